"""Hugging Face checkpoints: a ``config.json`` and a ``model.safetensors`` that
``transformers``' ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` load with
``from_pretrained``, written from and read into ggmlopt.models.

The mapping is the models' parameter names plus Hugging Face's prefix
(``model.`` for Llama, ``transformer.`` for GPT-2; ``lm_head.weight`` has none)
and one rule: a Llama's Linear weights are (in, out) here and (out, in) in
torch, so they are transposed; GPT-2's weights are (in, out) on both sides (its
Conv1D).  Needs only ``safetensors`` and ``json`` (the ``interop`` extra), never
``transformers`` itself.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any

import numpy as np

from .._optional import import_optional
from ..lora import refuse_adapters
from ..models import (
    GPT2,
    Gemma3,
    Gemma3Config,
    GPT2Config,
    Llama,
    LlamaConfig,
    Mistral,
    MistralConfig,
    Phi3,
    Phi3Config,
    Qwen2,
    Qwen2Config,
    Qwen3,
    Qwen3Config,
    SmolLM3,
    SmolLM3Config,
)
from ..nn.init import skip_init
from ..nn.linear import Linear
from ..nn.module import get_submodule, named_modules, set_submodule
from ..nn.quantized import QuantizedEmbedding, QuantizedLinear, refuse_quantized
from ..nn.rope_scaling import RopeScaling
from ._files import atomic_output

__all__ = ["load_hf", "save_hf"]

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


def _safetensors():
    return import_optional("safetensors.numpy", "interop", "Hugging Face checkpoints")


def _llama_family_config(cfg) -> dict[str, Any]:
    """The config.json keys a Llama-family model (Llama, Qwen2) shares."""
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": None if cfg.rope_scaling is None else cfg.rope_scaling.to_hf(),
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "initializer_range": 0.02, "torch_dtype": "float32", "use_cache": True,
    }


def _hf_config(model) -> dict[str, Any]:
    cfg = model.config
    if isinstance(model, Gemma3):
        family = _llama_family_config(cfg)
        del family["hidden_act"], family["rope_scaling"], family["rope_theta"]
        full = {"rope_type": "default", "rope_theta": cfg.rope_base} if cfg.rope_scaling is None \
            else {**cfg.rope_scaling.to_hf(), "rope_theta": cfg.rope_base}
        return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                **family, "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh",
                # transformers' field is an int (256 in every release)
                "query_pre_attn_scalar": int(cfg.query_pre_attn_scalar)
                if float(cfg.query_pre_attn_scalar).is_integer() else cfg.query_pre_attn_scalar,
                "sliding_window": cfg.sliding_window,
                "layer_types": ["sliding_attention" if s else "full_attention"
                                for s in cfg.sliding_layers],
                "rope_parameters": {"full_attention": full, "sliding_attention": {
                    "rope_type": "default", "rope_theta": cfg.rope_local_base}},
                "final_logit_softcapping": None, "attn_logit_softcapping": None,
                "attention_bias": False, "attention_dropout": 0.0,
                "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    if isinstance(model, Phi3):
        return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                **_llama_family_config(cfg), "sliding_window": cfg.sliding_window,
                "original_max_position_embeddings": cfg.original_max_seq_len,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0,
                # Phi3Config's defaults are Phi-3-mini's ids (32000 ...)
                "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    if isinstance(model, Mistral):
        return {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                **_llama_family_config(cfg), "head_dim": cfg.head_dim,
                "sliding_window": cfg.sliding_window,
                "bos_token_id": None, "eos_token_id": None}   # not MistralConfig's 1 and 2
    if isinstance(model, SmolLM3):
        return {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3",
                **_llama_family_config(cfg), "no_rope_layers": list(cfg.no_rope_layers),
                "no_rope_layer_interval": cfg.no_rope_layer_interval,
                "use_sliding_window": False, "attention_bias": False, "mlp_bias": False,
                # SmolLM3Config's defaults are the 3B's ids (128004 ...): not this vocabulary's
                "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    if isinstance(model, Qwen3):
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                **_llama_family_config(cfg), "head_dim": cfg.head_dim,
                "attention_bias": False, "use_sliding_window": False}
    if isinstance(model, Qwen2):
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                **_llama_family_config(cfg), "use_sliding_window": False}
    if isinstance(model, Llama):
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                **_llama_family_config(cfg), "head_dim": cfg.head_dim,
                "attention_bias": False, "mlp_bias": False}
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_embd": cfg.dim, "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads, "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len,
        "n_inner": None, "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "tie_word_embeddings": True, "torch_dtype": "float32", "use_cache": True,
    }


def _prefix(model) -> str:
    return "model." if isinstance(model, Llama) else "transformer."


def _tensor_map(model) -> list[tuple[str, Any, bool]]:
    """(Hugging Face name, Parameter, transposed) for every parameter."""
    transposed: set[int] = set()
    if isinstance(model, Llama):   # GPT-2's Conv1D weights are (in, out) like ours
        transposed = {id(m.weight) for _, m in named_modules(model) if isinstance(m, Linear)}
    prefix = _prefix(model)
    return [(name if name == "lm_head.weight" else prefix + name, p, id(p) in transposed)
            for name, p in model.named_parameters()]


def save_hf(model, directory) -> None:
    """Write model (a ggmlopt.models.Llama, Qwen2 or GPT2) to directory as a Hugging Face
    checkpoint: config.json and model.safetensors (float32), each atomically.
    The directory is created when missing.  transformers' from_pretrained then
    loads it with no missing or unexpected keys."""
    if not isinstance(model, (Llama, GPT2)):
        raise TypeError(f"model: expected a ggmlopt.models.Llama or GPT2, got "
                        f"{type(model).__name__}")
    refuse_adapters(model, "save_hf")
    refuse_quantized(model, "save_hf")
    st = _safetensors()
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"directory: {directory!r} is a file")
    os.makedirs(directory, exist_ok=True)
    tensors = {name: np.ascontiguousarray(p.data.T if t else p.data, dtype=np.float32)
               for name, p, t in _tensor_map(model)}
    with atomic_output(os.path.join(directory, WEIGHTS)) as tmp:
        st.save_file(tensors, tmp, metadata={"format": "pt"})
    with atomic_output(os.path.join(directory, CONFIG)) as tmp, open(tmp, "w") as f:
        json.dump(_hf_config(model), f, indent=2)
        f.write("\n")


def _read_config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"directory: no {CONFIG} in {directory!r}")
    with open(path) as f:
        return json.load(f)


# PretrainedConfig's own keys: bookkeeping, generation defaults and flags that do not
# change a decoder-only model's forward pass (those that would are checked below)
_COMMON_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "name_or_path",
    "_commit_hash", "_attn_implementation", "_attn_implementation_autoset", "dtype",
    "torch_dtype", "use_bfloat16", "use_cache", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "chunk_size_feed_forward", "is_encoder_decoder",
    "is_decoder", "tie_encoder_decoder", "id2label", "label2id", "num_labels",
    "problem_type", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "initializer_range", "max_length", "min_length",
    "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "tf_legacy_loss", "keys_to_ignore_at_inference", "output_router_logits",
    # structure flags, checked to hold their harmless value in _check_common
    "add_cross_attention", "cross_attention_hidden_size", "pruned_heads",
    "tie_word_embeddings",
})
_LLAMA_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias",
    "attention_dropout", "mlp_bias", "head_dim", "pretraining_tp",
})
# Qwen2's config: Llama's keys but the biases (fixed: q, k, v), plus its sliding window
# (refused when used) and the layer types it implies
_QWEN2_KEYS = (_LLAMA_KEYS - {"attention_bias", "mlp_bias", "pretraining_tp"}) | {
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
}
# Qwen3's: Qwen2's, with attention_bias (which must be False) and no pretraining_tp
_QWEN3_KEYS = _QWEN2_KEYS | {"attention_bias"}
# Mistral's: Llama's without the biases and pretraining_tp, with its sliding window
_MISTRAL_KEYS = (_LLAMA_KEYS - {"attention_bias", "mlp_bias", "pretraining_tp"}) | {
    "sliding_window"}
# Phi-3's: Mistral's with its dropouts (warned about when not zero) and the LongRoPE
# context (kept; LongRoPE itself is refused by the rope reader)
_PHI3_KEYS = _MISTRAL_KEYS | {"resid_pdrop", "embd_pdrop", "original_max_position_embeddings",
                              "partial_rotary_factor"}
# SmolLM3's: Llama's (no pretraining_tp) with its NoPE layers and the sliding window's keys
_SMOLLM3_KEYS = (_LLAMA_KEYS - {"pretraining_tp"}) | {
    "no_rope_layers", "no_rope_layer_interval", "use_sliding_window", "sliding_window",
    "layer_types",
}
# Gemma 3's text config (model_type gemma3_text)
_GEMMA3_KEYS = (_LLAMA_KEYS - {"hidden_act", "mlp_bias", "pretraining_tp"}) | {
    "hidden_activation", "query_pre_attn_scalar", "sliding_window", "sliding_window_pattern",
    "_sliding_window_pattern",
    "layer_types", "rope_local_base_freq", "final_logit_softcapping", "attn_logit_softcapping",
    "use_bidirectional_attention", "cache_implementation",
}
_GPT2_KEYS = frozenset({
    "vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_ctx", "n_inner",
    "activation_function", "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon",
    "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout", "n_special", "predict_special_tokens",
})


def _check_keys(hf: dict[str, Any], known: frozenset[str], kind: str) -> None:
    """Refuse a config key ggmlopt does not implement: dropping one silently
    would give another model than the checkpoint's."""
    unknown = sorted(k for k in hf if k not in known and k not in _COMMON_KEYS)
    if unknown:
        raise ValueError(f"keys {unknown} of a {kind!r} config are not implemented by "
                         f"ggmlopt; refusing the checkpoint rather than computing another "
                         "model than it describes")
    if hf.get("quantization_config"):
        raise ValueError("quantization_config: quantized Hugging Face checkpoints are not read")
    if hf.get("add_cross_attention") or hf.get("pruned_heads"):
        raise ValueError("add_cross_attention, pruned_heads: a plain decoder only")


def _no_dropout(hf: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    rates = {k: hf[k] for k in keys if hf.get(k)}
    if rates:
        warnings.warn(f"{where}: {rates}: ggmlopt's model applies no dropout there (the "
                      "forward pass is the same; training differs from one with dropout)",
                      UserWarning, stacklevel=4)


def _llama_from_hf(hf: dict[str, Any], where: str) -> Llama:
    _check_keys(hf, _LLAMA_KEYS, "llama")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention_bias, mlp_bias: only a Llama without biases is supported")
    return Llama(LlamaConfig(**_llama_fields(hf, where)))


def _qwen2_from_hf(hf: dict[str, Any], where: str) -> Qwen2:
    _check_keys(hf, _QWEN2_KEYS, "qwen2")
    _no_sliding_window(hf)
    # transformers' Qwen2Config defaults where the file says nothing
    return Qwen2(Qwen2Config(**_llama_fields(hf, where, max_len=32768)))


def _qwen3_from_hf(hf: dict[str, Any], where: str) -> Qwen3:
    _check_keys(hf, _QWEN3_KEYS, "qwen3")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias: a Qwen3 with biases is not supported")
    _no_sliding_window(hf)
    fields = _llama_fields(hf, where, head_dim_given=True, max_len=32768)
    return Qwen3(Qwen3Config(**fields, head_dim=hf.get("head_dim", 128)))   # HF's default


def _mistral_from_hf(hf: dict[str, Any], where: str) -> Mistral:
    _check_keys(hf, _MISTRAL_KEYS, "mistral")
    fields = _llama_fields(hf, where, head_dim_given=True, max_len=131072)
    # MistralConfig's default window is 4096: a config without the key has it
    window = hf.get("sliding_window", 4096)
    return Mistral(MistralConfig(**fields, head_dim=hf.get("head_dim"), sliding_window=window))


def _phi3_from_hf(hf: dict[str, Any], where: str) -> Phi3:
    _check_keys(hf, _PHI3_KEYS, "phi3")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor: only 1.0 (RoPE over the whole head) is "
                         f"supported, got {hf['partial_rotary_factor']}")
    _no_dropout(hf, ("resid_pdrop", "embd_pdrop"), where)
    fields = _llama_fields(hf, where, max_len=4096, eps=1e-5)
    return Phi3(Phi3Config(**fields, sliding_window=hf.get("sliding_window"),
                           original_max_seq_len=hf.get("original_max_position_embeddings",
                                                       4096)))


def _smollm3_from_hf(hf: dict[str, Any], where: str) -> SmolLM3:
    _check_keys(hf, _SMOLLM3_KEYS, "smollm3")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention_bias, mlp_bias: only a SmolLM3 without biases is supported")
    _no_sliding_window(hf)
    fields = _llama_fields(hf, where, max_len=32768, theta=2000000.0)   # HF's defaults
    fields["tie_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    layers = hf.get("no_rope_layers")
    n_layers = fields["n_layers"]
    if layers is not None and len(layers) > n_layers:   # HF: "at least" one per layer
        layers = layers[:n_layers]
    return SmolLM3(SmolLM3Config(**fields, no_rope_layers=None if layers is None else
                                 tuple(layers),
                                 no_rope_layer_interval=hf.get("no_rope_layer_interval", 4)))


def _gemma3_from_hf(hf: dict[str, Any], where: str) -> Gemma3:
    _check_keys(hf, _GEMMA3_KEYS, "gemma3_text")
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
    _no_dropout(hf, ("attention_dropout",), where)
    n_layers = hf["num_hidden_layers"]
    max_len = hf.get("max_position_embeddings", 131072)
    # transformers 5: rope_parameters per layer type; 4.x: rope_theta, rope_local_base_freq
    # and rope_scaling (the global layers')
    params = hf.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    theta = full.pop("rope_theta", hf.get("rope_theta", 1000000.0))
    local_theta = local.pop("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    if local.get("rope_type", "default") != "default" or len(set(local) - {"rope_type"}):
        raise ValueError(f"rope_parameters: the local layers' RoPE must be plain, got {local}")
    legacy = hf.get("rope_scaling") or {}
    if full and legacy and {k: v for k, v in legacy.items() if k != "type"} != full:
        raise ValueError(f"rope_scaling {legacy} and rope_parameters {full} disagree")
    scaling = RopeScaling.from_hf(full or legacy, max_len)
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(n_layers)]
    if any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ValueError(f"layer_types: expected sliding_attention or full_attention, got "
                         f"{sorted(set(types))}")
    return Gemma3(Gemma3Config(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=n_layers,
        n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads"),
        ffn_dim=hf["intermediate_size"], max_seq_len=max_len,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_base=float(theta),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), rope_scaling=scaling,
        head_dim=hf.get("head_dim", 256),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        sliding_window=hf.get("sliding_window", 4096), rope_local_base=float(local_theta),
        sliding_layers=tuple(t == "sliding_attention" for t in types)))


def _no_sliding_window(hf: dict[str, Any]) -> None:
    """Refuse sliding-window attention (Qwen2's and Qwen3's configs carry its keys)."""
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window: sliding-window attention is not supported")
    layers = hf.get("layer_types")
    if layers is not None and any(t != "full_attention" for t in layers):
        raise ValueError(f"layer_types: only full_attention layers are supported, got "
                         f"{sorted(set(layers))}")


def _llama_fields(hf: dict[str, Any], where: str, head_dim_given: bool = False, *,
                  max_len: int = 2048, theta: float = 10000.0,
                  eps: float = 1e-6) -> dict[str, Any]:
    """The LlamaConfig fields of a Llama-family config (Llama, Qwen2, Qwen3);
    head_dim_given: the family reads head_dim itself (Qwen3), else it must be
    hidden_size // num_attention_heads."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: only silu (Llama's SwiGLU) is supported, got {act!r}")
    _no_dropout(hf, ("attention_dropout",), where)
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    if not head_dim_given and hf.get("head_dim") not in (None, dim // heads):
        raise ValueError(f"head_dim: {hf['head_dim']} is not hidden_size // "
                         f"num_attention_heads = {dim // heads}")
    # transformers 5 writes rope_parameters (rope_theta inside it), 4.x rope_theta and
    # rope_scaling; both may be present
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters: expected a dict, got "  # noqa: TRY004
                         f"{type(params).__name__}")
    legacy = hf.get("rope_scaling") or {}
    if params and legacy and {k: v for k, v in legacy.items() if k != "type"} != {
            k: v for k, v in params.items() if k not in ("rope_theta", "type")}:
        raise ValueError(f"rope_scaling {legacy} and rope_parameters {params} disagree")
    theta = params.get("rope_theta", hf.get("rope_theta", theta))
    if "rope_theta" in params and "rope_theta" in hf and params["rope_theta"] != hf["rope_theta"]:
        raise ValueError(f"rope_theta {hf['rope_theta']} and rope_parameters' "
                         f"{params['rope_theta']} disagree")
    max_len = hf.get("max_position_embeddings", max_len)
    scaling = RopeScaling.from_hf(params or legacy, max_len)
    return {"vocab_size": hf["vocab_size"], "dim": dim, "n_layers": hf["num_hidden_layers"],
            "n_heads": heads, "n_kv_heads": hf.get("num_key_value_heads"),
            "ffn_dim": hf["intermediate_size"], "max_seq_len": max_len,
            "norm_eps": float(hf.get("rms_norm_eps", eps)), "rope_base": float(theta),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "rope_scaling": scaling}


def _gpt2_from_hf(hf: dict[str, Any], where: str) -> GPT2:
    _check_keys(hf, _GPT2_KEYS, "gpt2")
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
    n_ctx = hf.get("n_ctx")
    if n_ctx is not None and n_ctx != hf.get("n_positions", 1024):
        raise ValueError(f"n_ctx: {n_ctx} differs from n_positions {hf.get('n_positions')}")
    _no_dropout(hf, ("resid_pdrop", "embd_pdrop", "attn_pdrop"), where)
    return GPT2(GPT2Config(vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["n_layer"],
                           n_heads=hf["n_head"], max_seq_len=hf.get("n_positions", 1024),
                           norm_eps=float(hf.get("layer_norm_epsilon", 1e-5))))


def _model_from_config(hf: dict[str, Any], where: str):
    kind = hf.get("model_type")
    readers = {"llama": _llama_from_hf, "mistral": _mistral_from_hf, "phi3": _phi3_from_hf,
               "gemma3_text": _gemma3_from_hf,
               "qwen2": _qwen2_from_hf,
               "qwen3": _qwen3_from_hf,
               "smollm3": _smollm3_from_hf, "gpt2": _gpt2_from_hf}
    if kind not in readers:
        raise ValueError(f"{where}: model_type {kind!r} is not supported ({', '.join(readers)})")
    try:
        return readers[kind](hf, where)
    except KeyError as e:
        raise ValueError(f"{where}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _weight_files(directory: str) -> list[str]:
    single = os.path.join(directory, WEIGHTS)
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(os.path.join(directory, INDEX)):
        with open(os.path.join(directory, INDEX)) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(directory, name) for name in shards]
    else:
        raise FileNotFoundError(f"directory: no {WEIGHTS} (or {INDEX}) in {directory!r}")
    return files


def _read_tensors(directory: str) -> dict[str, np.ndarray]:
    st = _safetensors()
    tensors: dict[str, np.ndarray] = {}
    for path in _weight_files(directory):
        tensors.update(st.load_file(path))
    return tensors


# safetensors dtypes a mapped tensor is viewed as (bfloat16 as its raw 16-bit words)
_MAPPED = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def _mapped_tensors(directory: str) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (safetensors dtype, read-only view of the memory-mapped file)}: the
    format is an 8-byte header length, a JSON header (dtype, shape, data_offsets
    of each tensor) and the data."""
    out: dict[str, tuple[str, np.ndarray]] = {}
    for path in _weight_files(directory):
        raw = np.memmap(path, np.uint8, "r")
        try:
            n = int(raw[:8].view("<u8")[0])
            header = json.loads(bytes(raw[8:8 + n]).decode("utf-8"))
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a safetensors file ({e})") from None
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = info.get("dtype")
            if dtype not in _MAPPED:
                raise TypeError(f"{path}: tensor {name!r} has dtype {dtype}; expected floats")
            start, end = info["data_offsets"]
            view = raw[base + start:base + end].view(np.dtype(_MAPPED[dtype]).newbyteorder("<"))
            out[name] = (dtype, view.reshape(info["shape"]))
    return out


def _as_float32(dtype: str, array: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def _check_names(model, expected, tensors, where: str) -> None:
    """ValueError naming the tensors the model needs that the file lacks and
    those it holds that the model does not have (Hugging Face's buffers and a
    tied output aside)."""
    names = {name for name, _, _ in expected}
    ignored: tuple[str, ...] = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
    if isinstance(model, GPT2) or model.config.tie_embeddings:
        ignored += ("lm_head.weight",)
    missing = sorted(names - set(tensors))
    unexpected = sorted(k for k in tensors if k not in names and not k.endswith(ignored))
    if missing or unexpected:
        raise ValueError(f"{where}: does not match the {type(model).__name__} its config "
                         f"describes: missing {missing}, unexpected {unexpected}")


def _load_kept(directory: str, model, where: str):
    """load_hf's keep_types=True: every Linear weight and the token embedding
    over the mapped file's rows (torch's (out, in) layout is the rows a
    QuantizedLinear reads), the rest widened to float32."""
    tensors = _mapped_tensors(directory)
    expected = _tensor_map(model)
    ours = {id(p): name for name, p in model.named_parameters()}
    _check_names(model, expected, tensors, where)
    plan = []
    for name, p, transposed in expected:
        dtype, array = tensors[name]
        shape = array.T.shape if transposed else array.shape
        if shape != p.data.shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {array.shape}; expected "
                             f"{p.data.shape[::-1] if transposed else p.data.shape}")
        plan.append((ours[id(p)], p, dtype, array, transposed))
    for our_name, p, dtype, array, transposed in plan:
        module_name = our_name.rpartition(".")[0]
        if array.ndim == 2 and our_name.endswith(".weight"):
            old = get_submodule(model, module_name)
            qtype = "F32" if dtype == "F64" else dtype
            rows = np.ascontiguousarray(array.astype(np.float32)) if dtype == "F64" else array
            new: QuantizedLinear | QuantizedEmbedding
            if transposed:
                new = QuantizedLinear(rows, qtype, old.in_features, old.out_features,
                                      bias=old.bias)
            else:
                new = QuantizedEmbedding(rows, qtype, *p.data.shape)
            set_submodule(model, module_name, new)
        else:
            p.data[...] = _as_float32(dtype, array)
    return model


def load_hf(directory, *, keep_types=False):
    """A ggmlopt.models.Llama, Qwen2 or GPT2 from a Hugging Face checkpoint directory
    (config.json and model.safetensors, or a sharded model.safetensors.index.json),
    as save_hf or transformers' save_pretrained write them.

    Float16 tensors are widened to float32 (bfloat16 files need converting
    first).  A tied output (tie_word_embeddings) may be absent from the file;
    buffers Hugging Face keeps (rotary inv_freq, GPT-2's attention masks) are
    ignored.  Every tensor is checked (names, shapes) before the model is
    returned: ValueError names what is missing, unexpected or misshapen.

    keep_types=True (a Llama or Qwen2): every Linear weight and the token
    embedding stay as the file stores them (F32, F16 or BF16), read in place
    from the memory-mapped safetensors, as frozen QuantizedLinear /
    QuantizedEmbedding layers, for LoRA over them; norms and biases are
    float32 Parameters."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"directory: no such directory {directory!r}")
    if not isinstance(keep_types, (bool, np.bool_)):
        raise TypeError(f"keep_types: expected a bool, got {type(keep_types).__name__}")
    if keep_types:
        config = _read_config(directory)
        with skip_init():   # the weight matrices are replaced, never written
            model = _model_from_config(config, os.path.join(directory, CONFIG))
        if isinstance(model, GPT2):
            raise ValueError("keep_types: reads Llama-family checkpoints (GPT-2's Conv1D "
                             "weights are kept as float32: load it with keep_types=False)")
        return _load_kept(directory, model, os.path.join(directory, WEIGHTS))
    model = _model_from_config(_read_config(directory), os.path.join(directory, CONFIG))
    tensors = _read_tensors(directory)
    where = os.path.join(directory, WEIGHTS)
    expected = _tensor_map(model)
    _check_names(model, expected, tensors, where)
    values = []
    for name, p, transposed in expected:
        array = tensors[name]
        if array.dtype.kind != "f":
            raise TypeError(f"{where}: tensor {name!r} has dtype {array.dtype}; expected floats")
        array = array.T if transposed else array
        if array.shape != p.data.shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {tensors[name].shape}; "
                             f"expected {p.data.shape[::-1] if transposed else p.data.shape}")
        values.append((p, array))
    for p, array in values:
        p.data[...] = array
    return model
