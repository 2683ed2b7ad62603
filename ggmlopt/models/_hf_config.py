"""What the families' Hugging Face config readers and writers share: the keys
every PretrainedConfig carries, the Llama layout's keys and fields, and the
refusals (a key ggmlopt does not implement is refused, never dropped: dropping
it would compute another model than the checkpoint's)."""
from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from ..nn.rope_scaling import RopeScaling

__all__ = ["COMMON_KEYS", "LLAMA_KEYS", "check_keys", "llama_fields", "llama_hf_config",
           "no_dropout", "no_sliding_window"]

# PretrainedConfig's own keys: bookkeeping, generation defaults and flags that do not
# change a decoder-only model's forward pass (those that would are checked below)
COMMON_KEYS = frozenset({
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
    # structure flags, checked to hold their harmless value in check_keys
    "add_cross_attention", "cross_attention_hidden_size", "pruned_heads",
    "tie_word_embeddings",
    # the classes of a checkpoint's own code: transformers builds its native class of
    # model_type unless trust_remote_code, and so does ggmlopt
    "auto_map",
    # bookkeeping that published configs carry and transformers never reads: the label
    # count of 4.x configs (_num_labels, distilgpt2), a 4.x training flag, and
    # nanotron's marker on SmolLM2's llama configs
    "_num_labels", "gradient_checkpointing", "is_llama_config",
})
LLAMA_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias",
    "attention_dropout", "mlp_bias", "head_dim", "pretraining_tp", "rope_interleaved",
})


def check_keys(hf: Mapping[str, Any], known: frozenset[str], kind: str) -> None:
    """Refuse a config key ggmlopt does not implement: dropping one silently
    would give another model than the checkpoint's."""
    unknown = sorted(k for k in hf if k not in known and k not in COMMON_KEYS)
    if unknown:
        raise ValueError(f"keys {unknown} of a {kind!r} config are not implemented by "
                         f"ggmlopt; refusing the checkpoint rather than computing another "
                         "model than it describes")
    if hf.get("rope_interleaved"):
        # nanotron's flag (SmolLM2's configs carry it false): transformers never reads it
        # and rotates halves; a true one describes another model than transformers runs
        raise ValueError("rope_interleaved: an interleaved rotary embedding is not "
                         "supported (transformers rotates halves)")
    if hf.get("quantization_config"):
        raise ValueError("quantization_config: quantized Hugging Face checkpoints are not read")
    if hf.get("add_cross_attention") or hf.get("pruned_heads"):
        raise ValueError("add_cross_attention, pruned_heads: a plain decoder only")


def no_dropout(hf: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    """Warn about dropout rates the model does not apply (its forward pass is the
    same; training is not)."""
    rates = {k: hf[k] for k in keys if hf.get(k)}
    if rates:
        warnings.warn(f"{where}: {rates}: ggmlopt's model applies no dropout there (the "
                      "forward pass is the same; training differs from one with dropout, "
                      "and save_hf writes the model as it is: without these rates)",
                      UserWarning, stacklevel=5)


def no_sliding_window(hf: Mapping[str, Any], *, window_default: int | None = 4096,
                      sliding: Sequence[bool] | None = None) -> None:
    """Refuse sliding-window attention on any layer, the layers laid out as
    transformers lays them out: layer_types when the file has them, else, with
    use_sliding_window and a window, on the layers of sliding (the family's
    rule: SmolLM3's NoPE layers), by default from layer max_window_layers on
    (Qwen2, Qwen3).  window_default: the family's sliding_window where the
    file has none."""
    layers = hf.get("layer_types")
    if layers is None and hf.get("use_sliding_window") \
            and hf.get("sliding_window", window_default) is not None:
        n = hf["num_hidden_layers"]
        if sliding is None:
            first = hf.get("max_window_layers", 28)   # Qwen2Config's default
            sliding = [i >= first for i in range(n)]
        on = [i for i, s in enumerate(sliding[:n]) if s]
        if on:
            raise ValueError(f"use_sliding_window: sliding-window attention (on layers "
                             f"{on[:4]}{' ...' if len(on) > 4 else ''}) is not supported")
    if layers is not None and any(t != "full_attention" for t in layers):
        raise ValueError(f"layer_types: only full_attention layers are supported, got "
                         f"{sorted(set(layers))}")


def legacy_theta(legacy: Mapping[str, Any], theta: float, given: bool) -> None:
    """Refuses a rope_theta inside rope_scaling unless it is the base the model
    gets anyway (theta: the top-level or rope_parameters' one, given, else the
    family's default): transformers 5 reads it over the top-level one,
    transformers 4 ignored it, so the two disagree on such a file."""
    if "rope_theta" in legacy and float(legacy["rope_theta"]) != float(theta):
        raise ValueError(
            f"rope_scaling: its rope_theta {legacy['rope_theta']} differs from the model's "
            f"rope_theta {theta}{'' if given else ' (the default: none given)'}: transformers "
            f"5 reads the one inside rope_scaling, transformers 4 the other; give the base once "
            f"(the top-level rope_theta, or rope_parameters)")


def _rope_kind_named(params: Mapping[str, Any], *drop: str) -> dict[str, Any]:
    """A rope dict as transformers reads it, for comparing two: its kind under
    rope_type (the 4.x key 'type' where rope_type is absent), without drop."""
    out = {k: v for k, v in params.items() if k != "type" and k not in drop}
    if "type" in params and "rope_type" not in params:
        out["rope_type"] = params["type"]
    return out


def llama_fields(hf: Mapping[str, Any], where: str, head_dim_given: bool = False, *,
                 max_len: int = 2048, theta: float = 10000.0, eps: float = 1e-6,
                 kv_heads: int | None = None) -> dict[str, Any]:
    """The LlamaConfig fields of a Llama-layout config; head_dim_given: the
    family reads head_dim itself (Qwen3), else it must be hidden_size //
    num_attention_heads.  max_len, theta, eps, kv_heads: the family's
    transformers defaults where the file says nothing (kv_heads None: one
    key/value head per query head)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: only silu (Llama's SwiGLU) is supported, got {act!r}")
    no_dropout(hf, ("attention_dropout",), where)
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
    if params and legacy and (_rope_kind_named(legacy, "rope_theta")
                              != _rope_kind_named(params, "rope_theta")):
        raise ValueError(f"rope_scaling {legacy} and rope_parameters {params} disagree")
    # a top-level rope_theta beside rope_parameters' must agree with it; beside a
    # rope_scaling transformers 4 reads the top-level one (its default when absent)
    top = hf.get("rope_theta", theta)
    legacy_theta(legacy, params.get("rope_theta", top), "rope_theta" in hf or "rope_theta" in params)
    if "rope_theta" in params and (legacy or "rope_theta" in hf) and params["rope_theta"] != top:
        if legacy:
            raise ValueError(f"rope_parameters and rope_scaling are both given: transformers "
                             f"reads rope_scaling and the top-level rope_theta ({top}"
                             f"{'' if 'rope_theta' in hf else ', the default'}), not "
                             f"rope_parameters' rope_theta {params['rope_theta']}; keep one of "
                             f"the two")
        raise ValueError(f"rope_theta {top} and rope_parameters' {params['rope_theta']} disagree")
    theta = params.get("rope_theta", top)
    max_len = hf.get("max_position_embeddings", max_len)
    scaling = RopeScaling.from_hf(params or legacy, max_len)
    if scaling is not None:
        max_len = scaling.context_length(max_len)
    return {"vocab_size": hf["vocab_size"], "dim": dim, "n_layers": hf["num_hidden_layers"],
            "n_heads": heads, "n_kv_heads": hf.get("num_key_value_heads", kv_heads),
            "ffn_dim": hf["intermediate_size"], "max_seq_len": max_len,
            "norm_eps": float(hf.get("rms_norm_eps", eps)), "rope_base": float(theta),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "rope_scaling": scaling}


def llama_hf_config(cfg) -> dict[str, Any]:
    """The config.json keys the Llama layout's families share."""
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        # (a dynamic scaling's original length, which max_seq_len stretches)
        "max_position_embeddings": cfg.rope_scaling.original_max_position_embeddings
        if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "dynamic"
        else cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": None if cfg.rope_scaling is None else cfg.rope_scaling.to_hf(),
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "initializer_range": 0.02, "torch_dtype": "float32", "use_cache": True,
        # not LlamaConfig's 1 and 2 (another vocabulary's): where generation stops is
        # generation_config.json's, written from the tokenizer or the model's eog_ids
        "bos_token_id": None, "eos_token_id": None,
    }
