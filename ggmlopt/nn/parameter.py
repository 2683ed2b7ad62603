"""Parameter: a trainable float32 array and its gradient."""
from __future__ import annotations

import numpy as np

__all__ = ["Parameter"]


class Parameter:
    """Parameter(data, name=None): a trainable float32 array.

    data: a float32 copy of the given array (any real dtype, any shape).
    grad: float32 zeros of the same shape; backward passes add into it.
    grad_is_zero: True while grad is known to hold zeros (OptContext sets it after
    zeroing the gradients); a layer that sees it may overwrite grad instead of
    adding into it, and then clears it.
    """

    __slots__ = ("data", "grad", "grad_is_zero", "name")

    def __init__(self, data, name=None):
        arr = np.asarray(data)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"data: expected real numbers, got dtype {arr.dtype}")
        self.data = np.array(arr, dtype=np.float32, order="C", copy=True)
        self.grad = np.zeros_like(self.data)
        self.name = name
        self.grad_is_zero = True

    @property
    def shape(self):
        """The shape of data."""
        return self.data.shape

    @property
    def size(self):
        """The number of elements of data."""
        return self.data.size

    def __repr__(self):
        label = f" {self.name!r}" if self.name else ""
        return f"Parameter{label}(shape={self.data.shape}, dtype={self.data.dtype})"
