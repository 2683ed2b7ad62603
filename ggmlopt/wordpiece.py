"""WordPiece vocabularies as llama.cpp tokenizes them (its ``bert`` type, WPM:
BERT, BGE and the other encoders a GGUF may carry), with no dependency beyond
the standard library.

``encode`` follows llama-vocab.cpp's ``llm_tokenizer_wpm_session``: the text is
cut into words at whitespace, dropping NUL, U+FFFD and control characters;
each punctuation character, each ASCII symbol and each CJK ideograph is a word
of its own; with the vocabulary's ``lowercase`` option letters are lowercased
(``strip_accents``, on by default with it, also maps each character to the first
of its canonical decomposition, as llama.cpp's NFD table does, and drops
combining marks).  Each word, with U+2581 in front (the GGUF stores a
word's first piece so, and its continuations bare: BERT's ``##``), is taken
greedily as the longest vocabulary piece at each position; a word with a
position no piece starts leaves only the unknown token.  llama.cpp's test
vectors (``ggml-vocab-bert-bge.gguf``) are the oracle.
"""
from __future__ import annotations

import threading
import unicodedata
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ._args import bool_arg
from .text import (
    TOKEN_CONTROL,
    TOKEN_USER_DEFINED,
    Vocabulary,
    check_text,
    checked_ids,
    ids_around_special,
)

__all__ = ["WordPieceTokenizer"]

SPACE = "\u2581"   # the GGUF's mark of a word's first piece
# llama.cpp's whitespace (unicode_set_whitespace), not Python's str.isspace
_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                         0x2028, 0x2029, 0x202F, 0x205F, 0x3000])
# the CJK ideograph blocks llama.cpp (and Hugging Face's BertPreTokenizer) cut alone
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
        (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
_WORD_CACHE = 1 << 16   # words remembered with their ids (natural text repeats them)
_MAPPED_CHARACTERS = 1 << 16   # characters remembered by a normalizer's map


class _CharacterMap(dict):
    """str.translate's table for one set of normalizer options, each character's
    entry made on its first use (see WordPieceTokenizer.words)."""

    def __init__(self, lowercase: bool, strip_accents: bool) -> None:
        super().__init__()
        self.lowercase, self.strip_accents = lowercase, strip_accents

    def __missing__(self, cp: int) -> str | None:
        ch = chr(cp)
        if self.strip_accents:
            ch = _first_of_nfd(ch)
        cp2 = ord(ch)
        cat = unicodedata.category(ch)
        if cp2 in _WHITESPACE:
            out: str | None = " "
        elif cp2 == 0 or cp2 == 0xFFFD or (cat[0] == "C" and cat != "Cn") \
                or (self.strip_accents and cat[0] == "M"):
            out = None   # dropped, inside a word
        else:
            s = _lower(ch) if self.lowercase else ch
            out = f" {s} " if _alone(cp2, cat) else s
        if len(self) < _MAPPED_CHARACTERS:   # a bound on its memory: past it, computed again
            self[cp] = out
        return out


_TABLES: dict[tuple[bool, bool], _CharacterMap] = {}


def _table(lowercase: bool, strip_accents: bool) -> _CharacterMap:
    """The character map of one set of options, shared by the tokenizers using it."""
    table = _TABLES.get((lowercase, strip_accents))
    if table is None:
        table = _TABLES[lowercase, strip_accents] = _CharacterMap(lowercase, strip_accents)
    return table


def _alone(cp: int, category: str) -> bool:
    """Whether a character is a word by itself: punctuation, an ASCII symbol, a
    CJK ideograph."""
    return category[0] == "P" or (cp < 0x7F and category[0] == "S") or any(
        lo <= cp <= hi for lo, hi in _CJK)


def _first_of_nfd(ch: str) -> str:
    """The first character of ch's canonical decomposition: llama.cpp's NFD maps
    each character to that one (so an accented letter loses its accent, a Hangul
    syllable keeps its leading consonant)."""
    return unicodedata.normalize("NFD", ch)[0]


def _lower(ch: str) -> str:
    """Unicode's simple lowercase mapping (one character), as llama.cpp's table:
    Python's str.lower gives the full mapping, two characters for U+0130."""
    low = ch.lower()
    return low if len(low) == 1 else low[0]


class WordPieceTokenizer(Vocabulary):
    """WordPieceTokenizer(tokens, token_types, *, unk_id, cls_id=None, sep_id=None,
    lowercase=False, strip_accents=None, chat_template=None)

    tokens: the pieces, a word's first piece with U+2581 in front (llama.cpp's
    conversion of BERT's vocabulary); token_types: llama.cpp's types (1 normal,
    3 control, 4 user-defined); unk_id: the unknown token; cls_id, sep_id:
    what an encoder puts around a text (``bos_id`` and ``eos_id`` are the
    same; ``add_bos`` is True, as llama.cpp adds CLS ... SEP with special
    tokens).  lowercase, strip_accents: the vocabulary's normalizer options
    (llama.cpp's ``tokenizer.ggml.normalizer.*`` keys; strip_accents None
    follows lowercase).  ``encode(text, parse_special=True)`` -> int32 ids
    without CLS and SEP; ``decode(ids, skip_special=False)``.
    """

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int], *, unk_id: int,
                 cls_id: int | None = None, sep_id: int | None = None,
                 lowercase: bool = False, strip_accents: bool | None = None,
                 chat_template: str | None = None):
        self.tokens = [str(t) for t in tokens]
        n = len(self.tokens)
        self.token_types = [int(t) for t in token_types]
        if len(self.token_types) != n:
            raise ValueError(f"token_types: expected {n} values (one per token), got "
                             f"{len(self.token_types)}")
        self.vocab_size = n
        # (each checked as it is set: ggmlopt.text._special_id)
        if unk_id is None:
            raise TypeError("unk_id: expected a token id (int), got None")
        self.unk_id = unk_id
        self.bos_id = self.cls_id = cls_id
        self.eos_id = self.sep_id = sep_id
        self.eot_id = self.eom_id = None
        self.add_bos = True
        self.add_eos = False   # SEP is llama.cpp's add_sep, not an EOS
        # llama.cpp closes every text it tokenizes with its special tokens with SEP
        self.add_sep = self.sep_id is not None
        self.lowercase = bool(lowercase)
        self.strip_accents = self.lowercase if strip_accents is None else bool(strip_accents)
        self.chat_template = chat_template
        self.pre = "bert"
        self._ids: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            self._ids.setdefault(t, i)
        self._longest = max((len(t) for t in self.tokens), default=0)
        self._index_special()
        self._word_cache: dict[str, list[int]] = {}
        self._flag_lock = threading.Lock()

    # ---- text to ids ---------------------------------------------------------------------

    def encode(self, text: str, *, parse_special: bool = True) -> npt.NDArray[np.int32]:
        """text (str) -> int32 ids (n,), without CLS and SEP; special tokens written
        in the text become their ids (control ones only with parse_special)."""
        check_text(text)
        ids = ids_around_special(text, self._splitters[bool(parse_special)], self._ids,
                                 self._plain_ids)
        return np.asarray(ids, dtype=np.int32)

    def _plain_ids(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in self.words(text):
            ids += self._word_ids(word)
        return ids

    def words(self, text: str) -> list[str]:
        """text cut into the words the pieces are looked up in (llama.cpp's WPM
        preprocess, see the module docstring): one pass of str.translate maps
        every character (dropped, lowercased, whitespace to a space, a word of
        its own to itself between spaces), then str.split."""
        return text.translate(_table(self.lowercase, self.strip_accents)).split()

    def _word_ids(self, word: str) -> list[int]:
        """The longest pieces, left to right, of U+2581 + word; [unk_id] when a
        position starts no piece."""
        got = self._word_cache.get(word)
        if got is not None:
            return got
        text = SPACE + word
        ids, ok, i, n = [], True, 0, len(text)
        while i < n:
            for j in range(min(n, i + self._longest), i, -1):
                found = self._ids.get(text[i:j])
                if found is not None:
                    ids.append(found)
                    i = j
                    break
            else:
                ok = False
                break
        got = ids if ok and ids else [self.unk_id]
        if len(self._word_cache) < _WORD_CACHE:
            self._word_cache[word] = got
        return got

    # ---- ids to text ---------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token_id stands for in text (U+2581 as a space; a control
        token's own text)."""
        text = self.tokens[token_id]
        if self.token_types[token_id] in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            return text.encode("utf-8")
        return text.replace(SPACE, " ").encode("utf-8")

    def decode(self, ids: npt.ArrayLike, *, skip_special: bool = False) -> str:
        """ids -> str as llama.cpp's detokenizer gives it for this vocabulary: the
        pieces joined (U+2581 as a space, so the text starts with one), control
        tokens left out with skip_special, then its clean-up of spaces before
        ``? ! . ,``, around a lone apostrophe and before ``'s 'm 're 've``.  The
        words' normalization (case, accents, whitespace) does not come back."""
        skip_special = bool_arg(skip_special, "skip_special")
        arr = checked_ids(ids, self.vocab_size)
        text = "".join(self.token_bytes(i).decode("utf-8", "replace") for i in arr.tolist()
                       if not (skip_special and self.token_types[i] == TOKEN_CONTROL))
        return _clean_spaces(text)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        named = {"cls_token": self.cls_id, "sep_token": self.sep_id, "unk_token": self.unk_id}
        return {k: self.tokens[i] for k, i in named.items() if i is not None}

    def __repr__(self) -> str:
        return f"WordPieceTokenizer(vocab_size={self.vocab_size}, lowercase={self.lowercase})"


def _clean_spaces(text: str) -> str:
    """llama.cpp's clean_spaces passes over a detokenized text (llama-vocab.cpp's
    detokenize), character for character."""
    out = list(text[:1])
    for i in range(1, len(text)):   # " ?", " !", " .", " ,"
        if text[i - 1] == " " and text[i] in "?!.,":
            out.pop()
        out.append(text[i])
    buf = list(out)
    out, i = buf[:1], 1
    while i < len(buf):   # " ' " -> "'"; the dropped space reads as NUL afterwards
        if buf[i] == "'" and i + 1 < len(buf) and buf[i - 1] == " " and buf[i + 1] == " ":
            out.pop()
            out.append("'")
            buf[i + 1] = "\0"
            i += 2
            continue
        out.append(buf[i])
        i += 1
    text = "".join(out)
    out = list(text[:1])
    for i in range(1, len(text)):   # " 's", " 'm", " 're", " 've"
        if text[i - 1] == " " and text[i] == "'" and i + 1 < len(text):
            nxt = text[i + 1:i + 3]
            if nxt[:1] in ("s", "m") or (len(nxt) == 2 and nxt in ("re", "ve")):
                out.pop()
        out.append(text[i])
    return "".join(out)
