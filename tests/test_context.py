"""OptContext: losses, optimizers, accumulation, build types and bad input."""
import math
import types

import numpy as np
import pytest

import ggmlopt as go

LT = go.LossType


class Recorder:
    """out = x @ w (w: (n_in, n_out)); remembers the grad_out it was given."""

    def __init__(self, n_in, n_out, seed=0):
        rng = np.random.default_rng(seed)
        self.w = go.nn.Parameter(rng.standard_normal((n_in, n_out)))

    def parameters(self):
        return [self.w]

    def forward(self, x):
        self.x = x
        return x @ self.w.data

    def backward(self, g):
        self.g = g.copy()
        self.w.grad += self.x.T @ g


def ref_loss(lt, out, y, period):
    out = out.astype(np.float64)
    if lt == LT.MEAN:
        return out.sum() / (period * out.size), np.full(out.shape, 1 / (period * out.size))
    if lt == LT.SUM:
        return out.sum(), np.ones(out.shape)
    if lt == LT.MEAN_SQUARED_ERROR:
        d = out - y
        return (d * d).sum() / (period * out.size), 2 * d / (period * out.size)
    z = out - out.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    loss = -(y * logp).sum() / out.shape[0] / period
    return loss, (np.exp(logp) - y) / out.shape[0] / period


@pytest.mark.parametrize("period", [1, 3])
@pytest.mark.parametrize("lt", list(LT))
def test_loss_and_its_gradient(lt, period):
    rng = np.random.default_rng(int(lt) + 10 * period)
    model = Recorder(5, 7)
    ctx = go.OptContext(model, batch_size=9, ne_datapoint=5, loss_type=lt, opt_period=period)
    assert (ctx.labels is None) == (lt in (LT.MEAN, LT.SUM))
    ctx.inputs[...] = rng.standard_normal((9, 5))
    y = None
    if ctx.labels is not None:
        y = rng.random((9, 7)).astype(np.float32)
        y /= y.sum(1, keepdims=True)
        ctx.labels[...] = y
    w_before = model.w.data.copy()
    ctx.alloc(True)
    ctx.eval()
    out = ctx.inputs.astype(np.float64) @ w_before.astype(np.float64)
    loss, grad = ref_loss(lt, out, y, period)
    assert isinstance(ctx.loss, np.float32)
    assert float(ctx.loss) == pytest.approx(loss, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(model.g, grad, rtol=1e-4, atol=1e-7)
    if lt == LT.CROSS_ENTROPY:
        pred = np.argmax(ctx.outputs, axis=1)
        np.testing.assert_array_equal(ctx.pred, pred)
        assert ctx.ncorrect == int((pred == np.argmax(y, axis=1)).sum())
    else:
        assert ctx.pred is None and ctx.ncorrect is None


class FixedGrad:
    """One parameter vector whose gradient in step t is grads[t] (SUM loss, out (1, 1))."""

    def __init__(self, w0, grads):
        self.w = go.nn.Parameter(w0)
        self.grads = grads
        self.t = 0

    def parameters(self):
        return [self.w]

    def forward(self, x):
        return np.zeros((x.shape[0], 1), np.float32)

    def backward(self, g):
        self.w.grad += self.grads[self.t]
        self.t += 1


@pytest.mark.parametrize("n", [1, 7, 33, 4097])
@pytest.mark.parametrize("optimizer", list(go.OptimizerType))
def test_optimizers_match_float64_numpy(optimizer, n):
    rng = np.random.default_rng(n)
    steps = 40
    grads = rng.standard_normal((steps, n)).astype(np.float32)
    w0 = rng.standard_normal(n).astype(np.float32)
    pars = go.OptimizerParams(go.AdamWParams(alpha=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, wd=0.1),
                              go.SGDParams(alpha=0.05, wd=0.02))
    model = FixedGrad(w0, grads)
    ctx = go.OptContext(model, batch_size=1, ne_datapoint=1, loss_type=LT.SUM,
                        optimizer=optimizer, get_opt_pars=go.constant_optimizer_params,
                        get_opt_pars_ud=pars)
    w = w0.astype(np.float64)
    m = np.zeros(n)
    v = np.zeros(n)
    for t in range(1, steps + 1):
        ctx.alloc(True)
        ctx.eval()
        g = grads[t - 1].astype(np.float64)
        if optimizer == go.OptimizerType.SGD:
            w = w * (1 - 0.05 * 0.02) - 0.05 * g
        else:
            m = 0.8 * m + 0.2 * g
            v = 0.95 * v + 0.05 * g * g
            mh = m / (1 - 0.8 ** t)
            vh = np.sqrt(v / (1 - 0.95 ** t)) + 1e-6
            w = w * (1 - 1e-2 * 0.1) - 1e-2 * mh / vh
    assert ctx.iter == steps + 1
    np.testing.assert_allclose(model.w.data, w, rtol=1e-4, atol=1e-5)


def _mlp(seed):
    return go.nn.Sequential(go.nn.Linear(6, 5, rng=seed), go.nn.ReLU(),
                            go.nn.Linear(5, 4, rng=seed + 1))


@pytest.mark.parametrize("lt", [LT.MEAN, LT.CROSS_ENTROPY])
def test_accumulation_equals_one_big_batch(lt):
    rng = np.random.default_rng(3)
    k, b, steps = 3, 4, 4
    x = rng.standard_normal((steps * k * b, 6)).astype(np.float32)
    y = np.eye(4, dtype=np.float32)[rng.integers(0, 4, steps * k * b)]
    small, big = _mlp(0), _mlp(0)
    ctx_s = go.OptContext(small, batch_size=b, ne_datapoint=6, loss_type=lt, opt_period=k)
    ctx_b = go.OptContext(big, batch_size=k * b, ne_datapoint=6, loss_type=lt)
    rs, rb = go.Result(), go.Result()
    for s in range(steps):
        for j in range(k):
            lo = (s * k + j) * b
            ctx_s.alloc(True)
            ctx_s.eval(rs, inputs=x[lo:lo + b], labels=y[lo:lo + b] if ctx_s.labels is not None
                       else None)
        ctx_b.alloc(True)
        ctx_b.eval(rb, inputs=x[s * k * b:(s + 1) * k * b],
                   labels=y[s * k * b:(s + 1) * k * b] if ctx_b.labels is not None else None)
        for ps, pb in zip(small.parameters(), big.parameters()):
            np.testing.assert_allclose(ctx_s.grad_acc(ps), ctx_b.grad_acc(pb), rtol=1e-4,
                                       atol=1e-6)
            np.testing.assert_allclose(ps.data, pb.data, rtol=1e-4, atol=1e-5)
    assert ctx_s.iter == ctx_b.iter == steps + 1
    assert rs.loss()[0] == pytest.approx(rb.loss()[0], rel=1e-5)


def test_dynamic_mode_any_batch_size():
    model = _mlp(1)
    ctx = go.OptContext(model, loss_type=LT.CROSS_ENTROPY)
    assert not ctx.static_graphs and ctx.inputs is None
    for batch in (1, 5, 2):
        ctx.alloc(False)
        ctx.eval(None, inputs=np.ones((batch, 6)), labels=np.eye(4)[:1].repeat(batch, 0))
        assert ctx.outputs.shape == (batch, 4) and ctx.pred.shape == (batch,)
    r = go.Result()
    ctx.alloc(False)
    ctx.eval(r, inputs=np.ones((3, 6)), labels=np.eye(4)[:1].repeat(3, 0))
    ctx.alloc(False)
    with pytest.raises(ValueError, match="batch"):   # a bigger batch cannot join
        ctx.eval(r, inputs=np.ones((4, 6)), labels=np.eye(4)[:1].repeat(4, 0))
    assert r.ndata == 3 and ctx.eval_ready  # nothing changed; the eval may be retried
    ctx.eval(r, inputs=np.ones((2, 6)), labels=np.eye(4)[:1].repeat(2, 0))  # a smaller last one
    ctx.alloc(False)
    with pytest.raises(ValueError, match="smaller batch of 2"):
        ctx.eval(r, inputs=np.ones((3, 6)), labels=np.eye(4)[:1].repeat(3, 0))
    assert r.ndata == 5 and r.nbatches == 2
    with pytest.raises(ValueError, match="labels"):
        ctx.eval(None, inputs=np.ones((2, 6)), labels=np.ones((2, 3)))
    with pytest.raises(ValueError, match="inputs"):
        ctx.eval(None)
    ctx.eval(None, inputs=np.ones((2, 6)), labels=np.ones((2, 4)))
    with pytest.raises(RuntimeError, match="epoch"):
        go.epoch(ctx, go.Dataset(6, 4, 2), go.Result(), None)


def test_grad_context_accumulates_until_reset_and_refuses_opt():
    model = Recorder(2, 1)
    ctx = go.OptContext(model, batch_size=1, ne_datapoint=2, loss_type=LT.SUM,
                        build_type=go.BuildType.GRAD, opt_period=1000)
    ctx.inputs[...] = 1
    w0 = model.w.data.copy()
    for i in range(3):
        ctx.alloc(True)
        ctx.eval()
    np.testing.assert_array_equal(ctx.grad_acc(model.w), np.full((2, 1), 3.0))
    np.testing.assert_array_equal(model.w.data, w0)
    ctx.reset(False)
    assert not ctx.grad_acc(model.w).any()
    grad_opt = go.OptContext(Recorder(2, 1), batch_size=1, ne_datapoint=2, loss_type=LT.SUM,
                             build_type=go.BuildType.GRAD, opt_period=1)
    # opt_period 1: every backward eval would be an optimizer step
    with pytest.raises(RuntimeError, match="GRAD"):
        grad_opt.alloc(True)
    fwd = go.OptContext(Recorder(2, 1), batch_size=1, ne_datapoint=2, loss_type=LT.SUM,
                        build_type=go.BuildType.FORWARD)
    with pytest.raises(RuntimeError, match="FORWARD"):
        fwd.alloc(True)
    fwd.alloc(False)
    fwd.eval()
    assert fwd.iter == 1 and fwd.opt_i == 0


def test_a_forward_context_keeps_no_gradients(tmp_path):
    # ggml's forward graph has no gradient accumulators; inference allocates none
    model = _mlp(0)
    n = sum(p.data.size for p in model.parameters())
    x = np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32)
    want = model.forward(x).copy()
    fwd = go.OptContext(model, batch_size=3, ne_datapoint=6, loss_type=LT.MEAN,
                        build_type=go.BuildType.FORWARD)
    assert not fwd.arena.has_grads and fwd.arena.nbytes < 2 * 4 * n
    with pytest.raises(RuntimeError, match="FORWARD"):
        fwd.grad_acc(model.parameters()[0])
    fwd.inputs[...] = x
    fwd.alloc(False)
    fwd.eval()
    np.testing.assert_array_equal(fwd.outputs, want)
    fwd.save(tmp_path / "f.npz")
    back = go.OptContext.load(tmp_path / "f.npz", _mlp(1))
    for p, q in zip(back.model.parameters(), model.parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    grad = go.OptContext(_mlp(0), batch_size=3, ne_datapoint=6, loss_type=LT.MEAN,
                         build_type=go.BuildType.GRAD)
    assert grad.arena.has_grads and grad.arena.nbytes >= 2 * 4 * n


@pytest.mark.parametrize("fused, ranked", [(True, False), (False, False), (True, True)])
def test_a_refused_eval_leaves_the_generator_as_it_was(fused, ranked):
    # the forward pass draws dropout masks from ctx.rng before the labels are found
    # not to fit: the run must repeat as if the refused call had not been made
    from ggmlopt import lora
    from ggmlopt.models import Llama, LlamaConfig

    def context():
        model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                  ffn_dim=64, max_seq_len=64), seed=0)
        lora.apply(model, rank=2, dropout=0.25, seed=0)
        model.fused_head = fused
        # over a communicator the layers draw from the rank's own generator (model_rng)
        comm = None
        if ranked:
            from thread_comm import ThreadComm, ThreadGroup
            comm = ThreadComm(ThreadGroup(1), 0)
        return go.OptContext(model, loss_type="cross_entropy", seed=1, comm=comm)

    x = np.random.default_rng(0).integers(0, 64, (2, 8)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    refused, plain = context(), context()
    refused.alloc(True)
    with pytest.raises(ValueError, match="labels"):
        refused.eval(inputs=x, labels=y[:, :7].copy())
    refused.eval(inputs=x, labels=y)   # the alloc stands
    plain.alloc(True)
    plain.eval(inputs=x, labels=y)
    assert refused.loss == plain.loss
    assert refused.rng.bit_generator.state == plain.rng.bit_generator.state
    assert refused.model_rng.bit_generator.state == plain.model_rng.bit_generator.state
    for p, q in zip(refused.parameters(), plain.parameters()):
        np.testing.assert_array_equal(p.data, q.data)


def test_counters_and_lazy_zeroing():
    """opt_i counts every eval, iter only OPT steps; with opt_period 2 a forward
    alloc right after an OPT step zeroes the accumulator (ggml_opt_alloc)."""
    model = Recorder(1, 1)
    pars = go.OptimizerParams(sgd=go.SGDParams(alpha=0.5))
    ctx = go.OptContext(model, batch_size=1, ne_datapoint=1, loss_type=LT.SUM, opt_period=2,
                        optimizer=go.OptimizerType.SGD, get_opt_pars=go.constant_optimizer_params,
                        get_opt_pars_ud=pars)
    ctx.inputs[...] = 1
    ctx.alloc(True)
    ctx.eval()
    assert (ctx.opt_i, ctx.iter, ctx.build_type_last) == (1, 1, go.BuildType.GRAD)
    ctx.alloc(True)
    ctx.eval()
    assert (ctx.opt_i, ctx.iter, ctx.build_type_last) == (0, 2, go.BuildType.OPT)
    assert ctx.grad_acc(model.w)[0, 0] == 2.0  # still the summed gradient after the step
    ctx.alloc(False)
    assert ctx.grad_acc(model.w)[0, 0] == 0.0
    ctx.eval()
    assert ctx.opt_i == 1
    ctx.alloc(True)  # (1 + 1) % 2 == 0: an OPT step right away, as ggml
    assert ctx.build_type_last == go.BuildType.OPT
    ctx.eval()
    assert ctx.iter == 3


def test_reset_optimizer_zeroes_momenta_and_iter():
    model = Recorder(3, 1)
    ctx = go.OptContext(model, batch_size=2, ne_datapoint=3, loss_type=LT.MEAN)
    ctx.inputs[...] = 1
    ctx.alloc(True)
    ctx.eval()
    assert ctx.iter == 2 and ctx.arena.flat("m").any()
    ctx.reset(True)
    assert ctx.iter == 1 and not ctx.arena.flat("m").any() and not ctx.arena.flat("v").any()
    assert not ctx.arena.flat("grads").any()


def test_parameters_live_in_the_arena():
    model = _mlp(2)
    before = [p.data.copy() for p in model.parameters()]
    ctx = go.OptContext(model, batch_size=2, ne_datapoint=6, loss_type=LT.CROSS_ENTROPY)
    flat = ctx.arena.flat("weights")
    np.testing.assert_array_equal(flat, np.concatenate([b.ravel() for b in before]))
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.data, b)
        assert np.shares_memory(p.data, flat)
        assert ctx.grad_acc(p) is p.grad
    with pytest.raises(ValueError, match="param"):
        ctx.grad_acc(go.nn.Parameter([1.0]))


def test_seed_fixes_rng():
    a = go.OptContext(_mlp(0), seed=5).rng.permutation(10)
    b = go.OptContext(_mlp(0), seed=5).rng.permutation(10)
    c = go.OptContext(_mlp(0), seed=6).rng.permutation(10)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    np.testing.assert_array_equal(go.OptContext(_mlp(0)).rng.permutation(10),
                                  go.OptContext(_mlp(0)).rng.permutation(10))


class NoParams:
    def parameters(self):
        return []

    def forward(self, x):
        return x

    def backward(self, g):
        pass


class F64Params(NoParams):
    def __init__(self):
        # a parameter-like object (Parameter itself refuses float64 data)
        self.p = types.SimpleNamespace(data=np.ones(1), grad=np.zeros(1))

    def parameters(self):
        return [self.p]


def test_bad_construction():
    with pytest.raises(ValueError, match="no parameters"):
        go.OptContext(NoParams())
    with pytest.raises(TypeError, match="float32"):
        go.OptContext(F64Params())
    with pytest.raises(TypeError, match="forward"):
        go.OptContext(object())
    with pytest.raises(ValueError, match="opt_period"):
        go.OptContext(_mlp(0), opt_period=0)
    with pytest.raises(ValueError, match="loss_type"):
        go.OptContext(_mlp(0), loss_type=7)
    with pytest.raises(ValueError, match="ne_datapoint"):
        go.OptContext(_mlp(0), batch_size=4)
    with pytest.raises(ValueError, match="ne_datapoint|x"):
        go.OptContext(_mlp(0), batch_size=4, ne_datapoint=5)  # the model takes 6
    model = _mlp(0)
    w = model[0].weight.data
    with pytest.raises(TypeError):
        go.OptContext(model, get_opt_pars=3)
    assert model[0].weight.data is w  # nothing moved


def test_eval_alloc_order():
    ctx = go.OptContext(Recorder(1, 1), batch_size=1, ne_datapoint=1)
    with pytest.raises(RuntimeError, match="alloc"):
        ctx.eval()
    ctx.alloc(True)
    with pytest.raises(RuntimeError, match="alloc"):
        ctx.alloc(True)
    ctx.eval()
    with pytest.raises(RuntimeError):
        ctx.eval()


@pytest.mark.parametrize("field,value", [("alpha", 0.0), ("alpha", -1.0), ("beta1", -0.1),
                                         ("beta1", 1.5), ("beta2", 2.0), ("eps", -1e-9),
                                         ("wd", 1.5), ("wd", -0.1), ("alpha", math.nan)])
def test_invalid_adamw_params(field, value):
    pars = go.OptimizerParams()
    setattr(pars.adamw, field, value)
    pars.sgd.alpha = -5.0  # not the active optimizer: not validated
    model = Recorder(1, 1)
    ctx = go.OptContext(model, batch_size=1, ne_datapoint=1,
                        get_opt_pars=go.constant_optimizer_params, get_opt_pars_ud=pars)
    w0 = model.w.data.copy()
    ctx.alloc(True)
    with pytest.raises(ValueError, match=f"adamw.{field}"):
        ctx.eval()
    assert ctx.iter == 1 and ctx.opt_i == 0
    np.testing.assert_array_equal(model.w.data, w0)


@pytest.mark.parametrize("field,value", [("alpha", 0.0), ("wd", 1.01), ("wd", -1.0)])
def test_invalid_sgd_params(field, value):
    pars = go.OptimizerParams()
    setattr(pars.sgd, field, value)
    pars.adamw.beta1 = 7.0  # inactive
    ctx = go.OptContext(Recorder(1, 1), batch_size=1, ne_datapoint=1,
                        optimizer=go.OptimizerType.SGD,
                        get_opt_pars=go.constant_optimizer_params, get_opt_pars_ud=pars)
    ctx.alloc(True)
    with pytest.raises(ValueError, match=f"sgd.{field}"):
        ctx.eval()


def test_get_opt_pars_must_return_optimizer_params():
    ctx = go.OptContext(Recorder(1, 1), batch_size=1, ne_datapoint=1,
                        get_opt_pars=lambda ud: {"alpha": 1})
    ctx.alloc(True)
    with pytest.raises(TypeError, match="OptimizerParams"):
        ctx.eval()


def test_nan_loss_raises_and_changes_nothing():
    model = Recorder(2, 1)
    ctx = go.OptContext(model, batch_size=1, ne_datapoint=2, loss_type=LT.SUM)
    w0 = model.w.data.copy()
    r = go.Result()
    ctx.inputs[...] = [np.inf, 1.0]
    ctx.alloc(True)
    with pytest.raises(FloatingPointError, match="loss"):
        ctx.eval(r)
    assert ctx.iter == 1 and ctx.opt_i == 0 and r.ndata == 0
    np.testing.assert_array_equal(model.w.data, w0)
    assert not ctx.grad_acc(model.w).any()


def test_output_shape_must_match_labels():
    class Wrong(Recorder):
        def forward(self, x):
            return np.zeros((x.shape[0] + 1, 1), np.float32)

    with pytest.raises(ValueError, match="outputs"):
        go.OptContext(Wrong(1, 1), batch_size=2, ne_datapoint=1)
    ctx = go.OptContext(Recorder(2, 3), loss_type=LT.MEAN_SQUARED_ERROR)
    ctx.alloc(False)
    with pytest.raises(ValueError, match="labels"):
        ctx.eval(None, inputs=np.ones((2, 2)), labels=np.ones((2, 4)))


@pytest.mark.parametrize("lt,labels,exc", [
    (LT.CROSS_ENTROPY, np.ones((3, 4)), ValueError),            # wrong size
    (LT.CROSS_ENTROPY, np.ones((3, 3), np.complex64), TypeError),  # not real
    (LT.MEAN, np.ones((3, 3)), ValueError),                     # MEAN takes no labels
])
def test_static_eval_bad_labels_leave_the_inputs_buffer_alone(lt, labels, exc):
    ctx = go.OptContext(Recorder(2, 3), batch_size=3, ne_datapoint=2, loss_type=lt)
    ctx.inputs[...] = 5.0
    ctx.alloc(False)
    with pytest.raises(exc, match="labels"):
        ctx.eval(None, inputs=np.zeros((3, 2)), labels=labels)
    assert (ctx.inputs == 5.0).all() and ctx.eval_ready


@pytest.mark.parametrize("name", ["cross_entropy", "CROSS_ENTROPY", "Cross_Entropy",
                                  " cross_entropy "])
def test_loss_type_by_name_any_case(name):
    model = go.nn.Sequential(go.nn.Linear(3, 2, rng=0))
    ctx = go.OptContext(model, loss_type=name, build_type="forward", optimizer="sgd")
    assert ctx.loss_type is go.LossType.CROSS_ENTROPY
    assert ctx.build_type is go.BuildType.FORWARD
    assert ctx.optimizer_type is go.OptimizerType.SGD


def test_loss_type_bad_name_lists_the_names():
    model = go.nn.Sequential(go.nn.Linear(3, 2, rng=0))
    with pytest.raises(ValueError, match=r"loss_type: expected one of \['MEAN', 'SUM', "
                                         r"'CROSS_ENTROPY', 'MEAN_SQUARED_ERROR'\] \(any case\)"):
        go.OptContext(model, loss_type="cross-entropy")
    with pytest.raises(TypeError, match="loss_type: expected a LossType or one of its names"):
        go.OptContext(model, loss_type=2.0)


def _storage_problem():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = np.eye(2, dtype=np.float32)[(x[:, 0] > 0).astype(int)]
    ds = go.Dataset.from_arrays(x, y)
    model = go.nn.Sequential(go.nn.Linear(4, 8, rng=0), go.nn.ReLU(), go.nn.Linear(8, 2, rng=1))
    return model, ds


def _steps(ctx, ds, n, before_each=None):
    for ib in range(n):
        if before_each is not None:
            before_each()
        ctx.alloc(True)
        ds.get_batch(ctx.inputs, ctx.labels, ib)
        ctx.eval()


def test_a_grad_set_to_none_as_torch_users_do_is_a_zero_gradient():
    """torch's zero_grad(set_to_none=True): p.grad = None while a context holds
    the model.  The next backward then added into a private array the optimizer
    never read, and the parameter stopped training; it is a zero gradient, in
    the arena."""
    model, ds = _storage_problem()
    ctx = go.OptContext(model, batch_size=16, ne_datapoint=4, loss_type="cross_entropy")

    def clear():
        for p in model.parameters():
            p.grad = None
    _steps(ctx, ds, 4, clear)
    twin, _ = _storage_problem()
    _steps(go.OptContext(twin, batch_size=16, ne_datapoint=4, loss_type="cross_entropy"), ds, 4)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p.data.tobytes() == q.data.tobytes()
    # inside an accumulation window: what was accumulated is dropped
    ctx = go.OptContext(model, batch_size=16, ne_datapoint=4, loss_type="cross_entropy",
                        opt_period=2)
    _steps(ctx, ds, 1)
    assert any(np.abs(p.grad).sum() > 0 for p in model.parameters())
    clear()
    ctx.alloc(True)
    for p, view in zip(model.parameters(), ctx._grads):
        assert p.grad is view and not np.any(view) and p.grad_is_zero


def test_an_array_assigned_to_data_trains_in_the_arena():
    """p.data = new_array (same shape, float32) while a context holds the model:
    the context took no notice, so the model computed with the new array while
    the optimizer stepped (and checkpoints saved) the old one.  The next alloc
    takes its values into the arena, as torch's optimizer steps the new data."""
    model, ds = _storage_problem()
    ctx = go.OptContext(model, batch_size=16, ne_datapoint=4, loss_type="cross_entropy")
    new = [np.full(p.data.shape, 0.1, np.float32) for p in model.parameters()]
    for p, v in zip(model.parameters(), new):
        p.data = v.copy()
    _steps(ctx, ds, 3)
    twin, _ = _storage_problem()
    for p, v in zip(twin.parameters(), new):
        p.data[...] = v
    _steps(go.OptContext(twin, batch_size=16, ne_datapoint=4, loss_type="cross_entropy"), ds, 3)
    for p, q, w in zip(model.parameters(), twin.parameters(), ctx._weights):
        assert p.data is w
        assert p.data.tobytes() == q.data.tobytes()


class _StopsOnce(go.nn.Module):
    """A Linear whose backward raises once, after adding its weight gradient:
    a Ctrl-C (or a user layer's error) in the middle of a backward pass."""

    def __init__(self, exc):
        self.inner = go.nn.Linear(4, 2, rng=0)
        self.exc = exc

    def forward(self, x):
        return self.inner.forward(x)

    def backward(self, g):
        out = self.inner.backward(g)
        if self.exc is not None:
            exc, self.exc = self.exc, None
            raise exc
        return out


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), ValueError("a layer's own")])
def test_an_eval_stopped_inside_its_backward_refuses_to_go_on_until_reset(exc):
    """The gradients hold part of the batch: a retried eval added the batch again
    (weights off by 2e-3 after a few steps). alloc and eval refuse, naming
    reset(False) and checkpoints; after reset the context trains as a fresh one
    from the same weights."""
    _, ds = _storage_problem()
    layer = _StopsOnce(type(exc)(*exc.args))
    ctx = go.OptContext(layer, batch_size=16, ne_datapoint=4, loss_type="mean_squared_error",
                        opt_period=2)
    x = ds.data[:16]
    y = np.zeros((16, 2), np.float32)
    ctx.alloc(True)
    with pytest.raises(type(exc)):
        ctx.eval(inputs=x, labels=y)
    with pytest.raises(RuntimeError, match="stopped inside its backward pass.*reset\\(False\\)"):
        ctx.alloc(True)
    with pytest.raises(RuntimeError, match="stopped inside its backward pass"):
        ctx.eval(inputs=x, labels=y)
    ctx.reset(False)
    assert not np.any(layer.inner.weight.grad)
    ctx.alloc(True)
    ctx.eval(inputs=x, labels=y)   # goes on


def test_a_loaded_state_wins_over_an_array_assigned_before_it():
    """p.data = array, then load_state_dict: the next alloc copied the older
    array over the loaded weights (off by 4.0)."""
    model, ds = _storage_problem()
    ctx = go.OptContext(model, batch_size=16, ne_datapoint=4, loss_type="cross_entropy")
    _steps(ctx, ds, 2)
    state = ctx.state_dict()
    for p in model.parameters():
        p.data = np.full(p.data.shape, 4.0, np.float32)
    ctx.load_state_dict(state)
    ctx.alloc(True)
    for i, p in enumerate(model.parameters()):
        np.testing.assert_array_equal(p.data, state[f"param.{i}"])


def test_the_hidden_parameter_warning_spares_what_parameters_gives():
    """A model whose own parameters() reaches a layer kept in a private attribute
    trains it: no warning that it does not (and none for an evaluation)."""
    import warnings

    class Wrapped:
        def __init__(self):
            self._inner = go.nn.Linear(4, 2, rng=0)

        def parameters(self):
            return self._inner.parameters()

        def forward(self, x):
            return self._inner.forward(x)

        def backward(self, g):
            return self._inner.backward(g)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        go.OptContext(Wrapped(), loss_type=go.LossType.MEAN_SQUARED_ERROR)
