"""GPT2: Hugging Face's GPT2LMHeadModel (nanoGPT's GPT, llm.c's model), with its
parameter names without the ``transformer.`` prefix.

    wte(tokens) + wpe(positions) -> n_layers x [x + attn(ln_1(x)); x + mlp(ln_2(x))]
    -> ln_f -> logits against wte (tied)
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..nn.attention import GPT2Attention
from ..nn.embedding import Embedding
from ..nn.mlp import GPT2MLP
from ..nn.module import grads_ready
from ..nn.norm import LayerNorm
from ..nn.positions import DocumentPositions
from ._causal_lm import CausalLM, PreNormBlock, attend_cached, normal_init
from ._hf_config import check_keys, no_dropout
from .config import GPT2Config
from .family import Family

__all__ = ["FAMILY", "GPT2", "GPT2Block"]

INIT_STD = 0.02  # Hugging Face's initializer_range


class GPT2Block(PreNormBlock):
    """One pre-norm block: h = x + attn(ln_1(x)), y = h + mlp(ln_2(h))."""

    def __init__(self, config: GPT2Config, rng: np.random.Generator):
        init = normal_init(INIT_STD)
        self.ln_1 = LayerNorm(config.dim, config.norm_eps)
        self.attn = GPT2Attention(config.dim, config.n_heads, init=init, rng=rng)
        self.ln_2 = LayerNorm(config.dim, config.norm_eps)
        self.mlp = GPT2MLP(config.dim, config.ffn_dim, init=init, rng=rng)
        # GPT-2's scaled init of the projections into the residual stream
        std = INIT_STD / math.sqrt(2 * config.n_layers)
        for proj in (self.attn.c_proj, self.mlp.c_proj):
            proj.weight.data[...] = rng.normal(0.0, std, proj.weight.shape)

    def _parts(self):
        return self.ln_1, self.attn, self.ln_2, self.mlp

    def decode(self, x, cache_k, cache_v, pos):
        """forward for t new positions at pos.., reading and extending the cache."""
        attn = self.attn
        b, t, d = x.shape
        qkv = attn.c_attn.forward(self.ln_1.forward(x).reshape(b * t, d)).reshape(b, t, 3, d)
        shape = (b, t, attn.n_heads, attn.head_dim)
        cache_k[:, pos:pos + t] = qkv[:, :, 1].reshape(shape)
        cache_v[:, pos:pos + t] = qkv[:, :, 2].reshape(shape)
        o = attend_cached(np.ascontiguousarray(qkv[:, :, 0]).reshape(shape), cache_k, cache_v,
                          pos)
        h = x + attn.c_proj.forward(o.reshape(b * t, d)).reshape(b, t, d)
        return h + self.mlp.forward(self.ln_2.forward(h))


class GPT2(CausalLM):
    """GPT2(config, *, seed=0): a GPT-2 language model (learned positions,
    LayerNorm with bias, GELU (tanh), biases everywhere, the output tied to the
    token embedding).

    Parameters (Hugging Face's GPT2LMHeadModel names without ``transformer.``):
    ``wte.weight`` (vocab, dim), ``wpe.weight`` (max_seq_len, dim); per layer i
    ``h.{i}.ln_1.{weight,bias}``, ``h.{i}.attn.c_attn.{weight,bias}`` (q, k, v
    fused), ``h.{i}.attn.c_proj.{weight,bias}``, ``h.{i}.ln_2.{weight,bias}``,
    ``h.{i}.mlp.c_fc.{weight,bias}``, ``h.{i}.mlp.c_proj.{weight,bias}``;
    ``ln_f.{weight,bias}``.  The weights are (in, out), which for GPT-2 is
    also Hugging Face's own layout (its Conv1D).  Initialised as Hugging Face
    does from seed: N(0, 0.02), the two projections into the residual stream
    N(0, 0.02 / sqrt(2 * n_layers)), biases zero, norms ones.

    forward/backward/decode as Llama.
    """

    lm_head = None   # tied: the logits are h @ wte.weight.T

    def __init__(self, config: GPT2Config, *, seed: int = 0):
        if not isinstance(config, GPT2Config):
            raise TypeError(f"config: expected a GPT2Config, got {type(config).__name__}")
        self.config = config
        rng = np.random.default_rng(seed)
        init = normal_init(INIT_STD)
        self.wte = Embedding(config.vocab_size, config.dim, init=init, rng=rng)
        self.wpe = Embedding(config.max_seq_len, config.dim, init=init, rng=rng)
        self.h = [GPT2Block(config, rng) for _ in range(config.n_layers)]
        self.ln_f = LayerNorm(config.dim, config.norm_eps)
        self._positions = None
        self._x = None

    @property
    def _embedding(self):
        return self.wte

    def _kv_heads(self):
        return self.config.n_heads

    def _input_layers(self):
        return (self.wte, self.wpe)

    def _embed(self, tokens, pos):
        b, t = tokens.shape
        if self._x is None or self._x.shape[:2] != (b, t):
            self._x = np.empty((b, t, self.config.dim), np.float32)
        # packed documents: each token's position in its own document
        positions = pos.positions if isinstance(pos, DocumentPositions) else \
            np.arange(pos, pos + t)
        self._positions = positions
        np.add(self.wte.forward(tokens), self.wpe.forward(positions), out=self._x)
        return self._x

    def _hidden(self, tokens, pos=0):
        h = self._embed(tokens, pos)
        return self.ln_f.forward(self._blocks_forward(self.h, h, pos))

    def _hidden_backward(self, dh):
        g = self.ln_f.backward(dh)
        grads_ready(self.ln_f)  # the gradient-ready hook: each part once it is done
        g = self._blocks_backward(self.h, g)
        if g is not None:   # None: both embeddings are frozen
            self.wte.backward(g)
            # every sequence's position t adds into row t (packed: each token's own position)
            self.wpe.backward(g if self._positions.ndim == 2 else g.sum(axis=0))
        grads_ready(self.wte)
        grads_ready(self.wpe)

    def _decode_hidden(self, tokens, cache):
        pos = cache.length
        h = np.array(self._embed(tokens, pos), copy=True)
        for block, k, v in zip(self.h, cache.k, cache.v):
            h = block.decode(h, k, v, pos)
        return self.ln_f.forward(h)

    def __repr__(self):
        return f"GPT2({self.config})"


# ---- the family: its Hugging Face config; llama.cpp's gpt2 (ggmlopt.io.gguf_gpt2) ----

_HF_KEYS = frozenset({
    "vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_ctx", "n_inner",
    "activation_function", "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon",
    "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout", "n_special", "predict_special_tokens",
})


def _from_hf(hf: Mapping[str, Any], where: str) -> GPT2Config:
    check_keys(hf, _HF_KEYS, "gpt2")
    dim = hf["n_embd"]
    if hf.get("n_inner") not in (None, 4 * dim):
        raise ValueError(f"n_inner: only 4 * n_embd is supported, got {hf['n_inner']}")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function: only GELU's tanh form is supported, got "
                         f"{hf['activation_function']!r}")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("scale_attn_weights, scale_attn_by_inverse_layer_idx: only GPT-2's "
                         "1/sqrt(head_dim) scaling is supported")
    if not hf.get("tie_word_embeddings", True):
        raise ValueError("tie_word_embeddings: GPT-2's head is tied to its token embedding")
    # n_ctx: an old name transformers keeps and never reads (n_positions bounds the
    # positions), whatever its value
    no_dropout(hf, ("resid_pdrop", "embd_pdrop", "attn_pdrop"), where)
    return GPT2Config(vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["n_layer"],
                      n_heads=hf["n_head"], max_seq_len=hf.get("n_positions", 1024),
                      norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)))


def _to_hf(cfg: GPT2Config) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "n_embd": cfg.dim, "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads, "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len,
        "n_inner": None, "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "tie_word_embeddings": True, "torch_dtype": "float32", "use_cache": True,
        # not GPT2Config's 50256 (the real vocabulary's): see llama_hf_config
        "bos_token_id": None, "eos_token_id": None,
    }


# Hugging Face's GPT2LMHeadModel keeps its Conv1D weights (in, out), as ggmlopt does;
# llama.cpp's gpt2 has a writer of its own
FAMILY = Family("gpt2", GPT2, GPT2Config, hf_model_type="gpt2",
                hf_architecture="GPT2LMHeadModel", from_hf=_from_hf, to_hf=_to_hf,
                hf_prefix="transformer.", hf_transposed=False, hf_padding=False,
                gguf_arch="gpt2",
                gguf_layout="gpt2", lora_targets=("c_attn", "attn.c_proj"))
