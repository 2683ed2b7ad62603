"""Reshape and Flatten: shapes as Keras' Reshape and torch's nn.Flatten, views of
contiguous inputs, gradients reshaped back, clear errors."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.nn import Flatten, Linear, Reshape, Sequential


@pytest.mark.parametrize("shape,batch,n,want", [
    ((1, 28, 28), 5, 784, (5, 1, 28, 28)),
    ((-1,), 3, 7, (3, 7)),
    ((2, -1), 1, 6, (1, 2, 3)),
    ((3, 1, -1, 1), 2, 15, (2, 3, 1, 5, 1)),
    (4, 2, 4, (2, 4)),
])
def test_reshape_forward_is_a_view_with_the_keras_shape(shape, batch, n, want):
    layer = Reshape(shape)
    x = np.arange(batch * n, dtype=np.float32).reshape(batch, n)
    out = layer.forward(x)
    assert out.shape == want and out.dtype == np.float32
    assert np.shares_memory(out, x)
    np.testing.assert_array_equal(out.ravel(), x.ravel())


def test_reshape_backward_gives_the_gradient_the_input_shape():
    layer = Reshape((2, 3))
    layer.needs_input_grad = True
    x = np.zeros((4, 6), np.float32)
    layer.forward(x)
    g = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    gi = layer.backward(g)
    assert gi.shape == (4, 6)
    np.testing.assert_array_equal(gi, g.reshape(4, 6))
    layer.needs_input_grad = False
    assert layer.backward(g) is None


@pytest.mark.parametrize("bad,err,match", [
    ((2, 0), ValueError, "sizes >= 1 and at most one -1"),
    ((-1, -1), ValueError, "sizes >= 1 and at most one -1"),
    ((-2,), ValueError, "sizes >= 1"),
    ((), ValueError, "at least one dimension"),
    ((2.0, 3), TypeError, r"shape\[0\]: expected an int"),
    ((True,), TypeError, r"shape\[0\]: expected an int"),
    ("28", TypeError, "shape: expected a tuple of ints"),
])
def test_reshape_bad_shape(bad, err, match):
    with pytest.raises(err, match=match):
        Reshape(bad)


def test_reshape_size_mismatch_and_bad_input():
    with pytest.raises(ValueError, match=r"x: datapoints of shape \(10,\) \(10 elements\) "
                                         r"cannot be reshaped to \(1, 28, 28\)"):
        Reshape((1, 28, 28)).forward(np.zeros((2, 10), np.float32))
    with pytest.raises(ValueError, match="cannot be reshaped"):
        Reshape((4, -1)).forward(np.zeros((2, 10), np.float32))
    with pytest.raises(TypeError, match="x: expected real numbers"):
        Reshape((1,)).forward(np.array([["a"]]))
    with pytest.raises(ValueError, match="x: expected an array with a batch dimension"):
        Reshape((1,)).forward(np.float32(3))
    layer = Reshape((2, 2))
    with pytest.raises(RuntimeError, match="backward: call forward first"):
        layer.backward(np.zeros((1, 2, 2), np.float32))
    layer.forward(np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(3, 2, 2\)"):
        layer.backward(np.zeros((3, 4), np.float32))


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 1), (3, 7), (2, 1, 3)])
@pytest.mark.parametrize("dims", [(1, -1), (1, 2), (2, -1), (2, 3), (1, 1)])
def test_flatten_matches_torch(shape, dims):
    start, end = dims
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    ndim = len(shape)
    end_abs = end + ndim if end < 0 else end
    layer = Flatten(start, end)
    if not start <= end_abs < ndim:
        with pytest.raises(ValueError, match="x: cannot flatten dimensions"):
            layer.forward(x)
        return
    # torch.flatten(x, start, end): the dimensions start..end merged into one
    want = x.reshape(shape[:start] + (-1,) + shape[end_abs + 1:])
    out = layer.forward(x)
    assert out.shape == want.shape and np.shares_memory(out, x)
    np.testing.assert_array_equal(out, want)
    layer.needs_input_grad = True
    g = np.random.default_rng(1).standard_normal(want.shape).astype(np.float32)
    np.testing.assert_array_equal(layer.backward(g), g.reshape(shape))


@pytest.mark.parametrize("args,err,match", [
    ((0,), ValueError, "start_dim: expected >= 1"),
    ((2, 1), ValueError, "end_dim: expected -1, or a dimension >= start_dim=2"),
    ((1, 0), ValueError, "end_dim"),
    ((1.0,), TypeError, "start_dim: expected an int"),
    ((1, None), TypeError, "end_dim: expected an int"),
])
def test_flatten_bad_dims(args, err, match):
    with pytest.raises(err, match=match):
        Flatten(*args)


def test_non_contiguous_and_non_float32_inputs():
    x = np.arange(24, dtype=np.float64).reshape(4, 6)
    out = Reshape((3, 2)).forward(x)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, x.reshape(4, 3, 2))
    xt = np.arange(24, dtype=np.float32).reshape(6, 4).T   # (4, 6), not contiguous
    out = Flatten().forward(xt.reshape(4, 2, 3))
    np.testing.assert_array_equal(out, np.ascontiguousarray(xt))


def test_image_model_gradients_match_float64_reference():
    """Reshape -> Flatten around a Linear: the input gradient and weight gradient
    are those of the Linear alone on the flat data."""
    rng = np.random.default_rng(2)
    batch, c, h, w, nout = 3, 2, 3, 5, 4
    model = Sequential(Reshape((c, h, w)), Flatten(), Linear(c * h * w, nout, rng=0))
    model.needs_input_grad = True
    x = rng.standard_normal((batch, c * h * w)).astype(np.float32)
    g = rng.standard_normal((batch, nout)).astype(np.float32)
    out = model.forward(x)
    lin = model[2]
    np.testing.assert_allclose(out, x.astype(np.float64) @ lin.weight.data + lin.bias.data,
                               rtol=1e-5, atol=1e-6)
    gx = model.backward(g)
    assert gx.shape == x.shape
    np.testing.assert_allclose(gx, g.astype(np.float64) @ lin.weight.data.T.astype(np.float64),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lin.weight.grad, x.T.astype(np.float64) @ g, rtol=1e-5,
                               atol=1e-6)


def test_training_through_reshape_equals_training_without_it():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((20, 12)).astype(np.float32)
    y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, 20)]
    ds_a = go.Dataset.from_arrays(x, y)
    ds_b = go.Dataset.from_arrays(x, y)
    shaped = Sequential(Reshape((3, 2, 2)), Flatten(), Linear(12, 3, rng=5))
    flat = Sequential(Linear(12, 3, rng=5))
    for model, ds in ((shaped, ds_a), (flat, ds_b)):
        go.fit(model, ds, go.LossType.CROSS_ENTROPY, nepoch=3, nbatch_logical=5, silent=True,
               seed=1)
    for a, b in zip(shaped.parameters(), flat.parameters()):
        np.testing.assert_array_equal(a.data, b.data)
