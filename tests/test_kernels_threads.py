"""Threads: large calls split into blocks whose boundaries depend only on the
problem size, so every result, reductions included, is bit-identical whatever
the number of threads."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ggmlopt import kernels

F32 = np.float32
BIG = 300_001
THREADS = [1, 2, 3]


def run_with_threads(fn):
    """fn() under each thread count in THREADS; the list of its results."""
    results = []
    for n in THREADS:
        kernels.set_num_threads(n)
        assert kernels.get_num_threads() == n
        results.append(fn())
    return results


def as_bytes(result):
    """The exact bytes of a result (a number, an array or a tuple of them)."""
    parts = result if isinstance(result, tuple) else (result,)
    return b"".join(np.asarray(p).tobytes() for p in parts)


def assert_all_identical(results):
    assert all(as_bytes(r) == as_bytes(results[0]) for r in results[1:])


@pytest.fixture
def big(rng):
    return {
        "w": rng.standard_normal(BIG).astype(F32),
        "g": rng.standard_normal(BIG).astype(F32),
        "x": (rng.standard_normal(BIG) * 1e3).astype(F32),
        "ints": rng.integers(0, 3, BIG).astype(np.int32),
        "ints2": rng.integers(0, 3, BIG).astype(np.int32),
        "logits": rng.standard_normal((30_000, 10)).astype(F32),
        "labels": rng.random((30_000, 10)).astype(F32),
        "u8": rng.integers(0, 256, (700, 784), dtype=np.uint8),
    }


def test_reductions_are_bit_identical_across_thread_counts(simd_path, restore_threads, big):
    assert_all_identical(run_with_threads(lambda: kernels.sum(big["x"])))
    assert_all_identical(run_with_threads(lambda: kernels.sumsq(big["x"])))
    assert_all_identical(run_with_threads(lambda: kernels.count_equal(big["ints"], big["ints2"])))

    def ce():
        grad = np.empty_like(big["logits"])
        return kernels.cross_entropy(big["logits"], big["labels"], grad), grad
    assert_all_identical(run_with_threads(ce))

    def se():
        grad = np.empty_like(big["x"])
        return kernels.squared_error(big["x"], big["w"], grad, grad_scale=0.5), grad
    assert_all_identical(run_with_threads(se))
    # and they are right, not only stable
    assert kernels.count_equal(big["ints"], big["ints2"]) == np.count_nonzero(
        big["ints"] == big["ints2"])
    assert kernels.sum(big["x"]) == pytest.approx(np.sum(big["x"], dtype=np.float64), rel=1e-12)


def test_elementwise_kernels_agree_across_thread_counts(simd_path, restore_threads, big):
    def adamw():
        w, m, v = big["w"].copy(), np.zeros(BIG, F32), np.zeros(BIG, F32)
        for t in (1, 2):
            b1h, b2h = kernels.adamw_bias_corrections(0.9, 0.999, t)
            kernels.adamw_step(w, big["g"], m, v, alpha=1e-2, beta1=0.9, beta2=0.999,
                               eps=1e-8, wd=0.1, beta1h=b1h, beta2h=b2h)
        return w, m, v
    assert_all_identical(run_with_threads(adamw))

    def sgd():
        w = big["w"].copy()
        kernels.sgd_step(w, big["g"], alpha=0.1, wd=0.01)
        return w
    assert_all_identical(run_with_threads(sgd))

    def axpy_scale_fill():
        y = big["w"].copy()
        kernels.axpy(0.5, big["g"], y)
        kernels.scale(y, 3.0)
        z = np.empty(BIG, F32)
        kernels.fill(z, 2.0)
        return y, z
    assert_all_identical(run_with_threads(axpy_scale_fill))

    assert_all_identical(run_with_threads(
        lambda: kernels.argmax_rows(big["logits"])))
    assert_all_identical(run_with_threads(
        lambda: kernels.to_float32(big["u8"], scale=1 / 255)))

    def gather():
        perm = np.arange(699, -1, -1, dtype=np.int64)
        raw = np.empty_like(big["u8"])
        conv = np.empty(big["u8"].shape, F32)
        kernels.gather_shards(big["u8"], raw, perm)
        kernels.gather_shards(big["u8"], conv, perm, scale=0.5)
        return raw, conv
    results = run_with_threads(gather)
    assert_all_identical(results)
    np.testing.assert_array_equal(results[0][0], big["u8"][::-1])


def test_thread_count_is_clamped_and_restored(restore_threads):
    kernels.set_num_threads(1000)
    assert kernels.get_num_threads() == 64
    kernels.set_num_threads(1)
    assert kernels.get_num_threads() == 1


def test_changing_the_thread_count_between_calls_never_hangs(subprocess_env):
    # Workers restart after every change; a worker that starts late must still
    # take the task posted right after its creation (a lost task hangs the caller).
    script = textwrap.dedent("""
        import numpy as np
        from ggmlopt import kernels
        x = np.ones(300_001, np.float32)
        for i in range(40):
            kernels.set_num_threads(1 + i % 3)
            assert kernels.sum(x) == 300_001.0
            kernels.set_num_threads(2)
            assert kernels.sum(x) == 300_001.0
        print("done")
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=subprocess_env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"


def test_kernels_work_from_several_python_threads(restore_threads, big):
    # callers that find the pool busy run their blocks themselves: same answers
    import threading
    kernels.set_num_threads(2)
    expected = kernels.sum(big["x"])
    results = []

    def worker():
        for _ in range(20):
            results.append(kernels.sum(big["x"]))
    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 60
    assert all(r == expected for r in results)
