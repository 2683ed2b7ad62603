"""ggmlopt's own float32 products (kernels_gemm, the GEMM engine "native")
against a float64 reference on every SIMD path: shapes that are not multiples
of the tile (one row, one column, k of 1, k past a chunk), every operand layout
the layers hand over (w, w.T, x.T, column slices), accumulation, threads giving
the same bits, and refused arguments leaving out untouched.

Tolerance: each value is a chain of k float32 FMAs, each rounding once, so its
error is within k * 2^-24 of sum |a| |b| (plus the old value's magnitude when
accumulating), by the standard bound for a recursive sum."""
import numpy as np
import pytest

from ggmlopt import gemm, kernels, kernels_gemm

EPS32 = 2.0 ** -24
SHAPES = [(1, 1, 1), (1, 7, 5), (5, 1, 9), (2, 3, 1), (13, 17, 31), (15, 16, 33), (29, 65, 47),
          (37, 1100, 70), (100, 48, 257), (256, 576, 192),
          # no wider than a vector: an adapter's rank side (one-vector tiles)
          (61, 300, 8), (576, 256, 8), (45, 1600, 4), (59, 40, 16), (30, 17, 1),
          # A's rows 64 KB apart (a head's input gradient over a vocabulary of 49152)
          (20, 16384, 24),
          # nine panels (AVX-512's 32 columns, AVX2's 16) of many tiles: the
          # threads split the rows; a short k: a block wider than 256 columns
          (430, 410, 288), (430, 410, 144), (50, 300, 600)]
# the shapes whose threads split the columns, the rows, or blocks wider than 256
THREAD_SHAPES = [(70, 1300, 300), (430, 410, 288), (430, 410, 144), (50, 300, 600)]


def operands(rng, m, k, n, a_t, b_t):
    a = rng.standard_normal((k, m) if a_t else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if b_t else (k, n)).astype(np.float32)
    return (a.T if a_t else a), (b.T if b_t else b)


def check(got, a, b, old=None):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = a64 @ b64
    scale = np.abs(a64) @ np.abs(b64)
    if old is not None:
        want = want + old
        scale = scale + np.abs(old)
    k = a.shape[1]
    tol = (k + 1) * EPS32 * scale + 2.0 ** -149
    assert np.all(np.abs(got - want) <= tol), float(np.max(np.abs(got - want) - tol))


@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_products_against_float64(simd_path, shape, a_t, b_t):
    m, k, n = shape
    rng = np.random.default_rng(m * 1000 + k + n)
    a, b = operands(rng, m, k, n, a_t, b_t)
    out = np.full((m, n), np.nan, np.float32)  # never read without accumulate
    assert kernels_gemm.sgemm(a, b, out) is out
    check(out, a, b)
    old = out.astype(np.float64)
    kernels_gemm.sgemm(a, b, out, accumulate=True)
    check(out, a, b, old)


def test_views_with_offsets_and_row_strides(simd_path):
    rng = np.random.default_rng(1)
    big = rng.standard_normal((70, 131)).astype(np.float32)
    a = big[3:33, 5:62]          # rows of 131, an unaligned start
    b = big[2:59, 70:129]        # a column slice, rows of 131
    out_big = np.zeros((31, 100), np.float32)
    out = out_big[1:, 3:62]      # rows of 100 floats, unaligned
    kernels_gemm.sgemm(a, b, out)
    check(out, a, b)
    assert (out_big[0] == 0).all() and (out_big[:, :3] == 0).all() and (out_big[:, 62:] == 0).all()


def test_k_zero_and_empty(simd_path):
    out = np.full((3, 4), 7.0, np.float32)
    kernels_gemm.sgemm(np.zeros((3, 0), np.float32), np.zeros((0, 4), np.float32), out)
    assert (out == 0).all()
    out[...] = 7.0
    kernels_gemm.sgemm(np.zeros((3, 0), np.float32), np.zeros((0, 4), np.float32), out,
                       accumulate=True)
    assert (out == 7.0).all()
    kernels_gemm.sgemm(np.zeros((0, 5), np.float32), np.zeros((5, 4), np.float32),
                       np.zeros((0, 4), np.float32))


def test_non_finite_values_propagate(simd_path):
    a = np.ones((20, 40), np.float32)
    b = np.ones((40, 50), np.float32)
    a[3, 7] = np.inf
    b[11, 13] = np.nan
    out = np.empty((20, 50), np.float32)
    kernels_gemm.sgemm(a, b, out)
    assert np.isnan(out[:, 13]).all()
    assert np.isinf(out[3, np.arange(50) != 13]).all()
    mask = np.ones((20, 50), bool)
    mask[:, 13] = False
    mask[3] = False
    assert (out[mask] == 40).all()


@pytest.mark.parametrize("shape", THREAD_SHAPES)
def test_threads_give_the_same_bits(simd_path, restore_threads, shape):
    m, k, n = shape
    rng = np.random.default_rng(2)
    a, b = operands(rng, m, k, n, False, True)
    runs = []
    for threads in (1, 2, 3):
        kernels.set_num_threads(threads)
        out = np.empty((m, n), np.float32)
        kernels_gemm.sgemm(a, b, out)
        runs.append(out)
    check(runs[0], a, b)
    assert all(np.array_equal(runs[0], r) for r in runs[1:])


def test_refusals_name_the_argument_and_write_nothing():
    a = np.ones((4, 5), np.float32)
    b = np.ones((5, 6), np.float32)
    out = np.full((4, 6), 3.0, np.float32)
    cases = [
        ((a.astype(np.float64), b, out), TypeError, "a: expected dtype float32"),
        (([[1.0]], b, out), TypeError, "a: expected a numpy.ndarray"),
        ((a, b, np.ones(24, np.float32)), ValueError, "out: expected a 2-D array"),
        ((a, np.ones((4, 6), np.float32), out), ValueError, "shapes"),
        ((a, b, np.ones((6, 4), np.float32).T), ValueError, "out: expected rows"),
        ((np.ones((8, 10), np.float32)[::2, ::2], b, out), ValueError, "a: expected contiguous"),
        ((a, b[::-1], out), ValueError, "b: expected non-negative strides"),
    ]
    for args, kind, message in cases:
        with pytest.raises(kind, match=message):
            kernels_gemm.sgemm(*args)
        assert kernels_gemm.try_sgemm(*args) is False
    assert (out == 3.0).all()
    ro = out.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kernels_gemm.sgemm(a, b, ro)
    buf = np.ones((4, 20), np.float32)
    with pytest.raises(ValueError, match="a and out overlap"):
        kernels_gemm.sgemm(buf[:, :5], b, buf[:, 10:16])
    assert (buf == 1).all()
    # a row of one float seen 6 times (a zero column stride): the kernel would write
    # the 5 floats after it
    mem = np.full(8, 3.0, np.float32)
    row = np.lib.stride_tricks.as_strided(mem[:1], shape=(1, 6), strides=(24, 0), writeable=True)
    with pytest.raises(ValueError, match="out: expected rows of contiguous"):
        kernels_gemm.sgemm(a[:1], b, row)
    assert (mem == 3.0).all()


def test_the_engine_routes_products_to_it(simd_path):
    rng = np.random.default_rng(3)
    a, b = operands(rng, 33, 70, 45, False, True)
    previous = gemm.use_engine("native")
    try:
        assert gemm.engine() == "native"
        got = gemm.matmul(a, b, np.empty((33, 45), np.float32))
        want = np.empty((33, 45), np.float32)
        kernels_gemm.sgemm(a, b, want)
        assert np.array_equal(got, want)
        # a rank-8 side of 8+ rows is native's too (one-vector tiles)
        thin = gemm.matmul(a, b[:, :8], np.empty((33, 8), np.float32))
        want_thin = np.empty((33, 8), np.float32)
        kernels_gemm.sgemm(a, b[:, :8], want_thin)
        assert np.array_equal(thin, want_thin)
        # a row vector, fewer rows than a tile's worth and an output it cannot
        # take go to NumPy, still right
        check(gemm.matmul(a[:7], b, np.empty((7, 45), np.float32)), a[:7], b)
        row = gemm.matmul(a[0], b, np.empty(45, np.float32))
        check(row[None, :], a[:1], b)
        strided = np.empty((45, 33), np.float32).T
        check(gemm.matmul(a, b, strided), a, b)
    finally:
        gemm.use_engine(previous)


def test_native_training_passes_linger_the_kernel_threads_only_inside():
    """Under the native engine a context's forward and backward keep the kernel
    threads polling between products (gemm.NATIVE_TRAINING_LINGER_S); the
    setting before comes back after, and the numpy engine leaves it alone."""
    import ggmlopt as go
    from ggmlopt.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=33, dim=32, n_layers=1, n_heads=2, max_seq_len=16))
    x = np.arange(16, dtype=np.int32).reshape(2, 8) % 33
    seen = []
    forward = model._blocks_forward

    def spy(blocks, h, pos=0):
        seen.append(kernels.set_pool_linger(0.5))
        kernels.set_pool_linger(seen[-1])
        return forward(blocks, h, pos)
    model._blocks_forward = spy
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32)
    assert kernels.set_pool_linger(0) == 0.0
    previous = gemm.use_engine("native")
    try:
        ctx.alloc(True)
        ctx.eval(None, inputs=x, labels=(x + 1) % 33)
        gemm.use_engine("numpy")
        ctx.alloc(True)
        ctx.eval(None, inputs=x, labels=(x + 1) % 33)
    finally:
        gemm.use_engine(previous)
    assert seen == [gemm.NATIVE_TRAINING_LINGER_S, 0.0]
    assert kernels.set_pool_linger(0) == 0.0
