"""Linear: y = x @ weight + bias, with NumPy's BLAS."""
from __future__ import annotations

import numpy as np

from .. import kernels
from ._buffers import add_into, as_batch
from .init import kaiming_uniform
from .module import Module
from .parameter import Parameter

__all__ = ["Linear"]


class Linear(Module):
    """Linear(in_features, out_features, bias=True, *, init=None, rng=None)

    y = x @ weight + bias, x: (batch, in_features) -> y: (batch, out_features).
    weight: Parameter (in_features, out_features) (the transpose of torch's
    layout, which makes both BLAS calls of a training step faster), bias:
    Parameter (out_features,).
    init(weight, bias, rng) fills the float32 arrays in place (bias None without
    one); default kaiming_uniform (torch's default).  rng: None, an int seed or a
    numpy Generator; a fixed seed makes the initialisation reproducible.
    """

    def __init__(self, in_features, out_features, bias=True, *, init=None, rng=None):
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name}: expected >= 1, got {v}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        w = np.zeros((self.in_features, self.out_features), dtype=np.float32)
        b = np.zeros(self.out_features, dtype=np.float32) if bias else None
        (init or kaiming_uniform)(w, b, gen)
        self.weight = Parameter(w, name="weight")
        self.bias = Parameter(b, name="bias") if bias else None
        self._batch = -1
        self._x = None
        self._scratch = {}

    def _buffers(self, batch):
        self._out = np.empty((batch, self.out_features), dtype=np.float32)
        self._grad_in = np.empty((batch, self.in_features), dtype=np.float32)
        self._ones = np.ones(batch, dtype=np.float32)  # bias gradient as one gemv
        self._batch = batch

    def forward(self, x):
        """x: (batch, in_features) -> (batch, out_features) float32 (a buffer this
        layer reuses: the next forward overwrites it); ``layer(x)`` returns a copy
        the caller owns."""
        x = as_batch(x, self.in_features, "x")
        if x.shape[0] != self._batch:
            self._buffers(x.shape[0])
        out = self._out
        np.matmul(x, self.weight.data, out=out)
        if self.bias is not None:
            kernels.add_bias_rows(out, self.bias.data)
        self._x = x
        return out

    def backward(self, grad_out):
        """grad_out: (batch, out_features) float32.  Adds into weight.grad and
        bias.grad; returns d loss / d x (batch, in_features), or None when
        needs_input_grad is False."""
        if self._x is None:
            raise RuntimeError("backward: call forward first")
        g = as_batch(grad_out, self.out_features, "grad_out")
        if g.shape[0] != self._batch:
            raise ValueError(f"grad_out: expected {self._batch} rows like the last forward "
                             f"input, got {g.shape[0]}")
        x = self._x
        add_into(self.weight, lambda out: np.matmul(x.T, g, out=out), self, "weight")
        if self.bias is not None:
            ones = self._ones
            add_into(self.bias, lambda out: np.matmul(ones, g, out=out), self, "bias")
        if not self.needs_input_grad:
            return None
        np.matmul(g, self.weight.data.T, out=self._grad_in)
        return self._grad_in

    def __repr__(self):
        return (f"Linear(in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None})")
