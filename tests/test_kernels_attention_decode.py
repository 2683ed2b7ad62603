"""One decode step's attention over a key/value cache (kernels_attention.attention_decode):
within float32 rounding of a float64 softmax-weighted sum on every SIMD path, for
grouped-query heads, head widths that are not whole vectors, one cached position
and many; only the first `length` positions read; clear errors."""
import numpy as np
import pytest

from ggmlopt import kernels_attention as ka

U = 2.0 ** -24


def reference(q, cache_k, cache_v, length):
    """float64 (batch, n_heads * head_dim) and a float32 bound: the scores'
    dot products (head_dim terms), the exponentials and the weighted sum
    (length terms) each within gamma of their magnitudes, relative to the
    largest value a weight multiplies."""
    b, nh, d = q.shape
    nkv = cache_k.shape[2]
    group = nh // nkv
    k = cache_k[:, :length].astype(np.float64)
    v = cache_v[:, :length].astype(np.float64)
    out = np.empty((b, nh, d))
    bound = np.empty((b, nh, d))
    for i in range(b):
        for h in range(nh):
            kk, vv = k[i, :, h // group], v[i, :, h // group]
            s = kk @ q[i, h].astype(np.float64) / np.sqrt(d)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = p @ vv
            # a score off by e moves the weights by about e relatively
            score_err = (d + 4) * U * (np.abs(kk) @ np.abs(q[i, h])) / np.sqrt(d) + 8 * U
            bound[i, h] = (p * (2 * score_err + (length + 8) * U)) @ np.abs(vv) + \
                (length + 8) * U * (p @ np.abs(vv))
    return out.reshape(b, nh * d), bound.reshape(b, nh * d)


@pytest.mark.parametrize("b,nh,nkv,d,max_len,length", [
    (1, 9, 3, 64, 80, 1), (1, 9, 3, 64, 80, 37), (2, 4, 4, 24, 20, 20), (1, 8, 2, 7, 50, 33),
    (3, 2, 1, 128, 300, 257), (1, 1, 1, 1, 3, 2)])
def test_within_float32_of_a_float64_reference(simd_path, b, nh, nkv, d, max_len, length):
    rng = np.random.default_rng(b * 100 + length)
    q = (rng.standard_normal((b, nh, d)) * 2).astype(np.float32)
    ck = rng.standard_normal((b, max_len, nkv, d)).astype(np.float32)
    cv = rng.standard_normal((b, max_len, nkv, d)).astype(np.float32)
    ck[:, length:] = np.nan   # never read
    cv[:, length:] = np.nan
    got = ka.attention_decode(q, ck, cv, length)
    want, bound = reference(q, ck, cv, length)
    assert got.shape == (b, nh * d) and got.dtype == np.float32
    assert (np.abs(got - want) <= bound).all()


def test_a_dominant_key_and_equal_keys():
    q = np.zeros((1, 2, 16), np.float32)
    ck = np.zeros((1, 5, 1, 16), np.float32)
    cv = np.arange(5 * 16, dtype=np.float32).reshape(1, 5, 1, 16)
    # equal scores: the mean of the values
    np.testing.assert_allclose(ka.attention_decode(q, ck, cv, 5).reshape(2, 16),
                               np.broadcast_to(cv[0, :, 0].mean(axis=0), (2, 16)), rtol=1e-6)
    q[0, 0, 0] = 400.0   # head 0 sees key 3 only: its value exactly
    ck[0, 3, 0, 0] = 1.0
    got = ka.attention_decode(q, ck, cv, 5).reshape(2, 16)
    np.testing.assert_array_equal(got[0], cv[0, 3, 0])


def test_into_out_and_errors():
    q = np.ones((1, 4, 8), np.float32)
    ck = np.ones((1, 6, 2, 8), np.float32)
    out = np.full((1, 32), np.nan, np.float32)
    assert ka.attention_decode(q, ck, ck.copy(), 3, out=out) is out
    np.testing.assert_allclose(out, 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="length"):
        ka.attention_decode(q, ck, ck, 7)
    with pytest.raises(ValueError, match="length"):
        ka.attention_decode(q, ck, ck, 0)
    with pytest.raises(ValueError, match="kv heads"):
        ka.attention_decode(np.ones((1, 3, 8), np.float32), ck, ck, 2)
    with pytest.raises(ValueError, match="cache_v"):
        ka.attention_decode(q, ck, ck[:, :5], 2)
    with pytest.raises(ValueError, match="cache_k"):
        ka.attention_decode(q, ck[..., :4], ck[..., :4], 2)
    with pytest.raises(TypeError, match="q"):
        ka.attention_decode(q.astype(np.float64), ck, ck, 2)
    with pytest.raises(ValueError, match="out"):
        ka.attention_decode(q, ck, ck, 2, out=np.empty((1, 31), np.float32))


@pytest.mark.parametrize("b,max_len,start,length", [(1, 30, 25, 30), (2, 40, 7, 19),
                                                    (3, 12, 11, 12), (1, 9, 0, 9)])
def test_a_window_reads_only_its_positions(simd_path, b, max_len, start, length):
    """start: positions start .. length-1 only (a sliding window), as a cache
    holding just those; the positions outside are NaN and never read."""
    rng = np.random.default_rng(start * 7 + length)
    q = rng.standard_normal((b, 6, 20)).astype(np.float32)
    ck = np.full((b, max_len, 2, 20), np.nan, np.float32)
    cv = np.full((b, max_len, 2, 20), np.nan, np.float32)
    ck[:, start:length] = rng.standard_normal((b, length - start, 2, 20))
    cv[:, start:length] = rng.standard_normal((b, length - start, 2, 20))
    got = ka.attention_decode(q, ck, cv, length, start=start)
    want, bound = reference(q, ck[:, start:], cv[:, start:], length - start)
    assert (np.abs(got - want) <= bound).all()
    alone = ka.attention_decode(q, np.ascontiguousarray(ck[:, start:length]),
                                np.ascontiguousarray(cv[:, start:length]), length - start)
    np.testing.assert_array_equal(got, alone)
    with pytest.raises(ValueError, match="start: expected a position before length"):
        ka.attention_decode(q, ck, cv, length, start=length)
    with pytest.raises(ValueError, match="start"):
        ka.attention_decode(q, ck, cv, length, start=-1)
