"""GGUF: ggml's mnist-fc layout (what ggml's mnist-eval asserts), the generic
layout, round trips in float32 and float16, and every refusal leaving the model
unchanged."""
import os
import sys

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.io import GENERIC_ARCH, load_gguf, save_gguf
from ggmlopt.nn import Linear, Module, Parameter, ReLU, Sequential

gguf = pytest.importorskip("gguf")
GT = gguf.GGMLQuantizationType


def mnist_fc(seed):
    rng = np.random.default_rng(seed)
    return Sequential(Linear(784, 500, rng=rng), ReLU(), Linear(500, 10, rng=rng))


def params(model):
    return [p.data.copy() for p in model.parameters()]


def assert_unchanged(model, before):
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.data, b)


def read(path):
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    tensors = {t.name: (t.shape.tolist(), t.tensor_type, np.array(t.data)) for t in reader.tensors}
    order = [t.name for t in reader.tensors]
    return fields, tensors, order


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_mnist_fc_file_has_what_mnist_eval_asserts(tmp_path, dtype):
    m = mnist_fc(0)
    path = tmp_path / "fc.gguf"
    save_gguf(m, path, arch="mnist-fc", dtype=dtype)
    fields, tensors, order = read(path)
    assert fields["general.architecture"] == "mnist-fc"
    assert order == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    # ggml's ne (fastest dimension first), as mnist-common.cpp asserts them
    assert tensors["fc1.weight"][0] == [784, 500]
    assert tensors["fc1.bias"][0] == [500]
    assert tensors["fc2.weight"][0] == [500, 10]
    assert tensors["fc2.bias"][0] == [10]
    weight_type = GT.F32 if dtype == np.float32 else GT.F16
    assert tensors["fc1.weight"][1] == weight_type
    assert tensors["fc2.weight"][1] == weight_type
    assert tensors["fc1.bias"][1] == GT.F32
    assert tensors["fc2.bias"][1] == GT.F32
    # ne (784, 500) is NumPy (500, 784): row j holds hidden unit j's input weights,
    # the transpose of Linear's (in, out) storage
    np.testing.assert_array_equal(tensors["fc1.weight"][2],
                                  m[0].weight.data.T.astype(dtype))
    np.testing.assert_array_equal(tensors["fc2.weight"][2],
                                  m[2].weight.data.T.astype(dtype))
    np.testing.assert_array_equal(tensors["fc1.bias"][2], m[0].bias.data)
    np.testing.assert_array_equal(tensors["fc2.bias"][2], m[2].bias.data)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_mnist_fc_round_trip(tmp_path, dtype):
    m = mnist_fc(1)
    path = tmp_path / "fc.gguf"
    save_gguf(m, path, arch="mnist-fc", metadata={"note": "run 7"}, dtype=dtype)
    m2 = mnist_fc(2)
    kv = load_gguf(path, m2)
    assert kv == {"general.architecture": "mnist-fc", "note": "run 7"}
    for p, q in zip(m.parameters(), m2.parameters()):
        expected = p.data.astype(dtype).astype(np.float32) if p.data.ndim == 2 else p.data
        np.testing.assert_array_equal(q.data, expected)
        assert q.data.dtype == np.float32
    x = np.random.default_rng(0).random((7, 784), dtype=np.float32)
    tol = 0 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(m2(x), m(x), atol=tol, rtol=0)


def test_mnist_fc_loaded_into_an_opt_context_arena(tmp_path):
    m = mnist_fc(3)
    save_gguf(m, tmp_path / "fc.gguf", arch="mnist-fc")
    m2 = mnist_fc(4)
    ctx = go.OptContext(m2, batch_size=5, ne_datapoint=784,
                        loss_type=go.LossType.CROSS_ENTROPY)
    views = [p.data for p in m2.parameters()]
    load_gguf(tmp_path / "fc.gguf", m2, arch="mnist-fc")
    for v, p, q in zip(views, m.parameters(), m2.parameters()):
        assert q.data is v  # copied into the arena, not re-pointed
        np.testing.assert_array_equal(q.data, p.data)
    ctx.alloc(False)
    ctx.inputs[...] = 0.5
    ctx.eval()
    np.testing.assert_allclose(ctx.outputs, m(np.full((5, 784), 0.5, np.float32)), rtol=1e-6)


def write_raw(path, arch, tensors, kv=()):
    """A GGUF written directly with the gguf package: (name, NumPy array) pairs."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in kv:
        w.add_string(key, value)
    for name, array in tensors:
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_reads_a_file_written_like_ggmls_trainers(tmp_path):
    # ggml's mnist-train-fc.py writes torch's state_dict; mnist-train.cpp writes the
    # biases as 1-D tensors; a writer that keeps a trailing dimension of 1 gives
    # ne (500, 1): all are the same ggml tensors
    rng = np.random.default_rng(5)
    w1, b1 = rng.random((500, 784), np.float32), rng.random((500, 1), np.float32)
    w2, b2 = rng.random((10, 500), np.float32), rng.random(10, np.float32)
    path = tmp_path / "ggml.gguf"
    write_raw(path, "mnist-fc", [("fc1.weight", w1), ("fc1.bias", b1.T),
                                 ("fc2.weight", w2), ("fc2.bias", b2)])
    m = mnist_fc(0)
    load_gguf(path, m)
    np.testing.assert_array_equal(m[0].weight.data, w1.T)
    np.testing.assert_array_equal(m[0].bias.data, b1[:, 0])
    np.testing.assert_array_equal(m[2].weight.data, w2.T)
    np.testing.assert_array_equal(m[2].bias.data, b2)


class TwoHeads(Module):
    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.body = Sequential(Linear(5, 7, rng=rng), ReLU())
        self.head = Linear(7, 3, bias=False, rng=rng)
        self.temperature = Parameter(rng.random(1))

    def forward(self, x):
        return self.head.forward(self.body.forward(x)) * self.temperature.data

    def backward(self, g):
        raise NotImplementedError


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_generic_layout(tmp_path, dtype):
    m = TwoHeads(0)
    path = tmp_path / "g.gguf"
    save_gguf(m, path, metadata={"epochs": 3, "lr": 1e-3, "ok": True, "who": "me"},
              dtype=dtype)
    fields, tensors, order = read(path)
    assert fields["general.architecture"] == GENERIC_ARCH == "ggmlopt"
    assert fields["ggmlopt.tensor_layout"] == "torch"
    assert fields["epochs"] == 3 and fields["lr"] == 1e-3 and fields["ok"] is True
    assert order == ["temperature", "body.0.weight", "body.0.bias", "head.weight"]
    # ne = torch's shape reversed: a Linear weight is ne (in, out), ggml_mul_mat's operand
    assert tensors["body.0.weight"][0] == [5, 7]
    assert tensors["head.weight"][0] == [7, 3]
    assert tensors["body.0.bias"][0] == [7]
    assert tensors["temperature"][0] == [1]
    wt = GT.F32 if dtype == np.float32 else GT.F16
    assert tensors["body.0.weight"][1] == wt and tensors["head.weight"][1] == wt
    assert tensors["body.0.bias"][1] == GT.F32 and tensors["temperature"][1] == GT.F32
    m2 = TwoHeads(1)
    kv = load_gguf(path, m2)
    assert kv["epochs"] == 3 and kv["who"] == "me"
    for p, q in zip(m.parameters(), m2.parameters()):
        expected = p.data.astype(dtype).astype(np.float32) if p.data.ndim == 2 else p.data
        np.testing.assert_array_equal(q.data, expected)


def test_generic_reads_bf16_and_f16_biases(tmp_path):
    m = Sequential(Linear(3, 2, rng=0))
    w = np.array([[1.5, -2.0, 0.25], [3.0, 0.5, -1.0]], np.float32)  # torch layout
    bf16 = (w.view(np.uint32) >> 16).astype(np.uint16)
    path = tmp_path / "bf.gguf"
    writer = gguf.GGUFWriter(str(path), "ggmlopt")
    writer.add_tensor("0.weight", bf16, raw_shape=(2, 3), raw_dtype=GT.BF16)
    writer.add_tensor("0.bias", np.array([1, 2], np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    load_gguf(path, m)
    np.testing.assert_array_equal(m[0].weight.data, w.T)
    np.testing.assert_array_equal(m[0].bias.data, [1, 2])


# ---- refusals -----------------------------------------------------------------------------

def test_refuses_another_architecture(tmp_path):
    small = Sequential(Linear(4, 3, rng=0))
    save_gguf(small, tmp_path / "small.gguf")
    m = mnist_fc(0)
    before = params(m)
    with pytest.raises(ValueError, match=r"missing tensors \['2.weight', '2.bias'\]"):
        load_gguf(tmp_path / "small.gguf", m)
    save_gguf(m, tmp_path / "fc.gguf", arch="mnist-fc")
    with pytest.raises(ValueError, match="holds a 'mnist-fc' model, expected 'ggmlopt'"):
        load_gguf(tmp_path / "fc.gguf", m, arch="ggmlopt")
    with pytest.raises(ValueError, match="holds ggml's mnist-fc model, which does not fit"):
        load_gguf(tmp_path / "fc.gguf", small)
    write_raw(tmp_path / "llama.gguf", "llama", [("x", np.zeros(3, np.float32))])
    with pytest.raises(ValueError, match="holds a 'llama' model; load_gguf reads"):
        load_gguf(tmp_path / "llama.gguf", m)
    assert_unchanged(m, before)


def test_refuses_wrong_shape_missing_and_extra_tensors(tmp_path):
    rng = np.random.default_rng(0)
    good = [("fc1.weight", rng.random((500, 784), np.float32)),
            ("fc1.bias", rng.random(500, np.float32)),
            ("fc2.weight", rng.random((10, 500), np.float32)),
            ("fc2.bias", rng.random(10, np.float32))]
    m = mnist_fc(0)
    before = params(m)
    bad = list(good)
    bad[2] = ("fc2.weight", rng.random((500, 10), np.float32))  # transposed: ne (10, 500)
    write_raw(tmp_path / "shape.gguf", "mnist-fc", bad)
    with pytest.raises(ValueError, match=r"'fc2.weight' has ggml dims \(ne\) \(10, 500, 1, 1\); "
                                         r"the model needs \(500, 10, 1, 1\)"):
        load_gguf(tmp_path / "shape.gguf", m)
    write_raw(tmp_path / "missing.gguf", "mnist-fc", good[:3])
    with pytest.raises(ValueError, match=r"missing tensors \['fc2.bias'\]"):
        load_gguf(tmp_path / "missing.gguf", m)
    write_raw(tmp_path / "extra.gguf", "mnist-fc", good + [("fc3.bias", np.zeros(2, np.float32))])
    with pytest.raises(ValueError, match=r"no parameter for \['fc3.bias'\]"):
        load_gguf(tmp_path / "extra.gguf", m)
    ints = list(good)
    ints[3] = ("fc2.bias", np.arange(10, dtype=np.int32))
    write_raw(tmp_path / "int.gguf", "mnist-fc", ints)
    with pytest.raises(TypeError, match="'fc2.bias' has type I32"):
        load_gguf(tmp_path / "int.gguf", m)
    write_raw(tmp_path / "noarch.gguf", "mnist-fc", good)
    assert_unchanged(m, before)


def test_generic_refuses_other_layout_key(tmp_path):
    m = Sequential(Linear(2, 2, rng=0))
    write_raw(tmp_path / "l.gguf", "ggmlopt", [("0.weight", np.zeros((2, 2), np.float32)),
                                              ("0.bias", np.zeros(2, np.float32))],
              kv=[("ggmlopt.tensor_layout", "ggmlopt")])
    with pytest.raises(ValueError, match="tensor_layout='ggmlopt'; expected 'torch'"):
        load_gguf(tmp_path / "l.gguf", m)


@pytest.mark.parametrize("keep", [0, 3, 8, 24, 100, 1000, -1])
def test_truncated_file(tmp_path, keep):
    m = Sequential(Linear(30, 20, rng=0), ReLU(), Linear(20, 3, rng=1))
    path = tmp_path / "t.gguf"
    save_gguf(m, path)
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    before = params(m)
    with pytest.raises(ValueError, match="is a truncated GGUF file"):
        load_gguf(path, m)
    assert_unchanged(m, before)


def test_every_cut_of_a_file_says_truncated(tmp_path):
    """Wherever the file ends early (magic, header, key-values, tensor infos, data,
    the last tensor's padding), the error says truncated and the byte counts."""
    m = Sequential(Linear(5, 3, rng=0), ReLU(), Linear(3, 2, rng=1))
    path = tmp_path / "t.gguf"
    save_gguf(m, path, metadata={"note": "some text", "lr": 0.5}, dtype=np.float16)
    data = path.read_bytes()
    before = params(m)
    for keep in range(len(data)):
        path.write_bytes(data[:keep])
        with pytest.raises(ValueError, match=rf"is a truncated GGUF file \({keep} bytes; "):
            load_gguf(path, m)
    assert_unchanged(m, before)
    path.write_bytes(data)
    load_gguf(path, m)


def test_a_corrupt_file_is_not_called_truncated(tmp_path):
    m = Sequential(Linear(2, 2, rng=0))
    save_gguf(m, tmp_path / "c.gguf")
    data = bytearray((tmp_path / "c.gguf").read_bytes())
    data[24:32] = (2**62).to_bytes(8, "little")  # the first key's length
    (tmp_path / "c.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        load_gguf(tmp_path / "c.gguf", m)


def _tensor_info_at(data: bytes, name: str) -> int:
    """Where the tensor info of name starts (its name's length) in a GGUF header."""
    raw = name.encode()
    return data.index(len(raw).to_bytes(8, "little") + raw)


@pytest.mark.parametrize("edit, match", [
    (lambda d, at: d.__setitem__(slice(4, 8), (1).to_bytes(4, "little")), "version 1"),
    (lambda d, at: d.__setitem__(slice(4, 8), (4).to_bytes(4, "little")), "version 4"),
    # the first tensor's type F32 -> F16: the next one no longer starts where it says
    (lambda d, at: d.__setitem__(slice(at + 8 + 8 + 4 + 16, at + 8 + 8 + 4 + 20),
                                 (1).to_bytes(4, "little")), "'0.bias' has offset 64, expected 32"),
    (lambda d, at: d.__setitem__(slice(at + 8 + 8 + 4 + 20, at + 8 + 8 + 4 + 28),
                                 (32).to_bytes(8, "little")), "'0.weight' has offset 32, expected 0"),
    (lambda d, at: d.__setitem__(slice(at + 16, at + 20), (5).to_bytes(4, "little")),
     "'0.weight' has 5 dimensions"),
    (lambda d, at: d.__setitem__(slice(at + 16, at + 20), (0).to_bytes(4, "little")),
     "'0.weight' has unknown type"),
])
def test_a_header_gguf_cpp_refuses_is_refused(tmp_path, edit, match):
    # what llama.cpp's reader refuses (gguf.cpp) is refused here, not read as garbage
    m = Sequential(Linear(4, 3, rng=0))
    path = tmp_path / "h.gguf"
    save_gguf(m, path)   # tensors 0.weight (3, 4) F32 at 0, 0.bias at 64
    data = bytearray(path.read_bytes())
    edit(data, _tensor_info_at(bytes(data), "0.weight"))
    path.write_bytes(bytes(data))
    before = params(m)
    with pytest.raises(ValueError, match=match):
        load_gguf(path, m)
    assert_unchanged(m, before)


def test_foreign_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        load_gguf(path, Sequential(Linear(2, 2)))


def test_save_refuses_bad_arguments(tmp_path):
    m = mnist_fc(0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save_gguf(m, tmp_path / "no" / "such" / "m.gguf")
    with pytest.raises(ValueError, match="is a directory"):
        save_gguf(m, tmp_path)
    with pytest.raises(TypeError, match="path: expected a str or os.PathLike"):
        save_gguf(m, 3)
    with pytest.raises(TypeError, match="dtype: expected float32 or float16"):
        save_gguf(m, tmp_path / "m.gguf", dtype=np.int8)
    with pytest.raises(TypeError, match="dtype: expected float32 or float16"):
        save_gguf(m, tmp_path / "m.gguf", dtype="bogus")
    with pytest.raises(ValueError, match="arch: expected None"):
        save_gguf(m, tmp_path / "m.gguf", arch="llama")
    with pytest.raises(TypeError, match="arch: expected a str"):
        save_gguf(m, tmp_path / "m.gguf", arch=1)
    with pytest.raises(ValueError, match="it is not ggml's mnist-cnn model"):
        save_gguf(m, tmp_path / "m.gguf", arch="mnist-cnn")
    with pytest.raises(ValueError, match="it is not ggml's mnist-fc model"):
        save_gguf(Sequential(Linear(784, 10)), tmp_path / "m.gguf", arch="mnist-fc")
    with pytest.raises(ValueError, match="mnist-eval asserts float32"):
        save_gguf(m, tmp_path / "m.gguf", arch="mnist-cnn", dtype=np.float16)
    with pytest.raises(TypeError, match="metadata: expected a dict"):
        save_gguf(m, tmp_path / "m.gguf", metadata=[("a", 1)])
    with pytest.raises(TypeError, match="metadata: 'a' has a list"):
        save_gguf(m, tmp_path / "m.gguf", metadata={"a": [1]})
    with pytest.raises(ValueError, match="'general.architecture' is reserved"):
        save_gguf(m, tmp_path / "m.gguf", metadata={"general.architecture": "x"})
    with pytest.raises(TypeError, match="model: expected a model with parameters"):
        save_gguf(object(), tmp_path / "m.gguf")
    assert os.listdir(tmp_path) == []  # nothing written, no temporary left


def test_save_refuses_unnamed_parameters_and_long_names(tmp_path):
    class Hidden:
        def __init__(self):
            self.store = {"w": Parameter(np.zeros((2, 2)))}

        def parameters(self):
            return list(self.store.values())

    with pytest.raises(ValueError, match="have no name"):
        save_gguf(Hidden(), tmp_path / "h.gguf")
    with pytest.raises(ValueError, match="have no name"):
        load_gguf(__file__, Hidden())

    class Long(Module):
        def __init__(self):
            setattr(self, "a" * 60, Linear(2, 2))

    with pytest.raises(ValueError, match="longer than ggml's 63 bytes"):
        save_gguf(Long(), tmp_path / "l.gguf")
    with pytest.raises(ValueError, match="no parameters"):
        save_gguf(Sequential(ReLU()), tmp_path / "r.gguf")
    assert os.listdir(tmp_path) == []


def test_f16_overflow_refused(tmp_path):
    m = Sequential(Linear(2, 2, rng=0))
    m[0].weight.data[0, 1] = 1e5
    with pytest.raises(ValueError, match="beyond float16's range"):
        save_gguf(m, tmp_path / "m.gguf", dtype=np.float16)
    save_gguf(m, tmp_path / "m.gguf")  # float32 keeps it


def test_save_replaces_atomically(tmp_path):
    path = tmp_path / "m.gguf"
    a, b = Sequential(Linear(3, 2, rng=0)), Sequential(Linear(3, 2, rng=1))
    save_gguf(a, path)
    save_gguf(b, path)
    c = Sequential(Linear(3, 2, rng=2))
    load_gguf(path, c)
    np.testing.assert_array_equal(c[0].weight.data, b[0].weight.data)
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_gguf(tmp_path / "none.gguf", Sequential(Linear(2, 2)))
    with pytest.raises(ValueError, match="is a directory"):
        load_gguf(tmp_path, Sequential(Linear(2, 2)))


def test_import_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=r"pip install ggmlopt\[interop\]"):
        save_gguf(Sequential(Linear(2, 2)), tmp_path / "m.gguf")
    with pytest.raises(ImportError, match=r"GGUF export and import needs the 'gguf' package"):
        load_gguf(__file__, Sequential(Linear(2, 2)))
    assert os.listdir(tmp_path) == []


def test_metadata_values_round_trip(tmp_path):
    m = Sequential(Linear(2, 2, rng=0))
    meta = {"n": -3, "big": 2**40, "x": 0.1, "yes": True, "no": False, "s": "d\u00e9j\u00e0 vu"}
    save_gguf(m, tmp_path / "m.gguf", metadata=meta)
    kv = load_gguf(tmp_path / "m.gguf", m)
    for key, value in meta.items():
        assert kv[key] == value and type(kv[key]) is type(value)
    # arrays written by other tools come back as lists
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "ggmlopt")
    w.add_array("ints", [1, 2, 3])
    w.add_array("strs", ["a", "bc"])
    w.add_tensor("0.weight", np.zeros((2, 2), np.float32))
    w.add_tensor("0.bias", np.zeros(2, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    kv = load_gguf(tmp_path / "a.gguf", m)
    assert kv["ints"] == [1, 2, 3] and kv["strs"] == ["a", "bc"]
    with pytest.raises(ValueError, match="does not fit an int64"):
        save_gguf(m, tmp_path / "m.gguf", metadata={"huge": 2**63})


def test_saved_file_mode_follows_the_umask(tmp_path):
    save_gguf(Sequential(Linear(2, 2)), tmp_path / "m.gguf")
    (tmp_path / "plain").write_bytes(b"")
    assert (tmp_path / "m.gguf").stat().st_mode == (tmp_path / "plain").stat().st_mode
