"""ggmlopt.nn.init: torch's initialisers on ggmlopt's layouts, checked against
torch's formulas (fans of the torch layout of the same layer) and samples."""
import math

import numpy as np
import pytest

from ggmlopt.nn import Conv2d, Linear, Parameter, init

LINEAR = (300, 200)          # ggmlopt Linear weight (in, out); torch's is (200, 300)
CONV = (16, 8, 5, 5)         # Conv2d weight (out, in, kh, kw), as torch's
NONLINEARITIES = ["linear", "conv2d", "sigmoid", "tanh", "relu", "leaky_relu", "selu"]


def _torch_layout(shape):
    return shape[::-1] if len(shape) == 2 else shape


def _torch_fans(shape):
    """torch's own fan computation on the torch layout of the same layer."""
    torch = pytest.importorskip("torch")
    return torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(_torch_layout(shape)))


def _fans(shape):
    """torch's formula, written out: (fan_in, fan_out) of the torch layout."""
    t = _torch_layout(shape)
    receptive = math.prod(t[2:])
    return t[1] * receptive, t[0] * receptive


@pytest.mark.parametrize("shape", [LINEAR, CONV, (7, 9), (3, 2, 1)])
def test_fans_are_torchs_for_the_same_layer(shape):
    assert init._fan_in_and_fan_out(np.zeros(shape, np.float32)) == _fans(shape)
    assert init._fan_in_and_fan_out(np.zeros(shape, np.float32)) == _torch_fans(shape)


@pytest.mark.parametrize("nonlinearity", NONLINEARITIES)
@pytest.mark.parametrize("param", [None, 0.2, 3])
def test_calculate_gain_matches_torch(nonlinearity, param):
    torch = pytest.importorskip("torch")
    assert init.calculate_gain(nonlinearity, param) == pytest.approx(
        torch.nn.init.calculate_gain(nonlinearity, param), rel=1e-12)


def test_calculate_gain_formulas():
    assert init.calculate_gain("relu") == math.sqrt(2)
    assert init.calculate_gain("tanh") == 5 / 3
    assert init.calculate_gain("leaky_relu") == math.sqrt(2 / (1 + 0.01 ** 2))
    assert init.calculate_gain("leaky_relu", math.sqrt(5)) == math.sqrt(1 / 3)
    with pytest.raises(ValueError, match="nonlinearity: .*'gelu'"):
        init.calculate_gain("gelu")


def _std_and_bound(name, shape, kwargs):
    """The formula's (std, bound of the support or None)."""
    fan_in, fan_out = _fans(shape)
    if name.startswith("xavier"):
        std = kwargs.get("gain", 1.0) * math.sqrt(2.0 / (fan_in + fan_out))
    else:
        fan = fan_in if kwargs.get("mode", "fan_in") == "fan_in" else fan_out
        a = kwargs.get("a", 0)
        gain = init.calculate_gain(kwargs.get("nonlinearity", "leaky_relu"), a)
        std = gain / math.sqrt(fan)
    uniform = name.endswith("uniform_")
    return std, (math.sqrt(3.0) * std if uniform else None)


CASES = [
    ("xavier_uniform_", {}), ("xavier_uniform_", {"gain": 2.5}),
    ("xavier_normal_", {}), ("xavier_normal_", {"gain": 0.5}),
    ("kaiming_uniform_", {}), ("kaiming_uniform_", {"a": math.sqrt(5)}),
    ("kaiming_uniform_", {"mode": "fan_out", "nonlinearity": "relu"}),
    ("kaiming_normal_", {}), ("kaiming_normal_", {"mode": "fan_out", "nonlinearity": "relu"}),
    ("kaiming_normal_", {"a": 0.2, "nonlinearity": "leaky_relu"}),
]


@pytest.mark.parametrize("shape", [LINEAR, CONV])
@pytest.mark.parametrize(("name", "kwargs"), CASES)
def test_statistics_follow_torchs_formulas(name, kwargs, shape):
    w = np.zeros(shape, np.float32)
    assert getattr(init, name)(w, **kwargs, rng=0) is w
    std, bound = _std_and_bound(name, shape, kwargs)
    assert abs(w.mean()) < 4 * std / math.sqrt(w.size)
    assert w.std() == pytest.approx(std, rel=0.03)
    if bound is not None:
        assert np.abs(w).max() <= np.float32(bound)
        assert np.abs(w).max() > 0.99 * bound


@pytest.mark.parametrize("shape", [LINEAR, CONV])
@pytest.mark.parametrize(("name", "kwargs"), CASES)
def test_statistics_match_torchs_samples(name, kwargs, shape):
    """The same layer initialised by torch (its layout) has the same spread."""
    torch = pytest.importorskip("torch")
    ours = getattr(init, name)(np.zeros(shape, np.float32), **kwargs, rng=1)
    theirs = torch.empty(_torch_layout(shape))
    getattr(torch.nn.init, name)(theirs, **kwargs, generator=torch.Generator().manual_seed(1))
    theirs = theirs.numpy()
    assert ours.std() == pytest.approx(theirs.std(), rel=0.05)
    if name.endswith("uniform_"):
        assert np.abs(ours).max() == pytest.approx(np.abs(theirs).max(), rel=0.01)


def test_torchs_default_layer_init_is_kaiming_uniform_with_a_sqrt5():
    """kaiming_uniform_(a=sqrt(5)) is U(+-1/sqrt(fan_in)): Linear's default init
    (kaiming_uniform) and Conv2d's."""
    for layer, fan_in in ((Linear(300, 200, rng=0), 300), (Conv2d(8, 16, 5, rng=0), 200)):
        w = layer.weight.data
        bound = 1 / math.sqrt(fan_in)
        ours = init.kaiming_uniform_(np.zeros_like(w), a=math.sqrt(5), rng=0)
        assert np.abs(ours).max() <= np.float32(bound) and np.abs(w).max() <= np.float32(bound)
        assert ours.std() == pytest.approx(w.std(), rel=0.05)


def test_uniform_normal_constant_ones_zeros():
    w = np.empty((400, 300), np.float32)
    init.uniform_(w, -0.5, 2.0, rng=0)
    assert w.min() >= -0.5 and w.max() <= 2.0 and w.mean() == pytest.approx(0.75, abs=0.01)
    assert w.std() == pytest.approx(2.5 / math.sqrt(12), rel=0.01)
    init.uniform_(w, rng=0)  # torch's defaults: U(0, 1)
    assert w.min() >= 0 and w.max() <= 1
    init.normal_(w, 3.0, 0.01, rng=0)  # ggml's examples: N(0, 0.01), here around 3
    assert w.mean() == pytest.approx(3.0, abs=1e-4) and w.std() == pytest.approx(0.01, rel=0.01)
    assert init.constant_(w, 0.25) is w and np.all(w == np.float32(0.25))
    assert np.all(init.ones_(w) == 1) and np.all(init.zeros_(w) == 0)
    b = np.empty(7, np.float32)  # any shape, also a bias
    assert np.all(init.ones_(b) == 1)
    init.normal_(b, rng=0)
    assert np.all(np.isfinite(b))


@pytest.mark.parametrize(("mean", "std", "a", "b"),
                         [(0.0, 1.0, -2.0, 2.0), (0.0, 0.02, -0.04, 0.04), (1.0, 2.0, 0.5, 9.0)])
def test_trunc_normal_matches_torch(mean, std, a, b):
    w = init.trunc_normal_(np.empty((300, 200), np.float32), mean, std, a, b, rng=0)
    assert w.min() >= np.float32(a) and w.max() <= np.float32(b)
    assert w.min() < a + 0.05 * (b - a) and w.max() > b - 0.05 * (b - a)
    # the truncated normal's mean and variance (closed form)
    alpha, beta = (a - mean) / std, (b - mean) / std
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
    z = cdf(beta) - cdf(alpha)
    t_mean = mean + (pdf(alpha) - pdf(beta)) / z * std
    t_var = std ** 2 * (1 + (alpha * pdf(alpha) - beta * pdf(beta)) / z
                        - ((pdf(alpha) - pdf(beta)) / z) ** 2)
    assert w.mean() == pytest.approx(t_mean, abs=4 * math.sqrt(t_var / w.size))
    assert w.std() == pytest.approx(math.sqrt(t_var), rel=0.02)
    torch = pytest.importorskip("torch")
    theirs = torch.nn.init.trunc_normal_(torch.empty(200, 300), mean, std, a, b).numpy()
    assert w.std() == pytest.approx(theirs.std(), rel=0.03)


def test_rng_seed_generator_and_parameter():
    w1, w2 = np.empty((5, 4), np.float32), np.empty((5, 4), np.float32)
    init.xavier_uniform_(w1, rng=7)
    init.xavier_uniform_(w2, rng=7)
    np.testing.assert_array_equal(w1, w2)  # an int seed is reproducible
    gen = np.random.default_rng(7)
    init.xavier_uniform_(w2, rng=gen)
    np.testing.assert_array_equal(w1, w2)  # the same stream as the seed
    init.xavier_uniform_(w2, rng=gen)
    assert not np.array_equal(w1, w2)  # a Generator advances
    p = Parameter(np.zeros((5, 4), np.float32))
    assert init.kaiming_normal_(p, rng=0) is p.data and p.data.std() > 0
    # a non-contiguous view is filled in place
    big = np.zeros((10, 8), np.float32)
    init.ones_(big[::2, 1::2])
    assert big.sum() == 20 and np.all(big[::2, 1::2] == 1)


def test_bad_arguments_leave_the_array_unchanged():
    w = np.full((4, 3), 5.0, np.float32)
    with pytest.raises(TypeError, match="array: expected dtype float32, got float64"):
        init.normal_(np.zeros((2, 2)))
    with pytest.raises(TypeError, match="array: expected a float32 numpy.ndarray"):
        init.zeros_([1.0, 2.0])
    ro = np.zeros((2, 2), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        init.ones_(ro)
    for call, error, match in (
            (lambda: init.kaiming_uniform_(w, mode="fan_avg"), ValueError, "mode: "),
            (lambda: init.kaiming_normal_(w, nonlinearity="gelu"), ValueError,
             "nonlinearity: "),
            (lambda: init.xavier_uniform_(np.zeros(3, np.float32)), ValueError,
             "at least 2 dimensions"),
            (lambda: init.uniform_(w, 1.0, 0.0), ValueError, "a, b: expected a <= b"),
            (lambda: init.normal_(w, std=-1.0), ValueError, "std: expected >= 0"),
            (lambda: init.normal_(w, std="1"), TypeError, "std: expected a real number"),
            (lambda: init.constant_(w, math.nan), ValueError, "val: expected a finite"),
            (lambda: init.trunc_normal_(w, a=2.0, b=-2.0), ValueError, "a, b: expected a < b"),
            (lambda: init.trunc_normal_(w, a=10.0, b=11.0), ValueError, "holds"),
            (lambda: init.uniform_(w, rng="seed"), TypeError, "rng: expected None, an int"),
            (lambda: init.uniform_(w, rng=1.5), TypeError, "rng: "),
    ):
        with pytest.raises(error, match=match):
            call()
    assert np.all(w == 5.0)


def test_as_a_layers_init():
    def xavier(weight, bias, rng):
        init.xavier_uniform_(weight, rng=rng)
        if bias is not None:
            init.zeros_(bias)

    layer = Linear(300, 200, init=xavier, rng=0)
    bound = math.sqrt(6 / 500)
    assert np.abs(layer.weight.data).max() <= np.float32(bound)
    assert layer.weight.data.std() == pytest.approx(bound / math.sqrt(3), rel=0.03)
    assert np.all(layer.bias.data == 0)
