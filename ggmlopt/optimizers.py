"""Optimizers, one class each: what an optimizer step reads, keeps and does.

An optimizer is a subclass of ``Optimizer`` that names

* its hyper-parameters (``hyperparameter_names``), read and checked at every
  optimizer step from what ``get_opt_pars`` returns (``hyperparameters``), and
  from a checkpoint (``restore_hyperparameters``);
* its state (``state_names``): float32 arrays as large as the trainable
  parameters, kept in the context's arena beside the weights and gradients
  (so one kernel call covers every parameter), zeroed by ``ctx.reset(True)``,
  sharded over the ranks by ``shard_optimizer=True``, and saved in checkpoints
  as ``<name>_<state>.<i>`` per parameter;
* its step (``step``): one call over flat float32 arrays, the weights, the
  gradient summed over the logical batch, and the state arrays, in place,
  through a kernel.

A context saves the hyper-parameters of the last step as
``<name>.<hyper-parameter>`` (NaN before the first step) and refuses a
checkpoint of another optimizer (by ``name``).  The optimizer object itself
holds nothing that changes while training: every changing number is in the
arena or the context, which is what makes a resume exact.

``AdamW`` and ``SGD`` are ggml's (ggml_opt_step_adamw, ggml_opt_step_sgd): their
hyper-parameters are the ``adamw`` and ``sgd`` fields of ``OptimizerParams``,
checked as ggml asserts them.  ``OptimizerType.ADAMW`` / ``SGD`` (or their
names) stand for them wherever an optimizer is asked for.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from . import kernels
from ._args import enum_arg
from .optim_params import (
    AdamWParams,
    OptimizerParams,
    OptimizerType,
    SGDParams,
    validate_optimizer_params,
)

__all__ = ["SGD", "AdamW", "Optimizer", "optimizer_arg"]

_RESERVED = frozenset(("weights", "grads", "param", "grad"))


class Optimizer:
    """The base of every optimizer (see the module docstring).

    A subclass sets ``name`` (a short identifier: the checkpoints' prefix),
    ``hyperparameter_names`` and ``state_names``, and implements
    ``hyperparameters`` and ``step``; instances may carry settings that never
    change while training (a momentum factor, say)."""

    #: identifies the optimizer in checkpoints ("adamw"): letters, digits, "_"
    name: ClassVar[str] = ""
    #: the hyper-parameters step receives, in order, as checkpoints name them
    hyperparameter_names: ClassVar[tuple[str, ...]] = ()
    #: the state arrays, each as large as the trainable parameters
    state_names: ClassVar[tuple[str, ...]] = ()
    #: ggml's enum value, for the built-in optimizers only
    optimizer_type: ClassVar[OptimizerType | None] = None

    def hyperparameters(self, opt_pars: Any) -> tuple[np.float32, ...]:
        """The hyper-parameters of this step, float32, one per
        hyperparameter_names, from what get_opt_pars returned (usually an
        OptimizerParams); raise TypeError or ValueError naming the bad one.
        Called before the step's forward pass, so a bad value changes nothing.

        By default the object's own attributes of those names (an optimizer
        whose settings are fixed when it is made, ``Lion(alpha=1e-4)``); one
        that follows get_opt_pars (and so the schedules) overrides it."""
        missing = [n for n in self.hyperparameter_names if not hasattr(self, n)]
        if missing:
            raise NotImplementedError(
                f"{type(self).__name__}: define hyperparameters(opt_pars), or attributes "
                f"{missing} holding the hyper-parameters")
        values = []
        for name in self.hyperparameter_names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
                    or not np.isfinite(value):
                raise ValueError(f"{self.name}.{name}: expected a finite real number, got "
                                 f"{value!r}")
            values.append(np.float32(value))
        return tuple(values)

    def restore_hyperparameters(self, values: Sequence[float]) -> tuple[np.float32, ...]:
        """The hyper-parameters a checkpoint holds for the last step, checked
        (ValueError when they are not valid)."""
        return tuple(np.float32(v) for v in values)

    def step(self, weights: np.ndarray, grads: np.ndarray, state: Mapping[str, np.ndarray],
             hyper: Sequence[np.float32], iteration: int) -> None:
        """One optimizer step, in place on weights and state: flat float32
        arrays of one size (all parameters, or this rank's shard of them);
        hyper: what hyperparameters returned; iteration: ggml's iter, the
        1-based count of optimizer steps (this one included).

        Each element must be stepped on its own, as AdamW and SGD step it:
        the arrays may be any contiguous part of the parameters (a rank's
        shard under shard_optimizer, one parameter at a time under
        optimizer_in_backward), so a quantity taken over all of them (a
        global norm, LAMB's trust ratio) would be taken over that part only."""
        raise NotImplementedError(f"{type(self).__name__}.step")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AdamW(Optimizer):
    """ggml's AdamW (per element, t = iteration): m = beta1*m + (1-beta1)*g;
    v = beta2*v + (1-beta2)*g^2; w = w*(1 - alpha*wd) - alpha*mh/(sqrt(vh) + eps)
    with the bias corrections computed once per step on the host."""

    name = "adamw"
    hyperparameter_names = ("alpha", "beta1", "beta2", "eps", "wd")
    state_names = ("m", "v")
    optimizer_type = OptimizerType.ADAMW

    def hyperparameters(self, opt_pars: Any) -> tuple[np.float32, ...]:
        return validate_optimizer_params(opt_pars, OptimizerType.ADAMW)

    def restore_hyperparameters(self, values: Sequence[float]) -> tuple[np.float32, ...]:
        return validate_optimizer_params(OptimizerParams(adamw=AdamWParams(*values)),
                                         OptimizerType.ADAMW)

    def step(self, weights, grads, state, hyper, iteration):
        alpha, beta1, beta2, eps, wd = hyper
        beta1h, beta2h = kernels.adamw_bias_corrections(beta1, beta2, iteration)
        kernels.adamw_step(weights, grads, state["m"], state["v"], alpha=alpha, beta1=beta1,
                           beta2=beta2, eps=eps, wd=wd, beta1h=beta1h, beta2h=beta2h)


class SGD(Optimizer):
    """ggml's SGD: w = w*(1 - alpha*wd) - alpha*g; no state."""

    name = "sgd"
    hyperparameter_names = ("alpha", "wd")
    optimizer_type = OptimizerType.SGD

    def hyperparameters(self, opt_pars: Any) -> tuple[np.float32, ...]:
        return validate_optimizer_params(opt_pars, OptimizerType.SGD)

    def restore_hyperparameters(self, values: Sequence[float]) -> tuple[np.float32, ...]:
        return validate_optimizer_params(OptimizerParams(sgd=SGDParams(*values)),
                                         OptimizerType.SGD)

    def step(self, weights, grads, state, hyper, iteration):
        alpha, wd = hyper
        kernels.sgd_step(weights, grads, alpha=alpha, wd=wd)


_BUILT_IN = {OptimizerType.ADAMW: AdamW(), OptimizerType.SGD: SGD()}


def optimizer_arg(optimizer: object, name: str = "optimizer") -> Optimizer:
    """optimizer as an Optimizer: an instance passes (checked), an Optimizer
    subclass is instantiated without arguments, and an OptimizerType, its int
    value or its name (any case) gives ggml's AdamW or SGD."""
    if isinstance(optimizer, type) and issubclass(optimizer, Optimizer):
        optimizer = optimizer()
    if isinstance(optimizer, Optimizer):
        _check_declaration(optimizer, name)
        return optimizer
    if not isinstance(optimizer, (str, int, np.integer)) or isinstance(optimizer, bool):
        raise TypeError(f"{name}: expected an OptimizerType, one of its names or a "
                        f"ggmlopt.optimizers.Optimizer, got {type(optimizer).__name__}")
    return _BUILT_IN[enum_arg(optimizer, OptimizerType, name)]


def _check_declaration(opt: Optimizer, name: str) -> None:
    """A clear error for an Optimizer subclass whose names cannot make a checkpoint."""
    what = type(opt).__name__
    if not isinstance(opt.name, str) or not opt.name.isidentifier():
        raise ValueError(f"{name}: {what}.name must be an identifier (letters, digits, _), "
                         f"got {opt.name!r}")
    for attr in ("hyperparameter_names", "state_names"):
        names = getattr(opt, attr)
        if not isinstance(names, tuple) or not all(
                isinstance(n, str) and n.isidentifier() for n in names):
            raise ValueError(f"{name}: {what}.{attr} must be a tuple of identifiers, got "
                             f"{names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"{name}: {what}.{attr} repeats a name: {names!r}")
    clash = _RESERVED & set(opt.state_names)
    if clash:
        raise ValueError(f"{name}: {what}.state_names may not use {sorted(clash)} (the "
                         "arena's and checkpoints' own names)")
