"""The optimizer protocol (ggmlopt.optimizers): an optimizer defined here, outside
the package, trains through OptContext and fit, keeps its state in the arena,
checkpoints and resumes bit for bit, shards over ranks; AdamW and SGD as
Optimizer objects are ggml's two."""
import os
import sys

import numpy as np
import pytest

import ggmlopt as go

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
from dist_problem import make_problem
from thread_comm import results


class HeavyBall(go.Optimizer):
    """SGD with momentum, as torch.optim.SGD(momentum=mu): b = mu*b + g;
    w = w - alpha*b.  Its learning rate is get_opt_pars' sgd.alpha (so the
    schedules drive it), its momentum a setting of the object."""

    name = "heavy_ball"
    hyperparameter_names = ("alpha", "mu")
    state_names = ("b",)

    def __init__(self, mu=0.9):
        self.mu = mu

    def hyperparameters(self, opt_pars):
        alpha = np.float32(opt_pars.sgd.alpha)
        if not alpha > 0:
            raise ValueError(f"heavy_ball.alpha: expected > 0, got {float(alpha)}")
        return alpha, np.float32(self.mu)

    def restore_hyperparameters(self, values):
        alpha, mu = (np.float32(v) for v in values)
        if not alpha > 0:
            raise ValueError(f"heavy_ball.alpha: expected > 0, got {float(alpha)}")
        return alpha, mu

    def step(self, weights, grads, state, hyper, iteration):
        alpha, mu = hyper
        b = state["b"]
        b *= mu
        b += grads
        weights -= alpha * b


def _pars(alpha=0.05):
    return go.OptimizerParams(sgd=go.SGDParams(alpha=alpha))


def _ctx(model, optimizer, **kw):
    kw.setdefault("get_opt_pars", go.constant_optimizer_params)
    kw.setdefault("get_opt_pars_ud", _pars())
    return go.OptContext(model, batch_size=10, ne_datapoint=13,
                         loss_type=go.LossType.CROSS_ENTROPY, optimizer=optimizer, **kw)


def _steps(ctx, ds, n, first=0):
    for i in range(first, first + n):
        ctx.alloc(True)
        ds.get_batch(ctx.inputs, ctx.labels, i % (ds.ndata // 10))
        ctx.eval()


def _flat(model):
    return np.concatenate([p.data.ravel() for p in model.parameters()])


def test_the_context_steps_with_the_summed_gradient_and_the_state_in_its_arena():
    model, ds = make_problem(0)
    ctx = _ctx(model, HeavyBall(0.8), opt_period=2)
    assert ctx.arena.state_names == ("b",) and ctx.optimizer_type is None
    assert isinstance(ctx.optimizer, HeavyBall)
    params = ctx.parameters()
    b = np.zeros(ctx.arena.size, np.float32)
    for step in range(4):
        before = _flat(model)
        _steps(ctx, ds, 2, 2 * step)          # one logical batch of two physical ones
        g = np.concatenate([ctx.grad_acc(p).ravel() for p in params])  # the summed gradient
        b = b * np.float32(0.8) + g           # the same float32 operations, in NumPy
        np.testing.assert_array_equal(_flat(model), before - np.float32(0.05) * b)
        np.testing.assert_array_equal(ctx.arena.flat("b"), b)
    assert ctx.iter == 5
    ctx.reset(True)
    assert not ctx.arena.flat("b").any() and ctx.iter == 1


def test_state_dict_round_trip_continues_bit_for_bit():
    model, ds = make_problem(0)
    a = _ctx(model, HeavyBall())
    _steps(a, ds, 3)
    sd = a.state_dict()
    assert sd["optimizer"] == -1 and sd["optimizer_name"] == "heavy_ball"
    assert sd["heavy_ball.alpha"] == pytest.approx(0.05) and "heavy_ball_b.0" in sd
    assert not any(k.startswith("adamw") for k in sd)
    other, _ = make_problem(5)
    b = _ctx(other, HeavyBall())
    b.load_state_dict(sd)
    _steps(a, ds, 4, 3)
    _steps(b, ds, 4, 3)
    np.testing.assert_array_equal(_flat(model), _flat(other))
    np.testing.assert_array_equal(a.arena.flat("b"), b.arena.flat("b"))


def test_a_state_of_another_optimizer_is_refused():
    model, ds = make_problem(0)
    a = _ctx(model, HeavyBall())
    _steps(a, ds, 1)
    adamw = _ctx(make_problem(1)[0], "adamw")
    with pytest.raises(ValueError, match="optimizer.*heavy_ball.*ADAMW"):
        adamw.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="optimizer.*ADAMW.*heavy_ball"):
        a.load_state_dict(adamw.state_dict())


def test_load_needs_the_optimizer_defined_outside(tmp_path):
    model, ds = make_problem(0)
    a = _ctx(model, HeavyBall(0.7))
    _steps(a, ds, 3)
    path = tmp_path / "ckpt.npz"
    a.save(path)
    with pytest.raises(ValueError, match="heavy_ball.*optimizer="):
        go.OptContext.load(path, make_problem(1)[0])
    with pytest.raises(ValueError, match="heavy_ball.*SGD"):
        go.OptContext.load(path, make_problem(1)[0], optimizer="sgd")
    other = make_problem(1)[0]
    b = go.OptContext.load(path, other, go.constant_optimizer_params, _pars(),
                           optimizer=HeavyBall(0.7))
    _steps(a, ds, 2, 3)
    _steps(b, ds, 2, 3)
    np.testing.assert_array_equal(_flat(model), _flat(other))


def test_a_bad_hyperparameter_changes_nothing():
    model, ds = make_problem(0)
    ctx = _ctx(model, HeavyBall(), get_opt_pars_ud=_pars(-1.0))
    before = _flat(model)
    ctx.alloc(True)
    ds.get_batch(ctx.inputs, ctx.labels, 0)
    with pytest.raises(ValueError, match="heavy_ball.alpha"):
        ctx.eval()
    np.testing.assert_array_equal(_flat(model), before)
    assert ctx.iter == 1 and not ctx.arena.flat("b").any()


def _fit(nepoch, optimizer, checkpoint=None, resume=False, comm=None, shard=False):
    model, ds = make_problem(0)
    kwargs = {} if comm is None else {"comm": comm, "shard_optimizer": shard}
    hist = go.fit(model, ds, go.LossType.CROSS_ENTROPY, go.schedules.cosine(4, base=_pars(0.1)),
                  nepoch=nepoch, nbatch_logical=60, nbatch_physical=10, val_split=0.3,
                  silent=True, optimizer=optimizer, seed=3, checkpoint=checkpoint,
                  resume=resume, **kwargs)
    return _flat(model), hist


def test_fit_trains_checkpoints_and_resumes_bit_for_bit(tmp_path):
    straight, hist = _fit(4, HeavyBall())
    assert hist.epochs[-1].train_loss < hist.epochs[0].train_loss
    path = str(tmp_path / "fit.npz")
    _fit(2, HeavyBall(), path)
    resumed, hist2 = _fit(4, HeavyBall(), path, resume=True)
    np.testing.assert_array_equal(resumed, straight)
    assert [e.train_loss for e in hist2] == [e.train_loss for e in hist]
    with pytest.raises(ValueError, match="optimizer"):
        _fit(4, "adamw", path, resume=True)   # another optimizer: refused


@pytest.mark.parametrize("shard", [False, True])
def test_over_ranks_equals_one_process(shard):
    one, _ = _fit(2, HeavyBall())
    outs = results(2, lambda c: _fit(2, HeavyBall(), comm=c, shard=shard)[0])
    for flat in outs:
        np.testing.assert_array_equal(flat, outs[0])
    # the ranks sum the gradient in another order than one process: float32 rounding
    np.testing.assert_allclose(outs[0], one, rtol=0, atol=64 * np.finfo(np.float32).eps
                               * np.abs(one).max())


def test_sharded_checkpoint_resumes_bit_for_bit(tmp_path):
    path = str(tmp_path / "sharded.npz")
    straight = results(2, lambda c: _fit(4, HeavyBall(), comm=c, shard=True)[0])[0]
    results(2, lambda c: _fit(2, HeavyBall(), path, comm=c, shard=True))
    resumed = results(2, lambda c: _fit(4, HeavyBall(), path, True, comm=c, shard=True)[0])
    np.testing.assert_array_equal(resumed[0], straight)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_adamw_and_sgd_objects_are_ggmls_two(kind):
    by_enum, _ = _fit(2, kind)
    by_object, _ = _fit(2, {"adamw": go.optimizers.AdamW, "sgd": go.optimizers.SGD}[kind]())
    np.testing.assert_array_equal(by_object, by_enum)


def test_memory_report_counts_the_state_arrays():
    from ggmlopt.models import Llama, LlamaConfig
    lm = Llama(LlamaConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2,
                           max_seq_len=8))
    adamw = go.memory_report(lm, 1, 8, optimizer="adamw")
    sgd = go.memory_report(lm, 1, 8, optimizer="sgd")
    heavy = go.memory_report(lm, 1, 8, optimizer=HeavyBall())
    assert heavy.optimizer_state * 2 == adamw.optimizer_state and sgd.optimizer_state == 0


@pytest.mark.parametrize("attr,value,match", [
    ("name", "heavy.ball", "name must be an identifier"),
    ("state_names", ("grads",), "may not use"),
    ("state_names", ("b", "b"), "repeats"),
    ("hyperparameter_names", ["alpha"], "tuple of identifiers"),
])
def test_a_declaration_that_cannot_make_a_checkpoint_is_refused(attr, value, match):
    bad = type("Bad", (HeavyBall,), {attr: value})
    model, _ = make_problem(0)
    weights = [p.data for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        _ctx(model, bad())
    with pytest.raises(TypeError, match="optimizer: expected"):
        _ctx(model, 1.5)
    # refused before the context took the parameters: the model keeps its arrays
    assert all(p.data is w for p, w in zip(model.parameters(), weights))


class Lion(go.Optimizer):
    """Lion (Chen et al. 2023) with its settings fixed when made: the base class
    reads the hyper-parameters from the attributes of their names."""

    name = "lion"
    hyperparameter_names = ("alpha", "beta1", "beta2")
    state_names = ("m",)

    def __init__(self, alpha=1e-3, beta1=0.9, beta2=0.99):
        self.alpha, self.beta1, self.beta2 = alpha, beta1, beta2

    def step(self, weights, grads, state, hyper, iteration):
        alpha, beta1, beta2 = hyper
        m = state["m"]
        weights -= alpha * np.sign(beta1 * m + (np.float32(1) - beta1) * grads)
        m *= beta2
        m += (np.float32(1) - beta2) * grads


def test_hyperparameters_from_the_optimizers_own_settings(tmp_path):
    straight, _ = _fit(4, Lion(alpha=0.01))
    path = str(tmp_path / "lion.npz")
    _fit(2, Lion(alpha=0.01), path)
    resumed, _ = _fit(4, Lion(alpha=0.01), path, resume=True)
    np.testing.assert_array_equal(resumed, straight)
    sd = go.checkpoint.load_state(path)
    assert sd["lion.alpha"] == pytest.approx(0.01) and sd["lion.beta2"] == pytest.approx(0.99)
    model, _ = make_problem(0)
    with pytest.raises(ValueError, match="lion.alpha"):
        ctx = _ctx(model, Lion(alpha=float("nan")))
        _steps(ctx, make_problem(0)[1], 1)

    class Unsure(Lion):
        hyperparameter_names = ("alpha", "gamma")

    with pytest.raises(NotImplementedError, match="gamma"):
        _steps(_ctx(make_problem(0)[0], Unsure()), make_problem(0)[1], 1)


def test_a_fixed_setting_is_refused_when_the_context_is_made_by_its_name():
    """Lion(alpha=nan): refused at the first eval as get_opt_pars' fault; now by
    the optimizer, when the context is built."""
    model, _ = make_problem(0)
    with pytest.raises(ValueError, match=r"^optimizer: lion\.alpha: expected a finite"):
        _ctx(model, Lion(alpha=float("nan")))


class _Short(HeavyBall):
    def hyperparameters(self, opt_pars):
        return (np.float32(opt_pars.sgd.alpha),)   # one value for two names


def test_hyperparameters_of_the_wrong_count_are_refused_before_anything_changes():
    """(the step's unpacking failed after the backward pass, and a checkpoint
    indexed the values by name)"""
    model, ds = make_problem(0)
    ctx = _ctx(model, _Short())
    before = _flat(model)
    ctx.alloc(True)
    ds.get_batch(ctx.inputs, ctx.labels, 0)
    with pytest.raises(ValueError, match=r"_Short\.hyperparameters gave 1 values for its 2"):
        ctx.eval()
    np.testing.assert_array_equal(_flat(model), before)
    assert all(not np.any(p.grad) for p in model.parameters())
