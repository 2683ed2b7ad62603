"""The mnist example runs offline and learns."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.examples import mnist


def test_mnist_fc_shape():
    model = mnist.mnist_fc(seed=0)
    assert [p.data.shape for p in model.parameters()] == [(784, 500), (500,), (500, 10), (10,)]


def test_offline_run_learns(capsys):
    pytest.importorskip("sklearn")
    loss, acc = mnist.main(["--epochs", "2", "--silent", "--seed", "1"])
    out = capsys.readouterr().out
    assert "8x8 digits" in out and "mnist: test_acc=" in out
    assert acc > 0.85 and loss < 0.6


def test_synthetic_fallback_is_labelled_and_learnable():
    train, test = mnist.synthetic(0)
    assert train.ndata % 100 == 0 and train.data.shape[1] == 784
    model = mnist.mnist_fc(0)
    go.fit(model, train, go.LossType.CROSS_ENTROPY, nepoch=1, nbatch_logical=100,
           nbatch_physical=50, silent=True)
    result = mnist.evaluate(model, test, 50)
    assert result.ndata == test.ndata and result.accuracy()[0] > 0.5
    np.testing.assert_array_equal(result.pred().shape, (test.ndata,))
