"""Residual: x + fn(x), the skip connection of every transformer block."""
from __future__ import annotations

import numpy as np

from ._buffers import as_real_batch, empty
from .module import Module, grads_ready

__all__ = ["Residual"]


class Residual(Module):
    """Residual(fn): y = x + fn(x).

    fn: a module whose output has its input's shape (any shape: (batch, n),
    tokens (B, T, D)...), float32.  The way to write any pre-norm block
    (llama's, GPT-2's)::

        block = Sequential(
            Residual(Sequential(RMSNorm(d), CausalSelfAttention(d, n_heads))),
            Residual(Sequential(RMSNorm(d), SwiGLU(d, hidden))),
        )

    Forward adds x into fn's output buffer in place when fn says it may be
    overwritten (``output_is_scratch``: true for Linear and for a Sequential
    ending in one; a layer that returns its output projection's buffer, as an
    attention or MLP block does, may declare it too): one pass over x and no
    copy of it.  Otherwise (fn's last layer reads its own output in backward, as
    ReLU, Sigmoid or Tanh do, returns a view of x, or says nothing) the sum goes
    into a buffer of this module's own: the same values, one buffer more.
    Backward returns grad + fn.backward(grad), added in place into fn's input
    gradient buffer (one pass over grad, no copy of it); the gradient of x
    reaches fn's parameters through fn.backward only.

    ``forward`` returns a buffer (fn's or this module's) that the next forward
    overwrites; ``residual(x)`` returns a copy the caller owns.  backward
    returns None when needs_input_grad is False (fn then computes no input
    gradient either).  Parameter names are fn's under ``fn.``.
    """

    output_is_scratch = True  # nothing here reads the output again

    def __init__(self, fn):
        for method in ("forward", "backward"):
            if not callable(getattr(fn, method, None)):
                raise TypeError(f"fn: {type(fn).__name__} has no {method}()")
        self.fn = fn
        self._own = None       # the sum's buffer when fn's output may not be overwritten
        self._own_grad = None  # the input gradient's buffer when fn's may not be either
        self._shape = None
        self.needs_input_grad = True  # fn's input gradient is half of this one's

    @property
    def needs_input_grad(self):
        """Whether backward returns the input gradient; fn computes its own input
        gradient exactly when this is set."""
        return self._needs_input_grad

    @needs_input_grad.setter
    def needs_input_grad(self, value):
        self._needs_input_grad = bool(value)
        if isinstance(self.fn, Module) or hasattr(self.fn, "needs_input_grad"):
            self.fn.needs_input_grad = self._needs_input_grad

    def forward(self, x):
        """x: float32 of any shape -> x + fn(x), the same shape (a reused buffer)."""
        x = as_real_batch(x, "x")
        y = self.fn.forward(x)
        if not isinstance(y, np.ndarray) or y.shape != x.shape or y.dtype != np.float32:
            got = (f"{y.dtype} {y.shape}" if isinstance(y, np.ndarray) else type(y).__name__)
            raise ValueError(f"fn: a residual branch must return float32 of its input's shape "
                             f"{x.shape}, got {got}")
        self._shape = x.shape
        if getattr(self.fn, "output_is_scratch", False) and not np.shares_memory(x, y):
            return np.add(y, x, out=y)
        if self._own is None or self._own.shape != x.shape:
            self._own = empty(x.shape, dtype=np.float32)
        return np.add(x, y, out=self._own)

    def backward(self, grad_out):
        """grad_out: the last forward output's shape -> grad_out + fn.backward(grad_out)
        (a reused buffer), or None when needs_input_grad is False."""
        if self._shape is None:
            raise RuntimeError("backward: call forward first")
        g = as_real_batch(grad_out, "grad_out")
        if g.shape != self._shape:
            raise ValueError(f"grad_out: expected shape {self._shape} like the last forward "
                             f"output, got {g.shape}")
        gx = self.fn.backward(g)
        grads_ready(self.fn)  # the branch's gradients are final (gradient-ready hook)
        if not self._needs_input_grad:
            return None
        if gx is None:
            raise RuntimeError(f"fn: {type(self.fn).__name__}.backward returned no input "
                               "gradient; a residual branch must compute it (needs_input_grad)")
        if isinstance(gx, np.ndarray) and gx.dtype == np.float32 and gx.shape == g.shape \
                and gx.flags.writeable and not np.shares_memory(gx, g):
            return np.add(gx, g, out=gx)
        if self._own_grad is None or self._own_grad.shape != g.shape:
            self._own_grad = empty(g.shape, dtype=np.float32)
        return np.add(g, gx, out=self._own_grad)

    def __repr__(self):
        inner = repr(self.fn).replace("\n", "\n  ")
        return f"Residual(\n  {inner}\n)"
