"""Qwen3: Hugging Face's Qwen3ForCausalLM as its delta from Llama.

transformers' ``modular_qwen3.py`` makes Qwen3 a Llama whose attention
normalises each head of q and of k with an RMSNorm over head_dim (``q_norm``,
``k_norm``) before the rotary embedding, with an explicit ``head_dim`` (so the
query width n_heads * head_dim may differ from the hidden size: Qwen3-0.6B has
hidden 1024, 16 heads of 128) and no biases.  Sliding-window attention
(``use_sliding_window``), off in every released Qwen3 config, is refused by the
checkpoint reader.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from ._hf_config import check_keys, llama_fields, llama_hf_config, no_sliding_window
from .config import LlamaConfig
from .family import Family
from .llama import Llama
from .qwen2 import HF_KEYS as QWEN2_HF_KEYS

__all__ = ["FAMILY", "Qwen3", "Qwen3Config"]


@dataclasses.dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """Qwen3Config(vocab_size, dim, n_layers, n_heads, n_kv_heads=None, ffn_dim=None,
    max_seq_len=32768, norm_eps=1e-6, rope_base=1000000.0, tie_embeddings=False,
    rope_scaling=None, qkv_bias=False, head_dim=None): LlamaConfig's fields with
    Qwen3's defaults (Hugging Face's Qwen3Config) and ``head_dim`` (HF's head_dim;
    None: dim // n_heads), which must be even; qkv_bias must stay False."""

    max_seq_len: int = 32768
    norm_eps: float = 1e-6
    rope_base: float = 1000000.0
    head_dim: int | None = None  # type: ignore[assignment]  # a field here, not the property
    explicit_head_dim: ClassVar[bool] = True
    llama_cpp_permutes_qk: ClassVar[bool] = False   # llama.cpp's qwen3 rotates NeoX's halves

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.qkv_bias:
            raise ValueError("qkv_bias: a Qwen3 has no biases on its projections")

    @property
    def qk_norm(self) -> bool:
        """Each attention head normalises its q and k: True for every Qwen3."""
        return True


class Qwen3(Llama):
    """Qwen3(config, *, seed=0): a Qwen3 language model (config a Qwen3Config).

    Llama's parameters and names plus ``layers.{i}.self_attn.q_norm.weight`` and
    ``layers.{i}.self_attn.k_norm.weight`` (head_dim,), as Hugging Face's
    Qwen3ForCausalLM names them (without ``model.``); q_proj is (dim, n_heads *
    head_dim) and o_proj (n_heads * head_dim, dim)."""

    def __init__(self, config: Qwen3Config, *, seed: int = 0):
        if not isinstance(config, Qwen3Config):
            raise TypeError(f"config: expected a Qwen3Config, got {type(config).__name__}")
        super().__init__(config, seed=seed)

    def __repr__(self):
        return f"Qwen3({self.config})"


# ---- the family: its Hugging Face config and llama.cpp's qwen3 architecture ----------

# Qwen3's config.json: Qwen2's keys, where attention_bias (read by transformers'
# Qwen3) must be False; mlp_bias it never reads
_HF_KEYS = QWEN2_HF_KEYS


def _from_hf(hf: Mapping[str, Any], where: str) -> Qwen3Config:
    check_keys(hf, _HF_KEYS, "qwen3")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias: a Qwen3 with biases is not supported")
    no_sliding_window(hf)
    fields = llama_fields(hf, where, head_dim_given=True, max_len=32768, kv_heads=32)
    return Qwen3Config(**fields, head_dim=hf.get("head_dim", 128))   # HF's default


def _to_hf(cfg: Qwen3Config) -> dict[str, Any]:
    return {**llama_hf_config(cfg), "head_dim": cfg.head_dim, "attention_bias": False,
            "use_sliding_window": False}


FAMILY = Family("qwen3", Qwen3, Qwen3Config, hf_model_type="qwen3",
                hf_architecture="Qwen3ForCausalLM", from_hf=_from_hf, to_hf=_to_hf,
                gguf_arch="qwen3")
