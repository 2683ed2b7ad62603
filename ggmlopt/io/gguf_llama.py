"""A Llama as llama.cpp's GGUF files hold it, both ways.

The writer does what llama.cpp's ``convert_hf_to_gguf.py`` does for a
``LlamaForCausalLM``: general.architecture ``llama`` with every hyperparameter
key llama.cpp reads, llama.cpp's tensor names (ggmlopt.io.llama_names), the
q/k rows permuted to llama.cpp's rotary order, no ``output.weight`` when the
output is tied to the token embedding, and the tokenizer as a ``gpt2``-type
vocabulary.  The reader takes any llama-architecture GGUF (F32, F16, BF16 or
a quantized type gguf-py dequantizes) back to a ggmlopt.models.Llama.

The other families of the Llama layout (Qwen2, Qwen3, SmolLM3, Phi-3, Gemma 3:
llama.cpp's qwen2, qwen3, ... architectures) go through the same code: what
differs (their extra keys, tensor names, norm offsets, what llama.cpp cannot
hold) is each family's own, in ggmlopt.models.<family> (its ``FAMILY``), found
through ggmlopt.models.registry; this module names no family.

ByteTokenizer's vocabulary: token i < 256 is byte i written as GPT-2's
byte-to-unicode string (what a byte-level BPE vocabulary stores), token 256
``<|endoftext|>``.  llama.cpp wants merges for a ``gpt2`` vocabulary and
gguf-py writes no empty array, so there is one merge, ``a 1``, which never
applies: GPT-2's pre-tokenizer (``tokenizer.ggml.pre`` = ``gpt-2``) never
leaves a letter and a digit in one word.  So llama.cpp tokenizes any text to
its UTF-8 bytes, ByteTokenizer's ids.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import kernels_quant
from ..models import Llama, LlamaConfig
from ..models.llama import llama_parameter_shapes
from ..models.registry import FAMILIES, family_for_gguf, family_of, gguf_archs
from ..nn.init import skip_init
from ..nn.module import get_submodule, set_submodule
from ..nn.quantized import QuantizedEmbedding, QuantizedLinear, quantized_layers
from ..nn.rope_scaling import RopeScaling, rope_inv_freq
from ._files import atomic_output, input_path, output_path
from ._gguf_common import (
    model_file_items,
    refuse_adapter_file,
    shortest_float,
    stored,
)
from ._gguf_length import gguf_truncation
from ._gguf_tokenizer import BYTE_MERGES, byte_vocabulary, tokenizer_from_fields
from ._gguf_tokenizer_keys import tokenizer_keys
from ._gguf_write import quantized_rows, save_dtype_arg, warn_fallbacks, write_rest
from ._quant_mix import FILE_TYPES, is_70b, tensor_type
from .gguf_metadata import GgufMetadata
from .gguf_reader import GgufFile
from .llama_names import gguf_name, permute_qk, unpermute_qk

__all__ = ["BYTE_MERGES", "LLAMA_ARCH", "LLAMA_FAMILY", "LlamaGguf", "arch_of", "byte_vocabulary", "file_architecture",
           "load_gguf_tokenizer", "load_llama_gguf", "save_llama_gguf", "tokenizer_from_fields"]

LLAMA_ARCH = "llama"
# llama.cpp's architectures this module writes and reads (the registry's families of
# the llama layout: llama, qwen2, qwen3, smollm3, phi3, gemma3)
LLAMA_FAMILY = gguf_archs("llama")


def arch_of(model) -> str:
    """llama.cpp's general.architecture for a Llama-family model."""
    arch = family_of(model).gguf_arch
    assert arch is not None
    return arch


# keys save_llama_gguf writes; metadata may not set them
_RESERVED_PREFIXES = ("general.architecture", "general.file_type", "general.quantization_version",
                      *sorted(f"{arch}." for arch in LLAMA_FAMILY), "tokenizer.", "GGUF.")


def _gguf():
    from ._gguf_common import gguf_module as imported
    return imported()


# ---- writing ----

def _kv_heads(config: LlamaConfig) -> int:
    n = config.n_kv_heads
    assert n is not None  # LlamaConfig fills it in
    return n


def _linear_weight(name: str, weight: np.ndarray, config: LlamaConfig) -> np.ndarray:
    """A Linear's (in, out) weight as llama.cpp's (out, in) rows, q/k permuted
    for the llama architecture."""
    rows = np.ascontiguousarray(weight.T)
    if not config.llama_cpp_permutes_qk:   # qwen2, qwen3: Hugging Face's row order
        return rows
    if name.endswith("q_proj.weight"):
        return permute_qk(rows, config.n_heads)
    if name.endswith("k_proj.weight"):
        return permute_qk(rows, _kv_heads(config))
    return rows


def _gguf_arrays(model: Llama, dtype) -> list[tuple[str, np.ndarray, Any]]:
    """(llama.cpp name, array in ggml's row order, raw ggml type or None) for
    every tensor: Parameters stored in dtype (a block type for the matrices),
    weights kept in their file's types (QuantizedLinear, QuantizedEmbedding)
    written as they are."""
    gguf = _gguf()
    params = dict(model.named_parameters())
    arch = arch_of(model)
    offset = family_of(model).gguf_norm_offset
    cfg = model.config
    seventy_b = is_70b(arch, cfg.n_layers, cfg.n_heads, _kv_heads(cfg))
    out = []
    fallbacks: list[str] = []
    for name, _ in _parameter_shapes(model.config):
        p = params.get(name)
        if p is None:   # a weight kept as its file stored it
            layer = get_submodule(model, name[:-len(".weight")])
            rows = layer.qweight
            if model.config.llama_cpp_permutes_qk and name.endswith(("q_proj.weight",
                                                                     "k_proj.weight")):
                heads = model.config.n_heads if name.endswith("q_proj.weight") else \
                    _kv_heads(model.config)
                rows = np.ascontiguousarray(rows[permute_qk(np.arange(rows.shape[0]), heads)])
            t = gguf.GGMLQuantizationType[layer.qtype]
            raw = None if layer.qtype in ("F32", "F16") else t
            out.append((gguf_name(name, arch), rows.view(np.uint8) if raw is not None else rows,
                        raw))
            continue
        data = p.data
        if offset and data.ndim == 1:   # llama.cpp's gemma3 stores 1 + weight
            data = data + np.float32(offset)
        if data.ndim == 2 and name != "embed_tokens.weight":
            data = _linear_weight(name, data, model.config)
        data = np.ascontiguousarray(data, dtype=np.float32)
        if isinstance(dtype, str) and data.ndim == 2:
            tensor = gguf_name(name, arch)
            if not np.isfinite(data).all():
                raise ValueError(f"model: {name} holds a non-finite value; it cannot be "
                                 f"quantized to {dtype}")
            qtype, preferred = tensor_type(dtype, tensor, data.shape[1], model.config.n_layers,
                                           tied=model.lm_head is None, is_70b=seventy_b)
            head = tensor == "output.weight" or (tensor == "token_embd.weight"
                                                  and model.lm_head is None)
            # (a head too narrow for Q6_K keeps 8 bits, its usual place in small models)
            if qtype != preferred and not (head and qtype == "Q8_0"):
                fallbacks.append(f"{tensor} {preferred} -> {qtype}")
            array, raw = quantized_rows(gguf, name, data, qtype)
            out.append((tensor, array, raw))
        else:
            out.append((gguf_name(name, arch), stored(name, data, np.dtype(np.float32)
                                                if isinstance(dtype, str) else dtype), None))
    warn_fallbacks(fallbacks, dtype)
    return out


def save_llama_gguf(model, path, *, tokenizer, dtype=np.float32, metadata=None,
                    name: str | None = None) -> None:
    """Write a ggmlopt.models.Llama (or Qwen2: llama.cpp's qwen2 architecture, with
    its q/k/v biases and rows as they are) to path as llama.cpp's GGUF (atomically).

    tokenizer: the ByteTokenizer, BPETokenizer or SPMTokenizer the model was trained with
    (its token count must be the model's vocab_size), or a Hugging Face checkpoint's
    HFTokenizer (load_hf_tokenizer): written as llama.cpp's converter writes its
    tokenizer.json (byte-level BPE with a pre-tokenizer llama.cpp names, or
    SentencePiece's BPE with byte fallback, scores ordering the merges as the file
    does; ggmlopt.io._hf_gguf_vocab), a model with more rows than tokens padded
    with unused ``[PAD<id>]`` tokens; ValueError for one llama.cpp would tokenize
    otherwise (an unknown pre-tokenizer, a Metaspace one, ...).  dtype: np.float32 or
    np.float16 for the matrices (the token embedding and the Linear weights),
    or a file type as llama-quantize names it ("q8_0", "q4_0", "q4_1", "q5_0",
    "q5_1", "q4_k_s", "q4_k_m" or "q4_k", "q5_k_s", "q5_k_m" or "q5_k",
    "q6_k", "bf16"): each matrix gets the block type llama-quantize gives it
    under that file type (the head Q6_K, half of the value and down
    projections Q6_K under the _M mixes, a smaller block or f16 for rows that
    are not whole blocks, with a warning; ggmlopt.io._quant_mix), quantized to
    the bytes llama-quantize writes; the norm weights stay float32 as llama.cpp
    wants.  Weights a model keeps in their file's types (``load_gguf(...,
    keep_types=True)``) are written as they are, whatever dtype says.  metadata: extra
    keys (str -> bool, int, float or str) other than general.architecture,
    general.file_type, general.alignment, llama.* and tokenizer.*; its
    general.name, a str, is the name.  name: general.name (None: the source
    file's, else "ggmlopt-llama"); a Phi-3 vocabulary's name must hold "phi3"
    or "phi-3" (see _name_for_vocabulary).

    A model read by load_gguf carries its file's own key-values
    (``model.gguf_metadata``: general.* such as the license and base model,
    and, when the tokenizer written has the file's vocabulary, the
    tokenizer.* keys this writer does not set itself, e.g. the padding id):
    they are written back unless metadata or the writer sets the same key.

    Raises TypeError for another model or tokenizer; ValueError for a
    tokenizer whose size is not vocab_size (an HFTokenizer's: more than
    vocab_size), an HFTokenizer llama.cpp would tokenize otherwise, or a weight
    beyond float16's range.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"model: expected a ggmlopt.models.Llama, got {type(model).__name__}")
    family = family_of(model)
    carried = getattr(model, "gguf_metadata", None)
    if isinstance(metadata, Mapping) and "general.name" in metadata:
        # the name the file gets (metadata's keys are written last): checked as name= is
        name = metadata["general.name"]
        if not isinstance(name, str):
            raise TypeError(f"metadata: 'general.name' must be a str (llama.cpp reads a "
                            f"string), got {type(name).__name__}")
        metadata = {k: v for k, v in metadata.items() if k != "general.name"}
    chosen = name is not None or bool(carried and "general.name" in carried)
    if name is None:
        name = str(carried.get("general.name", "ggmlopt-llama")) if carried else "ggmlopt-llama"
    if isinstance(name, str):   # (model_file_items names a name of another type)
        name = _name_for_vocabulary(name, tokenizer, chosen)
    items = model_file_items(model, name, metadata, _RESERVED_PREFIXES)
    dtype = save_dtype_arg(dtype)
    path = output_path(path)
    cfg = model.config
    tok = tokenizer_keys(tokenizer, cfg.vocab_size)
    gguf = _gguf()
    arch = arch_of(model)
    family.gguf_check(cfg)   # what llama.cpp's architecture cannot hold: refused (or warned)
    arrays = _gguf_arrays(model, dtype)
    rope_keys, rope_tensors = _rope_scaling_out(cfg, arch)
    arrays.extend((tensor_name, data, None) for tensor_name, data in rope_tensors)
    file_type = _file_type(gguf, model, dtype, carried, arrays)
    _warn_kept_as_they_are(model, dtype, arrays)

    with atomic_output(path) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            writer.add_name(name)
            writer.add_file_type(file_type)
            writer.add_vocab_size(cfg.vocab_size)
            writer.add_context_length(cfg.max_seq_len)
            writer.add_embedding_length(cfg.dim)
            writer.add_block_count(cfg.n_layers)
            writer.add_feed_forward_length(cfg.ffn_dim)
            writer.add_head_count(cfg.n_heads)
            writer.add_head_count_kv(cfg.n_kv_heads)
            writer.add_layer_norm_rms_eps(cfg.norm_eps)
            writer.add_rope_freq_base(cfg.rope_base)
            writer.add_rope_dimension_count(getattr(cfg, "rotary_dim", cfg.head_dim))
            for key, value in rope_keys:
                if isinstance(value, str):
                    writer.add_string(key, value)
                else:
                    writer.add_float32(key, value)
            writer.add_key_length(cfg.head_dim)
            writer.add_value_length(cfg.head_dim)
            family.gguf_write(writer, cfg, arch)   # the family's own keys
            write_rest(writer, gguf, tok, tokenizer, items, arrays, carried)
        finally:
            writer.close()


def _matrix_types(arrays) -> list[str]:
    """The ggml type names of the written matrices (2-D tensors), in order."""
    return [raw.name if raw is not None else "F32" if array.dtype == np.float32 else "F16"
            for _, array, raw in arrays if array.ndim == 2]


def _dtype_types(model, arrays) -> set[str]:
    """The types dtype's quantization gave the matrices that were not kept."""
    kept = {name for name, _ in quantized_layers(model)}
    arch = arch_of(model)
    kept_gguf = {gguf_name(name + ".weight", arch) for name in kept}
    return {t for (name, array, _), t in zip([a for a in arrays if a[1].ndim == 2],
                                             _matrix_types(arrays))
            if name not in kept_gguf}


def _warn_kept_as_they_are(model, dtype, arrays) -> None:
    """A warning when a file type is asked for and weights kept in their file's
    types are written in others than it gives (an F16 base under dtype='q4_k_m':
    written as F16, as save_gguf's docstring says, which the label alone hides)."""
    if not isinstance(dtype, str):
        return
    kept = [layer.qtype for _, layer in quantized_layers(model)]
    allowed = _dtype_types(model, arrays) | {FILE_TYPES[dtype][1]}
    other = sorted({t for t in kept if t not in allowed})
    if other:
        counts = ", ".join(f"{kept.count(t)} {t}" for t in other)
        warnings.warn(f"dtype: {dtype!r} quantizes the float32 weights; {counts} weight "
                      f"matrices kept in their file's types (load_gguf(..., keep_types=True)) "
                      f"are written as they are, not in {dtype}'s types: load the model with "
                      f"keep_types=False to write every matrix in them", UserWarning,
                      stacklevel=4)


def _file_type(gguf, model, dtype, carried, arrays):
    """general.file_type as llama-quantize labels a file: when every weight
    matrix is kept in its source file's types (written as it was), the
    source's own label (llama.cpp names a mix, Q4_K_M, not its most common
    type); else the file type dtype asks for, when no kept weight is written
    in another type than it gives; else, beside kept weights, the written
    matrices' most common type (a K type as its _M mix, dtype's own label
    where that is its type); else F32 or F16 by dtype."""
    types = gguf.LlamaFileType
    kept = [layer.qtype for _, layer in quantized_layers(model)]
    from_float = any(p.data.ndim == 2 for _, p in model.named_parameters()) \
        if kept else True
    source = getattr(carried, "file_type", None)
    if kept and not from_float and source in set(types):
        return types(source)
    if isinstance(dtype, str):
        allowed = _dtype_types(model, arrays) | {FILE_TYPES[dtype][1]}
        if all(t in allowed for t in kept):
            return getattr(types, FILE_TYPES[dtype][0])
        written = _matrix_types(arrays)
        common = max(sorted(set(written)), key=written.count)
        if common == FILE_TYPES[dtype][1]:
            return getattr(types, FILE_TYPES[dtype][0])
        if common == "F32":
            return types.ALL_F32
        common = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}.get(common, common)
        return getattr(types, "MOSTLY_" + common, getattr(types, FILE_TYPES[dtype][0]))
    if kept:
        # the written matrices' most common type, the float ones (a merge's) counted
        floats = sum(p.data.ndim == 2 for _, p in model.named_parameters())
        written = kept + ["float"] * floats
        common = max(sorted(set(written)), key=written.count)
        common = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}.get(common, common)
        if hasattr(types, "MOSTLY_" + common):
            return getattr(types, "MOSTLY_" + common)
    return types.ALL_F32 if dtype == np.float32 else types.MOSTLY_F16


# the llama.cpp architectures of ggmlopt's families that read a rope_freqs tensor
_ROPE_FREQS_ARCHS = frozenset({LLAMA_ARCH})


def _rope_scaling_out(cfg: LlamaConfig, arch: str):
    """(<arch>.* rope keys, [(tensor name, float32 array)]) for a config's
    scaling, as llama.cpp's convert_hf_to_gguf writes them: linear as
    rope.scaling.type/factor, Llama 3's as the per-frequency factors tensor
    (theta_i = base^(-2i/d) / factor_i in llama.cpp), a Phi-3's LongRoPE as its
    long and short factor tensors and rope.scaling.attn_factor."""
    from ..nn.rope_scaling import default_inv_freq, rope_inv_freq
    scaling = cfg.rope_scaling
    if scaling is None:
        return [], []
    if scaling.rope_type == "linear":
        return [(f"{arch}.rope.scaling.type", "linear"),
                (f"{arch}.rope.scaling.factor", scaling.factor)], []
    if scaling.rope_type in ("llama3", "freq_factors"):
        if arch not in _ROPE_FREQS_ARCHS:
            raise ValueError(f"model: its {scaling.rope_type!r} rope scaling is written as "
                             f"llama.cpp's rope_freqs tensor, which its {arch} architecture "
                             f"does not read (the file would not load there); save_hf keeps it")
        if scaling.freq_factors is not None:
            return [], [("rope_freqs.weight", np.asarray(scaling.freq_factors, np.float32))]
        inv, _ = rope_inv_freq(cfg.head_dim, cfg.rope_base, scaling)
        base = default_inv_freq(cfg.head_dim, cfg.rope_base)
        return [], [("rope_freqs.weight",
                     (base.astype(np.float64) / inv.astype(np.float64)).astype(np.float32))]
    if scaling.rope_type == "longrope" and arch == "phi3":
        original = scaling.original_max_position_embeddings
        config_original = getattr(cfg, "original_max_seq_len", original)
        if original != config_original:
            raise ValueError(f"model: its LongRoPE switches at {original} positions, its config's "
                             f"original_max_seq_len (llama.cpp's phi3.rope.scaling."
                             f"original_context_length) is {config_original}")
        _, attention = rope_inv_freq(getattr(cfg, "rotary_dim", cfg.head_dim), cfg.rope_base,
                                     scaling)
        warnings.warn(f"model: llama.cpp takes LongRoPE's long factors for every position of "
                      f"a context (n_ctx) over {original}, where this model and transformers "
                      f"take them for a pass over {original} positions only: run it there with "
                      f"n_ctx <= {original} for the same logits", UserWarning, stacklevel=4)
        return [(f"{arch}.rope.scaling.attn_factor", attention)], [
            ("rope_factors_long.weight", np.asarray(scaling.long_factor, np.float32)),
            ("rope_factors_short.weight", np.asarray(scaling.short_factor, np.float32))]
    why = {"yarn": "llama.cpp computes YaRN differently",
           "longrope": "llama.cpp picks LongRoPE's factors by its context size, not by each "
                       "pass's positions as transformers does"}.get(scaling.rope_type,
                                                                     "llama.cpp has no form of it")
    raise ValueError(f"model: its {scaling.rope_type!r} rope scaling is not written to GGUF "
                     f"({why}); save_hf keeps it")


# ---- reading ----

# the <arch>.* keys the reader implements (each checked or used in _config)
_ARCH_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.freq_base",
    "rope.dimension_count", "vocab_size", "expert_count", "expert_used_count",
    "rope.scaling.type", "rope.scaling.factor",
})
def _longrope_in(fields, tensors, key, scaling, arch, where):
    """scaling, or a Phi-3's LongRoPE from its rope_factors_long/short tensors
    and rope.scaling.attn_factor (1 without it, as llama.cpp reads it).  llama.cpp
    takes the long factors for a whole context over the original length; ggmlopt,
    as transformers, for a pass over it."""
    found = {n: tensors.get(f"rope_factors_{n}.weight") for n in ("long", "short")}
    if all(t is None for t in found.values()):
        attention = key("rope.scaling.attn_factor", 1.0, required=False)
        if float(attention) != 1.0:
            # llama.cpp scales the rotated q and k by it on every layer, factors or not
            raise ValueError(f"{where}: {arch}.rope.scaling.attn_factor = {attention} without "
                             "LongRoPE's rope_factors_long/short tensors is not supported "
                             "(llama.cpp scales q and k by it)")
        return scaling
    if any(t is None for t in found.values()) or scaling is not None or arch != "phi3":
        raise ValueError(f"{where}: LongRoPE's factors are read as a phi3 file's "
                         "rope_factors_long.weight and rope_factors_short.weight together, "
                         "and alone")
    factors = {n: tuple(float(f) for f in t[1].float32(f"rope_factors_{n}.weight").ravel())
               for n, t in found.items()}
    return RopeScaling("longrope", short_factor=factors["short"], long_factor=factors["long"],
                       original_max_position_embeddings=int(
                           key("rope.scaling.original_context_length")),
                       attention_factor=float(key("rope.scaling.attn_factor", 1.0,
                                                  required=False)))


def _config(fields: dict[str, Any], tensors: dict[str, Any], where: str,
            arch: str = LLAMA_ARCH) -> LlamaConfig:
    """The config (its family's config class) a Llama-layout file's
    keys (and its tensors) describe."""
    def key(name, default=None, required=True):
        value = fields.get(f"{arch}.{name}", default)
        if value is None and required:
            raise ValueError(f"{where}: missing key '{arch}.{name}'")
        if isinstance(value, list):
            if value and all(v == value[0] for v in value):
                return value[0]   # a per-layer array with one value
            raise ValueError(f"{where}: key '{arch}.{name}' varies by layer ({value}); "
                             "not supported")
        return value

    family = family_for_gguf(arch)
    assert family is not None
    known = _ARCH_KEYS | family.gguf_keys
    unknown = sorted(k for k in fields if k.startswith(arch + ".")
                     and k[len(arch) + 1:] not in known)
    if unknown:
        # a key that changes the model and is dropped gives another model without a word
        raise ValueError(f"{where}: keys {unknown} are not implemented by ggmlopt's {arch}; "
                         "refusing the file rather than computing another model than it "
                         "describes")
    dim = key("embedding_length")
    n_heads = key("attention.head_count")
    n_kv_heads = key("attention.head_count_kv", n_heads)
    head_dim = dim // n_heads if isinstance(dim, int) and isinstance(n_heads, int) and n_heads \
        else None
    head_dim_given = bool(getattr(family.config_class, "explicit_head_dim", False))
    if not head_dim_given and arch == LLAMA_ARCH and \
            key("attention.key_length", head_dim, required=False) != head_dim:
        # heads wider or narrower than embedding_length // head_count (Mistral Nemo's
        # 128 of 5120 / 32): transformers' MistralConfig holds a head_dim, Llama's not
        family = next(f for f in FAMILIES if f.name == "mistral")
        head_dim_given = True
    if head_dim_given:   # qwen3, a Mistral: the head width is the file's key_length
        head_dim = key("attention.key_length", head_dim, required=False)
    partial = "partial_rotary_factor" in {f.name for f in dataclasses.fields(family.config_class)}
    for name in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        if name == "rope.dimension_count" and partial:
            continue   # the family reads it (a Phi-3's rotary share)
        value = key(name, head_dim, required=False)
        if value != head_dim:
            raise ValueError(f"{where}: '{arch}.{name}' = {value}, but a Llama here has "
                             f"embedding_length // head_count = {head_dim} (not supported)")
    if key("expert_count", 0, required=False) or key("expert_used_count", 0, required=False):
        raise ValueError(f"{where}: a mixture of experts ({arch}.expert_count > 0) is not "
                         "supported")
    scaling_type = key("rope.scaling.type", None, required=False)
    factor = key("rope.scaling.factor", 0.0, required=False)
    scaling = None
    if scaling_type == "linear":
        scaling = RopeScaling("linear", float(key("rope.scaling.factor")))
    elif scaling_type is None:
        # llama.cpp reads a missing type as linear: a factor other than 0 or 1 scales
        # (an explicit "none" never does)
        if float(factor) not in (0.0, 1.0):
            scaling = RopeScaling("linear", float(factor))
    elif scaling_type != "none":
        raise ValueError(f"{where}: rope scaling {scaling_type!r} is not supported (none, "
                         "linear, or Llama 3's rope_freqs tensor)")
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:
        if arch not in _ROPE_FREQS_ARCHS:
            # (llama.cpp refuses such a file: "wrong number of tensors")
            raise ValueError(f"{where}: a rope_freqs.weight tensor, which llama.cpp's {arch} "
                             "architecture does not read (its llama does)")
        if scaling is not None:
            raise ValueError(f"{where}: both llama.rope.scaling.type and rope_freqs.weight")
        data = freqs[1].float32("rope_freqs.weight").ravel()   # (ne, the GgufFile)
        scaling = RopeScaling("freq_factors", freq_factors=tuple(float(f) for f in data))
    scaling = _longrope_in(fields, tensors, key, scaling, arch, where)
    embd = tensors.get("token_embd.weight")
    vocab = fields.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if isinstance(tokens, list) else \
            (int(embd[0][1]) if embd is not None and len(embd[0]) == 2 else None)
    if vocab is None:
        raise ValueError(f"{where}: no vocabulary size ({arch}.vocab_size, tokenizer.ggml.tokens "
                         "or token_embd.weight)")
    config_class = family.config_class
    given: dict[str, Any] = {"head_dim": head_dim} if head_dim_given else {}
    given.update(family.gguf_fields(fields, key, head_dim, where))
    try:
        return config_class(
            vocab_size=vocab, dim=dim, n_layers=key("block_count"), n_heads=n_heads,
            n_kv_heads=n_kv_heads, ffn_dim=key("feed_forward_length"),
            max_seq_len=key("context_length"),
            norm_eps=shortest_float(key("attention.layer_norm_rms_epsilon")),
            rope_base=shortest_float(key("rope.freq_base", 10000.0, required=False)),
            tie_embeddings="output.weight" not in tensors, rope_scaling=scaling,
            **given)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: the keys describe no valid Llama: {e}") from None


def _dequantized(reader: GgufFile, name: str, quantized: set[str],
                 first_row: bool = False) -> np.ndarray:
    """A file's tensor as float32 in ggml's row order (shape = ne reversed); only
    its first row with first_row (a check that its type is read)."""
    t = reader.tensors[name]
    try:
        data = reader.float32(name, rows=1 if first_row else None)
    except NotImplementedError:
        raise ValueError(f"tensor {name!r} has type {t.type_name}, which gguf-py cannot "
                         "dequantize") from None
    if t.type_name not in ("F32", "F16", "F64", "BF16"):
        quantized.add(t.type_name)
    return data


def _ggml_rows(name: str, p_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The numpy shape (ne reversed) llama.cpp stores parameter name with."""
    if len(p_shape) == 2 and name != "embed_tokens.weight":
        return p_shape[::-1]   # Linear: (in, out) here, (out, in) rows there
    return p_shape


def _our_layout(name: str, rows: np.ndarray, config: LlamaConfig) -> np.ndarray:
    offset = family_of(config).gguf_norm_offset
    if rows.ndim == 1 and offset:
        return rows - np.float32(offset)   # llama.cpp's gemma3 stores 1 + weight
    if rows.ndim != 2 or name == "embed_tokens.weight":
        return rows
    if not config.llama_cpp_permutes_qk:   # qwen2, qwen3: no q/k permutation
        return rows.T
    if name.endswith("q_proj.weight"):
        rows = unpermute_qk(rows, config.n_heads)
    elif name.endswith("k_proj.weight"):
        rows = unpermute_qk(rows, _kv_heads(config))
    return rows.T


def file_architecture(path: str) -> str | None:
    """general.architecture of the GGUF file at path (None when it has none);
    ValueError for a truncated or unreadable file."""
    gguf = _gguf()
    short = gguf_truncation(path, gguf.GGML_QUANT_SIZES)
    if short is not None:
        raise ValueError(f"path: {path!r} is a truncated GGUF file ({short})")
    try:
        arch = GgufFile(path).fields.get("general.architecture")
    except (IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError) as e:
        raise ValueError(f"path: {path!r} is not a valid GGUF file ({e})") from None
    return arch if isinstance(arch, str) else None


class LlamaGguf:
    """What a llama-architecture GGUF holds, read and checked: ``config``
    (LlamaConfig), ``fields`` (every key-value), ``names`` (the Llama's parameter
    names), ``quantized`` (the block types to dequantize), and ``array(name)``:
    one parameter as a new float32 array in ggmlopt's layout, read from the file
    when asked (so a model loads one tensor at a time, not all of them twice)."""

    def __init__(self, path: str):
        gguf = _gguf()
        short = gguf_truncation(path, gguf.GGML_QUANT_SIZES)
        if short is not None:
            raise ValueError(f"path: {path!r} is a truncated GGUF file ({short})")
        quantized: set[str] = set()
        try:
            reader = GgufFile(path)
            self.fields = reader.fields
            self.metadata = GgufMetadata.from_file(reader)
            refuse_adapter_file(self.fields, path)
            arch = self.fields.get("general.architecture")
            if arch not in LLAMA_FAMILY:
                raise ValueError(f"path: {path!r} holds a {arch!r} model, not a 'llama' one "
                                 f"(nor another architecture of its family ggmlopt reads: "
                                 f"{', '.join(sorted(LLAMA_FAMILY - {LLAMA_ARCH}))}); "
                                 "load_gguf(path, model) loads other files into a model")
            self.arch = arch
            infos = {name: (t.ne, reader) for name, t in reader.tensors.items()}
            blocks = self.fields.get(f"{arch}.block_count")
            if isinstance(blocks, int) and blocks > len(infos):
                # (a corrupt count would build per-layer lists and defaults of millions
                # of entries before saying so)
                raise ValueError(f"path: {path!r}: {arch}.block_count is {blocks}, but the "
                                 f"file holds {len(infos)} tensors in all")
            self.config = _config(self.fields, infos, f"path: {path!r}", arch)
            wanted = {name: _ggml_rows(name, shape)
                      for name, shape in _parameter_shapes(self.config)}
            names = {gguf_name(name, arch): name for name in wanted}
            missing = sorted(n for n in names if n not in infos)
            # biases change the computation: refused with the rest (rope_freqs and the
            # rope_factors are the config's rope scaling)
            unexpected = sorted(n for n in infos if n not in names and n not in (
                "rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"))
            if missing or unexpected:
                raise ValueError(f"path: {path!r} does not hold the Llama its keys describe: "
                                 f"missing tensors {missing}, unexpected tensors {unexpected}")
            for gname, name in names.items():
                ne = infos[gname][0]
                shape = tuple(ne[::-1])
                if shape != wanted[name]:
                    raise ValueError(f"path: {path!r}: tensor {gname!r} has ggml dims (ne) "
                                     f"{ne}; the Llama its keys describe needs "
                                     f"{tuple(wanted[name][::-1])}")
                # every type must dequantize before any weight is written
                _dequantized(reader, gname, quantized, first_row=True)
            self._reader, self._names = reader, {name: gname for gname, name in names.items()}
        except (ValueError, IndexError, KeyError, TypeError, OverflowError,
                UnicodeDecodeError) as e:
            if isinstance(e, ValueError) and str(e).startswith("path:"):
                raise  # ours, already saying what is wrong
            raise ValueError(f"path: {path!r} is not a valid GGUF file ({e})") from None
        self.quantized = sorted(quantized)

    @property
    def names(self) -> list[str]:
        """The Llama parameter names the file holds."""
        return list(self._names)

    def array(self, name: str) -> np.ndarray:
        """Parameter name as float32 in ggmlopt's layout (a transposed view of a
        new array, for writing into the parameter: no second copy of a matrix)."""
        rows = _dequantized(self._reader, self._names[name], set())
        return _our_layout(name, rows, self.config)

    def stored(self, name: str) -> tuple[str, np.ndarray] | None:
        """(type name, rows) of weight matrix name as the file stores it: a
        read-only view of the mapped file (uint8 blocks, or float16 / uint16 /
        float32 words), its rows in Hugging Face's output order (a copy of the
        rows for a Llama's q and k, which llama.cpp permutes); None when
        ggmlopt's kernels do not read the type."""
        gname = self._names[name]
        t = self._reader.tensors[gname]
        if t.type_name not in kernels_quant.QTYPES:
            return None
        raw = self._reader.raw(gname)
        if not raw.dtype.isnative:   # a big-endian file's words: the kernels read native ones
            raw = raw.astype(raw.dtype.newbyteorder("="))
        if self.config.llama_cpp_permutes_qk and name.endswith(("q_proj.weight",
                                                                "k_proj.weight")):
            heads = self.config.n_heads if name.endswith("q_proj.weight") else \
                _kv_heads(self.config)
            raw = np.ascontiguousarray(raw[unpermute_qk(np.arange(raw.shape[0]), heads)])
        return t.type_name, raw


def _keep_types(read: LlamaGguf, model) -> list[str]:
    """Put a QuantizedLinear (QuantizedEmbedding for the token embedding) over
    the file's stored rows in place of every weight matrix of model whose type
    the kernels read; returns the types of the others (loaded as float32)."""
    widened = set()
    for name, shape in _parameter_shapes(read.config):
        if len(shape) != 2:
            continue
        stored = read.stored(name)
        if stored is None:
            widened.add(read._reader.tensors[read._names[name]].type_name)
            continue
        qtype, raw = stored
        where = name[:-len(".weight")]
        old = get_submodule(model, where)
        new: QuantizedLinear | QuantizedEmbedding
        if name == "embed_tokens.weight":
            new = QuantizedEmbedding(raw, qtype, shape[0], shape[1],
                                     padding_idx=getattr(old, "padding_idx", None))
        else:
            new = QuantizedLinear(raw, qtype, old.in_features, old.out_features, bias=old.bias)
        set_submodule(model, where, new)
    return sorted(widened)


def _parameter_shapes(config: LlamaConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the config's model, in
    named_parameters' order, without building one."""
    return (family_of(config).parameter_shapes or llama_parameter_shapes)(config)


def load_gguf_tokenizer(path):
    """The tokenizer of a GGUF file (a model's or a vocabulary's), as load_gguf
    gives it with the model: a BPETokenizer (gpt2-type vocabulary), an
    SPMTokenizer (llama-type SentencePiece), a ByteTokenizer (save_gguf's byte
    vocabulary), or None with a UserWarning for another type.  The chat template,
    special and end-of-generation ids come along.  Reads only the key-values:
    no tensor is loaded."""
    path = input_path(path)
    gguf = _gguf()
    short = gguf_truncation(path, gguf.GGML_QUANT_SIZES)
    if short is not None:
        raise ValueError(f"path: {path!r} is a truncated GGUF file ({short})")
    fields = GgufFile(path).fields
    if "tokenizer.ggml.model" not in fields:
        raise ValueError(f"path: {path!r} holds no tokenizer (no tokenizer.ggml.model)")
    return tokenizer_from_fields(fields, path)


def _name_for_vocabulary(name: str, tokenizer, chosen: bool) -> str:
    """general.name for a file of this tokenizer: llama.cpp gives a Phi-3
    vocabulary's special tokens their whitespace rule (rstrip) only when the
    name holds "phi3" or "phi-3", so a tokenizer with that rule gets such a
    name by default (ggmlopt-phi3); a name chosen (name=, or the source
    file's) without it is refused rather than written to tokenize otherwise."""
    if not getattr(tokenizer, "rstrip_ids", None):
        return name
    lowered = name.lower()
    if "phi3" in lowered or "phi-3" in lowered:
        return name
    if not chosen:
        return "ggmlopt-phi3"
    raise ValueError(f"name: {name!r}: the tokenizer strips the whitespace after its special "
                     f"tokens (Phi-3's rule), which llama.cpp applies only to a file whose "
                     f"general.name holds 'phi3' or 'phi-3'; give a name with it")


def _computes_otherwise(read: LlamaGguf, cfg) -> list[str]:
    """How the model read's file describes differs from a model of config cfg,
    beyond their shapes (checked before): the family (a file of the same
    llama.cpp architecture reads as cfg's family: a Mistral without a window is
    a llama file), each setting of cfg's config class but max_seq_len (how
    long a window the model takes, not how it computes), and the rotary
    frequencies (a Llama 3 scaling reads back as its frequency factors)."""
    family = family_of(cfg)
    if family.gguf_arch != read.arch:
        return [(f"architecture differs from the model's ({family.gguf_arch}, a "
                 f"{family.model_class.__name__})")]
    fields = {f.name for f in dataclasses.fields(cfg)}
    try:
        file_cfg = type(cfg)(**{f.name: getattr(read.config, f.name)
                                for f in dataclasses.fields(read.config) if f.name in fields})
    except (TypeError, ValueError) as e:
        return [f"settings do not make a {type(cfg).__name__} ({e})"]

    def windowless(c):
        # without a window, local layers differ from global ones by their RoPE alone:
        # equal bases and no scaling make every layer global
        return getattr(c, "sliding_window", 0) is None and (
            not any(getattr(c, "sliding_layers", None) or ())
            or (c.rope_local_base == c.rope_base and c.rope_scaling is None))

    if windowless(file_cfg) and windowless(cfg):
        fields -= {"sliding_layers", "rope_local_base"}

    def same(x, y):   # the file keeps floats in float32
        if isinstance(x, float) and isinstance(y, float):
            return bool(np.float32(x) == np.float32(y))
        return bool(x == y)

    differ = [f"{name} is {getattr(file_cfg, name)!r} (the model's: {getattr(cfg, name)!r})"
              # (a rotary share reads back as n_rot / head_dim: the frequencies say it)
              for name in sorted(fields - {"max_seq_len", "rope_scaling",
                                           "partial_rotary_factor"})
              if not same(getattr(file_cfg, name), getattr(cfg, name))]

    def frequencies(c):
        head_dim = getattr(c, "rotary_dim", None) or getattr(c, "head_dim", None) \
            or c.dim // c.n_heads
        inv, attention = rope_inv_freq(head_dim, c.rope_base, c.rope_scaling)
        pairs = inv.size
        if c.rope_scaling is not None and c.rope_scaling.rope_type == "longrope":
            long, _ = rope_inv_freq(head_dim, c.rope_base, c.rope_scaling, long=True)
            inv = np.concatenate([inv, long])
        return inv.astype(np.float64), attention, pairs

    (a, fa, pa), (b, fb, pb) = frequencies(file_cfg), frequencies(cfg)
    # (another base is said above; the frequencies then tell nothing more)
    if same(file_cfg.rope_base, cfg.rope_base) and pa != pb:
        # as many frequencies as rotated pairs: another rotary share
        differ.append(f"a head rotates {pa} pairs (the model's: {pb}; partial_rotary_factor "
                      "or the rotary width)")
    elif same(file_cfg.rope_base, cfg.rope_base) and (
            a.shape != b.shape or np.float32(fa) != np.float32(fb)
            or not np.allclose(a, b, rtol=4 * 2.0 ** -24, atol=0)):
        differ.append(f"rope_scaling is {file_cfg.rope_scaling!r} (the model's: "
                      f"{cfg.rope_scaling!r})")
    return differ


def _warn_quantized(read: LlamaGguf, path: str) -> None:
    if read.quantized:
        warnings.warn(f"{path}: tensors of type {', '.join(read.quantized)} were dequantized to "
                      "float32 (training continues from the dequantized values)",
                      UserWarning, stacklevel=3)


def _refuse_other_names(path: str, params: dict[str, Any], names) -> None:
    """ValueError naming the parameters the model and the file do not share (a
    model holding LoRA adapters: merge them first)."""
    extra = [n for n in params if n not in set(names)]
    missing = [n for n in names if n not in params]
    if any(n.endswith((".lora_a", ".lora_b")) for n in extra):
        raise ValueError(f"model: it holds LoRA adapters ({extra[0]}, ...), which a model "
                         f"file does not hold; load {path!r} into a model without them, or "
                         "fold them into its weights first (ggmlopt.lora.merge)")
    raise ValueError(f"path: {path!r} does not hold the model's parameters: the model has "
                     f"{extra[:5] or 'none'} the file lacks, the file {missing[:5] or 'none'} "
                     "the model lacks")


def load_llama_gguf(path, model=None, *, keep_types=False):
    """Read a llama-architecture GGUF (save_gguf's or llama.cpp's).

    Without model: returns (Llama built from the file's keys, tokenizer or None).
    With model (a Llama of the same shapes): loads the weights into it in place,
    with the file's own key-values as its ``gguf_metadata`` (what save_gguf
    writes back), and returns the file's key-values.  Tensors F32, F16, BF16, or quantized
    types gguf-py dequantizes (to float32, with a UserWarning naming them).
    ValueError for another architecture, missing keys or tensors, wrong shapes,
    a truncated file; the model is then unchanged.

    keep_types=True (without model): every weight matrix stays in the type the
    file stores it, read in place from the mapped file, as a frozen
    ggmlopt.nn.QuantizedLinear (QuantizedEmbedding for the token embedding):
    the model takes the file's size, not float32's, and trains through LoRA
    adapters (QLoRA).  Norms and biases are float32 Parameters.  A matrix of a
    type the kernels do not read (the IQ types but IQ4_NL and IQ4_XS) is dequantized to
    float32, with a UserWarning naming the types.
    """
    path = input_path(path)
    if not isinstance(keep_types, (bool, np.bool_)):
        raise TypeError(f"keep_types: expected a bool, got {type(keep_types).__name__}")
    if keep_types and model is not None:
        raise ValueError("keep_types: True builds the model from the file; pass model=None "
                         "(a model given is loaded in float32)")
    if model is not None and not isinstance(model, Llama):
        raise ValueError(f"path: {path!r} holds a Llama-family model; the model given is a "
                         f"{type(model).__name__}")
    read = LlamaGguf(path)
    if model is None:
        tokenizer = tokenizer_from_fields(read.fields, path)
        if keep_types:
            with skip_init():   # the weight matrices are replaced, never written
                built = family_of(read.config).model_class(read.config)
            widened = _keep_types(read, built)
            if widened:
                warnings.warn(f"{path}: keep_types: tensors of type {', '.join(widened)} were "
                              "dequantized to float32 (ggmlopt's kernels do not read them)",
                              UserWarning, stacklevel=2)
        else:
            # every parameter is written from the file below: no random draws, and
            # weights not yet written take no memory (the load peaks at the weights
            # plus one tensor, not the weights twice over while they are replaced)
            with skip_init():
                built = family_of(read.config).model_class(read.config)
        for name, p in built.named_parameters():
            p.data[...] = read.array(name)   # one tensor in memory twice at a time
        if tokenizer is not None:
            # generate stops at these by default (llama.cpp's end-of-generation set)
            built.eog_ids = frozenset(tokenizer.eog_ids)
        # what the file says about itself goes back into the files written from it
        built.gguf_metadata = read.metadata
        if not keep_types:
            _warn_quantized(read, path)
        return built, tokenizer
    params = dict(model.named_parameters())
    shapes = dict(_parameter_shapes(read.config))
    if set(params) != set(read.names):
        _refuse_other_names(path, params, read.names)
    if any(params[n].data.shape != shapes[n] for n in read.names):
        raise ValueError(f"path: {path!r} holds a Llama of config {read.config}, which does "
                         f"not fit the model given ({model.config})")
    differ = _computes_otherwise(read, model.config)
    if differ:
        raise ValueError(f"path: {path!r} holds a {read.arch} model whose {'; '.join(differ)}: "
                         f"its weights in the model given would compute another model; load "
                         f"it as a model of its own (load_gguf(path))")
    for name in read.names:
        params[name].data[...] = read.array(name)
    # the model's weights are this file's now, and so is what it says about itself
    # (a license and provenance of a file loaded before would be written back)
    model.gguf_metadata = read.metadata
    _warn_quantized(read, path)
    return dict(read.fields)

