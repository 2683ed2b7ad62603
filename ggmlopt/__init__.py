"""ggmlopt: ggml's training engine (ggml-opt) for Python.

Datasets split into shards, an optimizer context with AdamW and SGD, four loss
types, gradient accumulation, result statistics, epochs and ``fit`` with a
progress bar, on SIMD kernels (scalar, AVX2+FMA, AVX-512, NEON) picked at run time.
"""
from . import (
    checkpoint,
    clipping,
    corpora,
    datasets,
    distributed,
    io,
    lm,
    models,
    nn,
    schedules,
    testing,
    text,
)
from ._runtime import get_include, show_config
from .context import OptContext
from .dataset import Dataset
from .inference import evaluate, predict
from .kernels import get_num_threads, set_num_threads, simd_info
from .lm import generate
from .optim_params import (
    AdamWParams,
    BuildType,
    LossType,
    OptimizerParams,
    OptimizerType,
    SGDParams,
    constant_optimizer_params,
    default_optimizer_params,
)
from .progress import progress_bar
from .result import Result
from .training import EpochStats, History, epoch, fit

__version__ = "0.1.0"

__all__ = [
                           "AdamWParams",
                           "BuildType",
                           "Dataset",
                           "EpochStats",
                           "History",
                           "LossType",
                           "OptContext",
                           "OptimizerParams",
                           "OptimizerType",
                           "Result",
                           "SGDParams",
                           "checkpoint",
                           "clipping",
                           "constant_optimizer_params",
                           "corpora",
                           "datasets",
                           "default_optimizer_params",
                           "distributed",
                           "epoch",
                           "evaluate",
                           "fit",
                           "generate",
                           "get_include",
                           "get_num_threads",
                           "io",
                           "lm",
                           "models",
                           "nn",
                           "predict",
                           "progress_bar",
                           "schedules",
                           "set_num_threads",
                           "show_config",
                           "simd_info",
                           "testing",
                           "text",
]
