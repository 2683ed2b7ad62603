"""CRC-32 of large buffers: the fingerprint a checkpoint keeps of its frozen
base and that MPI ranks compare of their datasets (and a cheap sampled one
that tells when such a buffer changed)."""
from __future__ import annotations

import zlib
from typing import Any

# the bytes a CRC-32 call reads at once (zlib releases the GIL for each)
_CRC_CHUNK = 1 << 24


def crc32_bytes(raw: Any, value: int = 0) -> int:
    """zlib's CRC-32 of a buffer's bytes, continued from value, a chunk at a
    time: every byte counts (a base whose embedding differs in a few rows is
    another base) at about the speed of memory (4 GB/s on a Zen 4 core)."""
    view = memoryview(raw).cast("B")
    for at in range(0, len(view), _CRC_CHUNK):
        value = zlib.crc32(view[at:at + _CRC_CHUNK], value)
    return value


# the sampled CRC's stretches: 64 of 4 KiB, spread evenly (a quarter of a ms)
_STRETCH, _STRETCHES = 4096, 64


def sampled_crc32(raw: Any, value: int = 0) -> int:
    """CRC-32 of 64 stretches of 4 KiB spread over a buffer's bytes (all of a
    smaller one): it changes when a buffer is refilled or rewritten in large
    parts, not reliably when a few bytes change."""
    view = memoryview(raw).cast("B")
    size = len(view)
    if size <= _STRETCH * _STRETCHES:
        return zlib.crc32(view, value)
    gap = (size - _STRETCH) // (_STRETCHES - 1)
    for i in range(_STRETCHES):
        at = i * gap
        value = zlib.crc32(view[at:at + _STRETCH], value)
    return value
