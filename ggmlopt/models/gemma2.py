"""Gemma 2: Hugging Face's Gemma2ForCausalLM (gemma-2-2b, 9b, 27b and their -it
versions) as its delta from Llama.

From transformers' ``modeling_gemma2.py``, Gemma 3's block (``ggmlopt.models.gemma3``)
without its q/k norms:

- RMSNorm computing ``x / rms(x) * (1 + weight)``, four norms a block;
- GeGLU with the tanh GELU; token embeddings scaled by ``sqrt(hidden_size)`` (a float32);
- an explicit ``head_dim``, the scores scaled by ``query_pre_attn_scalar ** -0.5`` (256,
  the head width, in 2b and 9b; 144 = hidden / heads in 27b);
- the scores soft-capped before the softmax, ``s -> c * tanh(s / c)``
  (``attn_logit_softcapping``, 50), and so are the final logits
  (``final_logit_softcapping``, 30);
- local layers (a sliding window, 4096) and global ones (every key), alternating from a
  local first layer by default (``layer_types``), all with one RoPE (``rope_theta`` and
  the config's rope scaling on every layer);
- the head tied to the token embedding by default.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from .._dtypes import shortest_float
from ..nn.attention import CausalSelfAttention
from ._causal_lm import normal_init
from ._hf_config import LLAMA_KEYS, check_keys, llama_fields, llama_hf_config
from .config import LlamaConfig
from .family import Family
from .gemma3 import (
    FOUR_NORM_GGUF_NAMES,
    GeGLU,
    Gemma3DecoderLayer,
    GemmaLM,
    GemmaRMSNorm,
    WindowLayers,
)
from .llama import INIT_STD, with_layers

__all__ = ["FAMILY", "Gemma2", "Gemma2Config", "Gemma2DecoderLayer"]


def _cap(obj, name: str) -> None:
    """Check (and store as a float) the soft cap field name: None or a finite c > 0."""
    value = getattr(obj, name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected None or a float, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected None or a finite value > 0, got {value}")
    object.__setattr__(obj, name, value)


@dataclasses.dataclass(frozen=True)
class Gemma2Config(WindowLayers, LlamaConfig):
    """Gemma2Config(vocab_size, dim, n_layers, n_heads, n_kv_heads=None,
    ffn_dim=None, max_seq_len=8192, norm_eps=1e-6, rope_base=10000.0,
    tie_embeddings=True, rope_scaling=None, qkv_bias=False, head_dim=None,
    query_pre_attn_scalar=256.0, sliding_window=4096, sliding_layers=None,
    attn_logit_softcap=50.0, final_logit_softcap=30.0): Hugging Face's
    Gemma2Config as LlamaConfig's fields (rope_base and rope_scaling: every
    layer's) and Gemma 2's own.  head_dim None is dim // n_heads (Hugging
    Face's default, 256, is read from a checkpoint's config).
    sliding_layers: a tuple of bools, True where a layer is local
    (``layer_types``); None: local and global alternating, layer 0 local
    (transformers' default).  sliding_window: an int, as transformers' Gemma 2
    runs no config without one (every layer global: sliding_layers all False).
    attn_logit_softcap, final_logit_softcap: the caps c of the scores and of the
    final logits (``attn_logit_softcapping``, ``final_logit_softcapping``), None
    for none."""

    max_seq_len: int = 8192
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    head_dim: int | None = None  # type: ignore[assignment]  # a field here, not the property
    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 4096
    sliding_layers: tuple[bool, ...] | None = None
    attn_logit_softcap: float | None = 50.0
    final_logit_softcap: float | None = 30.0
    explicit_head_dim: ClassVar[bool] = True
    # llama.cpp's gemma2 rotates NeoX's halves, as Hugging Face does: rows as they are
    llama_cpp_permutes_qk: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.qkv_bias:
            raise ValueError("qkv_bias: a Gemma 2 has no biases on its projections")
        if self.sliding_layers is None:
            object.__setattr__(self, "sliding_layers", tuple(
                bool((i + 1) % 2) for i in range(self.n_layers)))
        if isinstance(self.sliding_layers, (str, bytes)) or \
                not hasattr(self.sliding_layers, "__len__"):
            raise TypeError(f"sliding_layers: expected a tuple of bools or None, got "
                            f"{type(self.sliding_layers).__name__}")
        layers = tuple(bool(v) for v in self.sliding_layers)   # type: ignore[union-attr]
        if len(layers) != self.n_layers:
            raise ValueError(f"sliding_layers: expected {self.n_layers} flags (one per layer), "
                             f"got {len(layers)}")
        object.__setattr__(self, "sliding_layers", layers)
        window = self.sliding_window
        if window is None:
            # transformers builds the local layers' mask even when no layer is local
            raise ValueError("sliding_window: expected an int >= 1, got None, which "
                             "transformers' Gemma 2 refuses too (every layer global: "
                             "sliding_layers all False)")
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(f"sliding_window: expected an int, got {type(window).__name__}")
        if window < 1:
            raise ValueError(f"sliding_window: expected an int >= 1, got {window}")
        object.__setattr__(self, "sliding_window", int(window))
        scalar = self.query_pre_attn_scalar
        if isinstance(scalar, bool) or not isinstance(scalar, numbers.Real):
            raise TypeError(f"query_pre_attn_scalar: expected a float, got "
                            f"{type(scalar).__name__}")
        if not (math.isfinite(scalar) and scalar > 0):
            raise ValueError(f"query_pre_attn_scalar: expected a finite value > 0, got {scalar}")
        object.__setattr__(self, "query_pre_attn_scalar", float(scalar))
        _cap(self, "attn_logit_softcap")
        _cap(self, "final_logit_softcap")



class Gemma2DecoderLayer(Gemma3DecoderLayer):
    """Gemma 2's block: Gemma 3's four norms, attention and GeGLU (its forward,
    backward and decode), without q/k norms, one RoPE on every layer, and the
    scores soft-capped."""

    def __init__(self, config: Gemma2Config, rng, layer: int = 0):
        init = normal_init(INIT_STD)
        d, eps = config.dim, config.norm_eps
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.self_attn = CausalSelfAttention(
            d, config.n_heads, config.n_kv_heads, rope_base=config.rope_base,
            rope_scaling=config.rope_scaling, bias=False, out_bias=False, init=init, rng=rng,
            head_dim=config.head_dim, sliding_window=config.sliding_window_of(layer),
            query_pre_attn_scalar=config.query_pre_attn_scalar,
            logit_softcap=config.attn_logit_softcap)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.mlp = GeGLU(d, config.ffn_dim, init=init, rng=rng)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)


class Gemma2(GemmaLM):
    """Gemma2(config, *, seed=0): a Gemma 2 model (config a Gemma2Config).
    Parameters as Hugging Face's Gemma2ForCausalLM names them (without
    ``model.``): Llama's with ``layers.{i}.pre_feedforward_layernorm`` and
    ``post_feedforward_layernorm``; the norms' weights are Gemma's (the scale
    is 1 + weight); ``lm_head.weight`` only when the head is untied.  The
    final logits are capped by ``final_logit_softcap``, the model's attribute
    set from its config."""

    layer_class = Gemma2DecoderLayer
    config_class = Gemma2Config

    def __init__(self, config: Gemma2Config, *, seed: int = 0):
        super().__init__(config, seed=seed)
        self.final_logit_softcap = config.final_logit_softcap


# ---- the family: its Hugging Face config and llama.cpp's gemma2 architecture ----------

# transformers' Gemma2Config, and what published configs carry beside it: 4.x's
# hidden_act (never read by a Gemma 2: its MLP computes hidden_activation), the
# sliding_window_size of gemma-2-9b's first config (read by no release) and the
# generation's cache_implementation ("hybrid")
_HF_KEYS = (LLAMA_KEYS - {"mlp_bias", "pretraining_tp", "rope_interleaved"}) | {
    "hidden_activation", "query_pre_attn_scalar", "sliding_window", "sliding_window_size",
    "layer_types", "final_logit_softcapping", "attn_logit_softcapping",
    "use_bidirectional_attention", "cache_implementation"}
_TANH_GELU = "gelu_pytorch_tanh"


def _hf_cap(hf: Mapping[str, Any], key: str, default: float) -> float | None:
    value = hf.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{key}: expected a number or null, got {value!r}")
    return float(value)


def _from_hf(hf: Mapping[str, Any], where: str) -> Gemma2Config:
    check_keys(hf, _HF_KEYS, "gemma2")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: only causal attention is supported")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias: a Gemma 2 with biases is not supported")
    act = hf.get("hidden_activation", _TANH_GELU)
    if act != _TANH_GELU:
        raise ValueError(f"hidden_activation: only gelu_pytorch_tanh is supported, got {act!r}")
    if hf.get("hidden_act") not in (None, _TANH_GELU):
        # transformers' Gemma 2 computes hidden_activation and never reads hidden_act: a
        # config whose two disagree is not clear about its model
        raise ValueError(f"hidden_act: {hf['hidden_act']!r}, where transformers' Gemma 2 "
                         f"computes hidden_activation ({act!r}); only gelu_pytorch_tanh is "
                         f"supported")
    head_dim = hf.get("head_dim", 256)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim: expected an int, got {head_dim!r}")
    n_layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window", 4096)
    if "sliding_window_size" in hf and hf["sliding_window_size"] != window:
        raise ValueError(f"sliding_window_size: {hf['sliding_window_size']}, but "
                         f"sliding_window (what transformers reads) is {window}")
    types = hf.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                 for i in range(n_layers)]
    if any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ValueError(f"layer_types: expected sliding_attention or full_attention, got "
                         f"{sorted(set(types))}")
    scalar = hf.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, numbers.Real):
        raise TypeError(f"query_pre_attn_scalar: expected a number, got {scalar!r}")
    if not float(scalar).is_integer():   # (transformers' config refuses it)
        raise ValueError(f"query_pre_attn_scalar: expected an int, as transformers' Gemma 2 "
                         f"config reads it, got {scalar!r}")
    # the Llama layout's RoPE keys (rope_parameters, or 4.x's rope_theta and rope_scaling),
    # one rotary embedding for every layer as transformers' Gemma 2 has; the activation
    # was checked above
    fields = llama_fields({k: v for k, v in hf.items() if k != "hidden_act"}, where,
                          head_dim_given=True, max_len=8192, theta=10000.0, eps=1e-6,
                          kv_heads=4)
    fields["tie_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    return Gemma2Config(
        **fields, head_dim=head_dim, query_pre_attn_scalar=float(scalar),
        sliding_window=window, sliding_layers=tuple(t == "sliding_attention" for t in types),
        attn_logit_softcap=_hf_cap(hf, "attn_logit_softcapping", 50.0),
        final_logit_softcap=_hf_cap(hf, "final_logit_softcapping", 30.0))


def _to_hf(cfg: Gemma2Config) -> dict[str, Any]:
    if not float(cfg.query_pre_attn_scalar).is_integer():
        raise ValueError(f"model: query_pre_attn_scalar={cfg.query_pre_attn_scalar} has no "
                         "Hugging Face form (transformers' Gemma 2 config takes an int)")
    family = llama_hf_config(cfg)
    del family["hidden_act"]   # Llama's silu; a Gemma 2's is hidden_activation
    return {**family, "head_dim": cfg.head_dim, "hidden_activation": _TANH_GELU,
            "query_pre_attn_scalar": int(cfg.query_pre_attn_scalar),
            "sliding_window": cfg.sliding_window,
            "layer_types": ["sliding_attention" if s else "full_attention"
                            for s in cfg.sliding_layers or ()],
            "attn_logit_softcapping": cfg.attn_logit_softcap,
            "final_logit_softcapping": cfg.final_logit_softcap,
            "attention_bias": False, "attention_dropout": 0.0}


def _llama_cpp_scalar(n_layers: int, dim: int, n_heads: int, head_dim: int) -> int:
    """The query_pre_attn_scalar llama.cpp's gemma2 computes with: dim / heads for
    its 27B (46 layers), head_dim otherwise (its f_attention_scale)."""
    return dim // n_heads if n_layers == 46 else head_dim


def _gguf_fields(fields, key, head_dim, where) -> dict[str, Any]:
    """A gemma2 file's window, local layers, soft caps and attention scale, with
    llama.cpp's defaults for the keys its converter leaves out (a window of 4096,
    every other layer local from layer 0, caps 50 and 30)."""
    n_layers = key("block_count")
    pattern = fields.get("gemma2.attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ValueError(f"{where}: gemma2.attention.sliding_window_pattern has "
                             f"{len(pattern)} entries for {n_layers} layers")
        sliding = tuple(bool(v) for v in pattern)
    else:   # llama.cpp's set_swa_pattern(n): every n-th layer global (0: none)
        n = int(pattern)
        sliding = tuple(n == 0 or i % n < n - 1 for i in range(n_layers))
    window = key("attention.sliding_window", 4096, required=False)
    if not window:
        if any(sliding):
            raise ValueError(f"{where}: gemma2.attention.sliding_window is 0, which masks "
                             "every key of the local layers in llama.cpp")
        window = 4096   # no local layer reads it: llama.cpp's default, as a config needs one
    base = key("rope.freq_base", 10000.0, required=False)
    local_base = key("rope.freq_base_swa", base, required=False)
    if np.float32(local_base) != np.float32(base):
        raise ValueError(f"{where}: gemma2.rope.freq_base_swa = {local_base} differs from "
                         f"rope.freq_base = {base}: a Gemma 2 has one RoPE base")
    caps = {name: shortest_float(key(name, default, required=False))
            for name, default in (("attn_logit_softcapping", 50.0),
                                  ("final_logit_softcapping", 30.0))}
    scalar = _llama_cpp_scalar(n_layers, key("embedding_length"), key("attention.head_count"),
                               head_dim)
    return {"sliding_window": int(window), "sliding_layers": sliding,
            "query_pre_attn_scalar": float(scalar),
            "attn_logit_softcap": caps["attn_logit_softcapping"],
            "final_logit_softcap": caps["final_logit_softcapping"]}


def _gguf_write(writer, cfg: Gemma2Config, arch: str) -> None:
    writer.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    writer.add_array(f"{arch}.attention.sliding_window_pattern",
                     [bool(v) for v in cfg.sliding_layers or ()])
    assert cfg.attn_logit_softcap is not None and cfg.final_logit_softcap is not None
    writer.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcap)
    writer.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcap)


def _gguf_check(cfg: Gemma2Config) -> None:
    """ValueError for a Gemma 2 llama.cpp's gemma2 would compute otherwise."""
    assert cfg.head_dim is not None
    scalar = _llama_cpp_scalar(cfg.n_layers, cfg.dim, cfg.n_heads, cfg.head_dim)
    if cfg.query_pre_attn_scalar != scalar:
        raise ValueError(f"model: llama.cpp's gemma2 scales the scores by {scalar} ** -0.5 "
                         f"(head_dim, or dim / heads at 46 layers); this Gemma 2's "
                         f"query_pre_attn_scalar is {cfg.query_pre_attn_scalar} (save_hf "
                         f"keeps it)")
    for name in ("attn_logit_softcap", "final_logit_softcap"):
        if getattr(cfg, name) is None:
            raise ValueError(f"model: llama.cpp's gemma2 always soft-caps (50 and 30 by "
                             f"default); this Gemma 2 has {name}=None (save_hf keeps it)")
    if not any(cfg.sliding_layers or ()):
        # llama.cpp's gemma2 always has local layers: a context over a file without
        # one stops the process on an assertion (no error a caller could catch)
        raise ValueError("model: llama.cpp's gemma2 always has local (sliding-window) layers; "
                         "every layer of this Gemma 2 is global, which llama.cpp cannot load "
                         "(save_hf keeps it)")
    if not cfg.tie_embeddings:
        # its output is the token embedding's tensor; an output.weight fails to load
        raise ValueError("model: llama.cpp's gemma2 takes its head from the token embedding; "
                         "this Gemma 2's is untied (tie_embeddings=False; save_hf keeps it)")


def _parameter_shapes(config: Gemma2Config) -> list[tuple[str, tuple[int, ...]]]:
    d, f, hd = config.dim, config.ffn_dim, config.head_dim
    assert f is not None and config.n_kv_heads is not None and hd is not None
    kv, q = config.n_kv_heads * hd, config.n_heads * hd
    return with_layers(config, [
        ("input_layernorm.weight", (d,)), ("self_attn.q_proj.weight", (d, q)),
        ("self_attn.k_proj.weight", (d, kv)), ("self_attn.v_proj.weight", (d, kv)),
        ("self_attn.o_proj.weight", (q, d)),
        ("post_attention_layernorm.weight", (d,)), ("pre_feedforward_layernorm.weight", (d,)),
        ("mlp.gate_proj.weight", (d, f)), ("mlp.up_proj.weight", (d, f)),
        ("mlp.down_proj.weight", (f, d)), ("post_feedforward_layernorm.weight", (d,))])


# llama.cpp's gemma2: Gemma 3's tensor names and 1 + w norms, its window, which layers
# are local, the two soft caps; the head always the token embedding
FAMILY = Family("gemma2", Gemma2, Gemma2Config, hf_model_type="gemma2",
                hf_architecture="Gemma2ForCausalLM", from_hf=_from_hf, to_hf=_to_hf,
                hf_pad_default=0,
                gguf_arch="gemma2",
                gguf_keys=frozenset({"attention.sliding_window",
                                     "attention.sliding_window_pattern", "rope.freq_base_swa",
                                     "attn_logit_softcapping", "final_logit_softcapping"}),
                gguf_fields=_gguf_fields, gguf_write=_gguf_write, gguf_check=_gguf_check,
                gguf_names=FOUR_NORM_GGUF_NAMES,
                gguf_norm_offset=1.0, parameter_shapes=_parameter_shapes)
