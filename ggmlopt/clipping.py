"""Gradient clipping by global L2 norm (beyond ggml; torch's clip_grad_norm_ rule).

Before each optimizer step, an OptContext made with ``clip_grad_norm=max_norm``
measures the L2 norm of the gradient the step uses, over every parameter at once
(one sum-of-squares pass over the arena's gradient section, accumulated in
double), and when it is too large scales that gradient in place:

    norm = sqrt(sum over all parameter elements of g^2)
    g *= min(1, max_norm / (norm + 1e-6))

(torch's clamp: the scale is below 1 from norm > max_norm - 1e-6 on).

The step then runs on the clipped gradient, so ``ctx.grad_acc(param)`` shows the
clipped gradient afterwards, and ``ctx.grad_norm`` holds the norm measured
before clipping.
"""
from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .context import OptContext

__all__ = ["check_max_norm", "clip_grad_norm"]


def check_max_norm(value: object, name: str = "clip_grad_norm") -> float | None:
    """value as a float > 0 (inf allowed: measure the norm, never clip), or None.

    Raises TypeError for a non-number (bools included), ValueError for <= 0 or NaN.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a float > 0 or None, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value) or value <= 0.0:
        raise ValueError(f"{name}: expected a float > 0 (the largest gradient L2 norm "
                         f"allowed), got {value!r}")
    return value


def clip_grad_norm(ctx: OptContext, max_norm: float) -> float:
    """Clip ctx's gradients (summed over the physical batches of the logical
    batch so far) to global L2 norm max_norm, in place, now.

    ctx: an OptContext.  max_norm: float > 0.  Returns the norm before clipping
    (a NaN norm makes every element NaN, as torch's).  RuntimeError for a
    context that keeps no gradient (optimizer_in_backward, FORWARD).
    OptContext(clip_grad_norm=...) and fit(clip_grad_norm=...) do this before
    every optimizer step; call it yourself only to clip outside of a step.
    """
    checked = check_max_norm(max_norm, "max_norm")
    if checked is None:
        raise TypeError("max_norm: expected a float > 0, got None")
    arena = getattr(ctx, "arena", None)
    if arena is None or not callable(getattr(arena, "clip_grad_norm", None)):
        raise TypeError(f"ctx: expected an OptContext, got {type(ctx).__name__}")
    if not getattr(arena, "has_grads", True):
        raise RuntimeError("clip_grad_norm: this context keeps no summed gradient to clip "
                           "(built with optimizer_in_backward=True, which steps each "
                           "parameter as its gradient is made, or for FORWARD only)")
    return arena.clip_grad_norm(checked)
