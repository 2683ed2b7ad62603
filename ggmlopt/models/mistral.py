"""Mistral: Hugging Face's MistralForCausalLM as its delta from Llama.

transformers' ``modular_mistral.py`` makes Mistral a Llama (grouped-query
heads, no biases, an untied head) whose attention may look back over a
sliding window only (``sliding_window``: query i sees keys i - W + 1 .. i;
Mistral 7B v0.1 has 4096, v0.2 and later none) and whose config may give the
head width (``head_dim``: Mistral NeMo's 32 heads of 128 over a hidden size of
5120).  The window runs inside the fused attention kernel, forward and
backward, at O(T x W) work.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from .config import LlamaConfig
from .llama import Llama

__all__ = ["Mistral", "MistralConfig"]


@dataclasses.dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    """MistralConfig(vocab_size, dim, n_layers, n_heads, n_kv_heads=None,
    ffn_dim=None, max_seq_len=131072, norm_eps=1e-6, rope_base=10000.0,
    tie_embeddings=False, rope_scaling=None, qkv_bias=False, head_dim=None,
    sliding_window=None): LlamaConfig's fields with Mistral's defaults (Hugging
    Face's MistralConfig), head_dim (None: dim // n_heads; even) and
    sliding_window (None: every earlier key; else the keys of the last
    sliding_window positions)."""

    max_seq_len: int = 131072
    norm_eps: float = 1e-6
    head_dim: int | None = None  # type: ignore[assignment]  # a field here, not the property
    sliding_window: int | None = None
    explicit_head_dim: ClassVar[bool] = True

    def __post_init__(self) -> None:
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ValueError(f"sliding_window: expected None or an int >= 1, got {window!r}")
        super().__post_init__()
        if self.qkv_bias:
            raise ValueError("qkv_bias: a Mistral has no biases on its projections")

    def sliding_window_of(self, layer: int) -> int | None:
        """Every layer's window: the config's sliding_window."""
        return self.sliding_window


class Mistral(Llama):
    """Mistral(config, *, seed=0): a Mistral language model (config a
    MistralConfig): Llama's parameters and names (Hugging Face's
    MistralForCausalLM's without ``model.``), q_proj (dim, n_heads * head_dim),
    o_proj (n_heads * head_dim, dim), and attention over config.sliding_window
    keys when it is set (generation with the KV cache too)."""

    def __init__(self, config: MistralConfig, *, seed: int = 0):
        if not isinstance(config, MistralConfig):
            raise TypeError(f"config: expected a MistralConfig, got {type(config).__name__}")
        super().__init__(config, seed=seed)

    def __repr__(self):
        return f"Mistral({self.config})"
