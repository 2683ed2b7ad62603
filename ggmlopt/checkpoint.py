"""Checkpoints: an OptContext's training state as a dict, and as one .npz file.

``ctx.state_dict()`` gives a dict of plain numbers, strings and NumPy arrays
(copies).  Names (i = 0 .. nparams-1, the context's parameter order):

    format            str    "ggmlopt.OptContext"
    format_version    int    FORMAT_VERSION
    loss_type, optimizer, build_type      int    the LossType / OptimizerType /
                                                 BuildType values the context was made with
                                                 (optimizer -1: one defined outside ggmlopt,
                                                 named by optimizer_name)
    optimizer_name    str    only for optimizer -1: its ``Optimizer.name``
    opt_period        int
    batch_size, ne_datapoint              int    -1 when None (dynamic mode)
    class_labels      int    1 when the static labels are class indices, else 0
                             (optional on load: older files lack it, meaning 0)
    iter, opt_i       int    ggml's counters
    build_type_last   int    the BuildType of the last alloc (it decides whether
                             the next alloc zeroes the gradients)
    nparams           int
    param.i           float32, the parameter's shape
    grad.i            float32, the gradient (accumulated over the physical batches
                      of the logical batch so far: ctx.grad_acc; zeros from a
                      context with optimizer_in_backward, which keeps none and
                      ignores these on load)
    grad_is_zero      int8 (nparams,), 1 where a layer may overwrite the gradient
                      instead of adding into it (Parameter.grad_is_zero), else 0
    <name>_<state>.i  float32, the optimizer's state arrays (contexts built for
                      OPT): adamw_m.i and adamw_v.i, AdamW's moments; SGD has none
    <name>.<hyper-parameter>   float, the optimizer's hyper-parameters used by
                      the last step (float32 values), NaN before the first step:
                      adamw.alpha, adamw.beta1, adamw.beta2, adamw.eps, adamw.wd
                      (AdamW) or sgd.alpha, sgd.wd (SGD); see ggmlopt.optimizers
    rng_state         str    ctx.rng's ``bit_generator.state`` (dataset shuffles and the
                             model's random draws, e.g. Dropout masks), as JSON
    rank_rng_states   str    only with comm: every rank's ``ctx.model_rng`` state, a
                             JSON list in rank order (see ggmlopt.rank_rng); optional
                             on load
    precision         str    the precision the context was made with, "f32" or "bf16"
                             (the one asked for: a machine without bf16 products runs
                             float32); optional on load (older files lack it, meaning
                             "f32")
    precision_run     str    the precision the products ran in, "f32" or "bf16": a
                             resume that runs in the other one warns; optional on load
    trainable         int8 (all the model's parameters,): 1 where a parameter trains,
                      0 where it is frozen (requires_grad=False); optional on load
                      (older files lack it, meaning every parameter trains)
    trainable_names   str    the dotted names of the nparams parameters in the state,
                             a JSON list (``parameters()[i]`` where the model names
                             none); optional on load (older files lack it)
    model_info        str    what the trainable parameters' names and shapes leave
                             open, per layer (an adapter's rank, alpha and dropout, the
                             type a frozen base is kept in: checkpoint.model_info), a
                             JSON object; optional on load (older files lack it)
    frozen_digest     str    a digest of the frozen weights (frozen parameters, layers
                             kept in their file's types), all bytes (frozen_digest);
                             optional on load (older files lack it)

Only the trainable parameters are in the state (``nparams`` of them, in the
context's order): a frozen parameter is part of the model, not of its training.
A state loads only into a model with the same frozen/trainable split and the
same parameter names (adapters on the same layers: over a frozen base kept in its
file's types, adapters on k_proj have the shapes of those on v_proj); a
different one raises ValueError naming the first parameter that differs.  Nor
does it load into a model whose adapters have another alpha or dropout, whose
kept layers other types (model_info), or whose frozen weights differ
(frozen_digest: a resume over another base file is refused).

``load_state_dict(sd)`` checks every name (none missing, none extra), every
dtype (ints, floats, strings, float32 arrays) and shape, the format version and
that the loss type, optimizer, build type, opt_period and precision are the
context's, then
copies into the context's own buffers (nothing is reallocated).  On any mismatch
it raises (TypeError for a wrong type or dtype, ValueError for a wrong name,
shape or value, RuntimeError between alloc and eval) before changing anything.

``ctx.save(path)`` writes one uncompressed .npz file (numbers as 0-d arrays,
strings as unicode arrays: nothing needs pickle) atomically: into a temporary
file beside path, flushed and fsynced, then renamed over path, and the directory
fsynced; a crash at any moment leaves either the previous file or the new one.
Reading uses ``allow_pickle=False`` and checks every member's CRC, and that
the archive lists as many members as its end record counts (a corrupted
central directory can hide the last ones); a truncated, corrupted or foreign
file raises ValueError.

``fit(..., checkpoint=path)`` adds the ``fit.*`` entries it needs for an exact
resume (see FitCheckpoint): the epoch reached, the dataset's shard permutation,
the fit configuration and the history so far; inside an epoch also the step
reached in it and its training statistics, and fit's evaluations every N steps.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import warnings
import zipfile
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import rank_rng
from ._atomic import atomic_output
from ._crc import crc32_bytes
from ._rng_state import checked_rng_state, rng_state_from_json, rng_state_to_json
from .optim_params import (
    BuildType,
    LossType,
    OptimizerParams,
    OptimizerType,
)
from .optimizers import Optimizer, optimizer_arg

if TYPE_CHECKING:
    from .context import OptContext
    from .dataset import Dataset

__all__ = ["FORMAT", "FORMAT_VERSION", "FitCheckpoint", "FitProgress", "check_model",
           "context_state_dict", "data_digest", "fit_seed_id", "frozen_digest", "load_context",
           "load_context_state_dict", "load_state", "parameter_names", "save_state"]

FORMAT = "ggmlopt.OptContext"
FORMAT_VERSION = 1

# the "optimizer" entry of an optimizer defined outside ggmlopt (optimizer_name names it)
_OTHER_OPTIMIZER = -1
_SETTING_KEYS = ("format_version", "loss_type", "optimizer", "build_type", "opt_period",
                 "batch_size", "ne_datapoint", "iter", "opt_i", "build_type_last", "nparams")
_FIT_INT_KEYS = ("fit.epoch", "fit.ndata", "fit.nbatch_logical", "fit.nbatch_physical",
                 "fit.idata_split")
_FIT_KEYS = _FIT_INT_KEYS + ("fit.permutation", "fit.history")
# a checkpoint inside an epoch (fit(checkpoint_every=...), max_steps) and fit's
# evaluations every N steps: written only when there is something to say, so files
# without them (all files before them) read as "at the end of epoch fit.epoch"
_FIT_STEP_KEYS = ("fit.step", "fit.train_totals", "fit.evals")
# settings a state may hold or lack (written by every save)
_OPTIONAL_KEYS = ("class_labels", "trainable")
# what identifies the run's data and shuffling; checked when present (files written
# before these entries existed lack them).  fit.seed: the int seed, -1 for None (the
# default seed), -2 for a numpy Generator.
_FIT_RUN_KEYS = ("fit.ne_datapoint", "fit.ne_label", "fit.ndata_shard", "fit.seed",
                 "fit.shuffle", "fit.accumulate", "fit.data")
# fit.data: CRC-32 of the dataset's data and labels as stored (data_digest): a
# dataset of the same sizes but other content or order is another run
# fit.accumulate: 0 for accumulate="batches", 1 for "tokens"
_ACCUMULATE = ("batches", "tokens")
# fit's run_info: JSON of what else identifies the run (a resume compares it key by key)
_FIT_RUN_INFO = "fit.run_info"
# fit's schedule: the repr of a ggmlopt.schedules schedule (its kind, length and warmup)
_FIT_SCHEDULE = "fit.schedule"
# fit's model: JSON of what the trainable parameters' names and shapes leave open
# (an adapter's alpha and dropout, the type a frozen base is kept in), per layer
_FIT_MODEL = "fit.model"
_INT_KEYS = frozenset(_SETTING_KEYS + _FIT_INT_KEYS + _FIT_RUN_KEYS + _OPTIONAL_KEYS
                      + ("fit.step",))
_STR_KEYS = frozenset(("format", "rng_state", "optimizer_name"))
# strings a state may hold or lack: the ranks' own generators (ggmlopt.rank_rng),
# the precision asked for and the one that ran (files written before bf16 lack
# both, before the second the second), the model's layers and frozen weights
_OPTIONAL_STR_KEYS = ("rank_rng_states", "precision", "precision_run", "trainable_names",
                      "model_info", "frozen_digest")
# the fields of training.EpochStats (10 before blas_threads, 11 before exchange_wait_s)
HISTORY_COLUMNS = 12
EVAL_COLUMNS = 7      # the fields of training.EvalStats
TRAIN_TOTALS = 7      # Result._totals() of the epoch's training so far (6 before the
                      # batches without a labelled position were counted)


# ---- the generator's state as JSON -------------------------------------------------------

# ---- reading entries of a state dict -----------------------------------------------------

def _get_int(sd, key):
    v = sd[key]
    if isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "iu":
        return int(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"state_dict[{key!r}]: expected an int, got "
                        f"{_describe(v)}")
    return int(v)


def _get_float(sd, key):
    v = sd[key]
    if isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "iuf":
        return float(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"state_dict[{key!r}]: expected a float, got {_describe(v)}")
    return float(v)


def _get_str(sd, key):
    v = sd[key]
    if isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind == "U":
        return str(v)
    if not isinstance(v, str):
        raise TypeError(f"state_dict[{key!r}]: expected a str, got {_describe(v)}")
    return v


def _get_array(sd, key, dtype, shape):
    v = sd[key]
    if not isinstance(v, np.ndarray):
        raise TypeError(f"state_dict[{key!r}]: expected a numpy.ndarray, got {_describe(v)}")
    if v.dtype != dtype:
        raise TypeError(f"state_dict[{key!r}]: expected dtype {np.dtype(dtype).name}, "
                        f"got {v.dtype}")
    if shape is not None and v.shape != tuple(shape):
        raise ValueError(f"state_dict[{key!r}]: expected shape {tuple(shape)}, got {v.shape}")
    return v


def _describe(v):
    if isinstance(v, np.ndarray):
        return f"an array of dtype {v.dtype} and shape {v.shape}"
    return type(v).__name__


def _get_enum(sd, key, enum_cls):
    v = _get_int(sd, key)
    try:
        return enum_cls(v)
    except ValueError:
        raise ValueError(f"state_dict[{key!r}]: {v} is not a {enum_cls.__name__} "
                         f"({[f'{m.name}={m.value}' for m in enum_cls]})") from None


def _check_format(sd):
    """Checks the format entries: a clear error for anything that is not ours."""
    if not isinstance(sd, Mapping):
        raise TypeError(f"state_dict: expected a dict, got {type(sd).__name__}")
    if "format" not in sd or "format_version" not in sd:
        raise ValueError("state_dict: not a ggmlopt OptContext state (no 'format' and "
                         "'format_version' entries)")
    fmt = _get_str(sd, "format")
    if fmt != FORMAT:
        raise ValueError(f"state_dict['format']: expected {FORMAT!r}, got {fmt!r}")
    version = _get_int(sd, "format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"state_dict['format_version']: this ggmlopt reads version "
                         f"{FORMAT_VERSION}, got {version}")


# ---- what a context's state looks like ---------------------------------------------------

def _optimizer_label(optimizer: Optimizer) -> str:
    """ggml's name of a built-in optimizer (ADAMW), a user's optimizer's name."""
    kind = optimizer.optimizer_type
    return kind.name if kind is not None else optimizer.name


def _saved_optimizer(sd: Mapping[str, Any]) -> str:
    """The label (as _optimizer_label) of the optimizer a state was saved with."""
    if _get_int(sd, "optimizer") == _OTHER_OPTIMIZER:
        if "optimizer_name" not in sd:
            raise ValueError("state_dict['optimizer_name']: missing (optimizer=-1 is an "
                             "optimizer defined outside ggmlopt, named by optimizer_name)")
        return _get_str(sd, "optimizer_name")
    return _get_enum(sd, "optimizer", OptimizerType).name


class _Layout:
    """What a context's state dict holds: its settings and parameter shapes."""

    def __init__(self, loss_type, optimizer, build_type, opt_period, shapes, bit_generator_type,
                 trainable=None, names=None, precision="f32"):
        # trainable: the split over all the model's parameters (None: all train);
        # names: their dotted names, for the messages
        self.trainable = tuple(bool(t) for t in trainable) if trainable is not None else \
            (True,) * len(shapes)
        self.names = list(names) if names is not None else \
            [f"parameters()[{i}]" for i in range(len(self.trainable))]
        self.loss_type = LossType(loss_type)
        self.optimizer = optimizer_arg(optimizer)
        self.build_type = BuildType(build_type)
        self.opt_period = opt_period
        self.shapes = [tuple(s) for s in shapes]
        # as OptContext builds its arena: the optimizer's state when it steps
        self.state = self.optimizer.state_names if self.build_type == BuildType.OPT else ()
        self.bit_generator_type = bit_generator_type
        self.precision = precision
        # the precision the products run in: the one asked for, or float32 on a
        # machine without bf16 products
        self.precision_run = precision

    @classmethod
    def of(cls, ctx):
        shapes = [p.data.shape for p in ctx.parameters()]
        lay = cls(ctx.loss_type, ctx.optimizer, ctx.build_type, ctx.opt_period, shapes,
                  type(ctx.rng.bit_generator), ctx.trainable_mask,
                  parameter_names(ctx.model, ctx.model_parameters), ctx.precision_asked)
        lay.precision_run = ctx.precision
        return lay

    @property
    def hyper_keys(self):
        """The entries of the optimizer's hyper-parameters ('adamw.alpha', ...)."""
        opt = self.optimizer
        return tuple(f"{opt.name}.{h}" for h in opt.hyperparameter_names)

    def state_sections(self):
        """{'adamw_m': 'm', ...}: the state's entry prefixes and the arena's
        section names of the optimizer's state."""
        return {f"{self.optimizer.name}_{s}": s for s in self.state}

    def array_keys(self):
        sections = ["param", "grad", *self.state_sections()]
        return [(f"{s}.{i}", shape) for s in sections for i, shape in enumerate(self.shapes)]

    def describe(self, key):
        """'param.2' -> 'parameter 2.weight' (named_parameters' name of the state's
        third trainable parameter), 'adamw_m.2' -> "the AdamW m of parameter
        2.weight"; the index where the model has no names."""
        section, i = key.rsplit(".", 1)
        names = [n for n, t in zip(self.names, self.trainable) if t]
        name = f"parameter {names[int(i)] if int(i) < len(names) else i}"
        if section == "param":
            return name
        if section == "grad":
            return f"the gradient of {name}"
        state = self.state_sections()[section]
        return f"the {type(self.optimizer).__name__} {state} of {name}"

    def keys(self):
        keys = (set(_SETTING_KEYS) | (_STR_KEYS - {"optimizer_name"}) | {"grad_is_zero"}
                | set(self.hyper_keys) | {k for k, _ in self.array_keys()})
        if self.optimizer.optimizer_type is None:
            keys.add("optimizer_name")
        return keys


def _check_split(sd, layout):
    """Raise unless the state's frozen/trainable split is the model's."""
    if "trainable" in sd:
        saved = _get_array(sd, "trainable", np.int8, None)
        if saved.ndim != 1 or not np.all((saved == 0) | (saved == 1)):
            raise ValueError("state_dict['trainable']: expected a 1-D array of 0 and 1")
        saved = tuple(bool(t) for t in saved)
    elif "nparams" in sd:  # written before frozen parameters: every parameter trained
        saved = (True,) * _get_int(sd, "nparams")
    else:
        return
    mine = layout.trainable
    if saved == mine:
        return
    if len(saved) != len(mine):
        if sum(saved) != sum(mine):
            return  # another model: the parameter count check says so
        raise ValueError(f"state_dict['trainable']: the state is of a model with {len(saved)} "
                         f"parameters ({sum(saved)} trainable), this model has {len(mine)} "
                         f"({sum(mine)} trainable){_adapters_hint(sd, layout)}")
    if "trainable_names" in sd and sum(saved) == sum(mine) and \
            _get_str(sd, "trainable_names") != json.dumps(
                [n for n, t in zip(layout.names, saved) if t]):
        # not another split of these parameters but other parameters (adapters on
        # other layers): their names say which
        _check_names(sd, layout)
    i = next(i for i, (a, b) in enumerate(zip(saved, mine)) if a != b)
    state = "trainable" if saved[i] else "frozen"
    here = "trainable" if mine[i] else "frozen (requires_grad=False)"
    raise ValueError(f"state_dict['trainable']: parameter {layout.names[i]!r} is {here} in "
                     f"this model but {state} in the state; freeze the same parameters as "
                     "the run that saved it")


def _is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")


def _adapters_hint(sd, layout) -> str:
    """Where one side's trainable parameters are LoRA adapters and the other's
    not: what to do about it (else "")."""
    try:
        saved = json.loads(str(sd.get("trainable_names", "[]")))
    except json.JSONDecodeError:
        return ""
    if not isinstance(saved, list):
        return ""
    theirs = any(_is_adapter(str(n)) for n in saved)
    ours = any(_is_adapter(n) for n, t in zip(layout.names, layout.trainable) if t)
    if theirs and not ours:
        return ("; the state's trainable parameters are LoRA adapters and this model has "
                "none: put the same adapters on it (lora.apply) before loading")
    if ours and not theirs:
        return ("; this model holds LoRA adapters and the state none: load it into the "
                "model as it was saved (before lora.apply)")
    return ""


def _check_names(sd, layout):
    """Raise unless the state's parameters have this model's names (where both
    have one)."""
    try:
        saved = json.loads(_get_str(sd, "trainable_names"))
    except json.JSONDecodeError:
        saved = None
    if not isinstance(saved, list) or not all(isinstance(n, str) for n in saved):
        raise ValueError("state_dict['trainable_names']: expected a JSON list of str")
    mine = [n for n, t in zip(layout.names, layout.trainable) if t]
    if len(saved) != len(mine):
        return   # another parameter count: the nparams check says so
    for i, (a, b) in enumerate(zip(saved, mine)):
        if a != b and not (a.startswith("parameters()[") or b.startswith("parameters()[")):
            raise ValueError(f"state_dict['trainable_names']: the state's parameter {i} is "
                             f"{a!r}, this model's is {b!r}; a resume needs the same "
                             "trainable parameters (the same adapters on the same layers)")


def parameter_names(model: Any, params: list[Any]) -> list[str]:
    """The dotted names of params in model (``parameters()[i]`` where one has no name)."""
    from .nn.module import named_parameters

    try:
        names = {id(p): name for name, p in named_parameters(model)}
    except (ValueError, TypeError, AttributeError):
        names = {}
    return [names.get(id(p), f"parameters()[{i}]") for i, p in enumerate(params)]


def _validate(sd, layout, *, warn=True):
    """Everything load_state_dict checks; returns (counters, opt_pars_in_force, rng_state)
    without changing anything.  warn=False: a check ahead of the load_state_dict that
    follows, which gives the warnings (once, not twice)."""
    _check_format(sd)
    # the settings first: "another optimizer" says more than the names it changes
    for key, want in (("loss_type", layout.loss_type), ("build_type", layout.build_type)):
        if key in sd:
            got = _get_enum(sd, key, type(want))
            if got != want:
                raise ValueError(f"state_dict[{key!r}]: the state is for {got.name}, this "
                                 f"context uses {want.name}")
    if "optimizer" in sd:
        saved, mine = _saved_optimizer(sd), _optimizer_label(layout.optimizer)
        if saved != mine:
            raise ValueError(f"state_dict['optimizer']: the state is for {saved}, this "
                             f"context uses {mine}")
    if "opt_period" in sd:
        opt_period = _get_int(sd, "opt_period")
        if opt_period != layout.opt_period:
            raise ValueError(f"state_dict['opt_period']: the state is for opt_period="
                             f"{opt_period}, this context has {layout.opt_period}")
    if "precision" in sd:
        saved = _get_str(sd, "precision")
        if saved != layout.precision:
            raise ValueError(f"state_dict['precision']: the state is of a run with "
                             f"precision={saved!r}, this context has "
                             f"precision={layout.precision!r}; a resume goes on in the "
                             "precision it started in")
    if "precision_run" in sd:
        ran = _get_str(sd, "precision_run")
        if ran != layout.precision_run and warn:
            warnings.warn(f"state_dict['precision_run']: the saved run multiplied in {ran} "
                          f"and this machine multiplies in {layout.precision_run} (precision="
                          f"{layout.precision!r} runs float32 where a CPU has no bf16 "
                          "products): the run goes on, but neither machine alone would "
                          "give its result", UserWarning, stacklevel=3)
    _check_split(sd, layout)
    if "trainable_names" in sd:
        _check_names(sd, layout)
    if "nparams" in sd:
        nparams = _get_int(sd, "nparams")
        if nparams != len(layout.shapes):
            raise ValueError(f"state_dict['nparams']: the state has {nparams} parameters, "
                             f"this context's model {len(layout.shapes)}"
                             f"{_adapters_hint(sd, layout)}")
    expected = layout.keys()
    missing = sorted(expected - sd.keys(), key=str)
    extra = sorted(set(sd.keys()) - expected - set(_OPTIONAL_KEYS) - set(_OPTIONAL_STR_KEYS),
                   key=str)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:8]}{' ...' if len(extra) > 8 else ''}")
        raise ValueError(f"state_dict: its names do not match this context's state: "
                         f"{'; '.join(parts)}")
    if "class_labels" in sd and _get_int(sd, "class_labels") not in (0, 1):
        raise ValueError(f"state_dict['class_labels']: expected 0 or 1, got "
                         f"{_get_int(sd, 'class_labels')}")
    opt_period = layout.opt_period
    for key in ("batch_size", "ne_datapoint"):
        if _get_int(sd, key) < -1 or _get_int(sd, key) == 0:
            raise ValueError(f"state_dict[{key!r}]: expected -1 (None) or >= 1, got "
                             f"{_get_int(sd, key)}")
    it = _get_int(sd, "iter")
    if it < 1:
        raise ValueError(f"state_dict['iter']: expected >= 1, got {it}")
    opt_i = _get_int(sd, "opt_i")
    if not 0 <= opt_i < opt_period:
        raise ValueError(f"state_dict['opt_i']: expected 0 <= opt_i < opt_period={opt_period}, "
                         f"got {opt_i}")
    last = _get_enum(sd, "build_type_last", BuildType)
    if last > layout.build_type:
        raise ValueError(f"state_dict['build_type_last']: {last.name} is beyond the build "
                         f"type {layout.build_type.name}")

    values = [_get_float(sd, k) for k in layout.hyper_keys]
    if all(math.isnan(v) for v in values):
        in_force = None
    else:
        try:
            in_force = tuple(layout.optimizer.restore_hyperparameters(values))
        except ValueError as e:
            raise ValueError(f"state_dict: optimizer parameters in force: {e}") from None

    for key, shape in layout.array_keys():
        try:
            _get_array(sd, key, np.float32, shape)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{layout.describe(key)}: {e}") from None
    flags = _get_array(sd, "grad_is_zero", np.int8, (len(layout.shapes),))
    if not np.all((flags == 0) | (flags == 1)):
        raise ValueError("state_dict['grad_is_zero']: expected only 0 and 1")
    rng_state = checked_rng_state(_get_str(sd, "rng_state"), layout.bit_generator_type)
    return (it, opt_i, last), in_force, rng_state


# ---- OptContext <-> state dict -----------------------------------------------------------

def context_state_dict(ctx: OptContext) -> dict[str, Any]:
    """ctx's state as described in the module docstring (arrays are copies)."""
    if ctx.eval_ready:
        raise RuntimeError("state_dict: alloc() was called and its eval() has not run; "
                           "call eval() first")
    lay = _Layout.of(ctx)
    sd = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "loss_type": int(ctx.loss_type),
        "optimizer": _OTHER_OPTIMIZER if ctx.optimizer_type is None else int(ctx.optimizer_type),
        "build_type": int(ctx.build_type),
        "opt_period": int(ctx.opt_period),
        "batch_size": -1 if ctx.batch_size is None else int(ctx.batch_size),
        "ne_datapoint": -1 if ctx.ne_datapoint is None else int(ctx.ne_datapoint),
        "iter": int(ctx.iter),
        "opt_i": int(ctx.opt_i),
        "build_type_last": int(ctx.build_type_last),
        "nparams": len(lay.shapes),
        "class_labels": int(getattr(ctx, "class_labels", False)),
    }
    if ctx.optimizer_type is None:
        sd["optimizer_name"] = ctx.optimizer.name
    in_force = ctx.opt_pars_in_force
    for j, name in enumerate(lay.hyper_keys):
        sd[name] = float("nan") if in_force is None else float(in_force[j])
    sharded = None
    dist = ctx.distributed
    if _sharded_state(ctx):  # many processes: the state is gathered from every rank
        sharded = dist.gather_state(ctx.arena.size)
    for key, shape in lay.array_keys():
        if key.startswith("grad.") and not ctx.arena.has_grads:
            # optimizer_in_backward keeps no gradient between steps: zeros, as the
            # next step's alloc would make them
            sd[key] = np.zeros(shape, np.float32)
        else:
            sd[key] = _section_view(ctx, lay, key, sharded).copy()
    # whether a layer overwrites or adds into a gradient decides the sign of its zeros
    sd["grad_is_zero"] = np.array([getattr(p, "grad_is_zero", False)
                                   for p in ctx.parameters()], dtype=np.int8)
    sd["rng_state"] = rng_state_to_json(ctx.rng.bit_generator)
    if dist is not None:  # many processes: every rank's own stream
        sd["rank_rng_states"] = rank_rng.gather_states(dist, ctx.model_rng)
    sd["trainable"] = np.array(lay.trainable, dtype=np.int8)
    sd["precision"] = lay.precision
    sd["precision_run"] = lay.precision_run
    sd["trainable_names"] = json.dumps([n for n, t in zip(lay.names, lay.trainable) if t])
    sd["model_info"] = json.dumps(model_info(ctx.model), sort_keys=True)
    sd["frozen_digest"] = frozen_digest(ctx.model, ctx.frozen_parameters())
    return sd


def _sharded_state(ctx):
    """Whether ctx's optimizer state is sharded over ranks (ggmlopt.distributed)."""
    dist = ctx.distributed
    return dist is not None and dist.sharded_state


def _section_view(ctx, layout, key, sharded=None):
    """The part of key (e.g. "grad.3") in ctx's arena, or in sharded (the full
    state arrays standing in for a sharded state)."""
    section, i = key.split(".")
    i = int(i)
    shapes = layout.shapes
    offset = sum(math.prod(s) for s in shapes[:i])  # parameters sit back to back
    which = {"param": "weights", "grad": "grads", **layout.state_sections()}[section]
    if sharded is not None and which in sharded:
        return sharded[which][offset:offset + math.prod(shapes[i])].reshape(shapes[i])
    return ctx.arena.view(which, offset, shapes[i])


def load_context_state_dict(ctx: OptContext, sd: Mapping[str, Any]) -> None:
    """Check sd against ctx completely, then copy it into ctx's buffers."""
    if ctx.eval_ready:
        raise RuntimeError("load_state_dict: alloc() was called and its eval() has not run; "
                           "call eval() first")
    lay = _Layout.of(ctx)
    (it, opt_i, last), in_force, rng_state = _validate(sd, lay)
    check_model(sd, ctx.model, ctx.frozen_parameters())
    dist = ctx.distributed
    rank_states = None
    if dist is not None and "rank_rng_states" in sd:
        rank_states = rank_rng.parse_states(_get_str(sd, "rank_rng_states"),
                                            lay.bit_generator_type)
    # from here on nothing can fail
    sharded = None
    if _sharded_state(ctx):  # many processes: each rank keeps its shard of the state
        sharded = {s: np.empty(ctx.arena.size, np.float32) for s in lay.state}
    for key, _ in lay.array_keys():
        if key.startswith("grad.") and not ctx.arena.has_grads:
            continue   # optimizer_in_backward: the next step starts from zero anyway
        np.copyto(_section_view(ctx, lay, key, sharded), sd[key])
    if sharded is not None:
        dist.set_state(sharded)
    ctx._restore_counters(it, opt_i, last, in_force)
    ctx.rng.bit_generator.state = rng_state
    if dist is not None:  # many processes: each rank's own stream
        rank_rng.restore(ctx, rank_states)
    for p, flag in zip(ctx.parameters(), sd["grad_is_zero"]):
        if hasattr(p, "grad_is_zero"):
            p.grad_is_zero = bool(flag)


def split_fit_entries(sd: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the context's entries, the fit.* entries) of a loaded checkpoint."""
    ctx_sd = {k: v for k, v in sd.items() if not k.startswith("fit.")}
    fit_sd = {k: v for k, v in sd.items() if k.startswith("fit.")}
    unknown = sorted(set(fit_sd) - set(_FIT_KEYS) - set(_FIT_RUN_KEYS) - set(_FIT_STEP_KEYS)
                     - {_FIT_RUN_INFO, _FIT_MODEL, _FIT_SCHEDULE})
    if unknown:
        raise ValueError(f"checkpoint: unexpected entries {unknown}")
    return ctx_sd, fit_sd


def load_context(cls: type[OptContext], path: str | os.PathLike[str], model: Any,
                 get_opt_pars: Callable[[Any], OptimizerParams], get_opt_pars_ud: Any,
                 clip_grad_norm: float | None, optimizer: Any = None, **dist: Any) -> OptContext:
    """OptContext.load: a context for model with the checkpoint's settings and state
    (optimizer: None, or the optimizer the checkpoint was saved with; needed for
    one defined outside ggmlopt)."""
    sd = load_state(path)
    ctx_sd, fit_sd = split_fit_entries(sd)
    try:
        _check_format(ctx_sd)
        settings = {k: _get_int(ctx_sd, k) for k in _SETTING_KEYS if k in ctx_sd}
        missing = [k for k in _SETTING_KEYS if k not in settings]
        if missing or "rng_state" not in ctx_sd:
            raise ValueError(f"state_dict: missing {missing or ['rng_state']}")
        loss_type = _get_enum(ctx_sd, "loss_type", LossType)
        saved_optimizer = _saved_optimizer(ctx_sd)
        if optimizer is None:
            if _get_int(ctx_sd, "optimizer") == _OTHER_OPTIMIZER:
                raise ValueError(f"optimizer: the checkpoint was saved with the optimizer "
                                 f"{saved_optimizer!r}, defined outside ggmlopt; pass it "
                                 f"(OptContext.load(..., optimizer=...))")
            optimizer = OptimizerType[saved_optimizer]
        optimizer = optimizer_arg(optimizer)
        if _optimizer_label(optimizer) != saved_optimizer:
            raise ValueError(f"optimizer: the checkpoint was saved with {saved_optimizer}, "
                             f"not {_optimizer_label(optimizer)}")
        build_type = _get_enum(ctx_sd, "build_type", BuildType)
        if settings["opt_period"] < 1:
            raise ValueError(f"state_dict['opt_period']: expected >= 1, got "
                             f"{settings['opt_period']}")
        precision = _get_str(ctx_sd, "precision") if "precision" in ctx_sd else "f32"
        if precision not in ("f32", "bf16"):
            raise ValueError(f"state_dict['precision']: expected 'f32' or 'bf16', got "
                             f"{precision!r}")
        bg_name = rng_state_from_json(_get_str(ctx_sd, "rng_state"))["bit_generator"]
        bg_type = getattr(np.random, bg_name, None)
        if not (isinstance(bg_type, type) and issubclass(bg_type, np.random.BitGenerator)):
            raise ValueError(f"rng_state: unknown bit generator {bg_name!r}")  # noqa: TRY004
    except (ValueError, TypeError) as e:
        raise type(e)(f"path: {os.fspath(path)!r}: {e}") from None

    # check the model against the checkpoint before the context takes its parameters
    params = cls._collect_parameters(model)
    trainable = [bool(getattr(p, "requires_grad", True)) for p in params]
    names = parameter_names(model, params)
    try:
        _check_split(ctx_sd, _Layout(loss_type, optimizer, build_type, settings["opt_period"],
                                     [], None, trainable, names, precision))
    except (ValueError, TypeError) as e:
        raise type(e)(f"model or checkpoint {os.fspath(path)!r} do not match: {e}") from None
    shapes = [p.data.shape for p, t in zip(params, trainable) if t]
    if len(shapes) != settings["nparams"]:
        hint = _adapters_hint(ctx_sd, _Layout(loss_type, optimizer, build_type, 1, [], None,
                                              trainable, names, precision))
        raise ValueError(f"model: it has {len(shapes)} parameters, the checkpoint "
                         f"{os.fspath(path)!r} {settings['nparams']}{hint}")
    lay = _Layout(loss_type, optimizer, build_type, settings["opt_period"], shapes, bg_type,
                  trainable, names, precision)
    for i, shape in enumerate(shapes):
        saved = ctx_sd.get(f"param.{i}")
        if isinstance(saved, np.ndarray) and saved.shape != shape:
            raise ValueError(f"model: {lay.describe(f'param.{i}')} has shape {shape}, the "
                             f"checkpoint {os.fspath(path)!r} has shape {saved.shape} for it "
                             f"(param.{i})")
    try:
        _validate(ctx_sd, lay, warn=False)   # (the context's load_state_dict warns)
        if _FIT_MODEL in fit_sd:   # written by fit (before the state had model_info)
            _check_model_info(fit_sd, _FIT_MODEL, model_info(model))
        check_model(ctx_sd, model, [p for p, t in zip(params, trainable) if not t])
    except (ValueError, TypeError) as e:
        raise type(e)(f"model or checkpoint {os.fspath(path)!r} do not match: {e}") from None

    bs, nd = settings["batch_size"], settings["ne_datapoint"]
    ctx = cls(model, batch_size=None if bs < 0 else bs, ne_datapoint=None if nd < 0 else nd,
              loss_type=loss_type, build_type=build_type, opt_period=settings["opt_period"],
              optimizer=optimizer, get_opt_pars=get_opt_pars, get_opt_pars_ud=get_opt_pars_ud,
              seed=np.random.Generator(bg_type()), clip_grad_norm=clip_grad_norm,
              class_labels=bool(_get_int(ctx_sd, "class_labels")) if "class_labels" in ctx_sd
              else False, precision=precision, **dist)
    ctx.load_state_dict(ctx_sd)
    return ctx


# ---- the file ---------------------------------------------------------------------------

def _as_array(key, value):
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError(f"state_dict[{key!r}]: object arrays cannot be saved without pickle")
        return value
    if isinstance(value, str):
        return np.array(value)
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, numbers.Real)):
        raise TypeError(f"state_dict[{key!r}]: expected a number, str or numpy.ndarray, got "
                        f"{type(value).__name__}")
    if isinstance(value, numbers.Integral):
        return np.array(int(value), dtype=np.int64)
    return np.array(float(value), dtype=np.float64)


def save_state(path: str | os.PathLike[str], sd: Mapping[str, Any]) -> None:
    """Write the state dict sd to path as one .npz file, atomically.

    path: str or os.PathLike, written as given (no suffix is added).  The data goes
    to a temporary file in the same directory, is flushed and fsynced, then
    renamed over path (atomic on POSIX and Windows), so readers and crashes only
    ever see a complete file.
    """
    if not isinstance(sd, Mapping):
        raise TypeError(f"state_dict: expected a dict, got {type(sd).__name__}")
    try:
        path = os.fspath(path)
    except TypeError:
        raise TypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}") \
            from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    arrays = {}
    for key, value in sd.items():
        if not isinstance(key, str) or not key or "/" in key:
            raise ValueError(f"state_dict: {key!r} is not a valid entry name")
        arrays[key] = _as_array(key, value)
    if os.path.isdir(path):
        raise ValueError(f"path: {path!r} is a directory; expected a file name")
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)


def _scalar(key, arr):
    """A 0-d array of a known scalar entry as the plain Python value it was saved from."""
    if arr.ndim != 0:
        return arr
    if key in _INT_KEYS and arr.dtype.kind in "iu":
        return int(arr)
    if arr.dtype.kind == "f" and not key.startswith("fit."):  # hyper-parameters
        return float(arr)
    if (key in _STR_KEYS or key in _OPTIONAL_STR_KEYS or key == _FIT_RUN_INFO) \
            and arr.dtype.kind == "U":
        return str(arr)
    return arr


def _counted_members(f) -> int | None:
    """The member count a zip file's end-of-central-directory record states (None
    where it does not say: no record found, or a ZIP64 count)."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - (22 + 65535)))   # the record and its longest comment
    tail = f.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + 22 > len(tail):
        return None
    total = int.from_bytes(tail[at + 10:at + 12], "little")
    return None if total == 0xFFFF else total


def load_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The state dict stored at path by save_state (numbers and strings as plain
    Python values, arrays as arrays).

    Raises FileNotFoundError when path does not exist, ValueError when it is not
    a complete, uncorrupted ggmlopt checkpoint (truncated, a bad CRC, not an .npz
    archive, pickled data, or another program's .npz).
    """
    try:
        path = os.fspath(path)
    except TypeError:
        raise TypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}") \
            from None
    where = repr(path)
    if os.path.isdir(path):
        raise ValueError(f"path: {where} is a directory; expected a checkpoint file")
    sd = {}
    with open(path, "rb") as f:
        if not zipfile.is_zipfile(f):
            raise ValueError(f"path: {where} is not a ggmlopt checkpoint (not an .npz "
                             "archive; truncated or another kind of file)")
        f.seek(0)
        try:
            counted = _counted_members(f)
            f.seek(0)
            with np.load(f, allow_pickle=False) as npz:  # a zip file: always an NpzFile
                if counted is not None and counted != len(npz.files):
                    # (zipfile does not compare them: an entry of a mid-epoch
                    # checkpoint lost this way would read as an epoch's end)
                    raise ValueError(f"the archive lists {len(npz.files)} members, its end "
                                     f"record counts {counted}")
                if len(set(npz.files)) != len(npz.files):
                    # a corrupted name that took another's: one of the two would be lost
                    raise ValueError("the archive lists a member name twice")
                for key in npz.files:
                    # reading a member to its end checks its CRC
                    sd[key] = _scalar(key, npz[key])
        except (zipfile.BadZipFile, ValueError, EOFError, KeyError, OSError,
                NotImplementedError, RuntimeError) as e:   # (a flipped "encrypted" flag)
            if isinstance(e, FileNotFoundError):
                raise
            raise ValueError(f"path: {where} is not a readable ggmlopt checkpoint (truncated "
                             f"or corrupted: {e})") from None
    if "format" not in sd or "format_version" not in sd:
        raise ValueError(f"path: {where} is an .npz file but not a ggmlopt checkpoint (no "
                         "'format' entry)")
    try:
        _check_format(sd)
    except (ValueError, TypeError) as e:
        raise ValueError(f"path: {where}: {e}") from None
    return sd


# ---- fit's checkpoints --------------------------------------------------------------------

class FitProgress(NamedTuple):
    """A fit checkpoint as FitCheckpoint.read returns it: the context's entries,
    the shard order, the epochs completed, their EpochStats rows, the steps done
    in the next epoch (0 at an epoch's end), that epoch's training Result totals
    (None at an epoch's end), the EvalStats rows and the schedule's repr (None
    when the run had none, or wrote no such entry)."""

    ctx_sd: dict[str, Any]
    permutation: np.ndarray
    epochs_done: int
    history_rows: list[tuple[float, ...]]
    step: int
    train_totals: tuple[float, ...] | None
    eval_rows: list[tuple[float, ...]]
    schedule: str | None = None


class FitCheckpoint:
    """What fit saves after every epoch and restores on resume: the context's state
    plus ``fit.epoch`` (epochs completed), ``fit.permutation`` (the dataset's
    shard order, int64 (nshards,)), ``fit.history`` (float64 (epochs, 12), the
    EpochStats rows so far), inside an epoch ``fit.step`` (its optimizer steps
    done) and ``fit.train_totals`` (float64 (7,), its training statistics so
    far), with evaluations every N steps ``fit.evals`` (float64 (n, 7), the
    EvalStats rows), and the configuration that must not change between
    runs (``fit.ndata``, ``fit.nbatch_logical``, ``fit.nbatch_physical``,
    ``fit.idata_split``) or that identifies the run (``fit.ne_datapoint``,
    ``fit.ne_label``, ``fit.ndata_shard``, ``fit.seed``, ``fit.data``: the
    data's and labels' CRC-32; checked on resume when the file has them).

    The path is checked when fit starts: its directory must exist and be
    writable, so a typo fails before the first epoch, not after it."""

    def __init__(self, path: Any, ndata: int, nbatch_logical: int, nbatch_physical: int,
                 idata_split: int, run: Mapping[str, int] | None = None,
                 run_info: Mapping[str, Any] | None = None,
                 model_info: Mapping[str, str] | None = None,
                 schedule: str | None = None) -> None:
        try:
            self.path = os.fspath(path)
        except TypeError:
            raise TypeError(f"checkpoint: expected a path (str or os.PathLike) or None, got "
                            f"{type(path).__name__}") from None
        if isinstance(self.path, bytes):
            self.path = os.fsdecode(self.path)
        if os.path.isdir(self.path):
            raise ValueError(f"checkpoint: {self.path!r} is a directory; expected a file name")
        # the folder the file lands in (atomic_output writes through a symbolic link)
        directory = os.path.dirname(os.path.abspath(self.path))
        real = os.path.dirname(os.path.realpath(self.path))
        if not os.path.isdir(real):
            raise ValueError(f"checkpoint: the directory {directory!r} of {self.path!r} does "
                             "not exist; create it first")
        if not os.access(real, os.W_OK | os.X_OK):
            raise ValueError(f"checkpoint: the directory {directory!r} of {self.path!r} is "
                             "not writable")
        self.config = {"fit.ndata": ndata, "fit.nbatch_logical": nbatch_logical,
                       "fit.nbatch_physical": nbatch_physical, "fit.idata_split": idata_split}
        self.run = dict(run or {})
        self.run_info = run_info_arg(run_info)
        self.model_info = dict(model_info or {})
        self.schedule = schedule

    def exists(self) -> bool:
        """Whether the checkpoint file exists."""
        return os.path.exists(self.path)

    def read(self, dataset: Dataset, nepoch: int, layout_args: tuple[Any, ...],
             steps_per_epoch: int | None = None, model: Any = None,
             frozen: list[Any] | None = None) -> FitProgress:
        """The checkpoint checked whole against this fit (its configuration, the
        dataset, and the context it will build: layout_args are _Layout's
        arguments; steps_per_epoch bounds fit.step; model and its frozen
        parameters, for check_model) before fit touches the model."""
        sd = load_state(self.path)
        ctx_sd, fit_sd = split_fit_entries(sd)
        where = f"checkpoint: {self.path!r}"
        missing = [k for k in _FIT_KEYS if k not in fit_sd]
        if missing:
            raise ValueError(f"{where} was not written by fit (missing {missing})")
        try:
            for key, want in self.config.items():
                got = _get_int(fit_sd, key)
                if got != want:
                    name = key.split(".", 1)[1]
                    raise ValueError(f"{key}: the checkpoint was made with {name}={got}, this "
                                     f"fit has {name}={want}")
            self._check_run(fit_sd, [k for k in self.run if k not in ("fit.seed", "fit.data")])
            self._check_run_info(fit_sd)   # (a caller's names for what made the data first)
            self._check_run(fit_sd, ("fit.data",))
            done = _get_int(fit_sd, "fit.epoch")
            if done < 0:
                raise ValueError(f"fit.epoch: expected >= 0, got {done}")
            perm = _get_array(fit_sd, "fit.permutation", np.int64, (dataset.nshards,))
            if not np.array_equal(np.sort(perm), np.arange(dataset.nshards)):
                raise ValueError("fit.permutation: not a permutation of the dataset's shards")
            ncols = HISTORY_COLUMNS
            if np.shape(fit_sd["fit.history"])[1:] in ((10,), (11,)):
                # written before EpochStats had blas_threads, or exchange_wait_s
                ncols = np.shape(fit_sd["fit.history"])[1]
            history = _get_array(fit_sd, "fit.history", np.float64, (done, ncols))
            step, totals, evals = self._read_steps(fit_sd, steps_per_epoch)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{where}: {e}") from None
        if done > nepoch or (done == nepoch and step > 0):
            more = f" and {step} steps of epoch {done + 1}" if step else ""
            raise ValueError(f"nepoch: the checkpoint {self.path!r} has already trained {done} "
                             f"epochs{more}, more than nepoch={nepoch}")
        try:
            _validate(ctx_sd, _Layout(*layout_args), warn=False)   # (load_state_dict warns)
        except (ValueError, TypeError) as e:
            raise type(e)(f"model or {where} do not match: {e}") from None
        try:
            # after the parameters' names and shapes, which say more where they differ
            self._check_model_info(fit_sd)
            if model is not None:
                check_model(ctx_sd, model, frozen or [])
            self._check_run(fit_sd, ("fit.seed",))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return FitProgress(ctx_sd, perm, done, [tuple(row) for row in history.tolist()], step,
                           totals, [tuple(row) for row in evals.tolist()],
                           str(fit_sd[_FIT_SCHEDULE]) if _FIT_SCHEDULE in fit_sd else None)

    @staticmethod
    def _read_steps(fit_sd: Mapping[str, Any], steps_per_epoch: int | None
                    ) -> tuple[int, tuple[float, ...] | None, np.ndarray]:
        """(fit.step, fit.train_totals, fit.evals) checked; 0, None and no rows
        for a file written at an epoch's end without evaluations."""
        step = _get_int(fit_sd, "fit.step") if "fit.step" in fit_sd else 0
        if step < 0 or (steps_per_epoch is not None and step >= max(steps_per_epoch, 1)):
            raise ValueError(f"fit.step: expected 0 <= step < {steps_per_epoch} (the steps "
                             f"of an epoch), got {step}")
        totals = None
        if step > 0:
            if "fit.train_totals" not in fit_sd:
                raise ValueError("fit.train_totals: missing for a checkpoint inside an epoch")
            totals = _get_array(fit_sd, "fit.train_totals", np.float64, None)
            if totals.shape not in ((TRAIN_TOTALS,), (TRAIN_TOTALS - 1,)):
                raise ValueError(f"fit.train_totals: expected shape ({TRAIN_TOTALS},), got "
                                 f"{totals.shape}")
            totals = tuple(totals.tolist())
        evals = np.zeros((0, EVAL_COLUMNS))
        if "fit.evals" in fit_sd:
            evals = _get_array(fit_sd, "fit.evals", np.float64, None)
            if evals.ndim != 2 or evals.shape[1] != EVAL_COLUMNS:
                raise ValueError(f"fit.evals: expected shape (n, {EVAL_COLUMNS}), got "
                                 f"{evals.shape}")
        return step, totals, evals

    def _check_run(self, fit_sd: Mapping[str, Any], keys: Iterable[str]) -> None:
        """Refuse a checkpoint of another run (the entries in keys it has, and
        fit.shuffle and fit.accumulate, which a checkpoint written before the entry
        existed holds as fit always did it: shuffling whenever nbatch_logical <
        ndata, accumulating ggml's way)."""
        before = {"fit.shuffle": int(self.config["fit.nbatch_logical"]
                                     < self.config["fit.ndata"]),
                  "fit.accumulate": 0}
        for key in keys:
            if key not in self.run or (key not in fit_sd and key not in before):
                continue
            got = _get_int(fit_sd, key) if key in fit_sd else before[key]
            want = self.run[key]
            if got != want:
                name = key.split(".", 1)[1]
                if key == "fit.data":
                    raise ValueError(f"{key}: the checkpoint was made with other data of the "
                                     f"same sizes (CRC-32 {got:08x}, this dataset's "
                                     f"{want:08x}: its datapoints, labels or their order "
                                     f"differ); resume only the same run (on the data "
                                     f"it began with)")
                how = (f"pass accumulate={_run_value(key, got)}" if key == "fit.accumulate"
                       else "same dataset and seed")
                raise ValueError(f"{key}: the checkpoint was made with {name}="
                                 f"{_run_value(key, got)}, this fit has {name}="
                                 f"{_run_value(key, want)}; resume only the same run ({how})")

    def _check_run_info(self, fit_sd: Mapping[str, Any]) -> None:
        """Refuse a checkpoint whose run_info gives a key of this fit's another value."""
        if _FIT_RUN_INFO not in fit_sd or not self.run_info:
            return
        saved = _json_object(fit_sd, _FIT_RUN_INFO)
        for key, want in self.run_info.items():
            if key in saved and saved[key] != want:
                raise ValueError(f"{_FIT_RUN_INFO}: the checkpoint was made with {key}="
                                 f"{saved[key]!r}, this fit has {key}={want!r}; resume only "
                                 f"the same run")

    def _check_model_info(self, fit_sd: Mapping[str, Any]) -> None:
        """Refuse a checkpoint of a model whose layers differ from this one's where
        the parameters' names and shapes do not tell (a checkpoint written before
        fit recorded it is not checked)."""
        if _FIT_MODEL in fit_sd:
            _check_model_info(fit_sd, _FIT_MODEL, self.model_info)

    def save(self, ctx: OptContext, dataset: Dataset, epoch: int,
             history_rows: list[tuple[float, ...]], step: int = 0,
             train_totals: tuple[float, ...] | None = None,
             eval_rows: list[tuple[float, ...]] | None = None) -> None:
        """Write the context's state, the shard order, the epochs done and the
        history rows to the checkpoint file (atomically); inside an epoch also
        the steps done in it (step > 0) and its training Result's totals, and
        the evaluations every N steps so far (eval_rows) when there are any."""
        sd = ctx.state_dict()
        sd.update(self.config)
        sd.update(self.run)
        if self.run_info:
            sd[_FIT_RUN_INFO] = json.dumps(self.run_info, sort_keys=True)
        if self.model_info:
            sd[_FIT_MODEL] = json.dumps(self.model_info, sort_keys=True)
        if self.schedule is not None:
            sd[_FIT_SCHEDULE] = self.schedule
        sd["fit.epoch"] = int(epoch)
        sd["fit.permutation"] = np.asarray(dataset.permutation, dtype=np.int64)
        sd["fit.history"] = np.array(history_rows, dtype=np.float64).reshape(
            len(history_rows), HISTORY_COLUMNS)
        if step > 0:
            sd["fit.step"] = int(step)
            sd["fit.train_totals"] = np.array(train_totals, dtype=np.float64)
        if eval_rows:
            sd["fit.evals"] = np.array(eval_rows, dtype=np.float64).reshape(
                len(eval_rows), EVAL_COLUMNS)
        if ctx.distributed is not None:  # many processes: rank 0 writes
            ctx.distributed.save(self.path, sd, save_state)
        else:
            save_state(self.path, sd)


def _json_object(fit_sd: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The checkpoint's entry key, a JSON object (ValueError for anything else)."""
    try:
        saved = json.loads(str(fit_sd[key]))
    except ValueError:
        saved = None
    if not isinstance(saved, dict):
        raise ValueError(f"{key}: not a JSON object")  # noqa: TRY004 (a file's value)
    return saved


def _check_model_info(sd: Mapping[str, Any], key: str, info: Mapping[str, str],
                      where: str | None = None) -> None:
    """Refuse a state whose entry key (a model_info as JSON) differs from info
    (where: the entry's name in the message, default key)."""
    saved = _json_object(sd, key)
    for name in sorted(set(saved) | set(info)):
        was, now = saved.get(name, "float32"), info.get(name, "float32")
        if was != now:
            raise ValueError(f"{where or key}: the checkpoint's model has {name}: {was}, this "
                             f"model has {now}; resume the same model")


def check_model(sd: Mapping[str, Any], model: Any, frozen: Iterable[Any]) -> None:
    """Refuse a state of a model that differs from model where the trainable
    parameters' names and shapes do not tell: its layers (the state's
    model_info) and its frozen weights (frozen: model's frozen parameters;
    the state's frozen_digest).  A state without these entries (written before
    them) is not checked."""
    if "model_info" in sd:
        _check_model_info(sd, "model_info", model_info(model), "state_dict['model_info']")
    if "frozen_digest" in sd:
        saved = _get_str(sd, "frozen_digest")
        # a state written before every byte counted holds the sampled digest
        now = frozen_digest(model, frozen, sampled=not saved.startswith(_DIGEST_PREFIX))
        if saved != now:
            raise ValueError(f"state_dict['frozen_digest']: the state was trained over other "
                             f"frozen weights than this model's (digest {saved}, this model "
                             f"{now}): another base model file, or another seed; resume over "
                             "the base the run started from")


# the sampled digest's stretches (states written before every byte counted)
_SAMPLED_STRETCH, _SAMPLED_STRETCHES = 4096, 16
_DIGEST_PREFIX = "crc-"


def _digest_array(h: Any, a: np.ndarray, sampled: bool) -> None:
    """Feed h a's dtype, shape and the CRC-32 of all its bytes (or, sampled,
    16 stretches of 4 KiB spread over them, as older states were written)."""
    h.update(f"{a.dtype.str}{a.shape};".encode())
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    if not sampled:
        h.update(crc32_bytes(raw).to_bytes(4, "little"))
        return
    size, chunk, count = raw.size, _SAMPLED_STRETCH, _SAMPLED_STRETCHES
    if size <= chunk * count:
        h.update(raw)
        return
    for i in range(count):
        at = (size - chunk) * i // (count - 1)
        h.update(raw[at:at + chunk])


def frozen_digest(model: Any, frozen: Iterable[Any], *, sampled: bool = False) -> str:
    """A digest ("crc-" and 16 hex digits) of what trains nowhere in model: its
    frozen parameters (frozen, in order) and the weights of its layers kept in
    their file's types (a QLoRA base), every byte of each array.  sampled: the
    16 hex digits older states hold, of a few stretches of each array (which
    missed a base that differs in a few rows)."""
    from .nn.quantized import quantized_layers
    h = hashlib.blake2b(digest_size=8)
    for p in frozen:
        _digest_array(h, p.data, sampled)
    for _, layer in quantized_layers(model):
        _digest_array(h, layer.qweight, sampled)
    return h.hexdigest() if sampled else _DIGEST_PREFIX + h.hexdigest()


def model_info(model) -> dict[str, str]:
    """Per layer, what a checkpoint of model's trainable parameters does not hold:
    a LoRA adapter's rank, alpha, dropout and base type ("LoRA rank=8
    alpha=16.0 dropout=0.1 over Q8_0"), a frozen layer kept in its file's type
    ("kept Q4_K"); float32 layers are not listed."""
    from .lora import named_adapters
    from .nn.module import named_modules
    info = {}
    for name, layer in named_adapters(model):
        dropout = getattr(getattr(layer, "lora_dropout", None), "p", 0.0)
        base = getattr(getattr(layer, "_base", None), "qtype", None) or "float32"
        info[name] = (f"LoRA rank={layer.rank} alpha={layer.alpha!r} dropout={dropout!r} "
                      f"over {base}")
    for name, module in named_modules(model):
        qtype = getattr(module, "qtype", None)
        if isinstance(qtype, str) and name not in info:
            info[name] = f"kept {qtype}"
    return info


def fit_seed_id(seed: Any) -> int:
    """fit's seed as the int a checkpoint stores: the seed, -1 for None, -2 for a
    numpy Generator (whose own state is the checkpoint's rng_state)."""
    if seed is None:
        return -1
    if isinstance(seed, np.random.Generator):
        return -2
    return int(seed)


def run_info_arg(run_info: Any) -> dict[str, Any]:
    """fit's run_info checked: None or a mapping of str to str, int, float or bool
    (values JSON keeps as they are); TypeError naming it otherwise."""
    if run_info is None:
        return {}
    if not isinstance(run_info, Mapping):
        raise TypeError(f"run_info: expected a dict of str to str, int, float or bool, got "
                        f"{type(run_info).__name__}")
    out = {}
    for key, value in run_info.items():
        if not isinstance(key, str):
            raise TypeError(f"run_info: expected str keys, got {type(key).__name__} {key!r}")
        if isinstance(value, (bool, np.bool_)):
            value = bool(value)
        elif isinstance(value, numbers.Integral):
            value = int(value)
        elif isinstance(value, numbers.Real) and math.isfinite(value):
            value = float(value)
        elif not isinstance(value, str):
            raise TypeError(f"run_info: {key!r}: expected a str, int, finite float or bool, "
                            f"got {type(value).__name__}")
        out[key] = value
    return out


def data_digest(dataset: Any) -> int:
    """CRC-32 of a dataset's data, then its labels, bytes as stored (their rows'
    order included): what fit.data keeps of the run's data."""
    value = 0
    for a in (dataset.data, getattr(dataset, "labels", None)):
        if a is not None:
            value = crc32_bytes(np.ascontiguousarray(a).reshape(-1).view(np.uint8), value)
    return value


def _run_value(key: str, value: int) -> str:
    if key == "fit.accumulate" and value in (0, 1):
        return repr(_ACCUMULATE[value])
    if key == "fit.seed" and value < 0:
        return "None" if value == -1 else "a numpy Generator"
    return str(value)
