"""Tokenizers: text to token ids and back.

Every tokenizer follows one protocol (Tokenizer): ``encode(text) -> int32 ids``,
``decode(ids) -> str``, ``vocab_size`` and ``eos_id`` (``bos_id`` None when the
vocabulary has no beginning-of-sequence token).  ByteTokenizer needs no training
and no files: each UTF-8 byte is a token, so any text round-trips.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from ._optional import import_optional

__all__ = ["BPETokenizer", "ByteTokenizer", "Tokenizer"]


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


# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp) by tokenizer.ggml.pre name
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                   r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_PATTERNS = {
    "gpt-2": _GPT2_PATTERN, "phi-2": _GPT2_PATTERN, "mpt": _GPT2_PATTERN,
    "olmo": _GPT2_PATTERN, "jais": _GPT2_PATTERN,
    "llama3": _LLAMA3_PATTERN, "llama-v3": _LLAMA3_PATTERN, "llama-bpe": _LLAMA3_PATTERN,
}


class BPETokenizer:
    """BPETokenizer(tokens, merges, *, token_types=None, eos_id=None, bos_id=None,
    add_bos=False, pre="gpt-2")

    A byte-level BPE tokenizer (GPT-2's kind; a GGUF's ``gpt2``-type vocabulary)
    run by the ``tokenizers`` library (the ``tokenizers`` extra: ``pip install
    ggmlopt[tokenizers]``, imported when one is made).

    tokens: the vocabulary, list of str (id i is tokens[i]) in GPT-2's
    byte-to-unicode form; merges: list of ``"left right"`` str in rank order;
    token_types: llama.cpp's type per token (1 normal, 3 control ...; default
    all 1); pre: llama.cpp's pre-tokenizer name (``tokenizer.ggml.pre``):
    ``gpt-2`` and ``llama-bpe`` (and their aliases) are reproduced, any other
    falls back to GPT-2's with a UserWarning.  add_bos: whether llama.cpp puts
    bos_id first (``encode`` never does: prepend it where a protocol wants it).

    ``encode(text)`` -> int32 (n,) ids, control tokens written in the text
    staying plain text (llama.cpp's ``parse_special=false``);
    ``decode(ids)`` -> str (invalid UTF-8 replaced by U+FFFD).
    """

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], *,
                 token_types: Sequence[int] | None = None, eos_id: int | None = None,
                 bos_id: int | None = None, add_bos: bool = False, pre: str = "gpt-2"):
        tk = import_optional("tokenizers", "tokenizers", "BPETokenizer")
        self.tokens = [str(t) for t in tokens]
        self.merges = [str(m) for m in merges]
        n = len(self.tokens)
        self.token_types = [1] * n if token_types is None else [int(t) for t in token_types]
        if len(self.token_types) != n:
            raise ValueError(f"token_types: expected {n} values (one per token), got "
                             f"{len(self.token_types)}")
        for name, value in (("eos_id", eos_id), ("bos_id", bos_id)):
            if value is not None and not 0 <= int(value) < n:
                raise IndexError(f"{name}: {value} is outside the vocabulary [0, {n})")
        self.vocab_size = n
        self.eos_id = None if eos_id is None else int(eos_id)
        self.bos_id = None if bos_id is None else int(bos_id)
        self.add_bos = bool(add_bos)
        self.pre = str(pre)
        pattern = PRE_TOKENIZER_PATTERNS.get(self.pre)
        if pattern is None:
            warnings.warn(f"pre: llama.cpp's pre-tokenizer {self.pre!r} is not reproduced; "
                          "GPT-2's is used, so some texts may tokenize differently",
                          UserWarning, stacklevel=2)
            pattern = _GPT2_PATTERN
        vocab = {t: i for i, t in enumerate(self.tokens)}
        pairs = []
        for m in self.merges:
            left, sep, right = m.partition(" ")
            if not sep:
                raise ValueError(f"merges: {m!r} is not 'left right'")
            # tokenizers wants every merge's result in the vocabulary; one that is not
            # (ByteTokenizer's GGUF vocabulary has one, which never applies) is left out
            if left + right in vocab:
                pairs.append((left, right))
        self._tk: Any = tk.Tokenizer(tk.models.BPE(vocab, pairs))
        self._tk.pre_tokenizer = tk.pre_tokenizers.Sequence([
            tk.pre_tokenizers.Split(tk.Regex(pattern), behavior="isolated"),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        self._tk.decoder = tk.decoders.ByteLevel()

    def encode(self, text: str) -> npt.NDArray[np.int32]:
        """text (str) -> int32 ids of shape (n,), without BOS."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        return np.asarray(self._tk.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: npt.ArrayLike) -> str:
        """ids (integers in [0, vocab_size), shape (n,)) -> str."""
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
            raise TypeError(f"ids: expected integer token ids, got dtype {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"ids: expected shape (n,), got {arr.shape}")
        bad = np.flatnonzero((arr < 0) | (arr >= self.vocab_size))
        if bad.size:
            i = int(bad[0])
            raise IndexError(f"ids: id {int(arr[i])} at position {i} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        return str(self._tk.decode(arr.astype(np.int64).tolist(), skip_special_tokens=False))

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, pre={self.pre!r})"
