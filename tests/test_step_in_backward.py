"""optimizer_in_backward: each parameter stepped in the backward pass as soon as
its gradient is final, gradients lent from a pool; the same bits as the step
after the backward pass (ggmlopt.step_in_backward)."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import GPT2, GPT2Config, Llama, LlamaConfig

OPT_PARS = go.OptimizerParams(adamw=go.AdamWParams(alpha=1e-2, wd=0.1),
                              sgd=go.SGDParams(alpha=0.1, wd=0.01))
VOCAB = 67


def llama(tie=True, seed=1):
    return Llama(LlamaConfig(vocab_size=VOCAB, dim=24, n_layers=3, n_heads=4, n_kv_heads=2,
                             ffn_dim=40, max_seq_len=32, tie_embeddings=tie), seed=seed)


def gpt2(seed=1):
    return GPT2(GPT2Config(vocab_size=VOCAB, dim=24, n_layers=2, n_heads=4, max_seq_len=32),
                seed=seed)


def context(model, in_backward, optimizer="adamw", **kw):
    return go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32,
                         optimizer=optimizer, get_opt_pars=go.constant_optimizer_params,
                         get_opt_pars_ud=OPT_PARS, optimizer_in_backward=in_backward, **kw)


def train(ctx, steps, seed=0, labels_masked=False):
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        t = rng.integers(0, VOCAB, (2, 18)).astype(np.int32)
        y = t[:, 1:].copy()
        if labels_masked:   # a prompt: its positions train nothing
            y[:, :9] = -1
        ctx.alloc(True)
        ctx.eval(None, inputs=t[:, :-1], labels=y)
        losses.append(float(ctx.loss))
    return losses


def weights(model):
    return [p.data.copy() for p in model.parameters()]


def assert_same_bits(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("make", [lambda: llama(True), lambda: llama(False), gpt2],
                         ids=["llama-tied", "llama", "gpt2"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_trajectory_is_the_step_after_the_backward_pass_bit_for_bit(make, optimizer,
                                                                        checkpointing):
    runs = []
    for in_backward in (False, True):
        model = make()
        if checkpointing:
            model.gradient_checkpointing_enable()
        ctx = context(model, in_backward, optimizer)
        losses = train(ctx, 4, labels_masked=True)
        runs.append((losses, weights(model), ctx.iter))
    assert runs[0][0] == runs[1][0]
    assert_same_bits(runs[0][1], runs[1][1])
    assert runs[0][2] == runs[1][2] == 5
    assert not np.array_equal(runs[0][1][0], weights(make())[0])   # it trained


def test_lora_adapters_step_in_the_backward_pass_as_after_it():
    runs = []
    for in_backward in (False, True):
        model = llama()
        lora.apply(model, rank=4, alpha=8, targets="all-linear", seed=3)
        ctx = context(model, in_backward)
        train(ctx, 3)
        runs.append(weights(model))
    assert_same_bits(*runs)


def test_a_parameter_with_no_gradient_is_stepped_with_zeros():
    """A parameter the backward pass never reaches (here: a bias-like extra the
    model does not use) decays under weight decay as with a zeroed gradient."""
    runs = []
    for in_backward in (False, True):
        model = llama()
        model.unused = go.nn.Parameter(np.ones(5, np.float32))
        ctx = context(model, in_backward)
        train(ctx, 2)
        runs.append(model.unused.data.copy())
    np.testing.assert_array_equal(runs[0], runs[1])
    assert np.all(runs[1] < 1.0)


def test_no_gradient_is_kept_between_steps_and_the_pool_holds_about_one_block():
    model = llama(tie=True)
    ctx = context(model, True)
    train(ctx, 2)
    assert not ctx.arena.has_grads
    assert all(p._grad is None for p in model.parameters())   # returned to the pool
    embed = model.embed_tokens.weight.data.nbytes
    block = sum(p.data.nbytes for p in model.layers[0].parameters())
    total = sum(p.data.nbytes for p in model.parameters())
    held = ctx._in_backward.pool.nbytes
    assert held < total
    report = go.memory_report(model, 2, 17, optimizer_in_backward=True)
    # the estimate, an upper bound: the embedding (its gradient lives from the head
    # to the end of the pass) and one block (whose parts are stepped one by one)
    assert report.gradients == embed + block
    assert embed < held <= report.gradients
    assert go.memory_report(model, 2, 17).gradients == total


def test_the_pool_lends_by_size_and_hands_out_zeros():
    pool = go.step_in_backward.GradientPool()
    p = go.nn.Parameter(np.zeros((3, 4), np.float32))
    q = go.nn.Parameter(np.zeros((4, 3), np.float32))
    g = pool.lend(p)
    assert g.shape == (3, 4) and not g.any()
    g[...] = 5.0
    pool.give_back(g)
    h = pool.lend(q)   # the same memory, another shape of the same size, zeroed
    assert h.shape == (4, 3) and not h.any()
    assert np.shares_memory(g, h)
    assert pool.nbytes == 0


def test_checkpoints_resume_across_the_two_modes(tmp_path):
    """A checkpoint saved by either mode resumes in the other on the same bits."""
    ref = llama()
    ctx = context(ref, False)
    train(ctx, 2, seed=5)
    train(ctx, 2, seed=6)
    for first, second in [(True, False), (False, True)]:
        model = llama()
        ctx = context(model, first)
        train(ctx, 2, seed=5)
        path = tmp_path / f"{first}.npz"
        ctx.save(path)
        resumed = go.OptContext.load(path, llama(seed=9), get_opt_pars=go.constant_optimizer_params,
                                     get_opt_pars_ud=OPT_PARS, optimizer_in_backward=second)
        train(resumed, 2, seed=6)
        assert_same_bits(weights(ref), weights(resumed.model))
        if first:
            sd = ctx.state_dict()
            assert all(not sd[k].any() for k in sd if k.startswith("grad."))


def test_fit_with_the_optimizer_in_the_backward_pass_is_fit_without():
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, VOCAB, (8, 17)).astype(np.int32)
    results = []
    for in_backward in (False, True):
        model = llama()
        ds = go.Dataset.from_arrays(tokens[:, :-1], tokens[:, 1:])
        hist = go.fit(model, ds, "cross_entropy", nepoch=2, nbatch_logical=2, silent=True,
                      seed=1, val_split=0.25, optimizer_in_backward=in_backward)
        results.append((hist.train_loss, hist.val_loss, weights(model)))
    assert results[0][0] == results[1][0] and results[0][1] == results[1][1]
    assert_same_bits(results[0][2], results[1][2])


def test_a_sequential_model_steps_in_the_backward_pass_as_after_it():
    runs = []
    for in_backward in (False, True):
        model = go.nn.Sequential(go.nn.Linear(7, 13, rng=1), go.nn.ReLU(),
                                 go.nn.Linear(13, 3, rng=2))
        ctx = go.OptContext(model, loss_type="cross_entropy", optimizer_in_backward=in_backward)
        rng = np.random.default_rng(0)
        for _ in range(3):
            x = rng.standard_normal((5, 7)).astype(np.float32)
            y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, 5)]
            ctx.alloc(True)
            ctx.eval(None, inputs=x, labels=y)
        runs.append(weights(model))
    assert_same_bits(*runs)


@pytest.mark.parametrize("kw, exc, pattern", [
    ({"opt_period": 2}, ValueError, "opt_period=1"),
    ({"clip_grad_norm": 1.0}, ValueError, "clip_grad_norm"),
    ({"build_type": "grad"}, ValueError, "OPT"),
    ({"shard_optimizer": True}, ValueError, "comm"),
])
def test_what_it_cannot_do_is_refused_and_the_model_untouched(kw, exc, pattern):
    model = llama()
    before = weights(model)
    with pytest.raises(exc, match=pattern):
        context(model, True, **kw)
    assert_same_bits(before, weights(model))
    assert all(p._lender is None for p in model.parameters())


def test_the_flag_must_be_a_bool_and_grad_acc_is_refused():
    with pytest.raises(TypeError, match="optimizer_in_backward"):
        context(llama(), 1)
    model = llama()
    ctx = context(model, True)
    with pytest.raises(RuntimeError, match="optimizer_in_backward"):
        ctx.grad_acc(model.norm.weight)
    with pytest.raises(TypeError, match="optimizer_in_backward"):
        go.memory_report(model, 1, 8, optimizer_in_backward="yes")
    with pytest.raises(ValueError, match="optimizer_in_backward"):   # never silently off
        ctx.clip_grad_norm = 1.0
    assert ctx.clip_grad_norm is None
    ctx.clip_grad_norm = None


def test_parameters_that_cannot_be_lent_a_gradient_are_refused():
    class Loose:   # a parameter by duck typing: .data and .grad, not a Parameter
        def __init__(self):
            self.data = np.zeros(3, np.float32)
            self.grad = np.zeros(3, np.float32)

    class Model:
        def __init__(self):
            self.p = Loose()

        def parameters(self):
            return [self.p]

        def forward(self, x):
            return x[:, :3] + self.p.data

        def backward(self, g):
            self.p.grad += g.sum(0)

    with pytest.raises(TypeError, match="ggmlopt.nn.Parameter"):
        go.OptContext(Model(), loss_type="mean", optimizer_in_backward=True)


def test_a_new_context_without_it_takes_the_gradients_back():
    """A model trained with the optimizer in the backward pass, then by an
    ordinary context: its gradients are that context's arena again."""
    model = llama()
    train(context(model, True), 1)
    ctx = context(model, False)
    train(ctx, 1)
    assert all(p._lender is None for p in model.parameters())
    assert np.shares_memory(ctx.grad_acc(model.norm.weight), ctx.arena.flat("grads"))


def test_the_pool_goes_with_its_context():
    """A model that outlives the context keeps no pool: its gradients are plain
    zeros when asked for again."""
    import gc
    import weakref
    model = llama()
    ctx = context(model, True)
    train(ctx, 1)
    pool = weakref.ref(ctx._in_backward.pool)
    del ctx
    gc.collect()
    assert pool() is None
    g = model.norm.weight.grad
    assert g.shape == model.norm.weight.shape and not g.any()
