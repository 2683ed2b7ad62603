"""BPE over raw UTF-8 with spaces as U+2581: llama.cpp's ``gemma4`` vocabulary type.

Gemma 4's tokenizer is a BPE of SentencePiece's shape: every space (and any U+2581
already in the text) is the piece character U+2581, lines and runs of newlines are
the only words, the merges run over characters (not GPT-2's byte map), and a
symbol the vocabulary lacks falls back to its bytes' ``<0xXX>`` tokens
(llama.cpp's ``llm_tokenizer_bpe_session`` with ``LLAMA_VOCAB_PRE_TYPE_GEMMA4``).
The tokenizers library runs the same pipeline (Replace, a newline Split, BPE with
byte fallback); the vectors llama.cpp ships for the vocabulary check it.

Long texts go a word at a time (ggmlopt._bpe_words): lines are cut further before
each run of spaces, except after a character that some token joins to a following
U+2581 (Gemma 4 has one such token, ``>▁</``): no merge can cross such a cut, so
the ids equal the whole line's.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from ._bpe_words import WordEncoder
from .text import TOKEN_BYTE, TOKEN_NORMAL, BPETokenizer

__all__ = ["LINES", "MetaspaceBPETokenizer", "joined_before_space", "word_pattern"]

SPACE = "\u2581"
#: llama.cpp's words for this type: lines, and runs of newlines
LINES = r"[^\n]+|[\n]+"


def joined_before_space(pieces: Iterable[str]) -> str:
    """The characters other than U+2581 that some piece holds right before a
    U+2581: a word may not be cut between such a character and a space."""
    found: set[str] = set()
    for text in pieces:
        if SPACE in text[1:]:
            found.update(a for a, b in zip(text, text[1:]) if b == SPACE and a != SPACE)
    return "".join(sorted(found))


def word_pattern(joined: str) -> str:
    """A line's words: each starts with its run of spaces (or U+2581s); a character
    of joined keeps the spaces after it in its word."""
    spaces = f"[ {SPACE}]"
    if not joined:
        return f"{spaces}*[^ {SPACE}]+|{spaces}+"
    cls = "".join(re.escape(c) for c in joined)
    return f"{spaces}*(?:[^ {SPACE}{cls}]|[{cls}]{spaces}*)+|{spaces}+"


class MetaspaceBPETokenizer(BPETokenizer):
    """MetaspaceBPETokenizer(tokens, merges, *, token_types=None, eos_id=None,
    bos_id=None, add_bos=True, eot_id=None, eom_id=None, chat_template=None,
    add_eos=False)

    A BPE over raw UTF-8 with spaces written as U+2581 and ``<0xXX>`` byte
    fallback: a GGUF's ``gemma4``-type vocabulary (Gemma 4), encoded and decoded
    as llama.cpp does.  tokens are the pieces as the vocabulary stores them (U+2581
    for a space), merges ``"left right"`` in rank order.  Everything else (special
    tokens, ``parse_special``, ``decode``, the lookups, the chat template) is
    BPETokenizer's.  llama.cpp always puts BOS first for this type, so add_bos
    defaults to True.
    """

    #: tokenizer.ggml.model of the vocabulary in a GGUF file
    gguf_model = "gemma4"

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], *,
                 token_types: Sequence[int] | None = None, eos_id: int | None = None,
                 bos_id: int | None = None, add_bos: bool = True,
                 eot_id: int | None = None, eom_id: int | None = None,
                 chat_template: str | None = None, add_eos: bool = False):
        super().__init__(tokens, merges, token_types=token_types, eos_id=eos_id,
                         bos_id=bos_id, add_bos=add_bos, pre="gemma4", eot_id=eot_id,
                         eom_id=eom_id, chat_template=chat_template, add_eos=add_eos)

    def _pipelines(self, tk: Any, vocab: dict[str, int],
                   pairs: list[tuple[str, str]]) -> tuple[Any, WordEncoder | None]:
        whole = tk.Tokenizer(tk.models.BPE(vocab, pairs, byte_fallback=True))
        whole.normalizer = tk.normalizers.Replace(" ", SPACE)
        whole.pre_tokenizer = tk.pre_tokenizers.Split(tk.Regex(LINES), behavior="isolated")
        whole.decoder = tk.decoders.Sequence([tk.decoders.Replace(SPACE, " "),
                                              tk.decoders.ByteFallback(),
                                              tk.decoders.Fuse()])
        word_tk = tk.Tokenizer(tk.models.BPE(vocab, pairs, byte_fallback=True))
        word_tk.normalizer = tk.normalizers.Replace(" ", SPACE)
        joined = joined_before_space(t for t, kind in zip(self.tokens, self.token_types)
                                     if kind == TOKEN_NORMAL)
        return whole, WordEncoder.make([LINES, word_pattern(joined)], word_tk)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token_id stands for in text: a byte token's byte, a piece's
        UTF-8 with U+2581 as a space (a control or user-defined token's own text)."""
        text = self.tokens[token_id]
        kind = self.token_types[token_id]
        if kind == TOKEN_BYTE and len(text) == 6 and text.startswith("<0x"):
            return bytes([int(text[3:5], 16)])
        if kind == TOKEN_NORMAL:
            text = text.replace(SPACE, " ")
        return text.encode("utf-8")

    def __repr__(self) -> str:
        return f"MetaspaceBPETokenizer(vocab_size={self.vocab_size})"
