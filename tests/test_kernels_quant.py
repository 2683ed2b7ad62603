"""The GGUF block-type kernels: dequantization bit-identical to gguf-py's (and
so to ggml's) on every SIMD path, the few-rows product within float32 rounding
of a float64 reference, and clear errors for bad input."""
import numpy as np
import pytest

from ggmlopt import kernels_quant as kq

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

# type: (values per block, bytes per block, byte offsets of the f16 scales)
BLOCKS = {"Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)),
          "Q5_1": (32, 24, (0, 2)), "Q8_0": (32, 34, (0,)), "Q4_K": (256, 144, (0, 2)),
          "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,)),
          "Q2_K": (256, 84, (80, 82)), "Q3_K": (256, 110, (108,)), "IQ4_NL": (32, 18, (0,)),
          "IQ4_XS": (256, 136, (0,))}
PLAIN = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
ALL = list(BLOCKS) + list(PLAIN)


def random_rows(qtype, nrows, nblocks, rng, scale=0.05):
    """nrows rows of nblocks random blocks of qtype: every quant bit random, the
    f16 scales finite (random ones could be NaN, whose payload gguf-py and C
    may carry differently)."""
    if qtype in PLAIN:
        w = (rng.standard_normal((nrows, nblocks * 32)) * scale).astype(np.float32)
        if qtype == "BF16":
            return (w.view(np.uint32) >> 16).astype(np.uint16)
        return w.astype(PLAIN[qtype])
    _, size, scales = BLOCKS[qtype]
    raw = rng.integers(0, 256, (nrows, nblocks, size), dtype=np.uint8)
    for off in scales:
        d = (rng.standard_normal((nrows, nblocks)) * scale).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(nrows, nblocks, 2)
    return raw.reshape(nrows, nblocks * size)


def reference(qtype, raw):
    """gguf-py's dequantization, float32 (nrows, ncols)."""
    if qtype == "F32":
        return raw.copy()
    if qtype == "F16":
        return raw.astype(np.float32)
    if qtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(gguf.quants.dequantize(raw, T[qtype]), np.float32)


def ncols_of(qtype, nblocks):
    return nblocks * (BLOCKS[qtype][0] if qtype in BLOCKS else 32)


@pytest.mark.parametrize("qtype", ALL)
@pytest.mark.parametrize("nrows,nblocks", [(1, 1), (7, 3), (3, 5)])
def test_dequantize_is_bit_identical_to_gguf_py(simd_path, qtype, nrows, nblocks):
    rng = np.random.default_rng(nrows * 31 + nblocks)
    raw = random_rows(qtype, nrows, nblocks, rng)
    ncols = ncols_of(qtype, nblocks)
    got = kq.dequantize(qtype, raw, ncols)
    want = reference(qtype, raw)
    assert got.shape == (nrows, ncols) and got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_dequantize_what_gguf_py_quantized(simd_path, qtype):
    """Blocks made from real values by gguf-py's quantizer (ggml's rounding)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, T[qtype])
    got = kq.dequantize(qtype, raw, 96)
    np.testing.assert_array_equal(got, reference(qtype, raw))
    # and the values are the weights to the type's resolution
    assert np.abs(got - w).max() < np.abs(w).max() / (8 if qtype.startswith("Q4") else 14)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "F16"])
def test_dequantize_a_row_range_into_a_row_block(qtype):
    rng = np.random.default_rng(5)
    raw = random_rows(qtype, 9, 2, rng)
    ncols = ncols_of(qtype, 2)
    full = reference(qtype, raw)
    big = np.full((12, ncols), np.nan, np.float32)
    out = kq.dequantize(qtype, raw, ncols, start=2, stop=7, out=big[4:9])
    assert out.base is big
    np.testing.assert_array_equal(big[4:9], full[2:7])
    assert np.isnan(big[:4]).all() and np.isnan(big[9:]).all()
    assert kq.dequantize(qtype, raw, ncols, start=3, stop=3).shape == (0, ncols)


def matmul_bound(x, w):
    """|x w^T - exact| <= gamma_n (|x| |w|^T) for a sum of n products in any
    order (u = 2^-24), plus the final rounding to float32."""
    n = x.shape[1]
    u = 2.0 ** -24
    gamma = n * u / (1 - n * u)
    mag = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    return gamma * mag + u * mag


@pytest.mark.parametrize("qtype", ALL)
@pytest.mark.parametrize("nx", [1, 3, 8, 11])
def test_matmul_equals_the_product_with_the_dequantized_weight(simd_path, qtype, nx):
    rng = np.random.default_rng(nx)
    nblocks = 3 if qtype in BLOCKS and BLOCKS[qtype][0] == 256 else 19   # 608 values: chunks
    raw = random_rows(qtype, 13, nblocks, rng)
    ncols = ncols_of(qtype, nblocks)
    x = rng.standard_normal((nx, ncols)).astype(np.float32)
    w = reference(qtype, raw)
    got = kq.matmul(x, qtype, raw)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (nx, 13)
    assert (np.abs(got - exact) <= matmul_bound(x, w)).all()


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
@pytest.mark.parametrize("ncols", [1, 7, 37, 100, 129])
@pytest.mark.parametrize("nx", [1, 2])
def test_half_matmul_of_any_width(simd_path, qtype, ncols, nx):
    """16-bit rows are any number of values wide: the vectors' tails count."""
    rng = np.random.default_rng(ncols)
    w = (rng.standard_normal((5, ncols)) * 0.05).astype(np.float32)
    raw = (w.view(np.uint32) >> 16).astype(np.uint16) if qtype == "BF16" else w.astype(np.float16)
    x = rng.standard_normal((nx, ncols)).astype(np.float32)
    w = reference(qtype, raw)
    got = kq.matmul(x, qtype, raw)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    assert (np.abs(got - exact) <= matmul_bound(x, w)).all()


def test_matmul_is_the_same_bits_on_any_number_of_threads(restore_threads):
    import ggmlopt
    rng = np.random.default_rng(9)
    raw = random_rows("Q4_K", 700, 4, rng)
    x = rng.standard_normal((2, 1024)).astype(np.float32)
    ggmlopt.set_num_threads(1)
    one = kq.matmul(x, "Q4_K", raw)
    ggmlopt.set_num_threads(2)
    np.testing.assert_array_equal(kq.matmul(x, "Q4_K", raw), one)


def test_a_read_only_mapping_is_read_in_place(tmp_path):
    rng = np.random.default_rng(2)
    raw = random_rows("Q8_0", 4, 2, rng)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mapped = np.memmap(path, np.uint8, "r", shape=raw.shape)
    assert not mapped.flags.writeable
    np.testing.assert_array_equal(kq.dequantize("Q8_0", mapped, 64), reference("Q8_0", raw))
    x = np.ones((1, 64), np.float32)
    np.testing.assert_allclose(kq.matmul(x, "Q8_0", mapped), x @ reference("Q8_0", raw).T,
                               rtol=1e-5, atol=1e-6)


def test_row_bytes():
    assert kq.row_bytes("Q4_K", 512) == 288
    assert kq.row_bytes("q8_0", 64) == 68
    assert kq.row_bytes(T.Q6_K, 256) == 210
    assert kq.row_bytes("BF16", 3) == 6
    with pytest.raises(ValueError, match="ncols.*256"):
        kq.row_bytes("Q4_K", 320)


def test_bad_input_names_the_argument():
    raw = random_rows("Q4_0", 2, 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="qtype.*IQ2_XXS.*Q4_0"):
        kq.dequantize("IQ2_XXS", raw, 32)
    with pytest.raises(ValueError, match="qtype: ggml type 16"):
        kq.dequantize(16, raw, 32)
    with pytest.raises(ValueError, match="ncols: Q2_K rows hold whole blocks of 256 values"):
        kq.dequantize("Q2_K", raw, 32)
    with pytest.raises(TypeError, match="qtype"):
        kq.dequantize(2.0, raw, 32)
    with pytest.raises(ValueError, match="raw: a row of 64 Q4_0 values is 36 bytes"):
        kq.dequantize("Q4_0", raw, 64)
    with pytest.raises(ValueError, match="raw: expected a 2-D"):
        kq.dequantize("Q4_0", raw.reshape(-1), 32)
    with pytest.raises(ValueError, match="raw: expected a C-contiguous"):
        kq.dequantize("Q4_0", np.zeros((2, 36), np.uint8)[:, ::2], 32)
    with pytest.raises(TypeError, match="raw"):
        kq.dequantize("Q4_0", raw.tolist(), 32)
    with pytest.raises(ValueError, match="start, stop"):
        kq.dequantize("Q4_0", raw, 32, start=1, stop=3)
    with pytest.raises(ValueError, match="out: expected shape"):
        kq.dequantize("Q4_0", raw, 32, out=np.empty((2, 31), np.float32))
    with pytest.raises(ValueError, match="x: expected shape"):
        kq.matmul(np.zeros(32, np.float32), "Q4_0", raw)
    with pytest.raises(TypeError, match="x: expected dtype float32"):
        kq.matmul(np.zeros((1, 32)), "Q4_0", raw)
    with pytest.raises(ValueError, match="x: rows of 31 values are not whole Q4_0 blocks of 32"):
        kq.matmul(np.zeros((1, 31), np.float32), "Q4_0", raw)
    out = np.zeros((1, 2), np.float32)
    kq.matmul(np.ones((1, 32), np.float32), "Q4_0", raw, out=out)
    np.testing.assert_allclose(out, reference("Q4_0", raw).sum(axis=1)[None], rtol=1e-5)


# ---- quantize: float32 rows to the K types ------------------------------------
# (bit-identity with ggml's own quantizer is checked in tests/llamacpp, where
# llama.cpp's library is at hand; here, what the bytes must satisfy)

def _sub_block_grids(qtype, raw):
    """Per value: (step, offset, nmax) of its sub-block's grid as the block's
    stored scales define it, value = step * level - offset, level in 0..nmax."""
    nrows = raw.shape[0]
    b = raw.reshape(nrows, -1, BLOCKS[qtype][1])
    if qtype == "Q6_K":
        d = b[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
        sc = b[..., 192:208].view(np.int8).astype(np.float32)
        step = np.repeat(d[..., None] * sc, 16, axis=-1)
        return step.reshape(nrows, -1), 32 * step.reshape(nrows, -1), 63
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 4:16].astype(np.int32)
    sc = np.empty(q.shape[:-1] + (8,), np.int32)
    m = np.empty_like(sc)
    sc[..., :4], m[..., :4] = q[..., 0:4] & 63, q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    m[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    step = np.repeat(d[..., None] * sc, 32, axis=-1).reshape(nrows, -1)
    offset = np.repeat(dmin[..., None] * m, 32, axis=-1).reshape(nrows, -1)
    return step, offset, 15 if qtype == "Q4_K" else 31


K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("qtype", K_TYPES)
def test_quantize_puts_each_value_on_the_nearest_point_of_its_sub_block_grid(qtype):
    """ggml's quantizers end by rounding every value to the grid its block's
    stored (rounded) scales define: the dequantized value is the grid point
    nearest to it.  A wrong packing of levels or scales breaks this."""
    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((6, 768)) * rng.uniform(0.01, 3, (6, 1))).astype(np.float32)
    rows[1, :256] = np.abs(rows[1, :256])   # a block with a positive minimum (min 0)
    rows[2, 256:300] = 0                     # a sub-block of zeros
    raw = kq.quantize(rows, qtype)
    assert raw.shape == (6, kq.row_bytes(qtype, 768)) and raw.dtype == np.uint8
    got = kq.dequantize(qtype, raw, 768).astype(np.float64)
    step, offset, nmax = (a.astype(np.float64) if isinstance(a, np.ndarray) else a
                          for a in _sub_block_grids(qtype, raw))
    live = step != 0
    level = np.round((got + offset) / np.where(live, step, 1))
    assert ((level >= 0) & (level <= nmax))[live].all()
    x = rows.astype(np.float64)
    err = np.abs(got - x)
    slack = 4 * 2.0 ** -24 * (np.abs(x) + np.abs(offset))
    for neighbour in (level - 1, level + 1):
        inside = live & (neighbour >= 0) & (neighbour <= nmax)
        alt = np.abs(neighbour * step - offset - x)
        assert (err <= alt + slack)[inside].all()


@pytest.mark.parametrize("qtype,bits", [("Q4_K", 4), ("Q5_K", 5), ("Q6_K", 6)])
def test_quantize_error_shrinks_with_the_bits(qtype, bits):
    """On Gaussian rows the root-mean-square error stays below one level of a
    uniform grid over +-3 sigma (6 sigma / 2^bits), the scale of what b bits
    can resolve."""
    rng = np.random.default_rng(4)
    rows = rng.standard_normal((16, 1024)).astype(np.float32)
    got = kq.dequantize(qtype, kq.quantize(rows, qtype), 1024)
    rms = float(np.sqrt(np.mean((got.astype(np.float64) - rows) ** 2)))
    assert rms < 6 / 2 ** bits


def test_quantize_zeros_and_threads(restore_threads):
    import ggmlopt
    zeros = np.zeros((3, 256), np.float32)
    for qtype in K_TYPES:
        np.testing.assert_array_equal(kq.dequantize(qtype, kq.quantize(zeros, qtype), 256),
                                      zeros)
    rows = np.random.default_rng(5).standard_normal((301, 512)).astype(np.float32)
    ggmlopt.set_num_threads(1)
    one = kq.quantize(rows, "Q4_K")
    ggmlopt.set_num_threads(2)
    np.testing.assert_array_equal(kq.quantize(rows, "Q4_K"), one)
    out = np.empty_like(one)
    assert kq.quantize(rows, "Q4_K", out=out) is out
    np.testing.assert_array_equal(out, one)
    assert kq.quantize(np.zeros((0, 256), np.float32), "Q6_K").shape == (0, 210)


def test_quantize_refuses_bad_input_before_writing():
    rows = np.ones((2, 256), np.float32)
    with pytest.raises(ValueError, match="qtype: quantize writes Q4_K, Q5_K, Q6_K; got Q8_0"):
        kq.quantize(rows, "Q8_0")
    with pytest.raises(ValueError, match="rows: Q4_K rows hold whole blocks of 256.*320"):
        kq.quantize(np.ones((2, 320), np.float32), "Q4_K")
    with pytest.raises(TypeError, match="rows: expected dtype float32"):
        kq.quantize(rows.astype(np.float64), "Q4_K")
    with pytest.raises(ValueError, match="rows: expected a 2-D"):
        kq.quantize(rows.reshape(-1), "Q4_K")
    out = np.full((2, 144), 7, np.uint8)
    bad = rows.copy()
    bad[1, 9] = np.nan
    with pytest.raises(ValueError, match="rows: every value must be finite"):
        kq.quantize(bad, "Q4_K", out=out)
    assert (out == 7).all()
    with pytest.raises(ValueError, match="out: expected shape"):
        kq.quantize(rows, "Q4_K", out=np.empty((2, 143), np.uint8))
