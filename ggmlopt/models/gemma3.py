"""Gemma 3 (text): Hugging Face's Gemma3ForCausalLM as its delta from Llama.

From transformers' ``modeling_gemma3.py``:

- RMSNorm computing ``x / rms(x) * (1 + weight)`` (the weight starts at zero);
- four norms per block: ``h = x + post_attention_layernorm(attn(input_layernorm(x)))``,
  ``y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``;
- GeGLU: ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``;
- token embeddings scaled by ``sqrt(hidden_size)`` (as a float32 here);
- per-head ``q_norm`` / ``k_norm`` (Gemma's RMSNorm) before RoPE, an explicit
  ``head_dim``, the scores scaled by ``query_pre_attn_scalar ** -0.5``;
- local layers (``sliding_attention``: a sliding window, RoPE base
  ``rope_local_base_freq``) and global ones (``full_attention``: every key, base
  ``rope_theta`` and the config's rope scaling), five local to one global by
  default (``layer_types``);
- tied embeddings.  Final-logit and attention-logit soft-capping (Gemma 2's; None
  in every Gemma 3 config) are refused by the checkpoint reader.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from .._dtypes import shortest_float
from ..nn.activation import GELU
from ..nn.attention import CausalSelfAttention
from ..nn.linear import Linear
from ..nn.module import Module, grads_ready
from ..nn.norm import RMSNorm
from ..nn.rope_scaling import RopeScaling
from ._causal_lm import attention_input_grad, cached_self_attention, normal_init
from ._hf_config import LLAMA_KEYS, check_keys, legacy_theta, llama_hf_config, no_dropout
from .config import LlamaConfig
from .family import Family
from .llama import INIT_STD, Llama, with_layers

__all__ = ["FAMILY", "FOUR_NORM_GGUF_NAMES", "GeGLU", "Gemma3", "Gemma3Config", "Gemma3DecoderLayer",
           "GemmaLM", "GemmaRMSNorm", "WindowLayers"]


class GemmaRMSNorm(RMSNorm):
    """GemmaRMSNorm(dim, eps=1e-6): y = x / sqrt(mean(x^2) + eps) * (1 + weight),
    weight a Parameter (dim,) of zeros (Gemma's norm, computed in float32)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__(dim, eps)
        self.weight.data[...] = 0.0

    def forward(self, x):
        """x: float32 (..., dim) -> (..., dim)."""
        return self._with_scale(lambda: super(GemmaRMSNorm, self).forward(x))

    def backward(self, grad_out):
        """d loss / d x; weight.grad gets d loss / d (1 + weight), the same."""
        return self._with_scale(lambda: super(GemmaRMSNorm, self).backward(grad_out))

    def _with_scale(self, run):
        """run() with weight.data read as 1 + weight (the kernels take the scale)."""
        w = self.weight
        stored = w.data
        scale = getattr(self, "_scale_buf", None)
        if scale is None or scale.shape != stored.shape:
            scale = self._scale_buf = np.empty_like(stored)
        np.add(stored, np.float32(1.0), out=scale)
        # (swapped in and out quietly: no assignment an OptContext would check)
        w._swap_data(scale)
        try:
            return run()
        finally:
            w._swap_data(stored)

    def __repr__(self):
        return f"GemmaRMSNorm({self.dim}, eps={self.eps})"


class GeGLU(Module):
    """GeGLU(dim, hidden): down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)),
    Gemma's MLP; Linear weights (in, out)."""

    def __init__(self, dim, hidden, *, init=None, rng=None):
        self.dim, self.hidden = int(dim), int(hidden)
        self.gate_proj = Linear(self.dim, self.hidden, bias=False, init=init, rng=rng)
        self.up_proj = Linear(self.dim, self.hidden, bias=False, init=init, rng=rng)
        self.down_proj = Linear(self.hidden, self.dim, bias=False, init=init, rng=rng)
        self.act = GELU(approximate="tanh")
        self._shape = None

    def forward(self, x):
        """x: float32 (..., dim) -> (..., dim)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        rows = x.reshape(-1, self.dim)
        g = self.gate_proj.forward(rows)
        self._u = self.up_proj.forward(rows)
        self._a = self.act.forward(g)
        if self._shape != x.shape:
            self._h = np.empty(g.shape, np.float32)
            self._shape = x.shape
        np.multiply(self._a, self._u, out=self._h)
        return self.down_proj.forward(self._h).reshape(x.shape)

    def backward(self, grad_out):
        """grad_out like the last output -> d loss / d x (None when
        needs_input_grad is False)."""
        if self._shape is None:
            raise RuntimeError("backward: call forward first")
        g = np.ascontiguousarray(grad_out, dtype=np.float32).reshape(-1, self.dim)
        dh = self.down_proj.backward(g)
        du = dh * self._a
        dgate = self.act.backward(dh * self._u)
        self.gate_proj.needs_input_grad = self.needs_input_grad
        self.up_proj.needs_input_grad = self.needs_input_grad
        dx = self.gate_proj.backward(dgate)
        dx_up = self.up_proj.backward(du)
        if dx is None:
            return None
        return (dx + dx_up).reshape(self._shape)


class WindowLayers:
    """A config whose layers are local (a sliding window) or global, as its
    sliding_layers flags say: Gemma 2's and Gemma 3's."""

    sliding_window: int | None
    sliding_layers: tuple[bool, ...] | None

    def is_sliding(self, layer: int) -> bool:
        """Whether layer attends over the sliding window (a local layer)."""
        assert self.sliding_layers is not None
        return self.sliding_layers[layer]

    def sliding_window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None


@dataclasses.dataclass(frozen=True)
class Gemma3Config(WindowLayers, LlamaConfig):
    """Gemma3Config(vocab_size, dim, n_layers, n_heads, n_kv_heads=None,
    ffn_dim=None, max_seq_len=131072, norm_eps=1e-6, rope_base=1000000.0,
    tie_embeddings=True, rope_scaling=None, qkv_bias=False, head_dim=None,
    query_pre_attn_scalar=256.0, sliding_window=4096, rope_local_base=10000.0,
    sliding_layers=None): Hugging Face's Gemma3TextConfig as LlamaConfig's
    fields (rope_base, rope_scaling: the global layers') and Gemma's own;
    head_dim None is dim // n_heads (Hugging Face's default, 256, is read from
    a checkpoint's config).
    sliding_layers: a tuple of bools, True where a layer is local
    (``layer_types``); None: five local to one global (HF's default pattern,
    layer i global when (i + 1) % 6 == 0)."""

    max_seq_len: int = 131072
    norm_eps: float = 1e-6
    rope_base: float = 1000000.0
    tie_embeddings: bool = True
    head_dim: int | None = None  # type: ignore[assignment]  # a field here, not the property
    query_pre_attn_scalar: float = 256.0
    sliding_window: int | None = 4096
    rope_local_base: float = 10000.0
    sliding_layers: tuple[bool, ...] | None = None
    explicit_head_dim: ClassVar[bool] = True
    llama_cpp_permutes_qk: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.qkv_bias:
            raise ValueError("qkv_bias: a Gemma 3 has no biases on its projections")
        if not self.tie_embeddings:
            raise ValueError("tie_embeddings: a Gemma 3's head is its token embedding")
        if self.sliding_layers is None:
            object.__setattr__(self, "sliding_layers", tuple(
                bool((i + 1) % 6) for i in range(self.n_layers)))
        layers = tuple(bool(v) for v in self.sliding_layers)   # type: ignore[union-attr]
        if len(layers) != self.n_layers:
            raise ValueError(f"sliding_layers: expected {self.n_layers} flags (one per layer), "
                             f"got {len(layers)}")
        object.__setattr__(self, "sliding_layers", layers)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window: expected >= 1 or None, got {self.sliding_window}")
        if not self.query_pre_attn_scalar > 0:
            raise ValueError(f"query_pre_attn_scalar: expected > 0, got "
                             f"{self.query_pre_attn_scalar}")
        if not (math.isfinite(self.rope_local_base) and self.rope_local_base > 1):
            raise ValueError(f"rope_local_base: expected a finite number > 1, got "
                             f"{self.rope_local_base}")
        if self.rope_scaling is not None and not self.rope_scaling.truncate:
            raise ValueError("rope_scaling: truncate=False is computed by neither transformers "
                             "(which reads it only at the top of a Gemma 3's per-layer-type "
                             "rope_parameters, where it never is) nor llama.cpp")

    @property
    def qk_norm(self) -> bool:
        """Each head normalises its q and k: True for every Gemma 3."""
        return True



class Gemma3DecoderLayer(Module):
    """Gemma 3's block with its four norms (see ggmlopt.models.gemma3)."""

    _shape = None

    def __init__(self, config: Gemma3Config, rng, layer: int = 0):
        init = normal_init(INIT_STD)
        local = config.is_sliding(layer)
        d, eps = config.dim, config.norm_eps
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.self_attn = CausalSelfAttention(
            d, config.n_heads, config.n_kv_heads,
            rope_base=config.rope_local_base if local else config.rope_base,
            rope_scaling=None if local else config.rope_scaling, bias=False, out_bias=False,
            init=init, rng=rng, head_dim=config.head_dim, qk_norm=True, norm_eps=eps,
            sliding_window=config.sliding_window_of(layer), norm_class=GemmaRMSNorm,
            query_pre_attn_scalar=config.query_pre_attn_scalar)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.mlp = GeGLU(d, config.ffn_dim, init=init, rng=rng)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)

    def forward(self, x, pos=0):
        """x: float32 (batch, T, dim) -> (batch, T, dim), a buffer the block reuses."""
        if x.shape != self._shape:
            self._h, self._y = np.empty(x.shape, np.float32), np.empty(x.shape, np.float32)
            self._shape = x.shape
        a = self.self_attn.forward(self.input_layernorm.forward(x), pos)
        np.add(x, self.post_attention_layernorm.forward(a), out=self._h)
        m = self.mlp.forward(self.pre_feedforward_layernorm.forward(self._h))
        return np.add(self._h, self.post_feedforward_layernorm.forward(m), out=self._y)

    def backward(self, grad_out):
        """grad_out (batch, T, dim) -> d loss / d x, a new array (the sums go
        into the norms' new input gradients), or None when needs_input_grad is
        False."""
        g = self.post_feedforward_layernorm.backward(grad_out)
        grads_ready(self.post_feedforward_layernorm)
        g = self.mlp.backward(g)
        grads_ready(self.mlp)
        dh = self.pre_feedforward_layernorm.backward(g)
        dh = np.add(grad_out, dh, out=dh)
        grads_ready(self.pre_feedforward_layernorm)
        g = self.post_attention_layernorm.backward(dh)
        grads_ready(self.post_attention_layernorm)
        dx = attention_input_grad(self, self.input_layernorm, self.self_attn, g)
        return None if dx is None else np.add(dh, dx, out=dx)

    def decode(self, x, cache_k, cache_v, pos):
        """forward for t new positions at pos.., reading and extending the cache."""
        b, t, d = x.shape
        rows = self.input_layernorm.forward(x).reshape(b * t, d)
        a = cached_self_attention(self.self_attn, rows, b, t, pos, cache_k, cache_v)
        h = x + self.post_attention_layernorm.forward(a)
        m = self.mlp.forward(self.pre_feedforward_layernorm.forward(h))
        return h + self.post_feedforward_layernorm.forward(m)


class GemmaLM(Llama):
    """What every Gemma adds to Llama's model: token embeddings scaled by
    sqrt(hidden_size) (HF's embed_scale, a float32) and Gemma's final norm;
    Gemma, Gemma 2 and Gemma 3 differ in their blocks.  config_class: the
    config a subclass takes (TypeError for another)."""

    config_class: ClassVar[type[LlamaConfig]] = LlamaConfig

    def __init__(self, config: LlamaConfig, *, seed: int = 0):
        if not isinstance(config, self.config_class):
            raise TypeError(f"config: expected a {self.config_class.__name__}, got "
                            f"{type(config).__name__}")
        super().__init__(config, seed=seed)
        self.norm = GemmaRMSNorm(config.dim, config.norm_eps)
        self._embed_scale = np.float32(math.sqrt(config.dim))

    def _embed(self, tokens):
        h = self.embed_tokens.forward(tokens)
        np.multiply(h, self._embed_scale, out=h)
        return h

    def _hidden(self, tokens, pos=0):
        return self.norm.forward(self._blocks_forward(self.layers, self._embed(tokens), pos))

    def _hidden_backward(self, dh):
        g = self.norm.backward(dh)
        grads_ready(self.norm)
        g = self._blocks_backward(self.layers, g)
        if g is not None:
            self.embed_tokens.backward(g * self._embed_scale)
        grads_ready(self.embed_tokens)

    def _decode_hidden(self, tokens, cache):
        pos = cache.length
        h = np.array(self._embed(tokens), copy=True)
        for layer, k, v in zip(self.layers, cache.k, cache.v):
            h = layer.decode(h, k, v, pos)
        return self.norm.forward(h)

    def __repr__(self):
        return f"{type(self).__name__}({self.config})"


class Gemma3(GemmaLM):
    """Gemma3(config, *, seed=0): a Gemma 3 text model (config a Gemma3Config).
    Parameters as Hugging Face's Gemma3ForCausalLM names them (without
    ``model.``): Llama's with ``layers.{i}.pre_feedforward_layernorm``,
    ``post_feedforward_layernorm`` and the attention's ``q_norm`` / ``k_norm``;
    the norms' weights are Gemma's (the scale is 1 + weight)."""

    layer_class = Gemma3DecoderLayer
    config_class = Gemma3Config


# ---- the family: its Hugging Face config and llama.cpp's gemma3 architecture ---------

# Gemma 3's text config.json (model_type gemma3_text)
_HF_KEYS = (LLAMA_KEYS - {"hidden_act", "mlp_bias", "pretraining_tp"}) | {
    "hidden_activation", "query_pre_attn_scalar", "sliding_window", "sliding_window_pattern",
    "_sliding_window_pattern",
    "layer_types", "rope_local_base_freq", "final_logit_softcapping", "attn_logit_softcapping",
    "use_bidirectional_attention", "cache_implementation",
}


def _from_hf(hf: Mapping[str, Any], where: str) -> Gemma3Config:
    check_keys(hf, _HF_KEYS, "gemma3_text")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise ValueError(f"{key}: soft-capping (Gemma 2's) is not implemented, got "
                             f"{hf[key]}")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: only causal attention is supported")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias: a Gemma 3 with biases is not supported")
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation: only gelu_pytorch_tanh is supported, got {act!r}")
    no_dropout(hf, ("attention_dropout",), where)
    n_layers = hf["num_hidden_layers"]
    max_len = hf.get("max_position_embeddings", 131072)
    # transformers 5: rope_parameters per layer type; 4.x: rope_theta, rope_local_base_freq
    # and rope_scaling (the global layers')
    params = hf.get("rope_parameters") or {}
    flat = sorted(set(params) - {"full_attention", "sliding_attention"})
    if flat:
        raise ValueError(f"rope_parameters: a Gemma 3's are given per layer type "
                         f"(full_attention, sliding_attention), got {flat} beside them, which "
                         f"transformers ignores; move them into full_attention")
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    theta = full.pop("rope_theta", hf.get("rope_theta", 1000000.0))
    local_theta = local.pop("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    if local.get("rope_type", "default") != "default" or len(set(local) - {"rope_type"}):
        raise ValueError(f"rope_parameters: the local layers' RoPE must be plain, got {local}")
    legacy = hf.get("rope_scaling") or {}
    if "type" in legacy and "rope_type" not in legacy:
        # transformers 4 applied it to the global layers, transformers 5 ignores it
        raise ValueError(f"rope_scaling: {legacy} names its kind by the old key 'type', which "
                         f"transformers 5 ignores on a Gemma 3 (4.x applied it); rename it "
                         f"'rope_type' to scale the global layers, or remove it")
    if full and legacy and ({k: v for k, v in legacy.items() if k not in ("type", "rope_theta")}
                            != full):
        raise ValueError(f"rope_scaling {legacy} and rope_parameters {full} disagree")
    legacy_theta(legacy, theta,
                 "rope_theta" in hf or "rope_theta" in (params.get("full_attention") or {}))
    scaling_hf = dict(full or legacy)
    if scaling_hf.get("truncate", True) is False:
        # transformers looks for truncate at the top of rope_parameters, which a Gemma 3
        # nests by layer type: it computes YaRN truncated whatever the config says
        warnings.warn(f"{where}: rope truncate=False has no effect on a Gemma 3 in transformers "
                      "(nor in llama.cpp): computed truncated, as they do", UserWarning,
                      stacklevel=3)
        scaling_hf.pop("truncate")
    scaling = RopeScaling.from_hf(scaling_hf, max_len)
    if scaling is not None:
        max_len = scaling.context_length(max_len)
    types = hf.get("layer_types")
    if types is None:
        # transformers reads sliding_window_pattern alone (its own _sliding_window_pattern
        # is a copy it keeps for old code, ignored when a config is read)
        pattern = hf.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(n_layers)]
    if any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ValueError(f"layer_types: expected sliding_attention or full_attention, got "
                         f"{sorted(set(types))}")
    scalar = hf.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, numbers.Real) \
            or not float(scalar).is_integer():   # (transformers' config refuses it)
        raise ValueError(f"query_pre_attn_scalar: expected an int, as transformers' Gemma 3 "
                         f"config reads it, got {scalar!r}")
    if "sliding_window" in hf and hf["sliding_window"] is None and \
            "sliding_attention" in types[:n_layers]:
        raise ValueError("sliding_window: null, with sliding_attention layers: transformers' "
                         "Gemma 3 cannot run them (it finds no window); give the window")
    return Gemma3Config(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=n_layers,
        n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads", 4),
        ffn_dim=hf["intermediate_size"], max_seq_len=max_len,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_base=float(theta),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), rope_scaling=scaling,
        head_dim=hf.get("head_dim", 256),
        query_pre_attn_scalar=float(scalar),
        sliding_window=hf.get("sliding_window", 4096), rope_local_base=float(local_theta),
        sliding_layers=tuple(t == "sliding_attention" for t in types))


def _to_hf(cfg: Gemma3Config) -> dict[str, Any]:
    if not float(cfg.query_pre_attn_scalar).is_integer():
        raise ValueError(f"model: query_pre_attn_scalar={cfg.query_pre_attn_scalar} has no "
                         "Hugging Face form (transformers' Gemma 3 config takes an int)")
    if cfg.sliding_window is None and any(cfg.sliding_layers or ()):
        raise ValueError("model: its local layers have no window (sliding_window None), "
                         "which transformers' Gemma 3 cannot run; give a window, or make "
                         "every layer global (sliding_layers all False)")
    family = llama_hf_config(cfg)
    del family["hidden_act"], family["rope_scaling"], family["rope_theta"]
    full = {"rope_type": "default", "rope_theta": cfg.rope_base} if cfg.rope_scaling is None \
        else {**cfg.rope_scaling.to_hf(), "rope_theta": cfg.rope_base}
    return {**family, "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh",
            # transformers' field is an int (256 in every release)
            "query_pre_attn_scalar": int(cfg.query_pre_attn_scalar),
            # (transformers' Gemma 3 builds its sliding mask whatever the layers: with
            # every layer global, any window, which none reads)
            "sliding_window": 4096 if cfg.sliding_window is None else cfg.sliding_window,
            "layer_types": ["sliding_attention" if s else "full_attention"
                            for s in cfg.sliding_layers or ()],
            "rope_parameters": {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": cfg.rope_local_base}},
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "attention_bias": False, "attention_dropout": 0.0,
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}


def _gguf_fields(fields, key, head_dim, where) -> dict[str, Any]:
    """A gemma3 file's window, local layers, local RoPE base and attention scale
    (llama.cpp scales by head_dim ** -0.5, by (dim / heads) ** -0.5 at 62 layers)."""
    if key("final_logit_softcapping", 0.0, required=False):
        raise ValueError(f"{where}: final-logit soft-capping is not implemented")
    n_layers = key("block_count")
    window = key("attention.sliding_window", 0, required=False)
    pattern = fields.get("gemma3.attention.sliding_window_pattern", 6)
    if not window:
        sliding: tuple[bool, ...] = (False,) * n_layers
    elif isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ValueError(f"{where}: gemma3.attention.sliding_window_pattern has "
                             f"{len(pattern)} entries for {n_layers} layers")
        sliding = tuple(bool(v) for v in pattern)
    else:   # llama.cpp's set_swa_pattern(n): every n-th layer dense (0: none)
        n = int(pattern)
        sliding = tuple(n == 0 or bool((i + 1) % n) for i in range(n_layers))
    dim, heads = key("embedding_length"), key("attention.head_count")
    scalar = dim // heads if n_layers == 62 else head_dim
    return {"sliding_window": int(window) if window else None, "sliding_layers": sliding,
            "rope_local_base": shortest_float(key("rope.freq_base_swa", 10000.0,
                                                  required=False)),
            "query_pre_attn_scalar": float(scalar)}


def _gguf_write(writer, cfg: Gemma3Config, arch: str) -> None:
    # a window with no local layer is written as none: llama.cpp's gemma3 with a
    # window needs a local layer (a context over such a file stops the process on
    # an assertion); without one every layer is global, as here
    if cfg.sliding_window is not None and any(cfg.sliding_layers or ()):
        writer.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
        writer.add_array(f"{arch}.attention.sliding_window_pattern",
                         [bool(v) for v in cfg.sliding_layers or ()])
    writer.add_float32(f"{arch}.rope.freq_base_swa", cfg.rope_local_base)


def _gguf_check(cfg: Gemma3Config) -> None:
    """ValueError for a Gemma 3 llama.cpp's gemma3 would compute otherwise."""
    scalar = cfg.dim // cfg.n_heads if cfg.n_layers == 62 else cfg.head_dim
    if cfg.query_pre_attn_scalar != scalar:
        raise ValueError(f"model: llama.cpp's gemma3 scales the scores by {scalar} ** -0.5 "
                         f"(head_dim, or dim / heads at 62 layers); this Gemma 3's "
                         f"query_pre_attn_scalar is {cfg.query_pre_attn_scalar} (save_hf keeps it)")
    if cfg.sliding_window is None and any(cfg.sliding_layers or ()) \
            and (cfg.rope_local_base != cfg.rope_base or cfg.rope_scaling is not None):
        raise ValueError("model: without a window llama.cpp's gemma3 treats every layer as "
                         "global (one RoPE base, the rope scaling on every layer); this "
                         "Gemma 3's local layers have their own base or no scaling "
                         "(save_hf keeps it)")
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type != "linear":
        raise ValueError(f"model: llama.cpp's gemma3 takes linear rope scaling only, got "
                         f"{cfg.rope_scaling.rope_type!r} (save_hf keeps it)")


def _parameter_shapes(config: Gemma3Config) -> list[tuple[str, tuple[int, ...]]]:
    d, f, hd = config.dim, config.ffn_dim, config.head_dim
    assert f is not None and config.n_kv_heads is not None and hd is not None
    kv, q = config.n_kv_heads * hd, config.n_heads * hd
    return with_layers(config, [
        ("input_layernorm.weight", (d,)), ("self_attn.q_proj.weight", (d, q)),
        ("self_attn.k_proj.weight", (d, kv)), ("self_attn.v_proj.weight", (d, kv)),
        ("self_attn.o_proj.weight", (q, d)), ("self_attn.q_norm.weight", (hd,)),
        ("self_attn.k_norm.weight", (hd,)),
        ("post_attention_layernorm.weight", (d,)), ("pre_feedforward_layernorm.weight", (d,)),
        ("mlp.gate_proj.weight", (d, f)), ("mlp.up_proj.weight", (d, f)),
        ("mlp.down_proj.weight", (f, d)), ("post_feedforward_layernorm.weight", (d,))])


# llama.cpp's names of the four norms of Gemma 2's and Gemma 3's blocks (the one Llama
# calls post_attention_layernorm, before the MLP, is their pre_feedforward_layernorm)
FOUR_NORM_GGUF_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                        "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}

# llama.cpp's gemma3: norm weights stored as 1 + w, four norms a block, its window, which
# layers are local and their RoPE base
FAMILY = Family("gemma3", Gemma3, Gemma3Config, hf_model_type="gemma3_text",
                hf_architecture="Gemma3ForCausalLM", from_hf=_from_hf, to_hf=_to_hf,
                hf_pad_default=0,
                gguf_arch="gemma3",
                gguf_keys=frozenset({"attention.sliding_window",
                                     "attention.sliding_window_pattern", "rope.freq_base_swa",
                                     "final_logit_softcapping"}),
                gguf_fields=_gguf_fields, gguf_write=_gguf_write, gguf_check=_gguf_check,
                gguf_names=FOUR_NORM_GGUF_NAMES,
                gguf_norm_offset=1.0, parameter_shapes=_parameter_shapes)
