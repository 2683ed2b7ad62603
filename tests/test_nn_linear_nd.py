"""Linear over any leading axes, its argument checks, and Parameter.data checked
at assignment."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.nn import Linear, Parameter


@pytest.mark.parametrize("lead", [(1,), (7,), (2, 9), (3, 1, 5), (1, 1, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_leading_axes_equal_the_flat_rows(lead, bias):
    rng = np.random.default_rng(len(lead))
    nin, nout = 17, 9
    x = rng.standard_normal((*lead, nin)).astype(np.float32)
    g = rng.standard_normal((*lead, nout)).astype(np.float32)
    nd, flat = Linear(nin, nout, bias, rng=1), Linear(nin, nout, bias, rng=1)
    out = nd.forward(x)
    assert out.shape == (*lead, nout) and out.dtype == np.float32
    np.testing.assert_array_equal(out, flat.forward(x.reshape(-1, nin)).reshape(out.shape))
    # float64 reference
    ref = x.astype(np.float64) @ nd.weight.data + (nd.bias.data if bias else 0)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    gx = nd.backward(g)
    assert gx.shape == x.shape
    np.testing.assert_array_equal(gx, flat.backward(g.reshape(-1, nout)).reshape(x.shape))
    for p, q in zip(nd.parameters(), flat.parameters()):
        np.testing.assert_array_equal(p.grad, q.grad)
    np.testing.assert_allclose(nd.weight.grad, x.reshape(-1, nin).astype(np.float64).T
                               @ g.reshape(-1, nout), rtol=1e-4, atol=1e-4)


def test_linear_keeps_a_contiguous_input_without_a_copy():
    x = np.ones((2, 3, 4), np.float32)
    lin = Linear(4, 5, rng=0)
    out = lin.forward(x)
    assert np.shares_memory(lin._x, x)
    assert lin.forward(x) is out  # the buffer is reused for the same shape


def test_linear_single_row_and_other_dtypes():
    lin = Linear(3, 2, rng=0)
    row = np.array([1.0, -2.0, 0.5])  # float64 (in,) -> (out,)
    out = lin.forward(row)
    assert out.shape == (2,)
    np.testing.assert_allclose(out, row @ lin.weight.data + lin.bias.data, rtol=1e-6)
    gx = lin.backward(np.ones(2))
    assert gx.shape == (3,)
    np.testing.assert_allclose(gx, lin.weight.data.sum(1), rtol=1e-6)
    np.testing.assert_array_equal(lin([[1, 2, 3]]), lin.forward(np.array([[1, 2, 3]], np.float32)))


def test_linear_shape_errors():
    lin = Linear(3, 2, rng=0)
    with pytest.raises(ValueError, match=r"x: expected shape \(batch, 3\), got \(2, 5, 4\) "
                                         r"\(any leading axes: \(\.\.\., 3\)\)"):
        lin.forward(np.ones((2, 5, 4), np.float32))
    with pytest.raises(ValueError, match="x"):
        lin.forward(np.float32(1.0))
    with pytest.raises(TypeError, match="x"):
        lin.forward(np.array([["a", "b", "c"]]))
    lin.forward(np.ones((2, 5, 3), np.float32))
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(2, 5, 2\)"):
        lin.backward(np.ones((10, 2), np.float32))


def test_linear_inside_a_context_on_tokens():
    """A (B, T, D) model inside a Sequential trains through an OptContext."""
    class Tokens(go.nn.Module):
        def __init__(self):
            self.net = go.nn.Sequential(go.nn.Reshape((4, 6)), Linear(6, 8, rng=0),
                                        go.nn.GELU(), Linear(8, 2, rng=1), go.nn.Flatten())

        def forward(self, x):
            return self.net.forward(x)

        def backward(self, g):
            return self.net.backward(g)

    model = Tokens()
    ctx = go.OptContext(model, loss_type=go.LossType.MEAN_SQUARED_ERROR)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 24)).astype(np.float32)
    y = rng.standard_normal((5, 8)).astype(np.float32)
    losses = []
    for _ in range(20):
        ctx.alloc(True)
        ctx.eval(inputs=x, labels=y)
        losses.append(float(ctx.loss))
    assert losses[-1] < losses[0]


# ---- traps: arguments refused where they are given ---------------------------------------

def test_linear_checks_init_and_rng_as_conv2d():
    for cls, args in ((Linear, (3, 2)), (go.nn.Conv2d, (1, 2, 3))):
        with pytest.raises(TypeError, match="init"):
            cls(*args, init="kaiming")
        with pytest.raises(TypeError, match="rng"):
            cls(*args, rng=1.5)
        with pytest.raises(TypeError, match="rng"):
            cls(*args, rng=True)
        with pytest.raises(TypeError, match="rng"):
            cls(*args, rng="seed")
        cls(*args, rng=np.int64(3))
        cls(*args, rng=np.random.default_rng(3))


def test_parameter_data_refuses_a_wrong_shape_or_dtype_at_assignment():
    lin = Linear(4, 3, rng=0)
    torch_layout = np.ones((3, 4), np.float32)  # torch's Linear.weight is (out, in)
    with pytest.raises(ValueError, match=r"expected shape \(4, 3\), got \(3, 4\).*transpose"):
        lin.weight.data = torch_layout
    with pytest.raises(TypeError, match="float32"):
        lin.weight.data = np.ones((4, 3), np.float64)
    with pytest.raises(TypeError, match="ndarray"):
        lin.bias.data = [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="contiguous"):
        lin.weight.data = np.ones((3, 4), np.float32).T
    with pytest.raises(ValueError, match="shape"):
        lin.bias.data = np.ones(4, np.float32)
    assert lin.weight.data.shape == (4, 3) and not (lin.weight.data == 1).all()
    new = np.full((4, 3), 0.5, np.float32)
    lin.weight.data = new
    assert lin.weight.data is new


def test_context_repoints_checked_parameters_at_its_arena():
    lin = Linear(4, 3, rng=0)
    values = lin.weight.data.copy()
    ctx = go.OptContext(lin)
    assert np.shares_memory(lin.weight.data, ctx.arena.flat("weights"))
    assert np.shares_memory(lin.weight.grad, ctx.arena.flat("grads"))
    np.testing.assert_array_equal(lin.weight.data, values)
    p = Parameter(np.zeros(2))
    p.data[...] = 3  # writing values in place is always allowed
    assert (p.data == 3).all()
