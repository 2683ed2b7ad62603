"""The mnist example's --save (ggml's GGUF), --load and --plot."""
import numpy as np
import pytest

from ggmlopt.examples import mnist

gguf = pytest.importorskip("gguf")


def test_save_plot_then_load_gives_the_same_test_numbers(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    model_path, png = tmp_path / "model.gguf", tmp_path / "curves.png"
    trained = mnist.main(["--epochs", "1", "--silent", "--save", str(model_path),
                          "--plot", str(png)])
    out = capsys.readouterr().out
    assert f"saved the model to {model_path} (mnist-fc, float32 weights)" in out
    reader = gguf.GGUFReader(model_path)
    assert reader.fields["general.architecture"].contents() == "mnist-fc"
    assert [t.name for t in reader.tensors] == ["fc1.weight", "fc1.bias", "fc2.weight",
                                                "fc2.bias"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # same seed, so the same test split; the untrained model of that seed would give
    # other numbers: they match only when the weights came from the file
    loaded = mnist.main(["--load", str(model_path)])
    assert "loaded mnist-fc weights" in capsys.readouterr().out
    np.testing.assert_allclose(loaded, trained, rtol=1e-6)


def test_save_f16(tmp_path):
    path = tmp_path / "m16.gguf"
    mnist.main(["--epochs", "1", "--silent", "--save", str(path), "--save-f16"])
    types = [t.tensor_type for t in gguf.GGUFReader(path).tensors]
    f16, f32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
    assert types == [f16, f32, f16, f32]


@pytest.mark.parametrize("argv", [["--load", "m.gguf", "--save", "x.gguf"],
                                  ["--load", "m.gguf", "--plot", "x.png"],
                                  ["--save-f16"]])
def test_conflicting_arguments(argv, capsys):
    with pytest.raises(SystemExit):
        mnist.main(argv)
    assert "error:" in capsys.readouterr().err


def test_load_refuses_a_file_of_another_architecture(tmp_path, capsys):
    from ggmlopt import nn
    from ggmlopt.io import save_gguf

    path = tmp_path / "other.gguf"
    save_gguf(nn.Sequential(nn.Linear(3, 2)), path)
    with pytest.raises(SystemExit):
        mnist.main(["--load", str(path)])
    assert "holds neither ggml's mnist-fc nor mnist-cnn" in capsys.readouterr().err


def test_cnn_save_then_load(tmp_path, capsys):
    if not hasattr(mnist, "mnist_cnn"):
        pytest.skip("the example has no --model cnn yet")
    path = tmp_path / "cnn.gguf"
    trained = mnist.main(["--model", "cnn", "--epochs", "1", "--silent", "--save", str(path)])
    assert "(mnist-cnn, float32 weights)" in capsys.readouterr().out
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "mnist-cnn"
    assert [t.name for t in reader.tensors] == ["conv1.kernel", "conv1.bias", "conv2.kernel",
                                                "conv2.bias", "dense.weight", "dense.bias"]
    np.testing.assert_allclose(mnist.main(["--model", "cnn", "--load", str(path)]), trained,
                               rtol=1e-6)
    with pytest.raises(SystemExit):
        mnist.main(["--model", "cnn", "--save", str(path), "--save-f16"])
