"""Reductions: sum, sumsq, mean (double accumulation), argmax per row (ties go to
the last maximal index, as in ggml), count_equal."""
import numpy as np
import pytest

from ggmlopt import kernels

F32 = np.float32


def assert_double_sum(actual, terms):
    """actual is the float64 sum of terms up to double-precision accumulation error."""
    terms = np.asarray(terms, dtype=np.float64)
    expected = float(np.sum(terms))
    bound = 1e-15 * terms.size * float(np.max(np.abs(terms), initial=0.0)) + 1e-300
    assert isinstance(actual, float)
    assert abs(actual - expected) <= bound, (actual, expected, bound)


def test_sum_matches_float64(simd_path, layout, rng, place):
    size, offset = layout
    x = place(rng.standard_normal(size).astype(F32) * F32(1000), offset)
    assert_double_sum(kernels.sum(x), x)


def test_sumsq_matches_float64(simd_path, layout, rng, place):
    size, offset = layout
    x = place(rng.standard_normal(size).astype(F32), offset)
    assert_double_sum(kernels.sumsq(x), x.astype(np.float64) ** 2)


def test_sum_accumulates_in_double(simd_path):
    # 2^24 + many ones: a float32 accumulator would lose every one of them
    x = np.ones(4097, F32)
    x[0] = 2.0 ** 24
    assert kernels.sum(x) == 2.0 ** 24 + 4096
    assert kernels.sumsq(np.full(1001, 0.1, F32)) == pytest.approx(1001 * float(F32(0.1)) ** 2,
                                                                   rel=1e-14)


def test_mean_matches_float64(simd_path, layout, rng, place):
    size, offset = layout
    x = place(rng.standard_normal(size).astype(F32), offset)
    assert kernels.mean(x) == pytest.approx(float(np.mean(x.astype(np.float64))), abs=1e-12)


def test_sums_of_empty_arrays_are_zero(simd_path):
    e = np.zeros(0, F32)
    assert kernels.sum(e) == 0.0
    assert kernels.sumsq(e) == 0.0


def test_sums_of_zeros_and_infinities(simd_path):
    assert kernels.sum(np.zeros(33, F32)) == 0.0
    x = np.zeros(17, F32)
    x[16] = np.inf
    assert kernels.sum(x) == np.inf
    assert kernels.sumsq(-x) == np.inf
    x[3] = -np.inf
    assert np.isnan(kernels.sum(x))


# ---- argmax ------------------------------------------------------------------

def argmax_last(x):
    """Per row: the last index of the maximum, NaN ignored; 0 for an all-NaN row."""
    with np.errstate(invalid="ignore"):
        mx = np.max(np.where(np.isnan(x), -np.inf, x), axis=1, keepdims=True)
    hit = x == mx                        # NaN entries never hit
    last = x.shape[1] - 1 - np.argmax(hit[:, ::-1], axis=1)
    return np.where(hit.any(axis=1), last, 0).astype(np.int32)


ARGMAX_SHAPES = [(1, 1), (3, 1), (2, 2), (5, 3), (4, 7), (3, 8), (3, 9), (2, 15), (2, 16),
                 (3, 17), (2, 31), (2, 33), (3, 1000), (2, 4097), (1, 300_001), (40_000, 9)]
SHAPE_IDS = [f"{r}x{c}" for r, c in ARGMAX_SHAPES]


@pytest.mark.parametrize("shape", ARGMAX_SHAPES, ids=SHAPE_IDS)
def test_argmax_of_distinct_values(simd_path, shape, rng, place):
    x = place(rng.standard_normal(shape).astype(F32), 1 + shape[1] % 3)
    out = kernels.argmax_rows(x)
    assert out.dtype == np.int32 and out.shape == (shape[0],)
    np.testing.assert_array_equal(out, argmax_last(x))
    np.testing.assert_array_equal(out, np.argmax(x, axis=1))


@pytest.mark.parametrize("shape", ARGMAX_SHAPES, ids=SHAPE_IDS)
def test_argmax_ties_go_to_the_last_index(simd_path, shape, rng, place):
    # three values only: most rows hold their maximum several times
    x = place(rng.integers(0, 3, size=shape).astype(F32), 2)
    np.testing.assert_array_equal(kernels.argmax_rows(x), argmax_last(x))


@pytest.mark.parametrize("ncols", [1, 7, 8, 9, 16, 17, 33])
def test_argmax_special_rows(simd_path, ncols):
    x = np.zeros((6, ncols), F32)
    x[0] = -np.inf                       # all -inf: every entry is maximal -> the last
    x[1] = np.nan                        # nothing comparable -> 0
    x[2] = -np.inf
    x[2, 0] = -1e30                      # one finite entry among -inf
    x[3] = 0.0
    x[3, 0] = -0.0                       # -0 == +0: a tie, the last wins
    x[4] = 1.0
    x[4, ncols // 2] = np.inf
    x[5] = 3.0
    x[5, ::2] = np.nan                   # NaN entries are ignored
    expected = [ncols - 1, 0, 0, ncols - 1, ncols // 2,
                ncols - 1 if ncols % 2 == 0 else max(ncols - 2, 0)]
    np.testing.assert_array_equal(kernels.argmax_rows(x), expected)


def test_argmax_writes_into_out(simd_path, rng):
    x = rng.standard_normal((9, 17)).astype(F32)
    out = np.full(9, -5, np.int32)
    assert kernels.argmax_rows(x, out=out) is out
    np.testing.assert_array_equal(out, np.argmax(x, axis=1))


def test_argmax_of_zero_rows_is_empty(simd_path):
    assert kernels.argmax_rows(np.zeros((0, 5), F32)).shape == (0,)


# ---- count_equal --------------------------------------------------------------

def test_count_equal_matches_numpy(simd_path, layout, rng, place):
    size, offset = layout
    a = place(rng.integers(0, 3, size).astype(np.int32), offset)
    b = place(rng.integers(0, 3, size).astype(np.int32), offset)
    assert kernels.count_equal(a, b) == int(np.count_nonzero(a == b))


def test_count_equal_extremes(simd_path):
    a = np.arange(4097, dtype=np.int32)
    assert kernels.count_equal(a, a.copy()) == 4097
    assert kernels.count_equal(a, a + 1) == 0
    assert kernels.count_equal(np.zeros(0, np.int32), np.zeros(0, np.int32)) == 0
    big = np.array([2**31 - 1, -2**31, 0], np.int32)
    assert kernels.count_equal(big, big[::-1].copy()) == 1
