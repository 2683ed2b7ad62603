"""SentencePiece vocabularies as llama.cpp tokenizes them (its ``llama`` type:
Llama 2, Mistral, Phi-3, Gemma's older files): scores, byte fallback and the
space prefix, with no dependency beyond NumPy.

``encode`` follows llama-vocab.cpp's ``llm_tokenizer_spm_session``: spaces
become U+2581, a text piece after the start or a special token gets one in
front (``add_space_prefix``), then the adjacent pair whose joined text is in
the vocabulary with the highest score is merged (ties: the leftmost) until none
is, and a piece that is no token is spelled by the merges that made it, or as
its bytes (``<0xXX>``).  llama.cpp's test vectors are the oracle.
"""
from __future__ import annotations

import heapq
import threading
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from ._args import bool_arg
from ._bpe_words import WordEncoder
from .text import (
    _ISSPACE,
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_USER_DEFINED,
    LongestFirstPartition,
    Vocabulary,
    add_eos_flag,
    check_text,
    checked_ids,
    ids_around_special,
)

__all__ = ["SPMTokenizer"]

SPACE = "\u2581"   # SentencePiece's visible space


class SPMTokenizer(Vocabulary):
    """SPMTokenizer(tokens, scores, token_types, *, bos_id=None, eos_id=None,
    unk_id=None, add_bos=True, add_space_prefix=True, eot_id=None, eom_id=None,
    chat_template=None, rstrip_ids=(), add_eos=False)

    tokens: the pieces (str, U+2581 for a space); scores: one float each;
    token_types: llama.cpp's types (1 normal, 2 unknown, 3 control, 4
    user-defined, 6 byte).  rstrip_ids: special tokens after which the text's
    whitespace is dropped (llama.cpp's rstrip attribute, which it gives Phi-3's
    special tokens; Hugging Face's ``rstrip`` added tokens).
    ``encode(text, parse_special=True)`` -> int32 ids without BOS (prepend
    ``bos_id`` where ``add_bos`` says; ``add_eos``: whether llama.cpp puts
    ``eos_id`` last when it tokenizes a text with its special tokens);
    ``decode(ids, skip_special=False)``; ``eog_ids``, ``token_to_id``,
    ``id_to_token``, ``apply_chat_template`` as BPETokenizer has them.
    """

    def __init__(self, tokens: Sequence[str], scores: Sequence[float],
                 token_types: Sequence[int], *, bos_id: int | None = None,
                 eos_id: int | None = None, unk_id: int | None = None, add_bos: bool = True,
                 add_space_prefix: bool = True, eot_id: int | None = None,
                 eom_id: int | None = None, chat_template: str | None = None,
                 rstrip_ids: Iterable[int] = (), add_eos: bool = False):
        self.tokens = [str(t) for t in tokens]
        n = len(self.tokens)
        self.scores = [float(s) for s in scores]
        self.token_types = [int(t) for t in token_types]
        if len(self.scores) != n or len(self.token_types) != n:
            raise ValueError(f"scores, token_types: expected {n} values each (one per token), "
                             f"got {len(self.scores)} and {len(self.token_types)}")
        self.vocab_size = n
        # (each checked as it is set: ggmlopt.text._special_id)
        self.bos_id, self.eos_id, self.unk_id = bos_id, eos_id, unk_id
        self.eot_id, self.eom_id = eot_id, eom_id
        self.add_bos = add_bos
        self.add_eos = add_eos_flag(add_eos, self.eos_id)
        self.add_space_prefix = bool(add_space_prefix)
        self.chat_template = chat_template
        self.pre = "spm"
        self._ids: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            self._ids.setdefault(t, i)
        self._byte_ids: dict[int, int | None] = {}
        for b in range(256):
            byte = self._ids.get(f"<0x{b:02X}>")
            self._byte_ids[b] = byte if byte is not None else self._ids.get(chr(b))
        self._index_special()
        self.rstrip_ids = frozenset(int(i) for i in rstrip_ids)
        if any(not 0 <= i < n for i in self.rstrip_ids):
            raise IndexError(f"rstrip_ids: expected ids in [0, {n}), got "
                             f"{sorted(self.rstrip_ids)[:5]}")
        self._fast: object = False   # the tokenizers engine, made on the first encode
        self._words: WordEncoder | None = None   # long texts a word at a time (with _fast)
        self._flag_lock = threading.Lock()

    # ---- text to ids ---------------------------------------------------------------------

    def encode(self, text: str, *, parse_special: bool = True) -> npt.NDArray[np.int32]:
        """text (str) -> int32 ids (n,), without BOS; special tokens written in the
        text become their ids (control ones only with parse_special).  Run by the
        ``tokenizers`` library when it is installed (hf_tokenizer(): the same ids,
        checked against this class's own algorithm, which runs otherwise and in
        encode_with_offsets)."""
        fast = self._fast_tokenizer()
        if fast is None:
            return self.encode_with_offsets(text, parse_special=parse_special)[0]
        check_text(text)
        if self._words is None and isinstance(self._splitters[bool(parse_special)],
                                              LongestFirstPartition):
            # the library's added tokens match leftmost, not llama.cpp's longest first
            return self.encode_with_offsets(text, parse_special=parse_special)[0]
        if self._words is None:
            return np.asarray(self._library_encode(fast, text, parse_special).ids,
                              dtype=np.int32)
        return np.asarray(self._encode_words(text, parse_special), dtype=np.int32)

    def _encode_words(self, text: str, parse_special: bool) -> list[int]:
        """encode's ids a word at a time, as the library encodes the whole text:
        the special tokens written in it cut it, each plain part gets the space
        prefix and U+2581 for its spaces (the library's normalizer), then its
        words (a run of U+2581 and the text up to the next one: no piece of the
        vocabulary crosses into a space from a letter, so no merge crosses
        them) go through the WordEncoder."""
        words = self._words
        assert words is not None   # encode's check
        prefix = SPACE if self.add_space_prefix else ""
        return ids_around_special(text, self._splitters[bool(parse_special)], self._ids,
                                  lambda piece: words.encode(prefix + piece.replace(" ", SPACE)),
                                  self.rstrip_ids)

    def _fast_tokenizer(self):
        """hf_tokenizer() made once, or None: without the tokenizers library, or
        for a vocabulary whose byte fallback is not the 256 ``<0xXX>`` pieces
        (the library falls back to those only; llama.cpp also to a piece that is
        the character itself)."""
        if self._fast is False:
            self._fast = None
            if all(f"<0x{b:02X}>" in self._ids for b in range(256)):
                try:
                    self._fast = self.hf_tokenizer()
                except ImportError:
                    pass
                else:
                    self._words = self._word_encoder(self._fast)
        return self._fast

    def _word_encoder(self, fast):
        """A WordEncoder over fast's BPE (no normalizer, no added tokens), or None
        without the regex package or when a piece of the vocabulary holds a space
        after another character (a merge could then cross words)."""
        if any(SPACE in t.lstrip(SPACE) for t in self.tokens):
            return None
        words = type(fast)(fast.model)
        return WordEncoder.make([f"{SPACE}*[^{SPACE}]+|{SPACE}+"], words)

    def hf_tokenizer(self):
        """This vocabulary as a ``tokenizers.Tokenizer`` (transformers' form of a
        Llama SentencePiece tokenizer): BPE over the pieces with merges ordered by
        the joined piece's score, highest first (llama.cpp's merge order), byte
        fallback, spaces as U+2581 with llama.cpp's space prefix before every run
        of text that starts the input or follows a special token (a normalizer,
        which runs on each run between added tokens), control tokens special,
        user-defined ones plain added tokens.  ImportError naming the
        ``tokenizers`` extra without the library."""
        from ._optional import import_optional
        tk = import_optional("tokenizers", "tokenizers", "SPMTokenizer.hf_tokenizer")
        vocab = dict(self._ids)   # (a piece written twice: its first id, as encode reads it)
        unk = self.tokens[self.unk_id] if self.unk_id is not None else None
        tok = tk.Tokenizer(tk.models.BPE(vocab, self._merges(), unk_token=unk, fuse_unk=True,
                                         byte_fallback=True))
        prefix = [tk.normalizers.Prepend(SPACE)] if self.add_space_prefix else []
        tok.normalizer = tk.normalizers.Sequence([*prefix, tk.normalizers.Replace(" ", SPACE)])
        steps = [tk.decoders.Replace(SPACE, " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()]
        if self.add_space_prefix:
            steps.append(tk.decoders.Strip(content=" ", left=1))
        tok.decoder = tk.decoders.Sequence(steps)
        tok.add_special_tokens([tk.AddedToken(self.tokens[i], normalized=False, special=True,
                                              rstrip=i in self.rstrip_ids)
                                for i in self._control])
        tok.add_tokens([tk.AddedToken(self.tokens[i], normalized=False, special=False,
                                      rstrip=i in self.rstrip_ids)
                        for i in self._user])
        return tok

    def _merges(self) -> list[tuple[str, str]]:
        """Every split of every piece into two pieces, ordered by the joined
        piece's score (highest first; among equal scores the longer left piece,
        then the longer right one, first), as transformers' generate_merges
        orders them with the vocabulary's scores."""
        found = []
        for piece, i in self._ids.items():
            local = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                     if piece[:k] in self._ids and piece[k:] in self._ids]
            local.sort(key=lambda lr: (self._ids[lr[0]], self._ids[lr[1]]))
            found += [(left, right, self.scores[i]) for left, right in local]
        found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
        return [(left, right) for left, right, _ in found]

    def encode_with_offsets(self, text: str, *, parse_special: bool = True
                            ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
        """(ids, offsets): encode's ids and int64 (n + 1,) byte offsets into the
        text's UTF-8, token i spelling bytes offsets[i]:offsets[i + 1] (the space
        prefix, which the text does not hold, counts as nothing)."""
        check_text(text)
        splitter = self._splitters[bool(parse_special)]
        pieces = [text] if splitter is None else splitter.split(text)
        ids: list[int] = []
        ends: list[int] = []
        at = 0                # bytes of the text before this piece
        prev_special = True   # the start counts as after a special token
        strip = False         # after a token with the rstrip attribute
        for i, piece in enumerate(pieces):
            if strip and not i % 2:
                # the whitespace is the special token's (as Hugging Face's offsets
                # of an rstrip token cover it); ASCII: a byte a character
                stripped = piece.lstrip(_ISSPACE)
                at += len(piece) - len(stripped)
                ends[-1] = at
                piece = stripped
            size = len(piece.encode("utf-8"))
            if i % 2:
                ids.append(self._ids[piece])
                ends.append(at + size)
                prev_special = True
                strip = ids[-1] in self.rstrip_ids
            elif piece:
                prefixed = self.add_space_prefix and prev_special
                first = len(ids)
                self._tokenize((" " + piece if prefixed else piece).replace(" ", SPACE), ids)
                spelled = np.cumsum([len(self.token_bytes(t)) for t in ids[first:]])
                ends.extend((at + np.maximum(spelled - int(prefixed), 0)).tolist())
                prev_special = False
            at += size
        offsets = np.asarray([0] + ends, dtype=np.int64)
        return np.asarray(ids, dtype=np.int32), offsets

    def _tokenize(self, text: str, out: list[int]) -> None:
        # symbols: the UTF-8 characters, joined by the best-scoring pair in the vocabulary
        chars = list(text)
        n = len(chars)
        texts = chars[:]
        prev = list(range(-1, n - 1))
        nxt = [i + 1 if i + 1 < n else -1 for i in range(n)]
        alive = [True] * n
        queue: list[tuple[float, int, int, str]] = []
        made: dict[str, tuple[str, str]] = {}

        def try_pair(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            joined = texts[left] + texts[right]
            token = self._ids.get(joined)
            if token is None:
                return
            # the highest score first, then the leftmost (llama.cpp's comparator)
            heapq.heappush(queue, (-self.scores[token], left, right, joined))
            made[joined] = (texts[left], texts[right])

        for i in range(1, n):
            try_pair(i - 1, i)
        while queue:
            _, left, right, joined = heapq.heappop(queue)
            if not (alive[left] and alive[right]) or texts[left] + texts[right] != joined \
                    or nxt[left] != right:
                continue   # one side merged since
            texts[left] = joined
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_pair(prev[left], left)
            try_pair(left, nxt[left])
        i = 0 if n else -1
        while i != -1:
            self._resegment(texts[i], made, out)
            i = nxt[i]

    def _resegment(self, piece: str, made: dict[str, tuple[str, str]], out: list[int]) -> None:
        token = self._ids.get(piece)
        if token is not None:
            out.append(token)
            return
        parts = made.get(piece)
        if parts is None:   # no token and no merge made it: byte fallback
            for b in piece.encode("utf-8"):
                byte = self._byte_ids.get(b)
                if byte is None:
                    if self.unk_id is None:
                        raise ValueError(f"text: byte 0x{b:02X} has no token and the "
                                         "vocabulary no unknown token")
                    byte = self.unk_id
                out.append(byte)
            return
        self._resegment(parts[0], made, out)
        self._resegment(parts[1], made, out)

    # ---- ids to text ---------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token_id stands for in text (U+2581 as a space; a byte token's
        byte; a control token's own text)."""
        kind = self.token_types[token_id]
        text = self.tokens[token_id]
        if kind == TOKEN_BYTE and len(text) == 6 and text.startswith("<0x"):
            return bytes([int(text[3:5], 16)])
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            return text.encode("utf-8")
        return text.replace(SPACE, " ").encode("utf-8")

    def decode(self, ids: npt.ArrayLike, *, skip_special: bool = False) -> str:
        """ids -> str: pieces joined with U+2581 as spaces, byte tokens as bytes
        (a run of byte tokens that is not UTF-8 gives a U+FFFD a byte, as
        transformers' ByteFallback decoder: a reply cut inside a character keeps
        its length in bytes), the space prefix of the first token
        removed as llama.cpp's detokenizer and transformers' Strip decoder do
        (after a leading BOS or other control token it stays: '<s> Hello');
        control tokens left out with skip_special, which then strips the first
        token kept, as transformers does."""
        skip_special = bool_arg(skip_special, "skip_special")
        arr = checked_ids(ids, self.vocab_size)
        out: list[str] = []
        run = bytearray()   # consecutive byte tokens, read together

        def flush() -> None:
            try:
                out.append(run.decode("utf-8"))
            except UnicodeDecodeError:
                out.append("\ufffd" * len(run))
            run.clear()

        first, strip = True, False
        for i in arr.tolist():
            if skip_special and i in self._control_ids:
                continue
            piece = self.token_bytes(i)
            if first:   # its space goes once the byte runs are read (a <0x20> in a broken
                # run is a U+FFFD then, as transformers' Strip comes after ByteFallback)
                strip = self.add_space_prefix and self.token_types[i] not in (
                    TOKEN_CONTROL, TOKEN_USER_DEFINED)
            first = False
            if self.token_types[i] == TOKEN_BYTE:
                run += piece
                continue
            if run:
                flush()
            out.append(piece.decode("utf-8", "replace"))
        if run:
            flush()
        text = "".join(out)
        return text[1:] if strip and text.startswith(" ") else text

    @property
    def special_tokens_map(self) -> dict[str, str]:
        named = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self.unk_id}
        return {k: self.tokens[i] for k, i in named.items() if i is not None}

    def __repr__(self) -> str:
        return f"SPMTokenizer(vocab_size={self.vocab_size})"
