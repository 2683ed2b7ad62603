"""The bf16 operands of a layer's products under ``precision="bf16"``: float32
arrays rounded to bfloat16 bits into buffers the layer keeps (a forward's
operands serve its backward)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from .. import gemm, kernels
from ._buffers import trains


def bf16_buffer(owner, key: str, shape: tuple[int, ...]) -> np.ndarray:
    """owner's uint16 buffer ``key`` of shape (made or resized as needed)."""
    buf = getattr(owner, key, None)
    if buf is None or buf.shape != shape:
        buf = np.empty(shape, dtype=np.uint16)
        setattr(owner, key, buf)
    return buf


def bf16_copy(owner, key: str, a: np.ndarray) -> np.ndarray:
    """a (float32) rounded to bfloat16 into owner's buffer ``key`` (made or
    resized as needed), returned as uint16 of a's shape."""
    buf = bf16_buffer(owner, key, a.shape)
    kernels.to_bfloat16(np.ascontiguousarray(a), out=buf)
    return buf


def bf16_weight(owner, w: np.ndarray) -> np.ndarray:
    """owner's weight w rounded to bfloat16 into its ``_w16`` buffer: once per
    product, or once in all while owner holds the weight fixed (weight_fixed)."""
    if getattr(owner, "_w16_fixed", False) and getattr(owner, "_w16_fresh", False):
        return owner._w16
    w16 = bf16_copy(owner, "_w16", w)
    owner._w16_fresh = getattr(owner, "_w16_fixed", False)
    return w16


@contextmanager
def weight_fixed(owner) -> Iterator[None]:
    """Within: owner's weight does not change (an output head called chunk by
    chunk in one pass), so its bf16 copy is made on the first product only."""
    owner._w16_fixed, owner._w16_fresh = True, False
    try:
        yield
    finally:
        owner._w16_fixed = owner._w16_fresh = False


def add_product_bf16(param, a16: np.ndarray, b16: np.ndarray) -> None:
    """param.grad (+)= a16 @ b16 (bf16 operands, float32 sums): written when the
    gradient is known to be zero, added otherwise; nothing for a frozen one."""
    if not trains(param):
        return
    gemm.matmul_bf16(a16, b16, param.grad, accumulate=not param.grad_is_zero)
    param.grad_is_zero = False
