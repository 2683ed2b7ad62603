"""Llama: Hugging Face's LlamaForCausalLM (llama2.c's Transformer), with its
parameter names without the ``model.`` prefix.

    embed_tokens -> n_layers x [x + self_attn(input_layernorm(x));
                                x + mlp(post_attention_layernorm(x))] -> norm -> lm_head
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..nn.attention import CausalSelfAttention
from ..nn.embedding import Embedding
from ..nn.linear import Linear
from ..nn.mlp import SwiGLU
from ..nn.module import Module, grads_ready
from ..nn.norm import RMSNorm
from ._causal_lm import CausalLM, PreNormBlock, cached_self_attention, normal_init
from ._decode_step import decode_in_one_call
from ._hf_config import LLAMA_KEYS, check_keys, llama_fields, llama_hf_config
from .config import LlamaConfig
from .family import Family

__all__ = ["FAMILY", "Llama", "LlamaDecoderLayer", "llama_parameter_shapes"]

INIT_STD = 0.02  # Hugging Face's initializer_range


class LlamaDecoderLayer(PreNormBlock):
    """One pre-norm block: h = x + self_attn(input_layernorm(x)),
    y = h + mlp(post_attention_layernorm(h)), x and y (batch, T, dim)."""

    def __init__(self, config: LlamaConfig, rng: np.random.Generator, layer: int = 0):
        init = normal_init(INIT_STD)
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = CausalSelfAttention(config.dim, config.n_heads, config.n_kv_heads,
                                             rope=config.uses_rope(layer),
                                             rope_base=config.rope_base,
                                             rope_scaling=config.rope_scaling,
                                             bias=config.qkv_bias, out_bias=False, init=init,
                                             rng=rng, head_dim=config.head_dim,
                                             qk_norm=config.qk_norm, norm_eps=config.norm_eps,
                                             sliding_window=config.sliding_window_of(layer))
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = SwiGLU(config.dim, config.ffn_dim, init=init, rng=rng)

    def _parts(self):
        return self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp

    def step_projections(self):
        """(layer, first row, rows) of the q, k, v, o, gate, up and down weights,
        for a decode step in one call (models._decode_step); None when the
        attention or the MLP is another kind (a subclass's)."""
        attn, mlp = self.self_attn, self.mlp
        if type(attn) is not CausalSelfAttention or type(mlp) is not SwiGLU:
            return None
        return [(p, 0, p.out_features) for p in (attn.q_proj, attn.k_proj, attn.v_proj,
                                                   attn.o_proj, mlp.gate_proj, mlp.up_proj,
                                                   mlp.down_proj)]

    def decode(self, x, cache_k, cache_v, pos):
        """forward for t new positions at pos.., reading and extending the cache."""
        y = decode_in_one_call(self, x, cache_k, cache_v, pos)
        if y is not None:   # a base kept in its file's types: the whole block in C
            return y
        b, t, d = x.shape
        rows = self.input_layernorm.forward(x).reshape(b * t, d)
        h = x + cached_self_attention(self.self_attn, rows, b, t, pos, cache_k, cache_v)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))


class Llama(CausalLM):
    """Llama(config, *, seed=0): a Llama language model.

    Parameters (Hugging Face's LlamaForCausalLM names without ``model.``):
    ``embed_tokens.weight`` (vocab, dim); per layer i
    ``layers.{i}.input_layernorm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
    ``layers.{i}.post_attention_layernorm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``;
    ``norm.weight``; ``lm_head.weight`` (absent with tie_embeddings).  Linear
    weights are (in, out), the transpose of torch's: that and the names are the
    whole mapping to a Hugging Face checkpoint.  Initialised as Hugging Face does
    (weights N(0, 0.02), norms ones) from seed.

    ``forward(tokens)``: int (batch, T), T <= max_seq_len -> logits float32
    (batch, T, vocab_size) (ValueError for a longer T, IndexError for an id
    outside the vocabulary, both before any work); ``backward(grad_logits)``;
    ``model(tokens)`` a copy; ``make_cache``/``decode`` for generation
    (ggmlopt.generate).
    """

    # the block of each layer, made as layer_class(config, rng, layer): a family
    # with other blocks (Phi-3's fused projections) names its own
    layer_class: Callable[..., Module] = LlamaDecoderLayer

    def __init__(self, config: LlamaConfig, *, seed: int = 0):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config: expected a LlamaConfig, got {type(config).__name__}")
        self.config = config
        rng = np.random.default_rng(seed)
        init = normal_init(INIT_STD)
        self.embed_tokens = Embedding(config.vocab_size, config.dim, init=init, rng=rng)
        self.layers = [self.layer_class(config, rng, i) for i in range(config.n_layers)]
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = (None if config.tie_embeddings else
                        Linear(config.dim, config.vocab_size, bias=False, init=init, rng=rng))

    @property
    def _embedding(self):
        return self.embed_tokens

    def _kv_heads(self):
        return self.config.n_kv_heads

    def _hidden(self, tokens, pos=0):
        h = self.embed_tokens.forward(tokens)
        return self.norm.forward(self._blocks_forward(self.layers, h, pos))

    def _hidden_backward(self, dh):
        g = self.norm.backward(dh)
        grads_ready(self.norm)  # the gradient-ready hook: each part once it is done
        g = self._blocks_backward(self.layers, g)
        if g is not None:   # None: the embedding is frozen
            self.embed_tokens.backward(g)
        grads_ready(self.embed_tokens)

    def _decode_hidden(self, tokens, cache):
        pos = cache.length
        h = np.array(self.embed_tokens.forward(tokens), copy=True)
        for layer, k, v in zip(self.layers, cache.k, cache.v):
            h = layer.decode(h, k, v, pos)
        return self.norm.forward(h)

    def __repr__(self):
        return f"Llama({self.config})"


# ---- the family: its Hugging Face config and llama.cpp's llama architecture ----------

def llama_parameter_shapes(config: LlamaConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of a Llama-layout model of config, in
    named_parameters' order, without building one (Qwen2's q/k/v biases and
    Qwen3's q/k norms follow the config's qkv_bias and qk_norm)."""
    d, f = config.dim, config.ffn_dim
    assert f is not None  # LlamaConfig fills it in
    n_kv = config.n_kv_heads
    assert n_kv is not None
    kv = n_kv * config.head_dim
    q = config.n_heads * config.head_dim   # d, but for a Qwen3 with its own head_dim
    biases = config.qkv_bias   # Qwen2's, after each weight as Linear names them
    norms = [("self_attn.q_norm.weight", (config.head_dim,)),
             ("self_attn.k_norm.weight", (config.head_dim,))] if config.qk_norm else []
    layer = [
        ("input_layernorm.weight", (d,)), ("self_attn.q_proj.weight", (d, q)),
        *([("self_attn.q_proj.bias", (q,))] if biases else []),
        ("self_attn.k_proj.weight", (d, kv)),
        *([("self_attn.k_proj.bias", (kv,))] if biases else []),
        ("self_attn.v_proj.weight", (d, kv)),
        *([("self_attn.v_proj.bias", (kv,))] if biases else []),
        ("self_attn.o_proj.weight", (q, d)), *norms, ("post_attention_layernorm.weight", (d,)),
        ("mlp.gate_proj.weight", (d, f)), ("mlp.up_proj.weight", (d, f)),
        ("mlp.down_proj.weight", (f, d))]
    return with_layers(config, layer)


def with_layers(config: LlamaConfig, layer: list[tuple[str, tuple[int, ...]]]
                ) -> list[tuple[str, tuple[int, ...]]]:
    """The whole model's (name, shape) list around one layer's: the token
    embedding, the layers, the final norm and an untied head."""
    d, v = config.dim, config.vocab_size
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed_tokens.weight", (v, d))]
    for i in range(config.n_layers):
        shapes += [(f"layers.{i}.{name}", shape) for name, shape in layer]
    shapes.append(("norm.weight", (d,)))
    if not config.tie_embeddings:
        shapes.append(("lm_head.weight", (d, v)))
    return shapes


def _from_hf(hf: Mapping[str, Any], where: str) -> LlamaConfig:
    check_keys(hf, LLAMA_KEYS, "llama")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention_bias, mlp_bias: only a Llama without biases is supported")
    return LlamaConfig(**llama_fields(hf, where))


def _to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    if cfg.qkv_bias:
        # transformers' attention_bias puts a bias on o_proj as well: a config that
        # says false would load without the q/k/v biases (dropped as unexpected)
        raise ValueError("model: a Llama with q/k/v biases (qkv_bias) has no Hugging Face "
                         "Llama config (attention_bias would give o_proj one too); use a "
                         "Qwen2, whose config.json has them")
    return {**llama_hf_config(cfg), "head_dim": cfg.head_dim, "attention_bias": False,
            "mlp_bias": False}


def _gguf_check(cfg: LlamaConfig) -> None:
    if cfg.qkv_bias:
        # llama.cpp permutes a llama's q/k rows, biases included; ggmlopt's llama reader
        # has no biases: rather than a file the two read differently, none
        raise ValueError("model: a Llama with q/k/v biases (qkv_bias) is not written as "
                         "llama.cpp's llama; use a Qwen2 (its qwen2 architecture)")


FAMILY = Family("llama", Llama, LlamaConfig, hf_model_type="llama",
                hf_architecture="LlamaForCausalLM", from_hf=_from_hf, to_hf=_to_hf,
                gguf_arch="llama", gguf_check=_gguf_check)
