"""Qwen2 / Qwen2.5: Hugging Face's Qwen2ForCausalLM as its delta from Llama.

transformers' ``modular_qwen2.py`` makes Qwen2 a Llama whose q, k and v
projections have biases (o has none); the rest (RMSNorm, SwiGLU, rotary
embeddings, grouped-query heads, a tied head on the small models) is Llama's.
Sliding-window attention (``use_sliding_window``), off in every released
Qwen2.5 config, is refused by the checkpoint reader.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from ._hf_config import LLAMA_KEYS, check_keys, llama_fields, llama_hf_config, no_sliding_window
from .config import LlamaConfig
from .family import Family
from .llama import Llama

__all__ = ["FAMILY", "Qwen2", "Qwen2Config"]


@dataclasses.dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    """Qwen2Config(vocab_size, dim, n_layers, n_heads, n_kv_heads=None, ffn_dim=None,
    max_seq_len=32768, norm_eps=1e-6, rope_base=1000000.0, tie_embeddings=False,
    rope_scaling=None, qkv_bias=True): LlamaConfig's fields with Qwen2's defaults
    (Hugging Face's Qwen2Config); qkv_bias must stay True."""

    max_seq_len: int = 32768
    norm_eps: float = 1e-6
    rope_base: float = 1000000.0
    qkv_bias: bool = True
    llama_cpp_permutes_qk: ClassVar[bool] = False   # llama.cpp's qwen2 rotates NeoX's halves

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.qkv_bias:
            raise ValueError("qkv_bias: a Qwen2 has biases on q, k and v (a Llama has none)")


class Qwen2(Llama):
    """Qwen2(config, *, seed=0): a Qwen2 language model (config a Qwen2Config).

    Llama's parameters and names plus ``layers.{i}.self_attn.{q,k,v}_proj.bias``,
    as Hugging Face's Qwen2ForCausalLM names them (without ``model.``)."""

    def __init__(self, config: Qwen2Config, *, seed: int = 0):
        if not isinstance(config, Qwen2Config):
            raise TypeError(f"config: expected a Qwen2Config, got {type(config).__name__}")
        super().__init__(config, seed=seed)


# ---- the family: its Hugging Face config and llama.cpp's qwen2 architecture ----------

# Qwen2's config.json: Llama's keys, plus its sliding window (refused when used) and
# the layer types it implies.  Its biases are fixed (q, k, v): transformers' Qwen2
# never reads attention_bias or mlp_bias, so whatever they say changes nothing
HF_KEYS = (LLAMA_KEYS - {"pretraining_tp"}) | {
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
}


def _from_hf(hf: Mapping[str, Any], where: str) -> Qwen2Config:
    # DeepSeek-R1-Distill-Qwen's files carry Qwen2-VL's use_mrope (false), which
    # transformers' Qwen2 never reads; a true one describes a multimodal RoPE
    check_keys(hf, HF_KEYS | {"use_mrope"}, "qwen2")
    if hf.get("use_mrope"):
        raise ValueError("use_mrope: multimodal rotary embeddings (Qwen2-VL's) are not "
                         "supported")
    no_sliding_window(hf)
    # transformers' Qwen2Config defaults where the file says nothing
    return Qwen2Config(**llama_fields(hf, where, max_len=32768, kv_heads=32))


def _to_hf(cfg: Qwen2Config) -> dict[str, Any]:
    return {**llama_hf_config(cfg), "use_sliding_window": False}


FAMILY = Family("qwen2", Qwen2, Qwen2Config, hf_model_type="qwen2",
                hf_architecture="Qwen2ForCausalLM", from_hf=_from_hf, to_hf=_to_hf,
                gguf_arch="qwen2")
