"""Activation kernels (tanh, sigmoid, SiLU, GELU in both forms, LeakyReLU), both
directions, against float64 references on every SIMD path.

Accuracy bounds, in units of the float32 spacing of the reference (ulp):
tanh 3, sigmoid 4, SiLU 6, exact GELU 10, the tanh-form GELU 6 + 4|2u| (2u, the
exponent's argument, is rounded to float before the exponential: at most 33 ulp
where |y| > 1e-8, up to some 300 ulp in the far negative tail, where torch's and
ggml's 1 + tanh(u) lose every digit).  Products x * f whose factor f is below
FLT_MIN (silu(-90)) may also be off by |x| * 2^-149, f's own spacing.
Derivatives: 10 ulp of the sum of the magnitudes of their terms (plus the tanh
form's 4|2u|), with the same allowance for subnormal factors.  Measured on the
sweep: 1.5, 3.0, 3.5, 6.1 and 2.2 (+ up to 2.7|2u|) ulp; derivatives at most
7 ulp of their terms.
"""
import math

import numpy as np
import pytest

from ggmlopt import kernels

F32 = np.float32
ULP_MIN = 2.0 ** -149
SQRT2 = math.sqrt(2.0)
K1 = 2.0 * math.sqrt(2.0 / math.pi)  # 2u = x * (K1 + K3 x^2)
K3 = K1 * 0.044715

_erfc = np.frompyfunc(math.erfc, 1, 1)


def erfc64(z):
    return _erfc(np.asarray(z, dtype=np.float64)).astype(np.float64)


def sweep():
    """Every 4099th positive float32 bit pattern (subnormals to FLT_MAX), their
    negatives, a dense grid over [-20, 20], and +-inf, NaN, +-0, +-FLT_MAX,
    the smallest subnormal."""
    pos = np.arange(0, 0x7F800000, 4099, dtype=np.uint32).view(F32)
    grid = np.linspace(-20, 20, 400_001).astype(F32)
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 3.4028235e38, -3.4028235e38,
                        1e-45, -1e-45, 0.625, -0.625, 1e4, -1e4, 88.0, -88.0, 110.0, -110.0],
                       dtype=F32)
    return np.concatenate([pos, -pos, grid, special])


def sigmoid64(v):
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(-np.abs(v))
        return np.where(v >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def phi_cdf64(v):
    """The standard normal CDF without cancellation on either side."""
    half = 0.5 * erfc64(np.abs(v) / SQRT2)
    return np.where(v < 0, half, 1.0 - half)


def gauss64(v):
    with np.errstate(over="ignore"):
        return np.exp(-0.5 * v * v)


def arg2u(v):
    with np.errstate(over="ignore", invalid="ignore"):
        c = np.clip(v, -1e4, 1e4)
        return c * (K1 + K3 * c * c)


def times_x(v, f):
    """v * f with the limit 0 where v = -inf and f = 0 (silu, gelu at -inf)."""
    with np.errstate(invalid="ignore"):
        return np.where(np.isneginf(v) & (f == 0), 0.0, v * f)


FORWARD = {
    "tanh": (lambda x, out=None: kernels.tanh(x, out=out), np.tanh),
    "sigmoid": (lambda x, out=None: kernels.sigmoid(x, out=out), sigmoid64),
    "silu": (lambda x, out=None: kernels.silu(x, out=out), lambda v: times_x(v, sigmoid64(v))),
    "gelu": (lambda x, out=None: kernels.gelu(x, out=out), lambda v: times_x(v, phi_cdf64(v))),
    "gelu_tanh": (lambda x, out=None: kernels.gelu(x, out=out, approximate="tanh"),
                  lambda v: times_x(v, sigmoid64(arg2u(v)))),
}
FORWARD_ULP = {"tanh": 3, "sigmoid": 4, "silu": 6, "gelu": 10, "gelu_tanh": 6}


def extra_ulp(name, xd):
    """The part of the bound that depends on x (see the module docstring)."""
    if name == "gelu_tanh":
        with np.errstate(invalid="ignore"):
            return 4.0 * np.nan_to_num(np.abs(arg2u(xd)), posinf=0.0)
    return np.zeros_like(xd)


def ulp_errors(got, ref, xd, name):
    """|got - ref| in float32 spacings of ref, minus the subnormal allowance; 0
    where both are the same NaN/inf, inf where only one is."""
    got = got.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        spacing = np.maximum(np.spacing(np.abs(ref.astype(F32))).astype(np.float64), ULP_MIN)
        # a factor below FLT_MIN (sigmoid(-90)) has absolute spacing 2^-149;
        # x times it keeps that much absolute error (negligible elsewhere)
        sub_allow = np.nan_to_num(np.abs(xd), posinf=0.0) * ULP_MIN
        err = np.maximum(np.abs(got - ref) - sub_allow, 0.0) / spacing
    special = np.isnan(ref) | np.isinf(ref)
    same = (np.isnan(ref) & np.isnan(got)) | (np.isinf(ref) & (got == ref))
    err[special] = np.where(same[special], 0.0, np.inf)
    err[~special & ~np.isfinite(got)] = np.inf
    return err - extra_ulp(name, xd)


@pytest.fixture(scope="module")
def swept():
    x = sweep()
    xd = x.astype(np.float64)
    return x, xd, {name: ref(xd) for name, (_, ref) in FORWARD.items()}


@pytest.mark.parametrize("name", list(FORWARD))
def test_forward_within_bound_over_the_float_range(simd_path, swept, name):
    x, xd, refs = swept
    got = FORWARD[name][0](x)
    err = ulp_errors(got, refs[name], xd, name)
    worst = int(np.argmax(err))
    assert err[worst] <= FORWARD_ULP[name], (
        f"{name}[{simd_path}] x={x[worst]!r}: got {got[worst]!r}, want {refs[name][worst]!r} "
        f"({err[worst]:.1f} ulp beyond the allowance)")


def test_forward_special_values(simd_path):
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], dtype=F32)
    t = kernels.tanh(x)
    assert np.isnan(t[0]) and t[1] == 1 and t[2] == -1
    assert np.signbit(t[4]) and t[4] == 0 and not np.signbit(t[3])
    s = kernels.sigmoid(x)
    assert np.isnan(s[0]) and s[1] == 1 and s[2] == 0 and s[3] == 0.5 and s[4] == 0.5
    for f in (kernels.silu, kernels.gelu, lambda v: kernels.gelu(v, approximate="tanh")):
        y = f(x)
        assert np.isnan(y[0]) and y[1] == np.inf and y[2] == 0 and y[3] == 0 and y[4] == 0
    lr = kernels.leaky_relu(x, 0.1)
    assert np.isnan(lr[0]) and lr[1] == np.inf and lr[2] == -np.inf and lr[3] == 0


def test_sigmoid_keeps_subnormal_results(simd_path):
    # 1/(1 + exp(100)) would be 0; exp(-|x|)/(1 + exp(-|x|)) keeps 3.7e-44
    x = np.array([-100.0, -95.0, -90.0], dtype=F32)
    got = kernels.sigmoid(x)
    want = np.exp(x.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * ULP_MIN)
    assert (got > 0).all()


def test_gelu_tails_keep_their_digits(simd_path):
    # 1 + erf(x/sqrt2) cancels to 0 in float for x < -5.5; erfc does not
    x = np.array([-6.0, -7.5, -9.0], dtype=F32)
    want = x.astype(np.float64) * phi_cdf64(x.astype(np.float64))
    np.testing.assert_allclose(kernels.gelu(x), want, rtol=1e-6)
    want_t = x * sigmoid64(arg2u(x.astype(np.float64)))
    np.testing.assert_allclose(kernels.gelu(x, approximate="tanh"), want_t, rtol=3e-5)


def test_gelu_forms_agree_to_the_approximation_error(simd_path):
    # the tanh form approximates the erf form to within 5e-4 absolute
    x = np.linspace(-8, 8, 10001).astype(F32)
    d = kernels.gelu(x) - kernels.gelu(x, approximate="tanh")
    assert 1e-4 < np.abs(d).max() < 5e-4


# ---- backward ------------------------------------------------------------------

def grad_refs(name, xd, gd, slope=0.01):
    """(float64 reference of the input gradient, scale of its terms) given the
    forward input x (or output y for tanh/sigmoid, passed as xd)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if name == "tanh":
            y = xd
            return gd * (1 - y * y), np.abs(gd) * (1 + y * y)
        if name == "sigmoid":
            y = xd
            return gd * y * (1 - y), np.abs(gd * y) * (1 + np.abs(y))
        if name == "silu":
            s = sigmoid64(xd)
            c = sigmoid64(-xd)
            return gd * s * (1 + xd * c), np.abs(gd) * s * (1 + np.abs(xd) * c)
        if name == "gelu":
            cdf, pdf_x = phi_cdf64(xd), xd * gauss64(xd) / math.sqrt(2 * math.pi)
            return gd * (cdf + pdf_x), np.abs(gd) * (cdf + np.abs(pdf_x))
        if name == "gelu_tanh":
            c = np.clip(xd, -1e4, 1e4)
            a = arg2u(xd)
            s, one_minus = sigmoid64(a), sigmoid64(-a)
            term = c * s * one_minus * (K1 + 3 * K3 * c * c)
            return gd * (s + term), np.abs(gd) * (s + np.abs(term))
    raise AssertionError(name)


BACKWARD = {
    "tanh": lambda a, g, out=None: kernels.tanh_backward(a, g, out=out),
    "sigmoid": lambda a, g, out=None: kernels.sigmoid_backward(a, g, out=out),
    "silu": lambda a, g, out=None: kernels.silu_backward(a, g, out=out),
    "gelu": lambda a, g, out=None: kernels.gelu_backward(a, g, out=out),
    "gelu_tanh": lambda a, g, out=None: kernels.gelu_backward(a, g, out=out,
                                                              approximate="tanh"),
}


def backward_input(name, x):
    """What the backward kernel takes: the forward output for tanh/sigmoid."""
    if name == "tanh":
        return kernels.tanh(x)
    if name == "sigmoid":
        return kernels.sigmoid(x)
    return x


def backward_tolerance(name, a, g):
    """(float64 reference, tolerance) of the backward kernel's output."""
    ad, gd = a.astype(np.float64), g.astype(np.float64)
    want, scale = grad_refs(name, ad, gd)
    ulps = 10.0 + extra_ulp(name, ad)
    tol = ulps * np.maximum(np.spacing(scale.astype(F32)).astype(np.float64), ULP_MIN)
    # a factor below FLT_MIN (sigmoid(-90)) is off by up to its spacing 2^-149,
    # times what multiplies it: x * g, and d(2u)/dx too in the tanh form
    mult = np.nan_to_num(np.abs(ad * gd), posinf=0.0)
    if name == "gelu_tanh":
        c = np.clip(ad, -1e4, 1e4)
        mult = mult * (K1 + 3 * K3 * c * c)
    return want, tol + 2 * mult * ULP_MIN


def check_backward(name, a, g, got):
    want, tol = backward_tolerance(name, a, g)
    finite = np.isfinite(want)
    bad = finite & ~(np.abs(got.astype(np.float64) - want) <= tol)
    bad |= ~finite & ~((np.isnan(want) & np.isnan(got)) | (got == want))
    i = int(np.argmax(bad)) if bad.any() else -1
    assert i < 0, (f"{name} backward at a={a[i]!r} g={g[i]!r}: got {got[i]!r}, "
                   f"want {want[i]!r} (tol {tol[i]:.3g})")


@pytest.mark.parametrize("name", list(BACKWARD))
def test_backward_within_bound_over_the_float_range(simd_path, swept, name):
    x = swept[0]
    x = x[np.isfinite(x)]
    a = backward_input(name, x)
    g = np.resize(np.array([1.0, -0.75, 3.5e-3, 2.0e3], dtype=F32), a.size)
    check_backward(name, a, g, BACKWARD[name](a, g))


@pytest.mark.parametrize("name", list(BACKWARD))
def test_backward_at_infinities_gives_the_limits(simd_path, name):
    x = np.array([np.inf, -np.inf, np.nan], dtype=F32)
    a = backward_input(name, x)
    got = BACKWARD[name](a, np.full(3, 2.0, F32))
    # saturated both ways: the derivative is 1 at +inf for the x * f ones, else 0
    want_inf = 2.0 if name in ("silu", "gelu", "gelu_tanh") else 0.0
    assert got[0] == want_inf and got[1] == 0 and np.isnan(got[2])


@pytest.mark.parametrize("name", list(FORWARD))
def test_awkward_sizes_and_offsets_both_directions(simd_path, layout, rng, place, name):
    size, offset = layout
    x0 = (rng.standard_normal(size) * 4).astype(F32)
    g0 = rng.standard_normal(size).astype(F32)
    x = place(x0, offset)
    g = place(g0, offset)
    y = FORWARD[name][0](x)
    err = ulp_errors(y, FORWARD[name][1](x0.astype(np.float64)), x0.astype(np.float64), name)
    assert err.max() <= FORWARD_ULP[name]
    a = backward_input(name, x0)
    check_backward(name, a, g0, BACKWARD[name](place(a, offset), g))
    # an element's result does not depend on where it sits (leftovers run the
    # same vector code): the unaligned results equal those of an aligned copy
    np.testing.assert_array_equal(y, FORWARD[name][0](x0.copy()))


@pytest.mark.parametrize("name", list(FORWARD))
def test_in_place(simd_path, rng, name):
    x0 = rng.standard_normal(1003).astype(F32)
    x = x0.copy()
    assert FORWARD[name][0](x, out=x) is x
    np.testing.assert_array_equal(x, FORWARD[name][0](x0))
    a = backward_input(name, x0)
    g0 = rng.standard_normal(1003).astype(F32)
    g = g0.copy()
    assert BACKWARD[name](a, g, out=g) is g
    np.testing.assert_array_equal(g, BACKWARD[name](a, g0))


@pytest.mark.parametrize("name", list(FORWARD))
def test_paths_agree_within_a_few_ulp(rng, name):
    paths = kernels.simd_paths()
    x = np.concatenate([(rng.standard_normal(20_000) * 6).astype(F32), sweep()[::7]])
    a = backward_input(name, x)
    g = rng.standard_normal(a.size).astype(F32)
    before = kernels.use_simd("scalar")
    try:
        ys, gs = FORWARD[name][0](x), BACKWARD[name](a, g)
        for p in paths:
            kernels.use_simd(p)
            y, gi = FORWARD[name][0](x), BACKWARD[name](a, g)
            with np.errstate(invalid="ignore", over="ignore"):
                sp = np.maximum(np.spacing(np.abs(ys)), ULP_MIN)
                allow = np.nan_to_num(np.abs(x.astype(np.float64)), posinf=0.0) * ULP_MIN
                diff = np.maximum(np.abs(y.astype(np.float64) - ys) - 2 * allow, 0.0)
                dy = np.where(np.isnan(ys) & np.isnan(y), 0, diff / sp)
            # the paths differ only in fused versus separate multiply-adds
            assert np.nanmax(dy - extra_ulp(name, x.astype(np.float64))) <= 8, p
            assert np.isnan(y).sum() == np.isnan(ys).sum()
            _, tol = backward_tolerance(name, a, g)
            assert (np.abs(gi.astype(np.float64) - gs) <= tol).all(), p
    finally:
        kernels.use_simd(before)


@pytest.mark.parametrize("name", list(FORWARD))
def test_one_and_two_threads_identical(simd_path, rng, restore_threads, name):
    x = (rng.standard_normal(300_001) * 3).astype(F32)
    a = backward_input(name, x)
    g = rng.standard_normal(a.size).astype(F32)
    results = []
    for threads in (1, 2):
        kernels.set_num_threads(threads)
        results.append((FORWARD[name][0](x), BACKWARD[name](a, g)))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


# ---- LeakyReLU: one select and one product, the same bits as NumPy ------------

@pytest.mark.parametrize("slope", [0.01, 0.2, 0.0, -0.5, 1.0, 3.0])
def test_leaky_relu_matches_numpy_bitwise(simd_path, layout, rng, place, slope):
    size, offset = layout
    x0 = rng.standard_normal(size).astype(F32)
    x0[::5] = 0.0
    x0[1::7] = -0.0
    x0[2::11] = np.nan
    g0 = rng.standard_normal(size).astype(F32)
    s = F32(slope)
    y = kernels.leaky_relu(place(x0, offset), slope)
    np.testing.assert_array_equal(y, np.where(x0 > 0, x0, x0 * s))
    assert (np.signbit(y) == np.signbit(np.where(x0 > 0, x0, x0 * s))).all()
    gi = kernels.leaky_relu_backward(place(x0, offset), place(g0, offset), slope)
    np.testing.assert_array_equal(gi, np.where(x0 > 0, g0, g0 * s))


def test_leaky_relu_threads_identical(simd_path, rng, restore_threads):
    x = rng.standard_normal(300_001).astype(F32)
    g = rng.standard_normal(300_001).astype(F32)
    out = []
    for threads in (1, 2):
        kernels.set_num_threads(threads)
        out.append((kernels.leaky_relu(x, 0.1), kernels.leaky_relu_backward(x, g, 0.1)))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    np.testing.assert_array_equal(out[0][1], out[1][1])


def test_any_shape_keeps_it(simd_path, rng):
    x = rng.standard_normal((2, 3, 5, 7)).astype(F32)
    for f in (kernels.tanh, kernels.sigmoid, kernels.silu, kernels.gelu, kernels.leaky_relu):
        assert f(x).shape == x.shape
    assert kernels.gelu_backward(x, x.copy()).shape == x.shape


def test_empty_arrays(simd_path):
    e = np.zeros((0, 4), F32)
    assert kernels.gelu(e).shape == (0, 4)
    assert kernels.tanh_backward(e, e.copy()).shape == (0, 4)


# ---- bad input --------------------------------------------------------------------

F = np.zeros(4, F32)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: kernels.tanh(np.zeros(4)), TypeError, "^x: expected dtype float32"),
    (lambda: kernels.sigmoid([0.0, 1.0]), TypeError, "^x: "),
    (lambda: kernels.silu(np.zeros(8, F32)[::2]), ValueError, "^x: expected a C-contiguous"),
    (lambda: kernels.gelu(F, out=np.zeros(5, F32)), ValueError, "^out: expected 4 elements"),
    (lambda: kernels.gelu(F, out=np.zeros(4, np.float64)), TypeError, "^out: "),
    (lambda: kernels.tanh_backward(F, np.zeros(3, F32)), ValueError, "^g: expected 4"),
    (lambda: kernels.sigmoid_backward(F, np.zeros(4, np.int32)), TypeError, "^g: "),
    (lambda: kernels.silu_backward(np.zeros(4, np.float16), F), TypeError, "^x: "),
    (lambda: kernels.gelu(F, approximate="erf"), ValueError, "^approximate: expected 'none'"),
    (lambda: kernels.gelu(F, approximate=None), TypeError, "^approximate: "),
    (lambda: kernels.gelu_backward(F, F, approximate="Tanh"), ValueError, "^approximate: "),
    (lambda: kernels.leaky_relu(F, "0.1"), TypeError, "^negative_slope: expected a real"),
    (lambda: kernels.leaky_relu(F, True), TypeError, "^negative_slope: "),
    (lambda: kernels.leaky_relu(F, float("nan")), ValueError, "^negative_slope: "),
    (lambda: kernels.leaky_relu_backward(F, F, 1e300), ValueError, "^negative_slope: "),
])
def test_bad_input_names_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_out_overlapping_an_input_is_refused():
    x = np.ones(8, F32)
    with pytest.raises(ValueError, match="overlap"):
        kernels.gelu_backward(x, np.ones(8, F32), out=x)
    buf = np.ones(16, F32)
    with pytest.raises(ValueError, match="overlap"):
        kernels.sigmoid(buf[:8], out=buf[4:12])
    assert (buf == 1).all()


def test_read_only_out_refused_and_inputs_untouched():
    x = np.ones(4, F32)
    out = np.zeros(4, F32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="^out: the array is read-only"):
        kernels.silu(x, out=out)
    assert (out == 0).all() and (x == 1).all()


def test_c_level_entry_points_are_exported():
    # kernels.pxd's declarations, shared with other Cython modules through the
    # module's C-API capsules (a cimport finds them there)
    names = ["tanh_f32", "tanh_backward_f32", "sigmoid_f32", "sigmoid_backward_f32", "silu_f32",
             "silu_backward_f32", "gelu_f32", "gelu_backward_f32", "gelu_tanh_f32",
             "gelu_tanh_backward_f32", "leaky_relu_f32", "leaky_relu_backward_f32"]
    capi = kernels.__pyx_capi__
    for name in names:
        assert name in capi, name
    assert "float *, float)" in str(capi["leaky_relu_f32"])
