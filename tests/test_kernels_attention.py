"""The fused causal attention and rotary embedding kernels (ggmlopt.kernels_attention)
against float64 NumPy references of their formulas, on every SIMD path and
awkward sizes; fused q|k|v rows; NaN/inf rows; 1 vs 2 threads bit for bit; bad
arguments refused before anything is written."""
import numpy as np
import pytest

from ggmlopt import kernels
from ggmlopt import kernels_attention as ka


def attention_reference(q, k, v, dout):
    """Unfused float64 causal attention with grouped heads (HF's repeat_kv):
    (out, lse, dq, dk, dv)."""
    q, k, v, dout = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    b, t, h, d = q.shape
    group = h // k.shape[2]
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scale = 1.0 / np.sqrt(d)
    s = np.einsum("bihd,bjhd->bhij", q, kk) * scale
    mask = np.tril(np.ones((t, t), dtype=bool))
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    p = e / total
    # masked pairs left out, not multiplied by 0: a row never sees a later inf
    terms = p[..., None] * vv.transpose(0, 2, 1, 3)[:, :, None]
    out = np.where(mask[..., None], terms, 0.0).sum(3).transpose(0, 2, 1, 3)
    lse = (m + np.log(total))[..., 0]
    dp = np.einsum("bihd,bjhd->bhij", dout, vv)
    delta = np.einsum("bihd,bihd->bhi", dout, out)[..., None]
    ds = p * (dp - delta) * scale
    dq = np.einsum("bhij,bjhd->bihd", ds, kk)
    dk = np.einsum("bhij,bihd->bjhd", ds, q).reshape(b, t, -1, group, d).sum(3)
    dv = np.einsum("bhij,bihd->bjhd", p, dout).reshape(b, t, -1, group, d).sum(3)
    return out, lse, dq, dk, dv


def assert_close(got, want, scale, rtol, what):
    err = np.abs(np.asarray(got, np.float64) - want).max() if want.size else 0.0
    assert err <= rtol * scale, f"{what}: error {err:.3g} above {rtol} x scale {scale:.3g}"


def random_qkv(rng, b, t, h, hkv, d, magnitude=1.0):
    q = (rng.standard_normal((b, t, h, d)) * magnitude).astype(np.float32)
    k = (rng.standard_normal((b, t, hkv, d)) * magnitude).astype(np.float32)
    v = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
    dout = rng.standard_normal((b, t, h, d)).astype(np.float32)
    return q, k, v, dout


SHAPES = [(b, t, h, hkv, d)
          for (b, h, hkv) in [(2, 4, 1), (1, 4, 2), (2, 4, 4)]
          for t in (1, 7, 64, 129)
          for d in (8, 16, 64)] + [
    (1, 33, 2, 2, 3), (1, 40, 2, 1, 20), (1, 17, 2, 2, 256), (1, 300, 1, 1, 33),
    (2, 130, 3, 1, 128),
    # widths whose last columns are two or three vectors of 8 or 16 lanes (stories15M's
    # 48, Phi-2's 80): the accumulations' narrow tails
    (2, 70, 2, 1, 24), (1, 37, 2, 1, 48), (1, 29, 2, 2, 56), (1, 45, 3, 1, 80)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-t{}-h{}-kv{}-d{}".format(*s))
def test_attention_matches_float64_reference(simd_path, shape, rng):
    q, k, v, dout = random_qkv(rng, *shape)
    out, lse = ka.attention_forward(q, k, v)
    dq, dk, dv = ka.attention_backward(q, k, v, out, lse, dout)
    ro, rlse, rdq, rdk, rdv = attention_reference(q, k, v, dout)
    # |o| <= max|v|; the gradients' terms are bounded by the tensors' scales
    vscale = np.abs(v).max()
    assert_close(out, ro, vscale, 2e-6, "out")
    assert_close(lse, rlse, np.abs(rlse).max() + 1, 1e-6, "lse")
    gscale = max(np.abs(rdq).max(), np.abs(rdk).max(), np.abs(rdv).max())
    for got, want, name in ((dq, rdq, "dq"), (dk, rdk, "dk"), (dv, rdv, "dv")):
        assert_close(got, want, gscale, 1e-5, name)


@pytest.mark.parametrize("magnitude", [30.0, 1e3])
def test_large_scores_stay_finite(simd_path, magnitude, rng):
    """Scores of 1e3..1e7: the online softmax keeps its maximum out, no overflow;
    the error follows the float rounding of the scores themselves."""
    q, k, v, dout = random_qkv(rng, 2, 45, 2, 1, 16, magnitude)
    out, lse = ka.attention_forward(q, k, v)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    ro, _rlse, *_ = attention_reference(q, k, v, dout)
    score_scale = magnitude * magnitude * 16 / 4  # sum |q||k| * scale, roughly
    # a rounding of eps * score_scale in a score moves p by as much, relatively
    assert_close(out, ro, np.abs(v).max(), 1e-6 * max(1.0, score_scale), "out")
    dq, dk, dv = ka.attention_backward(q, k, v, out, lse, dout)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()


def test_nan_and_inf_follow_the_reference(simd_path, rng):
    """A NaN in q row i spoils out row i only; a NaN in k or v row j spoils rows
    i >= j (the rows that see it); +inf scores give NaN (inf - inf), as the
    reference; rows before the bad key keep their values."""
    q, k, v, dout = random_qkv(rng, 1, 20, 2, 1, 8)
    q[0, 5, 0, 3] = np.nan
    k[0, 9, 0, 1] = np.nan
    v[0, 14, 0, 2] = np.inf
    out, lse = ka.attention_forward(q, k, v)
    with np.errstate(invalid="ignore"):
        ro, rlse, *_ = attention_reference(q, k, v, dout)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ro))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(rlse))
    ok = ~np.isnan(ro)
    np.testing.assert_allclose(out[ok], ro[ok], rtol=0, atol=2e-6 * np.abs(v[np.isfinite(v)]).max())
    q2, k2, v2, _ = random_qkv(rng, 1, 6, 1, 1, 8)
    q2[0, 3, 0, 0] = np.inf
    k2[0, 1, 0, 0] = 1.0
    out2, _ = ka.attention_forward(q2, k2, v2)
    with np.errstate(invalid="ignore"):
        ro2, *_ = attention_reference(q2, k2, v2, np.zeros_like(q2))
    np.testing.assert_array_equal(np.isnan(out2), np.isnan(ro2))


@pytest.mark.parametrize("hkv", [1, 3])
def test_fused_qkv_rows_match_separate(simd_path, hkv, rng):
    b, t, h, d = 2, 37, 3, 16
    q, k, v, dout = random_qkv(rng, b, t, h, hkv, d)
    qkv = np.concatenate([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], axis=2)
    out, lse = ka.attention_forward(q, k, v)
    fout, flse = ka.attention_forward_qkv(qkv, h, hkv)
    np.testing.assert_array_equal(fout, out)
    np.testing.assert_array_equal(flse, lse)
    dq, dk, dv = ka.attention_backward(q, k, v, out, lse, dout)
    dqkv = ka.attention_backward_qkv(qkv, h, fout, flse, dout, hkv)
    np.testing.assert_array_equal(dqkv[..., :h * d].reshape(dq.shape), dq)
    np.testing.assert_array_equal(dqkv[..., h * d:(h + hkv) * d].reshape(dk.shape), dk)
    np.testing.assert_array_equal(dqkv[..., (h + hkv) * d:].reshape(dv.shape), dv)


@pytest.mark.parametrize("shape", [(3, 130, 4, 2, 64), (1, 300, 2, 1, 16), (8, 33, 2, 2, 8)])
def test_one_and_two_threads_bit_identical(shape, restore_threads, rng):
    q, k, v, dout = random_qkv(rng, *shape)
    results = []
    for n in (1, 2):
        kernels.set_num_threads(n)
        out, lse = ka.attention_forward(q, k, v)
        results.append((out, lse, *ka.attention_backward(q, k, v, out, lse, dout)))
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_empty_batch_and_long_sequence(rng):
    q, k, v, dout = random_qkv(rng, 0, 5, 2, 1, 8)
    out, lse = ka.attention_forward(q, k, v)
    assert out.shape == (0, 5, 2, 8) and lse.shape == (0, 2, 5)
    q, k, v, dout = random_qkv(rng, 1, 1100, 1, 1, 8)
    out, lse = ka.attention_forward(q, k, v)
    ro, _rlse, *_ = attention_reference(q, k, v, dout)
    assert_close(out, ro, np.abs(v).max(), 2e-6, "out")


# ---- rotary embedding ------------------------------------------------------------

def rope_reference(x, pos, base):
    """HF's rotate_half form in float64 from HF's float32 angles (float32
    inv_freq times float32 position)."""
    d, t = x.shape[-1], x.shape[1]
    exponent = np.arange(0, d, 2).astype(np.float32) / np.float32(d)
    inv_freq = (np.float32(1.0) / (np.float32(base) ** exponent)).astype(np.float32)
    angles = (np.arange(pos, pos + t, dtype=np.float32)[:, None] * inv_freq).astype(np.float64)
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)[None, :, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)[None, :, None, :]
    x = x.astype(np.float64)
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * cos + rot * sin


@pytest.mark.parametrize("d", [2, 8, 16, 18, 64, 128])
@pytest.mark.parametrize("pos", [0, 3, 2048, 5000])
def test_rope_matches_reference(simd_path, d, pos, rng):
    x = rng.standard_normal((2, 7, 3, d)).astype(np.float32)
    cos, sin = ka.rope_table(d, pos + 7)
    y = ka.rope(x, cos, sin, pos)
    want = rope_reference(x, pos, 10000.0)
    # each output is x1 c - x2 s: a few roundings of |x1| + |x2|
    scale = np.abs(x[..., : d // 2]) + np.abs(x[..., d // 2:])
    scale = np.concatenate([scale, scale], axis=-1)
    assert (np.abs(y - want) <= 3e-7 * scale + 1e-30).all()
    back = ka.rope(y, cos, sin, pos, inverse=True)
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-6 * np.abs(x).max())
    inplace = x.copy()
    assert ka.rope(inplace, cos, sin, pos, out=inplace) is inplace
    np.testing.assert_array_equal(inplace, y)


def test_rope_table_matches_hugging_face():
    # Hugging Face's inv_freq comes from torch's float32 pow, whose last bit depends
    # on the CPU's vector path (AVX-512's differs from AVX2's): each side's pow is within
    # an ulp (Sleef's and NumPy's float32 pow) and its reciprocal within half of one, so
    # ours must be within three ulps of theirs; the tables then differ by no more than
    # that difference carried to each angle (position x it), the angles' own rounding
    # and the cos/sin values' rounding (half an ulp of 1 on each side)
    torch = pytest.importorskip("torch")
    for d in (8, 16, 64, 128):
        for base in (10000.0, 500000.0):
            inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
            positions = torch.arange(0, 4100).float()
            freqs = (inv_freq[:, None] @ positions[None, :]).T
            cos, sin = ka.rope_table(d, 4100, base)
            ours = (np.float32(1.0) / (np.float32(base) ** (
                np.arange(0, d, 2).astype(np.float32) / np.float32(d)))).astype(np.float32)
            theirs = inv_freq.numpy()
            assert np.all(np.abs(ours - theirs) <= 3 * np.spacing(theirs))
            angles = freqs.numpy()
            bound = (positions.numpy()[:, None] * np.abs(ours - theirs)[None, :]
                     + np.spacing(np.abs(angles)) + 2.0 ** -23)
            assert np.all(np.abs(cos - freqs.cos().numpy()) <= bound)
            assert np.all(np.abs(sin - freqs.sin().numpy()) <= bound)


# ---- bad arguments ---------------------------------------------------------------

def test_bad_arguments_raise_before_writing(rng):
    q, k, v, dout = random_qkv(rng, 1, 5, 4, 2, 8)
    out = np.full((1, 5, 4, 8), 7, np.float32)
    with pytest.raises(TypeError, match="q"):
        ka.attention_forward(q.astype(np.float64), k, v)
    with pytest.raises(TypeError, match="k"):
        ka.attention_forward(q, list(k), v)
    with pytest.raises(ValueError, match="q"):
        ka.attention_forward(q[0], k, v)
    with pytest.raises(ValueError, match="k"):
        ka.attention_forward(q, k[:, :4], v)
    with pytest.raises(ValueError, match="v"):
        ka.attention_forward(q, k, v[..., :4])
    with pytest.raises(ValueError, match="multiple"):
        ka.attention_forward(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
    with pytest.raises(ValueError, match="C-contiguous"):
        ka.attention_forward(q[:, ::-1], k, v)
    with pytest.raises(ValueError, match="out"):
        ka.attention_forward(q, k, v, out=np.empty((1, 5, 4, 7), np.float32))
    with pytest.raises(ValueError, match="overlap"):
        ka.attention_forward(q, k, v, out=q)
    with pytest.raises(ValueError, match="head_dim"):
        big = np.zeros((1, 2, 1, 300), np.float32)
        ka.attention_forward(big, big, big)
    out, lse = ka.attention_forward(q, k, v, out=out)
    with pytest.raises(ValueError, match="lse"):
        ka.attention_backward(q, k, v, out, lse[:, :2], dout)
    with pytest.raises(ValueError, match="grad_out"):
        ka.attention_backward(q, k, v, out, lse, dout[:, :4])
    dq = np.full_like(q, 7)
    with pytest.raises(ValueError, match="overlap"):
        ka.attention_backward(q, k, v, out, lse, dout, dq=dq, dk=dq[:, :, :2].copy(),
                              dv=dq.reshape(-1)[:80].reshape(v.shape))
    assert (dq == 7).all()
    with pytest.raises(ValueError, match="qkv"):
        ka.attention_forward_qkv(np.zeros((1, 5, 31), np.float32), 4, 2)
    with pytest.raises(ValueError, match="n_kv_heads"):
        ka.attention_forward_qkv(np.zeros((1, 5, 40), np.float32), 4, 3)
    with pytest.raises(TypeError, match="n_heads"):
        ka.attention_forward_qkv(np.zeros((1, 5, 40), np.float32), 4.0)


def test_rope_bad_arguments(rng):
    x = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
    cos, sin = ka.rope_table(8, 6)
    with pytest.raises(ValueError, match="cos"):
        ka.rope(x, cos, sin, pos=3)  # positions 3..6 need 7 rows
    with pytest.raises(ValueError, match="pos"):
        ka.rope(x, cos, sin, pos=-1)
    with pytest.raises(ValueError, match="even"):
        ka.rope(np.zeros((1, 4, 2, 7), np.float32), cos, sin)
    with pytest.raises(ValueError, match="sin"):
        ka.rope(x, cos, sin[:, :3])
    with pytest.raises(TypeError, match="x"):
        ka.rope(x.astype(np.float16), cos, sin)
    cos16, sin16 = ka.rope_table(8, 16)
    with pytest.raises(ValueError, match="overlap"):
        ka.rope(x, cos16, sin16, out=cos16.reshape(1, 4, 2, 8))
    with pytest.raises(ValueError, match="head_dim"):
        ka.rope_table(7, 4)
    with pytest.raises(ValueError, match="base"):
        ka.rope_table(8, 4, base=1.0)


# Fewer (batch, kv head) items than the threads share evenly: the backward runs in
# waves of key tiles (their ds stored, then each query block's dq), with the same
# additions in the same order as one item per (batch, kv head): the same bits.
SPLIT_SHAPES = [(1, 300, 9, 3, 64), (1, 130, 4, 1, 16), (1, 257, 2, 2, 8), (2, 200, 6, 1, 24),
                (1, 65, 3, 1, 33)]


@pytest.mark.parametrize("shape", SPLIT_SHAPES)
@pytest.mark.parametrize("packed", [False, True])
def test_backward_in_waves_bit_identical_on_any_threads(shape, packed, restore_threads, rng):
    from test_kernels_attention_ranged import masked_reference
    q, k, v, dout = random_qkv(rng, *shape)
    b, t = shape[:2]
    starts = None
    if packed:   # documents of uneven lengths packed into each window
        cuts = np.sort(rng.choice(np.arange(1, t), size=min(3, t - 1), replace=False))
        starts = np.zeros((b, t), np.int32)
        for c in cuts:
            starts[:, c:] = c
    kernels.set_num_threads(1)
    out, lse = ka.attention_forward(q, k, v, kv_start=starts)
    want = ka.attention_backward(q, k, v, out, lse, dout, kv_start=starts)
    for n in (2, 3, 4, 7):
        kernels.set_num_threads(n)
        got = ka.attention_backward(q, k, v, out, lse, dout, kv_start=starts)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert np.array_equal(g, w), f"{name} on {n} threads"
    _, _, rdq, rdk, rdv = masked_reference(q, k, v, dout, starts if packed else
                                           np.zeros((b, t), np.int32))
    scale = max(np.abs(rdq).max(), np.abs(rdk).max(), np.abs(rdv).max())
    for name, g, r in zip(("dq", "dk", "dv"), got, (rdq, rdk, rdv)):
        assert_close(g, r, scale, 1e-5, name)
