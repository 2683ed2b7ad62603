"""Gemma 2's soft cap on the attention scores (``softcap=`` of
ggmlopt.kernels_attention): each score s becomes c * tanh(s / c) before the
softmax, in the forward, the backward (through the cap's slope 1 - tanh^2),
the fused q|k|v rows and the decode step, against a float64 NumPy reference
on every SIMD path, with plain, windowed and packed rows.

Tolerances are those of the uncapped kernels' tests (test_kernels_attention)
plus the cap's own: a capped score is c * tanh(s / c) with tanh within a few
float32 ulps, so within 4 * 2^-24 * c of the reference, which moves each
probability by as much relatively; the score's own rounding only shrinks
through the slope (<= 1)."""
import numpy as np
import pytest

from ggmlopt import kernels
from ggmlopt import kernels_attention as ka

U = 2.0 ** -24


def capped_reference(q, k, v, dout, cap, starts=None):
    """Unfused float64 causal attention with grouped heads and scores capped
    at cap (None: no cap), keys before starts[b, i] masked: (out, lse, dq, dk, dv)."""
    q, k, v, dout = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    b, t, h, d = q.shape
    group = h // k.shape[2]
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scale = 1.0 / np.sqrt(d)
    raw = np.einsum("bihd,bjhd->bhij", q, kk) * scale
    if cap is None:
        s, slope = raw, np.ones_like(raw)
    else:
        th = np.tanh(raw / cap)
        s, slope = cap * th, 1.0 - th * th
    j = np.arange(t)
    first = np.zeros((b, t), np.int64) if starts is None else np.asarray(starts, np.int64)
    mask = (j[None, None, :] <= j[None, :, None]) & (j[None, None, :] >= first[:, :, None])
    mask = mask[:, None]
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    p = e / total
    out = np.einsum("bhij,bjhd->bihd", p, vv)
    lse = (m + np.log(total))[..., 0]
    dp = np.einsum("bihd,bjhd->bhij", dout, vv)
    delta = np.einsum("bihd,bihd->bhi", dout, out)[..., None]
    ds = p * (dp - delta) * slope * scale
    dq = np.einsum("bhij,bjhd->bihd", ds, kk)
    dk = np.einsum("bhij,bihd->bjhd", ds, q).reshape(b, t, -1, group, d).sum(3)
    dv = np.einsum("bhij,bihd->bjhd", p, dout).reshape(b, t, -1, group, d).sum(3)
    return out, lse, dq, dk, dv, np.abs(raw).max(initial=0.0)


def random_qkv(rng, b, t, h, hkv, d, magnitude):
    q = (rng.standard_normal((b, t, h, d)) * magnitude).astype(np.float32)
    k = (rng.standard_normal((b, t, hkv, d)) * magnitude).astype(np.float32)
    v = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
    dout = rng.standard_normal((b, t, h, d)).astype(np.float32)
    return q, k, v, dout


def check(got, want, tol, what):
    err = np.abs(np.asarray(got, np.float64) - want).max() if want.size else 0.0
    assert err <= tol, f"{what}: error {err:.3g} above {tol:.3g}"


def check_all(q, k, v, dout, cap, starts, out, lse, grads):
    ro, rlse, rdq, rdk, rdv, smax = capped_reference(q, k, v, dout, cap, starts)
    # the uncapped tests' bounds, the largest score's rounding (3e-7 S as the C tests
    # allow) and the cap's tanh (4 u c)
    spread = 3e-7 * smax + (0.0 if cap is None else 4 * U * cap)
    check(out, ro, (2e-6 + spread) * np.abs(v).max(), "out")
    check(lse, rlse, 1e-6 * (np.abs(rlse).max() + 1) + spread, "lse")
    gscale = max(np.abs(rdq).max(), np.abs(rdk).max(), np.abs(rdv).max())
    for got, want, name in zip(grads, (rdq, rdk, rdv), ("dq", "dk", "dv")):
        check(got, want, (1e-5 + 10 * spread) * gscale, name)


SHAPES = [(2, 37, 4, 2, 24), (1, 70, 3, 1, 48), (1, 5, 2, 2, 7), (2, 130, 4, 4, 16),
          (1, 1, 2, 1, 8), (1, 65, 8, 2, 256)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-t{}-h{}-kv{}-d{}".format(*s))
@pytest.mark.parametrize("cap", [0.5, 5.0, 50.0])
def test_capped_attention_matches_float64_reference(simd_path, shape, cap, rng):
    # magnitude 2: scores of a few tens, so the cap bends some and leaves others
    q, k, v, dout = random_qkv(rng, *shape, magnitude=2.0)
    out, lse = ka.attention_forward(q, k, v, softcap=cap)
    grads = ka.attention_backward(q, k, v, out, lse, dout, softcap=cap)
    check_all(q, k, v, dout, cap, None, out, lse, grads)


@pytest.mark.parametrize("window", [1, 5, 33])
def test_capped_sliding_window_and_packed_documents(simd_path, window, rng):
    b, t = 2, 90
    q, k, v, dout = random_qkv(rng, b, t, 4, 2, 16, magnitude=2.0)
    starts = ka.window_starts(b, t, window)
    out, lse = ka.attention_forward(q, k, v, kv_start=starts, softcap=8.0)
    grads = ka.attention_backward(q, k, v, out, lse, dout, kv_start=starts, softcap=8.0)
    check_all(q, k, v, dout, 8.0, starts, out, lse, grads)
    doc_ids = np.cumsum(rng.random((b, t)) < 1 / 9, axis=1).astype(np.int32)
    docs = ka.document_starts(doc_ids)
    out, lse = ka.attention_forward(q, k, v, kv_start=docs, softcap=8.0)
    grads = ka.attention_backward(q, k, v, out, lse, dout, kv_start=docs, softcap=8.0)
    check_all(q, k, v, dout, 8.0, docs, out, lse, grads)


def test_a_cap_changes_the_result_and_none_is_the_plain_kernel(rng):
    q, k, v, _ = random_qkv(rng, 1, 40, 2, 1, 16, magnitude=3.0)
    plain = ka.attention_forward(q, k, v)
    none = ka.attention_forward(q, k, v, softcap=None)
    assert all(np.array_equal(a, b) for a, b in zip(plain, none))
    capped, _ = ka.attention_forward(q, k, v, softcap=1.0)
    assert np.abs(capped - plain[0]).max() > 1e-2   # scores of tens, capped at 1
    # a cap far above every score leaves them within float rounding of the plain ones
    wide, _ = ka.attention_forward(q, k, v, softcap=1e6)
    check(wide, plain[0].astype(np.float64), 1e-5 * np.abs(v).max(), "wide cap")


@pytest.mark.parametrize("hkv", [1, 2])
def test_capped_fused_rows_match_separate(simd_path, hkv, rng):
    b, t, h, d = 2, 45, 4, 24
    qkv = (rng.standard_normal((b, t, (h + 2 * hkv) * d)) * 2).astype(np.float32)
    q = np.ascontiguousarray(qkv[..., :h * d].reshape(b, t, h, d))
    k = np.ascontiguousarray(qkv[..., h * d:(h + hkv) * d].reshape(b, t, hkv, d))
    v = np.ascontiguousarray(qkv[..., (h + hkv) * d:].reshape(b, t, hkv, d))
    dout = rng.standard_normal((b, t, h, d)).astype(np.float32)
    out, lse = ka.attention_forward(q, k, v, softcap=4.0)
    fo, fl = ka.attention_forward_qkv(qkv, h, hkv, softcap=4.0)
    assert np.array_equal(out, fo) and np.array_equal(lse, fl)
    dq, dk, dv = ka.attention_backward(q, k, v, out, lse, dout, softcap=4.0)
    dqkv = ka.attention_backward_qkv(qkv, h, fo, fl, dout, n_kv_heads=hkv, softcap=4.0)
    assert np.array_equal(dqkv[..., :h * d].reshape(dq.shape), dq)
    assert np.array_equal(dqkv[..., h * d:(h + hkv) * d].reshape(dk.shape), dk)
    assert np.array_equal(dqkv[..., (h + hkv) * d:].reshape(dv.shape), dv)


@pytest.mark.parametrize("shape", [(1, 300, 9, 3, 64), (1, 130, 4, 1, 16)])
def test_capped_backward_bit_identical_on_any_threads(shape, restore_threads, rng):
    q, k, v, dout = random_qkv(rng, *shape, magnitude=2.0)
    kernels.set_num_threads(1)
    out, lse = ka.attention_forward(q, k, v, softcap=6.0)
    want = ka.attention_backward(q, k, v, out, lse, dout, softcap=6.0)
    for n in (2, 3):
        kernels.set_num_threads(n)
        assert np.array_equal(ka.attention_forward(q, k, v, softcap=6.0)[0], out)
        got = ka.attention_backward(q, k, v, out, lse, dout, softcap=6.0)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert np.array_equal(g, w), f"{name} on {n} threads"
    check_all(q, k, v, dout, 6.0, None, out, lse, got)


@pytest.mark.parametrize("length,start", [(1, 0), (7, 0), (17, 0), (33, 5), (70, 40)])
def test_capped_decode_matches_the_reference_row(simd_path, length, start, rng):
    b, h, hkv, d, max_len = 2, 6, 2, 24, 80
    ck = (rng.standard_normal((b, max_len, hkv, d)) * 2).astype(np.float32)
    cv = rng.standard_normal((b, max_len, hkv, d)).astype(np.float32)
    q = (rng.standard_normal((b, h, d)) * 2).astype(np.float32)
    got = ka.attention_decode(q, ck, cv, length, start=start, softcap=3.0)
    keys, values = ck[:, start:length], cv[:, start:length]
    group = h // hkv
    s = np.einsum("bhd,blhd->bhl", q.astype(np.float64),
                  np.repeat(keys, group, axis=2).astype(np.float64)) / np.sqrt(d)
    s = 3.0 * np.tanh(s / 3.0)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bhl,blhd->bhd", p, np.repeat(values, group, axis=2).astype(np.float64))
    # scores within (d + 8) u of their magnitude plus the tanh's 4 u c; weights
    # within twice that and (length + 8) u; values at most max|v|
    smax = np.abs(s).max()
    tol = (2 * (d + 8) * U * smax + 8 * U * 3.0 + 3 * (length + 8) * U) * np.abs(cv).max()
    check(got.reshape(b, h, d), want, tol, "decode")


@pytest.mark.parametrize("bad,kind", [(0.0, ValueError), (-1.0, ValueError),
                                      (float("nan"), ValueError), (float("inf"), ValueError),
                                      ("5", TypeError), (True, TypeError)])
def test_bad_softcap_refused_before_writing(bad, kind, rng):
    q, k, v, dout = random_qkv(rng, 1, 9, 2, 1, 8, magnitude=1.0)
    out = np.full(q.shape, 7.0, np.float32)
    with pytest.raises(kind, match="softcap"):
        ka.attention_forward(q, k, v, out=out, softcap=bad)
    assert (out == 7.0).all()
    o, lse = ka.attention_forward(q, k, v)
    with pytest.raises(kind, match="softcap"):
        ka.attention_backward(q, k, v, o, lse, dout, softcap=bad)
    ck = np.zeros((1, 4, 1, 8), np.float32)
    with pytest.raises(kind, match="softcap"):
        ka.attention_decode(q[:, 0], ck, ck, 2, softcap=bad)
