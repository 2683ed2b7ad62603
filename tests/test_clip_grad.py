"""Gradient clipping by global L2 norm (clip_grad_norm=) against NumPy."""
import math

import numpy as np
import pytest

import ggmlopt as go

SIZES = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 1000, 4097]


class Scale:
    """out = x * w (elementwise over columns) for parameters w split in pieces; with
    the SUM loss, d loss / d w = the column sums of x."""

    def __init__(self, sizes, seed=0):
        rng = np.random.default_rng(seed)
        self.ws = [go.nn.Parameter(rng.normal(size=n)) for n in sizes]

    def parameters(self):
        return self.ws

    def forward(self, x):
        self.x = x
        return x * np.concatenate([w.data for w in self.ws])

    def backward(self, g):
        gw = (g * self.x).sum(axis=0, dtype=np.float32)
        start = 0
        for w in self.ws:
            w.grad += gw[start:start + w.size]
            start += w.size


def reference_clip(g, max_norm):
    """torch's rule in float64: (clipped gradient, norm); torch clamps the factor
    max / (norm + 1e-6) at 1, so it scales from norm > max - 1e-6 on."""
    g = g.astype(np.float64)
    norm = math.sqrt(float(np.sum(g * g)))
    return g * min(1.0, max_norm / (norm + 1e-6)), norm


def one_step(sizes, clip, optimizer=go.OptimizerType.SGD, x=None, opt_period=1):
    model = Scale(sizes)
    n = sum(sizes)
    ctx = go.OptContext(model, batch_size=2, ne_datapoint=n, loss_type=go.LossType.SUM,
                        optimizer=optimizer, opt_period=opt_period, clip_grad_norm=clip,
                        get_opt_pars=go.constant_optimizer_params,
                        get_opt_pars_ud=go.OptimizerParams(sgd=go.SGDParams(alpha=0.5)))
    w0 = np.concatenate([w.data for w in model.ws]).copy()
    for k in range(opt_period):
        ctx.alloc(True)
        ctx.eval(None, inputs=x[k])
    g = np.concatenate([ctx.grad_acc(w) for w in model.ws])
    w1 = np.concatenate([w.data for w in model.ws])
    return ctx, w0, g, w1


@pytest.mark.parametrize("n", SIZES)
def test_clipped_gradient_and_step_match_numpy(n):
    rng = np.random.default_rng(n)
    x = rng.normal(size=(1, 2, n)).astype(np.float32)
    raw = x[0].sum(axis=0, dtype=np.float32)
    _, norm = reference_clip(raw, 1.0)
    max_norm = norm / 3
    ctx, w0, g, w1 = one_step([n], max_norm, x=x)
    want, _ = reference_clip(raw, max_norm)
    assert ctx.grad_norm == pytest.approx(norm, rel=1e-6)
    # after the step grad_acc shows the clipped gradient
    np.testing.assert_allclose(g, want, rtol=2e-6, atol=1e-7)
    assert math.sqrt(float(np.sum(g.astype(np.float64) ** 2))) == pytest.approx(max_norm, rel=1e-5)
    # and the SGD step used it
    np.testing.assert_allclose(w1, w0 - 0.5 * want, rtol=1e-5, atol=1e-6)


def test_norm_is_global_over_all_parameters_and_accumulated_batches():
    sizes = [3, 17, 1, 40]
    n = sum(sizes)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 2, n)).astype(np.float32)
    raw = x.sum(axis=(0, 1), dtype=np.float64)  # three physical batches summed
    _, norm = reference_clip(raw, 1.0)
    ctx, _, g, _ = one_step(sizes, 2.0, x=x, opt_period=3)
    want, _ = reference_clip(raw, 2.0)
    assert ctx.grad_norm == pytest.approx(norm, rel=1e-5)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
    # per parameter the norms differ from 2: one global factor, not one per parameter
    factor = 2.0 / (norm + 1e-6)
    start = 0
    for s in sizes:
        np.testing.assert_allclose(g[start:start + s], raw[start:start + s] * factor,
                                   rtol=1e-5, atol=1e-6)
        start += s


@pytest.mark.parametrize("optimizer", list(go.OptimizerType))
def test_below_the_limit_nothing_changes(optimizer):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(1, 2, 33)).astype(np.float32)
    _, _, g_free, w_free = one_step([33], None, optimizer, x=x)
    raw_norm = math.sqrt(float(np.sum(g_free.astype(np.float64) ** 2)))
    for clip in (raw_norm * 1.01, float("inf")):
        ctx, _, g, w = one_step([33], clip, optimizer, x=x)
        assert g.tobytes() == g_free.tobytes() and w.tobytes() == w_free.tobytes()
        assert ctx.grad_norm == pytest.approx(raw_norm, rel=1e-6)
    # a limit below the norm scales the gradient the step used, for either optimizer
    ctx, _, g, w = one_step([33], raw_norm / 4, optimizer, x=x)
    np.testing.assert_allclose(g, g_free * (raw_norm / 4) / (raw_norm + 1e-6), rtol=2e-6)


def test_a_limit_within_1e6_above_the_norm_scales_as_torch_clamps():
    # torch's factor max / (norm + 1e-6) is below 1 for max - 1e-6 < norm <= max
    # too; with a small norm the factor (norm + 4e-7) / (norm + 1e-6) is 3e-4 off 1,
    # far beyond float32 rounding
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(1, 2, 21)) * 1e-4).astype(np.float32)
    raw = x[0].sum(axis=0, dtype=np.float32)
    _, norm = reference_clip(raw, 1.0)
    assert norm < 3e-3
    max_norm = norm + 4e-7
    _, _, g, _ = one_step([21], max_norm, x=x)
    want, _ = reference_clip(raw, max_norm)
    assert abs(want[0] / raw[0] - 1) > 1e-4
    np.testing.assert_allclose(g, want, rtol=2e-6, atol=0)
    # and a limit that far above the norm leaves it
    _, _, g, _ = one_step([21], norm + 2e-6, x=x)
    assert g.tobytes() == raw.tobytes()


def test_clipping_equals_torch_clip_grad_norm():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    for scale, offset in ((1.0, -0.5), (1e-4, 4e-7), (1e-4, 2e-6)):
        x = (rng.normal(size=(1, 2, 37)) * scale).astype(np.float32)
        raw = x[0].sum(axis=0, dtype=np.float32)
        max_norm = float(np.sqrt(np.sum(raw.astype(np.float64) ** 2))) + offset
        t = torch.nn.Parameter(torch.zeros(37))
        t.grad = torch.from_numpy(raw.copy())
        torch.nn.utils.clip_grad_norm_([t], max_norm)
        _, _, g, _ = one_step([37], max_norm, x=x)
        # torch's norm and factor in float32 against ours in double: a few float32 ulps
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=4 * np.finfo(np.float32).eps,
                                   atol=0)


def test_manual_clip_and_arena_entry_point():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1, 2, 9)).astype(np.float32)
    ctx, _, g, _ = one_step([9], None, x=x)
    before = g.copy()
    norm = go.clipping.clip_grad_norm(ctx, 0.25)
    assert norm == pytest.approx(np.sqrt(np.sum(before.astype(np.float64) ** 2)), rel=1e-6)
    after = ctx.grad_acc(ctx.parameters()[0])
    np.testing.assert_allclose(after, before * 0.25 / (norm + 1e-6), rtol=2e-6)
    with pytest.raises(TypeError, match="ctx"):
        go.clipping.clip_grad_norm(object(), 1.0)
    with pytest.raises(ValueError, match="max_norm"):
        go.clipping.clip_grad_norm(ctx, -1.0)


@pytest.mark.parametrize("bad,exc", [(-1.0, ValueError), (0, ValueError), (float("nan"), ValueError),
                                     (-float("inf"), ValueError), ("1", TypeError),
                                     (True, TypeError), ([1.0], TypeError)])
def test_bad_clip_grad_norm(bad, exc):
    model = go.nn.Linear(2, 2)
    with pytest.raises(exc, match="clip_grad_norm"):
        go.OptContext(model, clip_grad_norm=bad)
    assert model.weight.data.base is None  # the context did not take the parameters
    ds = go.Dataset.from_arrays(np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32))
    with pytest.raises(exc, match="clip_grad_norm"):
        go.fit(model, ds, go.LossType.MEAN_SQUARED_ERROR, nbatch_logical=2, silent=True,
               clip_grad_norm=bad)
    ctx = go.OptContext(go.nn.Linear(2, 2), clip_grad_norm=3)
    with pytest.raises(exc, match="clip_grad_norm"):
        ctx.clip_grad_norm = bad
    assert ctx.clip_grad_norm == 3.0
    ctx.clip_grad_norm = None
    assert ctx.clip_grad_norm is None


def test_a_nan_norm_makes_the_gradient_nan_as_torch_does():
    """[nan, 2, 3] clipped to 1: torch scales by clamp(nan) = nan; the finite
    elements were left unclipped (and stepped)."""
    p = go.nn.Parameter(np.zeros(3, np.float32))

    class Holder:
        def parameters(self):
            return [p]

        def forward(self, x):
            return x

        def backward(self, g):
            return g

    ctx = go.OptContext(Holder(), loss_type=go.LossType.MEAN_SQUARED_ERROR,
                        build_type=go.BuildType.GRAD)
    p.grad[...] = np.array([np.nan, 2.0, 3.0], np.float32)
    norm = go.clipping.clip_grad_norm(ctx, 1.0)
    assert np.isnan(norm) and np.isnan(p.grad).all()


def test_clipping_a_context_that_keeps_no_gradient_says_why():
    model = go.nn.Sequential(go.nn.Linear(3, 1, rng=0))
    ctx = go.OptContext(model, loss_type=go.LossType.MEAN_SQUARED_ERROR,
                        optimizer_in_backward=True)
    with pytest.raises(RuntimeError, match="optimizer_in_backward=True"):
        go.clipping.clip_grad_norm(ctx, 1.0)
