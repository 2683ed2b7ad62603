"""Dropout and the training protocol: the mask rate, no effect in evals that do
not train, the context's rng (never drawn by the construction probe), and
bit-exact resume with dropout on."""
import math

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.nn import Dropout, Linear, ReLU, Sequential


def _rng_state(rng):
    return rng.bit_generator.state


def expected_dropout(x, p, seed):
    """The documented draw: x.size float32 uniforms from default_rng(seed), keep
    where >= p, kept elements times float32(1 / (1 - p))."""
    u = np.random.default_rng(seed).random(x.shape, dtype=np.float32)
    keep = u >= np.float32(p)
    return np.where(keep, x * np.float32(1.0 / (1.0 - p)), np.float32(0)), keep


@pytest.mark.parametrize("p", [True, "0.5", None, 1j])
def test_p_of_wrong_type_is_a_type_error(p):
    with pytest.raises(TypeError, match="p: expected a float"):
        Dropout(p)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, math.nan, math.inf])
def test_p_outside_0_1_is_a_value_error(p):
    with pytest.raises(ValueError, match=r"p: expected a drop probability in \[0, 1\)"):
        Dropout(p)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("shape", [(1000, 37), (64, 3, 5, 7)])
def test_mask_rate_and_scale(p, shape):
    d = Dropout(p, rng=7).train()
    x = np.ones(shape, np.float32)
    out = d.forward(x)
    n = out.size
    dropped = np.count_nonzero(out == 0)
    # binomial(n, p): within 5 standard deviations
    assert abs(dropped - p * n) < 5 * math.sqrt(n * p * (1 - p))
    kept = out[out != 0]
    np.testing.assert_array_equal(kept, np.float32(1 / (1 - p)))
    assert abs(out.mean(dtype=np.float64) - 1.0) < 5 * math.sqrt(p / (1 - p) / n)


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (2, 3, 5, 5)])
def test_forward_and_backward_follow_the_documented_draw(shape):
    p = 0.3
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    d = Dropout(p, rng=11).train()
    want, keep = expected_dropout(x, p, 11)
    np.testing.assert_array_equal(d.forward(x), want)
    # d sum(g * out) / dx = g * mask: the same mask and scale
    grad_in = d.backward(g)
    np.testing.assert_allclose(grad_in, np.where(keep, g.astype(np.float64) / (1 - p), 0),
                               rtol=1e-6)
    assert np.array_equal(grad_in == 0, ~keep | (g == 0))


def test_not_training_is_the_identity_and_draws_nothing():
    d = Dropout(0.5, rng=3)
    assert d.training is False
    before = _rng_state(d.rng)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = d.forward(x)
    assert out is x
    g = np.ones((3, 4), np.float32)
    assert d.backward(g) is g
    assert _rng_state(d.rng) == before
    # p = 0 while training: identity, no draws either
    d0 = Dropout(0.0, rng=3).train()
    before = _rng_state(d0.rng)
    np.testing.assert_array_equal(d0(x), x)
    assert _rng_state(d0.rng) == before


def test_input_conversion_and_bad_input():
    d = Dropout(0.5, rng=0).train()
    out = d.forward(np.ones((4, 3)))  # float64 in: float32 out
    assert out.dtype == np.float32 and out.shape == (4, 3)
    with pytest.raises(TypeError, match="x: expected real numbers"):
        d.forward(np.array([["a"]]))
    with pytest.raises(ValueError, match="x: expected an array with a batch dimension"):
        d.forward(np.float32(1))
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(4, 3\)"):
        d.backward(np.ones((4, 4), np.float32))
    with pytest.raises(RuntimeError, match="backward: call forward first"):
        Dropout(0.5).backward(np.ones((1, 1), np.float32))
    with pytest.raises(TypeError, match="rng: expected a numpy.random.Generator"):
        d.set_rng(5)
    first = Dropout(0.5, rng=0).train()
    first.needs_input_grad = False
    first.forward(np.ones((2, 2), np.float32))
    assert first.backward(np.ones((2, 2), np.float32)) is None


# ---- the training protocol through an OptContext --------------------------------------

def dropout_model(seed=0, p=0.5):
    return Sequential(Linear(6, 16, rng=seed), ReLU(), Dropout(p), Linear(16, 3, rng=seed + 1))


def plain_model(seed=0):
    return Sequential(Linear(6, 16, rng=seed), ReLU(), Linear(16, 3, rng=seed + 1))


def test_no_effect_in_evals_that_do_not_train():
    x = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    model, plain = dropout_model(), plain_model()
    ctx = go.OptContext(model, loss_type=go.LossType.SUM, seed=5)
    ref = go.OptContext(plain, loss_type=go.LossType.SUM, seed=5)
    before = _rng_state(ctx.rng)
    ctx.alloc(False)
    ctx.eval(inputs=x)
    ref.alloc(False)
    ref.eval(inputs=x)
    assert model[2].training is False and model.training is False
    np.testing.assert_array_equal(ctx.outputs, ref.outputs)
    assert _rng_state(ctx.rng) == before       # a forward eval draws nothing
    ctx.alloc(True)
    ctx.eval(inputs=x)
    assert model[2].training is True and model.training is True
    assert _rng_state(ctx.rng) != before       # a training eval draws from ctx.rng
    assert model[2].rng is ctx.rng


def test_training_evals_draw_masks_from_the_context_rng():
    x = np.ones((5, 6), np.float32)
    model = dropout_model()
    ctx = go.OptContext(model, loss_type=go.LossType.SUM, seed=9)
    hidden = model[1].forward(model[0].forward(x)).copy()
    ctx.alloc(True)
    ctx.eval(inputs=x)
    want, _ = expected_dropout(hidden, 0.5, 9)
    np.testing.assert_array_equal(model[2]._out, want)


def test_construction_probe_runs_in_eval_mode_and_draws_nothing():
    model = dropout_model().train()
    own = _rng_state(model[2].rng)
    ctx = go.OptContext(model, batch_size=4, ne_datapoint=6, loss_type=go.LossType.SUM,
                        seed=3)
    assert _rng_state(ctx.rng) == _rng_state(np.random.default_rng(3))
    assert _rng_state(model[2].rng) == own
    assert model.training is True and model[2].training is True   # flags restored
    assert model[2].rng is not ctx.rng                               # bound at alloc only
    # a second context built on a model another context drives does not draw from
    # the first context's rng
    ctx.alloc(True)
    ctx.eval()
    before = _rng_state(ctx.rng)
    go.OptContext(model, batch_size=2, ne_datapoint=6, loss_type=go.LossType.SUM,
                  build_type=go.BuildType.FORWARD)
    assert _rng_state(ctx.rng) == before


class UserDropoutBlock:
    """A user's module that does not subclass Module: reads .training, gets set_rng."""

    def __init__(self):
        self.rng = None
        self.calls = []

    def set_rng(self, rng):
        self.rng = rng

    def parameters(self):
        return []

    def forward(self, x):
        self.calls.append(self.training)
        return x

    def backward(self, g):
        return g


class UserModel:
    """A user's model without train(): attributes holding modules."""

    def __init__(self):
        self.lin = Linear(6, 3, rng=0)
        self.blocks = [UserDropoutBlock()]

    def parameters(self):
        return self.lin.parameters()

    def forward(self, x):
        return self.blocks[0].forward(self.lin.forward(x))

    def backward(self, g):
        return self.lin.backward(self.blocks[0].backward(g))


@pytest.mark.parametrize("nested", [False, True])
def test_protocol_reaches_modules_that_are_not_Module(nested):
    user = UserModel()
    model = Sequential(user, ReLU()) if nested else user
    block = user.blocks[0]
    ctx = go.OptContext(model, batch_size=2, ne_datapoint=6, loss_type=go.LossType.SUM)
    assert block.calls == [False] and block.rng is None      # the probe
    x = np.ones((2, 6), np.float32)
    for backward in (True, False, True):
        ctx.alloc(backward)
        ctx.eval(inputs=x)
    assert block.calls == [False, True, False, True]
    assert block.rng is ctx.rng and user.lin.training is True


class OverridingTrain(go.nn.Module):
    """A Module whose train() does more than set flags: the context must call it."""

    def __init__(self):
        self.lin = Linear(6, 3, rng=0)
        self.drop = Dropout(0.5)
        self.calls = []

    def train(self, mode=True):
        self.calls.append(mode)
        return super().train(mode)

    def forward(self, x):
        return self.drop.forward(self.lin.forward(x))

    def backward(self, g):
        return self.lin.backward(self.drop.backward(g))


def test_an_overriding_train_is_called_on_every_alloc():
    model = OverridingTrain()
    ctx = go.OptContext(Sequential(model, ReLU()), loss_type=go.LossType.SUM)
    x = np.ones((2, 6), np.float32)
    for backward in (True, True, False):
        ctx.alloc(backward)
        ctx.eval(inputs=x)
    assert model.calls == [True, True, False]
    assert model.drop.training is False and model.drop.rng is ctx.rng


def test_the_protocol_object_matches_the_tree_walk():
    from ggmlopt.nn.module import TrainingProtocol

    user = UserModel()
    models = [dropout_model(), Sequential(user, Dropout(0.2)), user]
    for model in models:
        protocol = TrainingProtocol(model)
        rng = np.random.default_rng(0)
        for mode in (True, False):
            protocol.apply(mode, rng)
            got = [getattr(m, "training", None) for m in go.nn.modules(model)]
            go.nn.set_training(model, not mode)
            go.nn.set_training(model, mode)
            assert got == [getattr(m, "training", None) for m in go.nn.modules(model)]
            assert all(getattr(m, "rng", rng) is rng for m in go.nn.modules(model)
                       if hasattr(m, "set_rng"))


def test_the_context_that_runs_is_the_one_drawn_from():
    """Another context training the same model between the evals of a first one
    does not change the first one's masks: every alloc rebinds the rng."""
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((6, 4, 6)).astype(np.float32)

    def masks(interleave):
        model = dropout_model()
        ctx = go.OptContext(model, loss_type=go.LossType.SUM,
                            seed=1)
        other = go.OptContext(model, loss_type=go.LossType.SUM,
                              seed=2) if interleave else None
        got = []
        for x in xs:
            ctx.alloc(True)
            ctx.eval(inputs=x)
            got.append(model[2]._keep.copy())
            if other is not None:
                other.alloc(True)
                other.eval(inputs=x)   # draws from other.rng
        return got, _rng_state(ctx.rng)

    (a, sa), (b, sb) = masks(False), masks(True)
    assert sa == sb
    for ma, mb in zip(a, b):
        np.testing.assert_array_equal(ma, mb)
    assert not np.array_equal(a[0], a[1])


def test_fit_leaves_the_model_in_eval_mode():
    rng = np.random.default_rng(0)
    ds = go.Dataset.from_arrays(rng.standard_normal((40, 6)).astype(np.float32),
                                np.eye(3, dtype=np.float32)[rng.integers(0, 3, 40)])
    model = dropout_model()
    go.fit(model, ds, go.LossType.CROSS_ENTROPY, nepoch=1, nbatch_logical=10, silent=True)
    assert model.training is False and model[2].training is False
    x = rng.standard_normal((3, 6)).astype(np.float32)
    np.testing.assert_array_equal(model(x), model(x))


class _Interrupting:
    """A layer (identity) that raises `error` at its `after`-th training forward."""

    def __init__(self, error, after):
        self.error, self.after, self.calls, self.training = error, after, 0, False

    def parameters(self):
        return []

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == self.after:
                raise self.error
        return x

    def backward(self, grad_out):
        return grad_out


def _fit_data(rng):
    return go.Dataset.from_arrays(rng.standard_normal((40, 6)).astype(np.float32),
                                  np.eye(3, dtype=np.float32)[rng.integers(0, 3, 40)])


def _assert_eval_mode(model, rng):
    assert [m.training for m in go.nn.modules(model)] == [False] * len(list(go.nn.modules(model)))
    x = rng.standard_normal((3, 6)).astype(np.float32)
    np.testing.assert_array_equal(model(x), model(x))


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("boom")])
def test_fit_leaves_the_model_in_eval_mode_when_a_layer_raises(error):
    rng = np.random.default_rng(0)
    model = Sequential(Linear(6, 16, rng=0), ReLU(), Dropout(0.5), _Interrupting(error, 3),
                       Linear(16, 3, rng=1))
    with pytest.raises(type(error)):
        go.fit(model, _fit_data(rng), go.LossType.CROSS_ENTROPY, nepoch=2, nbatch_logical=10,
               silent=True)
    assert model[3].calls == 3  # it stopped in the middle of the first epoch
    _assert_eval_mode(model, rng)


def test_fit_leaves_the_model_in_eval_mode_when_the_progress_callback_raises(monkeypatch):
    from ggmlopt import training

    calls = []

    def interrupt(*args):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(training, "progress_bar", interrupt)
    rng = np.random.default_rng(0)
    model = dropout_model()
    with pytest.raises(KeyboardInterrupt):
        go.fit(model, _fit_data(rng), go.LossType.CROSS_ENTROPY, nepoch=1, nbatch_logical=10)
    assert calls == [True, True]  # two training batches of four ran
    _assert_eval_mode(model, rng)


# ---- bit-exact resume ------------------------------------------------------------------

def _dataset(seed=0, n=200):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    y = np.eye(3, dtype=np.float32)[(x[:, 0] > 0).astype(int) + (x[:, 1] > 0.5)]
    return go.Dataset.from_arrays(x, y, ndata_shard=2)


def _fit(model, ds, nepoch, path=None, resume=False):
    return go.fit(model, ds, go.LossType.CROSS_ENTROPY, nepoch=nepoch, nbatch_logical=20,
                  nbatch_physical=10, val_split=0.2, silent=True, seed=4,
                  checkpoint=path, resume=resume)


def test_fit_resume_with_dropout_is_bit_exact(tmp_path):
    straight = dropout_model()
    h_straight = _fit(straight, _dataset(), 4)

    path = tmp_path / "run.npz"
    first = dropout_model()
    _fit(first, _dataset(), 2, path)
    resumed = dropout_model()   # a fresh process: the same initialisation, then the checkpoint
    h_resumed = _fit(resumed, _dataset(), 4, path, resume=True)

    for a, b in zip(straight.parameters(), resumed.parameters()):
        np.testing.assert_array_equal(a.data, b.data)
    assert h_straight.train_loss == h_resumed.train_loss
    # dropout did act: without it the parameters differ
    no_dropout = dropout_model(p=0.0)
    _fit(no_dropout, _dataset(), 4)
    assert not np.array_equal(no_dropout.parameters()[0].data, straight.parameters()[0].data)


def test_context_load_with_dropout_is_bit_exact(tmp_path):
    def run(ctx, ds, nepochs):
        for _ in range(nepochs):
            ds.shuffle(ctx)
            go.epoch(ctx, ds, go.Result(), go.Result(), 160)

    def make(model):
        return go.OptContext(model, batch_size=10, ne_datapoint=6,
                             loss_type=go.LossType.CROSS_ENTROPY, opt_period=2, seed=8)

    straight = dropout_model()
    run(make(straight), _dataset(1), 3)

    ds = _dataset(1)   # its permutation goes on across the save and load
    half = dropout_model()
    ctx = make(half)
    run(ctx, ds, 1)
    ctx.save(tmp_path / "ctx.npz")
    resumed = dropout_model()
    run(go.OptContext.load(tmp_path / "ctx.npz", resumed), ds, 2)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        np.testing.assert_array_equal(a.data, b.data)
