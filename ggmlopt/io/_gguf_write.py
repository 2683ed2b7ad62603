"""Writing a model's GGUF, the parts every architecture's writer shares: the
dtype argument (a float type, or a file type as llama-quantize names it), float32
rows quantized to a block type with their scales checked, the warning naming the
matrices that fell back to another type, and the file's tail (tokenizer, the
caller's and the source file's key-values, the tensors)."""

from __future__ import annotations

import warnings

import numpy as np

from .. import kernels_quant
from ._gguf_common import dtype_arg, stored
from ._gguf_tokenizer_keys import add_tokenizer
from ._quant_mix import FILE_TYPES, file_type_name
from .gguf_metadata import GgufMetadata

__all__ = ["quantized_rows", "save_dtype_arg", "warn_fallbacks", "write_rest"]


def save_dtype_arg(dtype):
    """np.float32 or np.float16, or a file type llama-quantize names
    (_quant_mix.FILE_TYPES, its aliases q4_k and q5_k included)."""
    if isinstance(dtype, str) and file_type_name(dtype) is not None:
        return file_type_name(dtype)
    try:
        return dtype_arg(dtype)
    except TypeError:
        raise TypeError(f"dtype: expected float32 or float16 (np.float32, 'f32', np.float16 "
                        f"or 'f16') or a file type as llama-quantize names it "
                        f"({', '.join(FILE_TYPES)}, q4_k, q5_k), got {dtype!r}") from None


def quantized_rows(gguf, name: str, rows: np.ndarray, qtype: str):
    """(array, raw ggml type) of float32 rows in block type qtype (F16 as a
    float16 array): the K types through ggmlopt's port of ggml's reference
    quantizers, the 32-value ones through gguf-py's."""
    if qtype == "F16":
        return stored(name, rows, np.dtype(np.float16)), None   # (beyond float16: ValueError)
    t = gguf.GGMLQuantizationType[qtype]
    if qtype in kernels_quant.QUANTIZE_TYPES:
        array = kernels_quant.quantize(rows, qtype)
    else:
        array = gguf.quants.quantize(rows, t)
    _check_scales(name, rows, array, qtype)
    return array, t


# byte offsets of each block's float16 scales (d, and m / dmin) in ggml's block
# structs; a bf16 tensor is all float16-like words to check instead
_SCALE_OFFSETS = {"Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q5_0": (22, (0,)),
                  "Q5_1": (24, (0, 2)), "Q8_0": (34, (0,)), "Q4_K": (144, (0, 2)),
                  "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def _check_scales(name: str, rows: np.ndarray, array: np.ndarray, qtype: str) -> None:
    """ValueError when a block's float16 scale (or a bf16 value) came out infinite:
    weights too large for the type, which would read back as inf / NaN in llama.cpp
    (llama-quantize refuses such a row: ggml_validate_row_data)."""
    raw = np.ascontiguousarray(array).view(np.uint8)
    if qtype == "BF16":
        bad = (raw.view(np.uint16) & 0x7FFF) >= 0x7F80
    else:
        size, offsets = _SCALE_OFFSETS[qtype]
        blocks = raw.reshape(-1, size)
        bad = np.zeros(len(blocks), bool)
        for at in offsets:
            half = np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16)
            bad |= ~np.isfinite(half).ravel()
    if bad.any():
        why = "they round to inf" if qtype == "BF16" else "a block's float16 scale overflows"
        raise ValueError(f"dtype: {name} holds values too large for {qtype} (|x| up to "
                         f"{float(np.abs(rows).max()):g}: {why}, and llama.cpp would read "
                         f"inf / NaN); save it as f32, or bring the weights back into range")


def warn_fallbacks(fallbacks: list[str], dtype) -> None:
    """The UserWarning naming the matrices ("name WANTED -> TYPE") whose rows are
    not whole blocks of the type a file type gives them (save_gguf's caller)."""
    if fallbacks:
        warnings.warn(f"dtype: {len(fallbacks)} matrices' rows are not whole blocks of "
                      f"the types {dtype} gives them; as llama-quantize does, they fall back "
                      f"to a smaller block or f16: {', '.join(fallbacks[:6])}"
                      f"{', ...' if len(fallbacks) > 6 else ''}", UserWarning, stacklevel=5)


def write_rest(writer, gguf, tok: dict, tokenizer, items, arrays, carried) -> None:
    """After an architecture's own keys: the tokenizer (tok: its keys as
    tokenizer_keys gave them), the caller's key-values (items), the quantization
    version when a tensor has a block type, the source file's carried key-values,
    then every (name, array, raw type) of arrays; and the file written out."""
    add_tokenizer(writer, tok, tokenizer)
    for key, value, vtype in items:
        writer.add_key_value(key, value, vtype)
    if any(raw is not None for _, _, raw in arrays):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if isinstance(carried, GgufMetadata):
        carried.add_to(writer, tok["tokens"], tokenizer)
    for name, array, raw_dtype in arrays:
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
