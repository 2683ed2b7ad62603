"""ggmlopt: ggml's training engine (ggml-opt) for Python.

Datasets split into shards, an optimizer context with AdamW and SGD, four loss
types, gradient accumulation, result statistics, epochs and ``fit`` with a
progress bar, on SIMD kernels (scalar, AVX2+FMA, NEON) picked at run time.
"""
from . import datasets
from ._runtime import get_include, show_config
from .dataset import Dataset
from .kernels import get_num_threads, set_num_threads, simd_info

__version__ = "0.1.0"

__all__ = [
    "Dataset",
    "datasets",
    "get_include",
    "get_num_threads",
    "set_num_threads",
    "show_config",
    "simd_info",
]
