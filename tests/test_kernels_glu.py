"""The SwiGLU product kernels (kernels_glu) against float64 references on every
SIMD path: h = silu(g) * u within 8 ulp of |h|; the gradients within 12 ulp of
the sum of the magnitudes of their terms (SiLU itself is within 3.5 ulp, its
derivative within 7), plus |gate| 2^-148 where the sigmoid is subnormal; inf/NaN gates give the limits as the SiLU kernels do;
threads give the same bits."""
import numpy as np
import pytest

from ggmlopt import kernels, kernels_glu

F32 = np.float32
EPS32 = 2.0 ** -23
TINY = 2.0 ** -149


def sigmoid64(v):
    with np.errstate(over="ignore"):
        e = np.exp(-np.abs(v))
    return np.where(v >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def swiglu_ref(g, u, dh):
    g, u, dh = (a.astype(np.float64) for a in (g, u, dh))
    s = sigmoid64(g)
    c = sigmoid64(-g)
    gf = np.clip(g, -np.finfo(F32).max, np.finfo(F32).max)  # the limits at +-inf
    with np.errstate(invalid="ignore", over="ignore"):
        silu = np.where(np.isneginf(g), 0.0, g * s)
        dsilu = s * (1.0 + gf * c)
        dsilu_scale = s * (1.0 + np.abs(gf) * c)
        return (silu * u, np.abs(silu * u), dh * u * dsilu, np.abs(dh * u) * dsilu_scale,
                dh * silu, np.abs(dh * silu))


def check(got, want, tol, what):
    with np.errstate(invalid="ignore"):
        ok = (np.isnan(want) & np.isnan(got)) | (np.abs(got - want) <= tol) | (got == want)
    assert ok.all(), f"{what}: first miss at {np.flatnonzero(~ok)[0]}"


def gate_values(rng, n):
    g = rng.uniform(-30, 30, n).astype(F32)
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 100.0, -100.0, -90.0, 1e-30],
                       F32)
    k = min(n, special.size)
    g[:k] = special[:k]
    return g


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 16, 17, 33, 1000, 70_001])
def test_matches_float64(simd_path, rng, place, n):
    g = place(gate_values(rng, n), 1)
    u = place(rng.uniform(-3, 3, n).astype(F32), 2)
    dh = place(rng.uniform(-2, 2, n).astype(F32), 3)
    h_ref, h_scale, dg_ref, dg_scale, du_ref, du_scale = swiglu_ref(g, u, dh)
    h = kernels_glu.swiglu(g, u)
    # a subnormal sigmoid factor (gate < -87) is off by its own spacing: |g| 2^-149
    sub = 2 * TINY * np.abs(np.nan_to_num(g.astype(np.float64), posinf=0, neginf=0))
    check(h, h_ref, 8 * EPS32 * h_scale + sub * np.abs(u) + 4 * TINY, "h")
    dg, du = kernels_glu.swiglu_backward(g, u, dh)
    check(dg, dg_ref, 12 * EPS32 * dg_scale + sub * np.abs(dh * u) + 4 * TINY, "grad_gate")
    check(du, du_ref, 8 * EPS32 * du_scale + sub * np.abs(dh) + 4 * TINY, "grad_up")


def test_agrees_with_the_silu_kernels(rng):
    """swiglu is silu(g) * u; its gradients those of the SiLU kernels times u."""
    g = rng.uniform(-20, 20, 4097).astype(F32)
    u = rng.standard_normal(4097).astype(F32)
    dh = rng.standard_normal(4097).astype(F32)
    np.testing.assert_allclose(kernels_glu.swiglu(g, u), kernels.silu(g) * u, rtol=1e-6,
                               atol=1e-30)
    dg, du = kernels_glu.swiglu_backward(g, u, dh)
    np.testing.assert_allclose(dg, kernels.silu_backward(g, dh * u), rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(du, dh * kernels.silu(g), rtol=1e-6, atol=1e-30)


def test_in_place_and_shapes(rng):
    g = rng.standard_normal((3, 5, 7)).astype(F32)
    u = rng.standard_normal((3, 5, 7)).astype(F32)
    want = kernels_glu.swiglu(g, u)
    assert want.shape == g.shape
    g2 = g.copy()
    assert kernels_glu.swiglu(g2, u, out=g2) is g2
    assert g2.tobytes() == want.tobytes()


def test_threads_give_the_same_bits(restore_threads, rng):
    n = 8 * 256 * 768
    g = rng.standard_normal(n).astype(F32) * 4
    u = rng.standard_normal(n).astype(F32)
    dh = rng.standard_normal(n).astype(F32)
    res = []
    for t in (1, 2):
        kernels.set_num_threads(t)
        res.append((kernels_glu.swiglu(g, u),) + kernels_glu.swiglu_backward(g, u, dh))
    for a, b in zip(*res):
        assert a.tobytes() == b.tobytes()


def test_bad_input_is_refused(rng):
    g = rng.standard_normal(9).astype(F32)
    u = rng.standard_normal(9).astype(F32)
    with pytest.raises(TypeError, match="up: expected dtype float32"):
        kernels_glu.swiglu(g, u.astype(np.float64))
    with pytest.raises(ValueError, match="up: expected 9 elements"):
        kernels_glu.swiglu(g, u[:8].copy())
    with pytest.raises(ValueError, match="out: expected 9 elements"):
        kernels_glu.swiglu(g, u, out=np.empty(8, F32))
    big = np.zeros(18, F32)
    with pytest.raises(ValueError, match="overlap"):
        kernels_glu.swiglu(big[:9], u, out=big[1:10])
    dg = np.full(9, 7, F32)
    with pytest.raises(ValueError, match="grad_h: expected 9 elements"):
        kernels_glu.swiglu_backward(g, u, np.ones(10, F32), grad_gate=dg)
    with pytest.raises(ValueError, match="overlap"):
        kernels_glu.swiglu_backward(g, u, u, grad_gate=dg, grad_up=dg)
    with pytest.raises(ValueError, match="overlap"):
        kernels_glu.swiglu_backward(g, u, u, grad_gate=g)
    assert np.all(dg == 7)


def test_matches_torch(rng):
    torch = pytest.importorskip("torch")
    g = (rng.standard_normal((7, 33)) * 4).astype(F32)
    u = rng.standard_normal((7, 33)).astype(F32)
    dh = rng.standard_normal((7, 33)).astype(F32)
    tg = torch.tensor(g, requires_grad=True)
    tu = torch.tensor(u, requires_grad=True)
    th = torch.nn.functional.silu(tg) * tu
    th.backward(torch.tensor(dh))
    np.testing.assert_allclose(kernels_glu.swiglu(g, u), th.detach().numpy(), rtol=1e-5,
                               atol=1e-6)
    dg, du = kernels_glu.swiglu_backward(g, u, dh)
    np.testing.assert_allclose(dg, tg.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(du, tu.grad.numpy(), rtol=1e-5, atol=1e-6)
