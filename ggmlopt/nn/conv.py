"""Conv2d: 2-D convolution on NCHW float32 images, im2col + NumPy's BLAS."""
from __future__ import annotations

import math

import numpy as np

from .. import kernels
from ._buffers import add_into
from ._images import as_grad, as_images
from .module import Module
from .parameter import Parameter

__all__ = ["Conv2d", "conv_kaiming_uniform"]


def conv_kaiming_uniform(weight: np.ndarray, bias, rng: np.random.Generator) -> None:
    """torch.nn.Conv2d's default: weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    fan_in = in_channels*kh*kw (weight is (out_channels, in_channels, kh, kw)).
    Fills the arrays in place."""
    fan_in = int(np.prod(weight.shape[1:]))
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    weight[...] = rng.uniform(-bound, bound, size=weight.shape)
    if bias is not None:
        bias[...] = rng.uniform(-bound, bound, size=bias.shape)


def _count(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected >= 1, got {value}")
    return int(value)


class Conv2d(Module):
    """Conv2d(in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True, *,
    init=None, rng=None)

    y[n, o] = bias[o] + sum over c, ky, kx of weight[o, c, ky, kx] *
    x[n, c, oy*sh - ph + ky, ox*sw - pw + kx] (zero outside the image): torch's
    Conv2d (a cross-correlation) on NCHW float32.
    x: (batch, in_channels, h, w) -> y: (batch, out_channels, oh, ow) with
    oh = (h + 2*ph - kh)//sh + 1, ow = (w + 2*pw - kw)//sw + 1.
    kernel_size, stride (>= 1) and padding (>= 0): an int or a pair (height, width).
    weight: Parameter (out_channels, in_channels, kh, kw), bias: Parameter
    (out_channels,) or None: torch's layout and names.
    init(weight, bias, rng) fills the float32 arrays in place (bias None without
    one); default conv_kaiming_uniform (torch's default).  rng: None, an int seed
    or a numpy Generator.

    The packing (im2col, col2im) runs in the C kernels on the library's threads,
    the products go to NumPy's BLAS, one per image.  ``forward`` returns a buffer
    the layer reuses (the next forward overwrites it); ``conv(x)`` returns a copy
    the caller owns.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True,
                 *, init=None, rng=None):
        self.in_channels = _count(in_channels, "in_channels")
        self.out_channels = _count(out_channels, "out_channels")
        self.kernel_size = kernels.pair(kernel_size, "kernel_size")
        self.stride = kernels.pair(stride, "stride")
        self.padding = kernels.pair(padding, "padding", 0)
        if init is not None and not callable(init):
            raise TypeError(f"init: expected a callable init(weight, bias, rng), got "
                            f"{type(init).__name__}")
        if rng is not None and not isinstance(rng, (int, np.integer, np.random.Generator)) \
                or isinstance(rng, bool):
            raise TypeError(f"rng: expected None, an int seed or a numpy Generator, got "
                            f"{type(rng).__name__}")
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        kh, kw = self.kernel_size
        w = np.zeros((self.out_channels, self.in_channels, kh, kw), dtype=np.float32)
        b = np.zeros(self.out_channels, dtype=np.float32) if bias else None
        (init or conv_kaiming_uniform)(w, b, gen)
        self.weight = Parameter(w, name="weight")
        self.bias = Parameter(b, name="bias") if bias else None
        self._shape = None
        self._out_shape = None
        self._has_forward = False
        self._scratch = {}

    def _buffers(self, shape):
        n, c, h, w = shape
        oh, ow = kernels.conv2d_output_size(h, w, self.kernel_size, self.stride, self.padding)
        rows = c * self.kernel_size[0] * self.kernel_size[1]
        # allocate everything before replacing anything: a MemoryError leaves the
        # layer as it was
        col = np.empty((n, rows, oh * ow), dtype=np.float32)
        out = np.empty((n, self.out_channels, oh, ow), dtype=np.float32)
        self._col, self._out = col, out
        self._dcol = None  # the backward buffers come with the first backward
        self._out_shape = out.shape
        self._shape = tuple(shape)

    def _backward_buffers(self):
        n = self._shape[0]
        p = self._out_shape[2] * self._out_shape[3]
        rows = self._col.shape[1]
        self._dcol = np.empty_like(self._col)
        self._grad_in = np.empty(self._shape, dtype=np.float32)
        self._dw_images = np.empty((n, self.out_channels, rows), dtype=np.float32)
        self._db_images = np.empty((n, self.out_channels), dtype=np.float32)
        self._ones_plane = np.ones(p, dtype=np.float32)
        self._ones_batch = np.ones(n, dtype=np.float32)

    def forward(self, x):
        """x: (batch, in_channels, h, w) -> (batch, out_channels, oh, ow) float32 (a
        buffer this layer reuses: the next forward overwrites it)."""
        x = as_images(x, "x", self.in_channels)
        if x.shape != self._shape:
            self._buffers(x.shape)
        n = x.shape[0]
        oc = self.out_channels
        kernels.im2col(x, self.kernel_size, self.stride, self.padding, out=self._col)
        out3 = self._out.reshape(n, oc, -1)
        np.matmul(self.weight.data.reshape(oc, -1), self._col, out=out3)
        if self.bias is not None:
            kernels.add_bias_planes(self._out, self.bias.data)
        self._has_forward = True
        return self._out

    def backward(self, grad_out):
        """grad_out: (batch, out_channels, oh, ow) like the last forward output.
        Adds into weight.grad and bias.grad; returns d loss / d x (batch,
        in_channels, h, w), a buffer this layer reuses, or None when
        needs_input_grad is False."""
        if not self._has_forward:
            raise RuntimeError("backward: call forward first")
        g = as_grad(grad_out, self._out_shape)
        if self._dcol is None:
            self._backward_buffers()
        n, oc = g.shape[0], self.out_channels
        g3 = g.reshape(n, oc, -1)
        col = self._col

        def weight_grad(out):
            # per image (oc, p) @ (p, rows), then the sum over images
            np.matmul(g3, col.transpose(0, 2, 1), out=self._dw_images)
            np.sum(self._dw_images, axis=0, out=out.reshape(oc, -1))

        add_into(self.weight, weight_grad, self, "weight")
        if self.bias is not None:
            def bias_grad(out):
                np.matmul(g3, self._ones_plane, out=self._db_images)
                np.matmul(self._ones_batch, self._db_images, out=out)

            add_into(self.bias, bias_grad, self, "bias")
        if not self.needs_input_grad:
            return None
        np.matmul(self.weight.data.reshape(oc, -1).T, g3, out=self._dcol)
        return kernels.col2im(self._dcol, self._shape, self.kernel_size, self.stride,
                              self.padding, out=self._grad_in)

    def __repr__(self):
        return (f"Conv2d({self.in_channels}, {self.out_channels}, "
                f"kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, bias={self.bias is not None})")
