"""The language models' fused, chunked head and cross-entropy in an OptContext:
the loss, every gradient, the accuracy and the Result statistics those of the
full logits; the masked positions cost no head product; the full logits never
exist; a non-finite loss still changes nothing."""
import tracemalloc

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import GPT2, GPT2Config, Llama, LlamaConfig, _fused_head

V = 211
LLAMA = {"vocab_size": V, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "ffn_dim": 48, "max_seq_len": 64}
MODELS = {
    "llama": lambda: Llama(LlamaConfig(**LLAMA), seed=1),
    "llama-tied": lambda: Llama(LlamaConfig(**LLAMA, tie_embeddings=True), seed=2),
    "gpt2": lambda: GPT2(GPT2Config(vocab_size=V, dim=32, n_layers=2, n_heads=4,
                                    max_seq_len=64), seed=3),
    "llama-lora": lambda: _lora(Llama(LlamaConfig(**LLAMA), seed=4), ()),
    "llama-lora-on-the-head": lambda: _lora(Llama(LlamaConfig(**LLAMA), seed=5),
                                            ("q_proj", "v_proj", "lm_head")),
    "llama-tied-lora": lambda: _lora(Llama(LlamaConfig(**LLAMA, tie_embeddings=True),
                                           seed=6), ()),
}


def _lora(model, targets):
    lora.apply(model, rank=4, seed=0, **({"targets": targets} if targets else {}))
    for _, layer in lora.named_adapters(model):     # B = 0 would test nothing
        layer.lora_b.data[...] = np.random.default_rng(1).normal(0, 0.1, layer.lora_b.shape)
    return model


def _batch(seed, b=3, t=29, masked=0.6):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, V, (b, t)).astype(np.int32)
    y = rng.integers(0, V, (b, t)).astype(np.int32)
    y[rng.random((b, t)) < masked] = -1
    return x, y


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 5 rows, so every case runs several and a ragged last one."""
    monkeypatch.setattr(_fused_head, "CHUNK_BYTES", 5 * 4 * V)


def _run(model, fused, batches, opt_period=1):
    """Loss, the gradients of the step, predictions and Result statistics."""
    model.fused_head = fused
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32,
                        opt_period=opt_period)
    res = go.Result()
    losses, preds = [], []
    for x, y in batches:
        ctx.alloc(True)
        ctx.eval(res, inputs=x, labels=y)
        losses.append(float(ctx.loss))
        preds.append(ctx.pred.copy())
    grads = [ctx.grad_acc(p).copy() for p in ctx.parameters()]
    return losses, grads, preds, (res.loss(), res.accuracy(), res.nlabelled), ctx


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("opt_period", [1, 2])
def test_fused_head_equals_the_full_logits(name, opt_period, small_chunks):
    batches = [_batch(s) for s in range(opt_period)]
    fused = _run(MODELS[name](), True, batches, opt_period)
    full = _run(MODELS[name](), False, batches, opt_period)
    assert fused[4].outputs is None and full[4].outputs.shape == (3, 29, V)
    np.testing.assert_allclose(fused[0], full[0], rtol=1e-6)
    scale = max(np.abs(g).max() for g in full[1])
    for a, b in zip(fused[1], full[1]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * scale)
    for (x, y), pf, pu in zip(batches, fused[2], full[2]):
        lab = y.reshape(-1) >= 0
        np.testing.assert_array_equal(pf[lab], pu[lab])
        assert (pf[~lab] == -1).all()      # masked positions get no logits, no prediction
    (lf, uf), (af, auf), nf = fused[3]
    (lu, uu), (au, auu), nu = full[3]
    assert nf == nu and af == au and auf == auu
    np.testing.assert_allclose(lf, lu, rtol=1e-6)
    # the uncertainty is a spread of the per-eval losses: their rounding, absolutely
    np.testing.assert_allclose(uf, uu, rtol=0, atol=1e-5 * lu)   # (nan with one eval)


def test_masked_positions_cost_no_head_product(small_chunks):
    model = MODELS["llama"]()
    rows = []
    forward = model.lm_head.forward
    model.lm_head.forward = lambda h, out=None: rows.append(h.shape[0]) or forward(h, out=out)
    x, y = _batch(7)
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32)
    ctx.alloc(True)
    ctx.eval(None, inputs=x, labels=y)
    assert sum(rows) == int((y >= 0).sum()) and max(rows) == 5


def test_the_full_logits_never_exist():
    """A 32000-token vocabulary at 4 x 256 positions: 125 MiB of logits (and as
    much of their gradient) unfused; the fused step's peak stays far below."""
    vocab, b, t = 32000, 4, 256
    model = Llama(LlamaConfig(vocab_size=vocab, dim=16, n_layers=1, n_heads=2, ffn_dim=16,
                              max_seq_len=t, tie_embeddings=True), seed=0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, (b, t)).astype(np.int32)
    y = rng.integers(0, vocab, (b, t)).astype(np.int32)
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32)
    full_logits = b * t * vocab * 4
    peaks = []
    for _ in range(2):   # the second step: every lasting buffer exists already
        tracemalloc.start()
        ctx.alloc(True)
        ctx.eval(None, inputs=x, labels=y)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    chunk = _fused_head.chunk_rows(b * t, vocab) * vocab * 4     # one buffer: 3 chunks here
    assert chunk <= _fused_head.CHUNK_BYTES < full_logits // 2
    assert peaks[-1] < chunk + full_logits // 16
    assert _fused_head.CHUNK_BYTES + (8 << 20) <= 64 << 20    # the head's bound at any vocabulary


@pytest.mark.parametrize("name", ["llama", "llama-tied", "llama-lora-on-the-head"])
def test_a_non_finite_head_changes_nothing(name):
    model = MODELS[name]()
    x, y = _batch(3)
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32,
                        opt_period=2)
    ctx.alloc(True)
    ctx.eval(None, inputs=x, labels=y)     # a first micro-batch: gradients accumulated
    head = model.embed_tokens.weight if model.lm_head is None else \
        (model.lm_head.base.weight if hasattr(model.lm_head, "base") else model.lm_head.weight)
    head.data[3, 5] = np.inf if name != "llama-tied" else np.nan
    before = [ctx.grad_acc(p).copy() for p in ctx.parameters()]
    weights = [p.data.copy() for p in ctx.parameters()]
    ctx.alloc(True)
    with pytest.raises(FloatingPointError, match="the loss is"):
        ctx.eval(None, inputs=x, labels=y)
    for p, g, w in zip(ctx.parameters(), before, weights):
        np.testing.assert_array_equal(ctx.grad_acc(p), g)
        np.testing.assert_array_equal(p.data, w)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bad", [-5, -100, V])
def test_a_label_out_of_range_is_refused_fused_or_not_and_changes_nothing(fused, bad):
    # -1 is the one mask: the fused head keeps the rows labelled >= 0, and took
    # transformers' -100 (or any other negative) for a mask unnoticed
    model = MODELS["llama"]()
    model.fused_head = fused
    x, y = _batch(3)
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32,
                        opt_period=2)
    ctx.alloc(True)
    ctx.eval(None, inputs=x, labels=y)     # a first micro-batch: gradients accumulated
    before = [ctx.grad_acc(p).copy() for p in ctx.parameters()]
    weights = [p.data.copy() for p in ctx.parameters()]
    y = y.copy()
    y[1, 7] = bad
    ctx.alloc(True)
    with pytest.raises(IndexError, match=r"labels: class.*-1") as info:
        ctx.eval(None, inputs=x, labels=y)
    assert str(bad) in str(info.value)
    for p, g, w in zip(ctx.parameters(), before, weights):
        np.testing.assert_array_equal(ctx.grad_acc(p), g)
        np.testing.assert_array_equal(p.data, w)


def test_fit_trains_the_same_fused_or_not():
    """SGD: its step is linear in the gradient, so the two heads' gradients, equal
    within 1e-6 of their scale each step (above), give weights within that times
    the steps.  (AdamW divides by sqrt(v): for a weight whose gradient is rounding
    noise it turns an ulp of difference into a step of alpha, on one CPU path and
    not another.)"""
    x, y = _batch(11, b=8)
    runs = []
    sgd = go.OptimizerParams(sgd=go.SGDParams(alpha=0.05))
    for fused in (True, False):
        ds = go.Dataset.from_arrays(x, y)   # its own: fit shuffles it
        model = MODELS["llama-tied"]()
        model.fused_head = fused
        hist = go.fit(model, ds, "cross_entropy", nepoch=3, nbatch_logical=4, silent=True,
                      seed=0, optimizer=go.OptimizerType.SGD, get_opt_pars=lambda _: sgd)
        runs.append((hist, [p.data.copy() for p in model.parameters()]))
    (h0, w0), (h1, w1) = runs
    np.testing.assert_allclose([e.train_loss for e in h0], [e.train_loss for e in h1],
                               rtol=1e-5)
    assert [e.train_accuracy for e in h0] == [e.train_accuracy for e in h1]
    for a, b in zip(w0, w1):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())



def test_a_dropping_head_adapter_draws_the_masks_of_one_pass_fused_or_not(small_chunks):
    # the fused head checks that the loss is finite in a pass of its own before the
    # one that trains: the adapter's dropout drew its masks twice, so the gradient
    # came from other masks than the unfused head's and the stream moved apart
    def model():
        m = Llama(LlamaConfig(**LLAMA), seed=5)
        lora.apply(m, rank=4, seed=0, targets=("q_proj", "lm_head"), dropout=0.3)
        for _, layer in lora.named_adapters(m):
            layer.lora_b.data[...] = np.random.default_rng(1).normal(0, 0.1,
                                                                     layer.lora_b.shape)
        return m

    # every row labelled: the fused head's rows are the full logits' rows, so the
    # masks are the same draws of the stream (in chunks of 5 rows or at once)
    runs = [_run(model(), fused, [_batch(0, masked=0.0)]) for fused in (True, False)]
    (l0, g0, _, _, ctx0), (l1, g1, _, _, ctx1) = runs
    np.testing.assert_allclose(l0, l1, rtol=1e-5)
    for a, b in zip(g0, g1):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(np.abs(b).max(), 1e-30))
    states = [ctx.model.lm_head.lora_dropout.rng.bit_generator.state for ctx in (ctx0, ctx1)]
    assert states[0] == states[1]


@pytest.mark.parametrize("tie", [True, False])
def test_a_static_context_makes_no_logits_for_its_output_shape(tie):
    """A static context sizes its buffers from a language model's outputs_shape,
    without a forward pass whose whole (batch * T, vocab) logits would set the
    training's peak (training runs the head in chunks); a window longer than the
    model takes is refused as forward refuses it."""
    import ggmlopt as go
    from ggmlopt.models import Llama, LlamaConfig
    model = Llama(LlamaConfig(vocab_size=300, dim=16, n_layers=1, n_heads=2, max_seq_len=32,
                              tie_embeddings=tie), seed=0)
    calls = []
    forward = model.forward
    model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    ctx = go.OptContext(model, batch_size=2, ne_datapoint=16, loss_type="cross_entropy",
                        class_labels=True, inputs_dtype=np.int32)
    assert ctx.labels.shape == (2, 16) and calls == []
    assert model.outputs_shape(np.zeros((2, 16), np.int32)) == (2, 16, 300)
    held = [getattr(model, "_logits", None)] + ([] if tie else
                                                [getattr(model.lm_head, "_out", None)])
    assert all(a is None for a in held)
    with pytest.raises(ValueError, match="max_seq_len=32"):
        go.OptContext(model, batch_size=2, ne_datapoint=33, loss_type="cross_entropy",
                      class_labels=True, inputs_dtype=np.int32)


@pytest.mark.parametrize("name", ["llama", "llama-tied", "gpt2", "llama-lora-on-the-head"])
def test_a_bf16_head_takes_the_loss_kernels_bf16_gradient_bit_for_bit(name, small_chunks,
                                                                      monkeypatch):
    # under precision="bf16" the loss kernel writes the gradient's bf16 bits for a
    # plain head: the same bits the head's own rounding of a float32 gradient gave
    from ggmlopt import gemm
    if not gemm.bf16_support()[0]:
        pytest.skip("no native bf16 products here")
    take = _fused_head._takes_bf16_gradient
    calls = []

    def step(choose):
        monkeypatch.setattr(_fused_head, "_takes_bf16_gradient", choose)
        model = MODELS[name]()
        ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32,
                            precision="bf16")
        ctx.alloc(True)
        x, y = _batch(11)
        ctx.eval(None, inputs=x, labels=y)
        return float(ctx.loss), [ctx.grad_acc(p).copy() for p in ctx.parameters()]

    direct = step(lambda head: calls.append(take(head)) or calls[-1])
    assert any(calls) == (name != "llama-lora-on-the-head")   # a wrapped head rounds itself
    rounded = step(lambda head: False)
    assert direct[0] == rounded[0]
    for a, b in zip(direct[1], rounded[1]):
        np.testing.assert_array_equal(a, b)
