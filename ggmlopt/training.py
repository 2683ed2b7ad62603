"""fit: ggml's ggml_opt_fit, over epoch (ggmlopt.epoch_loop), with checkpoints,
schedules by step and many processes; it returns a History (ggmlopt.history)."""
from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._args import enum_arg
from ._blas_threads import blas_threads_setting
from ._fit_loop import FitLoop
from ._fit_plan import FitPlan
from .checkpoint import (
    FitCheckpoint,
    data_digest,
    fit_seed_id,
    model_info,
    parameter_names,
    run_info_arg,
)
from .context import OptContext, checks_before_taking
from .dataset import Dataset
from .epoch_loop import EpochCallback, check_dataset, epoch, label_form
from .gemm import check_precision
from .history import EpochStats, EvalStats, History
from .nn.module import set_training
from .optim_params import (
    BuildType,
    FitEpoch,
    LossType,
    OptimizerParams,
    OptimizerType,
    default_optimizer_params,
)
from .optimizers import Optimizer, optimizer_arg
from .progress import format_hms, progress_bar, time_us
from .schedules import Schedule

__all__ = ["EpochCallback", "EpochStats", "EvalStats", "History", "epoch", "fit"]


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
        optimizer: OptimizerType | int | str | Optimizer = OptimizerType.ADAMW,
        seed: int | np.random.Generator | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
        resume: bool = False, clip_grad_norm: float | None = None, *, comm: Any = None,
        shard_optimizer: bool = False, dataset_is_part: bool = False,
        bucket_cap_mb: float | None = 25.0, max_steps: int | None = None,
        eval_every: int | None = None, checkpoint_every: int | None = None,
        precision: str = "f32", drop_last: bool = False,
        optimizer_in_backward: bool = False, shuffle: bool | str = True,
        run_info: Mapping[str, Any] | None = None, accumulate: str = "batches") -> History:
    """Train model on dataset, as ggml_opt_fit.

    nbatch_logical datapoints per optimizer step, in physical batches of
    nbatch_physical (default nbatch_logical); ndata must be a multiple of
    nbatch_logical (ggml's rule) unless drop_last is True, and nbatch_logical
    of nbatch_physical.  drop_last=True (torch's DataLoader name): the last
    ndata % nbatch_logical datapoints of the shuffled order sit each epoch out
    (without a validation part each epoch's shuffle covers every datapoint, so
    each epoch leaves out others; with one, the same ones stay out); the
    History's ndata_train + ndata_val say how many were used.  The last val_split
    (0 <= val_split < 1) of the data validates, rounded to whole logical
    batches as ggml rounds it: floor((1 - val_split) * nbatches_logical) logical
    batches train (in float32) and the rest validate, so a split is never
    smaller than requested but may be up to one logical batch larger; fit warns
    (UserWarning) when the rounded split differs from val_split * ndata by more
    than half a logical batch, and raises ValueError before anything runs when
    no logical batch is left to train (History.ndata_train / ndata_val say what
    was used).  The dataset is
    shuffled once (when nbatch_logical < ndata) and its training part every epoch
    (when nbatch_logical < the training datapoints), in place, as ggml_opt_fit
    shuffles its dataset: a second fit over the same Dataset starts from the
    order the first left (the same seed gives another run; build the Dataset
    again, or save a checkpoint, to repeat one).  get_opt_pars(epoch) receives
    the 1-based epoch (a get_opt_pars whose ``unit`` is "step" gets the context).
    Unless silent, progress goes to stderr.  Returns a History.

    checkpoint: None or a file path: the training state is saved there (atomically,
    see ggmlopt.checkpoint) after every epoch (and every checkpoint_every steps).  resume: when the checkpoint file
    exists, continue from it up to nepoch epochs in all (the History then covers
    every epoch); training 4 epochs straight or 2, then resuming for 2 more, gives
    bit-for-bit the same parameters.  clip_grad_norm: None or a float > 0, the
    global gradient L2 norm each optimizer step is clipped to.
    shuffle (keyword-only, beyond ggml): False trains and validates in the
    dataset's order, never shuffled (llama-finetune's epochs over a text's
    windows: the last windows validate); True is ggml_opt_fit's shuffling (the
    whole dataset once, so the validation part is a random one, then the
    training part each epoch); "train" shuffles the training part each epoch
    and leaves the validation part the dataset's last datapoints (a validation
    set of its own, appended).
    run_info (keyword-only): None or a dict of str to str, int, float or bool
    naming what else makes this run what it is (a data file's digest, the LoRA
    options...): written into the checkpoint, and a resume whose run_info gives
    a key another value is refused (ValueError naming the key and both values);
    keys only one side has are not compared.  With comm, give every rank the
    same run_info (rank 0 writes its own, and every rank compares with it).
    The checkpoint also records each LoRA adapter's rank, alpha and dropout and
    the type each frozen layer is kept in (checkpoint.model_info), and a digest
    of the frozen weights (checkpoint.frozen_digest: another base file): a
    resume into a model that differs there is refused too.

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
    precision: "f32" (default) or "bf16": the layers' matrix products in bf16
    with float32 sums, weights, gradients and optimizer state, where the CPU
    multiplies bf16 natively (see OptContext; elsewhere a warning and float32),
    the validation batches' losses included; convolutions stay float32.
    optimizer_in_backward: True steps each parameter in the backward pass as soon
    as its gradient is final, with gradients lent from a small pool (a full
    fine-tune holds about one block's gradients instead of every parameter's):
    the same numbers, bit for bit; needs nbatch_physical == nbatch_logical, no
    clip_grad_norm and no comm (see OptContext, ggmlopt.step_in_backward).
    accumulate (keyword-only, beyond ggml): "batches" (default) is ggml's
    gradient accumulation: with several physical batches a step each one's mean
    loss is scaled by 1/opt_period, so every micro-batch weighs the same.
    "tokens" is Hugging Face Trainer's rule (num_items_in_batch, transformers
    4.46): for CROSS_ENTROPY on int32 class labels (-1 masking a position), each
    micro-batch's mean loss and gradient are scaled by its labelled positions
    over those of the whole logical batch, so the step's gradient, and the loss
    fit reports for it, is the mean over every labelled position of the step
    (validation losses are unchanged).  With one physical batch a step both are
    the same, bit for bit.  Refused (ValueError) with another loss, float labels
    or comm; a checkpoint resumes only in the mode it was written in.
    """
    if not isinstance(resume, bool):
        raise TypeError(f"resume: expected a bool, got {type(resume).__name__}")
    blas_threads_setting()  # a bad GGMLOPT_BLAS_THREADS stops fit before it starts
    if resume and checkpoint is None:
        raise ValueError("resume: needs checkpoint=path to resume from")
    run_info = run_info_arg(run_info)
    t_start_us = time_us()
    loss_type = enum_arg(loss_type, LossType, "loss_type")
    optimizer = optimizer_arg(optimizer)
    precision = check_precision(precision)
    _check_accumulate(accumulate, loss_type, dataset, comm)

    plan = FitPlan.from_args(dataset, nepoch, nbatch_logical, nbatch_physical, val_split, comm,
                             dataset_is_part, max_steps, eval_every, checkpoint_every,
                             checkpoint, drop_last, shuffle)
    if comm is not None:
        silent = silent or comm.Get_rank() != 0  # rank 0 alone prints
        if dataset_is_part is True:
            _agree_on_parts(comm, dataset)
    plan.check_schedule(get_opt_pars, optimizer)
    _check_memory(model, dataset, plan, optimizer, silent, optimizer_in_backward, precision,
                  comm, shard_optimizer)
    data = dataset.data
    ckpt = None
    if checkpoint is not None:
        labels = getattr(dataset, "labels", None)
        ckpt = FitCheckpoint(checkpoint, plan.ndata, plan.nbatch_logical, plan.nbatch_physical,
                             plan.idata_split, {
                                 "fit.ne_datapoint": data.shape[1],
                                 "fit.ne_label": 0 if labels is None else int(labels.shape[1]),
                                 "fit.ndata_shard": int(getattr(dataset, "ndata_shard", 1)),
                                 "fit.seed": fit_seed_id(seed),
                                 # whether this fit shuffles at all (a checkpoint
                                 # without the entry was written by one that did
                                 # whenever nbatch_logical < ndata)
                                 "fit.shuffle": 2 if plan.shuffle == "train"
                                 else int(plan.shuffle_all),
                                 "fit.accumulate": int(accumulate == "tokens"),
                                 # (a rank's part differs from rank 0's, which writes)
                                 **({} if dataset_is_part is True and comm is not None
                                    else {"fit.data": data_digest(dataset)})}, run_info,
                             model_info(model),
                             _schedule_record(get_opt_pars))
        if not resume and ckpt.exists():
            warnings.warn(f"checkpoint: {ckpt.path!r} exists and will be overwritten after the "
                          "first epoch (resume=False); pass resume=True to continue from it",
                          UserWarning, stacklevel=2)

    pending, resumed_from = None, ""
    if resume and ckpt is not None and ckpt.exists():
        resumed_from = ckpt.path
        pending = _read_checkpoint(ckpt, model, dataset, plan, seed, loss_type, optimizer,
                                   precision)

    # class-index labels take the class-index loss path (int32 label batches): one
    # per datapoint, or one per position (sequence labels, int32 (ndata, n_ctx))
    class_labels = (loss_type == LossType.CROSS_ENTROPY
                    and (bool(getattr(dataset, "class_labels", False))
                         or label_form(dataset) == "sequence"))
    # int32 data are token ids: the model takes int32 batches
    inputs_dtype = np.int32 if data.dtype == np.int32 else np.float32
    try:
        with checks_before_taking(lambda c: check_dataset(c, dataset)):
            ctx = OptContext(model, batch_size=plan.nbatch_physical, ne_datapoint=data.shape[1],
                             loss_type=loss_type, build_type=BuildType.OPT,
                             opt_period=plan.opt_period, optimizer=optimizer,
                             get_opt_pars=get_opt_pars, get_opt_pars_ud=FitEpoch(1), seed=seed,
                             clip_grad_norm=clip_grad_norm, comm=comm,
                             shard_optimizer=shard_optimizer, class_labels=class_labels,
                             inputs_dtype=inputs_dtype, bucket_cap_mb=bucket_cap_mb,
                             precision=precision,
                             optimizer_in_backward=optimizer_in_backward)
        ctx._accumulate = accumulate
        if comm is not None:
            ctx.distributed.parts = dataset_is_part
            # every rank runs the same steps from the same point: a rank that stopped
            # sooner, or resumed from elsewhere, would leave the others in a collective
            resumed = None if pending is None else (pending.epochs_done, pending.step)
            ctx.distributed.agree(
                None, "fit", f"nepoch={plan.nepoch} steps={plan.total_steps} "
                f"per_epoch={plan.steps_per_epoch} eval_every={plan.eval_every} "
                f"checkpoint_every={plan.checkpoint_every} resume={resumed}",
                hint="every rank must call fit with the same nepoch, max_steps, eval_every, "
                     "checkpoint_every and batches, and resume from the same checkpoint")

        # the whole data's counts: with dataset_is_part the plan is one rank's part,
        # and every rank's part takes as many datapoints
        parts = comm.Get_size() if dataset_is_part is True and comm is not None else 1
        history = History(val_split=float(val_split), ndata_train=plan.idata_split * parts,
                          ndata_val=(plan.ndata_used - plan.idata_split) * parts)
        loop = FitLoop(plan, ctx, dataset, history, ckpt, None if silent else progress_bar)
        order = dataset.permutation.copy()
        if pending is not None:
            ctx.load_state_dict(pending.ctx_sd)
            moved = _opt_pars_moved(get_opt_pars, ctx, pending)
            if moved:
                warnings.warn(f"resume: {resumed_from!r}: {moved}", UserWarning, stacklevel=2)
            dataset._set_permutation(pending.permutation)
            history.epochs = [EpochStats.from_row(r) for r in pending.history_rows]
            history.evaluations = [EvalStats.from_row(r) for r in pending.eval_rows]
            done, step = pending.epochs_done, pending.step
            if not silent:
                where = f" and step {step} of epoch {done + 1}" if step else ""
                sys.stderr.write(f"fit: resuming from {resumed_from} after epoch {done:04d}/"
                                 f"{plan.nepoch:04d}{where}\n")
            _run_restoring_order(loop, ctx, dataset, order, done + 1, step,
                                 pending.train_totals)
        else:
            if plan.shuffle_all:
                # shuffling only helps when one batch does not hold all the data
                dataset.shuffle(ctx.rng, -1)  # all data, training and validation
            _run_restoring_order(loop, ctx, dataset, order)
    finally:
        # every exit, also an exception or Ctrl-C in the middle of an epoch, leaves
        # the model in eval mode, so model(x) afterwards is inference (no dropout)
        set_training(model, False)
    if not silent:
        sys.stderr.write(f"fit: training took {format_hms(time_us() - t_start_us)}\n")
        sys.stderr.flush()
    return history


def _run_restoring_order(loop, ctx, dataset, order, *start) -> None:
    """loop.run(*start); a refusal before its first optimizer step (a value
    get_opt_pars returns, found at that step) leaves the dataset in the order
    fit found it: the model has not changed either."""
    iter_before = ctx.iter
    try:
        loop.run(*start)
    except BaseException:
        if ctx.iter == iter_before:
            dataset._set_permutation(order)
        raise


def _agree_on_parts(comm, dataset):
    """dataset_is_part=True: every rank's part holds as many datapoints, of the
    same shapes (parts of other window lengths trained on, each rank gathering
    predictions of another size), said before anything else is compared."""
    from .distributed import Distributed
    labels = getattr(dataset, "labels", None)
    shape = f"{dataset.ndata} datapoints of {tuple(dataset.data.shape[1:])}, labels " \
        f"{None if labels is None else tuple(labels.shape[1:])}"
    Distributed(comm).agree(None, "fit", shape,
                            hint="with dataset_is_part=True every rank's part must hold as "
                                 "many datapoints (its own rows), each of the same shape")


def _check_accumulate(accumulate, loss_type, dataset, comm):
    """ValueError (TypeError for a non-str) unless fit can accumulate as asked:
    "tokens" weighs the labelled positions of int32 class labels in cross-entropy."""
    values = "expected 'batches' (ggml's: each micro-batch's mean loss weighs the same) or " \
             "'tokens' (Trainer's: each labelled position of the step weighs the same)"
    if not isinstance(accumulate, str):
        raise TypeError(f"accumulate: {values}, got {type(accumulate).__name__}")
    if accumulate not in ("batches", "tokens"):
        raise ValueError(f"accumulate: {values}, got {accumulate!r}")
    if accumulate == "batches":
        return
    if loss_type != LossType.CROSS_ENTROPY:
        raise ValueError(f"accumulate: 'tokens' weighs the labelled positions of "
                         f"cross-entropy's class labels; loss_type is {loss_type.name}: pass "
                         "accumulate='batches'")
    form = label_form(dataset)
    if form not in ("classes", "sequence"):
        raise ValueError(f"accumulate: 'tokens' counts labelled positions of int32 class "
                         f"labels (-1 masking one); this dataset's labels are "
                         f"{form or 'absent'}: pass accumulate='batches'")
    if comm is not None:
        # each rank sees only its share of a logical batch, not the step's count
        raise ValueError("accumulate: 'tokens' is not supported with comm (the ranks would "
                         "need the labelled positions of the whole logical batch); pass "
                         "accumulate='batches'")


def _check_memory(model, dataset, plan, optimizer, silent, in_backward=False,
                  precision="f32", comm=None, shard_optimizer=False):
    """For a language model: the memory estimate of its training (printed unless
    silent), and MemoryError naming the ways out, before anything is allocated,
    when the machine cannot hold it (with comm: this rank's estimate, and the
    machine holding every rank on it, see ggmlopt.distributed.rank_memory)."""
    from .memory_estimate import check_fits, memory_report
    from .models import CausalLM
    if not isinstance(model, CausalLM) or dataset.data.shape[1] > model.config.max_seq_len:
        return   # the context's own checks speak for a window the model cannot take
    labels = getattr(dataset, "labels", None)
    share = 1.0 if labels is None or labels.dtype != np.int32 else \
        float(np.count_nonzero(labels >= 0)) / max(1, labels.size)
    report = memory_report(model, plan.nbatch_physical, dataset.data.shape[1],
                           optimizer=optimizer, labelled=share,
                           optimizer_in_backward=bool(in_backward), precision=precision)
    ranks = 1
    if comm is not None:
        from .distributed import rank_memory
        report, ranks = rank_memory(report, comm, shard_optimizer)
    if not silent:
        per_rank = f" (per rank, {ranks} on this machine)" if comm is not None else ""
        sys.stderr.write(f"fit{per_rank}: {report}\n")
    check_fits(report, ranks)


def _schedule_record(get_opt_pars) -> str | None:
    """What a checkpoint records of the schedule: the repr of one of
    ggmlopt.schedules' own classes (its kind, length and warmup), None for any
    other get_opt_pars (a subclass's fields may print differently every run; a
    wrapper around a schedule is no other run: a function's values are checked
    instead)."""
    if isinstance(get_opt_pars, Schedule) and type(get_opt_pars).__module__ == Schedule.__module__:
        return repr(get_opt_pars)
    return None


def _opt_pars_moved(get_opt_pars, ctx, progress) -> str | None:
    """What this fit's get_opt_pars gives the checkpoint's last step that differs
    from the parameters that step ran with (a resume whose learning rate,
    weight decay, warmup or run length is not the run's that wrote it), else None.
    A function is called once more for it, with the last step's epoch as
    fit's userdata."""
    # the kind, length or warmup, where the last step's rate does not tell them (a
    # step early in a warmup runs at t / warmup whatever the length)
    record = _schedule_record(get_opt_pars)
    other = None if None in (progress.schedule, record) or progress.schedule == record else \
        (f"its schedule was {progress.schedule}, this fit's is {record}: the run goes "
         "on with other parameters than the one that wrote the checkpoint")
    in_force = ctx.opt_pars_in_force
    unit = getattr(get_opt_pars, "unit", "epoch")
    if in_force is None or (unit == "step" and not isinstance(get_opt_pars, Schedule)):
        return other   # (a function of the context: what it gives is the next step's)
    # the step that ran last, or its epoch (mid-epoch: the next one's)
    epoch = progress.epochs_done + (1 if progress.step else 0)
    if isinstance(get_opt_pars, Schedule):
        t, what = (ctx.iter - 1 if unit == "step" else epoch), "schedule"
    else:
        t, what, unit = FitEpoch(epoch), "get_opt_pars", "epoch"
    try:
        now = tuple(ctx.optimizer.hyperparameters(get_opt_pars(t)))
    except Exception:   # noqa: BLE001 (past a schedule's end, or a function's own error:
        return other    # each is said where the step calls it)
    names = ctx.optimizer.hyperparameter_names
    moved = [f"{ctx.optimizer.name}.{n} {float(a):.6g}, this fit's {what} gives "
             f"{float(b):.6g}" for n, a, b in zip(names, in_force, now)
             if np.float32(a) != np.float32(b)]
    if not moved:
        return other
    said = (f"its last {unit} ({unit} {int(t)}) ran with {'; '.join(moved)}: the run goes "
            "on with other parameters than the one that wrote the checkpoint (another "
            "learning rate, schedule, warmup or length?)")
    return said if other is None else f"{said}; {other}"


def _read_checkpoint(ckpt, model, dataset, plan, seed, loss_type, optimizer, precision):
    """fit's checkpoint, checked whole against the model and this fit before the
    context takes the model (a FitProgress)."""
    params = OptContext._collect_parameters(model)
    trainable = [bool(getattr(p, "requires_grad", True)) for p in params]
    shapes = [p.data.shape for p, t in zip(params, trainable) if t]
    bit_generator = (type(seed.bit_generator) if isinstance(seed, np.random.Generator)
                     else type(np.random.default_rng(0).bit_generator))
    progress = ckpt.read(dataset, plan.nepoch, (loss_type, optimizer, BuildType.OPT,
                                                plan.opt_period, shapes, bit_generator,
                                                trainable, parameter_names(model, params),
                                                precision),
                         plan.steps_per_epoch, model,
                         [p for p, t in zip(params, trainable) if not t])
    trained = progress.epochs_done * plan.steps_per_epoch + progress.step
    if trained > plan.total_steps:
        raise ValueError(f"max_steps: the checkpoint {ckpt.path!r} has already trained "
                         f"{trained} optimizer steps, more than max_steps={plan.total_steps}")
    return progress
