"""Helpers the layers share: input checks and adding into a gradient."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .. import gemm

if TYPE_CHECKING:
    from .parameter import Parameter

def empty(shape, dtype=np.float32) -> np.ndarray:
    """np.empty(shape, dtype) starting on a 64-byte boundary.  NumPy's buffers
    start 16 bytes into a cache line, so every AVX-512 load of a kernel that
    walks one (attention, norms, SwiGLU) straddles two lines: a SmolLM2-shaped
    layer's attention backward takes 1.24 ms on such buffers, 1.05 on aligned
    ones.  A view into a slightly larger byte buffer."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"shape: negative dimension in {shape}")
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    # the address through the array interface: .ctypes builds an object per call,
    # 4 us of the 5.5 this took (a training step makes a few hundred buffers)
    skip = -raw.__array_interface__["data"][0] % 64
    return raw[skip:skip + nbytes].view(dtype).reshape(shape)


def as_batch(x, ncols: int, name: str) -> np.ndarray:
    """x as a 2-D float32 array (batch, ncols); copies only when dtype differs."""
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != ncols:
        raise ValueError(f"{name}: expected shape (batch, {ncols}), got {x.shape}")
    if x.dtype != np.float32:
        if x.dtype.kind not in "biuf":
            raise TypeError(f"{name}: expected real numbers, got dtype {x.dtype}")
        x = x.astype(np.float32)
    return x


def as_rows(x, ncols: int, name: str) -> np.ndarray:
    """x of shape (..., ncols) as float32 (copied only when the dtype differs or
    the array is not C-contiguous): the layers that act on the last axis (Linear)
    see a 2-D view (rows, ncols) of it through ``rows2d``."""
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.ndim < 2 or x.shape[-1] != ncols:
        raise ValueError(f"{name}: expected shape (batch, {ncols}), got {x.shape} (any "
                         f"leading axes: (..., {ncols}))")
    if x.dtype != np.float32:
        if x.dtype.kind not in "biuf":
            raise TypeError(f"{name}: expected real numbers, got dtype {x.dtype}")
        return np.ascontiguousarray(x, dtype=np.float32)
    return x if x.ndim == 2 else np.ascontiguousarray(x)


def rows2d(x: np.ndarray) -> np.ndarray:
    """x (..., n) as (rows, n): a view for a C-contiguous x (as_rows gives one)."""
    return x if x.ndim == 2 else x.reshape(-1, x.shape[-1])


def as_real_batch(x, name: str) -> np.ndarray:
    """x as float32 with a batch dimension (any shape after it); copies only when
    the dtype differs."""
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.dtype.kind not in "biuf":
        raise TypeError(f"{name}: expected real numbers, got dtype {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"{name}: expected an array with a batch dimension, got shape "
                         f"{x.shape}")
    return x if x.dtype == np.float32 else x.astype(np.float32)


def output_array(out, shape: tuple, inputs=()) -> np.ndarray:
    """out checked as a layer's ``out=`` argument: a writable C-contiguous float32
    ndarray of shape that shares no memory with inputs (the arrays the layer
    reads while writing out; None entries skipped)."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out: expected a numpy.ndarray, got {type(out).__name__}")
    if out.dtype != np.float32:
        raise TypeError(f"out: expected float32, got {out.dtype}")
    if out.shape != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)}, got {out.shape}")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("out: expected a writable C-contiguous array")
    if any(a is not None and np.may_share_memory(out, a) for a in inputs):
        raise ValueError("out: shares memory with an array the layer reads")
    return out


def trains(param: Parameter | None) -> bool:
    """Whether a layer computes param's gradient: it exists and is not frozen
    (``requires_grad`` False; parameters without the attribute train)."""
    return param is not None and getattr(param, "requires_grad", True)


def add_product(param: Parameter, a: np.ndarray, b: np.ndarray, scratch_owner, key) -> None:
    """param.grad += a @ b (written when the gradient is known to be zero): added
    by the BLAS in place where the engine can (gemm.accumulates_in_place), with
    no temporary the size of the gradient; else through add_into's scratch."""
    if not getattr(param, "requires_grad", True):
        return
    if param.grad_is_zero or not gemm.accumulates_in_place():
        add_into(param, lambda out: gemm.matmul(a, b, out), scratch_owner, key)
        return
    grad = param.grad
    assert grad is not None
    gemm.matmul(a, b, grad, accumulate=True)


def add_into(param: Parameter, compute, scratch_owner, key):
    """Put compute(out) into param.grad: written straight in when the gradient is
    known to be zero, else computed into a scratch buffer and added.  A frozen
    parameter (requires_grad False) has no gradient: compute is not called."""
    if not getattr(param, "requires_grad", True):
        return
    grad = param.grad
    assert grad is not None  # a trainable parameter's, made on first use
    if param.grad_is_zero:
        compute(grad)
        param.grad_is_zero = False
        return
    scratch = scratch_owner._scratch.get(key)
    if scratch is None or scratch.shape != grad.shape:
        scratch = np.empty(grad.shape, dtype=np.float32)
        scratch_owner._scratch[key] = scratch
    compute(scratch)
    np.add(grad, scratch, out=grad)
