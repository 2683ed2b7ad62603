"""Activation layers (Tanh, Sigmoid, GELU both forms, SiLU, LeakyReLU): input
gradients against central differences of float64 references, buffers, shapes,
bad input."""
import math

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import kernels

F32 = np.float32
_erfc = np.frompyfunc(math.erfc, 1, 1)

# float64 references written to avoid cancellation in their own tails (1 + erf
# and 1 + tanh lose every digit for x < -8 even in float64)


def sigmoid64(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def gelu64(x):
    return x * 0.5 * _erfc(-x / math.sqrt(2.0)).astype(np.float64)


def gelu_tanh64(x):
    # 0.5 x (1 + tanh(u)) = x sigmoid(2u)
    return x * sigmoid64(2 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))


# (layer factory, float64 reference of the forward)
LAYERS = {
    "Tanh": (go.nn.Tanh, np.tanh),
    "Sigmoid": (go.nn.Sigmoid, sigmoid64),
    "SiLU": (go.nn.SiLU, lambda x: x * sigmoid64(x)),
    "GELU": (go.nn.GELU, gelu64),
    "GELU-tanh": (lambda: go.nn.GELU(approximate="tanh"), gelu_tanh64),
    "LeakyReLU": (go.nn.LeakyReLU, lambda x: np.where(x > 0, x, 0.01 * x)),
    "LeakyReLU-0.2": (lambda: go.nn.LeakyReLU(negative_slope=0.2),
                      lambda x: np.where(x > 0, x, np.float64(F32(0.2)) * x)),
}
# forward tolerance: a few ulp (tests/test_kernels_activation.py holds the exact
# bounds); the tanh form's tail also carries the rounding of its argument 2u
FWD_RTOL = {"GELU-tanh": 1e-4}
GRAD_SIZES = [1, 7, 9, 17, 33, 1000, 4097, 300_001]


def central_difference(f64, x, c, h=1e-4):
    """d/dx_i of sum(c * f(x)) for an elementwise f: c_i (f(x_i + h) - f(x_i - h)) / 2h,
    in float64."""
    xd = x.astype(np.float64)
    return c * (f64(xd + h) - f64(xd - h)) / (2 * h)


def assert_grad_close(name, gx, num, c):
    """gx within 1e-5 relative of the numerical gradient, plus an absolute
    1e-7 |c|; Tanh and Sigmoid take the rounded forward output y, so 1 - y^2
    and y(1 - y) are off by up to 2 ulp(y) |c| near saturation (as torch's)."""
    c = np.abs(np.broadcast_to(np.asarray(c, dtype=np.float64), num.shape))
    atol = (4 * 2.0 ** -24 if name in ("Tanh", "Sigmoid") else 1e-7) * c
    err = np.abs(gx.astype(np.float64) - num)
    bad = ~(err <= 1e-5 * np.abs(num) + atol)
    i = int(np.argmax(bad))
    assert not bad.any(), f"{name}: element {i}: got {gx.flat[i]!r}, want {num.flat[i]!r}"


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("size", GRAD_SIZES)
def test_input_gradient_matches_central_differences(simd_path, rng, place, name, size):
    make, f64 = LAYERS[name]
    layer = make()
    x0 = (rng.standard_normal(size) * 3).astype(F32)
    if name.startswith("LeakyReLU"):
        # the kink: keep central differences off it
        x0[np.abs(x0) < 1e-3] = 0.5
    c = rng.standard_normal(size)
    x = place(x0, 1 + size % 3)
    y = layer.forward(x)
    np.testing.assert_allclose(y, f64(x0.astype(np.float64)), rtol=FWD_RTOL.get(name, 2e-6),
                               atol=1e-30)
    gx = layer.backward(place(c.astype(F32), 2))
    c32 = c.astype(F32).astype(np.float64)
    assert_grad_close(name, gx, central_difference(f64, x0, c32), c32)


@pytest.mark.parametrize("name", list(LAYERS))
def test_nchw_and_2d_shapes(simd_path, rng, name):
    make, f64 = LAYERS[name]
    layer = make()
    for shape in [(4, 3, 5, 7), (9, 17), (1, 1)]:
        x = rng.standard_normal(shape).astype(F32)
        y = layer.forward(x)
        assert y.shape == shape
        np.testing.assert_allclose(y, f64(x.astype(np.float64)), rtol=FWD_RTOL.get(name, 2e-6),
                                   atol=1e-30)
        c = rng.standard_normal(shape)
        gx = layer.backward(c.astype(F32))
        assert gx.shape == shape
        c32 = c.astype(F32).astype(np.float64)
        assert_grad_close(name, gx, central_difference(f64, x, c32), c32)


@pytest.mark.parametrize("name", list(LAYERS))
def test_forward_reuses_buffer_call_returns_copy(rng, name):
    layer = LAYERS[name][0]()
    x1 = rng.standard_normal((3, 5)).astype(F32)
    x2 = rng.standard_normal((3, 5)).astype(F32)
    a = layer(x1)
    first = layer.forward(x1)
    second = layer.forward(x2)
    assert first is second  # the reused buffer
    b = layer(x2)
    assert a is not b and not np.shares_memory(a, second)
    np.testing.assert_array_equal(a, kernels_forward(name, x1))
    np.testing.assert_array_equal(b, kernels_forward(name, x2))


def kernels_forward(name, x):
    return LAYERS[name][0]().forward(x).copy()


@pytest.mark.parametrize("name", list(LAYERS))
def test_one_and_two_threads_identical(simd_path, rng, restore_threads, name):
    x = rng.standard_normal((1000, 301)).astype(F32)
    g = rng.standard_normal((1000, 301)).astype(F32)
    out = []
    for threads in (1, 2):
        kernels.set_num_threads(threads)
        layer = LAYERS[name][0]()
        out.append((layer(x), layer.backward(g).copy()))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    np.testing.assert_array_equal(out[0][1], out[1][1])


@pytest.mark.parametrize("name", list(LAYERS))
def test_needs_input_grad_false_returns_none(name):
    layer = LAYERS[name][0]()
    layer.needs_input_grad = False
    layer.forward(np.ones((2, 3), F32))
    assert layer.backward(np.ones((2, 3), F32)) is None


@pytest.mark.parametrize("name", list(LAYERS))
def test_backward_uses_the_last_forward(rng, name):
    # tanh/sigmoid keep their output, the others their input: a second forward
    # of another shape must replace both
    layer = LAYERS[name][0]()
    layer.forward(rng.standard_normal((2, 3)).astype(F32))
    x = rng.standard_normal((4, 5)).astype(F32)
    layer.forward(x)
    g = np.ones((4, 5), F32)
    assert_grad_close(name, layer.backward(g), central_difference(LAYERS[name][1], x, 1.0), 1.0)


@pytest.mark.parametrize("name", list(LAYERS))
def test_bad_calls_name_the_argument(name):
    layer = LAYERS[name][0]()
    with pytest.raises(RuntimeError, match="call forward first"):
        layer.backward(np.ones(3, F32))
    with pytest.raises(TypeError, match="^x: expected real numbers"):
        layer.forward(np.array(["a", "b"]))
    with pytest.raises(TypeError, match="^x: "):
        layer.forward(np.ones(3, np.complex64))
    layer.forward(np.ones((2, 3), F32))
    with pytest.raises(ValueError, match=r"^grad_out: expected shape \(2, 3\)"):
        layer.backward(np.ones((3, 2), F32))
    with pytest.raises(TypeError, match="^grad_out: "):
        layer.backward(np.ones((2, 3), np.complex64))


def test_other_real_dtypes_are_converted():
    layer = go.nn.GELU()
    y = layer.forward(np.array([[1, -2, 3]], dtype=np.int64))
    assert y.dtype == F32
    np.testing.assert_allclose(y, gelu64(np.array([[1.0, -2.0, 3.0]])), rtol=2e-6)
    gx = layer.backward(np.ones((1, 3), dtype=np.float64))
    assert gx.dtype == F32


@pytest.mark.parametrize("call,exc,match", [
    (lambda: go.nn.GELU("erf"), ValueError, "^approximate: expected 'none' or 'tanh'"),
    (lambda: go.nn.GELU(approximate="Tanh"), ValueError, "^approximate: "),
    (lambda: go.nn.GELU(None), TypeError, "^approximate: "),
    (lambda: go.nn.GELU(True), TypeError, "^approximate: "),
    (lambda: go.nn.LeakyReLU("0.1"), TypeError, "^negative_slope: expected a real number"),
    (lambda: go.nn.LeakyReLU(None), TypeError, "^negative_slope: "),
    (lambda: go.nn.LeakyReLU(True), TypeError, "^negative_slope: "),
    (lambda: go.nn.LeakyReLU(float("nan")), ValueError, "^negative_slope: "),
    (lambda: go.nn.LeakyReLU(float("inf")), ValueError, "^negative_slope: "),
    (lambda: go.nn.LeakyReLU(1e39), ValueError, "^negative_slope: "),
])
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_reprs_and_exports():
    assert repr(go.nn.GELU()) == "GELU(approximate='none')"
    assert repr(go.nn.GELU(approximate="tanh")) == "GELU(approximate='tanh')"
    assert repr(go.nn.LeakyReLU(negative_slope=0.2)) == "LeakyReLU(negative_slope=0.2)"
    assert repr(go.nn.Tanh()) == "Tanh()"
    assert repr(go.nn.Sigmoid()) == "Sigmoid()"
    assert repr(go.nn.SiLU()) == "SiLU()"
    assert go.nn.LeakyReLU().negative_slope == 0.01
    for name in ("GELU", "LeakyReLU", "SiLU", "Sigmoid", "Tanh"):
        assert name in go.nn.__all__
        assert go.nn.GELU().parameters() == []


@pytest.mark.parametrize("act", ["Tanh", "Sigmoid", "SiLU", "GELU", "GELU-tanh", "LeakyReLU"])
def test_in_a_model_parameter_gradients_match_numerical(act):
    rng = np.random.default_rng(3)
    model = go.nn.Sequential(go.nn.Linear(5, 7, rng=1), LAYERS[act][0](),
                             go.nn.Linear(7, 3, rng=2))
    x = rng.standard_normal((4, 5)).astype(F32)
    c = rng.standard_normal((4, 3))
    f64 = LAYERS[act][1]
    l1, l2 = model[0], model[2]

    def loss64():
        h = f64(x.astype(np.float64) @ l1.weight.data + l1.bias.data)
        return float(np.sum(c * (h @ l2.weight.data + l2.bias.data)))

    model.forward(x)
    model.backward(c.astype(F32))
    w = l1.weight.data
    num = np.zeros(w.shape)
    for i in np.ndindex(w.shape):
        old = w[i]
        w[i] = old + 1e-2
        fp = loss64()
        w[i] = old - 1e-2
        fm = loss64()
        w[i] = old
        num[i] = (fp - fm) / 2e-2
    np.testing.assert_allclose(l1.weight.grad, num, rtol=2e-2, atol=2e-3)


def test_trains_in_fit():
    # a small regression, GELU in the middle: the loss goes down
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 4)).astype(F32)
    y = np.tanh(x @ rng.standard_normal((4, 2))).astype(F32)
    ds = go.Dataset.from_arrays(x, y)
    model = go.nn.Sequential(go.nn.Linear(4, 16, rng=0), go.nn.GELU(), go.nn.Linear(16, 2, rng=1))
    hist = go.fit(model, ds, go.LossType.MEAN_SQUARED_ERROR, nepoch=20, nbatch_logical=32,
                  nbatch_physical=32, silent=True, seed=0)
    assert hist.train_loss[-1] < 0.5 * hist.train_loss[0]
