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

from .config import LlamaConfig
from .llama import Llama

__all__ = ["SmolLM3", "SmolLM3Config", "default_rope_layers"]


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
