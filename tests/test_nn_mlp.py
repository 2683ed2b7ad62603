"""SwiGLU (Llama's MLP) and GPT2MLP against the same blocks written in torch
with the same weights: outputs and every gradient within 1e-5 relative; names,
the layer protocol and bad input."""
import numpy as np
import pytest

import ggmlopt.nn as gnn

F32 = np.float32


def t_linear(torch, lin):
    """A torch.nn.Linear holding lin's weights (ours are (in, out): transposed)."""
    t = torch.nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
    t.weight.data = torch.tensor(lin.weight.data.T.copy())
    if lin.bias is not None:
        t.bias.data = torch.tensor(lin.bias.data.copy())
    return t


def check_linear_grads(lin, t):
    np.testing.assert_allclose(lin.weight.grad, t.weight.grad.numpy().T, rtol=1e-5, atol=1e-5)
    if lin.bias is not None:
        np.testing.assert_allclose(lin.bias.grad, t.bias.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,hidden", [((1, 1, 8), 24), ((2, 7, 33), 65), ((3, 16), 40),
                                          ((2, 9, 64), 172)])
def test_swiglu_matches_torch(rng, shape, hidden):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    dim = shape[-1]
    m = gnn.SwiGLU(dim, hidden, rng=rng)
    gate, up, down = (t_linear(torch, lin) for lin in (m.gate_proj, m.up_proj, m.down_proj))
    x = rng.standard_normal(shape).astype(F32)
    dy = rng.standard_normal(shape).astype(F32)
    tx = torch.tensor(x, requires_grad=True)
    ty = down(F.silu(gate(tx)) * up(tx))
    ty.backward(torch.tensor(dy))
    y = m(x)
    dx = m.backward(dy)
    assert y.shape == shape and dx.shape == shape
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    for lin, t in ((m.gate_proj, gate), (m.up_proj, up), (m.down_proj, down)):
        check_linear_grads(lin, t)


@pytest.mark.parametrize("shape,hidden", [((1, 1, 8), None), ((2, 7, 33), 65), ((3, 16), None)])
def test_gpt2_mlp_matches_torch(rng, shape, hidden):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    dim = shape[-1]
    m = gnn.GPT2MLP(dim, hidden, rng=rng)
    assert m.hidden == (4 * dim if hidden is None else hidden)
    fc, proj = t_linear(torch, m.c_fc), t_linear(torch, m.c_proj)
    x = rng.standard_normal(shape).astype(F32)
    dy = rng.standard_normal(shape).astype(F32)
    tx = torch.tensor(x, requires_grad=True)
    ty = proj(F.gelu(fc(tx), approximate="tanh"))
    ty.backward(torch.tensor(dy))
    y = m(x)
    dx = m.backward(dy)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    check_linear_grads(m.c_fc, fc)
    check_linear_grads(m.c_proj, proj)


def test_names_and_protocol(rng):
    m = gnn.SwiGLU(8, 24, rng=0)
    assert [n for n, _ in m.named_parameters()] == ["gate_proj.weight", "up_proj.weight",
                                                    "down_proj.weight"]
    assert m.gate_proj.weight.shape == (8, 24) and m.down_proj.weight.shape == (24, 8)
    g = gnn.GPT2MLP(8)
    assert [n for n, _ in g.named_parameters()] == ["c_fc.weight", "c_fc.bias",
                                                    "c_proj.weight", "c_proj.bias"]
    for mod in (m, g):
        x = rng.standard_normal((2, 3, 8)).astype(F32)
        dy = rng.standard_normal((2, 3, 8)).astype(F32)
        out = mod.forward(x)
        assert mod(x) is not out
        dx1 = mod.backward(dy).copy()
        grads = [p.grad.copy() for p in mod.parameters()]
        mod.needs_input_grad = False
        assert mod.backward(dy) is None
        for p, g0 in zip(mod.parameters(), grads):
            np.testing.assert_allclose(p.grad, 2 * g0, rtol=1e-5, atol=1e-6)
        mod.needs_input_grad = True
        np.testing.assert_allclose(mod.backward(dy), dx1, rtol=1e-6)


@pytest.mark.parametrize("cls", [gnn.SwiGLU, gnn.GPT2MLP])
def test_bad_input(cls):
    m = cls(8, 16)
    with pytest.raises(RuntimeError, match="forward first"):
        m.backward(np.ones((2, 8), F32))
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., 8\)"):
        m.forward(np.ones((2, 7), F32))
    m.forward(np.ones((2, 3, 8), F32))
    with pytest.raises(ValueError, match="grad_out: expected shape"):
        m.backward(np.ones((6, 8), F32))
    with pytest.raises(TypeError, match="hidden"):
        cls(8, 16.0)
    with pytest.raises(ValueError, match="dim"):
        cls(0, 16)

