"""MaxPool2d and AvgPool2d on NCHW float32 images, one C kernel pass each way."""
from __future__ import annotations

import numpy as np

from .. import kernels
from ._buffers import empty
from ._images import as_grad, as_images
from .module import Module

__all__ = ["AvgPool2d", "MaxPool2d"]


class _Pool2d(Module):
    def __init__(self, kernel_size, stride=None):
        self.kernel_size = kernels.pair(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else kernels.pair(stride, "stride")
        self._shape = None
        self._out_shape = None
        self._has_forward = False

    def _check_input(self, x):
        x = as_images(x, "x")
        kh, kw = self.kernel_size
        if x.shape[2] < kh or x.shape[3] < kw:
            raise ValueError(f"x: the input ({x.shape[2]}, {x.shape[3]}) is smaller than the "
                             f"window ({kh}, {kw})")
        return x

    def _output_shape(self, shape):
        (kh, kw), (sh, sw) = self.kernel_size, self.stride
        return (shape[0], shape[1], (shape[2] - kh) // sh + 1, (shape[3] - kw) // sw + 1)

    def __repr__(self):
        return f"{type(self).__name__}(kernel_size={self.kernel_size}, stride={self.stride})"


class MaxPool2d(_Pool2d):
    """MaxPool2d(kernel_size, stride=None)

    The maximum of each kh*kw window, windows every stride (default:
    kernel_size), no padding, torch's floor mode: a trailing remainder that does
    not fill a window is dropped.  x: (batch, channels, h, w) float32 ->
    (batch, channels, (h - kh)//sh + 1, (w - kw)//sw + 1).  kernel_size and
    stride: an int or a pair (height, width), >= 1.

    The gradient goes to the position of each window's maximum; when several
    positions hold the maximum, the first in row-major order (top row first,
    then leftmost) wins.  A NaN counts as the maximum, so it reaches the loss.
    Where windows overlap, a position chosen by several windows receives the
    sum of their gradients.

    ``forward`` returns a buffer the layer reuses (the next forward overwrites
    it); ``pool(x)`` returns a copy the caller owns.

    ``forward_relu(x)`` is ``forward(relu(x))`` in one pass (the two commute:
    the pool takes the maxima of x and clamps them at 0), and the ``backward``
    that follows it returns the gradient w.r.t. the ReLU's input; outputs and
    gradients are those of ReLU then MaxPool2d, ties, zeros and NaN included.
    A Sequential uses it for a ReLU followed by a MaxPool2d.
    """

    def __init__(self, kernel_size, stride=None):
        super().__init__(kernel_size, stride)
        self._relu = False  # the last forward was forward_relu

    def _prepare(self, shape):
        """The buffers for inputs of shape (batch, channels, h, w); ValueError
        when the window does not fit."""
        kh, kw = self.kernel_size
        if shape[2] < kh or shape[3] < kw:
            raise ValueError(f"x: the input ({shape[2]}, {shape[3]}) is smaller than the "
                             f"window ({kh}, {kw})")
        if shape != self._shape:
            out_shape = self._output_shape(shape)
            out = empty(out_shape, dtype=np.float32)
            idx = empty(out_shape, dtype=np.int32)
            grad_in = empty(shape, dtype=np.float32)
            self._out, self._idx, self._grad_in = out, idx, grad_in
            self._shape, self._out_shape = tuple(shape), out_shape

    def _pool(self, x, kernel):
        x = self._check_input(x)
        self._prepare(x.shape)
        kernel(x, self.kernel_size, self.stride, out=self._out, indices=self._idx)
        self._has_forward = True
        return self._out

    def forward(self, x):
        """x: (batch, channels, h, w) -> (batch, channels, oh, ow) float32 (a reused
        buffer)."""
        out = self._pool(x, kernels.maxpool2d)
        self._relu = False
        return out

    def forward_relu(self, x):
        """forward(relu(x)) in one pass, without the ReLU's full-size output:
        x (batch, channels, h, w) -> (batch, channels, oh, ow) float32 (a reused
        buffer).  The next backward returns d loss / d x through both."""
        out = self._pool(x, kernels.maxpool2d_relu)
        self._relu = True
        return out

    def backward(self, grad_out):
        """grad_out: (batch, channels, oh, ow) like the last forward output; returns
        d loss / d x (a reused buffer; after forward_relu, x is the ReLU's input),
        or None when needs_input_grad is False."""
        if not self._has_forward:
            raise RuntimeError("backward: call forward first")
        g = as_grad(grad_out, self._out_shape)
        if not self.needs_input_grad:
            return None
        if self._relu:
            return kernels.maxpool2d_relu_backward(g, self._idx, self._out, self._shape,
                                                   self.kernel_size, self.stride,
                                                   out=self._grad_in)
        return kernels.maxpool2d_backward(g, self._idx, self._shape, self.kernel_size,
                                          self.stride, out=self._grad_in)


class AvgPool2d(_Pool2d):
    """AvgPool2d(kernel_size, stride=None)

    The mean of each kh*kw window, windows every stride (default: kernel_size),
    no padding, torch's floor mode: a trailing remainder that does not fill a
    window is dropped.  x: (batch, channels, h, w) float32 ->
    (batch, channels, (h - kh)//sh + 1, (w - kw)//sw + 1).  kernel_size and
    stride: an int or a pair (height, width), >= 1.  The gradient spreads
    grad_out/(kh*kw) over each window.

    ``forward`` returns a buffer the layer reuses (the next forward overwrites
    it); ``pool(x)`` returns a copy the caller owns.
    """

    def forward(self, x):
        """x: (batch, channels, h, w) -> (batch, channels, oh, ow) float32 (a reused
        buffer)."""
        x = self._check_input(x)
        if x.shape != self._shape:
            out_shape = self._output_shape(x.shape)
            out = empty(out_shape, dtype=np.float32)
            grad_in = empty(x.shape, dtype=np.float32)
            self._out, self._grad_in = out, grad_in
            self._shape, self._out_shape = x.shape, out_shape
        kernels.avgpool2d(x, self.kernel_size, self.stride, out=self._out)
        self._has_forward = True
        return self._out

    def backward(self, grad_out):
        """grad_out: (batch, channels, oh, ow) like the last forward output; returns
        d loss / d x (a reused buffer), or None when needs_input_grad is False."""
        if not self._has_forward:
            raise RuntimeError("backward: call forward first")
        g = as_grad(grad_out, self._out_shape)
        if not self.needs_input_grad:
            return None
        return kernels.avgpool2d_backward(g, self._shape, self.kernel_size, self.stride,
                                          out=self._grad_in)
