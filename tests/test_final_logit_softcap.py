"""Gemma 2's soft cap on the final logits (CausalLM.final_logit_softcap),
which every way to the logits applies: forward and backward(grad_logits), the
fused chunked head with its loss (on the float32 and bf16 paths), decode and
logits_between.  The reference is the uncapped model with the cap applied in
float64 outside it: its logits c * tanh(z / c), and for a loss gradient g the
uncapped model's backward of g * (1 - tanh^2)."""
import warnings

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import kernels
from ggmlopt.models import Llama, LlamaConfig, _fused_head

V = 97
CONFIG = {"vocab_size": V, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
          "ffn_dim": 48, "max_seq_len": 64}
CAP = 2.5
U = 2.0 ** -24


def model_pair(tied):
    """(capped, plain): the same weights, logits scaled up so the cap bends them."""
    models = []
    for _ in range(2):
        m = Llama(LlamaConfig(**CONFIG, tie_embeddings=tied), seed=3)
        head = m._embedding.weight if tied else m.lm_head.weight
        head.data[...] *= 40.0
        models.append(m)
    models[0].final_logit_softcap = CAP
    return models


def batch(seed, b=2, t=23, masked=0.4):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, V, (b, t)).astype(np.int32)
    y = rng.integers(0, V, (b, t)).astype(np.int32)
    y[rng.random((b, t)) < masked] = -1
    return x, y


def capped64(z):
    return CAP * np.tanh(np.asarray(z, np.float64) / CAP)


@pytest.mark.parametrize("tied", [False, True])
def test_forward_decode_and_windows_are_capped(tied):
    capped, plain = model_pair(tied)
    x, _ = batch(0)
    z = plain(x)
    assert np.abs(z).max() > 3 * CAP          # the cap has work to do
    want = capped64(z)
    # tanh within a few ulps of CAP, the division and product one rounding each
    tol = 4 * U * CAP
    np.testing.assert_allclose(capped(x), want, rtol=0, atol=tol)
    np.testing.assert_allclose(capped.logits_between(x, 5, 17), want[:, 5:17], rtol=0, atol=tol)
    cache_c, cache_p = capped.make_cache(2, 32), plain.make_cache(2, 32)
    step_c = capped.decode(x[:, :9], cache_c)
    step_p = plain.decode(x[:, :9], cache_p)
    np.testing.assert_allclose(step_c, capped64(step_p), rtol=0, atol=tol)
    one_c = capped.decode(x[:, 9:10], cache_c)
    one_p = plain.decode(x[:, 9:10], cache_p)
    np.testing.assert_allclose(one_c, capped64(one_p), rtol=0, atol=tol)


@pytest.mark.parametrize("tied", [False, True])
def test_backward_goes_through_the_cap(tied):
    capped, plain = model_pair(tied)
    x, _ = batch(1)
    g = np.random.default_rng(2).standard_normal((2, 23, V)).astype(np.float32)
    kept = g.copy()
    zc = capped.forward(x)
    t = np.asarray(zc, np.float64) / CAP
    capped.backward(g)
    assert np.array_equal(g, kept)             # the caller's gradient is not written
    plain.forward(x)
    plain.backward((g * (1 - t) * (1 + t)).astype(np.float32))
    for (name, pc), (_, pp) in zip(capped.named_parameters(), plain.named_parameters()):
        scale = np.abs(pp.grad).max() + 1e-30
        # the slope's own rounding (a few u) on each term of the sums
        np.testing.assert_allclose(pc.grad, pp.grad, rtol=0, atol=1e-5 * scale, err_msg=name)


def run_fused(model, fused, x, y, precision="f32"):
    model.fused_head = fused
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32,
                        precision=precision)
    ctx.alloc(True)
    res = go.Result()
    ctx.eval(res, inputs=x, labels=y)
    return float(ctx.loss), [ctx.grad_acc(p).copy() for p in ctx.parameters()], \
        ctx.pred.copy()


@pytest.mark.parametrize("tied", [False, True])
def test_fused_head_loss_and_gradients_equal_the_full_logits(tied, monkeypatch):
    monkeypatch.setattr(_fused_head, "CHUNK_BYTES", 5 * 4 * V)   # several chunks, a ragged one
    x, y = batch(4)
    fused = run_fused(model_pair(tied)[0], True, x, y)
    full = run_fused(model_pair(tied)[0], False, x, y)
    # the loss of the capped logits, as the cross-entropy kernel gives it on them
    capped = model_pair(tied)[0]
    want = float(kernels.cross_entropy(capped(x).reshape(-1, V), y.reshape(-1),
                                       ignore_index=-1))
    np.testing.assert_allclose(fused[0], want, rtol=1e-6)
    np.testing.assert_allclose(full[0], want, rtol=1e-6)
    scale = max(np.abs(g).max() for g in full[1])
    for a, b in zip(fused[1], full[1]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * scale)
    lab = y.reshape(-1) >= 0
    np.testing.assert_array_equal(fused[2][lab], full[2][lab])
    # and the cap changes the loss: the plain model's differs
    plain = run_fused(model_pair(tied)[1], True, x, y)
    assert abs(plain[0] - fused[0]) > 1e-3 * abs(fused[0])


def test_bf16_fused_head_equals_bf16_full_logits(monkeypatch):
    """The capped head in a bf16 pass: the fused head hands the head a float32
    gradient (its bf16 shortcut skipped under a cap), as the full logits do."""
    monkeypatch.setattr(_fused_head, "CHUNK_BYTES", 5 * 4 * V)
    x, y = batch(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # a CPU without bf16 products runs float32
        fused = run_fused(model_pair(False)[0], True, x, y, precision="bf16")
        full = run_fused(model_pair(False)[0], False, x, y, precision="bf16")
    np.testing.assert_allclose(fused[0], full[0], rtol=1e-5)
    # float32-level differences (chunked sums) may flip a bf16 rounding below the
    # head: a term moves by 2^-8 of its size at most
    scale = max(np.abs(g).max() for g in full[1])
    for a, b in zip(fused[1], full[1]):
        np.testing.assert_allclose(a, b, rtol=0, atol=2.0 ** -7 * scale)


def test_memory_report_counts_the_slope_buffer():
    """The capped head holds the cap's slope beside each chunk of logits: the
    report's head grows by one chunk buffer."""
    capped, plain = model_pair(False)
    report_c = go.memory_report(capped, 2, 23)
    report_p = go.memory_report(plain, 2, 23)
    chunk = _fused_head.chunk_rows(2 * 23, V) * V * 4
    assert report_c.head - report_p.head == chunk
    assert report_c.total > report_p.total   # the head is the peak of this small model


def test_the_cap_and_its_slope_make_no_temporary_of_the_chunk_s_size():
    # the fused head holds the logits and the slope (two chunk buffers, as
    # memory_report counts them): a third, a temporary of (1 + t), would be 56 MiB more
    import tracemalloc

    from ggmlopt.models._logit_softcap import soft_cap_backward, soft_cap_with_slope
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((64, 50_000)) * 40).astype(np.float32)   # 12.2 MiB
    want = np.float32(30.0) * np.tanh(logits / np.float32(30.0))
    t = np.tanh(logits / np.float32(30.0))
    slope = np.empty_like(logits)
    grad = np.ones_like(logits)
    tracemalloc.start()
    soft_cap_with_slope(logits, 30.0, slope)
    _, forward_peak = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    soft_cap_backward(grad, logits, 30.0)
    _, backward_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert max(forward_peak, backward_peak) < 4 << 20, (forward_peak, backward_peak)
    np.testing.assert_array_equal(logits, want)
    np.testing.assert_array_equal(slope, (np.float32(1) - t) * (np.float32(1) + t))
    # (the backward reads the capped logits: t again from them, within rounding)
    np.testing.assert_allclose(grad, slope, rtol=0, atol=4 * np.finfo(np.float32).eps)
