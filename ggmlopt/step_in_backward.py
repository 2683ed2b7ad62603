"""The optimizer step inside the backward pass (``optimizer_in_backward=True``).

With one physical batch per optimizer step, a parameter's step reads nothing but
its own weights, gradient and optimizer state and the step's hyper-parameters,
so it can run as soon as that gradient is final: when the gradient-ready hook
announces the module holding the parameter (``ggmlopt.nn.grads_ready``; the
language models announce each part of each block).  The gradient then goes back
to a pool and the next block's parameters borrow it, so a training step holds
the gradients of about one block at a time, plus those of the parameters the
hook cannot place (a tied embedding, which the head and the embedding both add
into), instead of a gradient for every parameter.  For a full fine-tune that is
a quarter of the floor of AdamW's memory (weights, gradients and two moments);
torchtune calls it ``optimizer_in_bwd``, LOMO is built on it.

The numbers are those of the step after the backward pass, bit for bit: the
same optimizer kernel over the same elements with the same hyper-parameters,
only earlier.  A parameter no module announces is stepped when the backward
pass has returned; one that received no gradient is stepped with zeros, as the
arena's zeroed gradient would be.

What it gives up (OptContext refuses the combinations): gradient accumulation
(opt_period > 1), clipping to a global norm (clip_grad_norm needs every
gradient before any step), training over many processes (comm), ``grad_acc``
(a gradient is gone once its step ran), and parameters that are not
``ggmlopt.nn.Parameter`` (their gradients cannot be lent).  An exception raised
inside the backward pass leaves the parameters announced before it stepped.
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ._buckets import FinalParameters
from .nn.module import on_grads_ready
from .nn.parameter import Parameter

__all__ = ["GradientPool", "StepInBackward"]


class GradientPool:
    """Zeroed float32 arrays lent as gradients, kept by size for the next
    borrower (of any shape with that many elements): the blocks of a model
    share sizes, and an untied head's gradient serves the token embedding after
    it, so the pool holds about one block's gradients whatever the depth."""

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}

    def lend(self, param: Parameter) -> np.ndarray:
        """A zeroed array of param's shape (Parameter.grad calls it on first use)."""
        free = self._free.get(param.size)
        flat = free.pop() if free else np.zeros(param.size, np.float32)
        return flat.reshape(param.shape)

    def give_back(self, grad: np.ndarray) -> None:
        """Zero grad (it was just read: it is in the cache) and keep it."""
        flat = grad.reshape(-1)   # a view of a lent array (a copy of a foreign one)
        flat.fill(0.0)
        self._free.setdefault(flat.size, []).append(flat)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays waiting to be lent."""
        return sum(g.nbytes for free in self._free.values() for g in free)


class _Lender:
    """What a parameter asks for a gradient: the pool while its context lives (a
    weak reference, so a model outliving its context does not keep the pool's
    memory), plain zeros after."""

    __slots__ = ("_pool",)

    def __init__(self, pool: GradientPool) -> None:
        self._pool = weakref.ref(pool)

    def __call__(self, param: Parameter) -> np.ndarray:
        pool = self._pool()
        return pool.lend(param) if pool is not None else np.zeros(param.shape, np.float32)


class StepInBackward:
    """StepInBackward(model, params, arena, optimizer): steps params (the
    context's trainable parameters, in arena order, each a Parameter) during
    the backward passes of the evals that step.  Their gradients become loans
    from a GradientPool: ``Parameter.grad`` is None between steps."""

    def __init__(self, model: Any, params: list[Parameter], arena: Any, optimizer: Any) -> None:
        self._model = model
        self._params = params
        self._optimizer = optimizer
        self.pool = GradientPool()
        self._final = FinalParameters(model, params)
        self._weights, self._state = [], []
        start = 0
        for p in params:
            n = p.data.size
            self._weights.append(arena.view("weights", start, (n,)))
            self._state.append({s: arena.view(s, start, (n,)) for s in arena.state_names})
            start += n
        lender = _Lender(self.pool)
        for p in params:
            p._set_storage(p.data, None, lender)
            p.grad_is_zero = True
        self._done = bytearray(len(params))
        self._hyper: tuple[np.float32, ...] = ()
        self._iteration = 0

    def backward(self, grad: np.ndarray | None, hyper: tuple[np.float32, ...],
                 iteration: int) -> None:
        """model.backward(grad), stepping each parameter (hyper, iteration: as
        Optimizer.step takes them) once its gradient is final."""
        self._done = bytearray(len(self._params))
        self._hyper, self._iteration = hyper, iteration
        with on_grads_ready(self._announced):
            self._model.backward(grad)
        self._step(range(len(self._params)))   # the ones no announcement placed

    def release(self) -> None:
        """Give back every gradient lent and not stepped (ctx.reset, and an
        alloc after a backward pass that raised): the next pass starts at zero."""
        for p in self._params:
            if p._grad is not None:
                self.pool.give_back(p._grad)
                p._grad = None
            p.grad_is_zero = True

    def _announced(self, module: object) -> None:
        self._step(self._final.after(module))

    def _step(self, indices) -> None:
        done, params, pool = self._done, self._params, self.pool
        for i in indices:
            if done[i]:
                continue
            done[i] = 1
            p = params[i]
            grad = p._grad if p._grad is not None else pool.lend(p)  # no gradient: zeros
            self._optimizer.step(self._weights[i], grad.reshape(-1), self._state[i],
                                 self._hyper, self._iteration)
            p._grad = None
            p.grad_is_zero = True
            pool.give_back(grad)
