"""Result: statistics over the evals of an epoch (ggml_opt_result)."""
from __future__ import annotations

import math

import numpy as np

__all__ = ["Result"]

_NEG_NAN = -math.nan  # what C's sqrt of a negative number gives on x86


class Result:
    """Per eval: ndata grows by the batch, the float32 loss is kept, predictions
    appended (cross-entropy) and ncorrect added (or -1 forever once an eval
    without it is seen).  One Result takes one batch size, one loss kind
    (per datapoint or not) and one opt_period."""

    __slots__ = (
        "_batch",
        "_nbatches",
        "_ncorrect",
        "_ndata",
        "_npred",
        "_opt_period",
        "_per_datapoint",
        "_pred",
        "_sum",
        "_sum_sq",
    )

    def __init__(self):
        self._pred = np.empty(0, dtype=np.int32)
        self.reset()

    def reset(self):
        """Forget every eval (the prediction buffer is kept for reuse)."""
        self._ndata = 0
        self._nbatches = 0
        self._sum = 0.0
        self._sum_sq = 0.0
        self._npred = 0
        self._ncorrect = 0
        self._opt_period = -1
        self._per_datapoint = False
        self._batch = -1

    @property
    def ndata(self) -> int:
        """Datapoints seen."""
        return self._ndata

    @property
    def nbatches(self) -> int:
        """Evals (physical batches) seen."""
        return self._nbatches

    def _check(self, batch: int, per_datapoint: bool, opt_period: int) -> None:
        """Raise ValueError when an eval of this kind cannot join this Result."""
        if self._nbatches == 0:
            return
        if per_datapoint != self._per_datapoint:
            raise ValueError("result: it holds losses "
                             f"{'per datapoint' if self._per_datapoint else 'summed'}, this eval's "
                             f"loss is {'per datapoint' if per_datapoint else 'summed'}; "
                             "use one Result per loss kind")
        if opt_period != self._opt_period:
            raise ValueError(f"result: it holds evals with opt_period={self._opt_period}, "
                             f"this eval has opt_period={opt_period}")
        if batch != self._batch:
            raise ValueError(f"result: it holds batches of {self._batch} datapoints, this eval "
                             f"has {batch}; varying batch sizes are not supported")

    def _add(self, batch: int, loss: np.float32, per_datapoint: bool, opt_period: int,
             pred, ncorrect) -> None:
        """Record one eval (call _check first).  pred: int32 (batch,) or None;
        ncorrect: int or None."""
        if self._nbatches == 0:
            self._per_datapoint = per_datapoint
            self._opt_period = opt_period
            self._batch = batch
        self._ndata += batch
        self._nbatches += 1
        # as ggml: float loss_scaled = loss*opt_period, and loss_scaled*loss_scaled,
        # both in float32, summed in double
        scaled = np.float32(loss) * np.float32(opt_period) if per_datapoint else np.float32(loss)
        self._sum += float(scaled)
        self._sum_sq += float(scaled * scaled)
        if pred is not None:
            n = self._npred + pred.shape[0]
            if n > self._pred.shape[0]:
                grown = np.empty(max(n, 2 * self._pred.shape[0]), dtype=np.int32)
                grown[:self._npred] = self._pred[:self._npred]
                self._pred = grown
            self._pred[self._npred:n] = pred
            self._npred = n
        if ncorrect is None or self._ncorrect < 0:
            self._ncorrect = -1
        else:
            self._ncorrect += int(ncorrect)

    def loss(self):
        """(loss, unc): the mean per-batch loss (per-datapoint losses, scaled back by
        opt_period) or the sum (SUM); unc is the standard error, NaN for fewer
        than 2 batches.  No batches: (0.0, NaN)."""
        n = self._nbatches
        if n == 0:
            return 0.0, math.nan
        mean = self._sum / n
        value = mean if self._per_datapoint else self._sum
        if n < 2:
            return value, math.nan
        var = self._sum_sq / n - mean * mean  # without Bessel's correction
        x = var / (n - 1) if self._per_datapoint else var * n / (n - 1)
        return value, (math.sqrt(x) if x >= 0 else _NEG_NAN)

    def accuracy(self):
        """(accuracy, unc) from ncorrect / ndata; NaN when some eval had no
        ncorrect or nothing was seen; unc = sqrt(a(1-a)/(ndata-1)), NaN for ndata < 2."""
        if self._ncorrect < 0 or self._ndata == 0:
            acc = math.nan
        else:
            acc = self._ncorrect / self._ndata
        if self._ncorrect >= 0 and self._ndata >= 2:
            x = acc * (1.0 - acc) / (self._ndata - 1)
            unc = math.sqrt(x) if x >= 0 else _NEG_NAN
        else:
            unc = math.nan
        return acc, unc

    # ---- many processes (ggmlopt.distributed sums these over the ranks) ----------------

    def _totals(self):
        """(ndata, nbatches, loss sum, loss sum of squares, ncorrect or -1)."""
        return (self._ndata, self._nbatches, self._sum, self._sum_sq, self._ncorrect)

    def _set_totals(self, totals, ctx):
        """Take totals (as _totals, summed over ranks) for evals of ctx's kind;
        a negative ncorrect means some eval had none."""
        ndata, nbatches, total, total_sq, ncorrect = totals
        self._ndata = round(float(ndata))
        self._nbatches = round(float(nbatches))
        self._sum = float(total)
        self._sum_sq = float(total_sq)
        self._ncorrect = round(float(ncorrect)) if ncorrect >= 0 else -1
        if self._nbatches:
            self._batch = ctx.batch_size
            self._per_datapoint = ctx.loss_per_datapoint
            self._opt_period = ctx.opt_period

    def pred(self) -> np.ndarray:
        """The predictions of every eval in order, int32 (a copy)."""
        return self._pred[:self._npred].copy()

    def __repr__(self):
        loss, unc = self.loss()
        return f"Result(ndata={self._ndata}, nbatches={self._nbatches}, loss={loss}±{unc})"
