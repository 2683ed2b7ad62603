"""Enums and optimizer parameters: ggml's ggml_opt_loss_type, ggml_opt_build_type,
ggml_opt_optimizer_type and ggml_opt_optimizer_params under Python names."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "AdamWParams",
    "BuildType",
    "FitEpoch",
    "LossType",
    "OptimizerParams",
    "OptimizerType",
    "SGDParams",
    "constant_optimizer_params",
    "default_optimizer_params",
]


class FitEpoch(int):
    """The 1-based epoch fit hands get_opt_pars: an int (ggml's userdata),
    marked as fit's epoch, so that a per-step schedule called with it from a
    function of the user's refuses it rather than read it as the step."""

    __slots__ = ()


class LossType(enum.IntEnum):
    """How the model's outputs become the scalar loss (ggml_opt_loss_type)."""

    MEAN = 0
    SUM = 1
    CROSS_ENTROPY = 2
    MEAN_SQUARED_ERROR = 3


class BuildType(enum.IntEnum):
    """How far an eval goes: forward only, + gradients, + optimizer step.
    Ordered (and numbered) like ggml_opt_build_type."""

    FORWARD = 10
    GRAD = 20
    OPT = 30


class OptimizerType(enum.IntEnum):
    """The optimizer an OPT step runs (ggml_opt_optimizer_type)."""

    ADAMW = 0
    SGD = 1


@dataclass
class AdamWParams:
    """AdamW hyper-parameters (ggml's defaults)."""

    alpha: float = 1e-3  # learning rate
    beta1: float = 0.9  # first-moment decay
    beta2: float = 0.999  # second-moment decay
    eps: float = 1e-8  # added to the denominator
    wd: float = 0.0  # weight decay, as a fraction of alpha


@dataclass
class SGDParams:
    """SGD hyper-parameters: w = w*(1 - alpha*wd) - alpha*g."""

    alpha: float = 1e-3
    wd: float = 0.0


@dataclass
class OptimizerParams:
    """What ``get_opt_pars`` returns: the parameters of both optimizers; only the
    active optimizer's are read (and validated)."""

    adamw: AdamWParams = field(default_factory=AdamWParams)
    sgd: SGDParams = field(default_factory=SGDParams)


def default_optimizer_params(userdata: object = None) -> OptimizerParams:
    """ggml's default optimizer parameters; userdata is ignored."""
    return OptimizerParams()


def constant_optimizer_params(userdata: OptimizerParams) -> OptimizerParams:
    """Returns userdata itself: pass the parameters as ``get_opt_pars_ud``."""
    return userdata


def _f32(value: object, name: str) -> np.float32:
    """A hyper-parameter as the float32 ggml stores it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    with np.errstate(over="ignore"):
        return np.float32(value)


def _check(ok: bool | np.bool_, name: str, value: np.float32, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {float(value)!r}")


def validate_optimizer_params(params: object, optimizer: OptimizerType) -> tuple[np.float32, ...]:
    """The active optimizer's parameters as float32 values, checked as ggml asserts
    them (NaN fails every check).

    ADAMW: (alpha, beta1, beta2, eps, wd) with alpha > 0, 0 <= beta1, beta2 <= 1,
    eps >= 0, 0 <= wd <= 1.  SGD: (alpha, wd) with alpha > 0, 0 <= wd <= 1.
    Raises TypeError when params is not an OptimizerParams, ValueError otherwise.
    """
    if not isinstance(params, OptimizerParams):
        raise TypeError(
            "get_opt_pars: expected it to return an OptimizerParams, got "
            f"{type(params).__name__}"
        )
    if optimizer == OptimizerType.SGD:
        p = params.sgd
        alpha, wd = _f32(p.alpha, "sgd.alpha"), _f32(p.wd, "sgd.wd")
        _check(alpha > 0, "sgd.alpha", alpha, "> 0")
        _check(0 <= wd <= 1, "sgd.wd", wd, "0 <= wd <= 1")
        if not math.isfinite(alpha):
            raise ValueError(f"sgd.alpha: expected a finite number, got {float(alpha)!r}")
        return alpha, wd
    pa = params.adamw
    alpha = _f32(pa.alpha, "adamw.alpha")
    beta1 = _f32(pa.beta1, "adamw.beta1")
    beta2 = _f32(pa.beta2, "adamw.beta2")
    eps = _f32(pa.eps, "adamw.eps")
    wd = _f32(pa.wd, "adamw.wd")
    _check(alpha > 0, "adamw.alpha", alpha, "> 0")
    _check(0 <= beta1 <= 1, "adamw.beta1", beta1, "0 <= beta1 <= 1")
    _check(0 <= beta2 <= 1, "adamw.beta2", beta2, "0 <= beta2 <= 1")
    _check(eps >= 0, "adamw.eps", eps, ">= 0")
    _check(0 <= wd <= 1, "adamw.wd", wd, "0 <= wd <= 1")
    # ggml lets inf through; the kernels take finite values only
    if not math.isfinite(alpha):
        raise ValueError(f"adamw.alpha: expected a finite number, got {float(alpha)!r}")
    if not math.isfinite(eps):
        raise ValueError(f"adamw.eps: expected a finite number, got {float(eps)!r}")
    return alpha, beta1, beta2, eps, wd
