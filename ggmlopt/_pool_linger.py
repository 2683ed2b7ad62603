"""Holding the kernel threads' linger (kernels.set_pool_linger: how long an idle
worker polls for the next call before it sleeps) while some work runs whose
calls come close together: a native training pass, a decode step.  Holds come
and go from any thread in any order (ranks run as threads, two threads
decoding at once): the longest held linger is in force, and the setting from
before the first hold comes back when the last one ends."""
from __future__ import annotations

import os
import threading

_holds: list[float] = []
_before = 0.0
_lock = threading.Lock()


def hold(seconds: float) -> None:
    """One more hold of at least seconds."""
    global _before
    from . import kernels

    with _lock:
        if not _holds:
            _before = kernels.set_pool_linger(seconds)
        _holds.append(seconds)
        kernels.set_pool_linger(max(_holds))


def release(seconds: float) -> None:
    """The end of a hold(seconds)."""
    from . import kernels

    with _lock:
        if seconds not in _holds:   # (a forked child dropped its parent's holds)
            return
        _holds.remove(seconds)
        kernels.set_pool_linger(max(_holds) if _holds else _before)


def _forget_in_child() -> None:
    """A forked child: the holds were other threads' (gone with the fork), and
    the lock may have been held by one of them."""
    global _lock
    _lock = threading.Lock()
    if _holds:
        _holds.clear()
        from . import kernels
        kernels.set_pool_linger(_before)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
