"""Every rank's predictions in the dataset's batch order (ggmlopt.distributed's epoch).

Over P ranks each rank evaluates only its share of an epoch's physical batches;
these gather the predictions its Result recorded so that ``Result.pred()`` holds
on every rank what one process's would: one entry per labelled row (a datapoint,
or a position with sequence labels) of every batch, in the order the batches
come in the (permuted) dataset.  Training: logical batch j is physical batches
``j*opt_period ...``, rank r evaluating the r-th run of ``per`` of them (with
``dataset_is_part=True`` rank r's part supplies that run: the global order is
then part 0's share of the logical batch, part 1's, ...).  Validation: round
robin over the ranks (batch b on rank ``b % P``); with parts, part 0's
validation batches, then part 1's, ...
"""
from __future__ import annotations

import math

import numpy as np

from .optim_params import LossType


def rows_per_batch(ctx):
    """Prediction entries of one physical batch of ctx, or 0 when its loss makes none."""
    if ctx.loss_type != LossType.CROSS_ENTROPY:
        return 0
    return ctx.batch_size * math.prod(ctx.out_shape[:-1])


def gather_training(dist, result, start, nsteps, per, rows):
    """Result's predictions from entry start on (nsteps x per physical batches of
    rows entries on this rank) replaced by every rank's, in logical-batch order."""
    if rows == 0 or nsteps == 0:
        return
    # every cross-entropy eval records its predictions: nsteps * per * rows here
    local = np.ascontiguousarray(result.pred()[start:])
    out = np.empty((dist.size, local.size), np.int32)
    dist._allgather(local, out)
    # (rank, step, per*rows) -> (step, rank, per*rows)
    glob = out.reshape(dist.size, nsteps, per * rows).transpose(1, 0, 2).reshape(-1)
    result._set_preds(start, glob)


def gather_validation(dist, result, start, nmine, nval, parts, rows):
    """Result's predictions from entry start on (this rank's nmine validation
    batches) replaced by every rank's in batch order.  nval: the validation
    batches of the dataset (round robin) or of each part (parts)."""
    if rows == 0 or nval == 0:
        return
    local = result.pred()[start:]  # nmine * rows entries
    P = dist.size
    if parts:  # part 0's batches, part 1's, ...
        out = np.empty((P, local.size), np.int32)
        dist._allgather(np.ascontiguousarray(local), out)
        result._set_preds(start, out.reshape(-1))
        return
    slots = -(-nval // P)  # the most batches any rank holds
    send = np.zeros((slots, rows), np.int32)
    send[:nmine] = local.reshape(nmine, rows)
    out = np.empty((P, slots, rows), np.int32)
    dist._allgather(send, out)
    # batch i of the validation is rank i % P's slot i // P
    order = out.transpose(1, 0, 2).reshape(slots * P, rows)[:nval]
    result._set_preds(start, order.reshape(-1))
