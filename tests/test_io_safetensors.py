"""safetensors in torch's layout: files torch's load_state_dict takes, files torch
wrote, the "ggmlopt" layout, and refusals leaving the model unchanged."""
import os
import sys

import numpy as np
import pytest

from ggmlopt.io import load_safetensors, save_safetensors
from ggmlopt.nn import Linear, Module, Parameter, ReLU, Sequential

st_numpy = pytest.importorskip("safetensors.numpy")


def mlp(seed, sizes=(13, 9, 5)):
    rng = np.random.default_rng(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            layers.append(ReLU())
        layers.append(Linear(a, b, rng=rng))
    return Sequential(*layers)


def params(model):
    return [p.data.copy() for p in model.parameters()]


def assert_unchanged(model, before):
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.data, b)


def test_file_holds_torchs_names_and_shapes(tmp_path):
    m = mlp(0)
    path = tmp_path / "m.safetensors"
    save_safetensors(m, path, metadata={"epochs": "3"})
    arrays = st_numpy.load_file(path)
    assert sorted(arrays) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert arrays["0.weight"].shape == (9, 13) and arrays["2.weight"].shape == (5, 9)
    assert arrays["0.bias"].shape == (9,) and arrays["0.weight"].dtype == np.float32
    np.testing.assert_array_equal(arrays["0.weight"], m[0].weight.data.T)
    np.testing.assert_array_equal(arrays["2.bias"], m[2].bias.data)
    from safetensors import safe_open
    with safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"epochs": "3", "format": "pt", "ggmlopt.layout": "torch"}


@pytest.mark.parametrize("layout", ["torch", "ggmlopt"])
def test_round_trip(tmp_path, layout):
    m, m2 = mlp(1, (1, 17, 3, 2)), mlp(2, (1, 17, 3, 2))
    path = tmp_path / "m.safetensors"
    save_safetensors(m, path, layout=layout)
    header = load_safetensors(path, m2, layout=layout)
    assert header["ggmlopt.layout"] == layout
    for p, q in zip(m.parameters(), m2.parameters()):
        np.testing.assert_array_equal(q.data, p.data)
    if layout == "ggmlopt":
        assert st_numpy.load_file(path)["0.weight"].shape == (1, 17)  # as stored here
        with pytest.raises(ValueError, match="saved with layout='ggmlopt', not 'torch'"):
            load_safetensors(path, m2)


def test_user_module_attribute_names(tmp_path):
    class Net(Module):
        def __init__(self, seed):
            rng = np.random.default_rng(seed)
            self.fc1 = Linear(6, 4, rng=rng)
            self.fc2 = Linear(4, 2, bias=False, rng=rng)
            self.gain = Parameter(rng.random(2))

    path = tmp_path / "n.safetensors"
    a, b = Net(0), Net(1)
    save_safetensors(a, path)
    assert sorted(st_numpy.load_file(path)) == ["fc1.bias", "fc1.weight", "fc2.weight", "gain"]
    load_safetensors(path, b)
    for p, q in zip(a.parameters(), b.parameters()):
        np.testing.assert_array_equal(q.data, p.data)


def test_refusals_leave_model_unchanged(tmp_path):
    m = mlp(0)
    before = params(m)
    rng = np.random.default_rng(0)
    good = {"0.weight": rng.random((9, 13), np.float32), "0.bias": rng.random(9, np.float32),
            "2.weight": rng.random((5, 9), np.float32), "2.bias": rng.random(5, np.float32)}
    cases = [
        ({**good, "0.weight": good["0.weight"].T.copy()}, ValueError,
         r"'0.weight' has shape \(13, 9\); the model expects \(9, 13\)"),
        ({k: v for k, v in good.items() if k != "2.bias"}, ValueError,
         r"missing tensors \['2.bias'\]"),
        ({**good, "3.weight": np.zeros(1, np.float32)}, ValueError,
         r"no parameter for \['3.weight'\]"),
        ({**good, "2.bias": np.arange(5, dtype=np.int32)}, TypeError,
         r"'2.bias' has dtype int32; expected floats"),
    ]
    for i, (arrays, error, message) in enumerate(cases):
        path = tmp_path / f"{i}.safetensors"
        st_numpy.save_file(arrays, path)
        with pytest.raises(error, match=message):
            load_safetensors(path, m)
        assert_unchanged(m, before)
    # float16 and float64 files are converted
    path = tmp_path / "f16.safetensors"
    st_numpy.save_file({k: v.astype(np.float16) for k, v in good.items()}, path)
    load_safetensors(path, m)
    np.testing.assert_array_equal(m[0].weight.data, good["0.weight"].astype(np.float16).T)


@pytest.mark.parametrize("keep", [0, 5, 8, 40, -1])
def test_truncated_file(tmp_path, keep):
    m = mlp(0)
    path = tmp_path / "t.safetensors"
    save_safetensors(m, path)
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    before = params(m)
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        load_safetensors(path, m)
    assert_unchanged(m, before)


def test_bad_arguments(tmp_path):
    m = mlp(0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save_safetensors(m, tmp_path / "missing" / "m.safetensors")
    with pytest.raises(ValueError, match=r"layout: expected one of \('torch', 'ggmlopt'\)"):
        save_safetensors(m, tmp_path / "m.safetensors", layout="tf")
    with pytest.raises(TypeError, match="layout: expected a str"):
        save_safetensors(m, tmp_path / "m.safetensors", layout=None)
    with pytest.raises(TypeError, match="metadata: safetensors stores str -> str"):
        save_safetensors(m, tmp_path / "m.safetensors", metadata={"n": 3})

    class Hidden:
        def __init__(self):
            self.store = [[Parameter(np.zeros(2))]]

        def parameters(self):
            return self.store[0]

    with pytest.raises(ValueError, match="have no name"):
        save_safetensors(Hidden(), tmp_path / "h.safetensors")
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_safetensors(tmp_path / "none.safetensors", m)


def test_import_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(ImportError, match=r"pip install ggmlopt\[interop\]"):
        save_safetensors(mlp(0), tmp_path / "m.safetensors")
    with pytest.raises(ImportError, match=r"needs the 'safetensors' package"):
        load_safetensors(__file__, mlp(0))


# ---- against torch ------------------------------------------------------------------------

def torch_mlp(sizes):
    torch = pytest.importorskip("torch")
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(a, b))
    return torch.nn.Sequential(*layers)


@pytest.mark.parametrize("sizes", [(784, 500, 10), (1, 3, 1), (13, 9, 5)])
def test_torch_loads_our_file_and_agrees(tmp_path, sizes):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    m = mlp(3, sizes)
    path = tmp_path / "m.safetensors"
    save_safetensors(m, path)
    t = torch_mlp(sizes)
    t.load_state_dict(load_file(path))  # strict: every name and shape
    x = np.random.default_rng(0).standard_normal((11, sizes[0])).astype(np.float32)
    with torch.no_grad():
        expected = t(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(m(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sizes", [(784, 500, 10), (2, 7, 3)])
def test_we_load_torchs_file_and_agree(tmp_path, sizes):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    torch.manual_seed(0)
    t = torch_mlp(sizes)
    path = tmp_path / "t.safetensors"
    save_file(t.state_dict(), path)
    m = mlp(9, sizes)
    load_safetensors(path, m)
    x = np.random.default_rng(1).standard_normal((6, sizes[0])).astype(np.float32)
    with torch.no_grad():
        expected = t(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(m(x), expected, atol=1e-5, rtol=1e-5)


def test_torch_loads_our_cnn_and_agrees(tmp_path):
    torch = pytest.importorskip("torch")
    from mnist_models import mnist_cnn, torch_mnist_cnn
    from safetensors.torch import load_file

    m = mnist_cnn(0)
    path = tmp_path / "cnn.safetensors"
    save_safetensors(m, path)
    arrays = load_file(path)
    assert arrays["1.weight"].shape == (8, 1, 3, 3) and arrays["8.weight"].shape == (10, 784)
    t = torch_mnist_cnn()
    t.load_state_dict(arrays)
    x = np.random.default_rng(0).random((9, 784), dtype=np.float32)
    with torch.no_grad():
        expected = t(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(m(x), expected, atol=1e-5, rtol=1e-5)


def test_we_load_torchs_cnn_and_agree(tmp_path):
    torch = pytest.importorskip("torch")
    from mnist_models import mnist_cnn, torch_mnist_cnn
    from safetensors.torch import save_file

    torch.manual_seed(1)
    t = torch_mnist_cnn()
    path = tmp_path / "t.safetensors"
    save_file(t.state_dict(), path)
    m = mnist_cnn(7)
    load_safetensors(path, m)
    x = np.random.default_rng(2).random((4, 784), dtype=np.float32)
    with torch.no_grad():
        expected = t(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(m(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_saved_file_mode_follows_the_umask(tmp_path, umask):
    """The same permissions as any other file the process writes (0644 under a
    022 umask), not those of a private temporary file (0600)."""
    old = os.umask(umask)
    try:
        save_safetensors(Sequential(Linear(2, 2)), tmp_path / "m.safetensors")
        (tmp_path / "plain").write_bytes(b"")
    finally:
        os.umask(old)
    mode = (tmp_path / "m.safetensors").stat().st_mode
    assert mode == (tmp_path / "plain").stat().st_mode == (0o100666 & ~umask)
