"""Residual(fn): x + fn(x) in place where fn allows it, exact gradients either way,
and (B, T, D) inputs through Sequential and the layers."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.nn import GELU, Dropout, Linear, Module, ReLU, Residual, Sequential, Tanh
from ggmlopt.testing import check_gradients


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape", [(5, 8), (2, 7, 8), (1, 1, 8), (3, 2, 1, 8)])
def test_residual_over_a_linear_adds_in_place(shape):
    lin = Linear(8, 8, rng=0)
    res = Residual(lin)
    x = _x(shape)
    x_before = x.copy()
    expected = x.astype(np.float64) + (x.astype(np.float64) @ lin.weight.data + lin.bias.data)
    out = res.forward(x)
    assert out is lin._out  # fn's output buffer, x added into it: no other buffer
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(x, x_before)
    g = _x(shape, 1)
    g_before = g.copy()
    gx = res.backward(g)
    assert res._own_grad is None   # the sum went into the branch's new input gradient
    np.testing.assert_allclose(gx, g + g @ lin.weight.data.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(g, g_before)
    np.testing.assert_allclose(lin.weight.grad, x.reshape(-1, 8).astype(np.float64).T
                               @ g.reshape(-1, 8), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tail", [Tanh, ReLU, GELU])
def test_residual_keeps_an_output_its_branch_reads(tail):
    """Tanh and ReLU read their output in backward: the sum goes elsewhere."""
    fn = Sequential(Linear(6, 6, rng=0), tail())
    fn.needs_input_grad = True
    res = Residual(fn)
    x = _x((4, 3, 6))
    y = fn.forward(x).copy()
    out = res.forward(x)
    assert not np.shares_memory(out, fn[1]._out)
    np.testing.assert_array_equal(out, x + y)
    check_gradients(Residual(Sequential(Linear(6, 6, rng=0), tail())), _x((4, 3, 6), 2))


def test_residual_of_a_branch_returning_its_input():
    res = Residual(Dropout(0.5))  # not training: Dropout returns x itself
    x = _x((3, 4))
    before = x.copy()
    out = res.forward(x)
    np.testing.assert_array_equal(out, 2 * before)
    np.testing.assert_array_equal(x, before)
    g = _x((3, 4), 1)
    gb = g.copy()
    np.testing.assert_array_equal(res.backward(g), 2 * gb)
    np.testing.assert_array_equal(g, gb)


def test_pre_norm_style_block_gradients_on_tokens():
    d, h = 8, 12
    block = Sequential(
        Residual(Sequential(Linear(d, h, rng=0), GELU(), Linear(h, d, rng=1))),
        Residual(Sequential(Linear(d, d, bias=False, rng=2))),
    )
    report = check_gradients(block, _x((2, 5, d), 3), rtol=2e-2)
    assert set(report) == {"0.fn.0.weight", "0.fn.0.bias", "0.fn.2.weight", "0.fn.2.bias",
                           "1.fn.0.weight", "input"}


def test_residual_first_in_a_model_computes_no_input_gradient():
    model = Sequential(Residual(Linear(4, 4, rng=0)), Linear(4, 2, rng=1))
    assert not model[0].needs_input_grad and not model[0].fn.needs_input_grad
    model.forward(_x((3, 4)))
    assert model.backward(_x((3, 2), 1)) is None
    assert model[0].fn.weight.grad.any()
    model.needs_input_grad = True
    assert model[0].fn.needs_input_grad


def test_residual_bad_branches_and_order():
    with pytest.raises(TypeError, match="fn"):
        Residual(object())
    with pytest.raises(ValueError, match="input's shape"):
        Residual(Linear(4, 3, rng=0)).forward(_x((2, 4)))
    with pytest.raises(RuntimeError, match="forward first"):
        Residual(Linear(4, 4)).backward(_x((2, 4)))
    res = Residual(Linear(4, 4, rng=0))
    res.forward(_x((2, 4)))
    with pytest.raises(ValueError, match="grad_out"):
        res.backward(_x((4, 2)))

    class NoInputGrad(Module):
        def forward(self, x):
            return x * 2

        def backward(self, g):
            return None

    bad = Residual(NoInputGrad())
    bad.forward(_x((2, 4)))
    with pytest.raises(RuntimeError, match="no input gradient"):
        bad.backward(_x((2, 4)))


def test_residual_trains_in_a_context_and_names_its_parameters():
    model = Sequential(Linear(6, 8, rng=0), Residual(Sequential(Linear(8, 8, rng=1), Tanh())),
                       Residual(Linear(8, 8, rng=2)), Linear(8, 3, rng=3))
    names = [n for n, _ in model.named_parameters()]
    assert names == ["0.weight", "0.bias", "1.fn.0.weight", "1.fn.0.bias", "2.fn.weight",
                     "2.fn.bias", "3.weight", "3.bias"]
    assert "Residual(" in repr(model)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 6)).astype(np.float32)
    y = rng.integers(0, 3, 16).astype(np.int32)
    pars = go.OptimizerParams(adamw=go.AdamWParams(alpha=0.02))
    ctx = go.OptContext(model, loss_type=go.LossType.CROSS_ENTROPY,
                        get_opt_pars=go.constant_optimizer_params, get_opt_pars_ud=pars)
    losses = []
    for _ in range(30):
        ctx.alloc(True)
        ctx.eval(inputs=x, labels=y)
        losses.append(float(ctx.loss))
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("layer", [GELU, Tanh, ReLU, go.nn.SiLU, go.nn.Sigmoid,
                                   lambda: go.nn.LeakyReLU(0.2), lambda: Dropout(0.3)])
def test_layers_take_token_shaped_inputs(layer):
    """(B, T, D) through the shape-agnostic layers inside a Sequential, also
    while training (Dropout draws a mask of the whole shape)."""
    model = Sequential(Linear(5, 6, rng=0), layer(), Linear(6, 4, rng=1))
    model.needs_input_grad = True
    go.nn.set_rng(model, np.random.default_rng(0))
    model.train(True)
    x = _x((2, 3, 5))
    out = model.forward(x)
    assert out.shape == (2, 3, 4)
    assert model.backward(np.ones_like(out)).shape == x.shape
    model.train(False)
    flat = model.forward(x.reshape(6, 5)).copy()
    np.testing.assert_array_equal(model.forward(x).reshape(6, 4), flat)
