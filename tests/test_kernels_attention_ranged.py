"""The fused attention kernels with a first key per query (kv_start): sliding
windows and documents packed into one window, against a float64 reference of
the masked softmax on every SIMD path and awkward sizes; packed documents equal
each document run alone; bad starts refused before anything is written."""
import numpy as np
import pytest
from test_kernels_attention import assert_close, random_qkv

from ggmlopt import kernels
from ggmlopt import kernels_attention as ka


def masked_reference(q, k, v, dout, starts):
    """Unfused float64 attention where query i of item b sees keys
    starts[b, i] .. i: (out, lse, dq, dk, dv)."""
    q, k, v, dout = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    b, t, h, d = q.shape
    group = h // k.shape[2]
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    j = np.arange(t)
    allowed = (j[None, None, :] <= j[None, :, None]) & (j[None, None, :] >= starts[:, :, None])
    mask = allowed[:, None]                                  # (b, 1, i, j)
    s = np.where(mask, np.einsum("bihd,bjhd->bhij", q, kk) / np.sqrt(d), -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    p = e / total
    out = np.einsum("bhij,bjhd->bihd", p, vv)
    lse = (m + np.log(total))[..., 0]
    dp = np.einsum("bihd,bjhd->bhij", dout, vv)
    delta = np.einsum("bihd,bihd->bhi", dout, out)[..., None]
    ds = p * (dp - delta) / np.sqrt(d)
    dq = np.einsum("bhij,bjhd->bihd", ds, kk)
    dk = np.einsum("bhij,bihd->bjhd", ds, q).reshape(b, t, -1, group, d).sum(3)
    dv = np.einsum("bhij,bihd->bjhd", p, dout).reshape(b, t, -1, group, d).sum(3)
    return out, lse, dq, dk, dv


def check_against_reference(q, k, v, dout, starts):
    out, lse = ka.attention_forward(q, k, v, kv_start=starts)
    dq, dk, dv = ka.attention_backward(q, k, v, out, lse, dout, kv_start=starts)
    ro, rlse, rdq, rdk, rdv = masked_reference(q, k, v, dout, starts)
    assert_close(out, ro, np.abs(v).max(), 2e-6, "out")
    assert_close(lse, rlse, np.abs(rlse).max() + 1, 1e-6, "lse")
    gscale = max(np.abs(rdq).max(), np.abs(rdk).max(), np.abs(rdv).max())
    for got, want, name in ((dq, rdq, "dq"), (dk, rdk, "dk"), (dv, rdv, "dv")):
        assert_close(got, want, gscale, 1e-5, name)
    return out, dq, dk, dv


SHAPES = [(2, 7, 4, 2, 8), (1, 64, 4, 1, 16), (2, 129, 4, 4, 13), (1, 300, 2, 1, 64),
          (1, 33, 2, 2, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-t{}-h{}-kv{}-d{}".format(*s))
@pytest.mark.parametrize("window", [1, 3, 32, 33, 100, 1000])
def test_sliding_windows_match_the_masked_reference(simd_path, shape, window, rng):
    q, k, v, dout = random_qkv(rng, *shape)
    starts = ka.window_starts(shape[0], shape[1], window)
    out, *_ = check_against_reference(q, k, v, dout, starts)
    if window >= shape[1]:   # a window over every key is plain causal attention, bit for bit
        np.testing.assert_array_equal(out, ka.attention_forward(q, k, v)[0])


def random_documents(rng, b, t):
    """doc ids (b, t): runs of random lengths, single tokens among them."""
    ids = np.zeros((b, t), dtype=np.int64)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=min(t - 1, rng.integers(0, 6)),
                                  replace=False)) if t > 1 else []
        for c in cuts:
            ids[row, c:] += 1
    return ids


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-t{}-h{}-kv{}-d{}".format(*s))
def test_packed_documents_match_the_masked_reference(simd_path, shape, rng):
    q, k, v, dout = random_qkv(rng, *shape)
    check_against_reference(q, k, v, dout, ka.document_starts(random_documents(rng, *shape[:2])))


def test_packed_documents_equal_each_document_alone(rng):
    b, t, h, hkv, d = 1, 150, 4, 2, 16
    q, k, v, dout = random_qkv(rng, b, t, h, hkv, d)
    bounds = [0, 1, 40, 41, 97, 150]       # documents of 1, 39, 1, 56 and 53 tokens
    ids = np.zeros((1, t), dtype=np.int32)
    for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        ids[0, lo:hi] = n
    starts = ka.document_starts(ids)
    out, lse = ka.attention_forward(q, k, v, kv_start=starts)
    grads = ka.attention_backward(q, k, v, out, lse, dout, kv_start=starts)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        part = [np.ascontiguousarray(a[:, lo:hi]) for a in (q, k, v, dout)]
        o1, l1 = ka.attention_forward(*part[:3])
        g1 = ka.attention_backward(*part[:3], o1, l1, part[3])
        scale = np.abs(v).max()
        np.testing.assert_allclose(out[:, lo:hi], o1, rtol=0, atol=2e-6 * scale)
        for got, want in zip(grads, g1):
            np.testing.assert_allclose(got[:, lo:hi], want, rtol=0,
                                       atol=1e-5 * max(np.abs(want).max(), 1e-30))


def test_fused_rows_take_the_same_first_keys(simd_path, rng):
    """attention_{forward,backward}_qkv (GPT-2's fused rows) with kv_start give
    the bits of the separate-array kernels with it."""
    b, t, h, d = 2, 37, 3, 8
    q, k, v, dout = random_qkv(rng, b, t, h, h, d)
    qkv = np.ascontiguousarray(np.concatenate([a.reshape(b, t, -1) for a in (q, k, v)], -1))
    starts = ka.document_starts(random_documents(rng, b, t))
    out, lse = ka.attention_forward(q, k, v, kv_start=starts)
    fo, fl = ka.attention_forward_qkv(qkv, h, kv_start=starts)
    np.testing.assert_array_equal(fo, out)
    np.testing.assert_array_equal(fl, lse)
    dq, dk, dv = ka.attention_backward(q, k, v, out, lse, dout, kv_start=starts)
    dqkv = ka.attention_backward_qkv(qkv, h, fo, fl, dout, kv_start=starts)
    np.testing.assert_array_equal(dqkv, np.concatenate([g.reshape(b, t, -1)
                                                        for g in (dq, dk, dv)], -1))
    with pytest.raises(ValueError, match="kv_start"):
        ka.attention_forward_qkv(qkv, h, kv_start=starts[:, :-1])


def test_one_and_two_threads_bit_identical(restore_threads, rng):
    q, k, v, dout = random_qkv(rng, 2, 200, 4, 2, 32)
    starts = ka.document_starts(random_documents(rng, 2, 200))
    results = []
    for n in (1, 2):
        kernels.set_num_threads(n)
        out, lse = ka.attention_forward(q, k, v, kv_start=starts)
        results.append((out, lse, *ka.attention_backward(q, k, v, out, lse, dout,
                                                         kv_start=starts)))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_starts_helpers():
    np.testing.assert_array_equal(ka.window_starts(2, 6, 3), [[0, 0, 0, 1, 2, 3]] * 2)
    np.testing.assert_array_equal(ka.document_starts([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]]),
                                  [[0, 0, 2, 2, 2, 5], [0] * 6])
    assert ka.window_starts(1, 4, 10).dtype == np.int32
    with pytest.raises(ValueError, match="window"):
        ka.window_starts(1, 4, 0)
    with pytest.raises(ValueError, match="doc_ids"):
        ka.document_starts(np.zeros(4, dtype=np.int32))


@pytest.mark.parametrize("bad,match", [
    (np.zeros((1, 5), np.int32), "shape"),
    (np.zeros((1, 6), np.int64), "int32"),
    (np.array([[0, 0, 3, 0, 0, 0]], np.int32), r"\[0, its position\]"),
    (np.array([[0, 0, -1, 0, 0, 0]], np.int32), r"\[0, its position\]"),
    (np.array([[0, 1, 1, 0, 2, 2]], np.int32), "never decrease"),
])
def test_bad_starts_are_refused_before_writing(bad, match, rng):
    q, k, v, dout = random_qkv(rng, 1, 6, 2, 1, 8)
    out = np.full((1, 6, 2, 8), 7.0, np.float32)
    with pytest.raises((ValueError, TypeError), match=match):
        ka.attention_forward(q, k, v, out=out, kv_start=bad)
    assert (out == 7.0).all()
    good_out, lse = ka.attention_forward(q, k, v)
    dq = np.full_like(q, 7.0)
    with pytest.raises((ValueError, TypeError), match=match):
        ka.attention_backward(q, k, v, good_out, lse, dout, dq=dq, kv_start=bad)
    assert (dq == 7.0).all()
