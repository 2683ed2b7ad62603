"""The Embedding layer: torch.nn.Embedding as the oracle, ids of any integer
dtype and shape, repeated ids, IndexError naming a bad id and its position
before any work, the layer protocol."""
import numpy as np
import pytest
from frozen_params import freeze

import ggmlopt.nn as gnn

F32 = np.float32


def test_default_init_is_standard_normal():
    layer = gnn.Embedding(1000, 64, rng=0)
    w = layer.weight.data
    assert w.shape == (1000, 64) and w.dtype == F32
    assert abs(w.mean()) < 0.02 and abs(w.std() - 1.0) < 0.02
    np.testing.assert_array_equal(gnn.Embedding(1000, 64, rng=0).weight.data, w)
    custom = gnn.Embedding(5, 3, init=lambda w, b, rng: w.fill(0.5))
    assert np.all(custom.weight.data == 0.5)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.int16])
@pytest.mark.parametrize("shape", [(7,), (2, 9), (2, 3, 4), ()])
def test_matches_torch(rng, dtype, shape):
    torch = pytest.importorskip("torch")
    layer = gnn.Embedding(50, 17, rng=rng)
    t = torch.nn.Embedding(50, 17)
    t.weight.data = torch.tensor(layer.weight.data.copy())
    ids = rng.integers(0, 50, shape).astype(dtype)
    if ids.size > 3:
        ids.reshape(-1)[:3] = 4  # repeated ids
    y = layer(ids)
    ty = t(torch.tensor(ids.astype(np.int64)))
    np.testing.assert_array_equal(y, ty.detach().numpy())
    dy = rng.standard_normal(shape + (17,)).astype(F32)
    ty.backward(torch.tensor(dy))
    assert layer.backward(dy) is None
    np.testing.assert_allclose(layer.weight.grad, t.weight.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_gradients_add_up_and_ids_are_copied(rng):
    layer = gnn.Embedding(10, 4, rng=rng)
    ids = np.array([[1, 2, 1]], np.int64)
    out = layer.forward(ids)
    assert out is layer.forward(ids)
    ids[0, 0] = 9  # the caller reuses its array before backward
    dy = np.ones((1, 3, 4), F32)
    layer.backward(dy)
    layer.backward(dy)
    want = np.zeros((10, 4), F32)
    want[1] = 4
    want[2] = 2
    np.testing.assert_array_equal(layer.weight.grad, want)
    assert not layer.weight.grad_is_zero


def test_bad_ids(rng):
    layer = gnn.Embedding(10, 4, rng=rng)
    with pytest.raises(TypeError, match="ids: expected integer"):
        layer.forward(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="ids: expected integer"):
        layer.forward(np.array([True]))
    with pytest.raises(IndexError, match=r"ids: id 10 at position \(1, 0\).*\[0, 10\)"):
        layer.forward(np.array([[0, 1], [10, 2]]))
    with pytest.raises(IndexError, match=r"id -3 at position \(2,\)"):
        layer.forward(np.array([0, 1, -3]))
    with pytest.raises(IndexError, match=r"id 4294967296 at position \(0,\)"):
        layer.forward(np.array([2 ** 32], np.int64))  # would wrap to 0 in int32
    with pytest.raises(RuntimeError, match="forward first"):
        layer.backward(np.ones((3, 4), F32))
    layer.forward(np.array([1, 2]))
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(2, 4\)"):
        layer.backward(np.ones((3, 4), F32))
    assert np.all(layer.weight.grad == 0)
    with pytest.raises(TypeError, match="num_embeddings"):
        gnn.Embedding(10.0, 4)
    with pytest.raises(ValueError, match="embedding_dim"):
        gnn.Embedding(10, 0)


def test_frozen_weight_gets_no_gradient(rng):
    layer = gnn.Embedding(10, 4, rng=rng)
    freeze(layer, "weight")
    layer.forward(np.array([1, 2]))
    layer.backward(np.ones((2, 4), F32))
    assert layer.weight.grad is None  # frozen: no gradient (torch's .grad of such a tensor)
