"""RMSNorm and LayerNorm kernels (kernels_norm) against float64 references on
every SIMD path: awkward row lengths, unaligned arrays, rows of NaN, inf, huge
and tiny values; parameter gradients the same bits on 1 and 2 threads; bad
input refused before any work; torch.nn.functional as the oracle.

Bounds: outputs within 2e-6 of |y|; input gradients within 4e-6 of the sum of
the magnitudes of their terms; parameter gradients within 1e-5 of the sum of
the magnitudes of the added terms (float sums of 64 rows, then double).
"""
import numpy as np
import pytest

from ggmlopt import kernels, kernels_norm

F32 = np.float32
DIMS = [1, 2, 7, 8, 9, 16, 17, 33, 100]
NROWS = [1, 3, 70]


def rms_ref(x, w, eps):
    x = x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        return x * rstd * w, rstd[..., 0]


def ln_ref(x, w, b, eps):
    x = x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        mean = x.mean(axis=-1, keepdims=True)
        rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
        y = (x - mean) * rstd * w
        return (y if b is None else y + b), mean[..., 0], rstd[..., 0]


def norm_backward_ref(x, w, mean, rstd, dy, layer):
    """(dx, dx_scale, dw_terms, db_terms) in float64 from the saved statistics."""
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        xh = (x - (mean[..., None] if layer else 0.0)) * rstd[..., None]
        g = dy * w
        d = x.shape[-1]
        a = g.mean(axis=-1, keepdims=True) if layer else 0.0
        c = (g * xh).mean(axis=-1, keepdims=True)
        dx = rstd[..., None] * (g - a - xh * c)
        scale = np.abs(rstd[..., None]) * (np.abs(g) + np.abs(g).sum(-1, keepdims=True) / d
                                           + np.abs(xh) * np.abs(g * xh).mean(-1, keepdims=True))
        return dx, scale, dy * xh, dy


def assert_close(got, want, tol, what):
    got = np.asarray(got, np.float64)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{what}: NaN where the reference has none"
    with np.errstate(invalid="ignore"):
        ok = nan | (np.abs(got - want) <= tol) | ((got == want) & np.isinf(want))
    if not ok.all():
        i = np.flatnonzero(~ok.reshape(-1))[0]
        tol_i = np.broadcast_to(tol, want.shape).reshape(-1)[i]
        raise AssertionError(f"{what}: element {i}: got {got.reshape(-1)[i]!r}, want "
                             f"{want.reshape(-1)[i]!r} within {tol_i!r}")


def make_rows(rng, nrows, dim, special=False):
    x = rng.standard_normal((nrows, dim)).astype(F32) * F32(3)
    if special and nrows >= 6:
        x[0, 0] = np.nan
        x[1, dim // 2] = np.inf
        x[2] *= F32(1e30)
        x[3] *= F32(1e-30)
        x[4] = F32(2.5)  # constant row: variance 0
        x[5, -1] = -np.inf
    return x


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("nrows", NROWS)
def test_rmsnorm_matches_float64(simd_path, rng, place, nrows, dim):
    x = place(make_rows(rng, nrows, dim, special=True), 1)
    w = place(rng.uniform(-2, 2, dim).astype(F32), 2)
    dy = place(rng.standard_normal((nrows, dim)).astype(F32), 3)
    y, rstd = kernels_norm.rmsnorm(x, w, 1e-6)
    y_ref, r_ref = rms_ref(x, w, 1e-6)
    assert_close(rstd, r_ref, 2e-7 * np.abs(r_ref), "rstd")
    assert_close(y, y_ref, 2e-6 * np.abs(y_ref) + 1e-37, "y")
    dw0 = rng.standard_normal(dim).astype(F32)
    dw = dw0.copy()
    dx = kernels_norm.rmsnorm_backward(x, w, rstd, dy, grad_weight=dw)
    dx_ref, scale, tw, _ = norm_backward_ref(x, w, None, rstd, dy, False)
    assert_close(dx, dx_ref, 4e-6 * scale + 1e-37, "dx")
    assert_close(dw, dw0 + tw.sum(0), 1e-5 * (np.abs(dw0) + np.abs(tw).sum(0)) + 1e-37, "dw")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("nrows", NROWS)
def test_layernorm_matches_float64(simd_path, rng, place, nrows, dim, bias):
    x = place(make_rows(rng, nrows, dim, special=True) + F32(5), 1)
    w = place(rng.uniform(-2, 2, dim).astype(F32), 2)
    b = place(rng.uniform(-1, 1, dim).astype(F32), 3) if bias else None
    dy = place(rng.standard_normal((nrows, dim)).astype(F32), 1)
    y, mean, rstd = kernels_norm.layernorm(x, w, b, 1e-5)
    y_ref, m_ref, r_ref = ln_ref(x, w, b, 1e-5)
    assert_close(mean, m_ref, 2e-7 * np.abs(m_ref), "mean")
    assert_close(rstd, r_ref, 4e-7 * np.abs(r_ref), "rstd")
    # y: the rounding of (x - mean) * rstd * w, and of mean (2^-24 |mean| rstd |w|)
    y_tol = 2e-6 * np.abs(y_ref) + 2e-7 * np.abs(m_ref * r_ref)[:, None] * np.abs(w) + 1e-37
    if b is not None:
        y_tol += 2e-7 * np.abs(b)
    assert_close(y, y_ref, y_tol, "y")
    dw0 = rng.standard_normal(dim).astype(F32)
    db0 = rng.standard_normal(dim).astype(F32)
    dw, db = dw0.copy(), db0.copy()
    dx = kernels_norm.layernorm_backward(x, w, mean, rstd, dy, grad_weight=dw,
                                         grad_bias=db if bias else None)
    dx_ref, scale, tw, tb = norm_backward_ref(x, w, mean, rstd, dy, True)
    assert_close(dx, dx_ref, 4e-6 * scale + 1e-37, "dx")
    assert_close(dw, dw0 + tw.sum(0), 1e-5 * (np.abs(dw0) + np.abs(tw).sum(0)) + 1e-37, "dw")
    if bias:
        assert_close(db, db0 + tb.sum(0), 1e-5 * (np.abs(db0) + np.abs(tb).sum(0)), "db")


def test_paths_agree_and_leading_axes(rng):
    """(..., dim) inputs are rows of their last axis; every path gives the scalar
    path's answer to a few ulp."""
    x = rng.standard_normal((2, 3, 5, 37)).astype(F32)
    w = rng.standard_normal(37).astype(F32)
    previous = kernels.use_simd("scalar")
    try:
        y0, _r0 = kernels_norm.rmsnorm(x, w)
    finally:
        kernels.use_simd(previous)
    y, r = kernels_norm.rmsnorm(x, w)
    assert y.shape == x.shape and r.shape == (30,)
    np.testing.assert_allclose(y, y0, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(y, rms_ref(x, w, 1e-6)[0], rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dim", [288, 768, 33])
def test_threads_give_the_same_bits(restore_threads, rng, dim):
    x = rng.standard_normal((2048, dim)).astype(F32)
    w = rng.standard_normal(dim).astype(F32)
    b = rng.standard_normal(dim).astype(F32)
    dy = rng.standard_normal((2048, dim)).astype(F32)
    results = []
    for t in (1, 2):
        kernels.set_num_threads(t)
        y, r = kernels_norm.rmsnorm(x, w)
        dw = np.ones(dim, F32)
        dx = kernels_norm.rmsnorm_backward(x, w, r, dy, grad_weight=dw)
        yl, m, rl = kernels_norm.layernorm(x, w, b)
        dwl, dbl = np.ones(dim, F32), np.ones(dim, F32)
        dxl = kernels_norm.layernorm_backward(x, w, m, rl, dy, grad_weight=dwl, grad_bias=dbl)
        results.append([y, r, dw, dx, yl, m, rl, dwl, dbl, dxl])
    for a, b_ in zip(*results):
        assert a.tobytes() == b_.tobytes()


def test_backward_skips_what_is_not_asked(rng):
    x = rng.standard_normal((4, 9)).astype(F32)
    w = rng.standard_normal(9).astype(F32)
    dy = rng.standard_normal((4, 9)).astype(F32)
    _y, m, r = kernels_norm.layernorm(x, w)
    assert kernels_norm.layernorm_backward(x, w, m, r, dy, input_grad=False) is None
    dw = np.zeros(9, F32)
    assert kernels_norm.rmsnorm_backward(x, w, r, dy, grad_weight=dw, input_grad=False) is None
    assert np.any(dw != 0)
    dx = np.full((4, 9), 7, F32)
    out = kernels_norm.rmsnorm_backward(x, w, r, dy, grad_x=dx)
    assert out is dx and not np.any(dx == 7)


def test_bad_input_is_refused_before_any_work(rng):
    x = rng.standard_normal((4, 9)).astype(F32)
    w = np.ones(9, F32)
    out = np.full((4, 9), 7, F32)
    with pytest.raises(TypeError, match="x: expected dtype float32"):
        kernels_norm.rmsnorm(x.astype(np.float64), w, out=out)
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., 9\)"):
        kernels_norm.rmsnorm(x[:, :8].copy(), w, out=out)
    with pytest.raises(ValueError, match="weight: expected shape"):
        kernels_norm.layernorm(x, np.ones((3, 3), F32), out=out)
    with pytest.raises(ValueError, match="bias: expected 9 elements"):
        kernels_norm.layernorm(x, w, np.ones(8, F32), out=out)
    with pytest.raises(ValueError, match="eps: expected >= 0"):
        kernels_norm.rmsnorm(x, w, -1.0, out=out)
    with pytest.raises(ValueError, match="eps"):
        kernels_norm.rmsnorm(x, w, float("nan"), out=out)
    with pytest.raises(TypeError, match="eps"):
        kernels_norm.rmsnorm(x, w, "1e-5", out=out)
    with pytest.raises(ValueError, match="out: expected 36 elements"):
        kernels_norm.rmsnorm(x, w, out=np.empty(35, F32))
    with pytest.raises(ValueError, match="rstd: expected 4 elements"):
        kernels_norm.rmsnorm(x, w, out=out, rstd=np.empty(5, F32))
    with pytest.raises(ValueError, match="overlap"):
        kernels_norm.rmsnorm(x, w, out=x)
    ro = out.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kernels_norm.rmsnorm(x, w, out=ro)
    assert np.all(out == 7)
    y, r = kernels_norm.rmsnorm(x, w)
    dw = np.zeros(9, F32)
    with pytest.raises(ValueError, match="grad_y: expected 36 elements"):
        kernels_norm.rmsnorm_backward(x, w, r, np.ones(35, F32), grad_weight=dw)
    with pytest.raises(ValueError, match="grad_weight: expected 9 elements"):
        kernels_norm.rmsnorm_backward(x, w, r, y, grad_weight=np.zeros(8, F32))
    with pytest.raises(ValueError, match="rstd: expected 4 elements"):
        kernels_norm.rmsnorm_backward(x, w, r[:3].copy(), y, grad_weight=dw)
    with pytest.raises(ValueError, match="overlap"):
        kernels_norm.rmsnorm_backward(x, w, r, y, grad_x=y)
    assert np.all(dw == 0)


def test_matches_torch(rng):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = (rng.standard_normal((3, 17, 33)) * 2 + 0.5).astype(F32)
    w = rng.uniform(0.5, 1.5, 33).astype(F32)
    b = rng.standard_normal(33).astype(F32)
    dy = rng.standard_normal(x.shape).astype(F32)
    for layer in (False, True):
        tx = torch.tensor(x, requires_grad=True)
        tw = torch.tensor(w, requires_grad=True)
        tb = torch.tensor(b, requires_grad=True)
        if layer:
            ty = F.layer_norm(tx, (33,), tw, tb, 1e-5)
            y, m, r = kernels_norm.layernorm(x, w, b, 1e-5)
        else:
            ty = F.rms_norm(tx, (33,), tw, 1e-6)
            y, r = kernels_norm.rmsnorm(x, w, 1e-6)
        ty.backward(torch.tensor(dy))
        dw, db = np.zeros(33, F32), np.zeros(33, F32)
        if layer:
            dx = kernels_norm.layernorm_backward(x, w, m, r, dy, grad_weight=dw, grad_bias=db)
            np.testing.assert_allclose(db, tb.grad.numpy(), rtol=1e-5, atol=1e-5)
        else:
            dx = kernels_norm.rmsnorm_backward(x, w, r, dy, grad_weight=dw)
        np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw, tw.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_workspace(rng):
    """A reused workspace gives the bits of a fresh one; a short or misaligned
    one is refused before any work."""
    x = rng.standard_normal((300, 40)).astype(F32)
    w = rng.standard_normal(40).astype(F32)
    dy = rng.standard_normal((300, 40)).astype(F32)
    _, m, r = kernels_norm.layernorm(x, w)
    need = kernels_norm.norm_backward_workspace(300, 40)
    assert need > 0 and kernels_norm.norm_backward_workspace(0, 40) == 0
    dw1, db1 = np.zeros(40, F32), np.zeros(40, F32)
    kernels_norm.layernorm_backward(x, w, m, r, dy, grad_weight=dw1, grad_bias=db1)
    work = np.full(need, np.nan, F32)
    dw2, db2 = np.zeros(40, F32), np.zeros(40, F32)
    kernels_norm.layernorm_backward(x, w, m, r, dy, grad_weight=dw2, grad_bias=db2,
                                    workspace=work)
    assert dw1.tobytes() == dw2.tobytes() and db1.tobytes() == db2.tobytes()
    # the bias alone (a frozen weight) gets the same sums
    db3 = np.zeros(40, F32)
    kernels_norm.layernorm_backward(x, w, m, r, dy, grad_bias=db3, workspace=work)
    assert db3.tobytes() == db1.tobytes()
    with pytest.raises(ValueError, match=f"workspace: expected at least {need}"):
        kernels_norm.rmsnorm_backward(x, w, r, dy, grad_weight=dw2, workspace=work[:-1])
    big = np.zeros(need + 1, F32)
    odd = big[1:] if big[1:].ctypes.data % 8 else big[:-1]
    with pytest.raises(ValueError, match="8-byte aligned"):
        kernels_norm.rmsnorm_backward(x, w, r, dy, grad_weight=dw2, workspace=odd)
    with pytest.raises(ValueError, match="overlap"):
        kernels_norm.rmsnorm_backward(x, w, r, dy, grad_weight=work[:40], workspace=work)
    assert dw2.tobytes() == dw1.tobytes()
    with pytest.raises(TypeError, match="nrows"):
        kernels_norm.norm_backward_workspace(3.0, 4)
