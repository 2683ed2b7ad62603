"""check_gradients over the transformer layers, Residual pre-norm blocks on
(B, T, D) tokens, and frozen parameters in them trained through an OptContext."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import nn
from ggmlopt.testing import check_gradients

B, T, D = 2, 5, 16


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def _randomise(module, seed=1, scale=0.3):
    """Weights away from their ones/zeros init, so every gradient term shows."""
    rng = np.random.default_rng(seed)
    for p in module.parameters():
        p.data[...] += scale * rng.standard_normal(p.shape).astype(np.float32)
    return module


CASES = {
    "RMSNorm": lambda: _randomise(nn.RMSNorm(D)),
    "LayerNorm": lambda: _randomise(nn.LayerNorm(D)),
    "LayerNorm:nobias": lambda: _randomise(nn.LayerNorm(D, bias=False)),
    "SwiGLU": lambda: nn.SwiGLU(D, 24, rng=0),
    "GPT2MLP": lambda: nn.GPT2MLP(D, 24, rng=0),
    "CausalSelfAttention": lambda: _randomise(nn.CausalSelfAttention(D, 4, rng=0), scale=0.2),
    "CausalSelfAttention:gqa": lambda: _randomise(nn.CausalSelfAttention(D, 4, 2, rng=0), scale=0.2),
    "CausalSelfAttention:norope": lambda: _randomise(
        nn.CausalSelfAttention(D, 2, 1, rope=False, rng=0), scale=0.2),
    "GPT2Attention": lambda: _randomise(nn.GPT2Attention(D, 2, rng=0), scale=0.2),
    "pre-norm attention block": lambda: nn.Residual(nn.Sequential(
        _randomise(nn.RMSNorm(D)), _randomise(nn.CausalSelfAttention(D, 4, 2, rng=0), scale=0.2))),
    "pre-norm MLP block": lambda: nn.Residual(nn.Sequential(
        _randomise(nn.LayerNorm(D)), nn.GPT2MLP(D, 24, rng=1))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformer_layers_pass_the_gradient_check(case):
    module = CASES[case]()
    report = check_gradients(module, _x((B, T, D)), rtol=2e-2, atol=2e-3)
    names = {n for n, p in module.named_parameters()}
    assert set(report) == names | {"input"}


def test_embedding_ids_have_no_input_gradient():
    emb = nn.Embedding(11, 6, rng=0)
    ids = np.array([[0, 3, 3, 10], [7, 0, 3, 1]], dtype=np.int32)  # repeated ids add up
    assert set(check_gradients(emb, ids)) == {"weight"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_frozen_parameter_gets_no_gradient_and_changes_no_other(case):
    ref, module = CASES[case](), CASES[case]()
    ref.needs_input_grad = module.needs_input_grad = True
    names = [n for n, _ in module.named_parameters()]
    frozen = names[len(names) // 2]
    dict(module.named_parameters())[frozen].requires_grad = False
    x = _x((B, T, D), 2).astype(np.float32)
    g = _x((B, T, D), 3).astype(np.float32)
    np.testing.assert_array_equal(module.forward(x), ref.forward(x))
    gx_ref = ref.backward(g).copy()
    np.testing.assert_array_equal(module.backward(g), gx_ref)
    params, ref_params = dict(module.named_parameters()), dict(ref.named_parameters())
    for name in names:
        if name == frozen:
            assert params[name].grad is None
        else:
            np.testing.assert_array_equal(params[name].grad, ref_params[name].grad)


def test_fine_tuning_a_pre_norm_block_with_a_frozen_attention():
    """Only the MLP block trains: the attention's weights keep their bits and
    hold no arena memory."""
    attn = nn.CausalSelfAttention(D, 4, 2, rng=0)
    model = nn.Sequential(
        nn.Reshape((T, D)),
        nn.Residual(nn.Sequential(nn.RMSNorm(D), attn)),
        nn.Residual(nn.Sequential(nn.RMSNorm(D), nn.SwiGLU(D, 24, rng=0))),
        nn.Flatten(),
    )
    for p in attn.parameters():
        p.requires_grad = False
    before = {n: p.data.copy() for n, p in attn.named_parameters()}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, T * D)).astype(np.float32)
    y = rng.standard_normal((4, T * D)).astype(np.float32)
    pars = go.OptimizerParams(adamw=go.AdamWParams(alpha=0.01))
    ctx = go.OptContext(model, loss_type=go.LossType.MEAN_SQUARED_ERROR,
                        get_opt_pars=go.constant_optimizer_params, get_opt_pars_ud=pars)
    trainable = sum(p.size for p in model.parameters() if p.requires_grad)
    assert ctx.arena.size == trainable < sum(p.size for p in model.parameters())
    losses = []
    for _ in range(15):
        ctx.alloc(True)
        ctx.eval(inputs=x, labels=y)
        losses.append(float(ctx.loss))
    assert losses[-1] < losses[0]
    for n, p in attn.named_parameters():
        np.testing.assert_array_equal(p.data, before[n])
        assert p.grad is None
