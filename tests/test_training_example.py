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


def test_data_dir_of_idx_files_trains_with_ggml_batch_sizes(tmp_path, capsys):
    """--data DIR: MNIST-named IDX files (gzipped, as the mirrors ship them) of a
    small learnable problem, trained with ggml's 1000/500 batches."""
    from test_idx import idx_bytes, write

    rng = np.random.default_rng(3)
    prototypes = rng.integers(0, 256, (10, 28, 28)).astype(np.uint8)

    def images(n):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        noise = rng.integers(-40, 41, (n, 28, 28))
        return np.clip(prototypes[labels] + noise, 0, 255).astype(np.uint8), labels

    for prefix, n in (("train", 2000), ("t10k", 500)):
        x, y = images(n)
        write(tmp_path / f"{prefix}-images-idx3-ubyte.gz", idx_bytes(x), gz=True)
        write(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", idx_bytes(y), gz=True)
    _, acc = mnist.main(["--data", str(tmp_path), "--epochs", "2", "--silent"])
    out = capsys.readouterr().out
    assert "2000 training, 500 test images" in out and "nbatch_logical=1000" in out
    assert acc > 0.9
