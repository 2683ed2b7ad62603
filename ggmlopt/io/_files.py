"""Paths for the exporters: argument checks, and files written atomically."""
from __future__ import annotations

import os

from .._atomic import atomic_output

__all__ = ["atomic_output", "input_path", "output_path"]


def _fspath(path, name: str) -> str:
    try:
        path = os.fspath(path)
    except TypeError:
        raise TypeError(f"{name}: expected a str or os.PathLike, got {type(path).__name__}") \
            from None
    return os.fsdecode(path) if isinstance(path, bytes) else path


def output_path(path, name: str = "path") -> str:
    """path as a str, after checking that its directory exists and that it is
    not itself a directory (FileNotFoundError / ValueError naming the argument)."""
    path = _fspath(path, name)
    if not path:
        raise ValueError(f"{name}: expected a file name, got ''")
    if os.path.isdir(path):
        raise ValueError(f"{name}: {path!r} is a directory; expected a file name")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{name}: the directory {directory!r} of {path!r} does not exist")
    return path


def input_path(path, name: str = "path") -> str:
    """path as a str, after checking that it is an existing file."""
    path = _fspath(path, name)
    if os.path.isdir(path):
        raise ValueError(f"{name}: {path!r} is a directory; expected a file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{name}: no such file {path!r}")
    return path
