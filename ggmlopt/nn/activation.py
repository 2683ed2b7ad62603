"""Activations: elementwise layers without parameters, each direction one kernel pass."""
from __future__ import annotations

import numpy as np

from .. import kernels
from ._buffers import empty
from .module import Module

__all__ = ["GELU", "LeakyReLU", "ReLU", "SiLU", "Sigmoid", "Tanh"]


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
            self._out = empty(x.shape, dtype=np.float32)
            self._grad_in = empty(x.shape, dtype=np.float32)
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


class _Elementwise(Module):
    """An activation without parameters: one kernel pass each way, into buffers
    reused while the input shape stays the same (any shape: (batch, n), NCHW...).

    ``forward`` returns the reused output buffer (the next forward overwrites
    it); ``module(x)`` returns a copy the caller owns.  ``backward`` returns the
    input gradient in another reused buffer, or None when needs_input_grad is
    False.  Subclasses name the kernels and whether backward reads the forward
    output (``_backward_from_output``) or the forward input, which is then kept
    by reference, as Linear keeps its input: it must not change in between.
    """

    _backward_from_output = False

    def __init__(self):
        self._shape = None
        self._out = None
        self._saved = None

    def _forward_kernel(self, x, out):
        raise NotImplementedError

    def _backward_kernel(self, saved, g, out):
        raise NotImplementedError

    def forward(self, x):
        """x: float32 array of any shape (other real dtypes are converted) ->
        an array of the same shape (a buffer this layer reuses)."""
        if not isinstance(x, np.ndarray):
            x = np.asarray(x)
        if x.dtype.kind not in "biuf":
            raise TypeError(f"x: expected real numbers, got dtype {x.dtype}")
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape != self._shape:
            self._out = empty(x.shape, dtype=np.float32)
            self._grad_in = empty(x.shape, dtype=np.float32)
            self._shape = x.shape
        self._forward_kernel(x, self._out)
        self._saved = self._out if self._backward_from_output else x
        return self._out

    def backward(self, grad_out):
        """grad_out: float32, the shape of the last forward's output ->
        d loss / d x of that shape (a buffer this layer reuses), or None when
        needs_input_grad is False."""
        if self._saved is None:
            raise RuntimeError("backward: call forward first")
        if not self.needs_input_grad:
            return None
        if not isinstance(grad_out, np.ndarray):
            grad_out = np.asarray(grad_out)
        if grad_out.dtype.kind not in "biuf":
            raise TypeError(f"grad_out: expected real numbers, got dtype {grad_out.dtype}")
        g = np.ascontiguousarray(grad_out, dtype=np.float32)
        if g.shape != self._shape:
            raise ValueError(f"grad_out: expected shape {self._shape} like the last forward "
                             f"output, got {g.shape}")
        return self._backward_kernel(self._saved, g, self._grad_in)


class Tanh(_Elementwise):
    """y = tanh(x) elementwise, within 1.5 ulp of float64 (torch.nn.Tanh).

    backward: g * (1 - y^2) from the forward output y.  ``forward`` returns a
    buffer the layer reuses; ``module(x)`` a copy the caller owns.
    """

    _backward_from_output = True

    def _forward_kernel(self, x, out):
        kernels.tanh(x, out=out)

    def _backward_kernel(self, y, g, out):
        return kernels.tanh_backward(y, g, out=out)

    def __repr__(self):
        return "Tanh()"


class Sigmoid(_Elementwise):
    """y = 1 / (1 + exp(-x)) elementwise, within 3 ulp of float64 over the whole
    range, tiny (subnormal) results included (torch.nn.Sigmoid).

    backward: g * y * (1 - y) from the forward output y.  ``forward`` returns a
    buffer the layer reuses; ``module(x)`` a copy the caller owns.
    """

    _backward_from_output = True

    def _forward_kernel(self, x, out):
        kernels.sigmoid(x, out=out)

    def _backward_kernel(self, y, g, out):
        return kernels.sigmoid_backward(y, g, out=out)

    def __repr__(self):
        return "Sigmoid()"


class SiLU(_Elementwise):
    """y = x * sigmoid(x) elementwise (torch.nn.SiLU, ggml_silu), within 3.5 ulp
    of float64; silu(-inf) = 0, the limit.

    backward: g * s * (1 + x(1 - s)), s = sigmoid(x), from the forward input x
    (ggml's silu_back), with 1 - s computed from exp(-|x|), not by subtraction.
    ``forward`` returns a buffer the layer reuses; ``module(x)`` a copy the
    caller owns.
    """

    def _forward_kernel(self, x, out):
        kernels.silu(x, out=out)

    def _backward_kernel(self, x, g, out):
        return kernels.silu_backward(x, g, out=out)

    def __repr__(self):
        return "SiLU()"


class GELU(_Elementwise):
    """GELU(approximate="none"|"tanh") elementwise, as torch.nn.GELU.

    "none": y = x * Phi(x) = x/2 * (1 + erf(x/sqrt 2)), ggml_gelu_erf.  We
    compute Phi from erfc (Phi = erfc(-x/sqrt 2)/2), so the negative tail keeps
    its digits where 1 + erf cancels (gelu(-7) = -9e-12, which ggml's and
    torch's formula in float32 round to 0 or less); within 6 ulp of float64.
    "tanh": y = x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), ggml_gelu
    (GELU_COEF_A = 0.044715), evaluated as x * sigmoid(2u) to avoid the same
    cancellation; within 2.2 ulp plus up to 2.7|2u| ulp from rounding 2u (33 ulp
    at most where |y| > 1e-8; only the far negative tail feels more).  ggml's CPU path evaluates the
    tanh form through a float16 lookup table for |x| < 10 (0 below -10, x above
    10): we do not reproduce that table, and match ggml's float32 formula to
    float rounding, not its table bit for bit (the table's float16 rounding of
    x and y is some 1e-3 relative).

    backward, from the forward input x: "none": g * (Phi(x) + x exp(-x^2/2) /
    sqrt(2 pi)); "tanh": g * (s + x s (1 - s) d(2u)/dx), s = sigmoid(2u), the
    exact derivative of the tanh form.  ``forward`` returns a buffer the layer
    reuses; ``module(x)`` a copy the caller owns.
    """

    def __init__(self, approximate="none"):
        if not isinstance(approximate, str):
            raise TypeError(f"approximate: expected 'none' or 'tanh', got "
                            f"{type(approximate).__name__}")
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")
        super().__init__()
        self.approximate = approximate

    def _forward_kernel(self, x, out):
        kernels.gelu(x, out=out, approximate=self.approximate)

    def _backward_kernel(self, x, g, out):
        return kernels.gelu_backward(x, g, out=out, approximate=self.approximate)

    def __repr__(self):
        return f"GELU(approximate={self.approximate!r})"


class LeakyReLU(_Elementwise):
    """LeakyReLU(negative_slope=0.01): y = x > 0 ? x : negative_slope * x
    elementwise (torch.nn.LeakyReLU; NaN stays NaN).  negative_slope: a finite
    real number.

    backward: g where x > 0, negative_slope * g elsewhere (x = 0 included, as
    torch), from the forward input x.  ``forward`` returns a buffer the layer
    reuses; ``module(x)`` a copy the caller owns.
    """

    def __init__(self, negative_slope=0.01):
        if isinstance(negative_slope, bool) or not isinstance(negative_slope,
                                                              (int, float, np.integer,
                                                               np.floating)):
            raise TypeError(f"negative_slope: expected a real number, got "
                            f"{type(negative_slope).__name__}")
        if not np.isfinite(negative_slope) or abs(float(negative_slope)) > 3.4028234e38:
            raise ValueError(f"negative_slope: expected a finite float32, got {negative_slope}")
        super().__init__()
        self.negative_slope = float(negative_slope)

    def _forward_kernel(self, x, out):
        kernels.leaky_relu(x, self.negative_slope, out=out)

    def _backward_kernel(self, x, g, out):
        return kernels.leaky_relu_backward(x, g, self.negative_slope, out=out)

    def __repr__(self):
        return f"LeakyReLU(negative_slope={self.negative_slope})"
