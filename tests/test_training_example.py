"""The mnist example runs offline and learns."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.examples import mnist


def test_mnist_fc_shape():
    model = mnist.mnist_fc(seed=0)
    assert [p.data.shape for p in model.parameters()] == [(784, 500), (500,), (500, 10), (10,)]


def test_mnist_fc_is_initialised_as_ggml():
    """ggml's mnist_model_init_random: every weight and bias of mnist-fc, as of
    mnist-cnn, from N(0, 0.01) (not torch's default U(+-1/sqrt(fan_in)))."""
    model = mnist.mnist_fc(seed=0)
    for p in model.parameters():
        assert abs(p.data.std() - 0.01) < 0.001 and abs(p.data.mean()) < 0.002
    values = np.concatenate([p.data.ravel() for p in model.parameters()])
    assert abs(values.std() - 0.01) < 0.0002
    np.testing.assert_array_equal(values, np.concatenate(
        [p.data.ravel() for p in mnist.mnist_fc(seed=0).parameters()]))


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


def write_idx_problem(directory):
    """MNIST-named IDX files (gzipped, as the mirrors ship them) of a small
    learnable problem: 2000 training and 500 test images of 10 noisy prototypes."""
    from test_idx import idx_bytes, write

    rng = np.random.default_rng(3)
    prototypes = rng.integers(0, 256, (10, 28, 28)).astype(np.uint8)

    def images(n):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        noise = rng.integers(-40, 41, (n, 28, 28))
        return np.clip(prototypes[labels] + noise, 0, 255).astype(np.uint8), labels

    for prefix, n in (("train", 2000), ("t10k", 500)):
        x, y = images(n)
        write(directory / f"{prefix}-images-idx3-ubyte.gz", idx_bytes(x), gz=True)
        write(directory / f"{prefix}-labels-idx1-ubyte.gz", idx_bytes(y), gz=True)


def test_data_dir_of_idx_files_trains_with_ggml_batch_sizes(tmp_path, capsys):
    """--data DIR trained with ggml's 1000/500 batches."""
    write_idx_problem(tmp_path)
    _, acc = mnist.main(["--data", str(tmp_path), "--epochs", "2", "--silent"])
    out = capsys.readouterr().out
    assert "2000 training, 500 test images" in out and "nbatch_logical=1000" in out
    assert acc > 0.9


# ---- mnist-cnn ------------------------------------------------------------------------

def test_mnist_cnn_is_ggmls_architecture_and_initialisation():
    model = mnist.mnist_cnn(seed=0)
    names = [(n, p.data.shape) for n, p in go.nn.named_parameters(model)]
    assert names == [("1.weight", (8, 1, 3, 3)), ("1.bias", (8,)),
                     ("4.weight", (16, 8, 3, 3)), ("4.bias", (16,)),
                     ("8.weight", (784, 10)), ("8.bias", (10,))]
    conv1, pool1, conv2, pool2 = model[1], model[3], model[4], model[6]
    assert conv1.padding == (1, 1) and conv2.padding == (1, 1)
    assert conv1.stride == (1, 1) and pool1.kernel_size == (2, 2) == pool2.kernel_size
    # ggml's mnist_model_init_random: every weight and bias from N(0, 0.01)
    values = np.concatenate([p.data.ravel() for p in model.parameters()])
    assert abs(values.std() - 0.01) < 0.0005 and abs(values.mean()) < 0.0005
    np.testing.assert_array_equal(values, np.concatenate(
        [p.data.ravel() for p in mnist.mnist_cnn(seed=0).parameters()]))
    out = model.forward(np.zeros((3, 784), np.float32))
    assert out.shape == (3, 10) and out.dtype == np.float32


def test_offline_cnn_run_passes_95_percent(capsys):
    """The offline digits with mnist-cnn: ggml's 30 epochs, batches 50/10."""
    pytest.importorskip("sklearn")
    loss, acc = mnist.main(["--model", "cnn", "--silent", "--seed", "0"])
    out = capsys.readouterr().out
    assert "mnist-cnn" in out and "nbatch_logical=50, nbatch_physical=10, 30 epochs" in out
    assert acc > 0.95 and loss < 0.2


def test_data_dir_of_idx_files_trains_the_cnn(tmp_path, capsys):
    write_idx_problem(tmp_path)
    _, acc = mnist.main(["--data", str(tmp_path), "--model", "cnn", "--epochs", "5",
                         "--nbatch-logical", "100", "--nbatch-physical", "50", "--silent"])
    out = capsys.readouterr().out
    assert "mnist-cnn" in out and "nbatch_logical=100, nbatch_physical=50" in out
    assert acc > 0.95


def test_unknown_model_is_refused(capsys):
    with pytest.raises(SystemExit):
        mnist.main(["--model", "rnn"])
    assert "invalid choice" in capsys.readouterr().err
