"""The configurations of the decoder-only language models: LlamaConfig, GPT2Config.

Plain frozen dataclasses checked when made, so a bad shape fails here rather
than inside a kernel of the first forward pass.  Field names follow llama2.c's
``ModelArgs`` and nanoGPT's ``GPTConfig``; the Hugging Face equivalents are
named in each class's docstring.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar

from ..nn.rope_scaling import RopeScaling

__all__ = ["GPT2Config", "LlamaConfig", "llama_ffn_dim"]

# llama2.c rounds the SwiGLU width up to a multiple of this (its train.py's
# multiple_of, with which the tinystories models were trained)
FFN_MULTIPLE_OF = 32


def llama_ffn_dim(dim: int, multiple_of: int = FFN_MULTIPLE_OF) -> int:
    """The SwiGLU hidden width llama2.c derives from dim: int(2 * 4 * dim / 3)
    rounded up to a multiple of multiple_of (dim 288 -> 768, as stories15M;
    512 -> 1376, stories42M; 768 -> 2048, stories110M)."""
    hidden = int(2 * (4 * dim) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _count(obj, name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}")
    object.__setattr__(obj, name, int(value))


def _positive(obj, name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected a finite value > 0, got {value}")
    object.__setattr__(obj, name, float(value))


def _heads(dim, n_heads):
    if dim % n_heads != 0:
        raise ValueError(f"dim: expected a multiple of n_heads={n_heads} (each head gets "
                         f"dim // n_heads features), got {dim}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """LlamaConfig(vocab_size, dim, n_layers, n_heads, n_kv_heads=None, ffn_dim=None,
    max_seq_len=2048, norm_eps=1e-5, rope_base=10000.0, tie_embeddings=False,
    rope_scaling=None, qkv_bias=False)

    A Llama (Hugging Face's LlamaForCausalLM; llama2.c's Transformer):
    vocab_size (HF vocab_size), dim (hidden_size), n_layers
    (num_hidden_layers), n_heads (num_attention_heads), n_kv_heads
    (num_key_value_heads; None: n_heads, grouped-query attention otherwise),
    ffn_dim (intermediate_size; None: llama_ffn_dim(dim), llama2.c's rule),
    max_seq_len (max_position_embeddings), norm_eps (rms_norm_eps), rope_base
    (rope_theta), tie_embeddings (tie_word_embeddings), rope_scaling
    (rope_scaling / rope_parameters: a ggmlopt.nn.RopeScaling, e.g. Llama 3.1's
    ``llama3``; None for plain RoPE), qkv_bias (biases on the q, k and v
    projections but not o: Qwen2's).

    Checked: every count >= 1 (ints; TypeError otherwise), dim a multiple of
    n_heads, n_heads a multiple of n_kv_heads, an even head_dim (RoPE rotates
    pairs of features), norm_eps and rope_base finite and > 0; ValueError
    names the field.  After construction n_kv_heads and ffn_dim hold ints.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    # whether the config gives head_dim (a Qwen3's) instead of dim // n_heads
    explicit_head_dim: ClassVar[bool] = False
    # whether llama.cpp's GGUF permutes the q/k rows into its rotary pairs (its llama
    # architecture); its qwen2 and qwen3 rotate NeoX's halves, as Hugging Face does
    llama_cpp_permutes_qk: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not isinstance(self.qkv_bias, bool):
            raise TypeError(f"qkv_bias: expected a bool, got {type(self.qkv_bias).__name__}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"rope_scaling: expected a ggmlopt.nn.RopeScaling or None, got "
                            f"{type(self.rope_scaling).__name__}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            _count(self, name, getattr(self, name))
        _count(self, "n_kv_heads", self.n_heads if self.n_kv_heads is None else self.n_kv_heads)
        _count(self, "ffn_dim", llama_ffn_dim(self.dim) if self.ffn_dim is None else self.ffn_dim)
        _positive(self, "norm_eps", self.norm_eps)
        _positive(self, "rope_base", self.rope_base)
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(f"tie_embeddings: expected a bool, got "
                            f"{type(self.tie_embeddings).__name__}")
        if not self.explicit_head_dim:
            _heads(self.dim, self.n_heads)
        else:   # a subclass's head_dim field (Qwen3, Mistral): None means dim // n_heads
            if self.head_dim is None:
                object.__setattr__(self, "head_dim", self.dim // self.n_heads)
            if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int):
                raise TypeError(f"head_dim: expected an int, got "
                                f"{type(self.head_dim).__name__}")
            if self.head_dim < 2 or self.head_dim % 2:
                raise ValueError(f"head_dim: expected an even int >= 2 (rotary embeddings "
                                 f"rotate pairs of features), got {self.head_dim}")
        n_kv_heads = self.n_kv_heads
        assert n_kv_heads is not None  # filled in above
        if self.n_heads % n_kv_heads != 0:
            raise ValueError(f"n_kv_heads: expected a divisor of n_heads={self.n_heads} (each "
                             f"key/value head serves n_heads // n_kv_heads query heads), got "
                             f"{n_kv_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"n_heads: dim // n_heads = {self.head_dim} must be even (rotary "
                             f"embeddings rotate pairs of features); dim={self.dim}, "
                             f"n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        """Features per attention head: dim // n_heads."""
        return self.dim // self.n_heads

    @property
    def qk_norm(self) -> bool:
        """Whether each attention head normalises its q and k (Qwen3): not a Llama's."""
        return False

    def uses_rope(self, layer: int) -> bool:
        """Whether layer (0-based) rotates its q and k: every Llama layer does
        (a SmolLM3 skips every fourth)."""
        return True

    def sliding_window_of(self, layer: int) -> int | None:
        """The sliding window of layer's attention (None: every earlier key, a
        Llama's; Mistral's is its config's sliding_window)."""
        return None


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT2Config(vocab_size, dim, n_layers, n_heads, max_seq_len=1024, norm_eps=1e-5)

    A GPT-2 (Hugging Face's GPT2LMHeadModel; nanoGPT's GPT, llm.c's model):
    vocab_size (HF vocab_size), dim (n_embd), n_layers (n_layer), n_heads
    (n_head), max_seq_len (n_positions: the learned position table),
    norm_eps (layer_norm_epsilon).  The MLP is 4 * dim wide (ffn_dim), the
    output tied to the token embedding.

    Checked: every count >= 1 (ints; TypeError otherwise), dim a multiple of
    n_heads, norm_eps finite and > 0; ValueError names the field.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    max_seq_len: int = 1024
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            _count(self, name, getattr(self, name))
        _positive(self, "norm_eps", self.norm_eps)
        _heads(self.dim, self.n_heads)

    @property
    def head_dim(self) -> int:
        """Features per attention head: dim // n_heads."""
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """The MLP's hidden width (c_fc's outputs): 4 * dim."""
        return 4 * self.dim
