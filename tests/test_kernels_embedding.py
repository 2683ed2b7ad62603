"""Embedding kernels (kernels_embedding): the gather is exact; the scatter-add
of gradient rows adds each row's contributions in the order of the ids, so it
equals np.add.at in float32 bit for bit (repeated ids included), on every SIMD
path and thread count; bad ids raise IndexError naming the id and its position
before anything is written."""
import numpy as np
import pytest

from ggmlopt import kernels, kernels_embedding

F32 = np.float32


@pytest.mark.parametrize("dim", [1, 3, 7, 8, 9, 17, 33, 100])
@pytest.mark.parametrize("shape", [(1,), (5,), (4, 7), (2, 3, 5)])
def test_gather_and_scatter_add_are_exact(simd_path, rng, place, shape, dim):
    num = 11
    w = place(rng.standard_normal((num, dim)).astype(F32), 1)
    ids = place(rng.integers(0, num, shape).astype(np.int32), 2)
    out = kernels_embedding.embedding(ids, w)
    assert out.shape == shape + (dim,)
    assert out.tobytes() == w[ids].tobytes()
    grad = place(rng.standard_normal(shape + (dim,)).astype(F32), 3)
    gw = rng.standard_normal((num, dim)).astype(F32)
    want = gw.copy()
    np.add.at(want, ids.reshape(-1), grad.reshape(-1, dim))
    assert kernels_embedding.embedding_backward(ids, grad, gw) is gw
    assert gw.tobytes() == want.tobytes()


def test_special_values_pass_through(rng):
    w = np.array([[np.nan, np.inf, -np.inf, 3e38], [1e-45, -0.0, 1.0, 2.0]], F32)
    ids = np.array([1, 0, 0], np.int32)
    out = kernels_embedding.embedding(ids, w)
    assert out.tobytes() == w[ids].tobytes()
    gw = np.zeros((2, 4), F32)
    grad = np.array([[1, 2, 3, 4], [3e38, 1, 1, 1], [3e38, np.nan, 1, 1]], F32)
    kernels_embedding.embedding_backward(ids, grad, gw)
    want = np.zeros((2, 4), F32)
    with np.errstate(over="ignore"):
        np.add.at(want, ids, grad)
    assert np.array_equal(gw, want, equal_nan=True)
    assert np.isinf(gw[0, 0])


@pytest.mark.parametrize("num", [1, 50, 32000])
def test_threads_give_the_same_bits(restore_threads, rng, num):
    dim = 288
    ids = rng.integers(0, num, (8, 256)).astype(np.int32)
    ids[0, :50] = 0  # many repeats of one id
    grad = rng.standard_normal((8, 256, dim)).astype(F32)
    w = rng.standard_normal((num, dim)).astype(F32)
    results = []
    for t in (1, 2):
        kernels.set_num_threads(t)
        gw = np.ones((num, dim), F32)
        kernels_embedding.embedding_backward(ids, grad, gw)
        results.append((kernels_embedding.embedding(ids, w), gw))
    assert results[0][0].tobytes() == results[1][0].tobytes() == w[ids].tobytes()
    assert results[0][1].tobytes() == results[1][1].tobytes()
    want = np.ones((num, dim), F32)
    np.add.at(want, ids.reshape(-1), grad.reshape(-1, dim))
    assert results[0][1].tobytes() == want.tobytes()


def test_bad_ids_raise_index_error_before_any_work(rng):
    w = rng.standard_normal((10, 4)).astype(F32)
    out = np.full((2, 3, 4), 7, F32)
    ids = np.array([[1, 2, 3], [4, 10, 5]], np.int32)
    with pytest.raises(IndexError, match=r"ids: id 10 at position \(1, 1\).*\[0, 10\)"):
        kernels_embedding.embedding(ids, w, out=out)
    assert np.all(out == 7)
    ids[1, 1] = -1
    gw = np.zeros((10, 4), F32)
    with pytest.raises(IndexError, match=r"id -1 at position \(1, 1\)"):
        kernels_embedding.embedding_backward(ids, out, gw)
    assert np.all(gw == 0)


def test_bad_arrays_are_refused(rng):
    w = rng.standard_normal((10, 4)).astype(F32)
    ids = np.array([1, 2], np.int32)
    with pytest.raises(TypeError, match="ids: expected dtype int32"):
        kernels_embedding.embedding(ids.astype(np.int64), w)
    with pytest.raises(TypeError, match="ids: expected dtype int32"):
        kernels_embedding.embedding(ids.astype(F32), w)
    with pytest.raises(TypeError, match="weight: expected dtype float32"):
        kernels_embedding.embedding(ids, w.astype(np.float64))
    with pytest.raises(ValueError, match="weight: expected shape"):
        kernels_embedding.embedding(ids, w.reshape(-1))
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 4\)"):
        kernels_embedding.embedding(ids, w, out=np.empty((2, 5), F32))
    with pytest.raises(ValueError, match=r"grad: expected shape \(2, 4\)"):
        kernels_embedding.embedding_backward(ids, np.ones((3, 4), F32), np.zeros_like(w))
    with pytest.raises(ValueError, match="overlap"):
        kernels_embedding.embedding_backward(ids, w[:2], w)
    ro = np.zeros_like(w)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kernels_embedding.embedding_backward(ids, np.ones((2, 4), F32), ro)


def test_matches_torch(rng):
    torch = pytest.importorskip("torch")
    w = rng.standard_normal((37, 19)).astype(F32)
    ids = rng.integers(0, 37, (5, 13)).astype(np.int32)
    grad = rng.standard_normal((5, 13, 19)).astype(F32)
    tw = torch.tensor(w, requires_grad=True)
    ty = torch.nn.functional.embedding(torch.tensor(ids, dtype=torch.long), tw)
    ty.backward(torch.tensor(grad))
    np.testing.assert_array_equal(kernels_embedding.embedding(ids, w), ty.detach().numpy())
    gw = np.zeros_like(w)
    kernels_embedding.embedding_backward(ids, grad, gw)
    np.testing.assert_allclose(gw, tw.grad.numpy(), rtol=1e-6, atol=1e-6)
