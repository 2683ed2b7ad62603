"""BatchPlan: which physical batches of the dataset one phase of an epoch
evaluates on this process, for the one loop over batches
(ggmlopt.epoch_loop.run_batches) that epoch, fit and the ranks share."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .result import Result

__all__ = ["BatchPlan", "EpochCallback"]

#: callback(train, ctx, dataset, result, ibatch, ibatch_max, t_start_us), as progress_bar
EpochCallback = Callable[[bool, Any, Any, "Result | None", int, int, int], None]


class BatchPlan:
    """The physical batches one phase of an epoch (training, or validation)
    evaluates on this process, and when its callback shows the statistics.

    One process (this class): every batch of [first, stop) in order, the
    callback after each.  Over many processes ggmlopt.distributed plans this
    rank's share instead (Distributed.batch_plan): a group of batches per
    optimizer step, the statistics summed over the ranks.  run_batches is the
    one loop over either.

    groups: tuples of dataset batch indices; the callback runs after each group
    that ``after_group`` returns statistics for, showing
    ``shown_before + (g + 1) * shown_per_group`` of ``shown_max`` batches."""

    def __init__(self, train: bool, first: int, stop: int, nbatches: int,
                 shown_before: int = 0, shown_max: int | None = None) -> None:
        self.train = train
        self.phase = "train" if train else "validation"   # for error messages
        self.nbatches = nbatches                          # the dataset's physical batches
        self.groups: list[tuple[int, ...]] = [(i,) for i in range(first, stop)]
        self.shown_before = shown_before
        self.shown_per_group = 1
        self.shown_max = stop - first if shown_max is None else shown_max

    # hooks: what one process needs is nothing; ggmlopt.distributed fills them in

    def guard(self) -> contextlib.AbstractContextManager[object]:
        """Around the phase: the ranks' failure reporting."""
        return contextlib.nullcontext()

    def begin(self, result: Result | None) -> Result | None:
        """The Result the phase records into (result itself here)."""
        return result

    def after_group(self, result: Result | None, ctx: Any) -> Result | None:
        """The statistics the callback shows after a group (None: no callback)."""
        return result

    def finish(self, result: Result | None, ctx: Any, dataset: Any,
               callback: EpochCallback | None, t_start: int) -> None:
        """After the last group."""
