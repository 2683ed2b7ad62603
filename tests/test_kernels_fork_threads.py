"""The thread pool under fork and under a thread count changed while other
threads run kernels (in a subprocess: a hang there times out instead of blocking
the suite)."""
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import multiprocessing as mp
    import os
    import threading

    import numpy as np
    from ggmlopt import kernels

    x = np.ones(1 << 20, np.float32)
    kernels.set_num_threads(2)
    assert kernels.sum(x) == x.size                  # the workers have started

    def child(q):
        q.put(kernels.sum(x))

    # multiprocessing with fork: the children restart their own workers
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=child, args=(q,)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert [q.get(timeout=5) for _ in procs] == [x.size] * 2

    # fork while another thread is inside a kernel (it may hold the pool)
    stop = threading.Event()
    errors = []

    def spin():
        while not stop.is_set():
            if kernels.sum(x) != x.size:
                errors.append("sum")
            kernels.set_num_threads(1 + int(kernels.get_num_threads() == 1))
    t = threading.Thread(target=spin)
    t.start()
    for _ in range(10):
        pid = os.fork()
        if pid == 0:
            os._exit(0 if kernels.sum(x) == x.size else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
    stop.set()
    t.join(30)
    assert not errors
    print("done")
""")


def test_fork_and_thread_count_changes_under_load(subprocess_env):
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=subprocess_env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"



HELD_AT_FORK = textwrap.dedent("""
    import os
    from ggmlopt import _blas_threads, _pool_linger
    with _blas_threads.blas_threads_for_training():
        _pool_linger.hold(0.002)
        pid = os.fork()
        if pid == 0:   # the child: report by exit status only
            ok = _blas_threads._Training.count == 0 and not _pool_linger._holds
            with _blas_threads.blas_threads_for_training():
                pass
            os._exit(0 if ok and _blas_threads._Training.count == 0 else 1)
        _, status = os.waitpid(pid, 0)
        _pool_linger.release(0.002)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert _blas_threads._Training.count == 0 and not _pool_linger._holds
    print("ok")
""")


@pytest.mark.skipif(sys.platform == "win32", reason="no fork on Windows")
def test_a_child_forked_while_another_thread_trains_holds_nothing_of_it():
    """The BLAS limit's holders and the kernel threads' linger holds belong to the
    parent's threads: a child forked while they hold started with them (its own
    fit then never put the BLAS back, and its pool polled for good)."""
    done = subprocess.run([sys.executable, "-c", HELD_AT_FORK], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
