"""The convolution and pooling kernels: im2col, col2im, the plane bias add, max
and average pooling, against float64 NumPy references on every SIMD path."""
import numpy as np
import pytest
from conv_reference import avgpool2d, im2col, maxpool2d, out_size

from ggmlopt import kernels

F32 = np.float32

# (n, c, h, w, kernel, stride, padding): batch 1, odd channels, stride 2,
# rectangular kernels/strides/paddings, rows shorter and longer than a vector
GEOMETRIES = [
    (1, 1, 1, 1, (1, 1), (1, 1), (0, 0)),
    (1, 1, 3, 3, (3, 3), (1, 1), (0, 0)),
    (2, 1, 28, 28, (3, 3), (1, 1), (1, 1)),
    (3, 3, 7, 9, (3, 3), (1, 1), (1, 1)),
    (1, 5, 13, 17, (3, 2), (2, 1), (1, 2)),
    (2, 3, 9, 11, (5, 5), (2, 2), (2, 2)),
    (1, 2, 8, 33, (2, 4), (3, 2), (0, 3)),
    (2, 1, 4, 5, (4, 4), (1, 3), (3, 3)),
    (1, 3, 19, 40, (1, 3), (1, 1), (0, 1)),
]
GEOMETRY_IDS = ["x".join(map(str, g[:4])) + f"-k{g[4]}-s{g[5]}-p{g[6]}" for g in GEOMETRIES]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
def test_im2col_matches_reference(simd_path, rng, geometry):
    n, c, h, w, kernel, stride, padding = geometry
    x = rng.standard_normal((n, c, h, w)).astype(F32)
    col = kernels.im2col(x, kernel, stride, padding)
    # a copy: the same bits
    np.testing.assert_array_equal(col, im2col(x, kernel, stride, padding).astype(F32))
    batch = kernels.im2col(x, kernel, stride, padding, batch_matrix=True)
    np.testing.assert_array_equal(batch, np.concatenate(list(col), axis=1))


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
def test_col2im_is_the_adjoint_of_im2col(simd_path, rng, geometry):
    n, c, h, w, kernel, stride, padding = geometry
    x = rng.standard_normal((n, c, h, w))
    col = rng.standard_normal(im2col(x, kernel, stride, padding).shape)
    dx = kernels.col2im(col.astype(F32), x.shape, kernel, stride, padding)
    # each dx element is the sum of the col entries im2col copied it to: the
    # transpose of the 0/1 matrix of im2col, applied to col (float64)
    positions = np.arange(x.size, dtype=np.float64).reshape(x.shape) + 1
    where = im2col(positions, kernel, stride, padding).astype(np.int64) - 1
    want = np.zeros(x.size)
    np.add.at(want, where[where >= 0], col.astype(F32).astype(np.float64)[where >= 0])
    scale = np.zeros(x.size)
    np.add.at(scale, where[where >= 0], np.abs(col[where >= 0]))
    assert np.all(np.abs(dx.reshape(-1) - want) <= 1e-6 * scale + 1e-30)
    # the batch-matrix layout gives the same sums
    batch = np.ascontiguousarray(np.concatenate(list(col.astype(F32)), axis=1))
    dxb = kernels.col2im(batch, x.shape, kernel, stride, padding, batch_matrix=True)
    np.testing.assert_array_equal(dxb, dx)


def test_col2im_overwrites_out(rng):
    x_shape = (2, 3, 6, 5)
    col = rng.standard_normal((2, 27, 30)).astype(F32)
    first = kernels.col2im(col, x_shape, 3, 1, 1)
    out = np.full(x_shape, np.nan, dtype=F32)
    assert kernels.col2im(col, x_shape, 3, 1, 1, out=out) is out
    np.testing.assert_array_equal(out, first)


@pytest.mark.parametrize("plane", [1, 7, 8, 9, 33, 196])
def test_add_bias_planes(simd_path, rng, plane):
    x0 = rng.standard_normal((3, 5, plane)).astype(F32)
    bias = rng.standard_normal(5).astype(F32)
    x = x0.copy()
    kernels.add_bias_planes(x, bias)
    np.testing.assert_array_equal(x, x0 + bias[None, :, None])


POOLS = [
    (1, 1, 2, 2, (2, 2), None),
    (2, 3, 28, 28, (2, 2), None),
    (1, 5, 7, 9, (2, 2), None),  # remainders dropped
    (2, 1, 9, 10, (3, 3), (2, 2)),  # overlapping windows
    (1, 2, 8, 11, (3, 2), (1, 3)),  # rectangular
    (1, 1, 5, 21, (1, 12), (1, 9)),  # windows wider than a vector
]
POOL_IDS = ["x".join(map(str, p[:4])) + f"-k{p[4]}-s{p[5]}" for p in POOLS]


@pytest.mark.parametrize("pool", POOLS, ids=POOL_IDS)
def test_maxpool2d_matches_reference(simd_path, rng, pool):
    n, c, h, w, kernel, stride = pool
    x = rng.standard_normal((n, c, h, w)).astype(F32)
    y, idx = kernels.maxpool2d(x, kernel, stride)
    st = kernel if stride is None else stride
    np.testing.assert_array_equal(y, maxpool2d(x, kernel, st).astype(F32))
    # the index points at the maximum
    flat = x.reshape(n, c, -1)
    np.testing.assert_array_equal(np.take_along_axis(flat, idx.reshape(n, c, -1), 2),
                                  y.reshape(n, c, -1))


@pytest.mark.parametrize("pool", POOLS, ids=POOL_IDS)
def test_maxpool2d_backward_sends_gradient_to_the_maximum(simd_path, rng, pool):
    n, c, h, w, kernel, stride = pool
    x = rng.standard_normal((n, c, h, w)).astype(F32)
    y, idx = kernels.maxpool2d(x, kernel, stride)
    g = rng.standard_normal(y.shape).astype(F32)
    dx = kernels.maxpool2d_backward(g, idx, x.shape, kernel, stride)
    want = np.zeros((n * c, h * w))
    for p in range(n * c):
        np.add.at(want[p], idx.reshape(n * c, -1)[p], g.reshape(n * c, -1)[p].astype(np.float64))
    np.testing.assert_allclose(dx.reshape(n * c, -1), want, rtol=1e-6, atol=1e-7)


def test_maxpool2d_ties_go_to_the_first_position_and_nan_wins(simd_path):
    x = np.array([[[[1, 3, 0, 0],
                    [3, 3, 0, 0],
                    [2, 2, np.nan, 5],
                    [2, 1, 7, np.nan]]]], dtype=F32)
    y, idx = kernels.maxpool2d(x, 2)
    np.testing.assert_array_equal(idx.reshape(-1), [1, 2, 8, 10])
    assert y[0, 0, 0, 0] == 3 and y[0, 0, 0, 1] == 0 and y[0, 0, 1, 0] == 2
    assert np.isnan(y[0, 0, 1, 1])


@pytest.mark.parametrize("pool", POOLS, ids=POOL_IDS)
def test_avgpool2d_and_backward(simd_path, rng, pool):
    n, c, h, w, kernel, stride = pool
    st = kernel if stride is None else stride
    x = rng.standard_normal((n, c, h, w)).astype(F32)
    y = kernels.avgpool2d(x, kernel, stride)
    np.testing.assert_allclose(y, avgpool2d(x, kernel, st), rtol=1e-5, atol=1e-6)
    g = rng.standard_normal(y.shape)
    dx = kernels.avgpool2d_backward(g.astype(F32), x.shape, kernel, stride)
    # the adjoint: <avgpool(x), g> = <x, backward(g)>
    want = np.sum(avgpool2d(x, kernel, st) * g.astype(F32))
    got = np.sum(x.astype(np.float64) * dx)
    assert abs(got - want) <= 1e-5 * np.sum(np.abs(x) * np.abs(dx))
    # one-hot gradients spread 1/(kh*kw) over exactly the window
    kh, kw = kernel
    e = np.zeros(y.shape, dtype=F32)
    e[-1, -1, -1, -1] = 1
    d = kernels.avgpool2d_backward(e, x.shape, kernel, stride)
    oy, ox = y.shape[2] - 1, y.shape[3] - 1
    want = np.zeros(x.shape, dtype=F32)
    want[-1, -1, oy * st[0]:oy * st[0] + kh, ox * st[1]:ox * st[1] + kw] = F32(1) / F32(kh * kw)
    np.testing.assert_array_equal(d, want)


def test_threads_give_identical_results(rng, restore_threads):
    x = rng.standard_normal((37, 3, 21, 19)).astype(F32)
    results = []
    for threads in (1, 2):
        kernels.set_num_threads(threads)
        col = kernels.im2col(x, (3, 2), (2, 1), (1, 1))
        dx = kernels.col2im(col, x.shape, (3, 2), (2, 1), (1, 1))
        y, idx = kernels.maxpool2d(x, 3, 2)
        dm = kernels.maxpool2d_backward(y, idx, x.shape, 3, 2)
        a = kernels.avgpool2d(x, 3, 2)
        da = kernels.avgpool2d_backward(a, x.shape, 3, 2)
        b = x.copy()
        kernels.add_bias_planes(b, np.arange(3, dtype=F32))
        results.append((col, dx, y, idx, dm, a, da, b))
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)


def test_paths_agree(rng):
    x = rng.standard_normal((5, 3, 30, 29)).astype(F32)
    results = {}
    for path in kernels.simd_paths():
        previous = kernels.use_simd(path)
        try:
            col = kernels.im2col(x, 3, 1, 1)
            results[path] = (col, kernels.col2im(col, x.shape, 3, 1, 1),
                             *kernels.maxpool2d(x, 2), kernels.avgpool2d(x, 2))
        finally:
            kernels.use_simd(previous)
    for path, res in results.items():
        for a, b in zip(res, results["scalar"]):
            # copies and additions in one order: the same bits on every path
            np.testing.assert_array_equal(a, b, err_msg=path)


# ---- bad input --------------------------------------------------------------

X = np.zeros((2, 3, 5, 5), dtype=F32)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"kernel_size": 0}, ValueError, "kernel_size: expected ints >= 1"),
    ({"kernel_size": 2.0}, TypeError, "kernel_size: expected an int"),
    ({"kernel_size": True}, TypeError, "kernel_size: expected an int"),
    ({"kernel_size": (1, 2, 3)}, ValueError, "kernel_size: expected an int or a pair"),
    ({"kernel_size": 3, "stride": 0}, ValueError, "stride: expected ints >= 1"),
    ({"kernel_size": 3, "padding": -1}, ValueError, "padding: expected ints >= 0"),
    ({"kernel_size": 3, "padding": "1"}, TypeError, "padding: expected an int"),
    ({"kernel_size": 6}, ValueError, "x: the input \\(5, 5\\) with padding"),
])
def test_im2col_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        kernels.im2col(X, **kwargs)


def test_im2col_bad_arrays():
    with pytest.raises(ValueError, match="x: expected a 4-D array"):
        kernels.im2col(X[0], 3)
    with pytest.raises(TypeError, match="x: expected dtype float32"):
        kernels.im2col(X.astype(np.float64), 3)
    out = np.full((2, 27, 9), 5, dtype=F32)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 27, 9\)"):
        kernels.im2col(X, 3, out=np.zeros((2, 27, 8), dtype=F32))
    with pytest.raises(ValueError, match="out: the array is read-only"):
        out.flags.writeable = False
        kernels.im2col(X, 3, out=out)
    np.testing.assert_array_equal(out, 5)


def test_col2im_bad_arguments():
    col = np.zeros((2, 27, 9), dtype=F32)
    with pytest.raises(ValueError, match=r"col: expected shape \(2, 27, 25\)"):
        kernels.col2im(col, X.shape, 3, 1, 1)
    with pytest.raises(ValueError, match="x_shape: expected 4 positive sizes"):
        kernels.col2im(col, (2, 3, 5), 3)
    with pytest.raises(TypeError, match="x_shape: expected a tuple of 4 ints"):
        kernels.col2im(col, None, 3)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 3, 5, 5\)"):
        kernels.col2im(np.zeros((2, 27, 9), F32), X.shape, 3, out=np.zeros((2, 3, 5, 4), F32))
    buf = np.full(1350, 4, dtype=F32)
    col, out = buf.reshape(2, 27, 25), buf[1200:].reshape(X.shape)
    with pytest.raises(ValueError, match="col and out overlap"):
        kernels.col2im(col, X.shape, 3, 1, 1, out=out)
    np.testing.assert_array_equal(buf, 4)


def test_pool_bad_arguments():
    with pytest.raises(ValueError, match=r"x: the input \(5, 5\) is smaller than the window"):
        kernels.maxpool2d(X, 6)
    with pytest.raises(ValueError, match="stride: expected ints >= 1"):
        kernels.avgpool2d(X, 2, 0)
    y, idx = kernels.maxpool2d(X, 2)
    bad = idx.copy()
    bad[0, 0, 0, 0] = 25
    with pytest.raises(IndexError, match=r"indices: positions must lie in \[0, 25\)"):
        kernels.maxpool2d_backward(y, bad, X.shape, 2)
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(2, 3, 2, 2\)"):
        kernels.maxpool2d_backward(y[:1], idx, X.shape, 2)
    with pytest.raises(TypeError, match="indices: expected dtype int32"):
        kernels.maxpool2d_backward(y, idx.astype(np.int64), X.shape, 2)
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(2, 3, 2, 2\)"):
        kernels.avgpool2d_backward(y[:, :1].copy(), X.shape, 2)


def test_add_bias_planes_bad_arguments():
    with pytest.raises(ValueError, match="bias: expected 3 elements"):
        kernels.add_bias_planes(X.copy(), np.zeros(4, F32))
    with pytest.raises(ValueError, match="x: expected at least 2 axes"):
        kernels.add_bias_planes(np.zeros(3, F32), np.zeros(3, F32))


def test_output_size_helper():
    assert kernels.conv2d_output_size(28, 28, 3, 1, 1) == (28, 28)
    assert kernels.conv2d_output_size(13, 17, (3, 2), (2, 1), (1, 2)) == out_size(13, 17, 3, 2,
                                                                                  2, 1, 1, 2)
