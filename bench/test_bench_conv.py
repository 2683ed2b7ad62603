"""Conv2d and the pools, forward + backward, against torch.nn on 2 threads: the
two convolutions and pools of ggml's mnist-cnn at batch 500.

The first convolution's input is the data: neither side computes its gradient
(ggmlopt: needs_input_grad False, as Sequential sets it; torch: an input
without requires_grad).  The second one returns the input gradient on both
sides."""
import numpy as np
import pytest
from conftest import measure

from ggmlopt.nn import AvgPool2d, Conv2d, MaxPool2d

# (batch, in_channels, size, out_channels): mnist-cnn's conv layers, 3x3 padding 1
CONVS = [(500, 1, 28, 8), (500, 8, 14, 16)]
POOLS = [(500, 8, 28), (500, 16, 14)]


def conv_case(shape):
    n, c, s, o = shape
    return f"conv2d fwd+bwd ({n},{c},{s},{s})->{o} 3x3 p1"


def _conv_data(shape, rng):
    n, c, s, o = shape
    x = rng.standard_normal((n, c, s, s), dtype=np.float32)
    g = rng.standard_normal((n, o, s, s), dtype=np.float32)
    return x, g


def _ggmlopt_conv(shape, rng):
    _, c, _, o = shape
    conv = Conv2d(c, o, 3, padding=1, rng=0)
    conv.needs_input_grad = c > 1
    x, g = _conv_data(shape, rng)

    def step():
        conv.forward(x)
        conv.backward(g)
    return conv, step


def _torch_conv(shape, rng, torch, conv=None):
    _, c, _, o = shape
    tc = torch.nn.Conv2d(c, o, 3, padding=1)
    if conv is not None:
        with torch.no_grad():
            tc.weight.copy_(torch.from_numpy(conv.weight.data))
            tc.bias.copy_(torch.from_numpy(conv.bias.data))
    x, g = _conv_data(shape, rng)
    xt = torch.from_numpy(x).requires_grad_(c > 1)
    gt = torch.from_numpy(g)

    def step():
        tc.zero_grad(set_to_none=False)
        tc(xt).backward(gt)
    return tc, xt, step


@pytest.mark.parametrize("shape", CONVS, ids=[conv_case(s) for s in CONVS])
@pytest.mark.parametrize("side", ["ggmlopt", "torch"])
def test_conv2d(benchmark, shape, side, rng, threads):
    threads(2)
    n, _, s, o = shape
    items = n * o * s * s
    if side == "ggmlopt":
        _, step = _ggmlopt_conv(shape, rng)
        measure(benchmark, step, case=conv_case(shape), role="ggmlopt",
                label="Conv2d forward + backward", items=items)
    else:
        torch = pytest.importorskip("torch")
        _, _, step = _torch_conv(shape, rng, torch)
        measure(benchmark, step, case=conv_case(shape), role="baseline",
                label="torch.nn.Conv2d forward + backward", target=1.0, items=items)


@pytest.mark.parametrize("shape", POOLS, ids=[f"({n},{c},{s},{s})" for n, c, s in POOLS])
@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("side", ["ggmlopt", "torch"])
def test_pool2d(benchmark, shape, kind, side, rng, threads):
    """No target in the issue: shown for scale."""
    threads(2)
    n, c, s = shape
    x = rng.standard_normal((n, c, s, s), dtype=np.float32)
    g = rng.standard_normal((n, c, s // 2, s // 2), dtype=np.float32)
    case = f"{kind}pool2d 2x2 fwd+bwd ({n},{c},{s},{s})"
    if side == "ggmlopt":
        pool = (MaxPool2d if kind == "max" else AvgPool2d)(2)

        def step():
            pool.forward(x)
            pool.backward(g)
        measure(benchmark, step, case=case, role="ggmlopt",
                label=f"{type(pool).__name__} forward + backward", items=x.size)
    else:
        torch = pytest.importorskip("torch")
        pool = (torch.nn.MaxPool2d if kind == "max" else torch.nn.AvgPool2d)(2)
        xt = torch.from_numpy(x).requires_grad_()
        gt = torch.from_numpy(g)

        def step():
            xt.grad = None
            pool(xt).backward(gt)
        measure(benchmark, step, case=case, role="baseline",
                label=f"torch.nn.{type(pool).__name__} forward + backward", items=x.size)


@pytest.mark.parametrize("shape", CONVS, ids=[conv_case(s) for s in CONVS])
def test_torch_baseline_matches(shape):
    """The baseline computes what ggmlopt does (same weights, same data)."""
    torch = pytest.importorskip("torch")
    conv, step = _ggmlopt_conv(shape, np.random.default_rng(5))
    tc, xt, tstep = _torch_conv(shape, np.random.default_rng(5), torch, conv)
    step()
    tstep()
    np.testing.assert_allclose(conv.weight.grad, tc.weight.grad.numpy(), rtol=1e-3, atol=1e-2)
    np.testing.assert_allclose(conv.bias.grad, tc.bias.grad.numpy(), rtol=1e-3, atol=1e-2)
    if shape[1] > 1:
        np.testing.assert_allclose(conv._grad_in, xt.grad.numpy(), rtol=1e-3, atol=1e-3)
