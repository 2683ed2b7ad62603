"""ggml's two MNIST models as GGUF tensors: the names, ggml dimensions and data
layout that ggml's examples/mnist (mnist-common.cpp: mnist_model_init_from_file)
requires, and the conversion from and to a ggmlopt model's torch-layout arrays.

ggml's ``ne`` lists dimensions fastest-varying first: a tensor with ``ne =
(n0, n1, n2, n3)`` is the NumPy array of shape ``(n3, n2, n1, n0)``.

mnist-fc (784-500-10, ReLU), parameters in this order::

    fc1.weight  ne (784, 500)    torch (500, 784)      ggmlopt Linear (784, 500)
    fc1.bias    ne (500,)
    fc2.weight  ne (500, 10)     torch (10, 500)
    fc2.bias    ne (10,)

mnist-cnn (conv 3x3 1->8 pad 1, ReLU, maxpool 2, conv 3x3 8->16 pad 1, ReLU,
maxpool 2, dense 784->10), all float32 (mnist-eval asserts it)::

    conv1.kernel  ne (3, 3, 1, 8)     torch (8, 1, 3, 3)
    conv1.bias    ne (1, 1, 8, 1)     torch (8,)   (broadcast over the image)
    conv2.kernel  ne (3, 3, 8, 16)    torch (16, 8, 3, 3)
    conv2.bias    ne (1, 1, 16, 1)    torch (16,)
    dense.weight  ne (784, 10)        torch (10, 784)
    dense.bias    ne (10,)

ggml flattens the pooled (16, 7, 7) feature map in (row, column, channel) order
(mnist-common.cpp permutes it to channels-fastest before the dense layer, like
Keras' Flatten of NHWC), while a Flatten of NCHW, ours and torch's, gives
(channel, row, column) order: dense.weight's columns are permuted on save and
back on load.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

__all__ = ["MNIST_ARCHS", "GgmlTensor"]

_HW, _NCB, _NCLASSES, _NHIDDEN = 28, 8, 10, 500
_POOLED = (2 * _NCB, _HW // 4, _HW // 4)  # (channels, rows, columns) before the dense layer


def _identity(a: np.ndarray) -> np.ndarray:
    return a


def _dense_to_ggml(w: np.ndarray) -> np.ndarray:
    """(10, 784) with CHW columns -> (10, 784) with HWC columns."""
    c, h, w_ = _POOLED
    return w.reshape(-1, c, h, w_).transpose(0, 2, 3, 1).reshape(w.shape[0], -1)


def _dense_from_ggml(w: np.ndarray) -> np.ndarray:
    """(10, 784) with HWC columns -> (10, 784) with CHW columns."""
    c, h, w_ = _POOLED
    return w.reshape(-1, h, w_, c).transpose(0, 3, 1, 2).reshape(w.shape[0], -1)


class GgmlTensor(NamedTuple):
    """One tensor of a ggml model: its GGUF name, ggml's ne (fastest first), the
    torch-layout shape of the matching ggmlopt parameter, whether that parameter
    is a Linear weight, whether ggml's loader accepts float16 for it, and the
    conversions between torch's array and the array ggml stores (NumPy shape =
    ne reversed)."""

    name: str
    ne: tuple[int, ...]
    torch_shape: tuple[int, ...]
    linear_weight: bool
    allows_f16: bool
    to_ggml: Callable[[np.ndarray], np.ndarray] = _identity
    from_ggml: Callable[[np.ndarray], np.ndarray] = _identity

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        return self.ne[::-1]

    def ggml_array(self, torch_array: np.ndarray) -> np.ndarray:
        """torch's array as the C-contiguous array ggml stores, shape numpy_shape."""
        return np.ascontiguousarray(self.to_ggml(torch_array).reshape(self.numpy_shape))

    def torch_array(self, ggml_array: np.ndarray) -> np.ndarray:
        """The array ggml stores (any shape with ne's elements) in torch's layout."""
        return self.from_ggml(ggml_array.reshape(self.numpy_shape)).reshape(self.torch_shape)


_NDENSE = _POOLED[0] * _POOLED[1] * _POOLED[2]

MNIST_ARCHS: dict[str, tuple[GgmlTensor, ...]] = {
    # mnist-eval takes f16 weight matrices for mnist-fc (mul_mat converts), f32 biases
    "mnist-fc": (
        GgmlTensor("fc1.weight", (_HW * _HW, _NHIDDEN), (_NHIDDEN, _HW * _HW), True, True),
        GgmlTensor("fc1.bias", (_NHIDDEN,), (_NHIDDEN,), False, False),
        GgmlTensor("fc2.weight", (_NHIDDEN, _NCLASSES), (_NCLASSES, _NHIDDEN), True, True),
        GgmlTensor("fc2.bias", (_NCLASSES,), (_NCLASSES,), False, False),
    ),
    "mnist-cnn": (
        GgmlTensor("conv1.kernel", (3, 3, 1, _NCB), (_NCB, 1, 3, 3), False, False),
        GgmlTensor("conv1.bias", (1, 1, _NCB, 1), (_NCB,), False, False),
        GgmlTensor("conv2.kernel", (3, 3, _NCB, 2 * _NCB), (2 * _NCB, _NCB, 3, 3), False, False),
        GgmlTensor("conv2.bias", (1, 1, 2 * _NCB, 1), (2 * _NCB,), False, False),
        GgmlTensor("dense.weight", (_NDENSE, _NCLASSES), (_NCLASSES, _NDENSE), True, False,
                   _dense_to_ggml, _dense_from_ggml),
        GgmlTensor("dense.bias", (_NCLASSES,), (_NCLASSES,), False, False),
    ),
}
