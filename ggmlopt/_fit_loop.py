"""fit's loop: the epochs of a FitPlan, paused where the plan says.

An epoch without pauses is ggml_opt_fit's: shuffle the training part, ``epoch``
(train, then validate), record the epoch, checkpoint.  An epoch the plan pauses
(evaluation or checkpoint every N steps, max_steps) trains the same batches in
the same order in parts, doing at each pause what the plan asks; the training
arithmetic is the same (an evaluation's forward passes touch neither the
generator nor the optimizer), so the parameters are those of the run without
pauses.
"""
from __future__ import annotations

import math
import sys
from dataclasses import astuple

from ._blas_threads import blas_threads_for_training, current_blas_threads
from .epoch_loop import epoch, epoch_plan, plan_batches, run_batches
from .history import EpochStats, EvalStats
from .optim_params import FitEpoch
from .progress import time_us
from .result import Result

__all__ = ["FitLoop"]


def _loss_or_nan(result):
    """ggml's loss of an empty Result is 0.0; the History says NaN, so no one reads
    a perfect validation loss into it."""
    return result.loss() if result.ndata else (math.nan, math.nan)


class FitLoop:
    """Runs plan's epochs on ctx and dataset, appending to history and writing
    ckpt (a FitCheckpoint or None); callback: None (silent) or the progress
    callback of every batch (progress_bar)."""

    def __init__(self, plan, ctx, dataset, history, ckpt, callback):
        self.plan, self.ctx, self.dataset = plan, ctx, dataset
        self.history, self.ckpt = history, ckpt
        self.silent = callback is None
        self.callback = callback
        self.result_train, self.result_val = Result(), Result()
        self.dist = ctx.distributed

    def run(self, first_epoch=1, first_step=0, train_totals=None):
        """Epochs first_epoch .. plan.nepoch, the first from its step first_step
        (a checkpoint inside an epoch: train_totals are its training statistics)."""
        plan, ctx, silent = self.plan, self.ctx, self.silent
        for ep in range(first_epoch, plan.nepoch + 1):
            done = first_step if ep == first_epoch else 0
            ctx.get_opt_pars_ud = FitEpoch(ep)   # ggml's userdata: the epoch
            self.result_train.reset()
            if done > 0:  # resumed inside the epoch: its shuffle and first steps are done
                self.result_train._set_totals(train_totals, ctx)
            elif plan.shuffle_train:
                self.dataset.shuffle(ctx.rng, plan.shuffle_extent)
            self.result_val.reset()
            if not silent:
                sys.stderr.write(f"fit: epoch {ep:04d}/{plan.nepoch:04d}:\n")
            t0 = time_us()
            waited = 0.0 if self.dist is None else self.dist.exchange_wait_total
            if done == 0 and plan.pauses(ep, 0) == [plan.steps_per_epoch] \
                    and plan.ndata_used == plan.ndata:   # epoch() runs every datapoint
                epoch(self.ctx, self.dataset, self.result_train, self.result_val,
                      plan.idata_split, self.callback, self.callback)
            else:
                self._epoch_in_parts(ep, done, t0)
            seconds = (time_us() - t0) / 1e6
            if self.dist is not None:
                waited = self.dist.exchange_wait_total - waited
            if not silent:
                sys.stderr.write("\n")
            step = (ep - 1) * plan.steps_per_epoch + plan.epoch_steps(ep)
            if plan.evaluates_at(step):  # the epoch's validation is this step's evaluation
                self._record_evaluation(step, ep, self.result_val)
            cut = plan.epoch_steps(ep) < plan.steps_per_epoch
            if cut and self.ckpt is not None:  # max_steps: resume continues this epoch
                self._save(ep - 1, plan.epoch_steps(ep))
            self.history.epochs.append(EpochStats(
                ep, *self.result_train.loss(), *self.result_train.accuracy(),
                *_loss_or_nan(self.result_val), *self.result_val.accuracy(), seconds,
                ctx._blas_threads, waited))
            if self.ckpt is not None and not cut:
                self._save(ep, 0)

    def _epoch_in_parts(self, ep, done, t_start):
        """Epoch ep from its step done, pausing where the plan says, then validating."""
        plan = self.plan
        end = plan.epoch_steps(ep)
        first = (ep - 1) * plan.steps_per_epoch
        for stop in plan.pauses(ep, done):
            self._train(done, stop, end, t_start)
            done = stop
            if stop == end:
                break
            if plan.evaluates_at(first + stop):
                result = Result()
                self._validate(result, None)
                self._record_evaluation(first + stop, ep, result)
            if self.ckpt is not None and plan.checkpoints_at(first + stop):
                self._save(ep - 1, stop)
        self._validate(self.result_val, self.callback)

    def _record_evaluation(self, step, ep, result):
        evaluations = self.history.evaluations
        if evaluations and evaluations[-1].step == step:
            return  # resumed from where a max_steps run stopped: it evaluated there
        loss, unc = _loss_or_nan(result)
        acc, acc_unc = result.accuracy()
        stats = EvalStats(step, ep, self.result_train.loss()[0], loss, unc, acc, acc_unc)
        self.history.evaluations.append(stats)
        if not self.silent:
            sys.stderr.write(f"{chr(10) if sys.stderr.isatty() else ''}fit: step {step:06d}: "
                             f"val loss={loss:.5f}±{unc:.5f}"
                             + (f" acc={100 * acc:.2f}±{100 * acc_unc:.2f}%"
                                if not math.isnan(acc) else "") + "\n")

    def _save(self, epochs_done, step):
        self.ckpt.save(self.ctx, self.dataset, epochs_done,
                       [astuple(e) for e in self.history.epochs], step,
                       self.result_train._totals() if step else None,
                       [astuple(e) for e in self.history.evaluations])

    # ---- batches ------------------------------------------------------------------------

    def _train(self, done, stop, end, t_start):
        """Train steps done+1 .. stop of the epoch (end: its last step, for the bar)."""
        plan = self.plan
        per = plan.batches_per_step
        self._run_batches(True, done * per, stop * per, self.result_train, self.callback,
                          done * plan.opt_period, end * plan.opt_period, t_start)

    def _validate(self, result, callback):
        """The held-out batches into result (as epoch's second loop)."""
        self._run_batches(False, self.plan.ibatch_split, self.plan.nbatches, result, callback,
                          0, None, None)

    def _run_batches(self, train, first, stop, result, callback, shown_before, shown_max,
                     t_start):
        """The dataset's physical batches [first, stop) through epoch_loop's one loop
        (over the ranks: this rank's share, after the ranks agreed on the window)."""
        ctx, dataset = self.ctx, self.dataset
        batches = plan_batches(ctx, train, first, stop, self.plan.nbatches, shown_before,
                               shown_max)
        if self.dist is None:
            with blas_threads_for_training(ctx.model) as ctx._blas_threads:
                run_batches(ctx, dataset, result, batches, callback, t_start)
            return
        n = stop - first

        def check():
            # the argument checks of a whole epoch, over the datapoints fit takes
            epoch_plan(ctx, dataset, None, None, -1, self.plan.ndata_used)
            return n, (n if train else 0)

        ctx._blas_threads = current_blas_threads()
        self.dist.begin_epoch(ctx, dataset, -1, check)
        run_batches(ctx, dataset, result, batches, callback, t_start)
