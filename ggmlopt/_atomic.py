"""Files written atomically: checkpoints and exported models alike."""
from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

__all__ = ["atomic_output"]


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yield a temporary file name beside path (same file system, so the rename is
    atomic); when the block ends normally the file is fsynced and renamed over
    path, then the directory is fsynced, otherwise the file is removed.  Readers
    and crashes only ever see the previous file or the complete new one.  The file
    gets the umask's usual mode (0644 under a 022 umask), also when the writer
    replaced the temporary file with one of its own (safetensors writes 0600)."""
    directory = os.path.dirname(os.path.abspath(path))
    while True:
        # os.open with 0o666 (not mkstemp's 0o600): the file gets the umask's usual mode
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    mode = os.stat(tmp).st_mode & 0o7777
    try:
        yield tmp
        if os.stat(tmp).st_mode & 0o7777 != mode:
            os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not possible everywhere (Windows); the rename is done
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
