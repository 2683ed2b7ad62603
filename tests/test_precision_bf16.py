"""precision="bf16": the layers' products take bf16-rounded copies of weights,
activations and output gradients and sum in float32, inside a training
context's evals only; weights, gradients and optimizer state stay float32.

Each layer is checked against the float64 product of the rounded operands
(kernels.to_bfloat16, itself checked bit for bit) within float32 summation's
gamma_k bound, which also shows that every operand was rounded (an unrounded
one misses by ~2^-9 relative, far outside the bound).
"""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import gemm, kernels, lora
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.nn import Embedding, Linear

F32 = np.float32
U = 2.0 ** -24

pytestmark = pytest.mark.skipif(not gemm.bf16_support()[0],
                                reason=f"no native bf16 products: {gemm.bf16_support()[1]}")


def rounded(x):
    """x rounded to bf16, as float64."""
    bits = kernels.to_bfloat16(np.ascontiguousarray(x, F32))
    return (bits.astype(np.uint32) << 16).view(F32).astype(np.float64)


def assert_within_sum_bound(got, a, b, extra=None):
    """got within gamma_(k+1) |a||b| (+ |extra|'s rounding) of a @ b (+ extra)."""
    k = a.shape[1]
    g = (k + 2) * U / (1 - (k + 2) * U)
    want = a @ b + (0 if extra is None else extra)
    bound = g * (np.abs(a) @ np.abs(b) + (0 if extra is None else np.abs(extra)))
    excess = np.abs(np.asarray(got, np.float64) - want) - bound
    assert (excess <= 0).all(), f"worst excess {excess.max():.3g}"


def test_linear_forward_and_backward_use_rounded_operands(rng):
    layer = Linear(37, 19, rng=1)
    layer.bias.data[...] = rng.standard_normal(19)
    x = rng.standard_normal((2, 5, 37), dtype=F32)
    g = rng.standard_normal((2, 5, 19), dtype=F32)
    with gemm.products_in("bf16"):
        y = layer.forward(x).copy()
        dx = layer.backward(g).copy()
    x64, w64, g64 = rounded(x.reshape(10, 37)), rounded(layer.weight.data), rounded(g.reshape(10, 19))
    assert_within_sum_bound(y.reshape(10, 19), x64, w64, layer.bias.data.astype(np.float64))
    assert_within_sum_bound(layer.weight.grad, x64.T, g64)
    assert_within_sum_bound(dx.reshape(10, 37), g64, w64.T)
    # the bias gradient sums the float32 gradient itself, not a rounded copy
    np.testing.assert_allclose(layer.bias.grad, g.reshape(10, 19).sum(0, dtype=np.float64),
                               rtol=0, atol=12 * U * np.abs(g).reshape(10, 19).sum(0).max())


def test_linear_accumulates_its_weight_gradient(rng):
    layer = Linear(8, 6, bias=False, rng=2)
    xs = [rng.standard_normal((4, 8), dtype=F32) for _ in range(2)]
    gs = [rng.standard_normal((4, 6), dtype=F32) for _ in range(2)]
    with gemm.products_in("bf16"):
        for x, g in zip(xs, gs):
            layer.forward(x)
            layer.backward(g)
    total = sum(rounded(x).T @ rounded(g) for x, g in zip(xs, gs))
    bound = 20 * U * sum(np.abs(rounded(x)).T @ np.abs(rounded(g)) for x, g in zip(xs, gs))
    assert (np.abs(layer.weight.grad - total) <= bound).all()


def test_outside_a_bf16_scope_products_stay_float32(rng):
    layer = Linear(64, 9, bias=False, rng=3)
    x = rng.standard_normal((5, 64), dtype=F32)
    y = layer.forward(x).copy()
    assert_within_sum_bound(y, x.astype(np.float64), layer.weight.data.astype(np.float64))
    with gemm.products_in("bf16"):
        yb = layer.forward(x).copy()
    assert np.max(np.abs(yb - y)) > 100 * 66 * U * np.max(np.abs(x) @ np.abs(layer.weight.data))
    assert layer.infer(x) is not None and not gemm.bf16_active()


def test_backward_follows_its_forwards_precision(rng):
    # a forward in float32 gets a float32 backward even inside a bf16 scope
    layer = Linear(16, 4, bias=False, rng=4)
    x, g = rng.standard_normal((3, 16), dtype=F32), rng.standard_normal((3, 4), dtype=F32)
    layer.forward(x)
    with gemm.products_in("bf16"):
        dx = layer.backward(g)
    assert_within_sum_bound(dx, g.astype(np.float64), layer.weight.data.astype(np.float64).T)


def test_tied_head_projects_with_rounded_operands(rng):
    emb = Embedding(41, 12, rng=5)
    rows = rng.standard_normal((7, 12), dtype=F32)
    g = rng.standard_normal((7, 41), dtype=F32)
    with gemm.products_in("bf16"):
        logits = emb.project(rows).copy()
        dh = emb.project_backward(g, rows).copy()
    r64, w64, g64 = rounded(rows), rounded(emb.weight.data), rounded(g)
    assert_within_sum_bound(logits, r64, w64.T)
    assert_within_sum_bound(dh, g64, w64)
    assert_within_sum_bound(emb.weight.grad, g64.T, r64)


def test_a_weight_held_fixed_is_rounded_once_and_anew_after(rng):
    """An output head called chunk by chunk in one pass rounds its weight once
    (weight_fixed); the next pass rounds it again."""
    from ggmlopt.nn._bf16 import weight_fixed
    layer, emb = Linear(12, 9, bias=False, rng=3), Embedding(9, 12, rng=4)
    x = rng.standard_normal((5, 12), dtype=F32)
    with gemm.products_in("bf16"):
        with weight_fixed(layer), weight_fixed(emb):
            a, ea = layer.forward(x).copy(), emb.project(x).copy()
            layer.weight.data *= 2   # (nothing changes a head's weight within a pass)
            emb.weight.data *= 2
            b, eb = layer.forward(x).copy(), emb.project(x).copy()
        np.testing.assert_array_equal(a, b)   # the first product's copy, reused
        np.testing.assert_array_equal(ea, eb)
        c, ec = layer.forward(x).copy(), emb.project(x).copy()   # rounded anew
    assert_within_sum_bound(c, rounded(x), rounded(layer.weight.data))
    assert_within_sum_bound(ec, rounded(x), rounded(emb.weight.data).T)
    assert not np.array_equal(a, c)


def test_lora_base_product_is_bf16_and_the_adapter_float32(rng):
    model = Llama(LlamaConfig(vocab_size=50, dim=16, n_layers=1, n_heads=2, ffn_dim=24,
                              max_seq_len=8), seed=0)
    lora.apply(model, rank=2, targets=("q_proj",), seed=1)
    layer = dict(lora.named_adapters(model))["layers.0.self_attn.q_proj"]
    layer.lora_b.data[...] = rng.standard_normal(layer.lora_b.data.shape) * 0.1
    x = rng.standard_normal((6, 16), dtype=F32)
    with gemm.products_in("bf16"):
        y = layer.forward(x).copy()
    base = layer.weight.data   # the frozen base's
    a, b = layer.lora_a.data.astype(np.float64), layer.lora_b.data.astype(np.float64)
    x64 = x.astype(np.float64)
    adapter = x64 @ a @ b * layer.scaling           # float32 operands, unrounded
    base_ref = rounded(x) @ rounded(base)
    k = 16
    bound = ((k + 2) * U * (np.abs(rounded(x)) @ np.abs(rounded(base)))
             + (2 + 3) * U * (np.abs(x64) @ np.abs(a) @ np.abs(b) * layer.scaling)
             + U * np.abs(y))                          # the sum of the two parts
    assert (np.abs(y - (base_ref + adapter)) <= bound).all()
    # and not the float32 base product: the rounding of x and W shows
    assert np.max(np.abs(y - (x64 @ base + adapter))) > np.max(bound)


def tiny_llama():
    return Llama(LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_dim=48, max_seq_len=16), seed=1)


def train(model, precision, steps=3, checkpointing=False):
    if checkpointing:
        model.gradient_checkpointing_enable()
    rng = np.random.default_rng(0)
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32, seed=5,
                        precision=precision)
    losses = []
    for _ in range(steps):
        tokens = rng.integers(0, 61, (3, 13)).astype(np.int32)
        ctx.alloc(True)
        ctx.eval(None, inputs=np.ascontiguousarray(tokens[:, :-1]),
                 labels=np.ascontiguousarray(tokens[:, 1:]))
        losses.append(float(ctx.loss))
    return ctx, losses, {n: p.data.copy() for n, p in model.named_parameters()}


def test_context_trains_in_bf16_near_float32():
    ctx, losses16, p16 = train(tiny_llama(), "bf16")
    assert ctx.precision == "bf16" and not gemm.bf16_active()
    _, losses32, p32 = train(tiny_llama(), "f32")
    assert all(p.dtype == F32 for p in p16.values())
    # the same first loss up to bf16's rounding of the logits' products, and
    # trajectories that differ (the products really were rounded)
    assert abs(losses16[0] - losses32[0]) < 2.0 ** -7 * abs(losses32[0])
    assert any(not np.array_equal(p16[n], p32[n]) for n in p32)
    for n in p32:   # 3 steps of AdamW at alpha 1e-3: each weight moves <= 3e-3
        assert np.max(np.abs(p16[n] - p32[n])) <= 6.1e-3, n


def test_bf16_with_checkpointing_is_bit_identical():
    _, losses, plain = train(tiny_llama(), "bf16")
    _, losses_ck, ck = train(tiny_llama(), "bf16", checkpointing=True)
    assert losses == losses_ck
    for n in plain:
        np.testing.assert_array_equal(plain[n], ck[n], err_msg=n)


def test_without_native_bf16_the_context_says_so_and_trains_float32(monkeypatch):
    monkeypatch.setattr(gemm, "bf16_support", lambda: (False, "no bf16 here"))
    with pytest.warns(UserWarning, match="no bf16 here.*float32"):
        ctx = go.OptContext(tiny_llama(), loss_type="cross_entropy", inputs_dtype=np.int32,
                            precision="bf16")
    assert ctx.precision == "f32"


def test_a_model_with_convolutions_says_they_stay_float32(monkeypatch):
    # a CNN under bf16 multiplies only its Linear layers in bf16: said when the
    # context is made, and not for a model without convolutions
    import warnings

    monkeypatch.setattr(gemm, "bf16_support", lambda: (True, "bf16 here"))
    cnn = go.nn.Sequential(go.nn.Conv2d(1, 4, 3, padding=1, rng=0), go.nn.ReLU(),
                           go.nn.Conv2d(4, 2, 3, padding=1, rng=1), go.nn.Flatten(),
                           go.nn.Linear(2 * 5 * 5, 3, rng=2))
    with pytest.warns(UserWarning, match="2 Conv2d layers multiply in float32"):
        ctx = go.OptContext(cnn, loss_type="cross_entropy", precision="bf16")
    assert ctx.precision == "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        go.OptContext(cnn, loss_type="cross_entropy", precision="f32")
        go.OptContext(tiny_llama(), loss_type="cross_entropy", inputs_dtype=np.int32,
                      precision="bf16")


def test_bad_precision_is_refused():
    with pytest.raises(ValueError, match="precision"):
        go.OptContext(tiny_llama(), loss_type="cross_entropy", inputs_dtype=np.int32,
                      precision="fp8")


def test_fit_takes_the_precision():
    corpus = np.random.default_rng(3).integers(0, 61, 8 * 12 + 9).astype(np.int32)
    ds = go.Dataset.from_tokens(corpus, 8, 8)
    loss = {}
    for precision in ("bf16", "f32"):
        hist = go.fit(tiny_llama(), ds, "cross_entropy", nbatch_logical=4, silent=True,
                      precision=precision)
        loss[precision] = hist.epochs[0].train_loss
    assert loss["bf16"] != loss["f32"]          # the products were rounded ...
    assert abs(loss["bf16"] - loss["f32"]) < 2.0 ** -6 * loss["f32"]   # ... and only that


def test_a_frozen_projection_s_input_gradient_follows_its_forward(rng):
    # attention's shortcut for a frozen Linear (no parameter gradient) keeps the
    # forward's precision: bf16 operands after a bf16 forward, float32 otherwise
    from ggmlopt.nn.attention import _linear_backward
    layer = Linear(24, 10, bias=False, rng=6)
    layer.weight.requires_grad = False
    x, g = rng.standard_normal((5, 24), dtype=F32), rng.standard_normal((5, 10), dtype=F32)
    with gemm.products_in("bf16"):
        layer.forward(x)
        dx = _linear_backward(layer, g, True)
    assert_within_sum_bound(dx, rounded(g), rounded(layer.weight.data).T)
    assert np.max(np.abs(dx - g.astype(np.float64) @ layer.weight.data.T)) > \
        100 * 12 * U * np.max(np.abs(g) @ np.abs(layer.weight.data.T))
    layer.forward(x)
    dx32 = _linear_backward(layer, g, True)
    assert_within_sum_bound(dx32, g.astype(np.float64), layer.weight.data.astype(np.float64).T)


def test_an_inference_projection_leaves_the_tied_head_s_backward_alone(rng):
    # decoding (the head's keep=False product) between a bf16 forward and its
    # backward changes neither the backward's precision nor its operands
    emb = Embedding(33, 8, rng=7)
    rows = rng.standard_normal((5, 8), dtype=F32)
    g = rng.standard_normal((5, 33), dtype=F32)
    with gemm.products_in("bf16"):
        emb.project(rows)
    other = emb.project(rng.standard_normal((2, 8), dtype=F32), keep=False)
    assert other.shape == (2, 33)
    with gemm.products_in("bf16"):
        dh = emb.project_backward(g, rows)
    assert_within_sum_bound(dh, rounded(g), rounded(emb.weight.data))
    assert_within_sum_bound(emb.weight.grad, rounded(g).T, rounded(rows))
