"""BLAS threads while training: fewer when the cores are busy.

The layers' matrix products run in NumPy's BLAS (OpenBLAS), whose worker threads
busy-wait for work and split each product evenly between themselves.  When
another process keeps a core busy, every product waits for the worker that lost
its core, and the spinning workers take CPU from the rest: with a busy loop on
one of two cores an epoch of a 784-500-10 model took 2.1 s instead of 0.13 s
with one BLAS thread, using 0.70 s of CPU instead of 0.08 s, while the kernel
pool (csrc/threadpool.c, whose workers sleep after ~1024 polls) at 1 or 2
threads made no clear difference.  So each epoch first counts
the cores not busy with other processes and, unless told otherwise, lets BLAS use
at most that many threads (at least one), restoring its setting afterwards.

A model whose own kernels do most of the work (the direct convolutions of a
small CNN, or every Linear under the native GEMM engine, on the kernel pool's
threads) gets one BLAS thread in auto mode: its
products are then small, and an idle OpenBLAS worker busy-waits for the next one
on a core the kernel pool needs.  On 2 free cores an epoch of mnist-cnn took
1.85 s with 2 BLAS threads and 1.23 s with one (mnist-fc, all BLAS: 0.46 s with
2, 0.77 s with 1, so it keeps them).

Knobs, read at every epoch:
  GGMLOPT_BLAS_THREADS=auto (default) as above; =N: exactly N BLAS threads while
  training; =keep: leave BLAS alone.  When OPENBLAS_NUM_THREADS, OMP_NUM_THREADS,
  MKL_NUM_THREADS or BLIS_NUM_THREADS is set (and GGMLOPT_BLAS_THREADS is not),
  BLAS is left alone too: the user chose.  show_config() prints which of these
  decided (blas_config()), and each EpochStats records the BLAS threads used.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from threadpoolctl import (  # type: ignore[import-untyped]
    OpenBLASController,
    ThreadpoolController,
)

__all__ = [
    "blas_config",
    "blas_limit_for_decoding",
    "blas_threads_for_training",
    "blas_threads_setting",
    "choose_blas_threads",
    "current_blas_threads",
    "others_running_recently",
    "work_split",
]

_BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")
# variables that force OpenBLAS's kernel choice (an older kernel is slower)
_KERNEL_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
_controller = None
_controller_modules = 0  # len(sys.modules) when _controller was made


def _usable_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _own_running_threads():
    """Threads of this process that are running or runnable right now."""
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the state follows the ")" that closes the command name
        if stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] == b"R":
            count += 1
    return max(count, 1)


def _others_running(samples=3, interval=0.002):
    """Runnable threads of other processes (Linux: /proc/loadavg's 4th field counts
    every runnable thread now, this process's included); the least of a few
    samples, so that a passing blip does not count; None if unknown."""
    least = None
    for i in range(samples):
        if i:
            time.sleep(interval)
        try:
            with open("/proc/loadavg") as f:
                runnable = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return None
        others = max(runnable - _own_running_threads(), 0)
        least = others if least is None else min(least, others)
    return least


_recent_sample = (float("-inf"), None)   # (time.monotonic() of the sample, its count)


def others_running_recently(max_age=1.0):
    """_others_running(), sampled again only when the last sample is older than
    max_age seconds: cheap enough for every decoding step."""
    global _recent_sample
    now = time.monotonic()
    taken, count = _recent_sample
    if now - taken > max_age:
        count = _others_running()
        _recent_sample = (now, count)
    return count


def choose_blas_threads(current, cpus, others_running, kernel_bound=False):
    """BLAS threads for an epoch: current, cut to the cores the other processes
    leave idle (at least 1); 1 when the model's own kernels do most of its work
    (kernel_bound, see work_split)."""
    if kernel_bound:
        return 1
    if others_running is None:
        return current
    return max(1, min(current, cpus - others_running))


def work_split(model):
    """(BLAS, kernel pool) multiply-adds per datapoint of the forward pass, from
    the layers whose cost is known: Linear (BLAS; the kernel pool under the
    native GEMM engine) and Conv2d after a forward (the kernel pool on its
    direct kernels, else BLAS); other layers count nothing."""
    from . import gemm
    from .nn.conv import Conv2d
    from .nn.linear import Linear
    from .nn.module import modules

    blas = pool = 0
    for m in modules(model):
        if isinstance(m, Linear):
            if gemm.engine() == "native":
                pool += m.in_features * m.out_features
            else:
                blas += m.in_features * m.out_features
        elif isinstance(m, Conv2d) and m._out_shape is not None:
            madds = m.weight.data.size * m._out_shape[2] * m._out_shape[3]
            if m._direct:
                pool += madds
            else:
                blas += madds
    return blas, pool


def _setting_source():
    """Why blas_threads_setting() says what it says: the variable that decided."""
    if os.environ.get("GGMLOPT_BLAS_THREADS", "").strip():
        return f"GGMLOPT_BLAS_THREADS={os.environ['GGMLOPT_BLAS_THREADS']}"
    chosen = [f"{k}={os.environ[k]}" for k in _BLAS_ENV if os.environ.get(k)]
    if chosen:
        return f"{', '.join(chosen)} is set and GGMLOPT_BLAS_THREADS is not"
    return "the default (GGMLOPT_BLAS_THREADS unset)"


def blas_threads_setting():
    """('auto' | 'keep' | int) from the environment; ValueError for a bad value."""
    value = os.environ.get("GGMLOPT_BLAS_THREADS", "").strip().lower()
    if not value:
        return "keep" if any(os.environ.get(k) for k in _BLAS_ENV) else "auto"
    if value in ("auto", "keep"):
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"GGMLOPT_BLAS_THREADS={os.environ['GGMLOPT_BLAS_THREADS']!r}: "
                         "expected 'auto', 'keep' or a number of threads >= 1")
    return n


def _blas():
    """threadpoolctl's controller of the BLAS libraries loaded in this process
    (NumPy's, and SciPy's once it is imported).  Made again when modules were
    imported since the last call, since an import may load another BLAS (SciPy's
    own OpenBLAS): a controller made before it would leave that library
    untouched.  Otherwise the one made before (making one takes milliseconds,
    and generation asks once per token)."""
    global _controller, _controller_modules
    if _controller is None or _controller_modules != len(sys.modules):
        _controller_modules = len(sys.modules)
        _controller = ThreadpoolController().select(user_api="blas")
    return _controller


def current_blas_threads():
    """The threads BLAS uses now (the most of any loaded BLAS library), or None
    when NumPy has no BLAS that threadpoolctl knows."""
    libs = _blas().lib_controllers
    return max(c.num_threads for c in libs) if libs else None


def blas_config():
    """What decides the BLAS threads of training, as show_config() prints it:
    libraries (one dict per loaded BLAS: internal_api, version, architecture (the
    kernel OpenBLAS chose), num_threads, filepath), kernel_env (OPENBLAS_CORETYPE
    and OPENBLAS_L2_SIZE when set), thread_env (the BLAS thread variables that are
    set), setting ('auto' | 'keep' | int, or the error a bad value gives) and
    source (the variable that decided it)."""
    try:
        setting = blas_threads_setting()
    except ValueError as e:
        setting = f"invalid: {e}"
    libs = [{key: c.info().get(key) for key in
             ("internal_api", "version", "architecture", "num_threads", "filepath")}
            for c in _blas().lib_controllers]
    return {
        "libraries": libs,
        "kernel_env": {k: os.environ[k] for k in _KERNEL_ENV if os.environ.get(k)},
        "thread_env": {k: os.environ[k] for k in _BLAS_ENV if os.environ.get(k)},
        "setting": setting,
        "source": _setting_source(),
    }


class _Training:
    """The BLAS limit of the trainings (and decode steps) running now,
    process-wide as the BLAS's threads are: the first sets it, those that start
    while it holds run under it, the last to finish puts the BLAS back (a fit in
    another Python thread that set and restored its own limit took the first's
    from under it, and could leave its own in force for good)."""

    lock = threading.Lock()
    count = 0
    threads: int | None = None
    limiter = None


@contextlib.contextmanager
def blas_threads_for_training(model=None):
    """Within the block BLAS uses the threads GGMLOPT_BLAS_THREADS asks for (see
    the module docstring) for training model; its previous setting comes back
    after.  Yields the BLAS threads in force in the block (None without a BLAS
    that threadpoolctl knows).  Trainings in several Python threads at once
    share the first one's setting."""
    setting = blas_threads_setting()
    with _Training.lock:
        if _Training.count == 0:
            _Training.threads, _Training.limiter = _training_limit(setting, model)
        _Training.count += 1
        threads = _Training.threads
    try:
        yield threads
    finally:
        _release_limit()


def _release_limit() -> None:
    """One holder of the shared limit done: the last puts the BLAS back."""
    with _Training.lock:
        if _Training.count == 0:   # (a forked child let go of its parent's holders)
            return
        _Training.count -= 1
        if _Training.count == 0 and _Training.limiter is not None:
            _let_this_thread_set_limits()   # (maybe not the thread that set it)
            _Training.limiter.restore_original_limits()
            _let_this_thread_set_limits()
            _Training.limiter = None


@contextlib.contextmanager
def blas_limit_for_decoding(want: int | None):
    """Within the block (a decode step) BLAS runs on want threads, the limit
    shared as trainings share theirs: a training running holds its limit (the
    step runs under it), and a training that starts during the step trains
    under the step's until the last of them ends (a step that set and restored
    its own changed the BLAS under a training).  want None: BLAS untouched."""
    with _Training.lock:
        joined = want is not None or _Training.count > 0
        if _Training.count == 0 and want is not None:
            current = current_blas_threads()
            if current is None or want == current:
                _Training.threads, _Training.limiter = current, None
            else:
                _let_this_thread_set_limits()
                _Training.threads, _Training.limiter = want, _blas().limit(limits=want)
        if joined:
            _Training.count += 1
    try:
        yield
    finally:
        if joined:
            _release_limit()


def _forget_in_child() -> None:
    """A forked child: the holders of the limit were the parent's threads (gone
    with the fork; the lock perhaps held by one): the BLAS gets its setting from
    before them back, and the child starts with no holder."""
    _Training.lock = threading.Lock()
    limiter, _Training.limiter = _Training.limiter, None
    _Training.count, _Training.threads = 0, None
    if limiter is not None:
        with contextlib.suppress(Exception):   # (a child's BLAS may refuse: no harm)
            _let_this_thread_set_limits()
            limiter.restore_original_limits()
            _let_this_thread_set_limits()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _let_this_thread_set_limits() -> None:
    """threadpoolctl lets only one Python thread change a process-wide OpenBLAS
    pool (the first to, until its `with` block ends; the others' changes do
    nothing, silently): make the calling thread able to."""
    clear = getattr(OpenBLASController, "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)


def _training_limit(setting, model):
    """(threads in force, the threadpoolctl limiter that set them or None)."""
    current = current_blas_threads()
    if setting == "keep" or current is None:
        return current, None
    if isinstance(setting, int):
        want = setting
    else:
        blas_madds, pool_madds = work_split(model) if model is not None else (0, 0)
        want = choose_blas_threads(current, _usable_cpus(), _others_running(),
                                   kernel_bound=pool_madds > blas_madds)
    if want == current:
        return current, None
    _let_this_thread_set_limits()
    return want, _blas().limit(limits=want)
