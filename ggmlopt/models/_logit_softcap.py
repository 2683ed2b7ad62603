"""Gemma 2's soft cap on the final logits: z -> c * tanh(z / c), as
transformers' Gemma2ForCausalLM computes it (``final_logit_softcapping``: divide,
tanh, multiply), and its backward through the slope 1 - tanh^2."""
from __future__ import annotations

import numpy as np

__all__ = ["soft_cap", "soft_cap_backward", "soft_cap_with_slope"]


def soft_cap(logits: np.ndarray, cap: float) -> np.ndarray:
    """logits (float32) capped in place; returns logits."""
    c = np.float32(cap)
    np.divide(logits, c, out=logits)
    np.tanh(logits, out=logits)
    return np.multiply(logits, c, out=logits)


def soft_cap_with_slope(logits: np.ndarray, cap: float, slope: np.ndarray) -> np.ndarray:
    """soft_cap(logits, cap), writing d capped / d logits, (1 - t)(1 + t) with
    t = tanh(logits / cap), into slope (like logits): the factored form keeps
    the slope's small values exact where t is near 1."""
    c = np.float32(cap)
    np.divide(logits, c, out=logits)
    np.tanh(logits, out=logits)
    np.subtract(np.float32(1.0), logits, out=slope)
    # (1 + t) a block of rows at a time: a temporary of the chunk's size would be a
    # third chunk buffer (56 MiB) beside the logits and the slope
    for s in _row_blocks(logits):
        slope[s] *= np.float32(1.0) + logits[s]
    return np.multiply(logits, c, out=logits)


def soft_cap_backward(grad: np.ndarray, capped: np.ndarray, cap: float) -> np.ndarray:
    """grad (d loss / d capped logits, float32) turned in place into d loss /
    d logits, given the capped logits of the forward; returns grad."""
    # 2-D views of the rows (grad is the caller's own copy: contiguous)
    grad2, capped2 = grad.reshape(-1, grad.shape[-1]), capped.reshape(-1, capped.shape[-1])
    for s in _row_blocks(grad2):
        t = np.divide(capped2[s], np.float32(cap))
        grad2[s] *= np.float32(1.0) - t
        grad2[s] *= np.float32(1.0) + t
    return grad


def _row_blocks(a: np.ndarray, block_bytes: int = 1 << 20) -> list[slice]:
    """Slices of a's rows (its first axis) of about block_bytes each, for
    temporaries of a block's size rather than of the whole array."""
    row_bytes = a.itemsize * (a.size // a.shape[0]) if a.ndim and a.shape[0] else 1
    step = max(1, block_bytes // max(1, row_bytes))
    return [slice(i, i + step) for i in range(0, a.shape[0] if a.ndim else 0, step)]
