"""Reductions: sum, sum of squares, argmax per row and count-equal against the
NumPy call a user would write instead."""
import numpy as np
import pytest
from conftest import measure

from ggmlopt import kernels

SIZES = [1_000, 100_000, 10_000_000]
ARGMAX_SHAPES = [(500, 10), (64, 32000), (100_000, 10), (1000, 10_000)]


def size_name(n):
    return f"{n:.0e}".replace("e+0", "e")


@pytest.fixture(scope="module")
def floats():
    rng = np.random.default_rng(7)
    return {n: rng.standard_normal(n, dtype=np.float32) for n in SIZES}


@pytest.fixture(scope="module")
def int_pairs():
    rng = np.random.default_rng(8)
    pairs = {}
    for n in SIZES:
        a = rng.integers(0, 10, n, dtype=np.int32)
        b = np.where(rng.random(n) < 0.5, a, rng.integers(0, 10, n, dtype=np.int32))
        pairs[n] = (a, b.astype(np.int32))
    return pairs


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("side", ["ggmlopt", "numpy"])
def test_sum(benchmark, n, side, floats):
    x = floats[n]
    case = f"sum n={size_name(n)}"
    if side == "ggmlopt":
        measure(benchmark, lambda: kernels.sum(x), case=case, role="ggmlopt",
                label="ggmlopt.sum", items=n, bytes_moved=4 * n)
    else:
        measure(benchmark, lambda: np.sum(x), case=case, role="baseline", label="np.sum",
                target=1.0, items=n, bytes_moved=4 * n)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("side", ["ggmlopt", "numpy"])
def test_sumsq(benchmark, n, side, floats):
    """No target in the issue: shown for scale against BLAS's float32 dot."""
    x = floats[n]
    case = f"sumsq n={size_name(n)}"
    if side == "ggmlopt":
        measure(benchmark, lambda: kernels.sumsq(x), case=case, role="ggmlopt",
                label="ggmlopt.sumsq", items=n, bytes_moved=4 * n)
    else:
        measure(benchmark, lambda: np.dot(x, x), case=case, role="baseline",
                label="np.dot(x, x)", items=n, bytes_moved=4 * n)


@pytest.mark.parametrize("shape", ARGMAX_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("side", ["ggmlopt", "numpy"])
def test_argmax_rows(benchmark, shape, side):
    x = np.random.default_rng(9).standard_normal(shape, dtype=np.float32)
    case = f"argmax_rows {shape[0]}x{shape[1]}"
    if side == "ggmlopt":
        out = np.empty(shape[0], np.int32)
        measure(benchmark, lambda: kernels.argmax_rows(x, out=out), case=case, role="ggmlopt",
                label="ggmlopt.argmax_rows(out=)", items=x.size, bytes_moved=4 * x.size)
    else:
        out = np.empty(shape[0], np.intp)
        measure(benchmark, lambda: np.argmax(x, axis=1, out=out), case=case, role="baseline",
                label="np.argmax(axis=1, out=)", target=1.0, items=x.size,
                bytes_moved=4 * x.size)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("side", ["ggmlopt", "numpy"])
def test_count_equal(benchmark, n, side, int_pairs):
    a, b = int_pairs[n]
    case = f"count_equal n={size_name(n)}"
    if side == "ggmlopt":
        measure(benchmark, lambda: kernels.count_equal(a, b), case=case, role="ggmlopt",
                label="ggmlopt.count_equal", items=n, bytes_moved=8 * n)
    else:
        measure(benchmark, lambda: np.count_nonzero(a == b), case=case, role="baseline",
                label="np.count_nonzero(a == b)", target=1.0, items=n, bytes_moved=8 * n)


def test_baselines_agree_with_kernels(floats, int_pairs):
    """Each baseline computes what its kernel does (else the comparison is moot)."""
    x = floats[100_000]
    assert kernels.sum(x) == pytest.approx(float(np.sum(x, dtype=np.float64)), rel=1e-9)
    assert kernels.sumsq(x) == pytest.approx(float(np.dot(x.astype(np.float64), x)), rel=1e-9)
    m = np.random.default_rng(3).standard_normal((64, 1000), dtype=np.float32)
    np.testing.assert_array_equal(kernels.argmax_rows(m), np.argmax(m, axis=1))
    a, b = int_pairs[100_000]
    assert kernels.count_equal(a, b) == np.count_nonzero(a == b)
