"""RMSNorm and LayerNorm over the last axis, one kernel pass each way."""
from __future__ import annotations

import numpy as np

from .. import kernels_norm
from ._buffers import empty
from ._lm_args import as_rows, check_eps, check_size, trains
from .module import Module
from .parameter import Parameter

__all__ = ["LayerNorm", "RMSNorm"]


class _RowNorm(Module):
    """What both norms share: buffers reused while the input shape stays the
    same, the forward input kept by reference for backward (as Linear keeps
    its input: it must not change in between), the grad_out checks."""

    def __init__(self, dim, eps):
        self.dim = check_size(dim, "dim")
        self.eps = check_eps(eps)
        self._shape = None
        self._x = None

    def _buffers(self, x):
        if x.shape != self._shape:
            nrows = x.size // self.dim
            self._out = empty(x.shape, dtype=np.float32)
            self._mean = empty(nrows, dtype=np.float32)
            self._rstd = empty(nrows, dtype=np.float32)
            self._work = empty(kernels_norm.norm_backward_workspace(nrows, self.dim),
                                  dtype=np.float32)
            self._shape = x.shape

    def _grad_out(self, grad_out):
        if self._x is None:
            raise RuntimeError("backward: call forward first")
        if not isinstance(grad_out, np.ndarray):
            grad_out = np.asarray(grad_out)
        if grad_out.dtype.kind not in "biuf":
            raise TypeError(f"grad_out: expected real numbers, got dtype {grad_out.dtype}")
        if grad_out.shape != self._shape:
            raise ValueError(f"grad_out: expected shape {self._shape} like the last forward "
                             f"output, got {grad_out.shape}")
        return np.ascontiguousarray(grad_out, dtype=np.float32)

    def _input_grad(self):
        """A new array for d loss / d x, made per backward call and not kept (a
        layer holds no backward buffer between steps)."""
        return empty(self._shape, np.float32) if self.needs_input_grad else None

    @staticmethod
    def _grad_of(param):
        """param.grad to add into (marked non-zero), or None when param is frozen."""
        if not trains(param):
            return None
        param.grad_is_zero = False
        return param.grad


class RMSNorm(_RowNorm):
    """RMSNorm(dim, eps=1e-6): y = x / sqrt(mean(x^2, -1) + eps) * weight over
    the last axis of x (..., dim) (torch.nn.RMSNorm with normalized_shape=dim,
    Llama's norm; torch's own default eps=None means float32's machine epsilon,
    pass it explicitly to match); weight: Parameter (dim,) of ones.  The mean
    of squares is summed in double.

    ``forward`` returns a buffer the layer reuses; ``module(x)`` a copy the
    caller owns.  ``backward`` adds into weight.grad (unless weight.requires_grad
    is False) and returns d loss / d x, or None when needs_input_grad is False.
    """

    def __init__(self, dim, eps=1e-6):
        super().__init__(dim, eps)
        self.weight = Parameter(np.ones(self.dim, dtype=np.float32), name="weight")

    def forward(self, x):
        """x: float32 (..., dim) (other real dtypes are converted) -> (..., dim)."""
        x = as_rows(x, self.dim, "x")
        self._buffers(x)
        kernels_norm.rmsnorm(x, self.weight.data, self.eps, out=self._out, rstd=self._rstd)
        self._x = x
        return self._out

    def backward(self, grad_out):
        """grad_out: (..., dim) like the last forward output -> d loss / d x."""
        g = self._grad_out(grad_out)
        return kernels_norm.rmsnorm_backward(
            self._x, self.weight.data, self._rstd, g, self._input_grad(),
            grad_weight=self._grad_of(self.weight), input_grad=self.needs_input_grad,
            workspace=self._work)

    def __repr__(self):
        return f"RMSNorm({self.dim}, eps={self.eps})"


class LayerNorm(_RowNorm):
    """LayerNorm(dim, eps=1e-5, bias=True): y = (x - mean) / sqrt(var + eps) *
    weight + bias over the last axis of x (..., dim), var the biased variance
    (torch.nn.LayerNorm with normalized_shape=dim, GPT-2's norm).  weight:
    Parameter (dim,) of ones; bias: Parameter (dim,) of zeros, or None.  Sums
    in double.

    ``forward`` returns a buffer the layer reuses; ``module(x)`` a copy the
    caller owns.  ``backward`` adds into weight.grad and bias.grad (those whose
    requires_grad is not False) and returns d loss / d x, or None when
    needs_input_grad is False.
    """

    def __init__(self, dim, eps=1e-5, bias=True):
        super().__init__(dim, eps)
        if not isinstance(bias, (bool, np.bool_)):
            raise TypeError(f"bias: expected a bool, got {type(bias).__name__}")
        self.weight = Parameter(np.ones(self.dim, dtype=np.float32), name="weight")
        self.bias = Parameter(np.zeros(self.dim, dtype=np.float32), name="bias") if bias else None

    def forward(self, x):
        """x: float32 (..., dim) (other real dtypes are converted) -> (..., dim)."""
        x = as_rows(x, self.dim, "x")
        self._buffers(x)
        kernels_norm.layernorm(x, self.weight.data,
                               self.bias.data if self.bias is not None else None, self.eps,
                               out=self._out, mean=self._mean, rstd=self._rstd)
        self._x = x
        return self._out

    def backward(self, grad_out):
        """grad_out: (..., dim) like the last forward output -> d loss / d x."""
        g = self._grad_out(grad_out)
        return kernels_norm.layernorm_backward(
            self._x, self.weight.data, self._mean, self._rstd, g, self._input_grad(),
            grad_weight=self._grad_of(self.weight),
            grad_bias=self._grad_of(self.bias) if self.bias is not None else None,
            input_grad=self.needs_input_grad, workspace=self._work)

    def __repr__(self):
        return f"LayerNorm({self.dim}, eps={self.eps}, bias={self.bias is not None})"
