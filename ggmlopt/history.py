"""The statistics fit records: EpochStats (an epoch's training and validation
figures), EvalStats (an evaluation within an epoch) and History (what fit returns),
used by fit, the plots and the checkpoints."""
from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["EpochStats", "EvalStats", "History"]


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
        """The epochs as columns: ``{"epoch": [1, 2, ...], "train_loss": [...],
        "train_loss_unc": [...], ..., "seconds": [...]}``, one list per
        EpochStats field (ints for epoch, floats, NaN where undefined), each as
        long as the history, so ``pandas.DataFrame(history.to_dict())`` is a
        table of one row per epoch."""
        return {f.name: [getattr(e, f.name) for e in self.epochs]
                for f in fields(EpochStats)}

    def plot(self, path: str | os.PathLike | None = None, **kwargs: Any) -> Any:
        """Loss and accuracy curves with uncertainty bands, written to path when given;
        returns the matplotlib Figure.  See ggmlopt.plotting.plot_history."""
        from .plotting import plot_history

        return plot_history(self, path, **kwargs)
