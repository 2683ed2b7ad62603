"""ggmlopt: ggml's training engine (ggml-opt) for Python.

Quick start::

    import numpy as np, ggmlopt as go
    x = np.random.default_rng(0).normal(size=(1000, 8)); y = (x[:, 0] > 0).astype(int)
    model = go.nn.Sequential(go.nn.Linear(8, 16), go.nn.ReLU(), go.nn.Linear(16, 2))
    go.fit(model, go.Dataset.from_arrays(x, y), "cross_entropy", nepoch=20, nbatch_logical=50)
    print(go.evaluate(model, (x, y), "cross_entropy").accuracy())  # (accuracy, uncertainty)

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
    gemm,
    io,
    lm,
    lora,
    models,
    nn,
    optimizers,
    schedules,
    step_in_backward,
    testing,
    text,
)
from ._runtime import get_include, show_config
from .context import OptContext
from .dataset import Dataset
from .inference import evaluate, predict
from .kernels import get_num_threads, set_num_threads, simd_info
from .lm import chat, generate, perplexity
from .memory_estimate import MemoryReport, memory_report
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
from .optimizers import Optimizer
from .progress import progress_bar
from .result import Result
from .training import EpochStats, EvalStats, History, epoch, fit

__version__ = "0.1.0"

__all__ = [
    "AdamWParams",
    "BuildType",
    "Dataset",
    "EpochStats",
    "EvalStats",
    "History",
    "LossType",
    "MemoryReport",
    "OptContext",
    "Optimizer",
    "OptimizerParams",
    "OptimizerType",
    "Result",
    "SGDParams",
    "chat",
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
    "gemm",
    "generate",
    "get_include",
    "get_num_threads",
    "io",
    "lm",
    "lora",
    "memory_report",
    "models",
    "nn",
    "optimizers",
    "perplexity",
    "predict",
    "progress_bar",
    "schedules",
    "set_num_threads",
    "show_config",
    "simd_info",
    "step_in_backward",
    "testing",
    "text",
]
