"""Paths for the exporters: argument checks, and files written atomically."""
from __future__ import annotations

import json
import os

from .._atomic import atomic_output

__all__ = ["atomic_output", "input_path", "output_path", "path_arg", "read_json_object"]


def path_arg(path, name: str) -> str:
    """path (a str, bytes or os.PathLike) as a str; TypeError naming the argument
    for anything else."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise TypeError(f"{name}: expected a str or os.PathLike, got {type(path).__name__}") \
            from None
    return os.fsdecode(path) if isinstance(path, bytes) else path


def read_json_object(path: str) -> dict:
    """The JSON object in the file at path; ValueError naming the file when it is
    no valid JSON or no object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:   # (JSONDecodeError is a ValueError)
        raise ValueError(f"{path}: not a valid JSON file ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got a JSON "  # noqa: TRY004 (a file's value)
                         f"{type(value).__name__}")
    return value


def output_path(path, name: str = "path") -> str:
    """path as a str, after checking that its directory exists and that it is
    not itself a directory (FileNotFoundError / ValueError naming the argument)."""
    path = path_arg(path, name)
    if not path:
        raise ValueError(f"{name}: expected a file name, got ''")
    if os.path.isdir(path):
        raise ValueError(f"{name}: {path!r} is a directory; expected a file name")
    directory = os.path.dirname(os.path.abspath(path))
    # (the folder the file lands in, through a symbolic link: atomic_output's)
    if not os.path.isdir(os.path.dirname(os.path.realpath(path))):
        raise FileNotFoundError(f"{name}: the directory {directory!r} of {path!r} does not exist")
    return path


def input_path(path, name: str = "path") -> str:
    """path as a str, after checking that it is an existing file."""
    path = path_arg(path, name)
    if os.path.isdir(path):
        raise ValueError(f"{name}: {path!r} is a directory; expected a file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{name}: no such file {path!r}")
    return path
