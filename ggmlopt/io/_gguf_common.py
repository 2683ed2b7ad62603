"""What the GGUF writers and readers share (the generic and mnist layouts in
gguf_format, llama.cpp's in gguf_llama, adapters in gguf_lora): the gguf package,
the dtype argument, extra metadata keys, float16's range check, and the refusal
of an adapter file where a model is read."""
from __future__ import annotations

import numbers
from collections.abc import Mapping

import numpy as np

from .._dtypes import dtype_or_ggml_name, shortest_float
from .._optional import import_optional

__all__ = ["dtype_arg", "gguf_module", "metadata_items", "model_file_items", "refuse_adapter_file", "shortest_float",
           "stored"]

_F16_MAX = float(np.finfo(np.float16).max)
# keys the writers set themselves
RESERVED_KEYS = ("general.architecture", "ggmlopt.tensor_layout")
ALIGNMENT_KEY = "general.alignment"


def gguf_module():
    """The gguf package (the interop extra), imported on first use."""
    return import_optional("gguf", "interop", "GGUF export and import")


def dtype_arg(dtype) -> np.dtype:
    """float32 or float16, as a NumPy dtype or llama.cpp's name ("f32", "f16")."""
    try:
        dt = dtype_or_ggml_name(dtype, "dtype")
    except TypeError:
        dt = None
    if dt not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise TypeError(f"dtype: expected float32 or float16 (np.float32, 'f32', np.float16 "
                        f"or 'f16'), got {dtype!r}")
    return dt  # type: ignore[return-value]


def metadata_items(metadata, gguf):
    if metadata is None:
        return []
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata: expected a dict, got {type(metadata).__name__}")
    vt = gguf.GGUFValueType
    items = []
    for key, value in metadata.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"metadata: keys must be non-empty str, got {key!r}")
        if key in RESERVED_KEYS or key.startswith("GGUF."):
            raise ValueError(f"metadata: key {key!r} is reserved (written by save_gguf)")
        if key == ALIGNMENT_KEY:
            # the offsets are laid out at the writer's alignment: another value (or
            # this one as an int64, not gguf's uint32) makes every tensor unreadable
            raise ValueError(f"metadata: key {key!r} is the file's tensor data alignment, "
                             "set by the writer; it cannot be given")
        if isinstance(value, bool):
            items.append((key, value, vt.BOOL))
        elif isinstance(value, numbers.Integral):
            if not -2**63 <= int(value) < 2**63:
                raise ValueError(f"metadata: {key!r}={value} does not fit an int64")
            items.append((key, int(value), vt.INT64))
        elif isinstance(value, numbers.Real):
            items.append((key, float(value), vt.FLOAT64))
        elif isinstance(value, str):
            items.append((key, value, vt.STRING))
        else:
            raise TypeError(f"metadata: {key!r} has a {type(value).__name__}; expected bool, "
                            "int, float or str")
    return items


def stored(name: str, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype == np.float16 and array.ndim >= 2:
        too_big = np.isfinite(array) & (np.abs(array) > _F16_MAX)
        if too_big.any():
            raise ValueError(f"dtype: parameter {name!r} holds values beyond float16's range "
                             f"(|x| up to {np.abs(array[too_big]).max():g} > {_F16_MAX:g}); "
                             "save it as float32")
        return array.astype(np.float16)
    return array


def refuse_adapter_file(fields, path: str) -> None:
    """ValueError when a GGUF's keys say it is an adapter (general.type
    'adapter'), not a model: load_gguf_lora reads those."""
    if fields.get("general.type") == "adapter":
        raise ValueError(f"path: {path!r} is a LoRA adapter (general.type is 'adapter', "
                         f"adapter.type {fields.get('adapter.type')!r}), not a model: "
                         "ggmlopt.io.load_gguf_lora(path, model) puts it on its base model; "
                         "load_gguf reads model files")


def model_file_items(model, name, metadata, reserved: tuple[str, ...]):
    """The checks a model file's writer makes before anything else (no adapters
    left unmerged, a str general.name) and the metadata key-values, none of them
    under a reserved prefix (keys the writer sets itself)."""
    from ..lora import refuse_adapters
    refuse_adapters(model, "save_gguf")
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    items = metadata_items(metadata, gguf_module())
    for key, _, _ in items:
        if key.startswith(reserved):
            raise ValueError(f"metadata: key {key!r} is reserved (written by save_gguf)")
    return items
