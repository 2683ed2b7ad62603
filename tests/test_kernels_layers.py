"""Layer helpers: bias add over rows, ReLU and its backward pass."""
import numpy as np
import pytest

from ggmlopt import kernels

F32 = np.float32


@pytest.mark.parametrize("ncols", [1, 7, 8, 9, 17, 500])
@pytest.mark.parametrize("nrows", [1, 3, 64])
def test_add_bias_rows_matches_numpy(simd_path, rng, nrows, ncols):
    x0 = rng.standard_normal((nrows, ncols)).astype(F32)
    bias = rng.standard_normal(ncols).astype(F32)
    x = x0.copy()
    kernels.add_bias_rows(x, bias)
    # one float addition per element: the same bits as NumPy's broadcast add
    np.testing.assert_array_equal(x, x0 + bias)


def test_add_bias_rows_large_uses_threads_and_matches(simd_path, rng, restore_threads):
    x0 = rng.standard_normal((700, 500)).astype(F32)
    bias = rng.standard_normal(500).astype(F32)
    for threads in (1, 2):
        kernels.set_num_threads(threads)
        x = x0.copy()
        kernels.add_bias_rows(x, bias)
        np.testing.assert_array_equal(x, x0 + bias)


def test_relu_matches_ggml_rule(simd_path, layout, rng, place):
    size, offset = layout
    x0 = rng.standard_normal(size).astype(F32)
    x0[::5] = 0.0
    x0[1::7] = -0.0
    x0[2::11] = np.nan
    x = place(x0, offset)
    y = kernels.relu(x)
    # x > 0 ? x : 0 with NaN kept (as torch), -0 giving +0
    expected = np.where((x0 > 0) | np.isnan(x0), x0, F32(0))
    np.testing.assert_array_equal(y, expected)
    assert not np.signbit(y[~np.isnan(y)]).any()
    np.testing.assert_array_equal(x, x0)  # the input is untouched


def test_relu_in_place(simd_path, rng):
    x = rng.standard_normal(1000).astype(F32)
    expected = np.maximum(x, 0)
    assert kernels.relu(x, out=x) is x
    np.testing.assert_array_equal(x, expected)


def test_relu_backward_passes_gradient_where_output_positive(simd_path, layout, rng, place):
    size, offset = layout
    y0 = np.maximum(rng.standard_normal(size).astype(F32), 0)
    g0 = rng.standard_normal(size).astype(F32)
    y, g = place(y0, offset), place(g0, offset)
    out = kernels.relu_backward(y, g)
    np.testing.assert_array_equal(out, np.where(y0 > 0, g0, F32(0)))
    # into g itself
    kernels.relu_backward(y, g, out=g)
    np.testing.assert_array_equal(g, np.where(y0 > 0, g0, F32(0)))


@pytest.mark.parametrize("call, exc, match", [
    (lambda: kernels.add_bias_rows(np.zeros(4, F32), np.zeros(4, F32)), ValueError, "^x: "),
    (lambda: kernels.add_bias_rows(np.zeros((2, 4), F32), np.zeros(3, F32)), ValueError,
     "^bias: "),
    (lambda: kernels.add_bias_rows(np.zeros((2, 4), np.float64), np.zeros(4, F32)), TypeError,
     "^x: "),
    (lambda: kernels.relu(np.zeros(4, F32), out=np.zeros(5, F32)), ValueError, "^out: "),
    (lambda: kernels.relu(np.zeros(4, np.int32)), TypeError, "^x: "),
    (lambda: kernels.relu_backward(np.zeros(4, F32), np.zeros(3, F32)), ValueError, "^g: "),
])
def test_layer_helpers_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_relu_backward_refuses_out_overlapping_y():
    y = np.ones(8, F32)
    with pytest.raises(ValueError, match="overlap"):
        kernels.relu_backward(y, np.ones(8, F32), out=y)


def test_add_bias_rows_refuses_bias_inside_x():
    x = np.zeros((2, 4), F32)
    with pytest.raises(ValueError, match="overlap"):
        kernels.add_bias_rows(x, x[0])
    np.testing.assert_array_equal(x, 0)
