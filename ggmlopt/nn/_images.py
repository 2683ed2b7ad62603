"""Input checks shared by the image layers (convolution, pooling)."""
from __future__ import annotations

import numpy as np


def as_images(x, name: str, channels: int | None = None) -> np.ndarray:
    """x as a C-contiguous 4-D float32 array (batch, channels, height, width);
    copies only when the dtype or the layout differ.  channels: the channel count
    x must have, or None for any."""
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"{name}: expected a 4-D NCHW array (batch, channels, height, width), "
                         f"got shape {x.shape}")
    if channels is not None and x.shape[1] != channels:
        raise ValueError(f"{name}: expected {channels} channels (axis 1 of NCHW), got "
                         f"{x.shape[1]} in shape {x.shape}")
    if x.dtype.kind not in "biuf":
        raise TypeError(f"{name}: expected real numbers, got dtype {x.dtype}")
    return np.ascontiguousarray(x, dtype=np.float32)


def as_grad(grad_out, shape: tuple, name: str = "grad_out") -> np.ndarray:
    """grad_out as a C-contiguous float32 array of exactly shape (the last
    forward output's)."""
    if not isinstance(grad_out, np.ndarray):
        grad_out = np.asarray(grad_out)
    if grad_out.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} like the last forward output, "
                         f"got {grad_out.shape}")
    if grad_out.dtype.kind not in "biuf":
        raise TypeError(f"{name}: expected real numbers, got dtype {grad_out.dtype}")
    return np.ascontiguousarray(grad_out, dtype=np.float32)
