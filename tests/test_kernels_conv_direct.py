"""The direct stride-1 convolution (kernels.conv2d_direct and its backward), the
2x2 max-pool fast path and ReLU + max pooling in one pass, against float64 NumPy
references on every SIMD path."""
import numpy as np
import pytest
from conv_reference import conv2d, maxpool2d, pad, windows

from ggmlopt import kernels

F32 = np.float32

# (n, c, o, h, w, kernel, padding): batch 1, odd channel counts, kernels 1, 3
# and 5 and rectangular, padding 0 to 2 and beyond kernel - 1, rows shorter
# and longer than a vector, sizes that do not divide by the vector width
DIRECT = [
    (1, 1, 1, 1, 1, (1, 1), (0, 0)),
    (1, 1, 8, 28, 28, (3, 3), (1, 1)),
    (3, 8, 16, 14, 14, (3, 3), (1, 1)),
    (2, 3, 5, 7, 9, (3, 3), (0, 0)),
    (1, 5, 3, 5, 5, (5, 5), (2, 2)),
    (2, 2, 3, 7, 10, (3, 2), (1, 2)),
    (9, 3, 7, 11, 6, (1, 1), (2, 1)),  # padding beyond the kernel
    (2, 1, 2, 4, 6, (2, 4), (0, 3)),
    (1, 3, 9, 17, 33, (5, 3), (1, 0)),
    (11, 7, 5, 3, 19, (3, 5), (2, 2)),
    (17, 2, 6, 9, 9, (3, 3), (1, 1)),  # more than two groups of 8 images
]
DIRECT_IDS = [f"n{d[0]}-c{d[1]}-o{d[2]}-{d[3]}x{d[4]}-k{d[5]}-p{d[6]}" for d in DIRECT]


def _data(case, rng):
    n, c, o, h, w, (kh, kw), _ = case
    x = rng.standard_normal((n, c, h, w)).astype(F32)
    weight = rng.standard_normal((o, c, kh, kw)).astype(F32)
    bias = rng.standard_normal(o).astype(F32)
    return x, weight, bias


def _grads(x, weight, g, padding):
    """float64 (dx, dw, db) of sum(conv2d(x) * g), stride 1."""
    kh, kw = weight.shape[2:]
    ph, pw = padding
    g64 = np.asarray(g, dtype=np.float64)
    dw = np.einsum("ncyxij,noyx->ocij", windows(x, kh, kw, 1, 1, ph, pw), g64)
    db = g64.sum(axis=(0, 2, 3))
    # dx: the full correlation of g with the flipped, transposed weights, cropped
    full = windows(g64, kh, kw, 1, 1, kh - 1, kw - 1)
    dxp = np.einsum("noyxij,ocij->ncyx", full,
                    np.asarray(weight, dtype=np.float64)[:, :, ::-1, ::-1])
    h, w = x.shape[2:]
    return dxp[:, :, ph:ph + h, pw:pw + w], dw, db


def _close(got, want, terms):
    """|got - want| within float32 rounding of the sum of |terms| behind each value."""
    assert got.shape == want.shape and got.dtype == F32
    assert np.all(np.abs(got - want) <= 2e-6 * terms + 1e-7), np.max(np.abs(got - want))


@pytest.mark.parametrize("case", DIRECT, ids=DIRECT_IDS)
def test_direct_forward_matches_reference(simd_path, rng, case):
    x, weight, bias = _data(case, rng)
    padding = case[6]
    y = kernels.conv2d_direct(x, weight, bias, padding)
    want = conv2d(x, weight, bias, (1, 1), padding)
    terms = conv2d(np.abs(x), np.abs(weight), np.abs(bias), (1, 1), padding)
    _close(y, want, terms)
    _close(kernels.conv2d_direct(x, weight, None, padding),
           conv2d(x, weight, None, (1, 1), padding), terms)


@pytest.mark.parametrize("case", DIRECT, ids=DIRECT_IDS)
def test_direct_backward_matches_reference(simd_path, rng, case):
    x, weight, _ = _data(case, rng)
    padding = case[6]
    oh, ow = kernels.conv2d_output_size(x.shape[2], x.shape[3], weight.shape[2:], 1, padding)
    g = rng.standard_normal((x.shape[0], weight.shape[0], oh, ow)).astype(F32)
    dx, dw, db = kernels.conv2d_direct_backward(x, weight, g, padding)
    want = _grads(x, weight, g, padding)
    terms = _grads(np.abs(x), np.abs(weight), np.abs(g), padding)
    for got, w, t in zip((dx, dw, db), want, terms):
        _close(got, w, t)
    # without the bias and input gradients: the same weight gradient, None for them
    dx2, dw2, db2 = kernels.conv2d_direct_backward(x, weight, g, padding, bias=False,
                                                   input_grad=False)
    assert dx2 is None and db2 is None
    np.testing.assert_array_equal(dw2, dw)


def _workspace_at(size, shift):
    """size float32 starting shift floats past a 64-byte boundary (the kernels
    align their scratch themselves)."""
    buf = np.empty(size + 32, dtype=F32)
    start = (-buf.ctypes.data % 64) // 4 + shift
    work = buf[start:start + size]
    assert work.ctypes.data % 64 == 4 * shift
    return work


def test_direct_threads_and_workspaces_give_the_same_bits(rng, restore_threads):
    """The weight gradient sums fixed groups of images: any thread count, any
    workspace size (fewer slots than threads included) gives the same bits."""
    x = rng.standard_normal((37, 3, 13, 11)).astype(F32)
    weight = rng.standard_normal((5, 3, 3, 3)).astype(F32)
    bias = rng.standard_normal(5).astype(F32)
    g = rng.standard_normal((37, 5, 13, 11)).astype(F32)
    one = kernels.conv2d_direct_workspace(x.shape, 5, 3, 1, threads=1)
    assert kernels.conv2d_direct_workspace(x.shape, 5, 3, 1, threads=2) > one
    results = []
    for threads, size, shift in ((1, one, 0), (2, one, 0), (2, None, 0), (2, 3 * one, 0),
                                 (2, one, 1), (1, one, 15)):
        kernels.set_num_threads(threads)
        work = None if size is None else _workspace_at(size, shift)
        y = kernels.conv2d_direct(x, weight, bias, 1, workspace=work)
        results.append((y, *kernels.conv2d_direct_backward(x, weight, g, 1, workspace=work)))
    for res in results[1:]:
        for a, b in zip(res, results[0]):
            np.testing.assert_array_equal(a, b)


def test_direct_paths_agree_to_rounding(rng):
    x = rng.standard_normal((9, 8, 14, 14)).astype(F32)
    weight = rng.standard_normal((16, 8, 3, 3)).astype(F32)
    g = rng.standard_normal((9, 16, 14, 14)).astype(F32)
    results = {}
    for path in kernels.simd_paths():
        previous = kernels.use_simd(path)
        try:
            results[path] = (kernels.conv2d_direct(x, weight, None, 1),
                             *kernels.conv2d_direct_backward(x, weight, g, 1))
        finally:
            kernels.use_simd(previous)
    for path, res in results.items():
        for a, b in zip(res, results["scalar"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(),
                                       err_msg=path)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_direct_nonfinite_input_spreads_as_the_definition(simd_path, rng, bad):
    """The wide layout's dropped columns read real inputs; an inf or NaN there
    must not reach weight-gradient entries the definition keeps finite."""
    x = rng.standard_normal((3, 2, 9, 10)).astype(F32)
    x[1, 0, 4, 0] = bad  # first column: read by dropped columns of the row above
    x[2, 1, 0, 9] = bad  # last column
    weight = rng.standard_normal((4, 2, 3, 3)).astype(F32)
    g = rng.standard_normal((3, 4, 9, 10)).astype(F32)
    y = kernels.conv2d_direct(x, weight, None, 1)
    dx, dw, db = kernels.conv2d_direct_backward(x, weight, g, 1)
    with np.errstate(invalid="ignore", over="ignore"):
        want_y = conv2d(x, weight, None, (1, 1), (1, 1))
        _, want_dw, _ = _grads(x, weight, g, (1, 1))
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want_y))
    np.testing.assert_array_equal(np.isnan(dw), np.isnan(want_dw))
    assert np.isfinite(dw).sum() > 0  # the taps that never read the bad inputs
    finite = np.isfinite(want_dw)
    terms = _grads(np.abs(np.nan_to_num(x, posinf=0, neginf=0)), np.abs(weight), np.abs(g),
                   (1, 1))[1]
    _close(np.where(finite, dw, 0), np.where(finite, want_dw, 0), terms)
    assert np.all(np.isfinite(db)) and np.all(np.isfinite(dx[0]))


def test_direct_empty_batch(rng):
    x = np.zeros((0, 2, 5, 5), dtype=F32)
    weight = rng.standard_normal((3, 2, 3, 3)).astype(F32)
    assert kernels.conv2d_direct(x, weight, None, 1).shape == (0, 3, 5, 5)
    dw = np.full((3, 2, 3, 3), 7, dtype=F32)
    db = np.full(3, 7, dtype=F32)
    dx, dw, db = kernels.conv2d_direct_backward(x, weight, np.zeros((0, 3, 5, 5), F32), 1,
                                                grad_weight=dw, grad_bias=db)
    assert dx.shape == x.shape and not dw.any() and not db.any()


W = np.zeros((3, 2, 3, 3), dtype=F32)
XD = np.zeros((2, 2, 5, 5), dtype=F32)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: kernels.conv2d_direct(XD.astype(np.float64), W), TypeError, "x: expected dtype"),
    (lambda: kernels.conv2d_direct(np.zeros((2, 1, 5, 5), F32), W), ValueError,
     "weight: expected shape"),
    (lambda: kernels.conv2d_direct(XD[0], W), ValueError, "x: expected a 4-D array"),
    (lambda: kernels.conv2d_direct(XD, W, np.zeros(2, F32)), ValueError, "bias: expected 3"),
    (lambda: kernels.conv2d_direct(XD, np.zeros((3, 2, 6, 3), F32)), ValueError,
     "smaller than the kernel"),
    (lambda: kernels.conv2d_direct(XD, W, padding=-1), ValueError, "padding: expected ints"),
    (lambda: kernels.conv2d_direct(XD, W, workspace=np.zeros(3, F32)), ValueError,
     "workspace: expected at least"),
    (lambda: kernels.conv2d_direct(XD, W, out=np.zeros((2, 3, 5, 5), F32)), ValueError,
     "out: expected shape"),
    (lambda: kernels.conv2d_direct(XD, W, out=XD), ValueError, "out: expected shape"),
    (lambda: kernels.conv2d_direct_backward(XD, W, np.zeros((2, 3, 4, 4), F32), 1), ValueError,
     "grad_out: expected shape"),
    (lambda: kernels.conv2d_direct_backward(XD, W, np.zeros((2, 3, 3, 3), F32),
                                            grad_weight=np.zeros((3, 2, 3), F32)), ValueError,
     "grad_weight: expected shape"),
    (lambda: kernels.conv2d_direct_workspace((2, 2, 5), 3, 3), ValueError, "x_shape"),
    (lambda: kernels.conv2d_direct_workspace(XD.shape, 0, 3), ValueError, "out_channels"),
    (lambda: kernels.conv2d_direct_workspace(XD.shape, 3, 3, threads=0), ValueError, "threads"),
])
def test_direct_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_direct_overlapping_buffers_are_refused(rng):
    buf = np.zeros(2 * 3 * 5 * 5 + 100, dtype=F32)
    x = buf[:2 * 2 * 25].reshape(2, 2, 5, 5)
    out = buf[:2 * 3 * 25].reshape(2, 3, 5, 5)
    with pytest.raises(ValueError, match="share memory|overlap"):
        kernels.conv2d_direct(x, W, None, 1, out=out)


# ---- max pooling: the 2x2 fast path, ReLU + max pooling -----------------------

# (n, c, h, w): rows of outputs shorter than, equal to and longer than a
# vector (4, 8, 16 lanes), odd sizes whose last row or column is dropped
POOL2 = [(1, 1, 2, 2), (2, 3, 28, 28), (1, 5, 7, 9), (3, 16, 14, 14), (1, 2, 16, 16),
         (2, 1, 33, 34), (1, 3, 5, 64), (4, 2, 3, 15)]
POOL2_IDS = ["x".join(map(str, p)) for p in POOL2]


def _separate(x, g, kernel=2, stride=None):
    """relu then maxpool2d then their backwards, as two layers do it."""
    r = kernels.relu(x)
    y, idx = kernels.maxpool2d(r, kernel, stride)
    d = kernels.maxpool2d_backward(g, idx, x.shape, kernel, stride)
    return y, kernels.relu_backward(r, d)


def _awkward(rng, shape):
    """Integers in [-3, 3] (ties, zeros, whole windows <= 0), a -0, and NaN."""
    x = rng.integers(-3, 4, shape).astype(F32)
    x.reshape(-1)[::7] = -0.0
    return x


@pytest.mark.parametrize("shape", POOL2, ids=POOL2_IDS)
def test_maxpool2x2_matches_reference(simd_path, rng, shape):
    for x in (rng.standard_normal(shape).astype(F32), _awkward(rng, shape)):
        y, idx = kernels.maxpool2d(x, 2)
        np.testing.assert_array_equal(y, maxpool2d(x, (2, 2), (2, 2)).astype(F32))
        # the first maximal position of each window, row-major
        v = windows(x, 2, 2, 2, 2).reshape(*y.shape, 4)
        first = np.argmax(v == y[..., None], axis=-1)
        oy, ox = np.indices(y.shape[2:])
        want = (2 * oy + first // 2) * shape[3] + 2 * ox + first % 2
        np.testing.assert_array_equal(idx, np.broadcast_to(want, y.shape))


@pytest.mark.parametrize("shape", POOL2, ids=POOL2_IDS)
def test_maxpool2x2_nan_and_inf(simd_path, rng, shape):
    x = rng.standard_normal(shape).astype(F32)
    flat = x.reshape(-1)
    flat[rng.integers(0, flat.size, 1 + flat.size // 13)] = np.nan
    flat[rng.integers(0, flat.size, 1 + flat.size // 17)] = np.inf
    flat[rng.integers(0, flat.size, 1 + flat.size // 19)] = -np.inf
    y, idx = kernels.maxpool2d(x, 2)
    # the reference: the first NaN of a window, else its first maximum
    v = windows(x, 2, 2, 2, 2).reshape(*y.shape, 4)
    isnan = np.isnan(v)
    best = np.where(isnan.any(-1), np.argmax(isnan, -1),
                    np.argmax(v == np.nanmax(np.where(isnan, -np.inf, v), -1)[..., None], -1))
    oy, ox = np.indices(y.shape[2:])
    want = (2 * oy + best // 2) * shape[3] + 2 * ox + best % 2
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(y, np.take_along_axis(v, best[..., None], -1)[..., 0])


@pytest.mark.parametrize("shape", POOL2 + [(2, 3, 9, 10)], ids=POOL2_IDS + ["overlap"])
def test_maxpool_relu_equals_relu_then_maxpool(simd_path, rng, shape):
    kernel, stride = (2, None) if shape != (2, 3, 9, 10) else (3, 2)
    for x in (rng.standard_normal(shape).astype(F32), _awkward(rng, shape)):
        x.reshape(-1)[5::23] = np.nan
        y, idx = kernels.maxpool2d_relu(x, kernel, stride)
        g = rng.standard_normal(y.shape).astype(F32)
        g.reshape(-1)[::11] = -0.0
        g.reshape(-1)[3::29] = np.nan  # where y == 0 it must not leak
        dx = kernels.maxpool2d_relu_backward(g, idx, y, x.shape, kernel, stride)
        want_y, want_dx = _separate(x, g, kernel, stride)
        np.testing.assert_array_equal(y, want_y)
        np.testing.assert_array_equal(np.signbit(y), np.signbit(want_y))
        np.testing.assert_array_equal(dx, want_dx)
        np.testing.assert_array_equal(np.signbit(dx), np.signbit(want_dx))


def test_pool_threads_give_identical_results(rng, restore_threads):
    x = _awkward(rng, (37, 5, 14, 14))
    x.reshape(-1)[::101] = np.nan
    results = []
    for threads in (1, 2):
        kernels.set_num_threads(threads)
        y, idx = kernels.maxpool2d_relu(x, 2)
        dx = kernels.maxpool2d_relu_backward(y, idx, y, x.shape, 2)
        results.append((y, idx, dx, *kernels.maxpool2d(x, 2)))
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)


def test_maxpool_relu_bad_input():
    x = np.zeros((1, 1, 4, 4), F32)
    y, idx = kernels.maxpool2d_relu(x, 2)
    with pytest.raises(ValueError, match="out_forward: expected shape"):
        kernels.maxpool2d_relu_backward(y, idx, y[:, :, :1], x.shape, 2)
    with pytest.raises(IndexError, match="indices: positions"):
        kernels.maxpool2d_relu_backward(y, idx + 100, y, x.shape, 2)
    with pytest.raises(TypeError, match="x: expected dtype"):
        kernels.maxpool2d_relu(x.astype(np.float64), 2)
    with pytest.raises(ValueError, match="smaller than the window"):
        kernels.maxpool2d_relu(x, 5)


def test_reference_pad_is_zero_padding():
    """The helper the gradient reference builds on."""
    x = np.ones((1, 1, 2, 2), F32)
    assert pad(x, 1, 0).shape == (1, 1, 4, 2) and pad(x, 1, 0)[0, 0, 0].sum() == 0


# ---- the convolution, ReLU and max pooling in one pass ------------------------

# (n, c, o, h, w, kernel, padding, pool kernel, pool stride)
CONV_POOL = [
    (1, 1, 1, 2, 2, (1, 1), (0, 0), 2, None),
    (17, 1, 8, 28, 28, (3, 3), (1, 1), 2, None),
    (9, 8, 16, 14, 14, (3, 3), (1, 1), 2, None),
    (3, 3, 5, 9, 11, (3, 3), (0, 0), 3, 2),  # overlapping windows
    (2, 2, 3, 7, 7, (5, 5), (2, 2), 2, 1),
    (4, 5, 7, 13, 6, (3, 2), (1, 0), (2, 3), None),
]
CONV_POOL_IDS = [f"n{d[0]}-c{d[1]}-o{d[2]}-{d[3]}x{d[4]}-k{d[5]}-pool{d[7]}s{d[8]}"
                 for d in CONV_POOL]


@pytest.mark.parametrize("case", CONV_POOL, ids=CONV_POOL_IDS)
def test_conv_relu_maxpool_equals_the_three_steps(simd_path, rng, case):
    """The same bits as conv2d_direct, maxpool2d_relu and their backwards, on
    integer data (ties, zeros, windows <= 0), a -0 and NaN."""
    n, c, o, h, w, kernel, padding, pk, ps = case
    x = rng.integers(-2, 3, (n, c, h, w)).astype(F32)
    x.reshape(-1)[::13] = -0.0
    x.reshape(-1)[7::97] = np.nan
    weight = rng.integers(-1, 2, (o, c, *kernel)).astype(F32)
    bias = rng.integers(-1, 2, o).astype(F32)
    y = kernels.conv2d_direct(x, weight, bias, padding)
    want_y, want_idx = kernels.maxpool2d_relu(y, pk, ps)
    g = rng.standard_normal(want_y.shape).astype(F32)
    dy = kernels.maxpool2d_relu_backward(g, want_idx, want_y, y.shape, pk, ps)
    want = kernels.conv2d_direct_backward(x, weight, dy, padding)
    got_y, got_idx = kernels.conv2d_direct_relu_maxpool(x, weight, bias, padding, pk, ps)
    got = kernels.conv2d_direct_relu_maxpool_backward(x, weight, g, got_idx, got_y, padding, pk,
                                                      ps)
    np.testing.assert_array_equal(got_y, want_y)
    np.testing.assert_array_equal(got_idx, want_idx)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    _, dw, db = kernels.conv2d_direct_relu_maxpool_backward(x, weight, g, got_idx, got_y,
                                                            padding, pk, ps, input_grad=False)
    np.testing.assert_array_equal(dw, want[1])
    np.testing.assert_array_equal(db, want[2])


def test_conv_relu_maxpool_threads_give_the_same_bits(rng, restore_threads):
    x = rng.standard_normal((37, 3, 12, 10)).astype(F32)
    weight = rng.standard_normal((6, 3, 3, 3)).astype(F32)
    bias = rng.standard_normal(6).astype(F32)
    results = []
    for threads in (1, 2):
        kernels.set_num_threads(threads)
        y, idx = kernels.conv2d_direct_relu_maxpool(x, weight, bias, 1, 2)
        g = np.linspace(-1, 1, y.size, dtype=F32).reshape(y.shape)
        results.append((y, idx, *kernels.conv2d_direct_relu_maxpool_backward(
            x, weight, g, idx, y, 1, 2)))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_conv_relu_maxpool_bad_input(rng):
    x = np.zeros((2, 2, 5, 5), F32)
    y, idx = kernels.conv2d_direct_relu_maxpool(x, W, None, 1, 2)
    assert y.shape == idx.shape == (2, 3, 2, 2)
    with pytest.raises(ValueError, match="smaller than the window"):
        kernels.conv2d_direct_relu_maxpool(x, W, None, 0, 4)
    with pytest.raises(ValueError, match="grad_out: expected shape"):
        kernels.conv2d_direct_relu_maxpool_backward(x, W, y[:1], idx, y, 1, 2)
    with pytest.raises(ValueError, match="out_forward: expected shape"):
        kernels.conv2d_direct_relu_maxpool_backward(x, W, y, idx, y[:1], 1, 2)
    with pytest.raises(IndexError, match="indices: positions"):
        kernels.conv2d_direct_relu_maxpool_backward(x, W, y, idx + 25, y, 1, 2)
    with pytest.raises(TypeError, match="indices: expected dtype int32"):
        kernels.conv2d_direct_relu_maxpool_backward(x, W, y, idx.astype(np.int64), y, 1, 2)


def test_direct_large_images_take_smaller_groups(rng, restore_threads):
    """Images whose scratch passes about 1 MiB go one to a weight-gradient group
    (and a batch of 3 then splits into 3 groups): still the reference's values,
    the same bits on 1 and 2 threads."""
    x = rng.standard_normal((3, 16, 80, 72)).astype(F32)
    weight = rng.standard_normal((4, 16, 3, 3)).astype(F32)
    g = rng.standard_normal((3, 4, 80, 72)).astype(F32)
    results = []
    for threads in (1, 2):
        kernels.set_num_threads(threads)
        results.append(kernels.conv2d_direct_backward(x, weight, g, 1))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    want = _grads(x, weight, g, (1, 1))
    terms = _grads(np.abs(x), np.abs(weight), np.abs(g), (1, 1))
    for got, w, t in zip(results[0], want, terms):
        _close(got, w, t)
