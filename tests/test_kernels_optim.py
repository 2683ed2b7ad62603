"""AdamW and SGD steps against float64 references (ggml's formulas)."""
import numpy as np
import pytest

from ggmlopt import kernels

F32 = np.float32


def adamw_reference(w, g, m, v, alpha, beta1, beta2, eps, wd, beta1h, beta2h):
    """One AdamW step in float64 on the float32 hyper-parameters the kernel receives."""
    alpha, beta1, beta2, eps, wd, beta1h, beta2h = (
        float(F32(x)) for x in (alpha, beta1, beta2, eps, wd, beta1h, beta2h))
    g = g.astype(np.float64)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    mh = m * beta1h
    vh = np.sqrt(v * beta2h) + eps
    w = w * (1.0 - alpha * wd) - alpha * mh / vh
    return w, m, v


def close(actual, expected, rtol):
    """Relative closeness, with an absolute floor tied to the array's scale (values
    that cancel to near zero carry the rounding of their larger parts)."""
    expected = np.asarray(expected, dtype=np.float64)
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale * 0.1)


def test_adamw_several_steps_match_float64(simd_path, layout, rng, place):
    size, offset = layout
    hp = {"alpha": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "wd": 0.1}
    w = place(rng.standard_normal(size).astype(F32), offset)
    m = place(np.zeros(size, F32), offset)
    v = place(np.zeros(size, F32), offset)
    w64, m64, v64 = w.astype(np.float64), np.zeros(size), np.zeros(size)
    for t in (1, 2, 3):
        g = place(rng.standard_normal(size).astype(F32), offset)
        beta1h, beta2h = kernels.adamw_bias_corrections(hp["beta1"], hp["beta2"], t)
        kernels.adamw_step(w, g, m, v, beta1h=beta1h, beta2h=beta2h, **hp)
        w64, m64, v64 = adamw_reference(w64, g, m64, v64, beta1h=beta1h, beta2h=beta2h, **hp)
        close(m, m64, 1e-5)
        close(v, v64, 1e-5)
        # the update is ~alpha = 1e-2 against |w| ~ 1: an error of 1e-4 in it shows
        close(w, w64, 2e-6)


def test_adamw_zero_gradient_only_decays(simd_path, rng, place):
    n = 33
    w0 = rng.standard_normal(n).astype(F32)
    w = place(w0, 1)
    m, v = np.zeros(n, F32), np.zeros(n, F32)
    kernels.adamw_step(w, np.zeros(n, F32), m, v, alpha=0.1, beta1=0.9, beta2=0.999,
                       eps=1e-8, wd=0.5, beta1h=10.0, beta2h=1000.0)
    np.testing.assert_array_equal(m, 0)
    np.testing.assert_array_equal(v, 0)
    np.testing.assert_allclose(w, w0.astype(np.float64) * (1 - 0.1 * 0.5), rtol=1e-7)


def test_adamw_leaves_neighbouring_memory_alone(simd_path, rng):
    n = 17
    buf = np.full(n + 8, 7.0, F32)
    w = buf[3:3 + n]
    kernels.adamw_step(w, rng.standard_normal(n).astype(F32), np.zeros(n, F32),
                       np.zeros(n, F32), alpha=0.1, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0,
                       beta1h=10.0, beta2h=1000.0)
    assert np.all(buf[:3] == 7) and np.all(buf[3 + n:] == 7)
    assert np.all(w != 7)


def test_adamw_of_size_zero_is_a_no_op(simd_path):
    e = np.zeros(0, F32)
    kernels.adamw_step(e, e.copy(), e.copy(), e.copy(), alpha=1e-3, beta1=0.9, beta2=0.999,
                       eps=1e-8, wd=0.0, beta1h=10.0, beta2h=1000.0)
    assert e.size == 0


@pytest.mark.parametrize("beta", [0.9, 0.999, 0.5])
def test_adamw_bias_corrections_follow_ggml(beta):
    for t in range(1, 12):
        b1h, b2h = kernels.adamw_bias_corrections(beta, 0.999, t)
        exact = 1.0 / (1.0 - float(F32(beta)) ** t)
        # powf in float32 then 1 - x: a few 1e-5 relative for beta near 1
        assert b1h == pytest.approx(exact, rel=1e-4)
        assert b2h == pytest.approx(1.0 / (1.0 - float(F32(0.999)) ** t), rel=1e-4)
    assert kernels.adamw_bias_corrections(0.9, 0.999, 1)[0] == pytest.approx(10.0, rel=1e-6)


def test_adamw_bias_corrections_reject_iteration_zero():
    with pytest.raises(ValueError, match="iteration"):
        kernels.adamw_bias_corrections(0.9, 0.999, 0)


def test_sgd_matches_float64(simd_path, layout, rng, place):
    size, offset = layout
    alpha, wd = 0.05, 0.25
    w0 = rng.standard_normal(size).astype(F32)
    g = place(rng.standard_normal(size).astype(F32), offset)
    w = place(w0, offset)
    kernels.sgd_step(w, g, alpha=alpha, wd=wd)
    a, d = float(F32(alpha)), float(F32(wd))
    decayed, update = w0.astype(np.float64) * (1.0 - a * d), a * g.astype(np.float64)
    # float32 rounds each term and the difference (fused or not): a few units of
    # 2^-24 of the terms' magnitudes, however much the difference cancels
    bound = 4 * 2.0**-24 * (np.abs(decayed) + np.abs(update))
    assert np.all(np.abs(w - (decayed - update)) <= bound)


def test_sgd_of_size_zero_is_a_no_op(simd_path):
    e = np.zeros(0, F32)
    kernels.sgd_step(e, e.copy(), alpha=0.1)
    assert e.size == 0


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_step_gives_the_same_bits_over_any_slices(simd_path, rng, kind):
    """An element's result does not depend on where it sits: stepping an array in
    pieces of awkward sizes (a rank's shard, one parameter stepped in the backward
    pass) gives the bits of one step over the whole (the partial last vector takes
    the vector path's operations under a mask)."""
    n = 101
    w, g = rng.standard_normal(n).astype(F32), rng.standard_normal(n).astype(F32)
    m, v = (0.1 * rng.standard_normal(n)).astype(F32), rng.random(n).astype(F32)

    def step(w, g, m, v):
        if kind == "adamw":
            kernels.adamw_step(w, g, m, v, alpha=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                               wd=0.1, beta1h=10.0, beta2h=1000.0)
        else:
            kernels.sgd_step(w, g, alpha=0.1, wd=0.01)

    whole = [a.copy() for a in (w, g, m, v)]
    step(*whole)
    pieces = [a.copy() for a in (w, g, m, v)]
    for lo, hi in [(0, 5), (5, 22), (22, 23), (23, 40), (40, 101)]:
        step(*(a[lo:hi] for a in pieces))
    for a, b in zip(whole, pieces):
        np.testing.assert_array_equal(a, b)

