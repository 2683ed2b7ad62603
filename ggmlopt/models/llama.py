"""Llama: Hugging Face's LlamaForCausalLM (llama2.c's Transformer), with its
parameter names without the ``model.`` prefix.

    embed_tokens -> n_layers x [x + self_attn(input_layernorm(x));
                                x + mlp(post_attention_layernorm(x))] -> norm -> lm_head
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..nn.attention import CausalSelfAttention
from ..nn.embedding import Embedding
from ..nn.linear import Linear
from ..nn.mlp import SwiGLU
from ..nn.module import Module, grads_ready
from ..nn.norm import RMSNorm
from ._causal_lm import CausalLM, PreNormBlock, cached_self_attention, normal_init
from .config import LlamaConfig

__all__ = ["Llama", "LlamaDecoderLayer"]

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

    def decode(self, x, cache_k, cache_v, pos):
        """forward for t new positions at pos.., reading and extending the cache."""
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
