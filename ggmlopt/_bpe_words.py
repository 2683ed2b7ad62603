"""A long text's byte-level BPE ids, one word at a time, each word merged once.

The tokenizers library spends most of an encode in its regex engine (Oniguruma)
running llama.cpp's pre-tokenizer patterns; the ``regex`` package runs the same
patterns several times faster.  WordEncoder cuts the text into words with it
(each pattern applied in turn to the pieces the previous one left, matches and
the text between them both kept, as the library's ``Split(behavior="isolated")``
and llama.cpp's ``unicode_regex_split`` do), merges every word it has not seen
through the library's BPE (one ``encode_batch`` of the new words), and keeps
each word's ids: a text then costs one regex pass and one lookup per word.

The ids are the library's for the whole text: words never merge across their
boundaries, and the cache holds what the library gives each word (tests compare
both on llama.cpp's tokenizer vectors and a megabyte of mixed text).
"""
from __future__ import annotations

import importlib
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ._byte_level import GPT2_BYTE_STRINGS
from .pretokenizers import PIECE_END, staged_patterns, word_patterns

__all__ = ["WordEncoder"]

#: distinct words kept; past it the cache starts afresh (a bound on its memory)
CACHE_WORDS = 1 << 18


_BYTE_LEVEL: dict[int, str] | None = None


def _byte_level_table() -> dict[int, str]:
    """GPT-2's byte-to-unicode map as a str.translate table over a word's bytes
    read as Latin-1 (one character per byte), made whole on first use."""
    global _BYTE_LEVEL
    table = _BYTE_LEVEL
    if table is None:
        table = _BYTE_LEVEL = dict(enumerate(GPT2_BYTE_STRINGS))
    return table


class WordEncoder:
    """WordEncoder.make(regexes, word_tokenizer): the words of a text by the
    pre-tokenizer's regexes (str patterns in the order they apply), their ids
    by word_tokenizer (a tokenizers.Tokenizer that byte-maps one word and runs
    BPE on it: no splitting, no added tokens).  None when the ``regex`` package
    is not installed (the tokenizers library then does the whole encode)."""

    def __init__(self, patterns: Sequence[Any], word_tokenizer: Any,
                 whole_words: Mapping[str, int] | None = None,
                 staged: Sequence[Any] | None = None) -> None:
        # each pattern in one capturing group: its split() alternates the text
        # between matches and the matches, in C
        self._patterns = list(patterns)
        # the same cuts run over the whole text, the pieces joined by PIECE_END
        # (pretokenizers.staged_patterns), or None
        self._staged = None if staged is None else list(staged)
        self._tk = word_tokenizer
        self._cache: dict[str, list[int]] = {}
        self._whole = whole_words

    @classmethod
    def make(cls, regexes: Sequence[str], word_tokenizer: Any,
             whole_words: Mapping[str, int] | None = None) -> WordEncoder | None:
        """whole_words: for a BPE that looks a word up whole before any merge
        (ignore_merges, Llama 3's), its byte-level vocabulary {token: id}: a new
        word found there is that token without a call into the library."""
        try:
            regex = importlib.import_module("regex")   # the tokenizers extra
        except ImportError:
            return None
        patterns = [regex.compile(f"({r})") for r in word_patterns(tuple(regexes))]
        if any(p.groups != 1 for p in patterns):   # a pattern with groups of its own
            return None
        steps = staged_patterns(tuple(regexes))
        staged = None if steps is None else [
            (re if engine == "re" else regex).compile(f"({r})") for engine, r in steps]
        return cls(patterns, word_tokenizer, whole_words, staged)

    def words(self, text: str) -> list[str]:
        """text cut by every pattern in turn, matches and gaps both kept."""
        if self._staged is not None and PIECE_END not in text:
            # each step cuts every piece in one call: split() alternates gaps and
            # matches, and the join marks every cut for the next step and the last
            joined = text
            for pattern in self._staged:
                joined = PIECE_END.join(pattern.split(joined))
            return list(filter(None, joined.split(PIECE_END)))
        pieces = [text]
        for pattern in self._patterns:
            # the matches alone (the group is the whole match) when they cover every
            # piece: no text between them to keep (a one-character piece is itself)
            findall = pattern.findall
            found: list[str] = []
            for piece in pieces:
                if len(piece) == 1:
                    found.append(piece)
                else:
                    found += findall(piece)
            if sum(map(len, found)) == len(text):
                pieces = [w for w in found if w]
                continue
            split = pattern.split   # matches and the text between them
            pieces = [w for piece in pieces for w in split(piece) if w]
        return pieces

    def encode(self, text: str) -> list[int]:
        """The ids of text (no special tokens in it: the caller cut them out)."""
        words = self.words(text)
        cache = self._cache
        try:   # every word seen before: one lookup each
            return list(itertools.chain.from_iterable(map(cache.__getitem__, words)))
        except KeyError:
            pass
        new = [w for w in dict.fromkeys(words) if w not in cache]
        if len(cache) + len(new) > CACHE_WORDS:
            # a new dict, not clear(): another thread may be reading the old one
            cache = self._cache = {}
            new = list(dict.fromkeys(words))
        if self._whole is not None:   # words that are a token, as the library finds them
            whole, table = self._whole, _byte_level_table()
            rest = []
            for word in new:
                found = whole.get(word.encode("utf-8").decode("latin-1").translate(table))
                if found is None:
                    rest.append(word)
                else:
                    cache[word] = [found]
            new = rest
        # (encode_batch_fast, tokenizers >= 0.20: the same ids without offsets, in a
        # third of the time for many short words)
        encode = getattr(self._tk, "encode_batch_fast", None) or self._tk.encode_batch
        for word, enc in zip(new, encode(new, add_special_tokens=False)):
            cache[word] = enc.ids
        return list(itertools.chain.from_iterable(map(cache.__getitem__, words)))
