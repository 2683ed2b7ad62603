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
    replaced the temporary file with one of its own (safetensors writes 0600).

    A symbolic link is written through (its target replaced, the link kept); a
    path that exists as anything but a regular file (a device, a pipe) is
    refused with ValueError, not replaced.  An OSError of the writing names
    path, not the temporary file."""
    shown = path
    path = os.path.realpath(path)   # through links: the link stays a link
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{shown!r} exists and is no regular file (a directory, a device "
                         f"or a pipe); expected a file name")
    directory = os.path.dirname(path)
    # the name's own length, and 18 more, may pass the file system's limit (255)
    base = os.path.basename(path)
    if len(os.fsencode(base)) > _MAX_KEPT_NAME:
        base = "ggmlopt-output"
    while True:
        # os.open with 0o666 (not mkstemp's 0o600): the file gets the umask's usual mode
        tmp = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
        except OSError as e:
            raise _naming(e, tmp, shown) from None
    try:
        mode = os.stat(tmp).st_mode & 0o7777
        yield tmp
        if os.stat(tmp).st_mode & 0o7777 != mode:
            os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _naming(e, tmp, shown) from e
        raise
    _fsync_dir(directory)


# a temporary name keeps the target's name up to this many bytes
_MAX_KEPT_NAME = 200


def _naming(e: OSError, tmp: str, path: str) -> OSError:
    """e, or the same error naming path where it named the temporary file (or
    nothing: a full disk)."""
    if e.filename not in (None, tmp) or e.errno is None:
        return e
    return type(e)(e.errno, f"{e.strerror} (writing {path!r})", path)


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
