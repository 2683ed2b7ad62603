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
from collections.abc import Mapping
from typing import Any, ClassVar

from ._hf_config import LLAMA_KEYS, check_keys, llama_fields, llama_hf_config
from .config import LlamaConfig
from .family import Family
from .llama import Llama

__all__ = ["FAMILY", "Mistral", "MistralConfig"]


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
            # (Phi3Config's check too)
            name = type(self).__name__.removesuffix("Config")
            raise ValueError(f"qkv_bias: a {name} has no biases on its projections")

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


# ---- the family: a Mistral is llama.cpp's llama when it has no active window ---------

# Mistral's config.json: Llama's keys without the biases and pretraining_tp, with its window
# attention_bias and mlp_bias: transformers' Mistral never reads them (no layer of
# its has a bias), so they change nothing; a file with biases is refused by its tensors
_HF_KEYS = (LLAMA_KEYS - {"pretraining_tp"}) | {"sliding_window"}


def _from_hf(hf: Mapping[str, Any], where: str) -> MistralConfig:
    check_keys(hf, _HF_KEYS, "mistral")
    fields = llama_fields(hf, where, head_dim_given=True, max_len=131072, kv_heads=8)
    # MistralConfig's default window is 4096: a config without the key has it
    window = hf.get("sliding_window", 4096)
    return MistralConfig(**fields, head_dim=hf.get("head_dim"), sliding_window=window)


def _to_hf(cfg: MistralConfig) -> dict[str, Any]:
    return {**llama_hf_config(cfg), "head_dim": cfg.head_dim,
            "sliding_window": cfg.sliding_window,
            "bos_token_id": None, "eos_token_id": None}   # not MistralConfig's 1 and 2


def _gguf_check(cfg: MistralConfig) -> None:
    if cfg.sliding_window is not None and cfg.sliding_window < cfg.max_seq_len:
        raise ValueError(f"model: llama.cpp's llama architecture (a Mistral's GGUF) has no "
                         f"sliding window; this Mistral attends over {cfg.sliding_window} "
                         f"keys of {cfg.max_seq_len} (save_hf keeps it)")


# llama.cpp runs a Mistral as its llama architecture: such a file reads back as a
# Llama, or as a Mistral when its heads are not dim // n_heads wide (key_length)
FAMILY = Family("mistral", Mistral, MistralConfig, hf_model_type="mistral",
                hf_architecture="MistralForCausalLM", from_hf=_from_hf, to_hf=_to_hf,
                gguf_arch="llama", gguf_check=_gguf_check)
