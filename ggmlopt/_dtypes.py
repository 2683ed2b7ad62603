"""dtype arguments: a NumPy dtype (or anything np.dtype takes) or llama.cpp's type
name (``"f32"``, ``"f16"``, ``"bf16"``, ``"q8_0"``...), everywhere a dtype is taken."""
from __future__ import annotations

import numpy as np

__all__ = ["GGML_FLOAT_NAMES", "GGML_QUANT_NAMES", "dtype_or_ggml_name", "shortest_float"]

# llama.cpp's names of the plain types (ggml_type_name, llama-quantize's arguments)
GGML_FLOAT_NAMES: dict[str, np.dtype] = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16),
                    "f64": np.dtype(np.float64), "i8": np.dtype(np.int8),
                    "i16": np.dtype(np.int16), "i32": np.dtype(np.int32),
                    "i64": np.dtype(np.int64)}
# its block types, named as ggml_type_name spells them (lower case)
GGML_QUANT_NAMES = ("bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k",
                    "q4_k", "q5_k", "q6_k", "iq4_nl", "tq1_0", "tq2_0")


def dtype_or_ggml_name(value, name: str) -> np.dtype | str:
    """value as a NumPy dtype, or as a lower-case ggml block-type name ("bf16",
    "q8_0", ...) for a type NumPy lacks.  llama.cpp's plain names ("f32", "F16")
    map to their NumPy dtypes.  TypeError naming the argument otherwise."""
    if isinstance(value, str):
        key = value.strip().lower()
        if key in GGML_FLOAT_NAMES:
            return GGML_FLOAT_NAMES[key]
        if key in GGML_QUANT_NAMES:
            return key
    try:
        return np.dtype(value)
    except TypeError:
        raise TypeError(f"{name}: expected a NumPy dtype or one of llama.cpp's type names "
                        f"({', '.join(GGML_FLOAT_NAMES)}, {', '.join(GGML_QUANT_NAMES)}), "
                        f"got {value!r}") from None


def shortest_float(value) -> float:
    """A float32 value (a GGUF key) as the shortest decimal that rounds to it
    (1e-05, not 9.99999974738e-06), so a config written from 1e-5 reads back as 1e-5."""
    return float(str(np.float32(value)))
