"""Gradient buckets: the arena's gradient section cut into pieces that are exchanged
over the ranks while the backward pass goes on (PyTorch DDP's buckets).

The buckets are cut from the end of the gradient section (its last parameters are
the last layers', whose gradients the backward pass finishes first): bucket 0 holds
the last ``bucket_elems`` floats, bucket 1 the ones before, and so on, so a
parameter may span or end several buckets.  A bucket may start once every
parameter overlapping it has its final gradient; buckets start strictly in their
order (the same on every rank, as MPI's collectives must be), so one that becomes
ready early waits for the ones before it.

Which parameters are final when a module is announced (``grads_ready(module)``,
see ggmlopt.nn.module): the trainable parameters held (as attributes, or in lists
or tuples of them) by module or a module below it.  A parameter held at more than
one place of the model's tree (a shared module, a parameter in two modules) or at
none that the walk sees is only final when the backward pass has returned.
"""
from __future__ import annotations

import math
from collections import Counter

from .nn.module import _children, _direct_parameters, modules

__all__ = ["DEFAULT_BUCKET_CAP_MB", "FinalParameters", "GradientBuckets", "check_bucket_cap_mb"]

DEFAULT_BUCKET_CAP_MB = 25.0  # PyTorch DDP's default bucket_cap_mb
_MIB = 1 << 20


def check_bucket_cap_mb(value):
    """bucket_cap_mb checked: a float > 0 (MiB, rounded down to whole float32s, at
    least one per bucket), or None (one exchange after the backward pass)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"bucket_cap_mb: expected a number of MiB (float > 0) or None, got "
                        f"{type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"bucket_cap_mb: expected a finite number of MiB > 0 (or None for "
                         f"one exchange after the backward pass), got {value!r}")
    return float(value)


def _holdings(model) -> Counter:
    """How many places of model's tree hold each parameter (by id): the tree is
    walked without merging repeated modules, so a module used twice counts twice."""
    counts: Counter = Counter()

    def walk(obj, path):
        if id(obj) in path:  # a cycle: its parameters were counted on the way down
            return
        if hasattr(obj, "__dict__"):
            for _, p in _direct_parameters(obj):
                counts[id(p)] += 1
        path.add(id(obj))
        for child in _children(obj):
            walk(child, path)
        path.discard(id(obj))

    walk(model, set())
    return counts


class FinalParameters:
    """FinalParameters(model, params): which of params (indices into the list)
    have their final gradients once a module of model is announced by the
    gradient-ready hook (see the module docstring: only parameters held at
    exactly one place of the tree; the others are final when the backward pass
    has returned).  Shared by the ranks' buckets and the optimizer step in the
    backward pass (ggmlopt.step_in_backward)."""

    def __init__(self, model, params) -> None:
        held = _holdings(model)
        self._index = {id(p): i for i, p in enumerate(params) if held.get(id(p)) == 1}
        self._after: dict[int, list[int]] = {}

    def after(self, module) -> list[int]:
        """Indices of the parameters whose gradients are final once module is
        announced (computed once per module)."""
        got = self._after.get(id(module))
        if got is None:
            found = {self._index[id(p)] for m in modules(module) if hasattr(m, "__dict__")
                     for _, p in _direct_parameters(m) if id(p) in self._index}
            got = self._after[id(module)] = sorted(found)
        return got


class GradientBuckets:
    """GradientBuckets(model, params, total, bucket_elems): the buckets of one
    context's gradient section and the state of one exchanging backward pass.

    params: the context's trainable parameters in arena order (their gradients
    lie one after the other from element 0); total: the floats exchanged (the
    gradient section, padded when sharded); bucket_elems: int >= 1 floats per
    bucket.  ``bounds[k]`` is bucket k's (start, end) in the section.
    """

    def __init__(self, model, params, total: int, bucket_elems: int) -> None:
        self.total = total
        self.size = bucket_elems
        nb = max(1, -(-total // bucket_elems))
        self.bounds = [(max(0, total - (k + 1) * bucket_elems), total - k * bucket_elems)
                       for k in range(nb)]
        self._final = FinalParameters(model, params)
        self._spans = []  # per parameter: the buckets it overlaps, (first, last + 1)
        pending = [0] * nb
        offset = 0
        for p in params:
            n = p.data.size
            if n == 0:
                self._spans.append((0, 0))
                continue
            first = (total - offset - n) // bucket_elems  # its last element's bucket
            last = (total - 1 - offset) // bucket_elems
            self._spans.append((first, last + 1))
            for k in range(first, last + 1):
                pending[k] += 1
            offset += n
        self._pending_at_start = pending
        self.reset()

    def reset(self):
        """Start a backward pass: no parameter final, no bucket started."""
        self._pending = list(self._pending_at_start)
        self._done = bytearray(len(self._spans))
        self.next = 0  # the next bucket to start

    def final_after(self, module):
        """Indices of the parameters whose gradients are final once module is
        announced (FinalParameters.after)."""
        return self._final.after(module)

    def announce(self, indices):
        """Parameters (indices) have their final gradients; returns the buckets
        that may start now, in order (their starting is the caller's)."""
        pending, done, spans = self._pending, self._done, self._spans
        for i in indices:
            if not done[i]:
                done[i] = 1
                lo, hi = spans[i]
                for k in range(lo, hi):
                    pending[k] -= 1
        start = self.next
        end = start
        while end < len(pending) and pending[end] == 0:
            end += 1
        self.next = end
        return range(start, end)

    def rest(self):
        """The buckets not started yet (the backward pass has returned)."""
        start, self.next = self.next, len(self.bounds)
        return range(start, self.next)
