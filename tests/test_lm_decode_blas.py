"""The BLAS threads of a decode step: for its few-row products (auto), the cores
other processes leave idle (one when they keep every core busy), GGMLOPT_BLAS_THREADS
obeyed, the previous count always restored."""
import numpy as np
import pytest

from ggmlopt._blas_threads import current_blas_threads
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.models._causal_lm import FEW_ROWS, blas_threads_for_rows


@pytest.fixture
def busy_cores(monkeypatch):
    """Other processes keep every core busy (the sample is not cached)."""
    from ggmlopt import _blas_threads
    monkeypatch.setattr(_blas_threads, "_others_running", lambda: 1000)
    monkeypatch.setattr(_blas_threads, "_recent_sample", (float("-inf"), None))


@pytest.fixture
def two_blas_threads(monkeypatch):
    for k in ("GGMLOPT_BLAS_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
              "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    from threadpoolctl import threadpool_limits

    if current_blas_threads() is None:
        pytest.skip("no BLAS that threadpoolctl knows")
    with threadpool_limits(2, user_api="blas"):
        yield current_blas_threads()


@pytest.mark.parametrize("setting, rows, inside", [
    (None, 1, 1), (None, FEW_ROWS, 1), ("auto", 7, 1), ("keep", 1, "same"),
    (None, FEW_ROWS + 1, "same"), ("3", 1, 3), ("3", 1000, 3)])
def test_threads_inside_and_restored(two_blas_threads, busy_cores, monkeypatch, setting, rows,
                                     inside):
    if setting is not None:
        monkeypatch.setenv("GGMLOPT_BLAS_THREADS", setting)
    before = current_blas_threads()
    with blas_threads_for_rows(rows):
        seen = current_blas_threads()
    assert seen == (before if inside == "same" else inside)
    assert current_blas_threads() == before


def test_restored_after_an_error_and_decode_leaves_blas_alone(two_blas_threads):
    before = current_blas_threads()
    with pytest.raises(RuntimeError), blas_threads_for_rows(1):
        raise RuntimeError("inside")
    assert current_blas_threads() == before
    model = Llama(LlamaConfig(vocab_size=33, dim=16, n_layers=1, n_heads=2, max_seq_len=9))
    cache = model.make_cache(1)
    logits = model.decode(np.array([[1, 2, 3]]), cache)
    assert logits.shape == (1, 3, 33) and current_blas_threads() == before
    with pytest.raises(IndexError):
        model.decode(np.array([[99]]), cache)
    assert current_blas_threads() == before


@pytest.mark.parametrize("others, inside", [(0, 2), (1, 1), (None, 2)])
def test_few_rows_run_on_the_cores_others_leave_idle(two_blas_threads, monkeypatch, others,
                                                     inside):
    """Two usable cores: none busy elsewhere keeps both threads, one busy leaves
    one; an unknown load keeps the count."""
    from ggmlopt import _blas_threads
    monkeypatch.setattr(_blas_threads, "_others_running", lambda: others)
    monkeypatch.setattr(_blas_threads, "_recent_sample", (float("-inf"), None))
    monkeypatch.setattr("ggmlopt.models._causal_lm._usable_cpus", lambda: 2)
    with blas_threads_for_rows(1):
        assert current_blas_threads() == inside
    assert current_blas_threads() == 2


def test_the_load_is_sampled_at_most_once_a_second(monkeypatch):
    from ggmlopt import _blas_threads
    calls = []
    monkeypatch.setattr(_blas_threads, "_others_running", lambda: calls.append(1) or 0)
    monkeypatch.setattr(_blas_threads, "_recent_sample", (float("-inf"), None))
    for _ in range(50):
        assert _blas_threads.others_running_recently() == 0
    assert len(calls) == 1
    assert _blas_threads.others_running_recently(max_age=0.0) == 0 and len(calls) == 2
