"""fit's plan: what fit decides from its arguments before it trains anything.

ggml_opt_fit computes its split and batch arithmetic once, then loops; fit does
the same, and what language-model training adds (a step budget, evaluation and
checkpoints every N optimizer steps) is part of that arithmetic, not of the
loop.  FitPlan.from_args checks every argument (raising ValueError or TypeError
naming it, before the context takes the model) and answers the loop's
questions: which epochs run, where inside an epoch the loop pauses, and what
happens at each pause.

Steps are optimizer steps (logical batches), counted from 1 over the whole fit:
step s of the fit is step ``s - (epoch - 1) * steps_per_epoch`` of its epoch.
"""
from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._args import int_arg
from .optim_params import OptimizerParams
from .optimizers import Optimizer
from .schedules import Schedule

__all__ = ["FitPlan"]


def _optional_steps(value: Any, name: str) -> int | None:
    return None if value is None else int_arg(value, name, 1)


def _check_split(ndata: int, nbatch_logical: int, val_split: float, idata_split: int) -> None:
    """Raise when the split leaves nothing to train; warn when rounding moved it by
    more than half a logical batch."""
    nbatches = ndata // nbatch_logical
    ntrain = idata_split // nbatch_logical
    if ntrain == 0:
        raise ValueError(
            f"val_split: {val_split} of {nbatches} logical batch{'es' if nbatches != 1 else ''} "
            f"(ndata={ndata}, nbatch_logical={nbatch_logical}) leaves no logical batch to "
            f"train (floor((1 - {val_split}) * {nbatches}) = 0); lower val_split or "
            "nbatch_logical")
    ndata_val = ndata - idata_split
    if abs(ndata_val - val_split * ndata) > nbatch_logical / 2:
        warnings.warn(
            f"val_split: {val_split} of ndata={ndata} asks for {val_split * ndata:g} "
            f"validation datapoints; rounded to whole logical batches of {nbatch_logical} "
            f"it is {ndata_val} ({ndata_val / ndata:.4g} of the data, {nbatches - ntrain} of "
            f"{nbatches} logical batches)", UserWarning, stacklevel=5)


def training_batches(nbatches_logical: int, val_split: float) -> int:
    """The logical batches of the training part when val_split of
    nbatches_logical validate, in float32 as ggml computes the split: the
    optimizer steps of an epoch (a schedule's length is sized from it)."""
    return int(np.float32(np.float32(1) - np.float32(val_split)) * np.float32(nbatches_logical))


@dataclass(frozen=True)
class FitPlan:
    """The numbers fit trains by (all counts per process).

    ndata: datapoints of the dataset (with drop_last, the last ndata %
    nbatch_logical of each epoch's order are left out: ndata_used train and
    validate).  nbatch_logical, nbatch_physical: this
    process's datapoints per optimizer step and per eval.  opt_period: physical
    batches per optimizer step over every rank (the context's).  nbatches:
    physical batches in the dataset; ibatch_split: the first validating one;
    idata_split = ibatch_split * nbatch_physical.  steps_per_epoch: optimizer
    steps an epoch trains.  nepoch: epochs that run (the last may end early);
    total_steps: optimizer steps of the whole fit.  eval_every, checkpoint_every:
    None or a step interval.
    """

    ndata: int
    nbatch_logical: int
    nbatch_physical: int
    opt_period: int
    nbatches: int
    ibatch_split: int
    steps_per_epoch: int
    nepoch: int
    total_steps: int
    eval_every: int | None = None
    checkpoint_every: int | None = None
    shuffle: bool | str = True

    @property
    def ndata_used(self) -> int:
        """The datapoints an epoch trains and validates on: whole logical batches."""
        return self.nbatches * self.nbatch_physical

    @property
    def shuffle_extent(self) -> int:
        """The datapoints each epoch's shuffle permutes: the training part, or the
        whole dataset when nothing validates and drop_last leaves some out (so
        each epoch leaves out others, as a shuffled DataLoader with drop_last)."""
        if not self.validates and self.ndata_used < self.ndata:
            return self.ndata
        return self.idata_split

    @property
    def idata_split(self) -> int:
        """The datapoints that train each epoch (the rest validate)."""
        return self.ibatch_split * self.nbatch_physical

    @property
    def batches_per_step(self) -> int:
        """Physical batches of the dataset per optimizer step."""
        return self.nbatch_logical // self.nbatch_physical

    @property
    def shuffle_all(self) -> bool:
        """Whether fit shuffles the whole dataset once (ggml: nbatch_logical < ndata;
        not with shuffle="train", whose validation part stays the data's last)."""
        return self.shuffle is True and self.nbatch_logical < self.ndata

    @property
    def shuffle_train(self) -> bool:
        """Whether each epoch shuffles its training part (nbatch_logical <
        shuffle_extent: ggml's idata_split)."""
        return bool(self.shuffle) and self.nbatch_logical < self.shuffle_extent

    @property
    def validates(self) -> bool:
        """Whether there is a held-out part."""
        return self.ibatch_split < self.nbatches

    def epoch_steps(self, epoch: int) -> int:
        """The optimizer steps epoch (1-based) trains: steps_per_epoch, fewer for an
        epoch cut by max_steps."""
        return max(0, min(self.steps_per_epoch,
                          self.total_steps - (epoch - 1) * self.steps_per_epoch))

    def pauses(self, epoch: int, done: int) -> list[int]:
        """The steps of epoch (counted inside it) after step done at which the loop
        stops training to evaluate or checkpoint, ending with the epoch's last."""
        end = self.epoch_steps(epoch)
        first = (epoch - 1) * self.steps_per_epoch
        stops = {end}
        for every in (self.eval_every, self.checkpoint_every):
            if every is not None:
                start = (first + done) // every + 1
                stops.update(k * every - first for k in range(start, (first + end) // every + 1))
        return sorted(s for s in stops if done < s <= end)

    def evaluates_at(self, step: int) -> bool:
        """Whether the fit evaluates after step (counted over the fit)."""
        return self.eval_every is not None and step % self.eval_every == 0

    def checkpoints_at(self, step: int) -> bool:
        """Whether a checkpoint is due after step (inside an epoch: the end of
        every epoch writes one anyway)."""
        return self.checkpoint_every is not None and step % self.checkpoint_every == 0

    @property
    def segmented(self) -> bool:
        """Whether some epoch pauses before its end (the loop then trains it in parts)."""
        return any(len(self.pauses(ep, 0)) > 1 or self.epoch_steps(ep) < self.steps_per_epoch
                   for ep in range(1, self.nepoch + 1))

    # ---- construction -----------------------------------------------------------------

    @classmethod
    def from_args(cls, dataset: Any, nepoch: Any, nbatch_logical: Any, nbatch_physical: Any,
                  val_split: Any, comm: Any = None, dataset_is_part: Any = False,
                  max_steps: Any = None, eval_every: Any = None,
                  checkpoint_every: Any = None, checkpoint: Any = None,
                  drop_last: Any = False, shuffle: Any = True) -> FitPlan:
        """fit's arguments checked and turned into a plan; raises ValueError or
        TypeError naming the argument.  Warns (UserWarning) when val_split rounds
        to a validation part more than half a logical batch off (see fit)."""
        nepoch = None if nepoch is None else int_arg(nepoch, "nepoch", 0)
        nbatch_logical = int_arg(nbatch_logical, "nbatch_logical", 1)
        nbatch_physical = nbatch_logical if nbatch_physical is None else \
            int_arg(nbatch_physical, "nbatch_physical", 1)
        max_steps = _optional_steps(max_steps, "max_steps")
        eval_every = _optional_steps(eval_every, "eval_every")
        checkpoint_every = _optional_steps(checkpoint_every, "checkpoint_every")
        if dataset_is_part is not False:  # many processes: from here on, this rank's share
            from .distributed import part_of_logical_batch
            nbatch_logical = part_of_logical_batch(comm, dataset_is_part, nbatch_logical)
        data = getattr(dataset, "data", None)
        if not isinstance(data, np.ndarray) or data.ndim != 2:
            raise TypeError(f"dataset: expected a ggmlopt.Dataset, got {type(dataset).__name__}")
        if not isinstance(drop_last, bool):
            raise TypeError(f"drop_last: expected a bool, got {type(drop_last).__name__}")
        if not isinstance(shuffle, (bool, str)):
            raise TypeError(f"shuffle: expected True, False or 'train', got "
                            f"{type(shuffle).__name__}")
        if isinstance(shuffle, str) and shuffle != "train":
            raise ValueError(f"shuffle: expected True, False or 'train', got {shuffle!r}")
        ndata = data.shape[0]
        rest = ndata % nbatch_logical
        if rest and not drop_last:
            raise ValueError(f"nbatch_logical: ndata={ndata} is not a multiple of "
                             f"nbatch_logical={nbatch_logical}; pass drop_last=True to leave "
                             f"{rest} datapoints out of each epoch, or pad the dataset")
        if ndata - rest == 0:
            raise ValueError(f"nbatch_logical: ndata={ndata} makes no logical batch of "
                             f"nbatch_logical={nbatch_logical}")
        ndata_used = ndata - rest
        if nbatch_logical % nbatch_physical != 0:
            raise ValueError(f"nbatch_physical: nbatch_logical={nbatch_logical} is not a "
                             f"multiple of nbatch_physical={nbatch_physical}")
        shard = getattr(dataset, "ndata_shard", 1)
        if nbatch_physical % shard != 0:
            raise ValueError(f"nbatch_physical: {nbatch_physical} is not a whole number of "
                             f"shards of ndata_shard={shard}")
        if isinstance(val_split, bool) or not isinstance(val_split, numbers.Real):
            raise TypeError(f"val_split: expected a float, got {type(val_split).__name__}")
        if not 0.0 <= np.float32(val_split) < 1.0:
            raise ValueError(f"val_split: expected 0 <= val_split < 1, got {val_split}")

        batches_per_step = nbatch_logical // nbatch_physical
        opt_period = batches_per_step
        if comm is not None:  # many processes: each rank its part of a logical batch
            nranks = comm.Get_size()
            if dataset_is_part:
                opt_period *= nranks  # physical batches of a logical batch over all ranks
            elif opt_period % nranks != 0:
                raise ValueError(f"nbatch_logical: with {nranks} ranks each rank evaluates "
                                 f"nbatch_logical/{nranks} datapoints per step in physical "
                                 f"batches of nbatch_physical, so nbatch_logical must be a "
                                 f"multiple of {nranks} x nbatch_physical = "
                                 f"{nranks * nbatch_physical}; got "
                                 f"nbatch_logical={nbatch_logical}")
        nbatches_logical = ndata_used // nbatch_logical
        # train <-> val split index (physical batches)
        ibatch_split = training_batches(nbatches_logical, float(val_split)) * batches_per_step
        _check_split(ndata_used, nbatch_logical, float(val_split),
                     ibatch_split * nbatch_physical)
        steps_per_epoch = ibatch_split // batches_per_step
        if shuffle == "train" and rest and ibatch_split * nbatch_physical < ndata_used:
            # the datapoints drop_last leaves out are the unshuffled tail: the held-out
            # set's own last ones, and as many training ones would validate instead
            raise ValueError(
                f"drop_last: shuffle='train' validates on the dataset's last datapoints, but "
                f"ndata={ndata} leaves its last {rest} out of logical batches of "
                f"{nbatch_logical}, so datapoints {ibatch_split * nbatch_physical}.."
                f"{ndata_used - 1} would validate instead of the last "
                f"{ndata_used - ibatch_split * nbatch_physical}; pad the dataset to whole "
                "logical batches (masked rows), or pass shuffle=True")

        if nepoch is None:
            if max_steps is None:
                raise ValueError("nepoch: None (as many epochs as max_steps needs) needs "
                                 "max_steps")
            nepoch = -(-max_steps // steps_per_epoch)
        total_steps = nepoch * steps_per_epoch
        if max_steps is not None:
            if max_steps > total_steps:
                raise ValueError(f"max_steps: {max_steps} optimizer steps need "
                                 f"{-(-max_steps // steps_per_epoch)} epochs of "
                                 f"{steps_per_epoch} steps, nepoch={nepoch} gives "
                                 f"{total_steps}; raise nepoch or pass nepoch=None")
            total_steps = max_steps
            nepoch = -(-max_steps // steps_per_epoch)
        if eval_every is not None and ibatch_split == ndata_used // nbatch_physical:
            raise ValueError(f"eval_every: evaluates on the held-out part, but val_split="
                             f"{val_split} holds out nothing; pass val_split > 0")
        if checkpoint_every is not None and checkpoint is None:
            raise ValueError("checkpoint_every: needs checkpoint=path to write to")
        return cls(ndata=ndata, nbatch_logical=nbatch_logical, nbatch_physical=nbatch_physical,
                   opt_period=opt_period, nbatches=ndata_used // nbatch_physical,
                   ibatch_split=ibatch_split, steps_per_epoch=steps_per_epoch, nepoch=nepoch,
                   total_steps=total_steps, eval_every=eval_every,
                   checkpoint_every=checkpoint_every, shuffle=shuffle)

    def check_schedule(self, get_opt_pars: Callable[[Any], OptimizerParams],
                       optimizer: Optimizer) -> None:
        """Run a ggmlopt.schedules schedule at the fit's last epoch (or step), so one
        too short for the fit fails before training instead of in the middle."""
        if not isinstance(get_opt_pars, Schedule) or self.nepoch == 0:
            return
        step = get_opt_pars.unit == "step"
        t_last = self.total_steps if step else self.nepoch
        if t_last < 1:
            return
        try:
            optimizer.hyperparameters(get_opt_pars(t_last))
        except (ValueError, TypeError) as e:
            what = (f"step {t_last} (nepoch={self.nepoch} x {self.steps_per_epoch} optimizer "
                    f"steps" + (f", max_steps={self.total_steps})"
                                if self.total_steps < self.nepoch * self.steps_per_epoch
                                else ")")
                    if step else f"epoch {t_last} (nepoch={self.nepoch})")
            raise type(e)(f"get_opt_pars: the schedule {get_opt_pars!r} fails at {what}, "
                          f"before training starts: {e}") from None

