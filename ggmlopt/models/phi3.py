"""Phi-3: Hugging Face's Phi3ForCausalLM as its delta from Llama.

A Llama whose q, k and v projections are one matrix (``self_attn.qkv_proj``,
output rows q | k | v) and whose gate and up projections are one
(``mlp.gate_up_proj``, output gate | up), optionally over a sliding window of
keys (``sliding_window``: Phi-3-mini-4k's 2047).  The fused weights are
Hugging Face's parameters: one product where Llama takes three (or two), and
the names a LoRA adapter or a PEFT checkpoint of Phi-3 uses.  LongRoPE (the
128k and 3.5 models) scales the rotary embedding (ggmlopt.nn.RopeScaling), and
a ``partial_rotary_factor`` below 1 rotates only the first features of each
head (Phi-4-mini's).
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from .. import kernels_attention as ka
from .. import kernels_glu
from ..nn.attention import RotaryEmbedding, _as_sequence, _position, window_kv_start
from ..nn.linear import Linear
from ..nn.module import Module
from ..nn.norm import RMSNorm
from ._causal_lm import PreNormBlock, attend_cached, normal_init
from ._decode_step import decode_in_one_call
from ._hf_config import LLAMA_KEYS, check_keys, llama_fields, llama_hf_config, no_dropout
from .family import Family
from .llama import INIT_STD, Llama, with_layers
from .mistral import MistralConfig

__all__ = ["FAMILY", "Phi3", "Phi3Attention", "Phi3Config", "Phi3MLP"]


@dataclasses.dataclass(frozen=True)
class Phi3Config(MistralConfig):
    """Phi3Config(vocab_size, dim, n_layers, n_heads, n_kv_heads=None, ffn_dim=None,
    max_seq_len=4096, norm_eps=1e-5, rope_base=10000.0, tie_embeddings=False,
    rope_scaling=None, qkv_bias=False, head_dim=None, sliding_window=None,
    original_max_seq_len=4096, partial_rotary_factor=1.0): MistralConfig's fields
    (a window, a head width) with Phi-3's defaults (Hugging Face's Phi3Config), its
    original_max_position_embeddings (where LongRoPE switches to its long
    factors) and partial_rotary_factor (the share of each head's features that
    rotate: ``rotary_dim`` = int(head_dim * factor), Phi-4-mini's 0.75)."""

    max_seq_len: int = 4096
    norm_eps: float = 1e-5
    original_max_seq_len: int = 4096
    partial_rotary_factor: float = 1.0
    llama_cpp_permutes_qk: ClassVar[bool] = False   # llama.cpp's phi3 rotates NeoX's halves

    def __post_init__(self) -> None:
        super().__post_init__()
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"partial_rotary_factor: expected a number in (0, 1], got {f!r}")
        object.__setattr__(self, "partial_rotary_factor", float(f))
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor: {f} of head_dim {self.head_dim} rotates "
                             f"{self.rotary_dim} features; expected an even number >= 2")
        s = self.rope_scaling
        if s is not None and s.rope_type == "longrope" and \
                s.original_max_position_embeddings != self.original_max_seq_len:
            # transformers switches at the config's original_max_position_embeddings
            raise ValueError(f"rope_scaling: LongRoPE's original_max_position_embeddings "
                             f"{s.original_max_position_embeddings} is not original_max_seq_len "
                             f"{self.original_max_seq_len}, where a Phi-3 switches to its long "
                             "factors")

    @property
    def rotary_dim(self) -> int:
        """The features of each head that rotate (transformers' int(head_dim * factor))."""
        assert self.head_dim is not None
        return int(self.head_dim * self.partial_rotary_factor)


class Phi3Attention(Module):
    """Phi-3's attention: qkv_proj (dim, (n_heads + 2 n_kv_heads) head_dim), its
    output rows q | k | v, RoPE on q and k, the fused causal kernel (over a
    sliding window when given), o_proj (n_heads head_dim, dim).  forward(x, pos)
    returns a buffer the layer reuses; backward adds into the parameters'
    gradients and returns d loss / d x (None when needs_input_grad is False)."""

    def __init__(self, config: Phi3Config, rng, init):
        self.dim, self.n_heads = config.dim, config.n_heads
        self.n_kv_heads, self.head_dim = config.n_kv_heads, config.head_dim
        assert self.n_kv_heads is not None and self.head_dim is not None
        self.q_width = self.n_heads * self.head_dim
        self.kv_width = self.n_kv_heads * self.head_dim
        self.qkv_proj = Linear(self.dim, self.q_width + 2 * self.kv_width, bias=False,
                               init=init, rng=rng)
        self.o_proj = Linear(self.q_width, self.dim, bias=False, init=init, rng=rng)
        self.rotary = RotaryEmbedding(self.head_dim, config.rope_base, config.rope_scaling,
                                      rotary_dim=config.rotary_dim)
        self.sliding_window = config.sliding_window
        self._saved = None

    def split_qkv(self, rows, b, t, pos):
        """(q, k, v) of rows (b * t, dim): contiguous (b, t, heads, head_dim)
        copies of the fused product's parts, q and k rotated for positions pos.."""
        qkv = self.qkv_proj.forward(rows)
        q = np.ascontiguousarray(qkv[:, :self.q_width]).reshape(b, t, self.n_heads, -1)
        k = np.ascontiguousarray(qkv[:, self.q_width:self.q_width + self.kv_width])
        k = k.reshape(b, t, self.n_kv_heads, -1)
        v = np.ascontiguousarray(qkv[:, self.q_width + self.kv_width:])
        self.rotary.rotate(q, pos, out=q)
        self.rotary.rotate(k, pos, out=k)
        return q, k, v.reshape(b, t, self.n_kv_heads, -1)

    def forward(self, x, pos=0):
        """x: float32 (batch, T, dim) -> (batch, T, dim); token t at position pos + t
        (or as a DocumentPositions places it, see CausalSelfAttention)."""
        x = _as_sequence(x, self.dim, "x")
        pos = _position(pos, x.shape[:2])
        b, t, _ = x.shape
        q, k, v = self.split_qkv(x.reshape(b * t, self.dim), b, t, pos)
        starts = window_kv_start(self.sliding_window, b, t, pos)
        o, lse = ka.attention_forward(q, k, v, kv_start=starts)
        self._saved = (q, k, v, o, lse, pos, starts)
        return self.o_proj.forward(o.reshape(b * t, -1)).reshape(b, t, self.dim)

    def backward(self, grad_out):
        """grad_out (batch, T, dim) like the last output -> d loss / d x."""
        if self._saved is None:
            raise RuntimeError("backward: call forward first")
        q, k, v, o, lse, pos, starts = self._saved
        b, t = q.shape[:2]
        g = _as_sequence(grad_out, self.dim, "grad_out")
        if g.shape[:2] != (b, t):
            raise ValueError(f"grad_out: expected shape {(b, t, self.dim)} like the last "
                             f"output, got {g.shape}")
        do = self.o_proj.backward(g.reshape(b * t, self.dim))
        do = np.ascontiguousarray(do, dtype=np.float32).reshape(o.shape)
        dq, dk, dv = ka.attention_backward(q, k, v, o, lse, do, kv_start=starts)
        self.rotary.rotate(dq, pos, out=dq, inverse=True)
        self.rotary.rotate(dk, pos, out=dk, inverse=True)
        dqkv = np.concatenate([dq.reshape(b * t, -1), dk.reshape(b * t, -1),
                               dv.reshape(b * t, -1)], axis=1)
        self.qkv_proj.needs_input_grad = self.needs_input_grad
        dx = self.qkv_proj.backward(dqkv)
        return None if dx is None else dx.reshape(b, t, self.dim)

    def __call__(self, x, pos=0):
        """forward(x, pos), copied into an array the caller owns."""
        return np.array(self.forward(x, pos), copy=True)


class Phi3MLP(Module):
    """Phi-3's MLP: gate_up_proj (dim, 2 hidden), its output gate | up,
    y = down_proj(silu(gate) * up)."""

    def __init__(self, dim, hidden, rng, init):
        self.dim, self.hidden = dim, hidden
        self.gate_up_proj = Linear(dim, 2 * hidden, bias=False, init=init, rng=rng)
        self.down_proj = Linear(hidden, dim, bias=False, init=init, rng=rng)
        self._shape = None

    def forward(self, x):
        """x: float32 (..., dim) -> (..., dim)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        gu = self.gate_up_proj.forward(x.reshape(-1, self.dim))
        self._g = np.ascontiguousarray(gu[:, :self.hidden])
        self._u = np.ascontiguousarray(gu[:, self.hidden:])
        h = kernels_glu.swiglu(self._g, self._u)
        self._shape = x.shape
        return self.down_proj.forward(h).reshape(x.shape)

    def backward(self, grad_out):
        """grad_out like the last output -> d loss / d x."""
        if self._shape is None:
            raise RuntimeError("backward: call forward first")
        g = np.ascontiguousarray(grad_out, dtype=np.float32).reshape(-1, self.dim)
        dh = self.down_proj.backward(g)
        dgate, dup = kernels_glu.swiglu_backward(self._g, self._u, dh)
        self.gate_up_proj.needs_input_grad = self.needs_input_grad
        dx = self.gate_up_proj.backward(np.concatenate([dgate, dup], axis=1))
        return None if dx is None else dx.reshape(self._shape)

    def __call__(self, x):
        """forward(x), copied into an array the caller owns."""
        return np.array(self.forward(x), copy=True)


class Phi3DecoderLayer(PreNormBlock):
    """Llama's pre-norm block over Phi3Attention and Phi3MLP."""

    def __init__(self, config: Phi3Config, rng, layer: int = 0):
        init = normal_init(INIT_STD)
        assert config.ffn_dim is not None
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Phi3Attention(config, rng, init)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = Phi3MLP(config.dim, config.ffn_dim, rng, init)

    def _parts(self):
        return self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp

    def step_projections(self):
        """LlamaDecoderLayer.step_projections: q, k and v are row ranges of
        qkv_proj, gate and up of gate_up_proj."""
        attn, mlp = self.self_attn, self.mlp
        qkv, gate_up = attn.qkv_proj, mlp.gate_up_proj
        nq, kv, hidden = attn.q_width, attn.kv_width, mlp.hidden
        return [(qkv, 0, nq), (qkv, nq, kv), (qkv, nq + kv, kv),
                (attn.o_proj, 0, attn.o_proj.out_features), (gate_up, 0, hidden),
                (gate_up, hidden, hidden), (mlp.down_proj, 0, mlp.down_proj.out_features)]

    def decode(self, x, cache_k, cache_v, pos):
        """forward for t new positions at pos.., reading and extending the cache."""
        y = decode_in_one_call(self, x, cache_k, cache_v, pos)
        if y is not None:   # a base kept in its file's types: the whole block in C
            return y
        attn = self.self_attn
        b, t, d = x.shape
        rows = self.input_layernorm.forward(x).reshape(b * t, d)
        q, k, v = attn.split_qkv(rows, b, t, pos)
        cache_k[:, pos:pos + t] = k
        cache_v[:, pos:pos + t] = v
        o = attend_cached(q, cache_k, cache_v, pos, attn.sliding_window)
        h = x + attn.o_proj.forward(o.reshape(b * t, -1)).reshape(b, t, d)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))


class Phi3(Llama):
    """Phi3(config, *, seed=0): a Phi-3 language model (config a Phi3Config).
    Parameters as Hugging Face's Phi3ForCausalLM names them (without
    ``model.``): Llama's, with ``layers.{i}.self_attn.qkv_proj.weight`` for q, k
    and v and ``layers.{i}.mlp.gate_up_proj.weight`` for gate and up."""

    layer_class = Phi3DecoderLayer

    def __init__(self, config: Phi3Config, *, seed: int = 0):
        if not isinstance(config, Phi3Config):
            raise TypeError(f"config: expected a Phi3Config, got {type(config).__name__}")
        super().__init__(config, seed=seed)

    def __repr__(self):
        return f"Phi3({self.config})"

    @property
    def recompute_cache_at(self) -> int | None:
        """With LongRoPE, its pretraining length: past it a pass takes the long
        factors, and transformers' Phi-3 generate drops its cache there to
        recompute it with them; None otherwise."""
        scaling = self.config.rope_scaling
        if scaling is None or scaling.rope_type != "longrope":
            return None
        return scaling.original_max_position_embeddings


# ---- the family: its Hugging Face config and llama.cpp's phi3 architecture -----------

# Phi-3's config.json: Mistral's keys with its dropouts (warned about when not zero) and
# LongRoPE's pretraining length (original_max_position_embeddings);
# attention_bias, mlp_bias and pretraining_tp are read by no layer of transformers'
# Phi3 (its projections have no bias: a file's bias tensors would be refused as unknown)
# Phi-4-mini's config.json (model_type phi3) carries its own code's keys, which
# transformers' Phi3 never reads: at these values (every layer full attention, no
# interpolation, no head bias) they describe the model transformers runs; others not
_PHI4_MINI_KEYS = (("full_attn_mod", 1), ("interpolate_factor", 1), ("lm_head_bias", False))
_HF_KEYS = LLAMA_KEYS | {
    "sliding_window", "resid_pdrop", "embd_pdrop", "original_max_position_embeddings",
    "partial_rotary_factor", *(k for k, _ in _PHI4_MINI_KEYS)}


def _from_hf(hf: Mapping[str, Any], where: str) -> Phi3Config:
    check_keys(hf, _HF_KEYS, "phi3")
    for key, neutral in _PHI4_MINI_KEYS:
        if key in hf and (isinstance(hf[key], bool) != isinstance(neutral, bool)
                          or hf[key] != neutral):
            raise ValueError(f"{key}: {hf[key]!r} is not supported (only {neutral!r}, Phi-4-mini's, "
                             "which transformers' Phi3 computes)")
    # (transformers' Phi3 reads no embd_pdrop: a rate there changes nothing)
    no_dropout(hf, ("resid_pdrop",), where)
    original = hf.get("original_max_position_embeddings", 4096)
    hf, partial = _as_longrope(hf, original)
    fields = llama_fields(hf, where, max_len=4096, eps=1e-5)
    return Phi3Config(**fields, sliding_window=hf.get("sliding_window"),
                      original_max_seq_len=original, partial_rotary_factor=partial)


def _as_longrope(hf: Mapping[str, Any], original: int) -> tuple[Mapping[str, Any], float]:
    """(hf with its rope scaling as transformers' Phi3Config reads it: "su" and
    "yarn" are LongRoPE (older Phi-3 files), the pretraining length the config's
    original_max_position_embeddings, any other scaling refused; the
    partial_rotary_factor, from the top level or the rope parameters)."""
    hf = dict(hf)
    partial = hf.pop("partial_rotary_factor", 1.0)
    given = hf.get("rope_parameters")
    if isinstance(given, dict) and hf.get("rope_scaling") and \
            given.get("partial_rotary_factor", partial) != partial:
        # transformers takes rope_scaling whole, the factor from the top level
        raise ValueError(f"rope_parameters and rope_scaling are both given: transformers reads "
                         f"rope_scaling and the top-level partial_rotary_factor ({partial}), "
                         f"not rope_parameters' {given['partial_rotary_factor']}; keep one of "
                         f"the two")
    for key in ("rope_parameters", "rope_scaling"):
        params = hf.get(key)
        if not isinstance(params, dict):
            continue
        params = dict(params)
        # transformers 5 keeps it among the rope parameters
        partial = params.pop("partial_rotary_factor", partial)
        kind = params.get("rope_type", params.get("type"))
        if kind in ("su", "yarn"):
            kind = "longrope"
        if kind not in (None, "default", "longrope"):
            raise ValueError(f"{key}: a Phi-3 scales its rotary embedding with LongRoPE only "
                             f"(transformers refuses {kind!r} for it)")
        if kind == "longrope":
            params.pop("type", None)
            params["rope_type"] = "longrope"
            # transformers' standardize_rope_params puts the config's own there
            params["original_max_position_embeddings"] = original
        hf[key] = params
    return hf, partial


def _to_hf(cfg: Phi3Config) -> dict[str, Any]:
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.rope_type != "longrope":
        # a config.json neither transformers nor load_hf would read back
        raise ValueError(f"model: its {scaling.rope_type!r} rope scaling is no Phi-3 "
                         f"checkpoint's: transformers' Phi3 (and load_hf) read LongRoPE only, "
                         f"so the files would load nowhere")
    return {**llama_hf_config(cfg), "sliding_window": cfg.sliding_window,
            "original_max_position_embeddings": cfg.original_max_seq_len,
            "partial_rotary_factor": cfg.partial_rotary_factor,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0,
            # Phi3Config's defaults are Phi-3-mini's ids (32000 ...)
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}


def _gguf_fields(fields, key, head_dim, where) -> dict[str, Any]:
    """The window and LongRoPE's original context, as convert_hf_to_gguf writes them."""
    window = key("attention.sliding_window", 0, required=False)
    context = key("context_length")
    if window and window < context:
        warnings.warn(f"{where}: phi3.attention.sliding_window is {window}: the model attends "
                      f"within it, as transformers' Phi-3 does, where llama.cpp's phi3 "
                      f"ignores the window (every key): beyond {window} tokens of its "
                      f"{context} their logits differ", UserWarning, stacklevel=5)
    n_rot = key("rope.dimension_count", head_dim, required=False)
    partial = n_rot / head_dim
    if not 0 < n_rot <= head_dim or int(head_dim * partial) != n_rot:
        raise ValueError(f"{where}: phi3.rope.dimension_count = {n_rot} is no share of the "
                         f"head's {head_dim} features")
    return {"sliding_window": int(window) if window else None,
            "original_max_seq_len": key("rope.scaling.original_context_length",
                                        key("context_length"), required=False),
            "partial_rotary_factor": partial}


def _gguf_write(writer, cfg: Phi3Config, arch: str) -> None:
    writer.add_uint32(f"{arch}.rope.scaling.original_context_length", cfg.original_max_seq_len)
    # 0 without a window, as llama.cpp's converter writes it (its mark of a Phi-4)
    writer.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window or 0)


def _gguf_check(cfg: Phi3Config) -> None:
    if cfg.head_dim != cfg.dim // cfg.n_heads:
        raise ValueError(f"model: llama.cpp's phi3 takes heads of dim / heads = "
                         f"{cfg.dim // cfg.n_heads} values (it would not load this file); this "
                         f"Phi-3's head_dim is {cfg.head_dim} (save_hf keeps it)")
    if cfg.sliding_window is not None and cfg.sliding_window < cfg.max_seq_len:
        warnings.warn(f"model: llama.cpp's phi3 ignores the sliding window (it attends to "
                      f"every key): beyond {cfg.sliding_window} tokens its logits differ "
                      "from this model's; the window is written for readers that keep it",
                      UserWarning, stacklevel=4)


def _parameter_shapes(config: Phi3Config) -> list[tuple[str, tuple[int, ...]]]:
    d, f, hd = config.dim, config.ffn_dim, config.head_dim
    assert f is not None and config.n_kv_heads is not None and hd is not None
    kv, q = config.n_kv_heads * hd, config.n_heads * hd
    return with_layers(config, [
        ("input_layernorm.weight", (d,)), ("self_attn.qkv_proj.weight", (d, q + 2 * kv)),
        ("self_attn.o_proj.weight", (q, d)), ("post_attention_layernorm.weight", (d,)),
        ("mlp.gate_up_proj.weight", (d, 2 * f)), ("mlp.down_proj.weight", (f, d))])


# llama.cpp's phi3: q | k | v in attn_qkv, gate | up in ffn_up; the window key (which it
# ignores) and LongRoPE's original context beside its llama keys
FAMILY = Family("phi3", Phi3, Phi3Config, hf_model_type="phi3",
                hf_architecture="Phi3ForCausalLM", from_hf=_from_hf, to_hf=_to_hf,
                hf_pad_default=32000,
                gguf_arch="phi3",
                gguf_keys=frozenset({"attention.sliding_window",
                                     "rope.scaling.original_context_length",
                                     "rope.scaling.attn_factor"}),
                gguf_fields=_gguf_fields, gguf_write=_gguf_write, gguf_check=_gguf_check,
                gguf_names={"self_attn.qkv_proj.weight": "attn_qkv.weight",
                            "mlp.gate_up_proj.weight": "ffn_up.weight"},
                parameter_shapes=_parameter_shapes, lora_targets=("qkv_proj", "o_proj"))
