"""RMSNorm and LayerNorm layers: torch.nn.RMSNorm / LayerNorm as the oracle
(outputs and every gradient within 1e-5 relative), the layer protocol (reused
buffers, gradients added, frozen parameters, needs_input_grad) and bad input."""
import numpy as np
import pytest
from frozen_params import freeze

import ggmlopt.nn as gnn

F32 = np.float32


def torch_pair(layer, rng):
    """(ggmlopt layer, torch layer) with the same random weights."""
    torch = pytest.importorskip("torch")
    dim = layer.dim
    layer.weight.data[...] = rng.uniform(0.5, 1.5, dim)
    if isinstance(layer, gnn.RMSNorm):
        t = torch.nn.RMSNorm(dim, eps=layer.eps)
    else:
        t = torch.nn.LayerNorm(dim, eps=layer.eps, bias=layer.bias is not None)
        if layer.bias is not None:
            layer.bias.data[...] = rng.standard_normal(dim)
            t.bias.data = torch.tensor(layer.bias.data.copy())
    t.weight.data = torch.tensor(layer.weight.data.copy())
    return t


@pytest.mark.parametrize("make", [lambda d: gnn.RMSNorm(d), lambda d: gnn.RMSNorm(d, eps=1e-5),
                                  lambda d: gnn.LayerNorm(d),
                                  lambda d: gnn.LayerNorm(d, bias=False)],
                         ids=["rms", "rms-eps1e-5", "layer", "layer-nobias"])
@pytest.mark.parametrize("shape", [(1, 1, 7), (2, 7, 33), (3, 64), (2, 5, 288)])
def test_matches_torch(rng, make, shape):
    torch = pytest.importorskip("torch")
    layer = make(shape[-1])
    t = torch_pair(layer, rng)
    x = (rng.standard_normal(shape) * 2 + 0.3).astype(F32)
    dy = rng.standard_normal(shape).astype(F32)
    tx = torch.tensor(x, requires_grad=True)
    ty = t(tx)
    ty.backward(torch.tensor(dy))
    y = layer(x)
    dx = layer.backward(dy)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.weight.grad, t.weight.grad.numpy(), rtol=1e-5, atol=1e-5)
    if getattr(layer, "bias", None) is not None:
        np.testing.assert_allclose(layer.bias.grad, t.bias.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [gnn.RMSNorm, gnn.LayerNorm])
def test_layer_protocol(rng, cls):
    layer = cls(9)
    assert [n for n, _ in layer.named_parameters()] == (
        ["weight"] if cls is gnn.RMSNorm else ["weight", "bias"])
    assert np.all(layer.weight.data == 1)
    x = rng.standard_normal((4, 9)).astype(F32)
    dy = rng.standard_normal((4, 9)).astype(F32)
    out = layer.forward(x)
    copy = layer(x)
    assert out is layer.forward(x) and copy is not out
    np.testing.assert_array_equal(copy, out)
    dx1 = layer.backward(dy).copy()
    assert not layer.weight.grad_is_zero
    g1 = layer.weight.grad.copy()
    dx2 = layer.backward(dy)
    np.testing.assert_array_equal(dx1, dx2)
    np.testing.assert_allclose(layer.weight.grad, 2 * g1, rtol=1e-6)  # added, not overwritten
    # float64 and int inputs are converted
    np.testing.assert_allclose(layer(x.astype(np.float64)), copy, rtol=1e-6)
    layer.needs_input_grad = False
    assert layer.backward(dy) is None
    np.testing.assert_allclose(layer.weight.grad, 3 * g1, rtol=1e-6)


@pytest.mark.parametrize("cls", [gnn.RMSNorm, gnn.LayerNorm])
def test_frozen_parameters_get_no_gradient(rng, cls):
    layer = cls(9)
    for name, _ in list(layer.named_parameters()):
        freeze(layer, name)
    x = rng.standard_normal((4, 9)).astype(F32)
    layer.forward(x)
    dx = layer.backward(np.ones((4, 9), F32))
    assert dx is not None
    for p in layer.parameters():
        assert p.grad is None  # frozen: no gradient (torch's .grad of such a tensor)


@pytest.mark.parametrize("cls", [gnn.RMSNorm, gnn.LayerNorm])
def test_bad_input(rng, cls):
    with pytest.raises(TypeError, match="dim"):
        cls(9.0)
    with pytest.raises(ValueError, match="dim"):
        cls(0)
    with pytest.raises(ValueError, match="eps"):
        cls(9, eps=-1)
    with pytest.raises(TypeError, match="eps"):
        cls(9, eps="small")
    layer = cls(9)
    with pytest.raises(RuntimeError, match="forward first"):
        layer.backward(np.ones((2, 9), F32))
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., 9\)"):
        layer.forward(np.ones((2, 8), F32))
    with pytest.raises(TypeError, match="x: expected real numbers"):
        layer.forward(np.array([["a"] * 9]))
    layer.forward(np.ones((2, 9), F32))
    g0 = layer.weight.grad.copy()
    with pytest.raises(ValueError, match="grad_out: expected shape"):
        layer.backward(np.ones((3, 9), F32))
    np.testing.assert_array_equal(layer.weight.grad, g0)
    with pytest.raises(TypeError, match="bias"):
        gnn.LayerNorm(9, bias="yes")


def test_layernorm_frozen_weight_trainable_bias(rng):
    layer = gnn.LayerNorm(9)
    freeze(layer, "weight")
    x = rng.standard_normal((4, 9)).astype(F32)
    dy = rng.standard_normal((4, 9)).astype(F32)
    layer.forward(x)
    layer.backward(dy)
    assert layer.weight.grad is None   # frozen: no gradient, as torch's .grad
    np.testing.assert_allclose(layer.bias.grad, dy.sum(0), rtol=1e-6, atol=1e-6)
