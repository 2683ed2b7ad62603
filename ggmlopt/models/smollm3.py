"""SmolLM3: Hugging Face's SmolLM3ForCausalLM as its delta from Llama.

transformers' ``modular_smollm3.py`` makes SmolLM3 a Llama (Llama 3's grouped
heads, tied embeddings on the 3B) some of whose layers apply no rotary embedding
("NoPE"): ``no_rope_layers[i]`` is 1 where layer i rotates q and k, 0 where it
does not, by default 0 on every ``no_rope_layer_interval``-th layer (4: layers
3, 7, 11, ...).  llama.cpp's ``smollm3`` architecture hard-codes that default
interval of 4, so only that pattern goes to a GGUF.  Sliding windows
(``use_sliding_window``) are refused by the checkpoint reader.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ._hf_config import LLAMA_KEYS, check_keys, llama_fields, llama_hf_config, no_sliding_window
from .config import LlamaConfig
from .family import Family
from .llama import Llama

__all__ = ["FAMILY", "SmolLM3", "SmolLM3Config", "default_rope_layers"]


def default_rope_layers(n_layers: int, interval: int = 4) -> tuple[int, ...]:
    """Hugging Face's default no_rope_layers: 0 on every interval-th layer."""
    return tuple(int((i + 1) % interval != 0) for i in range(n_layers))


@dataclasses.dataclass(frozen=True)
class SmolLM3Config(LlamaConfig):
    """SmolLM3Config(vocab_size, dim, n_layers, n_heads, n_kv_heads=None,
    ffn_dim=None, max_seq_len=32768, norm_eps=1e-6, rope_base=2000000.0,
    tie_embeddings=True, rope_scaling=None, qkv_bias=False, no_rope_layers=None,
    no_rope_layer_interval=4): LlamaConfig's fields with SmolLM3's defaults
    (Hugging Face's SmolLM3Config) and its NoPE layers: no_rope_layers, one 0 or 1
    per layer (1: the layer applies RoPE; None: Hugging Face's default, 0 on
    every no_rope_layer_interval-th layer)."""

    max_seq_len: int = 32768
    norm_eps: float = 1e-6
    rope_base: float = 2000000.0
    tie_embeddings: bool = True
    no_rope_layers: tuple[int, ...] | None = None
    no_rope_layer_interval: int = 4

    def __post_init__(self) -> None:
        interval = self.no_rope_layer_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"no_rope_layer_interval: expected an int >= 1, got {interval!r}")
        layers = self.no_rope_layers
        if layers is None:
            if isinstance(self.n_layers, int) and not isinstance(self.n_layers, bool):
                object.__setattr__(self, "no_rope_layers",
                                   default_rope_layers(self.n_layers, interval))
        else:
            if isinstance(layers, (str, bytes)) or not all(
                    type(v) is int and v in (0, 1) for v in layers):
                raise ValueError(f"no_rope_layers: expected a 0 or 1 per layer, got {layers!r}")
            object.__setattr__(self, "no_rope_layers", tuple(layers))
        super().__post_init__()
        if self.qkv_bias:
            raise ValueError("qkv_bias: a SmolLM3 has no biases on its projections")
        assert self.no_rope_layers is not None
        if len(self.no_rope_layers) != self.n_layers:
            raise ValueError(f"no_rope_layers: expected one entry per layer ({self.n_layers}), "
                             f"got {len(self.no_rope_layers)}")

    def uses_rope(self, layer: int) -> bool:
        """Whether layer (0-based) rotates its q and k (no_rope_layers[layer] == 1)."""
        assert self.no_rope_layers is not None
        return bool(self.no_rope_layers[layer])


class SmolLM3(Llama):
    """SmolLM3(config, *, seed=0): a SmolLM3 language model (config a
    SmolLM3Config): Llama's parameters and names (Hugging Face's
    SmolLM3ForCausalLM's without ``model.``); the layers whose no_rope_layers
    entry is 0 attend without rotary embeddings."""

    def __init__(self, config: SmolLM3Config, *, seed: int = 0):
        if not isinstance(config, SmolLM3Config):
            raise TypeError(f"config: expected a SmolLM3Config, got {type(config).__name__}")
        super().__init__(config, seed=seed)

    def __repr__(self):
        return f"SmolLM3({self.config})"


# ---- the family: its Hugging Face config and llama.cpp's smollm3 architecture --------

# SmolLM3's config.json: Llama's keys with its NoPE layers and the sliding window's keys
# (refused when used); the 3B's file also carries pretraining_tp and max_window_layers,
# which transformers' SmolLM3 never reads
_HF_KEYS = LLAMA_KEYS | {
    "no_rope_layers", "no_rope_layer_interval", "use_sliding_window", "sliding_window",
    "layer_types", "max_window_layers",
}


def _from_hf(hf: Mapping[str, Any], where: str) -> SmolLM3Config:
    check_keys(hf, _HF_KEYS, "smollm3")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention_bias, mlp_bias: only a SmolLM3 without biases is supported")
    # transformers' SmolLM3 slides its window on the NoPE layers only (no_rope_layers 0);
    # SmolLM3Config's sliding_window is None
    rope = hf.get("no_rope_layers") or default_rope_layers(
        hf["num_hidden_layers"], hf.get("no_rope_layer_interval", 4))
    no_sliding_window(hf, window_default=None, sliding=[not r for r in rope])
    fields = llama_fields(hf, where, max_len=32768, theta=2000000.0,   # HF's defaults
                          kv_heads=4)
    fields["tie_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    layers = hf.get("no_rope_layers")
    n_layers = fields["n_layers"]
    if layers is not None and len(layers) > n_layers:   # HF: "at least" one per layer
        layers = layers[:n_layers]
    return SmolLM3Config(**fields, no_rope_layers=None if layers is None else tuple(layers),
                         no_rope_layer_interval=hf.get("no_rope_layer_interval", 4))


def _to_hf(cfg: SmolLM3Config) -> dict[str, Any]:
    return {**llama_hf_config(cfg), "no_rope_layers": list(cfg.no_rope_layers or ()),
            "no_rope_layer_interval": cfg.no_rope_layer_interval,
            "use_sliding_window": False, "attention_bias": False, "mlp_bias": False,
            # SmolLM3Config's defaults are the 3B's ids (128004 ...): not this vocabulary's
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}


def _gguf_check(cfg: SmolLM3Config) -> None:
    if cfg.no_rope_layers != default_rope_layers(cfg.n_layers, 4):
        raise ValueError(f"model: llama.cpp's smollm3 skips RoPE on every fourth layer only; "
                         f"this SmolLM3's no_rope_layers {list(cfg.no_rope_layers or ())} "
                         "differ (save_hf keeps them)")


FAMILY = Family("smollm3", SmolLM3, SmolLM3Config, hf_model_type="smollm3",
                hf_architecture="SmolLM3ForCausalLM", from_hf=_from_hf, to_hf=_to_hf,
                hf_pad_default=128004,
                gguf_arch="smollm3", gguf_check=_gguf_check)
