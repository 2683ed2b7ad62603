"""Linear: y = x @ weight + bias, with the BLAS of ggmlopt.gemm."""
from __future__ import annotations

import numpy as np

from .. import gemm, kernels
from ._bf16 import add_product_bf16, bf16_copy, bf16_weight
from ._buffers import add_into, add_product, as_rows, empty, output_array, rows2d, trains
from .init import initializing, kaiming_uniform
from .module import Module
from .parameter import Parameter

__all__ = ["Linear"]


class Linear(Module):
    """Linear(in_features, out_features, bias=True, *, init=None, rng=None)

    y = x @ weight + bias over the last axis: x (..., in_features) float32 ->
    y (..., out_features), any number of leading axes (a batch (B, in), tokens
    (B, T, in), or a single row (in,)).  The leading axes are flattened into the
    rows of one matrix product (a reshape, no copy for a C-contiguous float32
    input), so (B, T, in) costs the same BLAS calls as (B*T, in).
    weight: Parameter (in_features, out_features) (the transpose of torch's
    layout, which makes both BLAS calls of a training step faster), bias:
    Parameter (out_features,) or None with bias=False.  A frozen weight or bias
    (``requires_grad=False``) gets no gradient (its product is skipped); the
    input gradient is still returned.  Inside a ``precision="bf16"`` context
    the products take bf16 copies of the weight, the input and the output
    gradient (float32 sums, float32 weight and gradients).
    init(weight, bias, rng) fills the float32 arrays in place (bias None without
    one); default kaiming_uniform (torch's default).  rng: None, an int seed or a
    numpy Generator; a fixed seed makes the initialisation reproducible.
    """

    output_is_scratch = True  # backward reads the input, never the output
    # under precision="bf16": whether the last forward multiplied in bf16, and its
    # operands (input, weight, output gradient, and the adapter seam's)
    _bf16_pass = False
    _x16 = _w16 = _g16 = _px16 = _pg16 = None

    def __init__(self, in_features, out_features, bias=True, *, init=None, rng=None):
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name}: expected >= 1, got {v}")
        if init is not None and not callable(init):
            raise TypeError(f"init: expected a callable init(weight, bias, rng), got "
                            f"{type(init).__name__}")
        if isinstance(rng, bool) or (
                rng is not None and not isinstance(rng, (int, np.integer, np.random.Generator))):
            raise TypeError(f"rng: expected None, an int seed or a numpy Generator, got "
                            f"{type(rng).__name__}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        if not initializing():   # inside skip_init(): a loader fills the weights
            self.weight = Parameter.zeros((self.in_features, self.out_features), "weight")
            self.bias = Parameter.zeros(self.out_features, "bias") if bias else None
        else:
            gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
            # initialised in the Parameters' own arrays: no transient copy of a weight
            # (a model's build peaks at its weights' bytes, not plus its largest matrix)
            self.weight = Parameter.zeros((self.in_features, self.out_features), "weight")
            self.bias = Parameter.zeros(self.out_features, "bias") if bias else None
            (init or kaiming_uniform)(self.weight.data,
                                      self.bias.data if bias else None, gen)
        self._shape = None   # the last forward input's shape
        self._x = None
        self._scratch = {}

    def _buffers(self, shape):
        lead = shape[:-1]
        rows = int(np.prod(lead, dtype=np.int64))
        # the output buffer comes with the first forward that writes into it
        # (a caller that passes out= never makes the layer keep one)
        self._out = self._out2 = None
        self._out_shape = (*lead, self.out_features)
        self._ones = np.ones(rows, dtype=np.float32)  # bias gradient as one gemv
        self._shape = shape

    def forward(self, x, out=None):
        """x: (..., in_features) -> (..., out_features) float32 (a buffer this
        layer reuses: the next forward overwrites it); ``layer(x)`` returns a copy
        the caller owns.  out: None, or a float32 C-contiguous array of the
        output's shape to write into and return instead; the layer then keeps no
        output buffer (a caller that consumes the output at once, as the
        residual sums of a decoder block, holds no dead copy between steps)."""
        out2 = self._out2_for(x, out)
        self._bf16_pass = gemm.bf16_active()
        if self._bf16_pass:
            gemm.matmul_bf16(bf16_copy(self, "_x16", rows2d(self._x)),
                             bf16_weight(self, self.weight.data), out2)
        else:
            gemm.matmul(rows2d(self._x), self.weight.data, out2)
        if self.bias is not None:
            kernels.add_bias_rows(out2, self.bias.data)
        return self._out if out is None else out

    def infer(self, x):
        """x (..., in_features) -> x @ weight + bias as a new float32 array,
        keeping nothing for a backward pass and reusing no buffer (decoding with
        a model that is between its forward and backward passes leaves both
        alone)."""
        x, shape = self._input(x)
        x2 = rows2d(x)
        # the product forward takes (the same engine, so the same bits)
        y = gemm.matmul(x2, self.weight.data,
                        empty((x2.shape[0], self.out_features), np.float32))
        if self.bias is not None:
            y += self.bias.data
        return y.reshape(*shape[:-1], self.out_features)

    def product(self, x2, out2):
        """out2 (rows, out) = x2 (rows, in) @ weight: the seam an adapter computes
        its base through (QuantizedLinear has the same)."""
        self._bf16_pass = gemm.bf16_active()
        if self._bf16_pass:
            return gemm.matmul_bf16(bf16_copy(self, "_px16", x2),
                                    bf16_weight(self, self.weight.data), out2)
        return gemm.matmul(x2, self.weight.data, out2)

    def product_transposed(self, g, out):
        """out (rows, in) = g (rows, out) @ weight^T: the input gradient's product
        (in bf16 when the forward's product was)."""
        if self._bf16_pass and self._w16 is not None:
            return gemm.matmul_bf16(bf16_copy(self, "_pg16", g), self._w16.T, out)
        return gemm.matmul(g, self.weight.data.T, out)

    def _out2_for(self, x, out=None):
        """Check x (..., in_features) (a single row (in,) is one row), keep it for
        the backward pass (as float32 rows), size the buffers for it and return
        the 2-D view (rows, out_features) of out (checked), or of the layer's
        own output buffer when out is None."""
        x, shape = self._input(x)
        want = (*shape[:-1], self.out_features)
        if out is not None:
            out = output_array(out, want, (x, self.weight.data if self.weight is not None
                                           else None))
        if shape != self._shape:
            self._buffers(shape)
        self._x = x
        if out is not None:
            return out.reshape(-1, self.out_features)
        if self._out is None:
            self._out = empty(want, dtype=np.float32)
            # its 2-D view (the buffer is contiguous): the BLAS calls' operand
            self._out2 = self._out.reshape(-1, self.out_features)
        return self._out2

    def _input(self, x):
        """(x as float32 rows of at least 2 axes, the shape the caller gave):
        a single row (in_features,) becomes one row of a matrix."""
        one_row = np.ndim(x) == 1
        x = as_rows(np.reshape(x, (1, -1)) if one_row else x, self.in_features, "x")
        return x, (x.shape[1:] if one_row else x.shape)

    def backward(self, grad_out):
        """grad_out: float32 of the last forward output's shape (..., out_features).
        Adds into weight.grad and bias.grad (not into a frozen one's); returns
        d loss / d x (the last input's shape), or None when needs_input_grad is
        False."""
        g = self._grad_rows(grad_out)
        if self._bf16_pass and self._x16 is not None and self._w16 is not None:
            return self._backward_bf16(g)
        self._add_dense_grads(g)
        if not self.needs_input_grad:
            return None
        grad_in, grad_in2 = self._input_grad()
        gemm.matmul(g, self.weight.data.T, grad_in2)
        return grad_in

    def _input_grad(self):
        """(a new array of the last input's shape for d loss / d x, its 2-D
        (rows, in_features) view).  Made per backward call and not kept: a layer
        holds no backward buffer between steps, so a model's activation memory is
        what its forward passes keep (the allocator hands the same memory to the
        next layer's backward)."""
        grad_in = empty(self._shape, np.float32)
        return grad_in, grad_in.reshape(-1, self.in_features)

    def takes_bf16_gradient(self) -> bool:
        """Whether the last forward was a bf16 pass whose backward can take the
        output gradient as bf16 bits (backward_bf16): no bias, whose gradient
        sums the float32 one."""
        return bool(self._bf16_pass) and self._x16 is not None and self._w16 is not None \
            and self.bias is None

    def backward_bf16(self, g16):
        """backward of a bf16 pass (takes_bf16_gradient()) for the output
        gradient already rounded to bfloat16 bits (uint16 (rows, out_features)):
        what backward multiplies after rounding a float32 gradient."""
        if not self.takes_bf16_gradient():
            raise RuntimeError("backward_bf16: the last forward was not a bf16 pass of a "
                               "Linear without bias")
        if g16.dtype != np.uint16 or g16.shape != (self._x16.shape[0], self.out_features):
            raise ValueError(f"g16: expected uint16 of shape "
                             f"{(self._x16.shape[0], self.out_features)}, got {g16.dtype} "
                             f"{g16.shape}")
        return self._backward_bf16(None, g16)

    def _backward_bf16(self, g, g16=None):
        """backward with the forward's bf16 operands and g rounded to bf16 (or
        g16, g's bf16 bits, when given: then there is no bias)."""
        if g16 is None:
            g16 = bf16_copy(self, "_g16", g)
        add_product_bf16(self.weight, self._x16.T, g16)
        if trains(self.bias):
            ones = self._ones
            add_into(self.bias, lambda out: gemm.matmul(ones, g, out), self, "bias")
        if not self.needs_input_grad:
            return None
        grad_in, grad_in2 = self._input_grad()
        gemm.matmul_bf16(g16, self._w16.T, grad_in2)
        return grad_in

    def _grad_rows(self, grad_out):
        """grad_out checked against the last forward output, as float32 rows
        (rows, out_features)."""
        if self._x is None:
            raise RuntimeError("backward: call forward first")
        want = self._out_shape
        if not isinstance(grad_out, np.ndarray):
            grad_out = np.asarray(grad_out)
        if grad_out.ndim < 1 or grad_out.shape[-1] != self.out_features:
            raise ValueError(f"grad_out: expected shape (batch, {self.out_features}), got "
                             f"{grad_out.shape} (the last forward output's shape {want})")
        if grad_out.shape != want:
            raise ValueError(f"grad_out: expected shape {want} like the last forward output, "
                             f"got {grad_out.shape}")
        return as_rows(grad_out.reshape(-1, self.out_features), self.out_features, "grad_out")

    def _add_dense_grads(self, g):
        """Add x^T g into weight.grad and the column sums of g into bias.grad."""
        x = rows2d(self._x)
        if self.weight is not None:   # None: an adapter over a QuantizedLinear
                add_product(self.weight, x.T, g, self, "weight")
        if self.bias is not None:
            ones = self._ones
            add_into(self.bias, lambda out: gemm.matmul(ones, g, out), self, "bias")

    def __repr__(self):
        return (f"Linear(in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None})")
