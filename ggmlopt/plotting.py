"""Learning curves: a History as columns, and as a picture (matplotlib, the
``plot`` extra: ``pip install ggmlopt[plot]``, imported only when drawing)."""
from __future__ import annotations

import math

import numpy as np

from ._optional import import_optional

__all__ = ["history_to_dict", "plot_history"]


def history_to_dict(history) -> dict[str, list]:
    """The History's epochs as columns (``history.to_dict()``, see
    ggmlopt.history.History.to_dict)."""
    return history.to_dict()


def _has_values(values) -> bool:
    return any(not math.isnan(v) for v in values)


def _draw(ax, epochs, history, metric, scale, ylabel):
    for phase, colour in (("train", "tab:blue"), ("val", "tab:orange")):
        mean = np.asarray(getattr(history, f"{phase}_{metric}"), dtype=np.float64) * scale
        unc = np.asarray(getattr(history, f"{phase}_{metric}_unc"), dtype=np.float64) * scale
        if not _has_values(mean):
            continue  # no validation split
        label = "training" if phase == "train" else "validation"
        ax.plot(epochs, mean, marker="o", markersize=3, color=colour, label=label)
        band = np.nan_to_num(unc, nan=0.0)
        ax.fill_between(epochs, mean - band, mean + band, color=colour, alpha=0.25,
                        linewidth=0)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.has_data():
        ax.legend()


def plot_history(history, path=None, *, figsize=(10.0, 4.0), dpi=100):
    """Draw the training and validation loss (left) and accuracy in % (right)
    per epoch, each with a band of +- its uncertainty (the Result's standard
    error; no band where it is NaN, no validation curve without a validation
    split).

    path: None, or a file name whose suffix picks the format (".png", ".pdf",
    ".svg"...); the figure is written there.  figsize (inches) and dpi set the
    size: a PNG is figsize * dpi pixels (1000 x 400 by default).
    Returns the matplotlib Figure.  Works without a display: the figure is not
    attached to pyplot (show it in a notebook by evaluating it, or with
    ``fig.savefig``).  Raises ImportError naming the ``plot`` extra without
    matplotlib, ValueError for an empty history.
    """
    if len(history.epochs) == 0:
        raise ValueError("history: it has no epochs to plot")
    if path is not None:
        from .io._files import output_path

        path = output_path(path)
    import_optional("matplotlib", "plot", "History.plot")
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi, layout="constrained")
    loss_ax, acc_ax = fig.subplots(1, 2)
    epochs = np.asarray([e.epoch for e in history.epochs])
    _draw(loss_ax, epochs, history, "loss", 1.0, "loss")
    _draw(acc_ax, epochs, history, "accuracy", 100.0, "accuracy (%)")
    loss_ax.set_title("loss")
    acc_ax.set_title("accuracy")
    if path is not None:
        fig.savefig(path, dpi=dpi)
    return fig
