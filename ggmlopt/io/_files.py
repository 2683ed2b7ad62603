"""Paths for the exporters: argument checks, and files written atomically."""
from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

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


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yield a temporary file name beside path; when the block ends normally the
    file is fsynced and renamed over path (atomic), otherwise removed.  Readers
    and crashes only ever see the previous file or the complete new one."""
    directory = os.path.dirname(os.path.abspath(path))
    while True:
        # os.open with 0o666 (not mkstemp's 0o600): the file gets the umask's usual mode
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
