"""Activation checkpointing: keep a block's input, drop its activations, and
recompute its forward pass just before its backward pass.

The recomputation runs the same kernels on the same input in the same order,
and replays the random numbers its Dropout layers, and any layer keeping the
generator ``set_rng`` gave it, drew (their generators are put back to where
they stood before the block's first forward, then to where they stood after
it), so the gradients are bit-identical to a run without checkpointing.
Memory: one block's activations at a time, plus every block's input.
"""
from __future__ import annotations

import numpy as np

from .dropout import Dropout
from .module import Module, modules, with_followers

__all__ = ["Checkpoint", "checkpointed_backward", "checkpointed_forward", "release_buffers"]


def release_buffers(block) -> None:
    """Forget the forward and backward buffers of every module of block (their
    arrays go when nothing else holds them); the next forward makes new ones.
    Arrays a module keeps across passes are named in its ``_kept_arrays``.  An
    adapter's base layer (not a sub-module: its ``training_followers``) holds
    the adapter's own buffers, its bf16 copies among them: released too."""
    for m in with_followers(modules(block)):
        state = vars(m)
        kept = getattr(type(m), "_kept_arrays", ())
        for key, value in list(state.items()):
            if not key.startswith("_") or key in kept:
                continue
            # a tuple holding any array (a layer's saved tensors with their positions)
            if isinstance(value, np.ndarray) or (
                    isinstance(value, tuple) and any(isinstance(v, np.ndarray) for v in value)):
                state[key] = None
        # the markers the layers compare to rebuild their buffers
        if "_shape" in state:
            state["_shape"] = None
        if "_rows" in state:
            state["_rows"] = -1


def _generators(block):
    """The distinct generators the modules of block draw from: Dropout's, and
    those a user's layer keeps from ``set_rng`` (ggmlopt.nn.module's protocol for
    layers that draw random numbers).  TypeError for a layer with ``set_rng``
    that keeps no Generator in its attributes: its draws could not be replayed,
    and a recomputation drawing other numbers gives wrong gradients silently."""
    found = {}
    for m in _with_wrapped(block):
        if isinstance(m, Checkpoint):
            continue   # its set_rng forwards to the module it wraps, walked too
        if isinstance(m, Dropout):
            found[id(m.rng)] = m.rng
        elif callable(getattr(m, "set_rng", None)):
            gens = [v for v in getattr(m, "__dict__", {}).values()
                    if isinstance(v, np.random.Generator)]
            if not gens:
                raise TypeError(f"{type(m).__name__}: has set_rng() but keeps no "
                                "numpy.random.Generator attribute, so a checkpointed "
                                "recomputation cannot replay its random draws; keep the "
                                "generator set_rng receives as an attribute")
            for g in gens:
                found[id(g)] = g
    return list(found.values())


def _with_wrapped(block):
    """modules(block) and the modules the Checkpoint wrappers among them wrap
    (the walk of the tree reaches a wrapped module's children, not it), each once."""
    seen, stack = set(), [block]
    while stack:
        for m in modules(stack.pop()):
            if id(m) not in seen:
                seen.add(id(m))
                yield m
                if isinstance(m, Checkpoint):
                    stack.append(m.module)


class _Saved:
    """What a checkpointed block keeps between its forward and backward passes."""

    __slots__ = ("args", "states", "x")

    def __init__(self, x, args, states):
        self.x, self.args, self.states = x, args, states


def checkpointed_forward(block, x, *args):
    """block.forward(x, *args), keeping a copy of x and the Dropout generators'
    states, and then releasing block's buffers.  Returns (output, saved): the
    output stays valid (block no longer reuses it)."""
    gens = _generators(block)
    states = [g.bit_generator.state for g in gens]
    saved = _Saved(np.array(x, dtype=np.float32, copy=True), args, list(zip(gens, states)))
    out = block.forward(x, *args)
    release_buffers(block)
    return out, saved


def checkpointed_backward(block, saved, grad_out):
    """Recompute block's forward from saved (the same random draws), run its
    backward on grad_out and release its buffers; returns the input gradient."""
    after = [(g, g.bit_generator.state) for g, _ in saved.states]
    for g, state in saved.states:
        g.bit_generator.state = state
    try:
        block.forward(saved.x, *saved.args)
    finally:
        for g, state in after:
            g.bit_generator.state = state
    grad_in = block.backward(grad_out)
    release_buffers(block)   # grad_in stays valid: block no longer reuses it
    return grad_in


class Checkpoint(Module):
    """Checkpoint(module): module with activation checkpointing while training.

    forward(x) runs module.forward(x) and keeps only x (and the random state
    of module's random layers); backward(grad_out) recomputes the forward and
    then runs module.backward: the same gradients, bit for bit, for about one
    more forward pass of the time.  Outside training it is module itself.
    Parameters keep module's names (the wrapper adds no level).
    """

    # the walks of the tree see module's parameters and children as the wrapper's
    wraps_transparently = True

    def __init__(self, module):
        for method in ("forward", "backward"):
            if not callable(getattr(module, method, None)):
                raise TypeError(f"module: {type(module).__name__} has no {method}() method")
        self.module = module
        self._saved = None

    def named_children(self):
        """module's own children: the wrapper is invisible in parameter names."""
        children = getattr(self.module, "named_children", None)
        return children() if callable(children) else Module.named_children(self.module)

    def named_parameters(self, prefix: str = ""):
        return self.module.named_parameters(prefix) if hasattr(
            self.module, "named_parameters") else super().named_parameters(prefix)

    def parameters(self):
        return self.module.parameters()

    def set_rng(self, rng):
        """module.set_rng(rng) when it has one: the walk of the tree (set_rng,
        on every alloc) skips the wrapped module itself, which would otherwise
        keep drawing from a generator of its own (another run than without the
        wrapper, and one a checkpoint cannot restore)."""
        bind = getattr(self.module, "set_rng", None)
        if callable(bind):
            bind(rng)

    def forward(self, x):
        """module.forward(x): outside training the buffer module reuses; while
        training the same values, keeping only x (module no longer reuses that
        result).  ``layer(x)`` returns a copy the caller owns."""
        if hasattr(self.module, "__dict__"):
            self.module.training = self.training   # the walk of the tree skips it
            self.module.needs_input_grad = self.needs_input_grad
        if not self.training:
            self._saved = None
            return self.module.forward(x)
        out, self._saved = checkpointed_forward(self.module, x)
        return out

    def backward(self, grad_out):
        """Recompute, then module.backward(grad_out)."""
        if self._saved is None:
            return self.module.backward(grad_out)
        saved, self._saved = self._saved, None
        return checkpointed_backward(self.module, saved, grad_out)

    def __repr__(self):
        return f"Checkpoint({self.module!r})"
