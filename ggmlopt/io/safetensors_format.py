"""safetensors files in torch's layout, with the ``safetensors`` package (the
``interop`` extra: ``pip install ggmlopt[interop]``), imported only when used.

A file written with ``layout="torch"`` holds one float32 tensor per parameter,
named and shaped as the equivalent torch module's ``state_dict`` (see
ggmlopt.io.torch_layout: a Linear weight (out, in), a Conv2d kernel (out, in,
kh, kw)), so ``torch_model.load_state_dict(safetensors.torch.load_file(path))``
works; a file torch wrote that way (``safetensors.torch.save_file(
torch_model.state_dict(), path)``) loads back with load_safetensors.
``layout="ggmlopt"`` stores the parameters as this package holds them (a Linear
weight (in, out)).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .._optional import import_optional
from ._files import atomic_output, input_path, output_path
from .torch_layout import assign_torch_arrays, torch_tensors

__all__ = ["LAYOUTS", "load_safetensors", "save_safetensors"]

LAYOUTS = ("torch", "ggmlopt")
_LAYOUT_KEY = "ggmlopt.layout"


def _safetensors():
    return import_optional("safetensors.numpy", "interop", "safetensors export and import")


def _layout_arg(layout) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"layout: expected a str, got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout


def save_safetensors(model, path, layout="torch", metadata=None) -> None:
    """Write model's parameters to path as a safetensors file (float32, atomically).

    layout: "torch" (names and shapes of the equivalent torch module's
    state_dict) or "ggmlopt" (the same names, shapes as stored here).
    metadata: optional dict str -> str, stored in the file's header (with
    "format": "pt" and "ggmlopt.layout": layout).

    Raises ValueError for an unnamed parameter, FileNotFoundError when path's
    directory does not exist, ImportError naming the ``interop`` extra without
    the safetensors package.
    """
    layout = _layout_arg(layout)
    path = output_path(path)
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"metadata: expected a dict, got {type(metadata).__name__}")
    header = {}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata: safetensors stores str -> str, got {key!r}: "
                            f"{type(value).__name__}")
        header[key] = value
    header.update({"format": "pt", _LAYOUT_KEY: layout})
    tensors = torch_tensors(model)
    save_file = _safetensors().save_file
    arrays = {t.name: (t.to_torch() if layout == "torch" else
                       np.array(t.param.data, dtype=np.float32, order="C"))
              for t in tensors}
    with atomic_output(path) as tmp:
        save_file(arrays, tmp, metadata=header)


def load_safetensors(path, model, layout="torch") -> dict:
    """Load a safetensors file into model's parameters, in place.

    layout: "torch" (a file written by save_safetensors or from a torch
    state_dict) or "ggmlopt"; a file that records another layout in its header
    is refused.  Every parameter's tensor must be there, with that layout's
    shape and a float dtype (float16/float32/float64, converted to float32),
    and no other tensor.

    Returns the file's header metadata (a dict str -> str, empty if none).
    Raises ValueError for a truncated or foreign file or a missing, extra or
    wrongly shaped tensor, TypeError for a non-float tensor, FileNotFoundError
    for a missing file.  On any error the model is unchanged.
    """
    layout = _layout_arg(layout)
    path = input_path(path)
    tensors = torch_tensors(model)
    safetensors = import_optional("safetensors", "interop", "safetensors import")
    try:
        with safetensors.safe_open(path, framework="np") as f:
            header = dict(f.metadata() or {})
            arrays = {name: _read_tensor(f, name, path) for name in f.keys()}  # noqa: SIM118
    except (safetensors.SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"path: {path!r} is not a valid safetensors file ({e})") from None
    saved = header.get(_LAYOUT_KEY)
    if saved is not None and saved != layout:
        raise ValueError(f"path: {path!r} was saved with layout={saved!r}, not {layout!r}")
    if layout == "ggmlopt":
        # as stored here -> torch's layout, which assign_torch_arrays checks
        transposed = {t.name for t in tensors if t.transposed}
        arrays = {n: (a.T if n in transposed else a) for n, a in arrays.items()}
    assign_torch_arrays(tensors, arrays, path)
    return header


def _read_tensor(f, name: str, path: str) -> np.ndarray:
    try:
        return f.get_tensor(name)
    except (TypeError, AttributeError) as e:  # a dtype NumPy has no type for (bfloat16,
        # float8: safetensors asks numpy for an attribute it does not have)
        raise TypeError(f"path: tensor {name!r} of {path!r} cannot be read as a NumPy array "
                        f"({e})") from None
