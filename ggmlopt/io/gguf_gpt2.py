"""A GPT-2 as llama.cpp's ``gpt2`` architecture stores it, both ways.

Tensors (llama.cpp's names for Hugging Face's): ``token_embd`` (wte),
``position_embd`` (wpe), per block ``attn_norm`` (ln_1), ``attn_qkv`` (c_attn:
rows q | k | v), ``attn_output`` (attn.c_proj), ``ffn_norm`` (ln_2), ``ffn_up``
(c_fc), ``ffn_down`` (mlp.c_proj), each with its bias, and ``output_norm``
(ln_f); no ``output``: llama.cpp ties the head to the token embedding as GPT-2
does.  A Linear's (in, out) weight is stored as ggml's (out, in) rows; GPT-2 has
no q/k permutation (no RoPE).  Keys ``gpt2.*``: context, embedding and
feed-forward lengths, block and head counts, the LayerNorm epsilon.
"""
from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np

from ..models import GPT2, GPT2Config
from ..nn.init import skip_init
from ._files import atomic_output, input_path, output_path
from ._gguf_common import (
    gguf_module,
    model_file_items,
    refuse_adapter_file,
    shortest_float,
    stored,
)
from ._gguf_length import gguf_truncation
from ._gguf_tokenizer_keys import tokenizer_keys
from ._gguf_write import quantized_rows, save_dtype_arg, warn_fallbacks, write_rest
from ._quant_mix import FILE_TYPES, tensor_type
from .gguf_metadata import GgufMetadata
from .gguf_reader import GgufFile

__all__ = ["GPT2_ARCH", "gguf_name_gpt2", "hf_name_gpt2", "load_gpt2_gguf", "save_gpt2_gguf"]

GPT2_ARCH = "gpt2"
_LAYER = {
    "ln_1.weight": "attn_norm.weight", "ln_1.bias": "attn_norm.bias",
    "attn.c_attn.weight": "attn_qkv.weight", "attn.c_attn.bias": "attn_qkv.bias",
    "attn.c_proj.weight": "attn_output.weight", "attn.c_proj.bias": "attn_output.bias",
    "ln_2.weight": "ffn_norm.weight", "ln_2.bias": "ffn_norm.bias",
    "mlp.c_fc.weight": "ffn_up.weight", "mlp.c_fc.bias": "ffn_up.bias",
    "mlp.c_proj.weight": "ffn_down.weight", "mlp.c_proj.bias": "ffn_down.bias",
}
_GLOBAL = {"wte.weight": "token_embd.weight", "wpe.weight": "position_embd.weight",
           "ln_f.weight": "output_norm.weight", "ln_f.bias": "output_norm.bias"}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_GLOBAL_BACK = {v: k for k, v in _GLOBAL.items()}
_OURS = re.compile(r"h\.(\d+)\.(.+)")
_THEIRS = re.compile(r"blk\.(\d+)\.(.+)")
_EMBEDDINGS = ("wte.weight", "wpe.weight")
_RESERVED = ("general.architecture", "general.file_type", "general.quantization_version", "gpt2.",
             "tokenizer.")


def gguf_name_gpt2(name: str) -> str:
    """llama.cpp's tensor name for a GPT2 parameter name (KeyError for another)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _OURS.fullmatch(name)
    if m and m.group(2) in _LAYER:
        return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise KeyError(f"{name!r} is not a parameter name of a GPT2")


def hf_name_gpt2(name: str) -> str:
    """The GPT2 parameter name of a llama.cpp gpt2 tensor (KeyError for another)."""
    if name in _GLOBAL_BACK:
        return _GLOBAL_BACK[name]
    m = _THEIRS.fullmatch(name)
    if m and m.group(2) in _LAYER_BACK:
        return f"h.{m.group(1)}.{_LAYER_BACK[m.group(2)]}"
    raise KeyError(f"{name!r} is not a tensor name of llama.cpp's gpt2")


def save_gpt2_gguf(model, path, *, tokenizer, dtype=np.float32, metadata=None,
                   name: str | None = None) -> None:
    """Write a ggmlopt.models.GPT2 to path as llama.cpp's gpt2 GGUF
    (atomically), with its tokenizer (ByteTokenizer, BPETokenizer or
    SPMTokenizer; its token count must be vocab_size; or a Hugging Face
    checkpoint's HFTokenizer, written as save_llama_gguf writes one).  dtype: float32 or
    float16 for the matrices (norms, biases and the position rows stay
    float32), or a file type as llama-quantize names it ("q8_0", "q4_k_m",
    "bf16", ...: each matrix gets the type llama-quantize gives it, the tied
    token embedding as the output head; see save_llama_gguf).  metadata: extra
    keys other than general.architecture, general.file_type, gpt2.* and
    tokenizer.*.  TypeError for another model or tokenizer; ValueError for a
    tokenizer of another size or a weight beyond float16's range.  A model
    read from a GGUF writes back its file's own key-values (as
    save_llama_gguf); name: general.name (None: the source file's, else
    "ggmlopt-gpt2")."""
    if not isinstance(model, GPT2):
        raise TypeError(f"model: expected a ggmlopt.models.GPT2, got {type(model).__name__}")
    carried = getattr(model, "gguf_metadata", None)
    if name is None:
        name = str(carried.get("general.name", "ggmlopt-gpt2")) if carried else "ggmlopt-gpt2"
    items = model_file_items(model, name, metadata, _RESERVED)
    dtype = save_dtype_arg(dtype)
    path = output_path(path)
    cfg = model.config
    tok = tokenizer_keys(tokenizer, cfg.vocab_size)
    gguf = gguf_module()
    arrays = _gpt2_arrays(model, dtype, gguf)
    if isinstance(dtype, str):
        file_type = getattr(gguf.LlamaFileType, FILE_TYPES[dtype][0])
    else:
        file_type = (gguf.LlamaFileType.ALL_F32 if dtype == np.float32
                     else gguf.LlamaFileType.MOSTLY_F16)
    with atomic_output(path) as tmp:
        writer = gguf.GGUFWriter(tmp, GPT2_ARCH)
        try:
            writer.add_name(name)
            writer.add_file_type(file_type)
            writer.add_vocab_size(cfg.vocab_size)
            writer.add_context_length(cfg.max_seq_len)
            writer.add_embedding_length(cfg.dim)
            writer.add_feed_forward_length(4 * cfg.dim)
            writer.add_block_count(cfg.n_layers)
            writer.add_head_count(cfg.n_heads)
            writer.add_layer_norm_eps(cfg.norm_eps)
            write_rest(writer, gguf, tok, tokenizer, items, arrays, carried)
        finally:
            writer.close()


def _gpt2_arrays(model, dtype, gguf) -> list[tuple[str, np.ndarray, Any]]:
    """(llama.cpp name, array in ggml's row order, raw ggml type or None) of every
    parameter: the matrices in dtype (a file type: the block type llama-quantize
    gives each, with its fall-backs), the rest float32."""
    arrays = []
    fallbacks = []
    for pname, p in model.named_parameters():
        data = p.data
        if data.ndim == 2 and pname not in _EMBEDDINGS:
            data = data.T   # (in, out) -> ggml's (out, in) rows
        data = np.ascontiguousarray(data, dtype=np.float32)
        gname = gguf_name_gpt2(pname)
        if isinstance(dtype, str) and data.ndim == 2 and pname != "wpe.weight":
            if not np.isfinite(data).all():
                raise ValueError(f"model: {pname} holds a non-finite value; it cannot be "
                                 f"quantized to {dtype}")
            # llama.cpp's gpt2 has no output tensor: the token embedding is the head
            qtype, preferred = tensor_type(dtype, gname, data.shape[1], model.config.n_layers,
                                           tied=True)
            if qtype != preferred and not (gname == "token_embd.weight" and qtype == "Q8_0"):
                fallbacks.append(f"{gname} {preferred} -> {qtype}")
            arrays.append((gname, *quantized_rows(gguf, pname, data, qtype)))
            continue
        # the position rows stay float32 in a float16 or quantized file, as llama.cpp's
        # converter and llama-quantize keep position_embd
        kept = np.dtype(np.float32) if pname == "wpe.weight" or isinstance(dtype, str) \
            else dtype
        arrays.append((gname, stored(pname, data, kept), None))
    warn_fallbacks(fallbacks, dtype)
    return arrays


_KEYS = frozenset({"context_length", "embedding_length", "feed_forward_length", "block_count",
                   "attention.head_count", "attention.head_count_kv",
                   "attention.layer_norm_epsilon", "vocab_size"})


def _config(fields: dict[str, Any], vocab: int | None, where: str) -> GPT2Config:
    unknown = sorted(k for k in fields if k.startswith("gpt2.") and k[5:] not in _KEYS)
    if unknown:
        raise ValueError(f"{where}: keys {unknown} are not implemented by ggmlopt's gpt2; "
                         "refusing the file rather than computing another model")

    def key(k, default=None):
        value = fields.get(f"gpt2.{k}", default)
        if value is None:
            raise ValueError(f"{where}: missing key 'gpt2.{k}'")
        return value

    dim, heads = key("embedding_length"), key("attention.head_count")
    if key("attention.head_count_kv", heads) != heads:
        raise ValueError(f"{where}: a GPT-2 with grouped key/value heads is not supported")
    if key("feed_forward_length") != 4 * dim:
        raise ValueError(f"{where}: gpt2.feed_forward_length {key('feed_forward_length')} is "
                         f"not 4 x embedding_length {dim}, as ggmlopt's GPT2 has it")
    if vocab is None:
        raise ValueError(f"{where}: no vocabulary size (gpt2.vocab_size, tokenizer.ggml.tokens "
                         "or token_embd.weight)")
    try:
        return GPT2Config(vocab_size=int(vocab), dim=dim, n_layers=key("block_count"),
                          n_heads=heads, max_seq_len=key("context_length"),
                          norm_eps=shortest_float(key("attention.layer_norm_epsilon")))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: the keys describe no valid GPT2: {e}") from None


def _refuse_more_than_the_file_holds(config: GPT2Config, reader, where: str) -> None:
    """ValueError, before a model is allocated, when the keys describe more
    layers or weights than the file's tensors hold (a corrupt count or width
    would otherwise allocate gigabytes first)."""
    d = config.dim
    needed = (config.vocab_size + config.max_seq_len + 2) * d + \
        config.n_layers * (12 * d * d + 13 * d)
    held = sum(int(np.prod([int(n) for n in t.ne], dtype=np.float64))
               for t in reader.tensors.values())
    if config.n_layers > len(reader.tensors) or needed > held:
        raise ValueError(f"{where}: its keys describe a GPT2 of {needed:,} weights in "
                         f"{config.n_layers} layers; the file holds {held:,} in "
                         f"{len(reader.tensors)} tensors")


def load_gpt2_gguf(path) -> tuple[GPT2, Any]:
    """(GPT2, tokenizer or None) of llama.cpp's gpt2 GGUF (save_gpt2_gguf's, or
    llama.cpp's converter's in F32, F16 or BF16; quantized tensors are
    dequantized to float32, with a UserWarning naming their types).  ValueError
    for another architecture, missing keys or tensors, wrong shapes, a type
    gguf-py cannot dequantize or a truncated file."""
    from ._gguf_tokenizer import tokenizer_from_fields
    path = input_path(path)
    gguf = gguf_module()
    short = gguf_truncation(path, gguf.GGML_QUANT_SIZES)
    if short is not None:
        raise ValueError(f"path: {path!r} is a truncated GGUF file ({short})")
    where = f"path: {path!r}"
    reader = GgufFile(path)
    fields = reader.fields
    refuse_adapter_file(fields, path)
    if fields.get("general.architecture") != GPT2_ARCH:
        raise ValueError(f"{where} holds a {fields.get('general.architecture')!r} model, not "
                         "a 'gpt2' one")
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = fields.get("gpt2.vocab_size", len(tokens) if isinstance(tokens, list) else None)
    config = _config(fields, vocab, where)
    _refuse_more_than_the_file_holds(config, reader, where)
    with skip_init():
        model = GPT2(config)
    params = dict(model.named_parameters())
    names = {gguf_name_gpt2(n): n for n in params}
    extra = sorted(set(reader.tensors) - set(names) - {"output.weight"})
    missing = sorted(set(names) - set(reader.tensors))
    if extra or missing:
        raise ValueError(f"{where} does not hold the GPT2 its keys describe: missing tensors "
                         f"{missing}, unexpected tensors {extra}")
    if "output.weight" in reader.tensors:
        raise ValueError(f"{where} has an output.weight of its own; ggmlopt's GPT2 ties the "
                         "head to the token embedding")
    arrays = {}
    quantized = set()
    for gname, pname in names.items():
        t = reader.tensors[gname]
        if t.type_name not in ("F32", "F16", "BF16"):
            quantized.add(t.type_name)   # (save_gguf's quantized files): dequantized
        try:
            rows = reader.float32(gname)
        except NotImplementedError:
            raise ValueError(f"{where}: tensor {gname!r} has type {t.type_name}, which gguf-py "
                             "cannot dequantize") from None
        shape = params[pname].shape
        want = shape if len(shape) == 1 or pname in _EMBEDDINGS else shape[::-1]
        if rows.shape != tuple(want):
            raise ValueError(f"{where}: tensor {gname!r} has shape {rows.shape}; the GPT2 its "
                             f"keys describe needs {tuple(want)}")
        arrays[pname] = rows if rows.ndim == 1 or pname in _EMBEDDINGS else rows.T
    for pname, data in arrays.items():   # every tensor checked before any is written
        params[pname].data[...] = data
    if quantized:
        warnings.warn(f"{path}: tensors of type {', '.join(sorted(quantized))} were dequantized "
                      "to float32 (training continues from the dequantized values)",
                      UserWarning, stacklevel=3)
    model.gguf_metadata = GgufMetadata.from_file(reader)
    tokenizer = tokenizer_from_fields(fields, path)
    if tokenizer is not None:
        # generate stops at these by default (llama.cpp's end-of-generation set)
        model.eog_ids = frozenset(tokenizer.eog_ids)
    return model, tokenizer
