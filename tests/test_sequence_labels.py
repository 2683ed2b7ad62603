"""Tokens through the engine: int32 inputs (batch, n_ctx), outputs (batch, n_ctx,
vocab), one class label per position with -1 masking it; the loss is the mean over
the labelled positions of a physical batch, scaled by 1/opt_period, accuracy is
next-token accuracy over labelled positions, Result.ndata counts datapoints."""
import numpy as np
import pytest

import ggmlopt as go

LT = go.LossType
V = 11


class Bigram:
    """logits[b, t] = weight[tokens[b, t]]: the smallest language model."""

    def __init__(self, vocab=V, seed=0):
        rng = np.random.default_rng(seed)
        self.weight = go.nn.Parameter(rng.normal(0, 1, (vocab, vocab)))
        self.seen = []

    def parameters(self):
        return [self.weight]

    def forward(self, tokens):
        assert tokens.dtype == np.int32
        self.seen.append(tokens.shape)
        self._tokens = tokens.copy()
        return self.weight.data[tokens]

    def backward(self, grad):
        np.add.at(self.weight.grad, self._tokens, grad)


def reference(weight, tokens, labels, opt_period=1):
    """Float64 masked mean cross-entropy over positions / opt_period, its
    gradient w.r.t. weight, the correct predictions and the labelled count."""
    logits = weight.astype(np.float64)[tokens]
    t = logits - logits.max(-1, keepdims=True)
    logp = t - np.log(np.exp(t).sum(-1, keepdims=True))
    keep = labels >= 0
    n = keep.sum()
    safe = np.where(keep, labels, 0)
    picked = np.take_along_axis(logp, safe[..., None], -1)[..., 0]
    loss = -(picked * keep).sum() / n / opt_period
    dlogits = np.exp(logp)
    np.put_along_axis(dlogits, safe[..., None],
                      np.take_along_axis(dlogits, safe[..., None], -1) - 1, -1)
    dlogits *= keep[..., None] / n / opt_period
    grad = np.zeros_like(weight, dtype=np.float64)
    np.add.at(grad, tokens, dlogits)
    pred = logits.argmax(-1)
    return loss, grad, int(((pred == labels) & keep).sum()), int(n)


def batch(rng, b=4, t=9, masked=0.3):
    tokens = rng.integers(0, V, (b, t)).astype(np.int32)
    labels = rng.integers(0, V, (b, t)).astype(np.int32)
    labels[rng.random((b, t)) < masked] = -1
    labels[0, 0] = 3
    return tokens, labels


@pytest.mark.parametrize("opt_period", [1, 2])
def test_dynamic_eval_is_the_masked_mean_over_positions(opt_period):
    rng = np.random.default_rng(opt_period)
    model = Bigram()
    w0 = model.weight.data.copy()
    ctx = go.OptContext(model, loss_type=LT.CROSS_ENTROPY,
                        opt_period=opt_period, inputs_dtype=np.int32)
    res = go.Result()
    tokens, labels = batch(rng)
    ctx.alloc(True)
    ctx.eval(res, inputs=tokens, labels=labels)
    loss, grad, ncorrect, n = reference(w0, tokens, labels, opt_period)
    assert ctx.outputs.shape == (4, 9, V)
    assert float(ctx.loss) == pytest.approx(loss, rel=1e-6)
    np.testing.assert_allclose(ctx.grad_acc(model.weight), grad, rtol=1e-5, atol=1e-7)
    assert ctx.ncorrect == ncorrect and ctx.pred.shape == (36,)
    assert res.ndata == 4 and res.nlabelled == n
    assert res.accuracy()[0] == pytest.approx(ncorrect / n)
    assert res.loss()[0] == pytest.approx(loss * opt_period, rel=1e-6)


def test_masked_positions_change_neither_loss_nor_gradient():
    rng = np.random.default_rng(5)
    tokens, labels = batch(rng)
    other = tokens.copy()
    other[labels < 0] = (other[labels < 0] + 1) % V   # different inputs where masked
    outs = []
    for x in (tokens, other):
        model = Bigram()
        ctx = go.OptContext(model, loss_type=LT.CROSS_ENTROPY,
                            inputs_dtype=np.int32)
        ctx.alloc(True)
        ctx.eval(None, inputs=x, labels=labels)
        outs.append((float(ctx.loss), ctx.grad_acc(model.weight).copy()))
    assert outs[0][0] == outs[1][0]
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_static_context_has_int32_buffers_shaped_by_the_model():
    model = Bigram()
    ctx = go.OptContext(model, 4, 9, loss_type=LT.CROSS_ENTROPY, class_labels=True,
                        inputs_dtype=np.int32)
    assert ctx.inputs.dtype == np.int32 and ctx.inputs.shape == (4, 9)
    assert ctx.labels.dtype == np.int32 and ctx.labels.shape == (4, 9)
    assert ctx.out_shape == (9, V) and ctx.ne_out == V
    with pytest.raises(TypeError, match="inputs: this context takes token ids"):
        ctx.alloc(True)
        ctx.eval(None, inputs=np.zeros((4, 9), np.float32))


def test_fit_on_token_windows_learns_the_corpus():
    # a corpus with a rule: the next token is (token * 3 + 1) % V
    seq = [2]
    for _ in range(3216):   # ndata = (3217 - 16 - 1) // 8 = 400
        seq.append((seq[-1] * 3 + 1) % V)
    ds = go.Dataset.from_tokens(np.array(seq, np.uint16), 16, 8)
    model = Bigram()
    pars = go.OptimizerParams(go.AdamWParams(alpha=0.05))
    history = go.fit(model, ds, LT.CROSS_ENTROPY, lambda epoch: pars, nepoch=4,
                     nbatch_logical=40, nbatch_physical=20, val_split=0.2, silent=True, seed=0)
    assert ds.ndata == 400
    assert model.seen[-1] == (20, 16)
    assert history[-1].val_accuracy == 1.0
    assert history[-1].val_loss < history[0].train_loss / 2


def test_fit_with_masked_labels_and_evaluate_count_positions():
    rng = np.random.default_rng(2)
    x = rng.integers(0, V, (40, 6)).astype(np.int32)
    y = rng.integers(0, V, (40, 6)).astype(np.int32)
    y[:, :2] = -1    # prompt positions: not trained on
    ds = go.Dataset.from_arrays(x, y)
    model = Bigram()
    go.fit(model, ds, LT.CROSS_ENTROPY, nepoch=1, nbatch_logical=10, silent=True)
    res = go.evaluate(model, ds, LT.CROSS_ENTROPY, batch_size=10)
    assert res.ndata == 40 and res.nlabelled == 40 * 4


@pytest.mark.parametrize("labels,exc,match", [
    (np.full((4, 9), -2, np.int32), IndexError, r"-1 to mask"),
    (np.zeros((4, 8), np.int32), ValueError, r"expected class indices of shape \(4, 9\)"),
    (np.full((4, 9), V, np.int32), IndexError, r"class 11 at row 0 is out of range"),
])
def test_bad_sequence_labels_change_nothing(labels, exc, match):
    model = Bigram()
    w0 = model.weight.data.copy()
    ctx = go.OptContext(model, loss_type=LT.CROSS_ENTROPY, inputs_dtype=np.int32)
    ctx.alloc(True)
    with pytest.raises(exc, match=match):
        ctx.eval(None, inputs=np.zeros((4, 9), np.int32), labels=labels)
    np.testing.assert_array_equal(model.weight.data, w0)
    assert ctx.iter == 1


def test_sequence_labels_need_cross_entropy():
    ds = go.Dataset.from_tokens(np.arange(100) % V, 8)
    with pytest.raises(ValueError, match="only CROSS_ENTROPY takes"):
        go.fit(Bigram(), ds, LT.MEAN_SQUARED_ERROR, nepoch=1, nbatch_logical=1, silent=True)


def test_inputs_dtype_is_checked():
    with pytest.raises(TypeError, match="inputs_dtype: expected numpy.float32"):
        go.OptContext(Bigram(), loss_type=LT.CROSS_ENTROPY, inputs_dtype=np.int64)


class DeclaredBigram(Bigram):
    inputs_dtype = np.int32   # what the language models of ggmlopt.models declare


def test_a_model_that_declares_token_inputs_needs_no_flag():
    model = DeclaredBigram()
    ctx = go.OptContext(model, 2, 5, loss_type=LT.CROSS_ENTROPY, class_labels=True)
    assert ctx.inputs_dtype == np.int32 and ctx.inputs.dtype == np.int32
    tokens = np.array([[1, 2, 3], [4, 5, 6]], np.int64)
    logits = go.predict(model, tokens, batch_size=1)
    assert logits.shape == (2, 3, V)
    np.testing.assert_array_equal(logits, model.weight.data[tokens])
    res = go.evaluate(model, (tokens, np.array([[2, 3, -1], [5, -1, -1]])), "cross_entropy")
    assert res.ndata == 2 and res.nlabelled == 3
