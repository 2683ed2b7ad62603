"""nn layers: gradients against float64 numerical derivatives, buffers, init."""
import numpy as np
import pytest

import ggmlopt as go


def numeric_grad(f, arr, eps=1e-3):
    """Central differences of the float64 scalar f() w.r.t. each element of arr."""
    g = np.zeros(arr.shape, dtype=np.float64)
    it = np.nditer(arr, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = arr[i]
        arr[i] = old + eps
        fp = f()
        arr[i] = old - eps
        fm = f()
        arr[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


@pytest.mark.parametrize("batch,nin,nout", [(1, 1, 1), (3, 7, 2), (9, 17, 5)])
def test_linear_relu_gradients_match_numerical(batch, nin, nout):
    rng = np.random.default_rng(batch)
    model = go.nn.Sequential(go.nn.Linear(nin, 8, rng=1), go.nn.ReLU(),
                             go.nn.Linear(8, nout, rng=2))
    model.needs_input_grad = True
    x = rng.standard_normal((batch, nin)).astype(np.float32)
    c = rng.standard_normal((batch, nout))  # loss = sum(c * out)

    def loss64():
        # float64 reference of the same function
        l1, l2 = model[0], model[2]
        h = np.maximum(x.astype(np.float64) @ l1.weight.data + l1.bias.data, 0)
        return float(np.sum(c * (h @ l2.weight.data + l2.bias.data)))

    model.forward(x)
    gx = model.backward(c.astype(np.float32))
    for p in model.parameters():
        num = numeric_grad(loss64, p.data)
        np.testing.assert_allclose(p.grad, num, rtol=2e-2, atol=2e-3)
    num_x = numeric_grad(loss64, x)
    np.testing.assert_allclose(gx, num_x, rtol=2e-2, atol=2e-3)


def test_backward_adds_into_grad_unless_flagged_zero():
    lin = go.nn.Linear(3, 2, rng=0)
    x = np.ones((4, 3), np.float32)
    g = np.ones((4, 2), np.float32)
    lin.forward(x)
    lin.backward(g)  # grad_is_zero starts True: written
    first = lin.weight.grad.copy()
    assert not lin.weight.grad_is_zero
    np.testing.assert_allclose(first, x.T @ g)
    lin.forward(x)
    lin.backward(g)  # now added
    np.testing.assert_allclose(lin.weight.grad, 2 * first)
    np.testing.assert_allclose(lin.bias.grad, 2 * g.sum(0))


def test_first_layer_skips_input_gradient_and_buffers_are_reused():
    model = go.nn.Sequential(go.nn.Linear(4, 3, rng=0), go.nn.ReLU(), go.nn.Linear(3, 2, rng=1))
    x = np.ones((5, 4), np.float32)
    out1 = model.forward(x)
    assert model.backward(np.ones((5, 2), np.float32)) is None
    out2 = model.forward(x)
    assert out1 is out2  # the same preallocated buffer
    assert model[2].needs_input_grad and not model[0].needs_input_grad


def test_linear_init_reproducible_and_bounded():
    a, b = go.nn.Linear(100, 50, rng=3), go.nn.Linear(100, 50, rng=3)
    np.testing.assert_array_equal(a.weight.data, b.weight.data)
    assert a.weight.data.shape == (100, 50) and a.weight.data.dtype == np.float32
    assert np.abs(a.weight.data).max() <= 0.1 and np.abs(a.bias.data).max() <= 0.1
    assert np.abs(a.weight.data).max() > 0.09
    c = go.nn.Linear(100, 50, rng=4)
    assert not np.array_equal(a.weight.data, c.weight.data)


def test_linear_init_hook():
    def init(w, b, rng):
        w[...] = 2.0
        b[...] = -1.0
    lin = go.nn.Linear(2, 3, init=init)
    assert (lin.weight.data == 2).all() and (lin.bias.data == -1).all()
    out = lin.forward(np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(out, [[3, 3, 3]])


def test_parameter_copies_as_float32():
    src = np.arange(4.0)
    p = go.nn.Parameter(src)
    src[0] = 9
    assert p.data.dtype == np.float32 and p.data[0] == 0 and p.grad.shape == (4,)
    with pytest.raises(TypeError):
        go.nn.Parameter(np.array(["a"]))


def test_bad_layer_arguments():
    with pytest.raises(ValueError):
        go.nn.Linear(0, 3)
    with pytest.raises(TypeError):
        go.nn.Linear(2.5, 3)
    lin = go.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="x"):
        lin.forward(np.ones((2, 4), np.float32))
    with pytest.raises(RuntimeError):
        go.nn.Linear(3, 2).backward(np.ones((2, 2), np.float32))
    with pytest.raises(ValueError):
        go.nn.Sequential()
    with pytest.raises(TypeError):
        go.nn.Sequential(object())
