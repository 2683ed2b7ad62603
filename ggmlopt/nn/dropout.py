"""Dropout: inverted dropout, active only in evals that train."""
from __future__ import annotations

import numbers

import numpy as np

from ._buffers import as_real_batch, empty
from .module import Module

__all__ = ["Dropout"]


class Dropout(Module):
    """Dropout(p=0.5, *, rng=None)

    While ``training`` (an OptContext sets it on every alloc: True in evals that
    train), each element of x is zeroed with probability p and the kept ones are
    multiplied by 1 / (1 - p), so the expected output is x (inverted dropout, as
    torch's nn.Dropout); backward passes the gradient through the same mask and
    scale.  Not training it is the identity.  p = 0 is the identity too and draws
    nothing.

    x: float32 of any shape (batch, ...) -> the same shape.
    p: a float in [0, 1); anything else is a ValueError.

    Randomness: an OptContext gives the layer its own seeded ``rng`` on every alloc
    (``set_rng``), so the masks are part of the context's stream and a checkpoint
    restores them: a run resumed with ``OptContext.load`` or ``fit(resume=True)``
    draws the masks of an uninterrupted run.  Each training forward draws
    ``x.size`` float32 uniforms (``rng.random(dtype=np.float32)``) and keeps the
    elements whose draw is >= p.  rng (None, an int seed or a numpy Generator) is
    only used outside a context, until one calls set_rng.
    """

    def __init__(self, p=0.5, *, rng=None):
        if isinstance(p, bool) or not isinstance(p, numbers.Real):
            raise TypeError(f"p: expected a float in [0, 1), got {type(p).__name__}")
        if not 0.0 <= float(p) < 1.0:  # NaN fails too
            raise ValueError(f"p: expected a drop probability in [0, 1), got {p}")
        self.p = float(p)
        self._rng = None
        self.set_rng(rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng))
        self._shape = None
        self._active = False   # whether the last forward applied a mask
        self._mask = None      # float32: 0 where dropped, 1 / (1 - p) where kept

    @property
    def rng(self) -> np.random.Generator:
        """The generator the masks are drawn from (the context's once one ran)."""
        return self._rng

    def set_rng(self, rng) -> None:
        """Draw the masks from rng (a numpy Generator) from now on; OptContext calls
        it with its own rng on every alloc."""
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"rng: expected a numpy.random.Generator, got {type(rng).__name__}")
        self._rng = rng

    def forward(self, x):
        """x: (batch, ...) float32 -> the same shape.  Training (p > 0): a buffer this
        layer reuses (the next forward overwrites it); otherwise x itself (converted
        to C-contiguous float32 when it was not).  ``layer(x)`` returns a copy the
        caller owns."""
        x = np.ascontiguousarray(as_real_batch(x, "x"))
        self._shape = x.shape
        self._active = bool(self.training) and self.p > 0.0
        if not self._active:
            return x
        if self._mask is None or self._mask.shape != x.shape:
            self._mask = empty(x.shape, dtype=np.float32)
            self._keep = empty(x.shape, dtype=bool)
            self._out = empty(x.shape, dtype=np.float32)
            self._grad_in = empty(x.shape, dtype=np.float32)
        mask = self._mask
        self._rng.random(out=mask, dtype=np.float32)
        np.greater_equal(mask, np.float32(self.p), out=self._keep)
        np.multiply(self._keep, np.float32(1.0 / (1.0 - self.p)), out=mask)
        return np.multiply(x, mask, out=self._out)

    def backward(self, grad_out):
        """grad_out: the shape of the last forward's output.  Returns grad_out times
        the last forward's mask (a buffer this layer reuses), grad_out itself when
        that forward did not drop, or None when needs_input_grad is False."""
        if self._shape is None:
            raise RuntimeError("backward: call forward first")
        if not self.needs_input_grad:
            return None
        g = np.ascontiguousarray(as_real_batch(grad_out, "grad_out"))
        if g.shape != self._shape:
            raise ValueError(f"grad_out: expected shape {self._shape} like the last forward "
                             f"output, got {g.shape}")
        if not self._active:
            return g
        return np.multiply(g, self._mask, out=self._grad_in)

    def __repr__(self):
        return f"Dropout(p={self.p})"
