"""Result: statistics over the evals of an epoch (ggml_opt_result)."""
from __future__ import annotations

import math

import numpy as np

__all__ = ["Result"]

_NEG_NAN = -math.nan  # what C's sqrt of a negative number gives on x86


class Result:
    """Result(): statistics over evals (ggml_opt_result).

    Per eval: ndata grows by the batch, the float32 loss is kept, predictions
    appended (cross-entropy) and ncorrect added (or -1 forever once an eval
    without it is seen).  A batch of masked sequence labels without one labelled
    position has no loss (its 0 stands for none): it counts its datapoints and
    predictions, and stays out of the loss's mean and uncertainty.  One Result
    takes one batch size, one loss kind (per datapoint or not) and one
    opt_period; a smaller last batch (evaluate's tail) may end it, after which
    it takes no more evals.

    An empty Result (no evals) keeps ggml's values, ``loss() == (0.0, nan)``;
    its repr and the progress bar say "no batches" instead of showing a loss.
    """

    __slots__ = (
        "_batch",
        "_nbatches",
        "_ncorrect",
        "_ndata",
        "_nempty",
        "_nlabelled",
        "_npred",
        "_opt_period",
        "_per_datapoint",
        "_pred",
        "_sum",
        "_sum_sq",
        "_tail",
    )

    def __init__(self) -> None:
        self._pred = np.empty(0, dtype=np.int32)
        self.reset()

    def reset(self) -> None:
        """Forget every eval (the prediction buffer is kept for reuse)."""
        self._ndata = 0
        self._nlabelled = 0
        self._nbatches = 0
        self._nempty = 0    # batches without a labelled position (no loss)
        self._sum = 0.0
        self._sum_sq = 0.0
        self._npred = 0
        self._ncorrect = 0
        self._opt_period = -1
        self._per_datapoint = False
        self._batch = -1
        # (batch, scaled loss) of a smaller last batch (loss None: it had no labelled
        # position)
        self._tail: tuple[int, float | None] | None = None

    @property
    def ndata(self) -> int:
        """Datapoints seen."""
        return self._ndata

    @property
    def nlabelled(self) -> int:
        """Labelled positions seen, the denominator of accuracy(): one per datapoint,
        or with sequence labels (a class per position, -1 masking one) the
        positions whose label is not -1."""
        return self._nlabelled

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
        if self._tail is not None:
            raise ValueError(f"result: it ended with a smaller batch of {self._tail[0]} "
                             "datapoints and takes no more evals")
        if batch > self._batch:
            raise ValueError(f"result: it holds batches of {self._batch} datapoints, this eval "
                             f"has {batch}; only a smaller last batch is supported")

    def _add(self, batch: int, loss: np.float32, per_datapoint: bool, opt_period: int,
             pred: np.ndarray | None, ncorrect: int | None, nlabelled: int | None = None,
             counted: bool = False) -> None:
        """Record one eval (call _check first).  pred: int32 (batch,) (or one per
        position with sequence labels) or None; ncorrect: int or None; nlabelled:
        the labelled positions (default batch); counted: its loss counts even
        without a labelled position (a token-weighted micro-batch: 0 of its step's)."""
        if self._nbatches == 0:
            self._per_datapoint = per_datapoint
            self._opt_period = opt_period
            self._batch = batch
        # as ggml: float loss_scaled = loss*opt_period, and loss_scaled*loss_scaled,
        # both in float32, summed in double
        scaled = np.float32(loss) * np.float32(opt_period) if per_datapoint else np.float32(loss)
        empty = nlabelled is not None and int(nlabelled) == 0 and not counted
        if batch < self._batch:
            self._tail = (batch, None if empty else float(scaled))
        self._ndata += batch
        self._nlabelled += batch if nlabelled is None else int(nlabelled)
        self._nbatches += 1
        if empty:
            self._nempty += 1
        else:
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

    def loss(self) -> tuple[float, float]:
        """(loss, unc): the mean per-batch loss (per-datapoint losses, scaled back by
        opt_period) or the sum (SUM); unc is the standard error, NaN for fewer
        than 2 batches.  No batches: (0.0, NaN), as ggml (repr says "no batches").

        With a smaller last batch the per-datapoint mean weighs each batch by its
        datapoints (the tail counts for what it holds); unc treats the batches
        alike, as ggml's formula does (a SUM's tail read as its sum over a full
        batch).  Batches without a labelled position
        (masked sequence labels) have no loss and are left out."""
        n = self._nbatches - self._nempty
        if n == 0:
            # no batch at all: ggml's (0, NaN); batches without a labelled position only:
            # no loss
            return (0.0 if self._nbatches == 0 else math.nan), math.nan
        mean = self._sum / n
        value = mean if self._per_datapoint else self._sum
        tail_batch, tail_loss = self._tail if self._tail is not None else (0, None)
        if tail_loss is not None and self._per_datapoint:
            full = self._sum - tail_loss
            # the batches with a loss: every one full but the tail
            value = (full * self._batch + tail_loss * tail_batch) / (
                self._ndata - self._nempty * self._batch)
        if n < 2:
            return value, math.nan
        total, total_sq = self._sum, self._sum_sq
        if tail_loss is not None and not self._per_datapoint:
            # a sum of fewer datapoints is no sample of a full batch's sum: the spread
            # reads the tail's sum as it would be over a full batch
            full_size = tail_loss * self._batch / tail_batch
            total += full_size - tail_loss
            total_sq += full_size * full_size - tail_loss * tail_loss
            mean = total / n
        var = total_sq / n - mean * mean  # without Bessel's correction
        x = var / (n - 1) if self._per_datapoint else var * n / (n - 1)
        return value, (math.sqrt(x) if x >= 0 else _NEG_NAN)

    def accuracy(self) -> tuple[float, float]:
        """(accuracy, unc) from ncorrect / n, n = nlabelled (ndata, unless the
        labels are sequences: then next-token accuracy over the labelled
        positions); NaN when some eval had no ncorrect or n == 0;
        unc = sqrt(a(1-a)/(n-1)), NaN for n < 2."""
        n = self._nlabelled
        if self._ncorrect < 0 or n == 0:
            acc = math.nan
        else:
            acc = self._ncorrect / n
        if self._ncorrect >= 0 and n >= 2:
            x = acc * (1.0 - acc) / (n - 1)
            unc = math.sqrt(x) if x >= 0 else _NEG_NAN
        else:
            unc = math.nan
        return acc, unc

    # ---- many processes (ggmlopt.distributed sums these over the ranks) ----------------

    def _totals(self):
        """(ndata, nbatches, loss sum, loss sum of squares, ncorrect or -1, nlabelled,
        batches without a labelled position)."""
        return (self._ndata, self._nbatches, self._sum, self._sum_sq, self._ncorrect,
                self._nlabelled, self._nempty)

    def _set_totals(self, totals, ctx):
        """Take totals (as _totals, summed over ranks) for evals of ctx's kind;
        a negative ncorrect means some eval had none."""
        # (six totals: a checkpoint written before the empty batches were counted)
        ndata, nbatches, total, total_sq, ncorrect, nlabelled, nempty = (*totals, 0)[:7]
        self._ndata = round(float(ndata))
        self._nlabelled = round(float(nlabelled))
        self._nbatches = round(float(nbatches))
        self._nempty = round(float(nempty))
        self._sum = float(total)
        self._sum_sq = float(total_sq)
        self._ncorrect = round(float(ncorrect)) if ncorrect >= 0 else -1
        if self._nbatches:
            self._batch = ctx.batch_size
            self._per_datapoint = ctx.loss_per_datapoint
            self._opt_period = ctx.opt_period

    def _set_preds(self, start: int, preds: np.ndarray) -> None:
        """Replace the predictions from entry start on by preds (every rank's, in
        dataset order: ggmlopt.distributed)."""
        n = start + preds.shape[0]
        if n > self._pred.shape[0]:
            grown = np.empty(n, dtype=np.int32)
            grown[:start] = self._pred[:start]
            self._pred = grown
        self._pred[start:n] = preds
        self._npred = n

    def pred(self) -> np.ndarray:
        """The predictions of every eval in order, int32 (a copy): one per
        datapoint, or per position with sequence labels (-1 at a masked
        position when a language model's fused head computed the loss, as it
        does by default: it computes no logits there).  After an epoch over
        several ranks (comm): every rank's, in the dataset's batch order, as one
        process's would be (see ggmlopt.distributed)."""
        return self._pred[:self._npred].copy()

    def __repr__(self) -> str:
        if self._nbatches == 0:
            return "Result(no batches)"
        loss, unc = self.loss()
        text = f"Result(ndata={self._ndata}, nbatches={self._nbatches}, loss={loss}±{unc}"
        acc, acc_unc = self.accuracy()
        if not math.isnan(acc):
            text += f", accuracy={acc}±{acc_unc}"
        return text + ")"
