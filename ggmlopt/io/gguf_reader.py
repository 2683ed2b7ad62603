"""A GGUF file read once, fast: its key-values as plain Python values and its
tensors as NumPy views of the memory-mapped file (no copy).

gguf-py's GGUFReader builds an object per array element of every key-value,
which takes seconds for the vocabulary of a modern model (150k tokens and
merges: 11 s here); this walks the header once with struct and NumPy instead.
The layout is GGUF v2/v3's (ggml's gguf.cpp): magic, version, tensor and
key-value counts, the key-values, the tensor infos (name, dims, type, offset),
then the data at the alignment (``general.alignment``, default 32).
"""
from __future__ import annotations

import math
import mmap
import struct
from typing import Any, Literal, NamedTuple

import numpy as np

__all__ = ["GgufFile", "TensorInfo"]

_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
            6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# ggml types NumPy holds as they are (ne reversed is the array's shape)
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
          27: np.int64, 28: np.float64, 30: np.uint16}   # 30: BF16, as raw 16-bit words


# the key-value readers: module functions, not closures in _parse (value calls
# itself: a closure doing so holds itself, a cycle through the map that kept the
# file mapped and open, an fd, after its last view was gone, until the garbage
# collector ran)
def _string(buf, order: Literal["<", ">"], pos: int) -> tuple[str, int]:
    n = struct.unpack_from(order + "Q", buf, pos)[0]
    start = pos + 8
    return bytes(buf[start:start + n]).decode("utf-8"), start + n


def _value(buf, order: Literal["<", ">"], vtype: int, pos: int, path: str) -> tuple[Any, int]:
    if vtype in _SCALARS:
        code, size = _SCALARS[vtype]
        v = struct.unpack_from(order + code, buf, pos)[0]
        return (bool(v) if vtype == 7 else v), pos + size
    if vtype == _STRING:
        return _string(buf, order, pos)
    if vtype != _ARRAY:
        raise ValueError(f"path: {path!r}: unknown value type {vtype}")
    item, n = struct.unpack_from(order + "IQ", buf, pos)
    pos += 12
    if item in _SCALARS:
        size = _SCALARS[item][1]
        dt = np.dtype(_NUMPY[item]).newbyteorder(order)
        arr = np.frombuffer(buf, dt, n, pos)
        return arr.tolist(), pos + n * size
    out = []
    for _ in range(n):
        v, pos = _value(buf, order, item, pos, path)
        out.append(v)
    return out, pos


class TensorInfo(NamedTuple):
    """One tensor of the file: ggml dims ``ne`` (fastest first), ggml type number
    and name, byte offset from the data start, byte size."""

    name: str
    ne: tuple[int, ...]
    type: int
    type_name: str
    offset: int
    nbytes: int


class GgufFile:
    """GgufFile(path): ``fields`` ({key: str, int, float, bool or list}),
    ``field_types`` ({key: (GGUF value type, item type of an array or None)}),
    ``tensors`` ({name: TensorInfo}, in the file's order), ``raw(name)`` (a
    read-only NumPy view of a tensor's bytes: shape ne reversed for plain
    types, (rows, bytes per row) uint8 for block types).  ValueError for a file
    that is no GGUF.  The mapping lives as long as a view of it does."""

    def __init__(self, path: str):
        import gguf  # its table of block sizes and type names
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._map)
        self._buf = buf
        try:
            self._parse(buf, gguf)
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as e:
            raise ValueError(f"path: {path!r} is not a valid GGUF file ({e})") from None

    def _parse(self, buf, gguf) -> None:
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"path: {self.path!r} is not a GGUF file (no GGUF magic)")
        order: Literal["<", ">"] = "<"
        version = struct.unpack_from("<I", buf, 4)[0]
        if version & 0xFFFF == 0:
            order = ">"
            version = struct.unpack_from(">I", buf, 4)[0]
        if version not in (2, 3):   # as gguf.cpp: v1 counts in 32 bits, v4 is unknown
            raise ValueError(f"path: {self.path!r} is GGUF version {version}; GGUF files "
                             "of versions 2 and 3 are read")
        ntensors, nkv = struct.unpack_from(order + "QQ", buf, 8)
        pos = 24
        u64 = struct.Struct(order + "Q")
        u32 = struct.Struct(order + "I")

        def string(pos):
            return _string(buf, order, pos)

        fields: dict[str, Any] = {}
        field_types: dict[str, tuple[int, int | None]] = {}
        for _ in range(nkv):
            key, pos = string(pos)
            if key in fields:
                raise ValueError(f"path: {self.path!r}: key {key!r} appears twice")
            vtype = u32.unpack_from(buf, pos)[0]
            item = u32.unpack_from(buf, pos + 4)[0] if vtype == _ARRAY else None
            field_types[key] = (vtype, item)
            fields[key], pos = _value(buf, order, vtype, pos + 4, self.path)
        sizes = {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}
        names = {int(t): t.name for t in gguf.GGMLQuantizationType}
        infos: list[TensorInfo] = []
        seen: set[str] = set()
        for _ in range(ntensors):
            name, pos = string(pos)
            ndim = u32.unpack_from(buf, pos)[0]
            if ndim > 4:   # GGML_MAX_DIMS
                raise ValueError(f"path: {self.path!r}: tensor {name!r} has {ndim} "
                                 "dimensions; at most 4 are valid")
            ne = struct.unpack_from(order + "q" * ndim, buf, pos + 4)
            pos += 4 + 8 * ndim
            ttype = u32.unpack_from(buf, pos)[0]
            offset = u64.unpack_from(buf, pos + 4)[0]
            pos += 12
            if ttype not in sizes:
                raise ValueError(f"path: {self.path!r}: tensor {name!r} has unknown type "
                                 f"{ttype}")
            block, type_size = sizes[ttype]
            count = math.prod(ne)
            if min(ne, default=0) < 0 or count >= 1 << 63:
                raise ValueError(f"path: {self.path!r}: tensor {name!r} has an invalid "
                                 f"shape {ne}")
            if (ne[0] if ne else 1) % block:
                raise ValueError(f"path: {self.path!r}: tensor {name!r} of type "
                                 f"{names.get(ttype, ttype)} has rows of {ne[0] if ne else 1} "
                                 f"values, not a multiple of its block of {block}")
            if name in seen:
                raise ValueError(f"path: {self.path!r}: tensor {name!r} appears twice")
            seen.add(name)
            infos.append(TensorInfo(name, tuple(int(n) for n in ne), ttype,
                                    names.get(ttype, str(ttype)), offset,
                                    count // block * type_size))
        alignment = fields.get("general.alignment", 32)
        if "general.alignment" in fields and (field_types["general.alignment"][0] != 4
                                              or alignment < 1 or alignment & (alignment - 1)):
            raise ValueError(f"path: {self.path!r}: general.alignment must be a power of 2 "
                             f"stored as uint32, got {alignment!r}")
        # each tensor where gguf.cpp expects it: right after the one before, padded
        expected = 0
        for t in infos:
            if t.offset != expected:
                raise ValueError(f"path: {self.path!r}: tensor {t.name!r} has offset "
                                 f"{t.offset}, expected {expected}")
            expected += -(-t.nbytes // alignment) * alignment
        self.data_start = -(-pos // alignment) * alignment
        self.fields = fields
        self.field_types = field_types
        self.tensors = {t.name: t for t in infos}
        self._order = order
        for t in infos:
            if self.data_start + t.offset + t.nbytes > len(buf):
                raise ValueError(f"path: {self.path!r} is a truncated GGUF file (tensor "
                                 f"{t.name!r} ends past its {len(buf)} bytes)")

    def raw(self, name: str) -> np.ndarray:
        """A read-only view of tensor name's bytes in the mapped file."""
        t = self.tensors[name]
        start = self.data_start + t.offset
        if t.type in _PLAIN:
            dt = np.dtype(_PLAIN[t.type]).newbyteorder(self._order)
            count = t.nbytes // dt.itemsize
            return np.frombuffer(self._buf, dt, count, start).reshape(t.ne[::-1])
        if self._order == ">":
            # a block's scales are swapped there, and ggml's and gguf-py's block
            # readers read little-endian words: garbage, not an error, otherwise
            raise ValueError(f"path: {self.path!r} is a big-endian GGUF file; its tensor "
                             f"{name!r} of type {t.type_name} cannot be read (llama.cpp "
                             f"refuses the file): convert it with gguf_convert_endian.py "
                             f"little")
        row = t.nbytes // max(1, int(np.prod(t.ne[1:], dtype=np.int64)))
        data = np.frombuffer(self._buf, np.uint8, t.nbytes, start)
        return data.reshape(tuple(t.ne[1:][::-1]) + (row,))

    def read(self, name: str, rows: int | None = None) -> np.ndarray:
        """raw(name)'s bytes read into a new array (the first rows only when
        given): reading, not mapping, keeps the file's pages out of this
        process's memory once the array is dropped."""
        view = self.raw(name)
        if rows is not None and view.ndim > 1:
            view = view.reshape(-1, view.shape[-1])[:rows]
        out = np.empty(view.shape, view.dtype)
        start = self.data_start + self.tensors[name].offset
        with open(self.path, "rb") as f:
            f.seek(start)
            f.readinto(out.reshape(-1).view(np.uint8).data)
        return out

    def float32(self, name: str, rows: int | None = None) -> np.ndarray:
        """Tensor name as a new float32 array of shape ne reversed (block types
        dequantized by gguf-py, exactly as ggml does); its first rows only when
        given (as a 2-D array)."""
        import gguf
        t = self.tensors[name]
        raw = self.read(name, rows)
        if t.type == 30:   # BF16: the upper half of a float32
            return (raw.astype(np.uint32) << 16).view(np.float32)
        if t.type in _PLAIN:
            return raw if raw.dtype == np.float32 else raw.astype(np.float32)
        data = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.type))
        shape = t.ne[::-1] if rows is None else (-1, t.ne[0])
        return np.asarray(data, np.float32).reshape(shape)
