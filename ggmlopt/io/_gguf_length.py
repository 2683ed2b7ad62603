"""How many bytes a GGUF file needs: its header walked field by field, so a file cut
short is reported as truncated (with the bytes it has and needs) instead of by
whatever the GGUF reader trips over first."""
from __future__ import annotations

import struct

__all__ = ["gguf_truncation"]

_MAGIC = b"GGUF"
_ALIGNMENT_KEY = "general.alignment"
_DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
# GGUF value type -> struct code of a scalar (8: string, 9: array)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
_STRING, _ARRAY = 8, 9


class _Short(Exception):
    """The file ended while `needed` bytes were wanted from its start."""

    def __init__(self, needed: int, what: str):
        super().__init__(needed, what)
        self.needed, self.what = needed, what


class _Corrupt(Exception):
    """A header value that no GGUF file has: not a truncation, left to the reader."""


class _Cursor:
    def __init__(self, f, order: str, size: int):
        self.f, self.order, self.pos, self.size = f, order, 0, size

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > self.size:   # never read (allocate) more than the file has
            raise _Short(self.pos + n, what)
        raw = self.f.read(n)
        if len(raw) < n:
            raise _Short(self.pos + n, what)
        self.pos += n
        return raw

    def scalar(self, code: str, what: str):
        return struct.unpack(self.order + code, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str) -> bytes:
        n = self.scalar("Q", what)
        if n > 1 << 40:
            raise _Corrupt
        return self.take(n, what)


def _value(c: _Cursor, vtype: int, what: str):
    if vtype in _SCALAR:
        return c.scalar(_SCALAR[vtype], what)
    if vtype == _STRING:
        return c.string(what)
    if vtype != _ARRAY:
        raise _Corrupt
    item_type, n = c.scalar("I", what), c.scalar("Q", what)
    if item_type not in _SCALAR:
        for _ in range(n):
            _value(c, item_type, what)
        return None
    size = struct.calcsize(_SCALAR[item_type])
    if n * size > 1 << 40:
        raise _Corrupt
    c.take(n * size, what)
    return None


def _needed(f, size: int, quant_sizes) -> int:
    """The bytes the file at f needs, raising _Short where its header ends early."""
    c = _Cursor(f, "<", size)
    if c.take(4, "magic") != _MAGIC:
        raise _Corrupt
    version = c.scalar("I", "version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        c.order = ">"
    ntensors = c.scalar("Q", "tensor count")
    nkv = c.scalar("Q", "key-value count")
    alignment = _DEFAULT_ALIGNMENT
    for i in range(nkv):
        key = c.string(f"key-value {i}")
        vtype = c.scalar("I", f"key-value {i}")
        value = _value(c, vtype, f"key-value {i}")
        if key == _ALIGNMENT_KEY.encode() and vtype == 4 and value and value & (value - 1) == 0:
            alignment = value
    tensors = []
    for i in range(ntensors):
        c.string(f"tensor info {i}")
        ndim = c.scalar("I", f"tensor info {i}")
        if ndim > 4:
            raise _Corrupt
        ne = [c.scalar("Q", f"tensor info {i}") for _ in range(ndim)]
        ttype = c.scalar("I", f"tensor info {i}")
        if ttype not in quant_sizes:   # a misread header, not a short file: the reader says
            raise _Corrupt
        offset = c.scalar("Q", f"tensor info {i}")
        tensors.append((ne, ttype, offset))
    data_start = -(-c.pos // alignment) * alignment
    # a file of no tensors (llama.cpp's vocabulary files) ends with its header, unpadded
    end = data_start if tensors else c.pos
    for ne, ttype, offset in tensors:
        block, type_size = quant_sizes[ttype]
        nelements = 1
        for n in ne:
            nelements *= n
        nbytes = nelements // block * type_size
        # ggml reads every tensor's data padded to the alignment
        end = max(end, data_start + offset + -(-nbytes // alignment) * alignment)
    return end


def gguf_truncation(path: str, quant_sizes) -> str | None:
    """What is missing when the GGUF file at path is cut short ("<size> bytes;
    <what> needs <n>", for an error message), else None (complete, or not a GGUF
    file: the reader says).

    quant_sizes: {ggml type number: (elements per block, bytes per block)}, the
    gguf package's GGML_QUANT_SIZES."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(0)
        if size < len(_MAGIC):
            return (f"{size} bytes; the GGUF magic needs 4"
                    if _MAGIC.startswith(f.read()) else None)
        try:
            needed = _needed(f, size, {int(k): v for k, v in quant_sizes.items()})
        except _Short as e:
            return f"{size} bytes; the header's {e.what} needs at least {e.needed}"
        except (_Corrupt, struct.error, OverflowError):
            return None
    if size < needed:
        return f"{size} bytes; the tensor data needs {needed}"
    return None
