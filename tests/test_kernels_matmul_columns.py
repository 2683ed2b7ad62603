"""kernels_gemm.matmul_columns: a few rows times a float32 weight stored (in,
out), as a Linear keeps it (decoding's product): within float32 rounding of a
float64 product on awkward sizes (inner lengths around the 64-row chunks, output
widths around a vector, one of each, a column range of a wider weight), on
every SIMD path; the same bits on 1 and 2 threads; empty operands; bad operands
refused by name with out untouched."""
import numpy as np
import pytest
from product_bounds import assert_product_close

from ggmlopt import kernels
from ggmlopt.kernels_gemm import matmul_columns


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 7, 33, 63, 64, 65, 129, 577])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 130])
def test_within_float32_rounding_of_float64(simd_path, m, k, n):
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    wide = rng.standard_normal((k, n + 9)).astype(np.float32)
    for w in (wide[:, :n], wide[:, 5:5 + n], np.ascontiguousarray(wide[:, :n])):
        out = np.full((m, n), np.nan, np.float32)
        assert matmul_columns(x, w, out) is out
        assert_product_close(out, x.astype(np.float64), w.astype(np.float64))


def test_rows_of_x_and_out_apart_in_wider_arrays():
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((3, 70)).astype(np.float32)
    w = rng.standard_normal((64, 20)).astype(np.float32)
    outs = np.full((3, 25), 7.0, np.float32)
    matmul_columns(xs[:, 3:67], w, outs[:, 2:22])
    assert_product_close(outs[:, 2:22], xs[:, 3:67].astype(np.float64), w.astype(np.float64))
    assert (outs[:, :2] == 7).all() and (outs[:, 22:] == 7).all()


def test_the_same_bits_on_any_number_of_threads():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 1536)).astype(np.float32)
    w = rng.standard_normal((1536, 576)).astype(np.float32)
    before = kernels.get_num_threads()
    try:
        got = []
        for threads in (1, 2, 3):
            kernels.set_num_threads(threads)
            got.append(matmul_columns(x, w, np.empty((2, 576), np.float32)))
    finally:
        kernels.set_num_threads(before)
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[0], got[2])


@pytest.mark.parametrize("m, k, n", [(0, 5, 4), (3, 0, 4), (3, 5, 0)])
def test_empty_operands(m, k, n):
    out = np.full((m, n), np.nan, np.float32)
    matmul_columns(np.ones((m, k), np.float32), np.ones((k, n), np.float32), out)
    assert (out == 0).all()


def test_bad_operands_are_refused_by_name():
    x, w = np.ones((2, 4), np.float32), np.ones((4, 3), np.float32)
    out = np.full((2, 3), 5.0, np.float32)
    cases = [
        ((x.astype(np.float64), w, out), TypeError, "x: expected dtype float32"),
        ((x, [[1.0]], out), TypeError, "w: expected a numpy.ndarray"),
        ((x, w, np.ones(6, np.float32)), ValueError, "out: expected a 2-D array"),
        ((x, np.ones((5, 3), np.float32), out), ValueError, "out: shapes"),
        ((x, np.asfortranarray(np.ones((4, 3), np.float32)), out), ValueError,
         "w: expected rows of contiguous"),
        ((x, w, np.ones((3, 2), np.float32).T), ValueError, "out: expected rows of contiguous"),
        ((x, w, np.lib.stride_tricks.as_strided(out, strides=(12, 0))), ValueError,
         "out: expected rows of contiguous"),
    ]
    for args, kind, message in cases:
        with pytest.raises(kind, match=message):
            matmul_columns(*args)
    assert (out == 5).all()
    ro = out.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        matmul_columns(x, w, ro)
    shared = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match="overlap"):
        matmul_columns(shared[:2], shared[:, :2], shared[2:, :2])
