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
    slope *= np.float32(1.0) + logits
    return np.multiply(logits, c, out=logits)


def soft_cap_backward(grad: np.ndarray, capped: np.ndarray, cap: float) -> np.ndarray:
    """grad (d loss / d capped logits, float32) turned in place into d loss /
    d logits, given the capped logits of the forward; returns grad."""
    t = np.divide(capped, np.float32(cap))
    grad *= np.float32(1.0) - t
    grad *= np.float32(1.0) + t
    return grad
