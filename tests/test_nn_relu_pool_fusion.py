"""A ReLU directly followed by a MaxPool2d inside a Sequential runs as one pass
(MaxPool2d.forward_relu); outputs and every gradient must equal those of the
layers run one after the other, ties, zeros, negatives and NaN included."""
import numpy as np
import pytest

from ggmlopt.nn import Conv2d, Flatten, Linear, MaxPool2d, ReLU, Sequential

F32 = np.float32


def _layers(seed=0):
    return [Conv2d(2, 3, 3, padding=1, rng=seed), ReLU(), MaxPool2d(2),
            Conv2d(3, 5, 3, padding=1, rng=seed + 1), ReLU(), MaxPool2d(2),
            Flatten(), Linear(5 * 2 * 2, 4, rng=seed + 2)]


def _run_separately(layers, x, g):
    """forward and backward layer by layer, no fusion; the input gradient too."""
    for i, layer in enumerate(layers):
        layer.needs_input_grad = True
    for layer in layers:
        x = layer.forward(x)
    out = x.copy()
    for layer in reversed(layers):
        g = layer.backward(g)
    return out, g.copy(), [p.grad.copy() for layer in layers for p in layer.parameters()]


def _awkward_input(rng, shape):
    """Integers (ties and exact zeros), negatives, a -0 and a NaN."""
    x = rng.integers(-2, 3, shape).astype(F32)
    x.reshape(-1)[::5] = -0.0
    return x


@pytest.mark.parametrize("kind", ["normal", "ties", "nan"])
def test_sequential_fusion_equals_layers_run_separately(simd_path, rng, kind):
    shape = (3, 2, 8, 9)  # 9: the last column is dropped by both pools
    x = rng.standard_normal(shape).astype(F32) if kind == "normal" else _awkward_input(rng,
                                                                                       shape)
    if kind == "nan":
        x[1, 0, 3, 4] = np.nan
    g = rng.standard_normal((3, 4)).astype(F32)

    fused_layers = _layers()
    model = Sequential(fused_layers)
    model.needs_input_grad = True
    for p in model.parameters():
        p.grad[...] = 0
        p.grad_is_zero = True
    out = model.forward(x).copy()
    dx = model.backward(g).copy()
    assert model._fused == {2: 0, 5: 3}  # Conv2d, ReLU, MaxPool2d twice
    assert fused_layers[2]._relu and fused_layers[5]._relu
    grads = [p.grad.copy() for p in model.parameters()]

    layers = _layers()
    for p in Sequential(layers).parameters():
        p.grad[...] = 0
        p.grad_is_zero = True
    want_out, want_dx, want_grads = _run_separately(layers, x, g)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(dx, want_dx)
    np.testing.assert_array_equal(np.signbit(dx), np.signbit(want_dx))
    for a, b in zip(grads, want_grads):
        np.testing.assert_array_equal(a, b)
    if kind == "nan":  # the NaN reaches image 1's outputs, and only those
        assert np.isnan(out[1]).all() and not np.isnan(out[[0, 2]]).any()


def test_relu_subclass_is_not_fused(rng):
    class MyReLU(ReLU):
        pass

    pool = MaxPool2d(2)
    model = Sequential(MyReLU(), pool)
    model.forward(rng.standard_normal((1, 1, 4, 4)).astype(F32))
    assert model._fused == {} and not pool._relu


def test_fused_pair_first_in_a_model_returns_no_input_gradient(rng):
    """A top-level model does not differentiate w.r.t. its data: a fused ReLU in
    first place gives None, as the ReLU itself would."""
    model = Sequential(ReLU(), MaxPool2d(2), Flatten())
    x = rng.standard_normal((2, 1, 4, 4)).astype(F32)
    y = model.forward(x)
    np.testing.assert_array_equal(y, np.maximum(x, 0).reshape(2, 1, 2, 2, 2, 2)
                                  .max(axis=(3, 5)).reshape(2, 4))
    assert model.backward(np.ones((2, 4), F32)) is None
    with pytest.raises(ValueError, match="grad_out: expected shape"):
        model.backward(np.ones((2, 5), F32))


def test_layers_stay_usable_alone_after_a_fused_run(rng):
    relu, pool = ReLU(), MaxPool2d(2)
    x = rng.standard_normal((2, 3, 6, 6)).astype(F32)
    fused = Sequential(relu, pool)
    fused.needs_input_grad = True
    y_fused = fused.forward(x).copy()
    # the same pool alone: plain max pooling again, its backward the pool's own
    y = pool.forward(x)
    assert not pool._relu
    np.testing.assert_array_equal(y, x.reshape(2, 3, 3, 2, 3, 2).max(axis=(3, 5)))
    g = np.ones(y.shape, F32)
    dx = pool.backward(g)
    assert dx.sum() == g.size  # every window's gradient, negative maxima included
    np.testing.assert_array_equal(y_fused, np.maximum(y, 0))


def test_relu_pool_pair_after_an_im2col_convolution(rng):
    """A Conv2d on im2col (stride 2) is not fused: only its ReLU and pool are,
    with the gradients of the layers run separately."""
    layers = [Conv2d(2, 3, 3, stride=2, padding=1, rng=0), ReLU(), MaxPool2d(2)]
    model = Sequential(layers)
    model.needs_input_grad = True
    x = _awkward_input(rng, (2, 2, 9, 8))
    y = model.forward(x).copy()
    assert model._fused == {2: 1}
    g = rng.standard_normal(y.shape).astype(F32)
    dx = model.backward(g).copy()
    grads = [p.grad.copy() for p in model.parameters()]
    ref = [Conv2d(2, 3, 3, stride=2, padding=1, rng=0), ReLU(), MaxPool2d(2)]
    want_y, want_dx, want_grads = _run_separately(ref, x, g)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(dx, want_dx)
    for a, b in zip(grads, want_grads):
        np.testing.assert_array_equal(a, b)


def test_fused_conv_relu_pool_bad_input_leaves_state(rng):
    model = Sequential(Conv2d(1, 2, 3, padding=1, rng=0), ReLU(), MaxPool2d(4))
    with pytest.raises(ValueError, match="expected 1 channels"):
        model.forward(np.zeros((1, 2, 8, 8), F32))
    with pytest.raises(ValueError, match="smaller than the window"):
        model.forward(np.zeros((1, 1, 3, 3), F32))
    x = rng.standard_normal((1, 1, 8, 8)).astype(F32)
    y = model.forward(x).copy()
    assert y.shape == (1, 2, 2, 2)
    g = np.ones((1, 2, 2, 2), F32)
    model.backward(g)
    want = [p.grad.copy() for p in model.parameters()]
    for p in model.parameters():
        p.grad_is_zero = True
    with pytest.raises(ValueError, match="smaller than the window"):
        model.forward(np.zeros((1, 1, 3, 3), F32))
    with pytest.raises(ValueError, match="grad_out: expected shape"):
        model.backward(np.ones((1, 2, 4, 4), F32))
    model.backward(g)  # still the last good forward's
    for p, w in zip(model.parameters(), want):
        np.testing.assert_array_equal(p.grad, w)
