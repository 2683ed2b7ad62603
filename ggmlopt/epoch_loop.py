"""epoch: ggml's ggml_opt_epoch, one pass over a dataset's batches (the first ones
train, the rest are evaluated), and the checks of a dataset against a context that
fit shares."""
from __future__ import annotations

import numbers

import numpy as np

from ._blas_threads import blas_threads_for_training, current_blas_threads
from .batch_plan import BatchPlan, EpochCallback
from .context import OptContext, first_nonfinite
from .dataset import Dataset
from .optim_params import (
    BuildType,
    LossType,
)
from .progress import time_us
from .result import Result

__all__ = ["BatchPlan", "EpochCallback", "check_dataset", "epoch", "epoch_plan", "eval_batch",
           "label_form", "plan_batches", "run_batches"]


def check_dataset(ctx: OptContext, dataset: Dataset, trains: bool = True) -> int:
    data = getattr(dataset, "data", None)
    if not isinstance(data, np.ndarray) or not callable(getattr(dataset, "get_batch", None)):
        raise TypeError(f"dataset: expected a ggmlopt.Dataset, got {type(dataset).__name__}")
    if data.ndim != 2 or data.shape[1] != ctx.ne_datapoint:
        raise ValueError(f"dataset: datapoints of {data.shape[1:]} elements do not match the "
                         f"context's ne_datapoint={ctx.ne_datapoint}")
    # a token id no forward pass reads is found now, not at its batch after steps
    # have changed the model (a language model says which ids it reads)
    check_tokens = getattr(ctx.model, "check_token_ids", None)
    if data.dtype == np.int32 and callable(check_tokens):
        check_tokens(data, "dataset")
    labels = dataset.labels
    if ctx.labels is None:
        if labels is not None:
            raise ValueError(f"dataset: it has labels but {ctx.loss_type.name} takes none; use "
                             "a dataset with ne_label=0")
    elif labels is None:
        raise ValueError(f"dataset: {ctx.loss_type.name} needs labels but the dataset has none")
    else:
        _check_label_form(ctx, dataset, labels)
        # (over several ranks a rank's part of the data may be padding alone: the
        # rule is one process's, where the dataset is all the data)
        if trains and labels.dtype == np.int32 and labels.size and labels.max() < 0 \
                and ctx.distributed is None:
            raise ValueError(f"dataset: every one of its {labels.size} labels is -1 (masked): "
                             "training on it would change nothing (a loss of 0 every step); "
                             "label the positions to learn (Dataset.from_tokens, or labels "
                             ">= 0 where the loss counts)")
    return data.shape[0]


def label_form(dataset):
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
    form = label_form(dataset)
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


def eval_batch(ctx: OptContext, dataset: Dataset, result: Result | None, ibatch: int,
                backward: bool, phase: str, nbatches: int) -> None:
    last = ctx.build_type_last
    inputs = ctx.inputs
    assert inputs is not None  # epoch checked the context is static
    # (with one physical batch a step, the batch's own mean is the token mean)
    tokens = backward and ctx._accumulate == "tokens" and ctx.opt_period > 1
    if tokens and ctx.opt_i == 0:
        # token-weighted accumulation scales each micro-batch by the whole step's count
        ctx._begin_token_step(labelled_in_step(ctx, dataset, ibatch),
                              f"{type(dataset).__name__}.get_batch")
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


def labelled_in_step(ctx: OptContext, dataset: Dataset, ibatch: int) -> int:
    """The labelled positions (labels >= 0) of the logical batch whose first
    physical batch is ibatch: its opt_period batches in the dataset's permuted
    order, as get_batch gathers them."""
    shard = dataset.ndata_shard
    assert ctx.batch_size is not None  # static, as epoch checked
    per = ctx.batch_size // shard   # shards per physical batch
    shards = np.asarray(dataset.permutation)[ibatch * per:(ibatch + ctx.opt_period) * per]
    rows = (shards[:, None] * shard + np.arange(shard)).reshape(-1)
    labels = dataset.labels
    assert labels is not None  # fit checked accumulate="tokens" has class labels
    return int(np.count_nonzero(labels[rows] >= 0))


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


def epoch_plan(ctx, dataset, result_train, result_eval, idata_split, used=None):
    """epoch's argument checks: (physical batches, the first validation batch);
    used: the datapoints the epoch takes, default all (fit's drop_last leaves
    the rest of the dataset out)."""
    if not isinstance(ctx, OptContext):
        raise TypeError(f"ctx: expected an OptContext, got {type(ctx).__name__}")
    if not ctx.static_graphs:
        raise RuntimeError("epoch: needs a static context (OptContext with batch_size), as "
                           "ggml_opt_epoch needs static graphs")
    for name, r in (("result_train", result_train), ("result_eval", result_eval)):
        if r is not None and not isinstance(r, Result):
            raise TypeError(f"{name}: expected a ggmlopt.Result or None, got {type(r).__name__}")
    trains = ctx.build_type != BuildType.FORWARD and idata_split != 0
    ndata = check_dataset(ctx, dataset, trains)
    ndata = ndata if used is None else used
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


def run_batches(ctx: OptContext, dataset: Dataset, result: Result | None, plan: BatchPlan,
                callback: EpochCallback | None, t_start: int | None = None) -> None:
    """The loop over an epoch's batches that epoch, fit and the ranks share:
    plan's groups of batches into result, the callback after each group
    (t_start: the progress bar's start, default now)."""
    t_start = time_us() if t_start is None else t_start
    with plan.guard():
        result = plan.begin(result)
        for g, group in enumerate(plan.groups):
            for ibatch in group:
                eval_batch(ctx, dataset, result, ibatch, plan.train, plan.phase, plan.nbatches)
            shown = plan.after_group(result, ctx)
            if callback is not None and shown is not None:
                callback(plan.train, ctx, dataset, shown,
                         plan.shown_before + (g + 1) * plan.shown_per_group, plan.shown_max,
                         t_start)
    plan.finish(result, ctx, dataset, callback, t_start)


def plan_batches(ctx: OptContext, train: bool, first: int, stop: int, nbatches: int,
                 shown_before: int = 0, shown_max: int | None = None) -> BatchPlan:
    """The BatchPlan of the dataset's batches [first, stop) on this process: all
    of them, or over comm's ranks this rank's share (see BatchPlan)."""
    dist = ctx.distributed
    if dist is None:
        return BatchPlan(train, first, stop, nbatches, shown_before, shown_max)
    return dist.batch_plan(ctx, train, first, stop, nbatches, shown_before, shown_max)


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
    dist = ctx.distributed if isinstance(ctx, OptContext) else None
    if dist is not None:  # many processes: the ranks agree on the epoch first
        ctx._blas_threads = current_blas_threads()  # as set_rank_threads left them
        nbatches, ibatch_split = dist.begin_epoch(
            ctx, dataset, idata_split,
            lambda: epoch_plan(ctx, dataset, result_train, result_eval, idata_split))
        _epoch_batches(ctx, dataset, result_train, result_eval, callback_train, callback_eval,
                       ibatch_split, nbatches)
        return
    nbatches, ibatch_split = epoch_plan(ctx, dataset, result_train, result_eval, idata_split)
    with blas_threads_for_training(ctx.model) as ctx._blas_threads:
        _epoch_batches(ctx, dataset, result_train, result_eval, callback_train, callback_eval,
                       ibatch_split, nbatches)


def _epoch_batches(ctx, dataset, result_train, result_eval, callback_train, callback_eval,
                   ibatch_split, nbatches):
    """The training batches, then the validation batches (ggml_opt_epoch's two loops)."""
    run_batches(ctx, dataset, result_train, plan_batches(ctx, True, 0, ibatch_split, nbatches),
                callback_train)
    run_batches(ctx, dataset, result_eval,
                plan_batches(ctx, False, ibatch_split, nbatches, nbatches), callback_eval)
