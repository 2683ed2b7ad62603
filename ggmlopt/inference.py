"""evaluate and predict: using a trained model on any number of datapoints.

Both run forward-only evals (BuildType.FORWARD, so a model sees ``training``
off) through an OptContext in dynamic mode, in batches of ``batch_size`` with a
smaller last batch when the datapoints do not divide evenly.  They borrow the
model: the context copies the parameters into its own arena, and afterwards
every parameter's ``.data``, ``.grad`` and ``grad_is_zero`` are the objects and
values they were before, so a model that lives in another OptContext keeps
training there as if nothing had happened (only buffers a layer reuses between
forward passes are overwritten, as by any forward pass).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Union

import numpy as np
import numpy.typing as npt

from . import kernels
from ._args import enum_arg, int_arg
from .context import OptContext, first_nonfinite
from .dataset import Dataset
from .nn.module import in_use, modules, with_followers
from .nn.parameter import Parameter
from .optim_params import BuildType, LossType
from .result import Result

__all__ = ["DEFAULT_BATCH_SIZE", "evaluate", "predict"]

DEFAULT_BATCH_SIZE = 256

#: A Dataset, an (x, y) pair (y None for MEAN and SUM), or x alone.
Data = Union[Dataset, "tuple[npt.ArrayLike, npt.ArrayLike | None]", npt.ArrayLike]

_ABSENT = object()


def evaluate(model: Any, data: Data, loss_type: LossType | int | str,
             batch_size: int = DEFAULT_BATCH_SIZE) -> Result:
    """The loss (and for cross-entropy the accuracy and predictions) of model on
    data, without training it.

    data: a ggmlopt.Dataset (its datapoints in storage order, uint8/float16 data
    scaled by its data_scale as in get_batch), or arrays ``(x, y)``: x of shape
    (n, ne_datapoint) and any real dtype (converted to float32), y the labels
    with n rows (None, or x alone, for MEAN and SUM, which take no labels).
    Labels go to the context unchanged.  loss_type: a LossType, its value or its
    name in any case ("cross_entropy").  batch_size: datapoints per eval; the
    last batch holds the rest (any n >= 1 works).

    Returns a Result: ``loss()`` the mean loss per datapoint (SUM: the total),
    ``accuracy()`` and ``pred()`` (int32 (n,), in data order) for cross-entropy.
    The model's parameters are unchanged (see the module docstring).
    Raises FloatingPointError when a batch's loss is NaN or infinite.
    """
    loss_type = enum_arg(loss_type, LossType, "loss_type")
    batch_size = int_arg(batch_size, "batch_size", 1)
    x, y, scale = _split(data, loss_type)
    result = Result()
    with _borrowed(model):
        ctx = OptContext(model, loss_type=loss_type, build_type=BuildType.FORWARD,
                         inputs_dtype=_inputs_dtype(data, x))
        for start in range(0, x.shape[0], batch_size):
            stop = min(start + batch_size, x.shape[0])
            ctx.alloc(False)
            inputs, labels = _rows(x, start, stop, scale), None if y is None else y[start:stop]
            try:
                ctx.eval(result, inputs=inputs, labels=labels)
            except FloatingPointError:
                raise FloatingPointError(
                    f"evaluate: the {loss_type.name} loss of datapoints {start}:{stop} is "
                    f"not finite ({_nonfinite_cause(inputs, labels, start)})") from None
    return result


def predict(model: Any, x: Dataset | npt.ArrayLike,
            batch_size: int = DEFAULT_BATCH_SIZE) -> npt.NDArray[np.float32]:
    """The model's outputs for the datapoints x: a new float32 array (n, ne_out),
    or (n, positions, ne_out) for a model with outputs per position.

    x: (n, ne_datapoint) of any real dtype (converted to float32), or a
    ggmlopt.Dataset (its data in storage order, scaled as in get_batch).
    batch_size: datapoints per forward pass; the last batch holds the rest.
    The model's parameters are unchanged (see the module docstring).
    Raises FloatingPointError when a batch's outputs are not all finite.
    """
    batch_size = int_arg(batch_size, "batch_size", 1)
    if isinstance(x, Dataset):
        x_arr, _, scale = _split(x, LossType.SUM, labels_allowed=True)
    else:
        x_arr, _, scale = _split((x, None), LossType.SUM)
    n = x_arr.shape[0]
    out: npt.NDArray[np.float32] | None = None
    with _borrowed(model):
        ctx = OptContext(model, loss_type=LossType.SUM, build_type=BuildType.FORWARD,
                         inputs_dtype=_inputs_dtype(x, x_arr))
        for start in range(0, n, batch_size):
            stop = min(start + batch_size, n)
            ctx.alloc(False)
            inputs = _rows(x_arr, start, stop, scale)
            try:
                ctx.eval(None, inputs=inputs)
            except FloatingPointError:
                cause = _nonfinite_cause(inputs, None, start,
                                         "NaN or infinite, or too large to sum")
                raise FloatingPointError(
                    f"predict: the model's outputs for datapoints {start}:{stop} are not "
                    f"finite ({cause})") from None
            outputs = ctx.outputs
            assert outputs is not None
            if out is None:
                out = np.empty((n,) + outputs.shape[1:], dtype=np.float32)
            out[start:stop] = outputs
    assert out is not None
    return out


def _split(data: Any, loss_type: LossType, labels_allowed: bool = False
           ) -> tuple[np.ndarray, Any, float | None]:
    """(x, y, scale): the datapoints, the labels (None when the loss takes none)
    and the factor for uint8/float16 Dataset data (None: convert plainly)."""
    needs_labels = loss_type in (LossType.CROSS_ENTROPY, LossType.MEAN_SQUARED_ERROR)
    scale = None
    if isinstance(data, Dataset):
        x = data.data
        y = data.labels
        if data.data_dtype in (np.uint8, np.float16):
            scale = data.data_scale
        where = "data: the dataset"
    else:
        if isinstance(data, tuple):
            if len(data) != 2:
                raise ValueError(f"data: expected a Dataset, an (x, y) pair or an array x, got "
                                 f"a tuple of {len(data)}")
            x, y = data
        else:
            x, y = data, None
        try:
            x = np.asarray(x)
        except ValueError:   # NumPy's "inhomogeneous shape": a list [x, y], say
            raise ValueError(f"data: expected a Dataset, an (x, y) tuple or an array x, got "
                             f"a {type(x).__name__} that is no array (pass x and y as a "
                             f"tuple)") from None
        if x.dtype.kind not in "biuf":
            raise TypeError(f"x: expected real numbers, got dtype {x.dtype}")
        if x.ndim != 2:
            raise ValueError(f"x: expected shape (n, ne_datapoint), got {x.shape}")
        where = "y"
    if x.shape[0] == 0:
        raise ValueError("x: no datapoints (expected at least one row)")
    if labels_allowed:
        return x, None, scale
    if y is None:
        if needs_labels:
            raise ValueError(f"{'data: the dataset has no labels' if where != 'y' else 'y: None'}"
                             f"; {loss_type.name} needs labels")
        return x, None, scale
    if not needs_labels:
        raise ValueError(f"{where} has labels but {loss_type.name} takes none (pass y=None)")
    if not isinstance(y, np.ndarray):
        y = np.asarray(y)
    if y.ndim == 0 or y.shape[0] != x.shape[0]:
        raise ValueError(f"y: expected {x.shape[0]} rows like x, got shape {y.shape}")
    return x, y, scale


def _inputs_dtype(data: Any, x: np.ndarray) -> Any:
    """int32 for a Dataset of int32 data (token ids), else None: the model's own
    ``inputs_dtype`` (see OptContext), float32 by default."""
    return np.int32 if isinstance(data, Dataset) and x.dtype == np.int32 else None


def _nonfinite_cause(inputs, labels, start: int,
                     otherwise: str = "NaN or infinite outputs") -> str:
    """Which datapoint holds the first NaN or inf of a batch's inputs or labels."""
    for what, a in (("inputs", inputs), ("labels", labels)):
        found = first_nonfinite(np.asarray(a)) if a is not None else None
        if found is not None:
            return f"datapoint {start + found[0]} holds {found[1]} in its {what}"
    return otherwise


def _rows(x: np.ndarray, start: int, stop: int, scale: float | None) -> np.ndarray:
    """Rows start:stop of x, as float32 times scale for uint8/float16 Dataset data."""
    chunk = x[start:stop]
    return chunk if scale is None else kernels.to_float32(np.ascontiguousarray(chunk),
                                                          scale=scale)


@contextmanager
def _borrowed(model: Any) -> Iterator[None]:
    """_borrowed_here, the model in use by this thread throughout (in_use)."""
    with in_use(model, "evaluate or predict"), _borrowed_here(model):
        yield


@contextmanager
def _borrowed_here(model: Any) -> Iterator[None]:
    """Give model back as it came: each parameter's .data, .grad and grad_is_zero,
    every module's training flag and the generator a layer that draws holds.  Inside, every ggmlopt Parameter reads as
    frozen, so the forward-only context reads the weights where they are: no copy
    into an arena, no gradient (the flag is put back as it was, the count of
    trainability changes untouched: a training context over the model sees
    nothing happened)."""
    params = OptContext._collect_parameters(model) if callable(
        getattr(model, "parameters", None)) else []
    # a Parameter's gradient as it is (None when not made yet: reading .grad would make it)
    saved = [(p, p.data, p._grad if isinstance(p, Parameter) else p.grad,
              getattr(p, "grad_is_zero", _ABSENT)) for p in params]
    trains = [(p, p._requires_grad) for p in params if isinstance(p, Parameter)]
    # every module set_training reaches (a plain object's own named_children, an
    # adapter's base), each flag as its own attribute or none
    reached = [m for m in with_followers(modules(model)) if hasattr(m, "__dict__")]
    flags = [(m, vars(m).get("training", _ABSENT)) for m in reached]
    # the generators the layers that draw (set_rng: Dropout's) hold: the context's
    # alloc hands them its own
    generators = [(m, k, v) for m in reached if callable(getattr(m, "set_rng", None))
                  for k, v in vars(m).items() if isinstance(v, np.random.Generator)]
    try:
        for p, _ in trains:
            p._requires_grad = False
        yield
    finally:
        for p, was in trains:
            p._requires_grad = was
        for p, data, grad, zero in saved:
            if isinstance(p, Parameter):   # put back as they were (no assignment)
                p._swap_data(data)
                p._grad = grad
            else:
                p.data = data
                p.grad = grad
            if zero is not _ABSENT:
                p.grad_is_zero = zero
        for m, key, generator in generators:
            vars(m)[key] = generator
        for m, training in flags:
            if training is not _ABSENT:
                m.training = training
            elif "training" in vars(m):
                del m.training
