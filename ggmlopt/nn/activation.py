"""Activations: elementwise layers without parameters, each direction one kernel pass."""
from __future__ import annotations

import numpy as np

from .. import kernels
from .module import Module

__all__ = ["ReLU"]


class ReLU(Module):
    """y = x > 0 ? x : 0 elementwise (NaN stays NaN, so it reaches the loss and
    stops training); the gradient is
    passed where y > 0 (0 at x == 0, as ggml's step function).  Both directions
    are single kernel passes."""

    def __init__(self):
        self._shape = None
        self._out = None

    def forward(self, x):
        """max(x, 0) of x (batch, n), as float32 in a buffer this layer reuses."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape != self._shape:
            self._out = np.empty(x.shape, dtype=np.float32)
            self._grad_in = np.empty(x.shape, dtype=np.float32)
            self._shape = x.shape
        return kernels.relu(x, out=self._out)

    def backward(self, grad_out):
        """grad_out (batch, n) where the last forward's output is > 0, else 0: the
        input gradient (float32, a reused buffer), or None when not needed."""
        if self._out is None:
            raise RuntimeError("backward: call forward first")
        if not self.needs_input_grad:
            return None
        g = np.ascontiguousarray(grad_out, dtype=np.float32)
        if g.shape != self._shape:
            raise ValueError(f"grad_out: expected shape {self._shape} like the last forward "
                             f"output, got {g.shape}")
        return kernels.relu_backward(self._out, g, out=self._grad_in)

    def __repr__(self):
        return "ReLU()"
