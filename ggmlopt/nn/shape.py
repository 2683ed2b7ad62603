"""Reshape and Flatten: change the shape of each datapoint, keep the batch dimension.

The engine's datapoints are flat vectors of ne_datapoint floats; an image model
takes (batch, 784) and reshapes it to (batch, 1, 28, 28) itself with
``Reshape((1, 28, 28))``, and ``Flatten()`` turns (batch, C, H, W) back into
(batch, C*H*W) before a Linear layer.  Neither copies a C-contiguous input.
"""
from __future__ import annotations

import math
import numbers

from ._buffers import as_real_batch
from .module import Module

__all__ = ["Flatten", "Reshape"]


def _int(v, name):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    return int(v)


class _ShapeLayer(Module):
    """forward: x reshaped to self._target(x.shape); backward: the gradient
    reshaped back to the last input's shape."""

    _in_shape = None
    _out_shape = None

    def _target(self, shape):
        raise NotImplementedError

    def forward(self, x):
        """x: (batch, ...) float32 -> a view of x with the new shape (a copy only when
        x is not C-contiguous or not float32).  ``layer(x)`` returns a copy the
        caller owns."""
        x = as_real_batch(x, "x")
        out_shape = self._target(x.shape)
        self._in_shape, self._out_shape = x.shape, out_shape
        return x.reshape(out_shape)

    def backward(self, grad_out):
        """grad_out: the shape of the last forward's output -> a view of it with the
        last forward input's shape, or None when needs_input_grad is False."""
        if self._in_shape is None:
            raise RuntimeError("backward: call forward first")
        if not self.needs_input_grad:
            return None
        g = as_real_batch(grad_out, "grad_out")
        if g.shape != self._out_shape:
            raise ValueError(f"grad_out: expected shape {self._out_shape} like the last "
                             f"forward output, got {g.shape}")
        return g.reshape(self._in_shape)


class Reshape(_ShapeLayer):
    """Reshape(shape): (batch, *in) -> (batch, *shape), as Keras' Reshape: shape
    excludes the batch dimension, and one entry may be -1 (inferred from the
    datapoint's size).  ``Reshape((1, 28, 28))`` makes flat MNIST datapoints
    (batch, 784) NCHW images.  The number of elements per datapoint must match
    (ValueError otherwise); backward reshapes the gradient back."""

    def __init__(self, shape):
        if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)):
            raise TypeError(f"shape: expected a tuple of ints, got {type(shape).__name__}")
        shape = tuple(_int(v, f"shape[{i}]") for i, v in enumerate(shape))
        if not shape:
            raise ValueError("shape: expected at least one dimension (the batch is kept "
                             "and not part of shape)")
        if any(v < 1 and v != -1 for v in shape) or shape.count(-1) > 1:
            raise ValueError(f"shape: expected sizes >= 1 and at most one -1, got {shape}")
        self.shape = shape

    def _target(self, in_shape):
        n = math.prod(in_shape[1:])
        known = math.prod(v for v in self.shape if v != -1)
        if -1 in self.shape:
            if n % known != 0:
                raise ValueError(f"x: datapoints of shape {in_shape[1:]} ({n} elements) "
                                 f"cannot be reshaped to {self.shape}")
            target = tuple(n // known if v == -1 else v for v in self.shape)
        else:
            if n != known:
                raise ValueError(f"x: datapoints of shape {in_shape[1:]} ({n} elements) "
                                 f"cannot be reshaped to {self.shape} ({known} elements)")
            target = self.shape
        return (in_shape[0], *target)

    def __repr__(self):
        return f"Reshape({self.shape})"


class Flatten(_ShapeLayer):
    """Flatten(start_dim=1, end_dim=-1): dimensions start_dim..end_dim merged into
    one, as torch's nn.Flatten: (batch, C, H, W) -> (batch, C*H*W) by default.
    The batch dimension is kept (start_dim >= 1).  Element order is C order, so
    after NCHW images a following Linear sees channel by channel (ggml's mnist-cnn
    flattens height, width, channel: the same model up to a permutation of the
    dense weight's rows).  backward reshapes the gradient back."""

    def __init__(self, start_dim=1, end_dim=-1):
        self.start_dim = _int(start_dim, "start_dim")
        self.end_dim = _int(end_dim, "end_dim")
        if self.start_dim < 1:
            raise ValueError(f"start_dim: expected >= 1 (the batch dimension 0 is kept), got "
                             f"{self.start_dim}")
        if self.end_dim == 0 or (self.end_dim > 0 and self.end_dim < self.start_dim):
            raise ValueError(f"end_dim: expected -1, or a dimension >= start_dim="
                             f"{self.start_dim}, got {self.end_dim}")

    def _target(self, in_shape):
        ndim = len(in_shape)
        end = self.end_dim + ndim if self.end_dim < 0 else self.end_dim
        if not self.start_dim <= end < ndim:
            raise ValueError(f"x: cannot flatten dimensions {self.start_dim}..{self.end_dim} "
                             f"of shape {in_shape}")
        merged = math.prod(in_shape[self.start_dim:end + 1])
        return (*in_shape[:self.start_dim], merged, *in_shape[end + 1:])

    def __repr__(self):
        return f"Flatten(start_dim={self.start_dim}, end_dim={self.end_dim})"
