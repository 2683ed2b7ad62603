"""uint8/float16 storage gathered into float32 batches, on every SIMD path, against NumPy."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import kernels

SIZES = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 1000, 4097]
PATHS = kernels.simd_paths()
# simd_path (tests/conftest.py): every compiled path, skipped where the CPU lacks it


F16_SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, -65504.0, 2.0 ** -24,
                         -(2.0 ** -24), 2.0 ** -14, 6.1e-5, 1.0, -1.5, 0.333], np.float16)


def make_data(dtype, n, ne, rng):
    if dtype == np.uint8:
        return rng.integers(0, 256, (n, ne), dtype=np.uint8)
    data = (rng.standard_normal((n, ne)) * 100).astype(np.float16)
    flat = data.reshape(-1)
    flat[rng.integers(0, flat.size, min(flat.size, 3 * len(F16_SPECIALS)))] = \
        np.resize(F16_SPECIALS, min(flat.size, 3 * len(F16_SPECIALS)))
    return data


@pytest.mark.parametrize("dtype", [np.uint8, np.float16])
@pytest.mark.parametrize("ne", SIZES)
@pytest.mark.parametrize("ndata_shard", [1, 3])
def test_converting_get_batch_matches_numpy(simd_path, dtype, ne, ndata_shard):
    rng = np.random.default_rng(ne * 7 + ndata_shard)
    ndata = 12
    scale = 1 / 255 if dtype == np.uint8 else 0.37
    data = make_data(dtype, ndata, ne, rng)
    ds = go.Dataset.from_arrays(data, ndata_shard=ndata_shard, data_scale=scale,
                                allow_nonfinite=True)  # the conversion of inf and NaN
    ds.shuffle(rng)
    batch = 2 * ndata_shard
    for ibatch in range(ds.nshards // 2):
        out = np.full((batch, ne), -7.0, np.float32)
        ds.get_batch(out, None, ibatch)
        shards = ds.permutation[2 * ibatch:2 * ibatch + 2]
        rows = (shards[:, None] * ndata_shard + np.arange(ndata_shard)).ravel()
        expected = data[rows].astype(np.float32) * np.float32(scale)
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(np.signbit(out), np.signbit(expected))   # -0.0 kept


@pytest.mark.parametrize("dtype", [np.uint8, np.float16])
def test_same_dtype_batch_is_a_raw_copy_without_scale(simd_path, dtype):
    rng = np.random.default_rng(1)
    data = make_data(dtype, 10, 33, rng)
    ds = go.Dataset.from_arrays(data, ndata_shard=5, data_scale=0.5, allow_nonfinite=True)
    out = np.zeros((5, 33), dtype)
    ds.get_batch(out, None, 1)
    np.testing.assert_array_equal(out.view(np.uint8), data[5:].view(np.uint8))   # bit-exact


@pytest.mark.parametrize("dtype", [np.uint8, np.float16])
@pytest.mark.parametrize("n", SIZES)
def test_conversion_kernel_matches_numpy(simd_path, dtype, n):
    rng = np.random.default_rng(n)
    src = make_data(dtype, 1, n + 1, rng).ravel()[1:]      # an unaligned start too
    out = np.empty(n, np.float32)
    kernels.to_float32(src, out, scale=0.125)
    np.testing.assert_array_equal(out, src.astype(np.float32) * np.float32(0.125))


def test_every_compiled_path_is_runnable_here():
    assert "scalar" in PATHS
    assert go.simd_info()["active"] in PATHS
