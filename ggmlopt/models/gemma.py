"""Gemma (1): Hugging Face's GemmaForCausalLM (gemma-2b, gemma-7b, gemma-1.1, CodeGemma)
as its delta from Llama.

From transformers' ``modeling_gemma.py``:

- Llama's block, h = x + attn(input_layernorm(x)), y = h + mlp(post_attention_layernorm(h)),
  with Gemma's RMSNorm, ``x / rms(x) * (1 + weight)`` (the weight starts at zero);
- GeGLU: ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))`` (a config's ``hidden_act``
  "gelu", the published checkpoints', is read as the tanh GELU, as transformers reads it);
- token embeddings scaled by ``sqrt(hidden_size)`` (as a float32);
- an explicit ``head_dim`` (256 in gemma-2b and gemma-7b, whose 3072 / 16 heads is 192),
  the scores scaled by ``head_dim ** -0.5``;
- ``attention_bias``: biases on q, k, v and o together;
- the head tied to the token embedding by default.

Gemma 3 (``ggmlopt.models.gemma3``) adds q/k norms, two more norms a block, local
layers and its own score scale to this; its norm and MLP are these.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from ..nn.attention import CausalSelfAttention
from ._causal_lm import PreNormBlock, cached_self_attention, normal_init
from ._hf_config import LLAMA_KEYS, check_keys, llama_fields, llama_hf_config
from .config import LlamaConfig
from .family import Family
from .gemma3 import GeGLU, GemmaLM, GemmaRMSNorm
from .llama import INIT_STD, with_layers

__all__ = ["FAMILY", "Gemma", "GemmaConfig", "GemmaDecoderLayer"]


@dataclasses.dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    """GemmaConfig(vocab_size, dim, n_layers, n_heads, n_kv_heads=None,
    ffn_dim=None, max_seq_len=8192, norm_eps=1e-6, rope_base=10000.0,
    tie_embeddings=True, rope_scaling=None, qkv_bias=False, head_dim=None,
    attention_bias=False): Hugging Face's GemmaConfig as LlamaConfig's fields
    and Gemma's own: head_dim (None is dim // n_heads; Hugging Face's default,
    256, is read from a checkpoint's config) and attention_bias (biases on the
    q, k, v and o projections, transformers' attention_bias; qkv_bias, Qwen2's
    q/k/v without o, is not a Gemma's and must stay False)."""

    max_seq_len: int = 8192
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    head_dim: int | None = None  # type: ignore[assignment]  # a field here, not the property
    attention_bias: bool = False
    explicit_head_dim: ClassVar[bool] = True
    # llama.cpp's gemma rotates NeoX's halves, as Hugging Face does: rows as they are
    llama_cpp_permutes_qk: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not isinstance(self.attention_bias, bool):
            raise TypeError(f"attention_bias: expected a bool, got "
                            f"{type(self.attention_bias).__name__}")
        super().__post_init__()
        if self.qkv_bias:
            raise ValueError("qkv_bias: a Gemma's biases are attention_bias (on q, k, v and o "
                             "together); qkv_bias must stay False")


class GemmaDecoderLayer(PreNormBlock):
    """Gemma's block: Llama's with Gemma's norms, GeGLU, an explicit head width and
    optional biases on every projection of the attention."""

    def __init__(self, config: GemmaConfig, rng, layer: int = 0):
        init = normal_init(INIT_STD)
        d, eps = config.dim, config.norm_eps
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.self_attn = CausalSelfAttention(
            d, config.n_heads, config.n_kv_heads, rope_base=config.rope_base,
            rope_scaling=config.rope_scaling, bias=config.attention_bias,
            out_bias=config.attention_bias, init=init, rng=rng, head_dim=config.head_dim)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.mlp = GeGLU(d, config.ffn_dim, init=init, rng=rng)

    def _parts(self):
        return self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp

    def decode(self, x, cache_k, cache_v, pos):
        """forward for t new positions at pos.., reading and extending the cache
        (layer by layer: the one-call decode step takes RMSNorms and a SwiGLU only)."""
        b, t, d = x.shape
        rows = self.input_layernorm.forward(x).reshape(b * t, d)
        h = x + cached_self_attention(self.self_attn, rows, b, t, pos, cache_k, cache_v)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))


class Gemma(GemmaLM):
    """Gemma(config, *, seed=0): a Gemma (1) model (config a GemmaConfig).
    Parameters as Hugging Face's GemmaForCausalLM names them (without
    ``model.``): Llama's, the norms' weights Gemma's (the scale is 1 +
    weight), with ``self_attn.{q,k,v,o}_proj.bias`` under attention_bias."""

    layer_class = GemmaDecoderLayer
    config_class = GemmaConfig


# ---- the family: its Hugging Face config and llama.cpp's gemma architecture -----------

# transformers' GemmaConfig (and 4.x's hidden_activation); Llama's mlp_bias and
# pretraining_tp are not a Gemma's (its MLP never has biases): refused as unknown
_HF_KEYS = (LLAMA_KEYS - {"mlp_bias", "pretraining_tp", "rope_interleaved"}) | {
    "hidden_activation", "use_bidirectional_attention"}
# the activations transformers computes as the tanh GELU: "gelu" is the published
# checkpoints' legacy value, which GemmaConfig turns into gelu_pytorch_tanh
_TANH_GELU = ("gelu_pytorch_tanh", "gelu")


def _from_hf(hf: Mapping[str, Any], where: str) -> GemmaConfig:
    check_keys(hf, _HF_KEYS, "gemma")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: only causal attention is supported")
    act = hf.get("hidden_act", "gelu_pytorch_tanh")
    if act not in _TANH_GELU:
        raise ValueError(f"hidden_act: only gelu_pytorch_tanh (or its legacy name gelu) is "
                         f"supported, got {act!r}")
    legacy = hf.get("hidden_activation")
    if legacy not in (None, "gelu_pytorch_tanh"):
        # transformers 4.x computed the MLP with it, 5 ignores it: the two disagree
        raise ValueError(f"hidden_activation: only gelu_pytorch_tanh is supported (transformers "
                         f"4.x computes with this key, 5 ignores it), got {legacy!r}")
    head_dim = hf.get("head_dim", 256)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim: expected an int (transformers' GemmaConfig takes no "
                         f"other), got {head_dim!r}")
    bias = hf.get("attention_bias", False)
    if not isinstance(bias, bool):
        raise TypeError(f"attention_bias: expected true or false, got {bias!r}")
    # the Llama layout's RoPE keys (rope_parameters, or 4.x's rope_theta and rope_scaling),
    # read as transformers' Gemma reads them; the activation was checked above
    fields = llama_fields({k: v for k, v in hf.items() if k != "hidden_act"}, where,
                          head_dim_given=True, max_len=8192, theta=10000.0, eps=1e-6,
                          kv_heads=16)
    fields["tie_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    return GemmaConfig(**fields, head_dim=head_dim, attention_bias=bias)


def _to_hf(cfg: GemmaConfig) -> dict[str, Any]:
    return {**llama_hf_config(cfg), "hidden_act": "gelu_pytorch_tanh", "head_dim": cfg.head_dim,
            "attention_bias": cfg.attention_bias, "attention_dropout": 0.0}


def _gguf_check(cfg: GemmaConfig) -> None:
    """ValueError for a Gemma llama.cpp's gemma cannot hold."""
    if not cfg.tie_embeddings:
        # its output is the token embedding's tensor; an output.weight fails to load
        raise ValueError("model: llama.cpp's gemma takes its head from the token embedding; "
                         "this Gemma's is untied (tie_embeddings=False; save_hf keeps it)")
    if cfg.attention_bias:
        raise ValueError("model: llama.cpp's gemma has no bias on its attention's output "
                         "projection; this Gemma has attention_bias (save_hf keeps it)")


def _parameter_shapes(config: GemmaConfig) -> list[tuple[str, tuple[int, ...]]]:
    d, f, hd = config.dim, config.ffn_dim, config.head_dim
    assert f is not None and config.n_kv_heads is not None and hd is not None
    kv, q = config.n_kv_heads * hd, config.n_heads * hd

    def projection(name, n_in, n_out):   # each bias after its weight, as Linear names them
        weight = [(f"self_attn.{name}.weight", (n_in, n_out))]
        return weight + ([(f"self_attn.{name}.bias", (n_out,))] if config.attention_bias else [])

    return with_layers(config, [
        ("input_layernorm.weight", (d,)), *projection("q_proj", d, q),
        *projection("k_proj", d, kv), *projection("v_proj", d, kv),
        *projection("o_proj", q, d), ("post_attention_layernorm.weight", (d,)),
        ("mlp.gate_proj.weight", (d, f)), ("mlp.up_proj.weight", (d, f)),
        ("mlp.down_proj.weight", (f, d))])


# llama.cpp's gemma: the llama layout's tensor names and keys, norm weights stored as
# 1 + w, q/k rows as Hugging Face's, the head always the token embedding
FAMILY = Family("gemma", Gemma, GemmaConfig, hf_model_type="gemma",
                hf_architecture="GemmaForCausalLM", from_hf=_from_hf, to_hf=_to_hf,
                hf_pad_default=0, gguf_arch="gemma", gguf_check=_gguf_check,
                gguf_norm_offset=1.0, parameter_shapes=_parameter_shapes)
