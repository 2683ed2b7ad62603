"""Gradient-buffer helpers: axpy, scale, fill."""
import numpy as np
import pytest

from ggmlopt import kernels

F32 = np.float32


def test_axpy_matches_float64(simd_path, layout, rng, place):
    size, offset = layout
    x = place(rng.standard_normal(size).astype(F32), offset)
    y0 = rng.standard_normal(size).astype(F32)
    y = place(y0, offset)
    kernels.axpy(-0.37, x, y)
    expected = y0.astype(np.float64) + float(F32(-0.37)) * x.astype(np.float64)
    # FMA rounds once, mul+add twice: an ulp of the larger term either way
    scale = np.abs(y0).astype(np.float64) + np.abs(x).astype(np.float64)
    assert np.all(np.abs(y - expected) <= 2e-7 * scale)


def test_axpy_with_x_being_y_doubles_it(simd_path, rng):
    y0 = rng.standard_normal(33).astype(F32)
    y = y0.copy()
    kernels.axpy(1.0, y, y)
    np.testing.assert_array_equal(y, 2 * y0)


def test_scale_matches_float32_product(simd_path, layout, rng, place):
    size, offset = layout
    x0 = rng.standard_normal(size).astype(F32)
    x = place(x0, offset)
    kernels.scale(x, 0.3)
    # one rounding of one product: the same bits on every path
    np.testing.assert_array_equal(x, x0 * F32(0.3))


def test_fill_writes_exactly_the_array(simd_path, layout, place):
    size, offset = layout
    x = place(np.zeros(size, F32), offset)
    base = x.base
    kernels.fill(x, -2.5)
    assert np.all(x == -2.5)
    # the 7s around the view are untouched
    assert np.count_nonzero(base == 7) == base.size - size


@pytest.mark.parametrize("value", [np.inf, -np.inf, 0.0])
def test_fill_special_values(simd_path, value):
    x = np.ones(17, F32)
    kernels.fill(x, value)
    np.testing.assert_array_equal(x, np.full(17, value, F32))


def test_fill_nan(simd_path):
    x = np.ones(9, F32)
    kernels.fill(x, float("nan"))
    assert np.all(np.isnan(x))


def test_empty_arrays_are_fine(simd_path):
    e = np.zeros(0, F32)
    kernels.axpy(1.0, e, e.copy())
    kernels.scale(e, 2.0)
    kernels.fill(e, 1.0)
    assert e.size == 0
