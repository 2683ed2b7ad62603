"""BLAS threads while training: each epoch cuts NumPy's BLAS threads to the cores
other processes leave idle (GGMLOPT_BLAS_THREADS=auto, the default), or to a
given number, or leaves them alone, and restores them after."""
import io
import json
import math

import numpy as np
import pytest
import threadpoolctl  # a required dependency: BLAS thread control works in every install

import ggmlopt as go
from ggmlopt import _blas_threads


@pytest.fixture(autouse=True)
def numpy_engine():
    """These tests count Linear layers as BLAS work: NumPy's engine, whatever
    GGMLOPT_GEMM says (the native engine's case has its own test)."""
    from ggmlopt import gemm

    previous = gemm.use_engine("numpy")
    yield
    gemm.use_engine(previous)


def blas_threads():
    info = threadpoolctl.threadpool_info()
    return max((i["num_threads"] for i in info if i["user_api"] == "blas"), default=None)


@pytest.mark.parametrize("current,cpus,others,want", [
    (2, 2, 0, 2), (2, 2, 1, 1), (2, 2, 9, 1), (8, 16, 4, 8), (16, 16, 4, 12), (4, 4, None, 4),
    (1, 8, 0, 1),
])
def test_choose_blas_threads(current, cpus, others, want):
    assert _blas_threads.choose_blas_threads(current, cpus, others) == want
    # a model whose own kernels do most of the work: one BLAS thread, whatever else
    assert _blas_threads.choose_blas_threads(current, cpus, others, kernel_bound=True) == 1


def test_work_split_counts_blas_and_kernel_pool_layers():
    from ggmlopt.examples.mnist import mnist_cnn, mnist_fc

    assert _blas_threads.work_split(mnist_fc(0)) == (784 * 500 + 500 * 10, 0)
    cnn = mnist_cnn(0)
    blas, pool = _blas_threads.work_split(cnn)
    assert (blas, pool) == (784 * 10, 0)  # the convolutions' sizes come with a forward
    cnn.forward(np.zeros((2, 784), np.float32))
    assert _blas_threads.work_split(cnn) == (784 * 10, 8 * 9 * 28 * 28 + 16 * 8 * 9 * 14 * 14)
    wide = go.nn.Sequential(go.nn.Conv2d(3, 64, 3, padding=1, rng=0))  # im2col + BLAS
    wide.forward(np.zeros((1, 3, 5, 5), np.float32))
    assert _blas_threads.work_split(wide) == (64 * 3 * 9 * 25, 0)


def test_work_split_under_the_native_gemm_engine():
    from ggmlopt import gemm
    from ggmlopt.examples.mnist import mnist_fc

    previous = gemm.use_engine("native")
    try:  # the products run on the kernel pool: one BLAS thread in auto mode
        assert _blas_threads.work_split(mnist_fc(0)) == (0, 784 * 500 + 500 * 10)
    finally:
        gemm.use_engine(previous)


@pytest.mark.parametrize("env,want", [
    ({}, "auto"), ({"GGMLOPT_BLAS_THREADS": "auto"}, "auto"),
    ({"GGMLOPT_BLAS_THREADS": " KEEP "}, "keep"), ({"GGMLOPT_BLAS_THREADS": "3"}, 3),
    ({"OPENBLAS_NUM_THREADS": "1"}, "keep"), ({"OMP_NUM_THREADS": "2"}, "keep"),
    ({"OMP_NUM_THREADS": "2", "GGMLOPT_BLAS_THREADS": "auto"}, "auto"),
])
def test_the_setting_comes_from_the_environment(monkeypatch, env, want):
    for key in ("GGMLOPT_BLAS_THREADS",) + _blas_threads._BLAS_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert _blas_threads.blas_threads_setting() == want


@pytest.mark.parametrize("value", ["0", "-2", "many", "1.5"])
def test_a_bad_setting_stops_fit_before_it_starts(monkeypatch, value):
    monkeypatch.setenv("GGMLOPT_BLAS_THREADS", value)
    model = go.nn.Linear(3, 2, rng=0)
    before = model.weight.data.copy()
    ds = go.Dataset.from_arrays(np.zeros((4, 3), np.float32), np.zeros(4, np.int32))
    with pytest.raises(ValueError, match=f"GGMLOPT_BLAS_THREADS={value!r}: expected 'auto'"):
        go.fit(model, ds, go.LossType.CROSS_ENTROPY, silent=True)
    np.testing.assert_array_equal(model.weight.data, before)


def _threads_during_an_epoch(monkeypatch, env, others):
    monkeypatch.setenv("GGMLOPT_BLAS_THREADS", env)
    monkeypatch.setattr(_blas_threads, "_others_running", lambda: others)
    seen = []
    model = go.nn.Sequential(go.nn.Linear(3, 4, rng=0), go.nn.Linear(4, 2, rng=1))
    ctx = go.OptContext(model, 2, 3, loss_type=go.LossType.CROSS_ENTROPY, class_labels=True)
    ds = go.Dataset.from_arrays(np.ones((4, 3)), np.array([0, 1, 1, 0]))
    go.epoch(ctx, ds, go.Result(), None, -1, lambda *a: seen.append(blas_threads()))
    return seen


def test_an_epoch_on_busy_cores_uses_fewer_blas_threads(monkeypatch):
    before = blas_threads()
    if before is None or before < 2:
        pytest.skip("NumPy's BLAS runs one thread here: nothing to cut")
    assert _threads_during_an_epoch(monkeypatch, "auto", 1000) == [1, 1]
    assert blas_threads() == before  # restored
    assert _threads_during_an_epoch(monkeypatch, "auto", 0) == [before, before]
    assert _threads_during_an_epoch(monkeypatch, "keep", 1000) == [before, before]
    assert _threads_during_an_epoch(monkeypatch, "1", 0) == [1, 1]
    assert blas_threads() == before


def test_a_kernel_bound_model_trains_with_one_blas_thread(monkeypatch):
    before = blas_threads()
    if before is None or before < 2:
        pytest.skip("NumPy's BLAS runs one thread here: nothing to cut")
    monkeypatch.setenv("GGMLOPT_BLAS_THREADS", "auto")
    monkeypatch.setattr(_blas_threads, "_others_running", lambda: 0)
    seen = []
    model = go.nn.Sequential(go.nn.Reshape((1, 6, 6)), go.nn.Conv2d(1, 4, 3, padding=1, rng=0),
                             go.nn.ReLU(), go.nn.Flatten(), go.nn.Linear(144, 2, rng=1))
    ctx = go.OptContext(model, 2, 36, loss_type=go.LossType.CROSS_ENTROPY, class_labels=True)
    ds = go.Dataset.from_arrays(np.ones((4, 36)), np.array([0, 1, 1, 0]))
    go.epoch(ctx, ds, go.Result(), None, -1, lambda *a: seen.append(blas_threads()))
    assert seen == [1, 1]
    assert blas_threads() == before


def test_others_running_reads_the_run_queue():
    others = _blas_threads._others_running()
    assert others is None or others >= 0
    assert _blas_threads._own_running_threads() >= 1  # this thread runs


def _clean_env(monkeypatch, **env):
    for key in ("GGMLOPT_BLAS_THREADS",) + _blas_threads._BLAS_ENV + _blas_threads._KERNEL_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def _config_text():
    out = io.StringIO()
    go.show_config(out)
    return out.getvalue()


def test_show_config_reports_the_blas_library_kernel_and_threads(monkeypatch):
    _clean_env(monkeypatch)
    lib = next(i for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas")
    text = _config_text()
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("BLAS   "))
    assert lib["internal_api"] in line and lib["version"] in line
    assert f"threads={blas_threads()}" in line
    if lib.get("architecture"):
        assert f"kernel {lib['architecture']}" in line
    assert "OPENBLAS_CORETYPE unset" in text
    assert "auto: each epoch cuts BLAS" in text and "GGMLOPT_BLAS_THREADS unset" in text


@pytest.mark.parametrize("env,says", [
    ({"OPENBLAS_NUM_THREADS": "1"}, ("keep: BLAS keeps its own threads while training; from "
                                     "OPENBLAS_NUM_THREADS=1 is set and GGMLOPT_BLAS_THREADS is not")),
    ({"OMP_NUM_THREADS": "2"}, "from OMP_NUM_THREADS=2 is set"),
    ({"OMP_NUM_THREADS": "2", "GGMLOPT_BLAS_THREADS": "3"},
     "3 BLAS threads while training; from GGMLOPT_BLAS_THREADS=3"),
    ({"GGMLOPT_BLAS_THREADS": "many"}, "invalid: GGMLOPT_BLAS_THREADS='many'"),
    ({"OPENBLAS_CORETYPE": "Haswell"}, "BLAS kernel forced  : OPENBLAS_CORETYPE=Haswell"),
])
def test_show_config_says_which_variable_decides_the_blas_threads(monkeypatch, env, says):
    # a thread variable set for BLAS changes ggmlopt's policy: it must show
    _clean_env(monkeypatch, **env)
    assert says in _config_text()


def _fit_blas_threads(monkeypatch, env, **fit_args):
    _clean_env(monkeypatch, **env)
    model = go.nn.Sequential(go.nn.Linear(3, 4, rng=0), go.nn.Linear(4, 2, rng=1))
    ds = go.Dataset.from_arrays(np.ones((8, 3)), np.array([0, 1, 1, 0] * 2))
    history = go.fit(model, ds, go.LossType.CROSS_ENTROPY, nepoch=2, nbatch_logical=4,
                     nbatch_physical=2, silent=True, **fit_args)
    return [e.blas_threads for e in history]


def test_each_epoch_records_the_blas_threads_it_used(monkeypatch, tmp_path):
    before = blas_threads()
    assert _fit_blas_threads(monkeypatch, {"GGMLOPT_BLAS_THREADS": "1"}) == [1, 1]
    assert _fit_blas_threads(monkeypatch, {"GGMLOPT_BLAS_THREADS": "keep"}) == [before] * 2
    # a resumed fit keeps the threads of the epochs it did not run again
    ckpt = str(tmp_path / "run.npz")
    first = _fit_blas_threads(monkeypatch, {"GGMLOPT_BLAS_THREADS": "1"}, checkpoint=ckpt)
    again = _fit_blas_threads(monkeypatch, {"GGMLOPT_BLAS_THREADS": "keep"}, checkpoint=ckpt,
                              resume=True)
    assert first == again == [1, 1]


def test_history_rows_of_older_checkpoints_have_no_blas_threads():
    row = (3, 0.5, 0.1, 0.9, 0.01) + (math.nan,) * 4 + (1.25,)
    stats = go.EpochStats.from_row(row)
    assert stats.epoch == 3 and stats.seconds == 1.25 and stats.blas_threads is None
    assert go.EpochStats.from_row(row + (2.0,)).blas_threads == 2


def test_a_blas_loaded_after_the_first_epoch_is_limited_too():
    # SciPy brings its own OpenBLAS; imported after ggmlopt first looked at the BLAS
    # libraries, an epoch on busy cores must still cut every one of them
    pytest.importorskip("scipy.linalg")
    code = """
import sys
import numpy as np, threadpoolctl
import ggmlopt as go
from ggmlopt import _blas_threads
_blas_threads.current_blas_threads()        # the controller is made here, before SciPy
import scipy.linalg                          # noqa: F401  (loads SciPy's OpenBLAS)
libs = [i for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
if len(libs) < 2 or min(i["num_threads"] for i in libs) < 2:
    print("skip"); sys.exit(0)
_blas_threads._others_running = lambda: 1000
seen = []
def record(*a):
    seen.append(sorted(i["num_threads"] for i in threadpoolctl.threadpool_info()
                       if i["user_api"] == "blas"))
model = go.nn.Sequential(go.nn.Linear(3, 4, rng=0), go.nn.Linear(4, 2, rng=1))
ctx = go.OptContext(model, 2, 3, loss_type=go.LossType.CROSS_ENTROPY, class_labels=True)
ds = go.Dataset.from_arrays(np.ones((4, 3)), np.array([0, 1, 1, 0]))
go.epoch(ctx, ds, go.Result(), None, -1, record)
import json; print(json.dumps(seen))
"""
    import subprocess
    import sys
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in _blas_threads._BLAS_ENV + ("GGMLOPT_BLAS_THREADS",)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    if proc.stdout.strip() == "skip":
        pytest.skip("one BLAS library, or one already on a single thread")
    seen = json.loads(proc.stdout.strip())
    assert seen and all(all(n == 1 for n in libs) and len(libs) >= 2 for libs in seen), seen


def test_trainings_in_two_threads_share_one_limit_and_restore_it(monkeypatch):
    # the BLAS's threads are the process's: a fit that started second found the
    # first's limit in force and set none; the first, finishing, put the BLAS back
    # under the second, which trained on with threads it did not record
    import threading
    before = blas_threads()
    if before is None or before < 2:
        pytest.skip("NumPy's BLAS runs one thread here: nothing to cut")
    monkeypatch.setenv("GGMLOPT_BLAS_THREADS", "1")

    def openblas_threads():   # the process-wide pool (MKL's over OpenMP is per thread)
        return max((i["num_threads"] for i in threadpoolctl.threadpool_info()
                    if i["internal_api"] == "openblas"), default=1)

    seen = []
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with _blas_threads.blas_threads_for_training() as threads:
            seen.append(("first", threads, openblas_threads()))
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second():
        first_in.wait(5)
        with _blas_threads.blas_threads_for_training() as threads:
            second_in.set()
            first_out.wait(5)     # trains on after the first has finished
            seen.append(("second", threads, openblas_threads()))

    workers = [threading.Thread(target=first), threading.Thread(target=second)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert [(t, n) for _, t, n in seen] == [(1, 1), (1, 1)], seen
    assert blas_threads() == before


def test_a_decode_step_and_a_training_share_one_limit(monkeypatch):
    """A decode step set and restored its own BLAS limit under a training
    running in another thread (the epoch recorded 1 thread, BLAS ran on 2);
    both now hold one shared limit, and the last to end puts the BLAS back."""
    from ggmlopt._blas_threads import (
        blas_limit_for_decoding,
        blas_threads_for_training,
        current_blas_threads,
    )
    start = current_blas_threads()
    if start is None or start < 2:
        pytest.skip("a BLAS of one thread has no limit to share")
    monkeypatch.setenv("GGMLOPT_BLAS_THREADS", "1")
    decoding = blas_limit_for_decoding(1)
    decoding.__enter__()
    assert current_blas_threads() == 1
    with blas_threads_for_training() as recorded:
        assert recorded == 1
        decoding.__exit__(None, None, None)   # the step ends while the training runs
        assert current_blas_threads() == 1
        with blas_limit_for_decoding(1):       # a step during the training: under it
            assert current_blas_threads() == 1
        assert current_blas_threads() == 1
    assert current_blas_threads() == start
