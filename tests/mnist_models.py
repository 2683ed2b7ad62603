"""ggml's two MNIST models built from ggmlopt.nn for the exporter tests (and their
torch equivalents).  Reshape/Flatten come from ggmlopt.nn when it has them, else
from the minimal stand-ins here."""
import numpy as np
import pytest

from ggmlopt import nn


class _Reshape(nn.Module):
    def __init__(self, shape):
        self.shape = tuple(shape)

    def forward(self, x):
        self._in = x.shape
        return np.ascontiguousarray(x, dtype=np.float32).reshape(x.shape[0], *self.shape)

    def backward(self, g):
        return g.reshape(self._in)


class _Flatten(nn.Module):
    def forward(self, x):
        self._in = x.shape
        return np.ascontiguousarray(x).reshape(x.shape[0], -1)

    def backward(self, g):
        return g.reshape(self._in)


Reshape = getattr(nn, "Reshape", _Reshape)
Flatten = getattr(nn, "Flatten", _Flatten)


def mnist_fc(seed):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(784, 500, rng=rng), nn.ReLU(), nn.Linear(500, 10, rng=rng))


def mnist_cnn(seed):
    """conv 3x3 1->8 pad 1, ReLU, maxpool 2; conv 3x3 8->16 pad 1, ReLU, maxpool 2;
    flatten (NCHW); dense 784 -> 10, on flat (batch, 784) datapoints."""
    conv2d = getattr(nn, "Conv2d", None)
    if conv2d is None:
        pytest.skip("ggmlopt.nn has no Conv2d yet")
    rng = np.random.default_rng(seed)
    return nn.Sequential(
        Reshape((1, 28, 28)),
        conv2d(1, 8, 3, padding=1, rng=rng), nn.ReLU(), nn.MaxPool2d(2),
        conv2d(8, 16, 3, padding=1, rng=rng), nn.ReLU(), nn.MaxPool2d(2),
        Flatten(),
        nn.Linear(784, 10, rng=rng))


def cnn_features(model, x):
    """The pooled (batch, 16, 7, 7) feature map before the dense layer."""
    h = x
    for layer in model.layers[:-2]:
        h = layer.forward(h)
    return np.array(h)


def torch_mnist_cnn():
    torch = pytest.importorskip("torch")
    tn = torch.nn
    return tn.Sequential(tn.Unflatten(1, (1, 28, 28)),
                         tn.Conv2d(1, 8, 3, padding=1), tn.ReLU(), tn.MaxPool2d(2),
                         tn.Conv2d(8, 16, 3, padding=1), tn.ReLU(), tn.MaxPool2d(2),
                         tn.Flatten(), tn.Linear(784, 10))
