"""IDX reader and MNIST loader on files written here."""
import gzip
import struct

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.datasets import load_idx, load_mnist, load_mnist_split

CODES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D,
         np.float64: 0x0E}


def idx_bytes(arr, code=None):
    arr = np.asarray(arr)
    code = CODES[arr.dtype.type] if code is None else code
    header = struct.pack(">BBBB", 0, 0, code, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()


def write(path, payload, gz=False):
    path.write_bytes(gzip.compress(payload) if gz else payload)
    return path


@pytest.mark.parametrize("dtype", list(CODES))
@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (0, 7), (1, 1, 1, 1)])
@pytest.mark.parametrize("gz", [False, True])
def test_round_trip(tmp_path, dtype, shape, gz):
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal(shape) * 50).astype(dtype)
    path = write(tmp_path / ("a.idx.gz" if gz else "a.idx"), idx_bytes(arr), gz)
    out = load_idx(path)
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative
    assert out.shape == shape and out.flags.c_contiguous and out.flags.writeable
    np.testing.assert_array_equal(out, arr)


def test_gzip_is_detected_by_content_not_name(tmp_path):
    arr = np.arange(6, dtype=np.uint8).reshape(2, 3)
    np.testing.assert_array_equal(load_idx(write(tmp_path / "plain", idx_bytes(arr), gz=True)), arr)
    np.testing.assert_array_equal(load_idx(str(tmp_path / "plain")), arr)   # str paths too


@pytest.mark.parametrize("cut", [1, 3, 5, 11, 20])
@pytest.mark.parametrize("gz", [False, True])
def test_truncated_file_is_an_error(tmp_path, cut, gz):
    payload = idx_bytes(np.arange(12, dtype=np.int32).reshape(3, 4))[:-cut]
    path = write(tmp_path / "t.idx", payload, gz)
    with pytest.raises(ValueError, match="truncated|too short"):
        load_idx(path)


def test_trailing_bytes_are_an_error(tmp_path):
    path = write(tmp_path / "t.idx", idx_bytes(np.zeros(4, np.uint8)) + b"\0")
    with pytest.raises(ValueError, match="trailing"):
        load_idx(path)


@pytest.mark.parametrize("payload, what", [
    (b"\x00\x01\x08\x01\x00\x00\x00\x01\x05", "not an IDX"),
    (b"\x08\x00\x08\x01\x00\x00\x00\x01\x05", "not an IDX"),
    (b"\x00\x00\x07\x01\x00\x00\x00\x01\x05", "unknown IDX element type"),
    (b"\x00\x00\x08", "too short"),
    (b"", "too short"),
    (b"\x00\x00\x08\x03\x00\x00\x00\x01", "truncated header"),
])
def test_wrong_header_is_an_error(tmp_path, payload, what):
    path = write(tmp_path / "bad.idx", payload)
    with pytest.raises(ValueError, match=what) as e:
        load_idx(path)
    assert "bad.idx" in str(e.value)


def test_corrupt_gzip_is_an_error(tmp_path):
    good = gzip.compress(idx_bytes(np.arange(1000, dtype=np.int32)))
    path = tmp_path / "c.gz"
    path.write_bytes(good[:len(good) // 2])
    with pytest.raises(ValueError, match="gzip"):
        load_idx(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_idx(tmp_path / "nope")


# ---- MNIST-style directories ----------------------------------------------------------

def write_mnist(directory, ntrain=12, ntest=6, gz=False, rows=4, cols=5, sep="-"):
    rng = np.random.default_rng(2)
    content = {}
    for prefix, n in (("train", ntrain), ("t10k", ntest)):
        images = rng.integers(0, 256, (n, rows, cols), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        suffix = ".gz" if gz else ""
        write(directory / f"{prefix}-images{sep}idx3-ubyte{suffix}", idx_bytes(images), gz)
        write(directory / f"{prefix}-labels{sep}idx1-ubyte{suffix}", idx_bytes(labels), gz)
        content[prefix] = (images, labels)
    return content


@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist_builds_uint8_datasets_with_one_hot_labels(tmp_path, gz):
    content = write_mnist(tmp_path, gz=gz)
    train, test = load_mnist(tmp_path, ndata_shard=3)
    for ds, (images, labels) in ((train, content["train"]), (test, content["t10k"])):
        n = len(labels)
        assert isinstance(ds, go.Dataset)
        assert (ds.ndata, ds.ne_datapoint, ds.ne_label, ds.ndata_shard) == (n, 20, 10, 3)
        assert ds.data_dtype == np.uint8 and ds.label_dtype == np.float32
        np.testing.assert_array_equal(ds.data, images.reshape(n, 20))
        np.testing.assert_array_equal(ds.labels, np.eye(10, dtype=np.float32)[labels])
        batch = np.empty((n, 20), np.float32)
        ds.get_batch(batch, np.empty((n, 10), np.float32), 0)
        np.testing.assert_allclose(batch, images.reshape(n, 20) / 255.0, rtol=1e-6)
        assert batch.max() <= 1.0
    assert load_mnist(tmp_path).train.ndata_shard == 1


@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist_finds_dot_named_files(tmp_path, gz):
    # other mirrors name them train-images.idx3-ubyte, t10k-labels.idx1-ubyte, ...
    content = write_mnist(tmp_path, gz=gz, sep=".")
    train, test = load_mnist(tmp_path)
    for ds, (images, labels) in ((train, content["train"]), (test, content["t10k"])):
        np.testing.assert_array_equal(ds.data, images.reshape(len(labels), -1))
        np.testing.assert_array_equal(ds.labels.argmax(axis=1), labels)


def test_load_mnist_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="directory"):
        load_mnist(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        load_mnist(tmp_path)
    write_mnist(tmp_path)
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(np.zeros(5, np.uint8)))
    with pytest.raises(ValueError, match="5 labels for 6 images"):
        load_mnist(tmp_path)
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(np.full(6, 10, np.uint8)))
    with pytest.raises(ValueError, match="label 10 out of range"):
        load_mnist(tmp_path)
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(np.zeros(6, np.int32)))
    with pytest.raises(ValueError, match="uint8 labels"):
        load_mnist(tmp_path)
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(np.zeros(6, np.uint8))[:-1])
    with pytest.raises(ValueError, match="truncated"):
        load_mnist(tmp_path)
    with pytest.raises(ValueError, match="ndata"):
        load_mnist(tmp_path, ndata_shard=5)


def _check(ds, images, labels):
    np.testing.assert_array_equal(ds.data, images.reshape(len(labels), -1))
    np.testing.assert_array_equal(ds.labels.argmax(axis=1), labels)


def _rename(directory, old, new):
    for kind in ("images-idx3", "labels-idx1"):
        (directory / f"{old}-{kind}-ubyte").rename(directory / f"{new}-{kind}-ubyte")


def test_load_mnist_takes_file_prefixes(tmp_path, monkeypatch):
    content = write_mnist(tmp_path)
    _rename(tmp_path, "train", "train60k")
    train, test = load_mnist(tmp_path, train="train60k")
    _check(train, *content["train"])
    _check(test, *content["t10k"])
    # path prefixes, without a directory; relative ones from the current directory
    train, test = load_mnist(train=tmp_path / "train60k", test=str(tmp_path / "t10k-"))
    _check(train, *content["train"])
    _check(test, *content["t10k"])
    monkeypatch.chdir(tmp_path)
    assert load_mnist(train="train60k", ndata_shard=3).test.ndata_shard == 3
    # the images file's own name as the prefix
    _check(load_mnist(tmp_path, train="train60k-images-idx3-ubyte").train, *content["train"])


def test_load_mnist_takes_explicit_paths(tmp_path):
    """As ggml's mnist-train / mnist-eval take them: images file, labels file."""
    content = write_mnist(tmp_path, gz=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").rename(tmp_path / "test-labels.gz")
    pair = (tmp_path / "t10k-images-idx3-ubyte.gz", tmp_path / "test-labels.gz")
    train, test = load_mnist(tmp_path, test=pair)
    _check(test, *content["t10k"])
    _check(train, *content["train"])
    # relative to directory, and without it
    _check(load_mnist(tmp_path, test=("t10k-images-idx3-ubyte", "test-labels")).test,
           *content["t10k"])
    _check(load_mnist_split(pair), *content["t10k"])
    _check(load_mnist_split(tmp_path / "train"), *content["train"])
    assert load_mnist_split(tmp_path / "train", ndata_shard=4).ndata_shard == 4


def test_load_mnist_prefix_errors_name_the_split(tmp_path):
    write_mnist(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^train: none of .*train60k-images-idx3-ubyte"):
        load_mnist(tmp_path, train="train60k")
    with pytest.raises(FileNotFoundError, match=r"^test: none of .*nolabels"):
        load_mnist(tmp_path, test=("t10k-images-idx3-ubyte", "nolabels"))
    with pytest.raises(ValueError, match="test: expected a file prefix or .* got 3 items"):
        load_mnist(tmp_path, test=("a", "b", "c"))
    with pytest.raises(TypeError, match="train: expected a file prefix"):
        load_mnist(tmp_path, train=3)
    with pytest.raises(FileNotFoundError, match=r"^files: none of .*nothing-images-idx3-ubyte"):
        load_mnist_split(tmp_path / "nothing")
