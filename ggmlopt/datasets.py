"""Readers for datasets on disk: IDX files (the format MNIST-style datasets ship in),
and instruction data in JSON Lines (read_jsonl, from ggmlopt.instruct).

IDX layout (big-endian): two zero bytes, a type code, the number of dimensions
``ndim``, then ``ndim`` uint32 sizes, then the elements in C order.  Unlike
ggml's example loader, which reads past a short file silently, every check here
(magic, type, sizes, exact file length) raises a ValueError naming the file.
"""
from __future__ import annotations

import gzip
import os
import zlib
from typing import NamedTuple

import numpy as np

from .dataset import Dataset
from .instruct import read_jsonl

__all__ = ["IDX_DTYPES", "MNIST_FILES", "MnistSplits", "load_idx", "load_mnist",
           "load_mnist_split", "read_jsonl"]

# IDX type code -> element dtype (big-endian as stored)
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_GZIP_MAGIC = b"\x1f\x8b"

# split -> (images file, labels file), without the optional .gz suffix
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# a file prefix ("train", "data/MNIST/raw/t10k") + these = the split's two files
_IMAGES_SUFFIX, _LABELS_SUFFIX = "-images-idx3-ubyte", "-labels-idx1-ubyte"


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] != _GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path}: not a valid gzip file ({e})") from None


def load_idx(path: str | os.PathLike) -> np.ndarray:
    """The array stored in an IDX file (optionally gzip-compressed: detected by its
    magic bytes, whatever the name).

    Returns a C-contiguous array in native byte order of the file's element type
    (uint8, int8, int16, int32, float32 or float64) and shape.  Raises
    FileNotFoundError for a missing file and ValueError for a wrong magic number,
    an unknown type code, or a length that does not match the header.
    """
    path = os.fspath(path)
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise ValueError(f"{path}: {len(raw)} bytes, too short for an IDX header (4 bytes)")
    if raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (magic bytes {raw[:4].hex()}, expected "
                         "00 00 <type> <ndim>)")
    code, ndim = raw[2], raw[3]
    if code not in IDX_DTYPES:
        known = ", ".join(f"0x{c:02x}" for c in IDX_DTYPES)
        raise ValueError(f"{path}: unknown IDX element type 0x{code:02x} (expected one of "
                         f"{known})")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated header: {ndim} dimensions need {header} bytes, "
                         f"the file has {len(raw)}")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = IDX_DTYPES[code]
    expected = header + int(np.prod(shape, dtype=object)) * dtype.itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "trailing bytes"
        raise ValueError(f"{path}: {what}: shape {shape} of {dtype.name} needs {expected} "
                         f"bytes, the file has {len(raw)}")
    arr = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="))  # a writable copy that owns its memory


def _candidates(path: str) -> tuple[str, ...]:
    # some mirrors name the files with a dot: train-images.idx3-ubyte
    directory, name = os.path.split(path)
    dotted = os.path.join(directory, name.replace("-idx", ".idx"))
    return tuple(dict.fromkeys((path, path + ".gz", dotted, dotted + ".gz")))


def _find(path: str, what: str) -> str:
    """The existing file among path and its .gz / dot-named forms."""
    candidates = _candidates(path)
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"{what}: none of {', '.join(candidates)} found")


class MnistSplits(NamedTuple):
    """The train and test Datasets of load_mnist."""

    train: Dataset
    test: Dataset


def _split_files(split, directory: str | None, what: str) -> tuple[str, str]:
    """(images path, labels path) of a split given as a file prefix or a pair of
    paths (relative ones under directory when it is given)."""
    if isinstance(split, (tuple, list)):
        if len(split) != 2:
            raise ValueError(f"{what}: expected a file prefix or (images path, labels path), "
                             f"got {len(split)} items")
        images, labels = (os.fspath(p) for p in split)
        paths = [os.path.join(directory, p) if directory else p for p in (images, labels)]
        return _find(paths[0], what), _find(paths[1], what)
    try:
        prefix = os.fspath(split)
    except TypeError:
        raise TypeError(f"{what}: expected a file prefix (str or os.PathLike) or (images "
                        f"path, labels path), got {type(split).__name__}") from None
    if isinstance(prefix, bytes):
        prefix = os.fsdecode(prefix)
    prefix = os.path.join(directory, prefix) if directory else prefix
    for suffix in (_IMAGES_SUFFIX + ".gz", _IMAGES_SUFFIX):  # the images file itself
        if prefix.endswith(suffix):
            prefix = prefix[:-len(suffix)]
            break
    prefix = prefix.removesuffix("-")
    return _find(prefix + _IMAGES_SUFFIX, what), _find(prefix + _LABELS_SUFFIX, what)


def _mnist_split(images_path: str, labels_path: str, nclasses: int,
                 ndata_shard: int) -> Dataset:
    images = load_idx(images_path)
    labels = load_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(f"{images_path}: expected uint8 images of shape (n, rows, cols), "
                         f"got {images.dtype} {images.shape}")
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise ValueError(f"{labels_path}: expected uint8 labels of shape (n,), got "
                         f"{labels.dtype} {labels.shape}")
    if labels.shape[0] != images.shape[0]:
        raise ValueError(f"{labels_path}: {labels.shape[0]} labels for {images.shape[0]} "
                         f"images in {images_path}")
    if labels.size and int(labels.max()) >= nclasses:
        raise ValueError(f"{labels_path}: label {int(labels.max())} out of range for "
                         f"nclasses={nclasses}")
    n = images.shape[0]
    ds = Dataset(images.shape[1] * images.shape[2], nclasses, n, ndata_shard,
                 data_dtype=np.uint8, label_dtype=np.float32, data_scale=1.0 / 255.0)
    ds.data[...] = images.reshape(n, -1)
    onehot = ds.labels
    assert onehot is not None
    onehot[np.arange(n), labels] = 1.0
    return ds


def load_mnist_split(files: str | os.PathLike | tuple, ndata_shard: int = 1,
                     nclasses: int = 10) -> Dataset:
    """One MNIST-style Dataset from its two IDX files.

    files: the files' common prefix, e.g. ``"data/MNIST/raw/t10k"`` for
    t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte (each possibly with .gz,
    or dot-named: t10k-images.idx3-ubyte; the images file's own name works as
    well), or a pair (images path, labels path), as ggml's mnist-train and
    mnist-eval take them.  Data and labels as in load_mnist.
    """
    return _mnist_split(*_split_files(files, None, "files"), nclasses, ndata_shard)


def load_mnist(directory: str | os.PathLike | None = None, ndata_shard: int = 1,
               nclasses: int = 10, *, train: str | os.PathLike | tuple = "train",
               test: str | os.PathLike | tuple = "t10k") -> MnistSplits:
    """MNIST-style train and test Datasets from the four standard IDX files in
    directory (train-images-idx3-ubyte, train-labels-idx1-ubyte,
    t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each possibly with .gz, or
    dot-named as some mirrors have them: train-images.idx3-ubyte, ...).

    train, test: each split's file prefix ("train", "t10k" by default; any other
    such as "train60k" for train60k-images-idx3-ubyte ..., or a path prefix) or
    a pair (images path, labels path); relative ones are under directory when
    it is given (directory None: the current directory, or the paths as given).

    Data: uint8, (n, rows * cols), data_scale 1/255 (get_batch into a float32
    batch gives pixels in [0, 1]).  Labels: one-hot float32, (n, nclasses).
    Returns MnistSplits(train, test).  FileNotFoundError names the files looked
    for; ValueError a file that is not what MNIST's is.
    """
    if directory is not None:
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"directory: {directory} is not a directory")
    files = [_split_files(split, directory, name) for split, name in
             ((train, "train"), (test, "test"))]
    return MnistSplits(*(_mnist_split(*f, nclasses, ndata_shard) for f in files))
