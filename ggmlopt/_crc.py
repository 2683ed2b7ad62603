"""CRC-32 of large buffers: the fingerprint a checkpoint keeps of its frozen
base and that MPI ranks compare of their datasets."""
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
