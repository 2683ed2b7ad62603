"""progress_bar: ggml's epoch callback (ggml_opt_epoch_callback_progress_bar).

On a terminal it writes the reference's line character for character and
redraws it with a carriage return after every batch; when stderr is not a
terminal (a log file, a pipe) it writes only the final line of each phase.
"""
from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .context import OptContext
    from .dataset import Dataset
    from .result import Result

__all__ = ["format_hms", "format_progress", "progress_bar", "time_us"]

# Unicode eighth blocks, from 1/8 filled to full
_BLOCKS = ("\u258F", "\u258E", "\u258D", "\u258C", "\u258B", "\u258A", "\u2589", "\u2588")


def time_us() -> int:
    """A monotonic clock in microseconds (ggml_time_us)."""
    return time.monotonic_ns() // 1000


def format_hms(t_us: int) -> str:
    """HH:MM:SS of a non-negative duration in microseconds (truncated, as ggml)."""
    s = t_us // 1_000_000
    h = s // 3600
    s -= h * 3600
    m = s // 60
    s -= m * 60
    return f"{h:02d}:{m:02d}:{s:02d}"


def _cfloat(x: float, prec: int) -> str:
    """printf("%.<prec>lf", x) as glibc prints it (NaN keeps its sign: -nan)."""
    if math.isnan(x):
        return "-nan" if math.copysign(1.0, x) < 0 else "nan"
    return f"{x:.{prec}f}"


def _bar(ibatch: int, ibatch_max: int) -> str:
    cells = []
    ibatch8 = 8 * ibatch
    for j in range(8):
        cell = " "
        for level in range(8, 0, -1):  # full block first, as the reference's if-chain
            if ibatch_max * (8 * j + level) // 8 < ibatch8:
                cell = _BLOCKS[level - 1]
                break
        cells.append(cell)
    return "".join(cells)


def format_progress(train: bool, batch_size: int, result: Result | None, ibatch: int,
                    ibatch_max: int, t_start_us: int, now_us: int | None = None) -> str:
    """The progress line without the trailing '\\r' (see progress_bar); an empty
    result shows "no batches" in place of the loss and accuracy, and result None
    "no result"."""
    # ggml's empty result reads loss=0.00000, which looks like a perfect loss
    if result is None:
        stats = "no result "
    elif result.nbatches == 0:
        stats = "no batches "
    else:
        loss, loss_unc = result.loss()
        acc, acc_unc = result.accuracy()
        stats = (f"loss={_cfloat(loss, 5)}\u00b1{_cfloat(loss_unc, 5)} "
                 f"acc={_cfloat(100.0 * acc, 2)}\u00b1{_cfloat(100.0 * acc_unc, 2)}% ")
    idata = ibatch * batch_size
    idata_max = ibatch_max * batch_size
    t_ibatch_us = (time_us() if now_us is None else now_us) - t_start_us
    t_eta_us = t_ibatch_us * (ibatch_max - ibatch) // ibatch if ibatch > 0 else 0
    return (f"{'train: ' if train else 'val:   '}[{_bar(ibatch, ibatch_max)}] "
            f"data={idata:07d}/{idata_max:07d} {stats}"
            f"t={format_hms(t_ibatch_us)} ETA={format_hms(t_eta_us)} ")


def progress_bar(train: bool, ctx: OptContext, dataset: Dataset, result: Result | None,
                 ibatch: int, ibatch_max: int, t_start_us: int) -> None:
    """Epoch callback: a progress line on stderr.

    train: True for the training phase; ctx: the OptContext (its batch size
    scales the data counts); result: that phase's Result; ibatch: batches done
    (1-based); ibatch_max: batches in the phase; t_start_us: time_us() at the
    phase's start.  Format: ``train: [████▌   ] data=0000500/0060000
    loss=0.12345±0.00123 acc=96.50±0.25% t=00:00:01 ETA=00:00:10 \\r`` and a
    newline after the last batch.
    """
    stream = sys.stderr
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    last = ibatch == ibatch_max
    if not tty and not last:
        return
    line = format_progress(train, ctx.batch_size or 0, result, ibatch, ibatch_max, t_start_us)
    stream.write(line + ("\r\n" if last else "\r") if tty else line + "\n")
    stream.flush()
