"""precision="bf16" never multiplies a stale bf16 copy of a weight: whatever
changed the float32 weights (optimizer steps, an assignment, a merge, a
checkpoint loaded, a float32 fit in between), a bf16 forward is bit for bit the
one of a fresh model and context over the same float32 weights (the same
rounding of the same weights); and a machine without bf16 products trains
exactly as float32 does."""
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import gemm, lora
from ggmlopt.models import Llama, LlamaConfig

pytestmark = pytest.mark.skipif(not gemm.bf16_support()[0],
                                reason=f"no native bf16 products: {gemm.bf16_support()[1]}")

VOCAB = 61


def tiny(seed=1, tie=False):
    return Llama(LlamaConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_dim=48, max_seq_len=16, tie_embeddings=tie), seed=seed)


def context(model, precision):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32, seed=5,
                             precision=precision)


def run(ctx, seed, backward):
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (3, 13)).astype(np.int32)
    ctx.alloc(backward)
    ctx.eval(None, inputs=np.ascontiguousarray(tokens[:, :-1]),
             labels=np.ascontiguousarray(tokens[:, 1:]))
    return float(ctx.loss)


def fresh_loss(model, make, precision="bf16"):
    """The forward loss of a new model from make() holding model's weights, in a
    new context."""
    other = make()
    weights = dict(model.named_parameters())
    for name, p in other.named_parameters():
        p.data[...] = weights[name].data
    return run(context(other, precision), 0, False)


@pytest.mark.parametrize("tie", [False, True])
def test_the_forward_rounds_the_current_weights(tie):
    model = tiny(tie=tie)
    ctx = context(model, "bf16")
    for i in range(3):   # a tied head follows its embedding's steps
        run(ctx, i, True)
    make = lambda: tiny(seed=9, tie=tie)
    assert run(ctx, 0, False) == fresh_loss(model, make)
    for _, p in model.named_parameters():
        p.data[...] *= np.float32(1.01)
    assert run(ctx, 0, False) == fresh_loss(model, make)
    run(context(model, "f32"), 3, True)      # a float32 step in between
    assert run(ctx, 0, False) == fresh_loss(model, make)
    # and the rounding is real: the float32 forward differs
    assert run(ctx, 0, False) != fresh_loss(model, make, "f32")


def test_lora_steps_assignment_and_merge_leave_no_stale_copy():
    def adapted(seed=9):
        m = tiny(seed)
        lora.apply(m, rank=4, targets="all-linear")
        return m
    model = adapted(1)
    ctx = context(model, "bf16")
    for i in range(2):
        run(ctx, i, True)
    assert run(ctx, 0, False) == fresh_loss(model, adapted)
    for name, p in model.named_parameters():
        if "lora_b" in name:
            p.data[...] += np.float32(0.05)
    assert run(ctx, 0, False) == fresh_loss(model, adapted)
    lora.merge(model)
    merged = context(model, "bf16")
    run(merged, 2, True)
    assert run(merged, 0, False) == fresh_loss(model, lambda: tiny(9))


def test_a_loaded_checkpoint_goes_on_bit_for_bit(tmp_path):
    model = tiny()
    ctx = context(model, "bf16")
    for i in range(2):
        run(ctx, i, True)
    ctx.save(tmp_path / "c.npz")
    for i in range(2, 4):
        run(ctx, i, True)
    other = tiny(seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = go.OptContext.load(tmp_path / "c.npz", other)
    assert loaded.precision == "bf16"
    for i in range(2, 4):
        run(loaded, i, True)
    assert run(loaded, 0, False) == run(ctx, 0, False)
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        np.testing.assert_array_equal(a.data, b.data, err_msg=name)


_FIT = """
import warnings, numpy as np, ggmlopt as go
from ggmlopt.models import Llama, LlamaConfig
m = Llama(LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                      max_seq_len=16), seed=1)
ds = go.Dataset.from_tokens(np.random.default_rng(3).integers(0, 61, 8 * 12 + 13)
                            .astype(np.int32), 12, 12)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    go.fit(m, ds, "cross_entropy", nbatch_logical=4, silent=True, seed=0, precision={!r})
print(any("training in float32" in str(w.message) for w in seen))
print(b"".join(p.data.tobytes() for _, p in m.named_parameters()).hex())
"""


def test_without_bf16_products_the_fit_is_float32_s_bit_for_bit():
    # the native bf16 engine on the AVX2 path has no bf16 instruction
    env = dict(os.environ, GGMLOPT_SIMD="avx2", GGMLOPT_GEMM_BF16="native")
    out = {}
    for precision in ("bf16", "f32"):
        done = subprocess.run([sys.executable, "-c", _FIT.format(precision)], env=env,
                              capture_output=True, text=True, check=True)
        out[precision] = done.stdout.split()
    assert out["bf16"][0] == "True" and out["f32"][0] == "False"
    assert out["bf16"][1] == out["f32"][1]


def _bf16_values(a):
    """a rounded to bf16 (nearest even) and widened to float64."""
    bits = go.kernels.to_bfloat16(np.ascontiguousarray(a, np.float32)).astype(np.uint32) << 16
    return bits.view(np.float32).astype(np.float64)


@pytest.mark.parametrize("bias", [False, True])
def test_a_lora_base_weight_trained_again_takes_its_gradient_from_bf16_copies(bias):
    """An adapter's base weight made trainable again multiplies like a Linear's
    in a bf16 pass: dW = r(x)^T r(g) (it was the float32 x^T g), the bias the
    float32 column sums."""
    from ggmlopt.nn import Linear
    from ggmlopt.nn.lora_layers import LoRALinear
    rng = np.random.default_rng(0)
    layer = LoRALinear(Linear(40, 24, bias=bias, rng=1), 4, 8.0, rng=2)
    layer.lora_b.data[...] = rng.standard_normal(layer.lora_b.shape) * 0.1
    layer.weight.requires_grad = True
    if bias:
        layer.bias.requires_grad = True
        layer.bias.grad[...] = 0
    layer.weight.grad[...] = 0
    x = rng.standard_normal((6, 40)).astype(np.float32)
    g = rng.standard_normal((6, 24)).astype(np.float32)
    with gemm.products_in("bf16"):
        layer.forward(x)
        layer.backward(g)
    want = _bf16_values(x).T @ _bf16_values(g)
    # float32 sums of 6 exact products of bf16 values: a few float32 roundings
    tol = 8 * np.finfo(np.float32).eps * (np.abs(_bf16_values(x)).T @ np.abs(_bf16_values(g)))
    assert np.all(np.abs(layer.weight.grad - want) <= tol)
    assert np.abs(layer.weight.grad - x.astype(np.float64).T @ g).max() > 1e-3   # not x^T g
    if bias:
        np.testing.assert_allclose(layer.bias.grad, g.astype(np.float64).sum(0), rtol=1e-6,
                                   atol=1e-6)
