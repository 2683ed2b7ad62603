"""Dataset storage conversions (uint8/float16 -> float32 with a scale) and the
shard gather (raw and converting)."""
import numpy as np
import pytest

from ggmlopt import kernels

F32 = np.float32


def assert_same_floats(actual, expected):
    """Bit-identical float32 arrays, except that any NaN matches any NaN."""
    actual = np.asarray(actual, F32)
    expected = np.asarray(expected, F32)
    assert actual.shape == expected.shape
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(actual), nan)
    np.testing.assert_array_equal(actual[~nan].view(np.uint32), expected[~nan].view(np.uint32))


# ---- to_float32 -------------------------------------------------------------------

@pytest.mark.parametrize("scale", [1.0, 1.0 / 255, -3.0])
def test_uint8_to_float32(simd_path, layout, scale, rng, place):
    size, offset = layout
    src = place(rng.integers(0, 256, size, dtype=np.uint8), offset)
    out = place(np.full(size, np.nan, F32), offset)
    assert kernels.to_float32(src, out, scale=scale) is out
    # one product of exact values: the same bits on every path
    assert_same_floats(out, src.astype(F32) * F32(scale))


@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0])
def test_every_float16_converts_exactly(simd_path, scale):
    # all 65536 bit patterns: zeros, subnormals, normals, inf, NaN, both signs
    src = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    out = kernels.to_float32(src, scale=scale)
    assert out.dtype == F32 and out.shape == src.shape
    with np.errstate(invalid="ignore"):          # signalling NaNs times scale
        expected = src.astype(F32) * F32(scale)
    assert_same_floats(out, expected)


def test_float16_special_values(simd_path, place):
    vals = np.array([0.0, -0.0, 6e-8, -6e-8, 6.1e-5, 65504.0, -65504.0, np.inf, -np.inf,
                     np.nan, 1.0, -2.5, 1e-7, 3.0e-5, 0.1, 7.0, 1024.0], dtype=np.float16)
    src = place(vals, 1)
    out = kernels.to_float32(src)
    assert_same_floats(out, vals.astype(F32))
    assert out[7] == np.inf and out[8] == -np.inf and np.isnan(out[9])
    assert np.signbit(out[1]) and not np.signbit(out[0])
    assert out[2] == F32(2.0 ** -24)           # the smallest subnormal half


def test_float16_to_float32_random(simd_path, layout, rng, place):
    size, offset = layout
    vals = (rng.standard_normal(size) * 100).astype(np.float16)
    src = place(vals, offset)
    out = place(np.zeros(size, F32), offset)
    kernels.to_float32(src, out, scale=0.125)
    assert_same_floats(out, vals.astype(F32) * F32(0.125))


def test_to_float32_keeps_the_shape(simd_path):
    src = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    out = kernels.to_float32(src, scale=2.0)
    assert out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, src.astype(F32) * 2)


def test_to_float32_of_empty_array(simd_path):
    assert kernels.to_float32(np.zeros(0, np.uint8)).shape == (0,)


# ---- gather_shards --------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint8, np.float16, np.float64,
                                   np.int64, np.complex64])
@pytest.mark.parametrize("shard_shape", [(), (1,), (3,), (7, 5), (784,)])
def test_raw_gather_copies_shards_in_perm_order(dtype, shard_shape, rng):
    nshards = 23
    src = (rng.standard_normal((nshards,) + shard_shape) * 50).astype(dtype)
    perm = rng.permutation(nshards)[:17].astype(np.int64)
    dst = np.zeros((17,) + shard_shape, dtype)
    kernels.gather_shards(src, dst, perm)
    np.testing.assert_array_equal(dst, src[perm])


def test_raw_gather_with_repeats_and_unaligned_views(simd_path, rng, place):
    src = place(rng.standard_normal((9, 5)).astype(F32), 3)
    perm = place(np.array([8, 0, 0, 4, 8], np.int64), 1)
    dst = place(np.zeros((5, 5), F32), 2)
    kernels.gather_shards(src, dst, perm)
    np.testing.assert_array_equal(dst, src[perm])


@pytest.mark.parametrize("src_dtype", [np.uint8, np.float16])
@pytest.mark.parametrize("nshards,shard", [(1, 1), (5, 3), (9, 17), (33, 784), (600, 784)])
def test_converting_gather(simd_path, src_dtype, nshards, shard, rng):
    if src_dtype is np.uint8:
        src = rng.integers(0, 256, (nshards, shard), dtype=np.uint8)
    else:
        src = rng.standard_normal((nshards, shard)).astype(np.float16)
    perm = rng.permutation(nshards).astype(np.int64)
    dst = np.full((nshards, shard), np.nan, F32)
    kernels.gather_shards(src, dst, perm, scale=1.0 / 255)
    assert_same_floats(dst, src[perm].astype(F32) * F32(1.0 / 255))


def test_converting_gather_scale_defaults_to_one(simd_path, rng):
    src = rng.integers(0, 256, (4, 9), dtype=np.uint8)
    dst = np.zeros((2, 9), F32)
    kernels.gather_shards(src, dst, np.array([3, 1], np.int64))
    np.testing.assert_array_equal(dst, src[[3, 1]].astype(F32))


def test_gather_accepts_any_dst_shape_of_the_right_size(rng):
    src = rng.standard_normal((6, 4)).astype(F32)
    dst = np.zeros(12, F32)
    kernels.gather_shards(src, dst, np.array([5, 2, 0], np.int64))
    np.testing.assert_array_equal(dst.reshape(3, 4), src[[5, 2, 0]])


@pytest.mark.parametrize("bad", [-1, 6, 2**40])
def test_gather_perm_out_of_range_is_an_index_error(bad, rng):
    src = rng.standard_normal((6, 4)).astype(F32)
    dst = np.full((3, 4), 9.0, F32)
    with pytest.raises(IndexError, match="perm"):
        kernels.gather_shards(src, dst, np.array([0, bad, 1], np.int64))
    assert np.all(dst == 9.0)


def test_gather_from_zero_shards(rng):
    dst = np.full((1, 4), 9.0, F32)
    with pytest.raises(IndexError, match="perm"):
        kernels.gather_shards(np.zeros((0, 4), F32), dst, np.array([0], np.int64))
    assert np.all(dst == 9.0)
    kernels.gather_shards(np.zeros((0, 4), F32), np.zeros((0, 4), F32), np.zeros(0, np.int64))


def test_gather_of_no_shards_writes_nothing(rng):
    src = rng.standard_normal((6, 4)).astype(F32)
    dst = np.zeros(0, F32)
    kernels.gather_shards(src, dst, np.zeros(0, np.int64))
    assert dst.size == 0
