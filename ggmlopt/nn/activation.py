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
        """x: float32 of any shape -> the same shape, in a buffer this layer reuses
        (the next forward overwrites it); ``layer(x)`` returns a copy the caller
        owns."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape != self._shape:
            self._out = np.empty(x.shape, dtype=np.float32)
            self._grad_in = np.empty(x.shape, dtype=np.float32)
            self._shape = x.shape
        return kernels.relu(x, out=self._out)

    def backward(self, grad_out):
        """grad_out: the last forward output's shape -> d loss / d x (a buffer this
        layer reuses), or None when needs_input_grad is False."""
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
