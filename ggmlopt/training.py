"""epoch and fit: ggml's ggml_opt_epoch and ggml_opt_fit, and the History fit returns."""
from __future__ import annotations

import functools
import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from ._args import enum_arg
from ._blas_threads import blas_threads_for_training, blas_threads_setting, current_blas_threads
from ._fit_plan import FitPlan
from .checkpoint import FitCheckpoint, fit_seed_id, parameter_names
from .context import OptContext, checks_before_taking, first_nonfinite
from .dataset import Dataset
from .nn.module import set_training
from .optim_params import (
    BuildType,
    LossType,
    OptimizerParams,
    OptimizerType,
    default_optimizer_params,
)
from .progress import format_hms, progress_bar, time_us
from .result import Result

__all__ = ["EpochCallback", "EpochStats", "EvalStats", "History", "epoch", "fit"]

#: callback(train, ctx, dataset, result, ibatch, ibatch_max, t_start_us), as progress_bar
EpochCallback = Callable[[bool, OptContext, Dataset, "Result | None", int, int, int], None]


def _check_dataset(ctx: OptContext, dataset: Dataset, trains: bool = True) -> int:
    data = getattr(dataset, "data", None)
    if not isinstance(data, np.ndarray) or not callable(getattr(dataset, "get_batch", None)):
        raise TypeError(f"dataset: expected a ggmlopt.Dataset, got {type(dataset).__name__}")
    if data.ndim != 2 or data.shape[1] != ctx.ne_datapoint:
        raise ValueError(f"dataset: datapoints of {data.shape[1:]} elements do not match the "
                         f"context's ne_datapoint={ctx.ne_datapoint}")
    labels = dataset.labels
    if ctx.labels is None:
        if labels is not None:
            raise ValueError(f"dataset: it has labels but {ctx.loss_type.name} takes none; use "
                             "a dataset with ne_label=0")
    elif labels is None:
        raise ValueError(f"dataset: {ctx.loss_type.name} needs labels but the dataset has none")
    else:
        _check_label_form(ctx, dataset, labels)
        if trains and labels.dtype == np.int32 and labels.size and labels.max() < 0:
            raise ValueError(f"dataset: every one of its {labels.size} labels is -1 (masked): "
                             "training on it would change nothing (a loss of 0 every step); "
                             "label the positions to learn (Dataset.from_tokens, or labels "
                             ">= 0 where the loss counts)")
    return data.shape[0]


def _label_form(dataset):
    """'classes' (int32 class indices, ne_label 1), 'sequence' (int32, one class
    per position: ne_label > 1), 'float', another dtype's name, or None without
    labels."""
    labels = getattr(dataset, "labels", None)
    if labels is None:
        return None
    if getattr(dataset, "class_labels", False):
        return "classes"
    if labels.dtype == np.int32:
        return "sequence"
    return "float" if labels.dtype == np.float32 else labels.dtype.name


_WHAT_TO_PASS = ("pass class indices (integers of shape (ndata,)) or float one-hot labels "
                 "(ndata, {n}) to Dataset.from_arrays")


def _check_label_form(ctx, dataset, labels):
    """The dataset's labels fit the context's labels buffer: class indices for a
    class_labels context, float32 of the model's outputs otherwise."""
    ne_out = ctx.ne_out
    form = _label_form(dataset)
    if form == "sequence" and (ctx.out_shape is None or len(ctx.out_shape) < 2):
        form = labels.dtype.name  # rows of int32 for a model with one row of outputs
    classes_ctx = ctx.labels.dtype == np.int32
    if form == "sequence" and classes_ctx:
        if ctx.labels.shape[1:] != labels.shape[1:]:
            raise ValueError(f"dataset: sequence labels of {labels.shape[1]} positions per "
                             f"datapoint do not match the model's outputs {ctx.out_shape} "
                             f"(one class per position of shape {ctx.labels.shape[1:]})")
        if labels.size and (labels.min() < -1 or labels.max() >= ne_out):
            raise ValueError(f"dataset: class indices from {labels.min()} to {labels.max()} "
                             f"do not fit the model's {ne_out} outputs per position (expected "
                             f"0 .. {ne_out - 1}, or -1 to mask a position)")
    elif form == "sequence":
        raise ValueError(f"dataset: its labels are int32 class indices per position, which "
                         f"only CROSS_ENTROPY takes, on a model with outputs (batch, positions, "
                         f"classes); this context has {ctx.loss_type.name} and outputs "
                         f"{ctx.out_shape}")
    elif form == "classes" and classes_ctx:
        if labels.size and (labels.min() < 0 or labels.max() >= ne_out):
            raise ValueError(f"dataset: class indices from {labels.min()} to {labels.max()} "
                             f"do not fit the model's {ne_out} outputs (expected 0 .. "
                             f"{ne_out - 1})")
    elif form == "classes":
        if ctx.loss_type == LossType.CROSS_ENTROPY:
            raise ValueError("dataset: its labels are class indices but the context was built "
                             "for one-hot labels; build it with class_labels=True")
        raise ValueError(f"dataset: its labels are class indices, which only CROSS_ENTROPY "
                         f"takes; {ctx.loss_type.name} needs float targets of the model's "
                         f"{ne_out} outputs: one-hot encode the classes (float32 (ndata, "
                         f"{ne_out})) for Dataset.from_arrays")
    elif form != "float":
        raise ValueError(f"dataset: labels of {form} ({labels.shape[1]} per datapoint) cannot "
                         f"be trained on; " + _WHAT_TO_PASS.format(n=ne_out))
    elif classes_ctx:
        raise ValueError("dataset: its labels are float (one-hot) but the context was built "
                         "for class indices (class_labels=True)")
    elif labels.shape[1] != ne_out:
        hint = ("; for class indices pass integers of shape (ndata,)"
                if ctx.loss_type == LossType.CROSS_ENTROPY and labels.shape[1] == 1 else "")
        raise ValueError(f"dataset: labels of {labels.shape[1]} elements do not match the "
                         f"model's {ne_out} outputs{hint}")


def _eval_batch(ctx: OptContext, dataset: Dataset, result: Result | None, ibatch: int,
                backward: bool, phase: str, nbatches: int) -> None:
    last = ctx.build_type_last
    inputs = ctx.inputs
    assert inputs is not None  # epoch checked the context is static
    ctx.alloc(backward)
    try:
        dataset.get_batch(inputs, ctx.labels, ibatch)
        ctx.eval(result)
    except BaseException as e:
        # the alloc was ours: undo it, so the context is not left waiting for an eval
        ctx._undo_alloc(last)
        if isinstance(e, FloatingPointError):
            where = _nonfinite_datapoint(ctx, dataset, ibatch)
            raise FloatingPointError(f"{e} [{phase} batch {ibatch} of the dataset "
                                     f"({nbatches} batches){where}]") from None
        raise


def _nonfinite_datapoint(ctx, dataset, ibatch) -> str:
    """Which datapoint of the dataset holds the batch's first NaN or inf (inputs,
    then labels), for the error message; "" when the batch holds none."""
    for what, batch in (("data", ctx.inputs), ("labels", ctx.labels)):
        found = first_nonfinite(batch)
        if found is None:
            continue
        row, value = found
        shard = dataset.ndata_shard
        slot = ibatch * (batch.shape[0] // shard) + row // shard  # get_batch's shard order
        index = int(dataset.permutation[slot]) * shard + row % shard
        return f": its datapoint {index} holds {value} in its {what}"
    return ""


def _epoch_plan(ctx, dataset, result_train, result_eval, idata_split):
    """epoch's argument checks: (physical batches, the first validation batch)."""
    if not isinstance(ctx, OptContext):
        raise TypeError(f"ctx: expected an OptContext, got {type(ctx).__name__}")
    if not ctx.static_graphs:
        raise RuntimeError("epoch: needs a static context (OptContext with batch_size), as "
                           "ggml_opt_epoch needs static graphs")
    for name, r in (("result_train", result_train), ("result_eval", result_eval)):
        if r is not None and not isinstance(r, Result):
            raise TypeError(f"{name}: expected a ggmlopt.Result or None, got {type(r).__name__}")
    trains = ctx.build_type != BuildType.FORWARD and idata_split != 0
    ndata = _check_dataset(ctx, dataset, trains)
    batch = ctx.batch_size
    assert batch is not None  # static, checked above
    if ndata % batch != 0:
        raise ValueError(f"dataset: ndata={ndata} is not a multiple of the batch size {batch}")
    nbatches = ndata // batch
    if isinstance(idata_split, bool) or not isinstance(idata_split, numbers.Integral):
        raise TypeError(f"idata_split: expected an int, got {type(idata_split).__name__}")
    idata_split = ndata if idata_split < 0 else int(idata_split)
    if idata_split % batch != 0 or idata_split > ndata:
        raise ValueError(f"idata_split: expected a multiple of the batch size {batch} "
                         f"at most ndata={ndata}, got {idata_split}")
    return nbatches, idata_split // batch


def epoch(ctx: OptContext, dataset: Dataset, result_train: Result | None = None,
          result_eval: Result | None = None, idata_split: int = -1,
          callback_train: EpochCallback | None = None,
          callback_eval: EpochCallback | None = None) -> None:
    """One pass over the dataset, as ggml_opt_epoch: the batches before idata_split
    train (alloc(True)), the rest are evaluated (alloc(False)), in the dataset's
    permuted order.  idata_split < 0 (the default): every datapoint trains and
    result_eval stays empty ("no batches"); otherwise a multiple of the batch
    size, at most ndata.  callback(train, ctx, dataset, result,
    ibatch (1-based), ibatch_max, t_start_us) runs after every batch.
    Needs a static context (batch_size given).

    A context with comm runs its ranks' parts of the epoch (ggmlopt.distributed):
    the callbacks then run after every optimizer step and once after the
    validation, with statistics summed over the ranks, and both Results end
    holding the numbers of the whole dataset."""
    dist = getattr(ctx, "_dist", None)
    if dist is not None:  # many processes: each rank its part of the batches
        ctx._blas_threads = current_blas_threads()  # as set_rank_threads left them
        return dist.epoch(_epoch_plan, _eval_batch, ctx, dataset, result_train, result_eval,
                          idata_split, callback_train, callback_eval)
    nbatches, ibatch_split = _epoch_plan(ctx, dataset, result_train, result_eval, idata_split)

    with blas_threads_for_training(ctx.model) as ctx._blas_threads:
        _epoch_batches(ctx, dataset, result_train, result_eval, callback_train, callback_eval,
                       ibatch_split, nbatches)


def _epoch_batches(ctx, dataset, result_train, result_eval, callback_train, callback_eval,
                   ibatch_split, nbatches):
    ibatch = 0
    t_loop_start = time_us()
    while ibatch < ibatch_split:
        _eval_batch(ctx, dataset, result_train, ibatch, True, "train", nbatches)
        if callback_train is not None:
            callback_train(True, ctx, dataset, result_train, ibatch + 1, ibatch_split,
                           t_loop_start)
        ibatch += 1
    t_loop_start = time_us()
    while ibatch < nbatches:
        _eval_batch(ctx, dataset, result_eval, ibatch, False, "validation", nbatches)
        if callback_eval is not None:
            callback_eval(False, ctx, dataset, result_eval, ibatch + 1 - ibatch_split,
                          nbatches - ibatch_split, t_loop_start)
        ibatch += 1


@dataclass
class EpochStats:
    """One epoch of fit: training and validation loss and accuracy with their
    uncertainties (NaN where undefined, and every validation field NaN without a
    validation split), the epoch's wall time, the BLAS threads its matrix
    products ran on (GGMLOPT_BLAS_THREADS, see show_config(); None when NumPy's
    BLAS is unknown to threadpoolctl), and with comm= the seconds this rank spent
    on gradient exchange that the backward pass did not hide (summed over the
    epoch's optimizer steps, see ggmlopt.distributed; 0.0 in one process, NaN in
    a row read from a checkpoint written before the field existed)."""

    epoch: int
    train_loss: float
    train_loss_unc: float
    train_accuracy: float
    train_accuracy_unc: float
    val_loss: float
    val_loss_unc: float
    val_accuracy: float
    val_accuracy_unc: float
    seconds: float
    blas_threads: int | None = None
    exchange_wait_s: float = 0.0

    @classmethod
    def from_row(cls, row: Sequence[float]) -> EpochStats:
        """The EpochStats of a checkpoint's history row (astuple's order, None
        stored as NaN; rows without blas_threads or exchange_wait_s come from
        older checkpoints)."""
        threads = row[10] if len(row) > 10 else math.nan
        names = [f.name for f in fields(cls)][1:10]
        return cls(epoch=int(row[0]), **dict(zip(names, map(float, row[1:10]))),
                   blas_threads=None if math.isnan(threads) else int(threads),
                   exchange_wait_s=float(row[11]) if len(row) > 11 else math.nan)


@dataclass
class EvalStats:
    """One evaluation of fit(eval_every=N) on the held-out part: after optimizer
    step ``step`` (counted over the fit, from 1) of epoch ``epoch``, the
    validation loss and accuracy with their uncertainties (as EpochStats's, NaN
    where undefined), and ``train_loss``, the epoch's training loss so far (what
    the progress bar shows at that step)."""

    step: int
    epoch: int
    train_loss: float
    val_loss: float
    val_loss_unc: float
    val_accuracy: float
    val_accuracy_unc: float

    @classmethod
    def from_row(cls, row: Sequence[float]) -> EvalStats:
        """The EvalStats of a checkpoint's ``fit.evals`` row (astuple's order)."""
        return cls(int(row[0]), int(row[1]), *map(float, row[2:7]))


@dataclass
class History:
    """What fit returns: one EpochStats per epoch (``history[i]``, ``len(history)``)
    and the same numbers by column (``history.train_loss`` ...: read-only lists,
    one value per epoch).

    val_split: the fraction fit was asked for; ndata_train and ndata_val: the
    datapoints that trained and validated each epoch after rounding the split to
    whole logical batches (ndata_val = ndata - ndata_train, ndata_train =
    floor((1 - val_split) * nbatches_logical) * nbatch_logical, in float32 as
    ggml computes it).

    evaluations: with fit(eval_every=N), one EvalStats per evaluation on the
    held-out part, every N optimizer steps (empty otherwise).  An epoch cut
    short by max_steps is in ``epochs`` with the statistics of the steps it
    trained.
    """

    epochs: list[EpochStats] = field(default_factory=list)
    val_split: float = 0.0
    ndata_train: int = 0
    ndata_val: int = 0
    evaluations: list[EvalStats] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.epochs)

    def __getitem__(self, i: int) -> EpochStats:
        return self.epochs[i]

    def __iter__(self) -> Iterator[EpochStats]:
        return iter(self.epochs)

    def _column(self, name: str) -> list[float]:
        return [getattr(e, name) for e in self.epochs]

    @property
    def train_loss(self) -> list[float]:
        """The training loss of every epoch (EpochStats.train_loss)."""
        return self._column("train_loss")

    @property
    def train_loss_unc(self) -> list[float]:
        """The training loss's uncertainty of every epoch."""
        return self._column("train_loss_unc")

    @property
    def train_accuracy(self) -> list[float]:
        """The training accuracy of every epoch (NaN unless cross-entropy)."""
        return self._column("train_accuracy")

    @property
    def train_accuracy_unc(self) -> list[float]:
        """The training accuracy's uncertainty of every epoch."""
        return self._column("train_accuracy_unc")

    @property
    def val_loss(self) -> list[float]:
        """The validation loss of every epoch (NaN without a validation split)."""
        return self._column("val_loss")

    @property
    def val_loss_unc(self) -> list[float]:
        """The validation loss's uncertainty of every epoch."""
        return self._column("val_loss_unc")

    @property
    def val_accuracy(self) -> list[float]:
        """The validation accuracy of every epoch (NaN without a split or unless
        cross-entropy)."""
        return self._column("val_accuracy")

    @property
    def val_accuracy_unc(self) -> list[float]:
        """The validation accuracy's uncertainty of every epoch."""
        return self._column("val_accuracy_unc")

    @property
    def exchange_wait_s(self) -> list[float]:
        """The seconds of gradient exchange not hidden behind the backward pass in
        every epoch (this rank's; 0.0 without comm)."""
        return self._column("exchange_wait_s")

    @property
    def seconds(self) -> list[float]:
        """The wall time of every epoch, in seconds."""
        return self._column("seconds")

    @property
    def blas_threads(self) -> list[int | None]:
        """The BLAS threads of every epoch (see EpochStats.blas_threads)."""
        return self._column("blas_threads")  # type: ignore[return-value]

    def to_dict(self) -> dict[str, list]:
        """The epochs as columns, {field name: list}; see ggmlopt.plotting.history_to_dict."""
        from .plotting import history_to_dict

        return history_to_dict(self)

    def plot(self, path: str | os.PathLike | None = None, **kwargs: Any) -> Any:
        """Loss and accuracy curves with uncertainty bands, written to path when given;
        returns the matplotlib Figure.  See ggmlopt.plotting.plot_history."""
        from .plotting import plot_history

        return plot_history(self, path, **kwargs)


def _stops_every_rank(fit_function):
    """With comm=..., a failure on one rank makes every rank raise instead of
    leaving the others waiting in a collective (ggmlopt.distributed)."""
    @functools.wraps(fit_function)
    def wrapper(*args, **kwargs):
        if kwargs.get("comm") is None:
            return fit_function(*args, **kwargs)
        from .distributed import Distributed
        with Distributed(kwargs["comm"], kwargs.get("shard_optimizer", False)).reporting("fit"):
            return fit_function(*args, **kwargs)
    return wrapper


@_stops_every_rank
def fit(model: Any, dataset: Dataset, loss_type: LossType | int | str,
        get_opt_pars: Callable[[Any], OptimizerParams] = default_optimizer_params,
        nepoch: int | None = 1, nbatch_logical: int = 1, nbatch_physical: int | None = None,
        val_split: float = 0.0, silent: bool = False,
        optimizer: OptimizerType | int | str = OptimizerType.ADAMW,
        seed: int | np.random.Generator | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
        resume: bool = False, clip_grad_norm: float | None = None, *, comm: Any = None,
        shard_optimizer: bool = False, dataset_is_part: bool = False,
        bucket_cap_mb: float | None = 25.0, max_steps: int | None = None,
        eval_every: int | None = None, checkpoint_every: int | None = None) -> History:
    """Train model on dataset, as ggml_opt_fit.

    nbatch_logical datapoints per optimizer step, in physical batches of
    nbatch_physical (default nbatch_logical); ndata must be a multiple of
    nbatch_logical and nbatch_logical of nbatch_physical.  The last val_split
    (0 <= val_split < 1) of the data validates, rounded to whole logical
    batches as ggml rounds it: floor((1 - val_split) * nbatches_logical) logical
    batches train (in float32) and the rest validate, so a split is never
    smaller than requested but may be up to one logical batch larger; fit warns
    (UserWarning) when the rounded split differs from val_split * ndata by more
    than half a logical batch, and raises ValueError before anything runs when
    no logical batch is left to train (History.ndata_train / ndata_val say what
    was used).  The dataset is
    shuffled once (when nbatch_logical < ndata) and its training part every epoch
    (when nbatch_logical < the training datapoints).  get_opt_pars(epoch) receives
    the 1-based epoch (a get_opt_pars whose ``unit`` is "step" gets the context).
    Unless silent, progress goes to stderr.  Returns a History.

    checkpoint: None or a file path: the training state is saved there (atomically,
    see ggmlopt.checkpoint) after every epoch (and every checkpoint_every steps).  resume: when the checkpoint file
    exists, continue from it up to nepoch epochs in all (the History then covers
    every epoch); training 4 epochs straight or 2, then resuming for 2 more, gives
    bit-for-bit the same parameters.  clip_grad_norm: None or a float > 0, the
    global gradient L2 norm each optimizer step is clipped to.

    The model's ``training`` flag follows each eval (see ggmlopt.nn.module); fit
    leaves it in eval mode (training False) on every exit, also when it raises or
    is interrupted (KeyboardInterrupt), so ``model(x)`` afterwards is inference
    (no dropout).
    Checked before the first epoch: the split, a ggmlopt.schedules schedule
    over every epoch (or step) of the fit (one that would fail later raises
    now), and the checkpoint's directory (it must exist).  An existing
    checkpoint file without resume=True is overwritten (UserWarning); resuming
    refuses a checkpoint made with another dataset (ndata, datapoint and label
    sizes, ndata_shard) or another seed.
    comm: None, or an mpi4py communicator: data-parallel training over its P
    ranks (see ggmlopt.distributed).  Each rank passes the same arguments and
    dataset; each logical batch is split over the ranks (nbatch_logical must be
    a multiple of P * nbatch_physical), the gradients are summed once per
    optimizer step, and every rank ends with the same parameters, equal to the
    single-process run's up to float rounding.  The History holds the numbers of
    the whole dataset on every rank; only rank 0 prints and writes the
    checkpoint.  shard_optimizer: with comm, each rank keeps only its shard of
    the AdamW moments.  dataset_is_part: with comm, each rank passes only its own
    part of the data (the same number of datapoints on every rank, 1/P of the
    memory): every logical batch takes nbatch_logical/P datapoints from each part,
    each rank shuffles its part (the same permutation of its shard indices on
    every rank) and validates on the last val_split of it; the numbers are those
    of the whole data, and a checkpoint resumes on the same number of ranks.
    bucket_cap_mb: with comm, MiB of gradients per bucket exchanged during the
    backward pass (float > 0, default 25 as PyTorch DDP), or None for one
    exchange after it (see OptContext).

    Steps (keyword-only, beyond ggml; steps are optimizer steps, counted over the
    whole fit from 1; every one is checked before training, see
    ggmlopt._fit_plan.FitPlan):
    max_steps: None or an int >= 1: stop after this many optimizer steps, in the
    middle of an epoch if need be (that epoch then validates and is recorded
    with the steps it trained).  nepoch=None with max_steps: as many epochs as
    max_steps needs; max_steps beyond nepoch's steps raises ValueError.
    eval_every: None or an int >= 1: evaluate on the held-out part (val_split > 0)
    after every eval_every optimizer steps, recorded in History.evaluations
    (EvalStats); an evaluation that falls on an epoch's end is that epoch's
    validation.  Evaluating changes nothing in the training: the parameters are
    those of the same fit without eval_every.
    checkpoint_every: None or an int >= 1 (needs checkpoint): also save the
    checkpoint after every checkpoint_every optimizer steps inside an epoch (and
    when max_steps stops inside one).  Resuming from such a checkpoint continues
    the epoch at its next step, with its shuffle, the generator, the optimizer,
    the epoch's training statistics and the History as they were: the result is
    bit for bit the uninterrupted fit's.
    A step schedule (ggmlopt.schedules with unit="step") follows ctx.iter, so
    it continues across epochs and resumes exactly.
    """
    if not isinstance(resume, bool):
        raise TypeError(f"resume: expected a bool, got {type(resume).__name__}")
    blas_threads_setting()  # a bad GGMLOPT_BLAS_THREADS stops fit before it starts
    if resume and checkpoint is None:
        raise ValueError("resume: needs checkpoint=path to resume from")
    t_start_us = time_us()
    loss_type = enum_arg(loss_type, LossType, "loss_type")
    optimizer = enum_arg(optimizer, OptimizerType, "optimizer")
    from ._fit_loop import FitLoop  # it runs epoch(): imported here, not at the top

    plan = FitPlan.from_args(dataset, nepoch, nbatch_logical, nbatch_physical, val_split, comm,
                             dataset_is_part, max_steps, eval_every, checkpoint_every,
                             checkpoint)
    if comm is not None:
        silent = silent or comm.Get_rank() != 0  # rank 0 alone prints
    plan.check_schedule(get_opt_pars, optimizer)
    data = dataset.data
    ckpt = None
    if checkpoint is not None:
        labels = getattr(dataset, "labels", None)
        ckpt = FitCheckpoint(checkpoint, plan.ndata, plan.nbatch_logical, plan.nbatch_physical,
                             plan.idata_split, {
                                 "fit.ne_datapoint": data.shape[1],
                                 "fit.ne_label": 0 if labels is None else int(labels.shape[1]),
                                 "fit.ndata_shard": int(getattr(dataset, "ndata_shard", 1)),
                                 "fit.seed": fit_seed_id(seed)})
        if not resume and ckpt.exists():
            warnings.warn(f"checkpoint: {ckpt.path!r} exists and will be overwritten after the "
                          "first epoch (resume=False); pass resume=True to continue from it",
                          UserWarning, stacklevel=2)

    pending, resumed_from = None, ""
    if resume and ckpt is not None and ckpt.exists():
        resumed_from = ckpt.path
        pending = _read_checkpoint(ckpt, model, dataset, plan, seed, loss_type, optimizer)

    # class-index labels take the class-index loss path (int32 label batches): one
    # per datapoint, or one per position (sequence labels, int32 (ndata, n_ctx))
    class_labels = (loss_type == LossType.CROSS_ENTROPY
                    and (bool(getattr(dataset, "class_labels", False))
                         or _label_form(dataset) == "sequence"))
    # int32 data are token ids: the model takes int32 batches
    inputs_dtype = np.int32 if data.dtype == np.int32 else np.float32
    try:
        with checks_before_taking(lambda c: _check_dataset(c, dataset)):
            ctx = OptContext(model, batch_size=plan.nbatch_physical, ne_datapoint=data.shape[1],
                             loss_type=loss_type, build_type=BuildType.OPT,
                             opt_period=plan.opt_period, optimizer=optimizer,
                             get_opt_pars=get_opt_pars, get_opt_pars_ud=1, seed=seed,
                             clip_grad_norm=clip_grad_norm, comm=comm,
                             shard_optimizer=shard_optimizer, class_labels=class_labels,
                             inputs_dtype=inputs_dtype, bucket_cap_mb=bucket_cap_mb)
        if comm is not None:
            ctx._dist.parts = dataset_is_part

        history = History(val_split=float(val_split), ndata_train=plan.idata_split,
                          ndata_val=plan.ndata - plan.idata_split)
        loop = FitLoop(plan, ctx, dataset, history, ckpt, None if silent else progress_bar)
        if pending is not None:
            ctx.load_state_dict(pending.ctx_sd)
            dataset._set_permutation(pending.permutation)
            history.epochs = [EpochStats.from_row(r) for r in pending.history_rows]
            history.evaluations = [EvalStats.from_row(r) for r in pending.eval_rows]
            done, step = pending.epochs_done, pending.step
            if not silent:
                where = f" and step {step} of epoch {done + 1}" if step else ""
                sys.stderr.write(f"fit: resuming from {resumed_from} after epoch {done:04d}/"
                                 f"{plan.nepoch:04d}{where}\n")
            loop.run(done + 1, step, pending.train_totals)
        else:
            if plan.shuffle_all:
                # shuffling only helps when one batch does not hold all the data
                dataset.shuffle(ctx.rng, -1)  # all data, training and validation
            loop.run()
    finally:
        # every exit, also an exception or Ctrl-C in the middle of an epoch, leaves
        # the model in eval mode, so model(x) afterwards is inference (no dropout)
        set_training(model, False)
    if not silent:
        sys.stderr.write(f"fit: training took {format_hms(time_us() - t_start_us)}\n")
        sys.stderr.flush()
    return history


def _read_checkpoint(ckpt, model, dataset, plan, seed, loss_type, optimizer):
    """fit's checkpoint, checked whole against the model and this fit before the
    context takes the model (a FitProgress)."""
    params = OptContext._collect_parameters(model)
    trainable = [bool(getattr(p, "requires_grad", True)) for p in params]
    shapes = [p.data.shape for p, t in zip(params, trainable) if t]
    bit_generator = (type(seed.bit_generator) if isinstance(seed, np.random.Generator)
                     else type(np.random.default_rng(0).bit_generator))
    progress = ckpt.read(dataset, plan.nepoch, (loss_type, optimizer, BuildType.OPT,
                                                plan.opt_period, shapes, bit_generator,
                                                trainable, parameter_names(model, params)),
                         plan.steps_per_epoch)
    trained = progress.epochs_done * plan.steps_per_epoch + progress.step
    if trained > plan.total_steps:
        raise ValueError(f"max_steps: the checkpoint {ckpt.path!r} has already trained "
                         f"{trained} optimizer steps, more than max_steps={plan.total_steps}")
    return progress
