"""Input checks the language-model layers share."""
from __future__ import annotations

import numpy as np


def check_size(v, name: str) -> int:
    """v as a positive int; TypeError for a non-int (bool included), ValueError below 1."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"{name}: expected >= 1, got {v}")
    return int(v)


def check_eps(eps, name: str = "eps") -> float:
    """eps as a finite float >= 0."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a real number, got {type(eps).__name__}")
    e = float(eps)
    if not (0.0 <= e < float(np.finfo(np.float32).max)):
        raise ValueError(f"{name}: expected a finite number >= 0, got {eps}")
    return e


def as_rows(x, dim: int, name: str) -> np.ndarray:
    """x as float32 (..., dim) C-contiguous; copies only when the dtype or the
    layout differs."""
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.dtype.kind not in "biuf":
        raise TypeError(f"{name}: expected real numbers, got dtype {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != dim:
        raise ValueError(f"{name}: expected shape (..., {dim}), got {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


def trains(param) -> bool:
    """Whether param gets a gradient (a frozen one has requires_grad False)."""
    return param is not None and getattr(param, "requires_grad", True)
