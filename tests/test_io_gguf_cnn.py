"""GGUF for ggml's mnist-cnn: what ggml's mnist-eval asserts, ggml's
(row, column, channel) flattening before the dense layer, round trips."""
import numpy as np
import pytest
from mnist_models import cnn_features, mnist_cnn, mnist_fc

from ggmlopt.io import load_gguf, save_gguf

gguf = pytest.importorskip("gguf")
GT = gguf.GGMLQuantizationType


def read(path):
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    return arch, [(t.name, t.shape.tolist(), t.tensor_type, np.array(t.data))
                  for t in reader.tensors]


def test_file_has_what_mnist_eval_asserts(tmp_path):
    m = mnist_cnn(0)
    path = tmp_path / "cnn.gguf"
    save_gguf(m, path, arch="mnist-cnn")
    arch, tensors = read(path)
    assert arch == "mnist-cnn"
    assert [(n, ne, t) for n, ne, t, _ in tensors] == [
        ("conv1.kernel", [3, 3, 1, 8], GT.F32),
        ("conv1.bias", [1, 1, 8, 1], GT.F32),
        ("conv2.kernel", [3, 3, 8, 16], GT.F32),
        ("conv2.bias", [1, 1, 16, 1], GT.F32),
        ("dense.weight", [784, 10], GT.F32),
        ("dense.bias", [10], GT.F32),
    ]
    data = {n: d for n, _, _, d in tensors}
    conv1, conv2, dense = m.layers[1], m.layers[4], m.layers[8]
    # ne (kw, kh, in, out) is torch's (out, in, kh, kw)
    np.testing.assert_array_equal(data["conv1.kernel"], conv1.weight.data)
    np.testing.assert_array_equal(data["conv2.kernel"], conv2.weight.data)
    np.testing.assert_array_equal(data["conv1.bias"].ravel(), conv1.bias.data)
    np.testing.assert_array_equal(data["conv2.bias"].ravel(), conv2.bias.data)
    np.testing.assert_array_equal(data["dense.bias"], dense.bias.data)
    # ggml's dense input index is (h*7 + w)*16 + c; ours (Flatten of NCHW) c*49 + h*7 + w
    g = data["dense.weight"]
    assert g.shape == (10, 784)
    for o, c, h, w in [(0, 0, 0, 0), (3, 15, 6, 6), (9, 7, 2, 5), (5, 1, 0, 6)]:
        assert g[o, (h * 7 + w) * 16 + c] == dense.weight.data[c * 49 + h * 7 + w, o]


def test_ggml_dense_layer_on_ggml_flattening_gives_our_logits(tmp_path):
    # what mnist-common.cpp computes after the second pool: permute to channels-
    # fastest, flatten, mul_mat with dense.weight, add dense.bias
    m = mnist_cnn(1)
    path = tmp_path / "cnn.gguf"
    save_gguf(m, path, arch="mnist-cnn")
    _, tensors = read(path)
    data = {n: d for n, _, _, d in tensors}
    x = np.random.default_rng(0).random((5, 784), dtype=np.float32)
    feats = cnn_features(m, x)  # (5, 16, 7, 7)
    ggml_in = feats.transpose(0, 2, 3, 1).reshape(5, 784).astype(np.float64)
    logits = ggml_in @ data["dense.weight"].T.astype(np.float64) + data["dense.bias"]
    np.testing.assert_allclose(m(x), logits, rtol=1e-5, atol=1e-5)


def test_round_trip(tmp_path):
    m, m2 = mnist_cnn(2), mnist_cnn(3)
    save_gguf(m, tmp_path / "cnn.gguf", arch="mnist-cnn")
    assert load_gguf(tmp_path / "cnn.gguf", m2, arch="mnist-cnn") == \
        {"general.architecture": "mnist-cnn"}
    for p, q in zip(m.parameters(), m2.parameters()):
        np.testing.assert_array_equal(q.data, p.data)
    x = np.random.default_rng(1).random((3, 784), dtype=np.float32)
    np.testing.assert_array_equal(m2(x), m(x))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_generic_layout_round_trip(tmp_path, dtype):
    m, m2 = mnist_cnn(4), mnist_cnn(5)
    path = tmp_path / "g.gguf"
    save_gguf(m, path, dtype=dtype)
    arch, tensors = read(path)
    assert arch == "ggmlopt"
    assert [(n, ne) for n, ne, _, _ in tensors] == [
        ("1.weight", [3, 3, 1, 8]), ("1.bias", [8]), ("4.weight", [3, 3, 8, 16]),
        ("4.bias", [16]), ("8.weight", [784, 10]), ("8.bias", [10])]
    wt = GT.F32 if dtype == np.float32 else GT.F16
    assert [t for _, _, t, _ in tensors] == [wt, GT.F32, wt, GT.F32, wt, GT.F32]
    load_gguf(path, m2)
    for p, q in zip(m.parameters(), m2.parameters()):
        expected = p.data.astype(dtype).astype(np.float32) if p.data.ndim >= 2 else p.data
        np.testing.assert_array_equal(q.data, expected)


def test_float16_refused_for_mnist_cnn(tmp_path):
    with pytest.raises(ValueError, match="mnist-eval asserts float32"):
        save_gguf(mnist_cnn(0), tmp_path / "c.gguf", arch="mnist-cnn", dtype=np.float16)
    assert list(tmp_path.iterdir()) == []


def test_refuses_other_architecture_and_wrong_shapes(tmp_path):
    cnn, fc = mnist_cnn(0), mnist_fc(0)
    save_gguf(cnn, tmp_path / "cnn.gguf", arch="mnist-cnn")
    save_gguf(fc, tmp_path / "fc.gguf", arch="mnist-fc")
    before_cnn = [p.data.copy() for p in cnn.parameters()]
    before_fc = [p.data.copy() for p in fc.parameters()]
    with pytest.raises(ValueError, match="holds ggml's mnist-fc model, which does not fit"):
        load_gguf(tmp_path / "fc.gguf", cnn)
    with pytest.raises(ValueError, match="holds ggml's mnist-cnn model, which does not fit"):
        load_gguf(tmp_path / "cnn.gguf", fc)
    with pytest.raises(ValueError, match="holds a 'mnist-cnn' model, expected 'mnist-fc'"):
        load_gguf(tmp_path / "cnn.gguf", cnn, arch="mnist-fc")
    # conv2.kernel with in and out swapped: ne (3, 3, 16, 8)
    _, tensors = read(tmp_path / "cnn.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "mnist-cnn")
    for name, _, _, data in tensors:
        w.add_tensor(name, data.transpose(1, 0, 2, 3).copy() if name == "conv2.kernel" else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'conv2.kernel' has ggml dims \(ne\) \(3, 3, 16, 8\); "
                                         r"the model needs \(3, 3, 8, 16\)"):
        load_gguf(tmp_path / "bad.gguf", cnn)
    for p, b in zip(cnn.parameters(), before_cnn):
        np.testing.assert_array_equal(p.data, b)
    for p, b in zip(fc.parameters(), before_fc):
        np.testing.assert_array_equal(p.data, b)
