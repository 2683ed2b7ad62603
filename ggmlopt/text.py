"""Tokenizers: text to token ids and back.

Every tokenizer follows one protocol (Tokenizer): ``encode(text) -> int32 ids``,
``decode(ids) -> str``, ``vocab_size`` and ``eos_id`` (``bos_id`` None when the
vocabulary has no beginning-of-sequence token).  ByteTokenizer needs no training
and no files: each UTF-8 byte is a token, so any text round-trips.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = ["ByteTokenizer", "Tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What ggmlopt needs of a tokenizer (generation, perplexity, GGUF export)."""

    vocab_size: int
    eos_id: int | None
    bos_id: int | None

    def encode(self, text: str) -> npt.NDArray[np.int32]:
        """text as token ids, int32 of shape (n,)."""
        ...

    def decode(self, ids: npt.ArrayLike) -> str:
        """The text of token ids (any integer array-like of shape (n,))."""
        ...


class ByteTokenizer:
    """ByteTokenizer(): the 256 byte values of UTF-8 as tokens 0..255, and
    ``<|endoftext|>`` as token 256 (``vocab_size`` 257, ``eos_id`` 256, no BOS).

    ``encode(text)`` is ``np.frombuffer(text.encode("utf-8"))`` as int32 (lone
    surrogates, which are not UTF-8, pass as their 3-byte forms); ``decode(ids)``
    joins the bytes and decodes them as UTF-8 with invalid sequences replaced by
    U+FFFD, writing the end-of-text token as ``<|endoftext|>`` (or dropping it
    with ``skip_special=True``).  ``decode(encode(s)) == s`` for every valid
    Unicode string.
    """

    vocab_size = 257
    eos_id = 256
    bos_id = None
    eos_text = "<|endoftext|>"

    def encode(self, text: str) -> npt.NDArray[np.int32]:
        """text (str) -> int32 ids of shape (number of UTF-8 bytes,)."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        data = text.encode("utf-8", errors="surrogatepass")
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids: npt.ArrayLike, *, skip_special: bool = False) -> str:
        """ids (integers in [0, 257), shape (n,)) -> str; bytes that are not valid
        UTF-8 become U+FFFD; token 256 becomes ``<|endoftext|>`` unless
        skip_special."""
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
            raise TypeError(f"ids: expected integer token ids, got dtype {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"ids: expected shape (n,), got {arr.shape}")
        arr = arr.astype(np.int64)
        bad = np.flatnonzero((arr < 0) | (arr >= self.vocab_size))
        if bad.size:
            i = int(bad[0])
            raise IndexError(f"ids: id {int(arr[i])} at position {i} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        pieces = []
        start = 0
        for end in np.flatnonzero(arr == self.eos_id).tolist() + [arr.size]:
            pieces.append(arr[start:end].astype(np.uint8).tobytes().decode("utf-8", "replace"))
            if end < arr.size and not skip_special:
                pieces.append(self.eos_text)
            start = end + 1
        return "".join(pieces)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eos_id=256)"
