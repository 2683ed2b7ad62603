"""Frozen parameters (Parameter.requires_grad=False): no gradient, no optimizer
memory, never changed; training equals training with those parameters as
constants; checkpoints hold only what trains and refuse another split."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.distributed import optimizer_state_nbytes
from ggmlopt.nn import Conv2d, Linear, Parameter, ReLU, Sequential

NIN, NHID, NOUT, BATCH = 7, 9, 3, 5


def _mlp(seed=0):
    return Sequential(Linear(NIN, NHID, rng=seed), ReLU(), Linear(NHID, NOUT, rng=seed + 1))


def _data(n_steps, seed=1):
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((n_steps, BATCH, NIN)).astype(np.float32)
    ys = rng.integers(0, NOUT, size=(n_steps, BATCH)).astype(np.int32)
    return xs, ys


class _OnlyListed:
    """A model that lists only some parameters: the others are constants to it."""

    def __init__(self, inner, listed):
        self.inner, self.listed = inner, listed

    def parameters(self):
        return list(self.listed)

    def forward(self, x):
        return self.inner.forward(x)

    def backward(self, g):
        return self.inner.backward(g)


def _train(model, xs, ys, **ctx_kw):
    ctx = go.OptContext(model, loss_type=go.LossType.CROSS_ENTROPY, **ctx_kw)
    losses = []
    for x, y in zip(xs, ys):
        ctx.alloc(True)
        ctx.eval(inputs=x, labels=y)
        losses.append(float(ctx.loss))
    return ctx, losses


# ---- Parameter -----------------------------------------------------------------------------

def test_parameter_requires_grad_flag_and_grad():
    p = Parameter(np.ones((2, 3)))
    assert p.requires_grad and p.grad.shape == (2, 3)
    q = Parameter(np.ones(4), "w", requires_grad=False)
    assert not q.requires_grad and q.grad is None  # torch: .grad of a frozen tensor is None
    assert "requires_grad=False" in repr(q)
    q.requires_grad = True
    assert q.grad is not None and not q.grad.any() and q.grad_is_zero
    q.requires_grad = False
    assert q.grad is None
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="requires_grad"):
            Parameter([1.0], requires_grad=bad)
        with pytest.raises(TypeError, match="requires_grad"):
            p.requires_grad = bad
    assert p.requires_grad
    with pytest.raises(TypeError):
        Parameter([1.0], "w", False)  # keyword only


# ---- layers ----------------------------------------------------------------------------------

def test_linear_frozen_weight_gets_no_gradient_and_still_passes_the_input_gradient():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    g = rng.standard_normal((4, 5)).astype(np.float32)
    ref, lin = Linear(6, 5, rng=3), Linear(6, 5, rng=3)
    lin.weight.requires_grad = False
    ref.forward(x)
    gx_ref = ref.backward(g).copy()
    lin.forward(x)
    gx = lin.backward(g)
    assert lin.weight.grad is None
    np.testing.assert_array_equal(gx, gx_ref)
    np.testing.assert_array_equal(lin.bias.grad, ref.bias.grad)
    lin.bias.requires_grad = False
    lin.forward(x)
    np.testing.assert_array_equal(lin.backward(g), gx_ref)
    assert lin.bias.grad is None


@pytest.mark.parametrize("channels,stride", [((2, 3), 1), ((40, 40), 2)])  # direct, im2col
@pytest.mark.parametrize("frozen", [("weight",), ("bias",), ("weight", "bias")])
def test_conv2d_frozen_parameters(channels, stride, frozen):
    rng = np.random.default_rng(1)
    cin, cout = channels
    x = rng.standard_normal((3, cin, 9, 7)).astype(np.float32)
    ref, conv = Conv2d(cin, cout, 3, stride, 1, rng=2), Conv2d(cin, cout, 3, stride, 1, rng=2)
    for name in frozen:
        getattr(conv, name).requires_grad = False
    out = ref.forward(x)
    g = rng.standard_normal(out.shape).astype(np.float32)
    gx_ref = ref.backward(g).copy()
    np.testing.assert_array_equal(conv.forward(x), out)
    np.testing.assert_array_equal(conv.backward(g), gx_ref)
    for name in ("weight", "bias"):
        p, q = getattr(conv, name), getattr(ref, name)
        if name in frozen:
            assert p.grad is None
        else:
            np.testing.assert_array_equal(p.grad, q.grad)
    # the fused Conv2d, ReLU, MaxPool2d pass too
    seq = Sequential(Conv2d(cin, cout, 3, stride, 1, rng=2), ReLU(), go.nn.MaxPool2d(2))
    seq_ref = Sequential(Conv2d(cin, cout, 3, stride, 1, rng=2), ReLU(), go.nn.MaxPool2d(2))
    seq.needs_input_grad = seq_ref.needs_input_grad = True
    for name in frozen:
        getattr(seq[0], name).requires_grad = False
    o = seq_ref.forward(x)
    g2 = rng.standard_normal(o.shape).astype(np.float32)
    gx2 = seq_ref.backward(g2).copy()
    np.testing.assert_array_equal(seq.forward(x), o)
    np.testing.assert_array_equal(seq.backward(g2), gx2)
    for name in ("weight", "bias"):
        if name not in frozen:
            np.testing.assert_array_equal(getattr(seq[0], name).grad,
                                          getattr(seq_ref[0], name).grad)


def test_module_zero_grad():
    model = _mlp()
    model[0].weight.requires_grad = False
    model.needs_input_grad = True
    x, _ = _data(1)
    model.forward(x[0])
    model.backward(np.ones((BATCH, NOUT), np.float32))
    assert model[2].weight.grad.any() and not model[2].weight.grad_is_zero
    model.zero_grad()
    for p in model.parameters():
        if p.requires_grad:
            assert not p.grad.any() and p.grad_is_zero
        else:
            assert p.grad is None
    # inside a context: the arena's gradients, in place
    ctx, _ = _train(model, *_data(1))
    model.zero_grad()
    assert not ctx.arena.flat("grads").any()


# ---- training ----------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("opt_period", [1, 2])
def test_training_with_frozen_parameters_equals_training_with_constants(optimizer, opt_period):
    xs, ys = _data(6)
    frozen_model = _mlp()
    frozen = [frozen_model[0].weight, frozen_model[2].bias]
    for p in frozen:
        p.requires_grad = False
    frozen_before = [(p.data, p.data.copy()) for p in frozen]
    ctx, losses = _train(frozen_model, xs, ys, optimizer=optimizer, opt_period=opt_period,
                         clip_grad_norm=0.5)

    const_model = _mlp()
    listed = [const_model[0].bias, const_model[2].weight]
    ctx_c, losses_c = _train(_OnlyListed(const_model, listed), xs, ys, optimizer=optimizer,
                             opt_period=opt_period, clip_grad_norm=0.5)

    assert losses == losses_c  # bit for bit
    assert ctx.parameters() == [frozen_model[0].bias, frozen_model[2].weight]
    for p, q in zip(ctx.parameters(), ctx_c.parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    assert ctx.grad_norm == ctx_c.grad_norm  # clipping saw only the trainable gradients
    for p, (data, values) in zip(frozen, frozen_before):
        assert p.data is data  # where it was, owned by its Parameter
        np.testing.assert_array_equal(p.data, values)
        assert p.grad is None
        with pytest.raises(ValueError, match="frozen"):
            ctx.grad_acc(p)
    # the arena holds only what trains
    n_train = sum(p.size for p in ctx.parameters())
    assert ctx.arena.size == n_train == ctx_c.arena.size
    assert ctx.arena.nbytes == ctx_c.arena.nbytes
    assert "frozen=" in repr(ctx)


def test_optimizer_memory_is_that_of_the_trainable_parameters():
    model, full = _mlp(), _mlp()
    model[0].weight.requires_grad = False
    ctx = go.OptContext(model)
    ctx_full = go.OptContext(full)
    assert ctx.arena.size == ctx_full.arena.size - NIN * NHID
    assert ctx.arena.nbytes < ctx_full.arena.nbytes
    assert optimizer_state_nbytes(ctx) < optimizer_state_nbytes(ctx_full)
    assert ctx.arena.nbytes == 4 * ctx.arena.section * 4  # weights, grads, m, v


def test_adamw_trajectory_against_a_float64_reference():
    """A linear model x @ W + b with W frozen, MSE loss: the trainable b follows
    AdamW computed in float64 from float64 gradients."""
    rng = np.random.default_rng(5)
    lin = Linear(4, 3, rng=0)
    lin.weight.requires_grad = False
    xs = rng.standard_normal((8, 6, 4)).astype(np.float32)
    ts = rng.standard_normal((8, 6, 3)).astype(np.float32)
    pars = go.OptimizerParams(adamw=go.AdamWParams(alpha=0.05, beta1=0.9, beta2=0.99,
                                                   eps=1e-8, wd=0.01))
    ctx = go.OptContext(lin, loss_type=go.LossType.MEAN_SQUARED_ERROR,
                        get_opt_pars=go.constant_optimizer_params, get_opt_pars_ud=pars)
    w = lin.weight.data.astype(np.float64)
    b = lin.bias.data.astype(np.float64)
    m, v = np.zeros(3), np.zeros(3)
    a, b1, b2, eps, wd = 0.05, 0.9, 0.99, 1e-8, 0.01
    for t, (x, y) in enumerate(zip(xs, ts), start=1):
        ctx.alloc(True)
        ctx.eval(inputs=x, labels=y)
        out = x.astype(np.float64) @ w + b
        g = (2 * (out - y) / out.size).sum(0)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mh, vh = m / (1 - b1 ** t), np.sqrt(v / (1 - b2 ** t)) + eps
        b = b * (1 - a * wd) - a * mh / vh
        np.testing.assert_allclose(lin.bias.data, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(lin.weight.data, w.astype(np.float32))


# ---- construction and the split -------------------------------------------------------------

def test_a_model_with_nothing_to_train():
    model = _mlp()
    for p in model.parameters():
        p.requires_grad = False
    for bt in (go.BuildType.OPT, go.BuildType.GRAD):
        with pytest.raises(ValueError, match="no trainable parameter.*0.weight"):
            go.OptContext(model, build_type=bt)
    assert all(p.grad is None for p in model.parameters())
    # evaluating a frozen model needs no trainable parameter
    x, y = _data(1)
    res = go.evaluate(model, (x[0], y[0]), go.LossType.CROSS_ENTROPY)
    assert np.isfinite(res.loss()[0])
    np.testing.assert_array_equal(go.predict(model, x[0]), model(x[0]))
    ctx = go.OptContext(model, build_type=go.BuildType.FORWARD)
    assert ctx.parameters() == []


def test_changing_the_split_after_the_context_is_built_stops_alloc():
    model = _mlp()
    model[0].weight.requires_grad = False
    ctx, _ = _train(model, *_data(2))
    before = ctx.arena.flat("weights").copy()
    model[2].weight.requires_grad = False
    with pytest.raises(RuntimeError, match="frozen .*after this context was built"):
        ctx.alloc(True)
    model[2].weight.requires_grad = True
    model[0].weight.requires_grad = True
    with pytest.raises(RuntimeError, match="unfrozen"):
        ctx.alloc(True)
    model[0].weight.requires_grad = False
    np.testing.assert_array_equal(ctx.arena.flat("weights"), before)
    # back as built: trains on, the gradient is the arena's again
    x, y = _data(1, seed=7)
    ctx.alloc(True)
    ctx.eval(inputs=x[0], labels=y[0])
    assert np.shares_memory(model[2].weight.grad, ctx.arena.flat("grads"))
    assert not np.array_equal(ctx.arena.flat("weights"), before)


# ---- checkpoints --------------------------------------------------------------------------------

def _frozen_mlp(names=("0.weight",)):
    model = _mlp()
    params = dict(model.named_parameters())
    for n in names:
        params[n].requires_grad = False
    return model


def test_state_dict_holds_only_the_trainable_parameters():
    model = _frozen_mlp(("0.weight", "2.bias"))
    ctx, _ = _train(model, *_data(2))
    sd = ctx.state_dict()
    assert sd["nparams"] == 2
    assert sorted(k for k in sd if k.startswith("param.")) == ["param.0", "param.1"]
    assert sd["param.0"].shape == (NHID,) and sd["param.1"].shape == (NHID, NOUT)
    np.testing.assert_array_equal(sd["trainable"], [0, 1, 1, 0])


def test_resume_with_frozen_parameters_is_exact(tmp_path):
    xs, ys = _data(8)
    whole = _frozen_mlp()
    _, losses = _train(whole, xs, ys)

    first = _frozen_mlp()
    ctx1, losses1 = _train(first, xs[:4], ys[:4])
    ctx1.save(tmp_path / "c.npz")
    second = _frozen_mlp()
    ctx2 = go.OptContext.load(tmp_path / "c.npz", second)
    rest = []
    for x, y in zip(xs[4:], ys[4:]):
        ctx2.alloc(True)
        ctx2.eval(inputs=x, labels=y)
        rest.append(float(ctx2.loss))
    assert losses1 + rest == losses
    for p, q in zip(whole.parameters(), second.parameters()):
        np.testing.assert_array_equal(p.data, q.data)


@pytest.mark.parametrize("other", [(), ("0.weight", "0.bias"), ("2.weight",)])
def test_a_checkpoint_refuses_another_split_naming_the_parameter(tmp_path, other):
    ctx, _ = _train(_frozen_mlp(), *_data(2))
    ctx.save(tmp_path / "c.npz")
    sd = ctx.state_dict()
    model = _frozen_mlp(other)
    before = [(p.data, p.data.copy()) for p in model.parameters()]
    name = {(): "0.weight", ("0.weight", "0.bias"): "0.bias", ("2.weight",): "0.weight"}[other]
    with pytest.raises(ValueError, match=f"'{name}'"):
        go.OptContext.load(tmp_path / "c.npz", model)
    for p, (data, values) in zip(model.parameters(), before):
        assert p.data is data
        np.testing.assert_array_equal(p.data, values)
    if other == ("2.weight",):  # same count of trainable parameters: load_state_dict's check
        ctx_other = go.OptContext(model, loss_type=go.LossType.CROSS_ENTROPY)
        with pytest.raises(ValueError, match="'0.weight' is trainable"):
            ctx_other.load_state_dict(sd)


def test_a_checkpoint_without_the_split_means_every_parameter_trained(tmp_path):
    ctx, _ = _train(_mlp(), *_data(2))
    sd = ctx.state_dict()
    del sd["trainable"]  # as files written before frozen parameters
    go.OptContext(_mlp(), loss_type=go.LossType.CROSS_ENTROPY).load_state_dict(sd)
    frozen_ctx = go.OptContext(_frozen_mlp(("2.weight",)), loss_type=go.LossType.CROSS_ENTROPY)
    with pytest.raises(ValueError, match="'2.weight' is frozen"):
        frozen_ctx.load_state_dict(sd)


def test_fit_resume_with_frozen_parameters(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, NIN)).astype(np.float32)
    y = np.eye(NOUT, dtype=np.float32)[rng.integers(0, NOUT, 40)]
    path = tmp_path / "fit.npz"

    def ds():  # fit shuffles its dataset: each run starts from a fresh one
        return go.Dataset.from_arrays(x, y)

    full = _frozen_mlp()
    h_full = go.fit(full, ds(), go.LossType.CROSS_ENTROPY, nepoch=4, nbatch_logical=10,
                    silent=True, seed=1)
    part = _frozen_mlp()
    go.fit(part, ds(), go.LossType.CROSS_ENTROPY, nepoch=2, nbatch_logical=10, silent=True,
           seed=1, checkpoint=path)
    resumed = _frozen_mlp()
    h = go.fit(resumed, ds(), go.LossType.CROSS_ENTROPY, nepoch=4, nbatch_logical=10, silent=True,
               seed=1, checkpoint=path, resume=True)
    assert [e.train_loss for e in h] == [e.train_loss for e in h_full]
    for p, q in zip(full.parameters(), resumed.parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    with pytest.raises(ValueError, match="'0.weight'"):
        go.fit(_mlp(), ds(), go.LossType.CROSS_ENTROPY, nepoch=4, nbatch_logical=10, silent=True,
               seed=1, checkpoint=path, resume=True)


# ---- many processes (a communicator of threads) ------------------------------------------------

def test_ranks_train_only_the_trainable_parameters_and_compare_the_frozen_ones():
    from thread_comm import results, run_ranks

    xs, ys = _data(4)

    def train(comm):
        model = _frozen_mlp()
        ctx = go.OptContext(model, loss_type=go.LossType.CROSS_ENTROPY, opt_period=2,
                            comm=comm)
        rank = comm.Get_rank()
        for x, y in zip(xs, ys):
            half = BATCH // 2 + 1
            ctx.alloc(True)
            ctx.eval(inputs=x[:half] if rank == 0 else x[half:],
                     labels=y[:half] if rank == 0 else y[half:])
        assert ctx.arena.size == sum(p.size for p in ctx.parameters())
        return np.concatenate([p.data.ravel() for p in model.parameters()])

    outs = results(2, train)
    np.testing.assert_array_equal(outs[0], outs[1])

    def mismatched(comm):
        model = _frozen_mlp()
        if comm.Get_rank() == 1:
            model[0].weight.data[0, 0] += 1  # a frozen value differs: no rank would fix it
        go.OptContext(model, loss_type=go.LossType.CROSS_ENTROPY, opt_period=2, comm=comm)

    for _, e in run_ranks(2, mismatched):
        assert isinstance(e, ValueError) and "freeze the same parameters" in str(e)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
@pytest.mark.parametrize("norm", ["q_norm", "k_norm"])
def test_a_first_block_q_or_k_norm_trains_over_a_frozen_rest(family, norm):
    # the q/k norms sit between the frozen projections and the attention kernel: with
    # nothing below them training (the first block over a frozen embedding) they still
    # need dq and dk; their gradient is the one they get when the embedding trains too
    from ggmlopt.models import Gemma3, Gemma3Config, Qwen3, Qwen3Config
    kw = {"vocab_size": 53, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
          "ffn_dim": 40, "max_seq_len": 64}
    make = (lambda: Qwen3(Qwen3Config(**kw, head_dim=12), seed=4)) if family == "qwen3" \
        else (lambda: Gemma3(Gemma3Config(**kw, head_dim=16), seed=7))
    name = f"layers.0.self_attn.{norm}.weight"
    tokens = np.random.default_rng(0).integers(0, 53, (2, 16)).astype(np.int32)
    labels = np.roll(tokens, -1, 1)
    labels[:, -1] = -1
    grads = []
    for with_embedding in (False, True):
        model = make()
        for n, p in model.named_parameters():
            p.requires_grad = n == name or (with_embedding and n == "embed_tokens.weight")
        ctx = go.OptContext(model, loss_type="cross_entropy")
        ctx.alloc(True)
        ctx.eval(None, inputs=tokens, labels=labels)
        grads.append(ctx.grad_acc(dict(model.named_parameters())[name]).copy())
    assert np.abs(grads[1]).max() > 0
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6, atol=1e-9)
