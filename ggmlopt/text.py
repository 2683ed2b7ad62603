"""Tokenizers: text to token ids and back.

Every tokenizer follows one protocol (Tokenizer): ``encode(text) -> int32 ids``,
``decode(ids) -> str``, ``vocab_size`` and ``eos_id`` (``bos_id`` None when the
vocabulary has no beginning-of-sequence token).  ByteTokenizer needs no training
and no files: each UTF-8 byte is a token, so any text round-trips.
"""
from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from ._args import bool_arg
from ._bpe_words import WordEncoder
from ._byte_level import GPT2_BYTE_STRINGS
from ._optional import import_optional
from .pretokenizers import IGNORE_MERGES, pre_tokenizer_regexes

__all__ = ["EOG_TEXTS", "GPT2_BYTE_STRINGS", "BPETokenizer", "ByteTokenizer", "Tokenizer",
           "load_hf_tokenizer"]


def load_hf_tokenizer(directory):
    """A Hugging Face checkpoint directory's tokenizer (tokenizer.json with
    tokenizer_config.json), equal to transformers' AutoTokenizer: see
    ggmlopt.hf_tokenizer.load_hf_tokenizer."""
    from .hf_tokenizer import load_hf_tokenizer as load
    return load(directory)


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



# transformers' apply_chat_template options beyond the template's variables: the
# value each takes by default here (what ggmlopt returns), and what else it does
_TOKENIZER_OPTIONS = {
    "sanitize_control_tokens": (False, "special tokens' texts in messages are their tokens"),
    "truncation": (False, "the ids come back whole"),
    "max_length": (None, "the ids come back whole"),
    "padding": (False, "one conversation's ids come back unpadded"),
    "return_dict": (False, "the ids come back as an int32 array (tokenize=True) or the text"),
    "return_assistant_tokens_mask": (False, "Dataset.from_chat labels the assistant turns"),
    "return_tensors": (None, "the ids come back as a NumPy int32 array"),
    "tokenizer_kwargs": (None, "the text is encoded as the tokenizer encodes it"),
}


def _refuse_tokenizer_options(kwargs: dict) -> None:
    """ValueError for a transformers tokenizer option asking for what
    apply_chat_template does not do (the defaults, and 'np' tensors, pass)."""
    for name, (default, does) in _TOKENIZER_OPTIONS.items():
        if name not in kwargs:
            continue
        value = kwargs.pop(name)
        if value == default or (name == "return_tensors" and value == "np") or \
                (name == "tokenizer_kwargs" and value == {}) or \
                (name in ("padding", "truncation") and value in ("do_not_pad", "do_not_truncate")):
            continue
        raise ValueError(f"{name}={value!r}: transformers' tokenizer option is not supported by "
                         f"apply_chat_template here ({does})")

# a tokenizer's special ids (each None or an id of its vocabulary) and its flags
_SPECIAL_IDS = frozenset({"bos_id", "eos_id", "eot_id", "eom_id", "pad_id", "unk_id",
                          "sep_id", "cls_id"})
_FLAGS = frozenset({"add_bos", "add_eos"})


def _special_id(tokenizer: Any, name: str, value: Any) -> int | None:
    """value as a special id of tokenizer: None, or an int in [0, vocab_size)
    (TypeError for another type, IndexError outside the vocabulary)."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected a token id (int) or None, got "
                        f"{type(value).__name__}")
    n = getattr(tokenizer, "vocab_size", None)
    if isinstance(n, int) and not 0 <= int(value) < n:
        raise IndexError(f"{name}: {int(value)} is outside the vocabulary [0, {n})")
    return int(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


class _ChatTemplated:
    """apply_chat_template for a tokenizer with ``chat_template`` (a Jinja str or
    None), ``named_chat_templates`` (the checkpoint's other templates by name:
    ``tool_use``, ``rag``) and ``special_tokens_map``."""

    named_chat_templates: dict[str, str] = {}   # noqa: RUF012 (replaced, never mutated)

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template apply_chat_template renders (None: none).
        Assigning one replaces the checkpoint's named templates too (its
        ``tool_use``), as assigning transformers' ``chat_template`` does: the
        template given renders with tools as well."""
        return self.__dict__.get("_chat_template")

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        if template is not None and not isinstance(template, str):
            raise TypeError(f"chat_template: expected a Jinja template (str) or None, got "
                            f"{type(template).__name__}")
        self.__dict__["_chat_template"] = template
        self.named_chat_templates = {}

    def __setattr__(self, name: str, value: Any) -> None:
        # the special ids and flags a user may set (TRL's eos_token=, a pad token)
        # are checked as they are set, not where they are read much later
        if name in _SPECIAL_IDS:
            value = _special_id(self, name, value)
            if name == "eos_id" and value is None and getattr(self, "add_eos", False):
                raise ValueError("eos_id: None, but add_eos is True (it appends the eos "
                                 "token): set add_eos False first")
        elif name in _FLAGS:
            value = _flag(name, value)
            if name == "add_eos" and value and getattr(self, "eos_id", None) is None:
                raise ValueError("add_eos: True needs an eos_id (the token it appends)")
        super().__setattr__(name, value)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The special tokens' texts a chat template sees (``bos_token``,
        ``eos_token``, ...), as transformers binds them."""
        return {}

    def encode(self, text: str, *, parse_special: bool = False) -> npt.NDArray[np.int32]:
        """text as token ids (each tokenizer defines it)."""
        raise NotImplementedError

    def apply_chat_template(self, messages, tools=None, documents=None, chat_template=None,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False,
                            tokenize: bool = True, **kwargs):
        """messages rendered by this tokenizer's chat template as transformers'
        ``apply_chat_template`` renders them: the text (tokenize=False) or its
        int32 ids (special tokens written by the template become their ids; no
        BOS is added beyond what the template writes).  The arguments are
        transformers', in its order: tools (a checkpoint's ``tool_use``
        template renders them where it has one, as transformers picks it),
        documents, chat_template (one of the named templates, or a template's
        source), add_generation_prompt, continue_final_message, tokenize;
        kwargs: further template variables.
        ValueError when the tokenizer has no chat_template or messages is empty (as
        transformers refuses it); the ``chat`` extra (jinja2) renders it.
        transformers' tokenizer options that change what comes back
        (``sanitize_control_tokens``, ``truncation``, ``max_length``,
        ``padding``, ``return_dict``, ``return_assistant_tokens_mask``,
        ``return_tensors``, ``tokenizer_kwargs``) are refused unless they ask
        for what this returns anyway: passed to the template as variables, they
        would be dropped without a word."""
        if isinstance(messages, (list, tuple)) and not messages:
            raise ValueError("messages: an empty conversation (give at least one message)")
        _refuse_tokenizer_options(kwargs)
        # transformers' arguments in transformers' order (tools second), passed on
        # to the template as it passes them
        for name, value, unset in (("tools", tools, None), ("documents", documents, None),
                                   ("continue_final_message", continue_final_message, False)):
            if value is not unset:
                kwargs[name] = value
        template = self.compiled_chat_template(tools=tools, chat_template=chat_template)
        text = template.render(messages, add_generation_prompt, **kwargs)
        return self.encode(text, parse_special=True) if tokenize else text

    def compiled_chat_template(self, *, tools=None, chat_template=None):
        """The ggmlopt.chat_template.ChatTemplate of chat_template (made once), or
        with tools of the named ``tool_use`` template where there is one; a
        chat_template given: the named template of that name, else that source."""
        source = self.chat_template
        if chat_template is not None:
            if not isinstance(chat_template, str):
                raise TypeError(f"chat_template: expected a template's name or source (str), "
                                f"got {type(chat_template).__name__}")
            source = self.named_chat_templates.get(chat_template, chat_template)
        elif tools is not None and self.named_chat_templates.get("tool_use"):
            source = self.named_chat_templates["tool_use"]
        if not source:
            raise ValueError(f"tokenizer: {self!r} has no chat_template (give one: "
                             "tokenizer.chat_template = '...jinja...')")
        # the special tokens as they are now (a changed eos_id renders as its token)
        specials = self.special_tokens_map
        key = (source, tuple(sorted(specials.items())))
        cache = self.__dict__.setdefault("_compiled_templates", {})
        if key not in cache:
            from .chat_template import ChatTemplate
            if len(cache) > 4:   # templates set and replaced by hand: keep a few
                cache.clear()
            cache[key] = ChatTemplate(source, special_tokens=specials)
        return cache[key]


# ByteTokenizer's vocabulary as its files store it: byte i is GPT-2's string of it
_BYTE_STRING_IDS = {text: i for i, text in enumerate(GPT2_BYTE_STRINGS)}


class ByteTokenizer(_ChatTemplated):
    """ByteTokenizer(chat_template=None, add_eos=False): the 256 byte values of
    UTF-8 as tokens 0..255, and ``<|endoftext|>`` as token 256 (``vocab_size``
    257, ``eos_id`` 256, no BOS); chat_template: a Jinja chat template for
    apply_chat_template; add_eos: whether llama.cpp appends the EOS to a text it
    tokenizes with its special tokens (a GGUF's ``tokenizer.ggml.add_eos_token``).

    ``encode(text)`` is ``np.frombuffer(text.encode("utf-8"))`` as int32 (lone
    surrogates, which are not UTF-8, pass as their 3-byte forms); ``decode(ids)``
    joins the bytes and decodes them as UTF-8 with invalid sequences replaced by
    U+FFFD, writing the end-of-text token as ``<|endoftext|>`` (or dropping it
    with ``skip_special=True``).  ``decode(encode(s)) == s`` for every valid
    Unicode string.  ``token_to_id`` / ``id_to_token`` name the tokens as its
    GGUF and tokenizer.json files store them (GPT-2's byte strings).
    """

    vocab_size = 257
    eos_id = 256
    bos_id = None
    add_bos = False
    eos_text = "<|endoftext|>"
    eog_ids = frozenset({256})   # where generation stops by default

    def __init__(self, chat_template: str | None = None, add_eos: bool = False):
        self.chat_template = chat_template
        self.add_eos = add_eos

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {"eos_token": self.eos_text}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token_id stands for in text (``<|endoftext|>``'s text for 256)."""
        return self.eos_text.encode() if token_id == self.eos_id else bytes([token_id])

    def token_to_id(self, token: str) -> int | None:
        """The id of a token's text as the vocabulary save_gguf and save_hf write
        stores it (GPT-2's byte-to-unicode string of byte i for i < 256, then
        ``<|endoftext|>``; the tokenizer load_gguf or load_hf_tokenizer reads back
        from such a file says the same), or None."""
        if token == self.eos_text:
            return self.eos_id
        return _BYTE_STRING_IDS.get(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary's text of an id as token_to_id reads it (IndexError
        outside [0, 257))."""
        if not 0 <= int(token_id) < self.vocab_size:
            raise IndexError(f"token_id: {token_id} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return self.eos_text if int(token_id) == self.eos_id else GPT2_BYTE_STRINGS[int(token_id)]

    def encode(self, text: str, *, parse_special: bool = False) -> npt.NDArray[np.int32]:
        """text (str) -> int32 ids of shape (number of UTF-8 bytes,); with
        parse_special, ``<|endoftext|>`` written in the text becomes id 256 (as a
        chat template writes it)."""
        check_text(text)
        if parse_special and self.eos_text in text:
            parts = [self.encode(part) for part in text.split(self.eos_text)]
            eos = np.array([self.eos_id], np.int32)
            pieces = [parts[0]]
            for part in parts[1:]:
                pieces += [eos, part]
            return np.concatenate(pieces).astype(np.int32)
        data = text.encode("utf-8", errors="surrogatepass")
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids: npt.ArrayLike, *, skip_special: bool = False) -> str:
        """ids (integers in [0, 257), shape (n,)) -> str; bytes that are not valid
        UTF-8 become U+FFFD; token 256 becomes ``<|endoftext|>`` unless
        skip_special."""
        skip_special = bool_arg(skip_special, "skip_special")
        arr = checked_ids(ids, self.vocab_size)
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


# llama.cpp's token types (tokenizer.ggml.token_type, llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = \
    1, 2, 3, 4, 5, 6
# the texts llama.cpp's llama_vocab::load marks as end-of-generation (its EOG set also
# holds the eos, eot and eom ids the file names); it makes each a control token
# whatever type the file gives it
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
                       "<|flush|>", "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>",
                       "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
                       "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                       "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["})
# llama.cpp's fill-in-the-middle pad, repository and file-separator tokens, found by
# their text (the first text of each kind the vocabulary holds): control tokens whatever
# the file says, and ends of generation
FIM_EOG_TEXTS = (("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
                 ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
                 ("<|file_sep|>",))
# llama.cpp's fill-in-the-middle prefix, suffix and middle tokens, found by their text as
# the kinds above: control tokens whatever the file says (DeepSeek Coder's are
# user-defined there), which end nothing
FIM_CONTROL_TEXTS = (
    ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
     "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
     "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
     "\u2581<MID>", "<|code_middle|>", "<|middle|>"))
# the whitespace llama.cpp strips beside a token with the rstrip attribute (C's isspace)
_ISSPACE = " \t\n\v\f\r"


def llama_cpp_special(types: Sequence[int], ids: dict[str, int], named: Iterable[int | None]
                      ) -> tuple[set[int], set[int], set[int]]:
    """(control, user-defined, end-of-generation) token ids as llama.cpp's
    vocabulary loader leaves them (llama-vocab.cpp) from the file's types, its
    text-to-id map and the eos/eot/eom ids it names: the end-of-generation texts
    it knows become control tokens whatever their type; gpt-oss's channel
    tokens are user-defined (always matched); with o200k_harmony's return and
    call tokens, ``<|end|>`` is a user-defined token that ends nothing; beside
    Gemma 4's ``<|tool_response>``, ``</s>`` is a normal token; the
    fill-in-the-middle pad, repository and file-separator tokens
    (FIM_EOG_TEXTS) are control tokens that end generation, its prefix, suffix
    and middle ones (FIM_CONTROL_TEXTS) control tokens that do not; the
    unknown-type tokens are control ones too."""
    def at(text):
        return ids.get(text)

    def first_of_each(kinds):
        return {ids[found] for kind in kinds
                if (found := next((t for t in kind if t in ids), None)) is not None}

    by_text = {i for t in EOG_TEXTS if (i := at(t)) is not None} | first_of_each(FIM_EOG_TEXTS)
    fim = first_of_each(FIM_CONTROL_TEXTS)
    # an unknown-type token (<unk>, Phi-3's [PAD...]) is matched and skipped as a
    # control one: llama.cpp's special partition and token_to_piece treat both alike
    control = {i for i, k in enumerate(types) if k in (TOKEN_CONTROL, TOKEN_UNKNOWN)} \
        | by_text | fim
    user = {i for i, k in enumerate(types) if k == TOKEN_USER_DEFINED} - by_text - fim
    eog = by_text | {i for i in named if i is not None}
    for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        if (i := at(t)) is not None:
            control.discard(i)
            user.add(i)
    end, s = not_eog_beside(ids, eog)
    if end is not None:
        eog.discard(end)
        control.discard(end)
        user.add(end)
    if s is not None:
        eog.discard(s)
        control.discard(s)
        user.discard(s)
    return control, user, eog


def not_eog_beside(ids: dict[str, int], eog: set[int]) -> tuple[int | None, int | None]:
    """(``<|end|>``'s id, ``</s>``'s id), each where llama.cpp's loader takes it out
    of the end-of-generation ids eog because of the tokens beside it (else None):
    ``<|end|>`` with a call token (``<|call|>`` or ``<|calls|>``) and either
    o200k_harmony's ``<|return|>`` or solar-open's ``<|flush|>``,
    ``</s>`` with Gemma 4's ``<|tool_response>`` or PLaMo's ``<|plamo:eos|>``."""
    texts = {t for t in ("<|return|>", "<|call|>", "<|calls|>", "<|flush|>", "<|end|>",
                         "<|tool_response>", "<|plamo:eos|>", "</s>") if ids.get(t) in eog}
    call = bool(texts & {"<|call|>", "<|calls|>"})   # llama.cpp counts either as "call"
    end = ids["<|end|>"] if "<|end|>" in texts and call and (
        "<|return|>" in texts or "<|flush|>" in texts) else None
    s = ids["</s>"] if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"} \
        else None
    return end, s


def check_text(text: object, name: str = "text") -> None:
    """What every encode takes: a str (TypeError otherwise) that UTF-8 can encode
    (ValueError naming a lone surrogate, which no tokenizer spells); name: the
    argument's, for the messages."""
    if not isinstance(text, str):
        raise TypeError(f"{name}: expected a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: a lone surrogate U+{ord(text[e.start]):04X} at position "
                         f"{e.start}; expected text that UTF-8 can encode") from None


def checked_ids(ids: npt.ArrayLike, vocab_size: int) -> np.ndarray:
    """ids as int64 (n,) after checking them (TypeError, ValueError, IndexError
    naming the first bad one): what every decode takes."""
    arr = np.asarray(ids)
    if arr.dtype == object and arr.ndim == 1:   # Python ints beyond 64 bits
        for i, v in enumerate(arr.tolist()):
            if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v < vocab_size:
                raise IndexError(f"ids: id {v} at position {i} is outside the vocabulary "
                                 f"[0, {vocab_size})")
    if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
        raise TypeError(f"ids: expected integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"ids: expected shape (n,), got {arr.shape}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise IndexError(f"ids: id {int(arr[i])} at position {i} is outside the vocabulary "
                         f"[0, {vocab_size})")
    return arr


def add_eos_flag(add_eos: object, eos_id: int | None) -> bool:
    """A tokenizer's add_eos, checked: llama.cpp asserts an eos id when the flag
    asks it to append one."""
    add_eos = _flag("add_eos", add_eos)
    if add_eos and eos_id is None:
        raise ValueError("add_eos: True needs an eos_id (the token it appends)")
    return bool(add_eos)


class _FlagLock:
    """A lock around the tokenizers library's encode_special_tokens flag, which
    belongs to the tokenizer, not to the call; left out when the tokenizer is
    copied or pickled (a lock is neither) and made anew."""

    _flag_lock: threading.Lock

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_flag_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._flag_lock = threading.Lock()

    def _library_encode(self, tk: Any, text: str, parse_special: bool) -> Any:
        """tk.encode(text) (a tokenizers.Tokenizer, no special tokens added) with
        special tokens in the text matched only with parse_special."""
        with self._flag_lock:
            tk.encode_special_tokens = not parse_special
            try:
                return tk.encode(text, add_special_tokens=False)
            finally:
                tk.encode_special_tokens = False


class Vocabulary(_FlagLock, _ChatTemplated):
    """What the vocabulary tokenizers (BPETokenizer, ggmlopt.spm.SPMTokenizer)
    share: ``tokens`` with llama.cpp's ``token_types``, the special tokens matched
    whole in text, the end-of-generation ids, the lookups."""

    tokens: list[str]
    token_types: list[int]
    vocab_size: int
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    _ids: dict[str, int]

    def _index_special(self) -> None:
        # the tokens matched as a whole in text before the merges (llama.cpp's
        # special-token partition), longest first; parse_special=False matches only
        # the user-defined ones, as llama.cpp does.  The end-of-generation tokens
        # llama.cpp knows by their text are control tokens whatever the file says
        # (it overrides their type: "control-looking token")
        control, user, eog = llama_cpp_special(self.token_types, self._ids,
                                               (self.eos_id, self.eot_id, self.eom_id))
        self._control, self._user = sorted(control), sorted(user)
        self._control_ids = frozenset(control)
        self._splitters = {
            parse: special_splitter([self.tokens[i] for i in
                                     sorted(self._control + self._user if parse
                                            else self._user)])
            for parse in (True, False)}
        self.eog_ids = frozenset(eog)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token's text as the vocabulary stores it, or None."""
        return self._ids.get(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary's text of an id (IndexError outside it)."""
        if not 0 <= int(token_id) < self.vocab_size:
            raise IndexError(f"token_id: {token_id} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return self.tokens[int(token_id)]


class BPETokenizer(Vocabulary):
    """BPETokenizer(tokens, merges, *, token_types=None, eos_id=None, bos_id=None,
    add_bos=False, pre="gpt-2", eot_id=None, eom_id=None, chat_template=None,
    add_eos=False)

    A byte-level BPE tokenizer (GPT-2's kind; a GGUF's ``gpt2``-type vocabulary)
    run by the ``tokenizers`` library (the ``tokenizers`` extra: ``pip install
    ggmlopt[tokenizers]`` or ``pip install tokenizers``, imported when one is made).

    tokens: the vocabulary, list of str (id i is tokens[i]) in GPT-2's
    byte-to-unicode form; merges: list of ``"left right"`` str in rank order;
    token_types: llama.cpp's type per token (1 normal, 3 control, 4 user-defined
    ...; default all 1); pre: llama.cpp's pre-tokenizer name
    (``tokenizer.ggml.pre``): ``gpt-2`` and ``llama-bpe`` (and their aliases) are
    reproduced, any other falls back to GPT-2's with a UserWarning.  add_bos:
    whether llama.cpp puts bos_id first (``encode`` never does: prepend it where a
    protocol wants it).  add_eos: whether llama.cpp puts eos_id last when it
    tokenizes a text with its special tokens (``tokenizer.ggml.add_eos_token``;
    ``encode`` never does).  eot_id, eom_id: the file's end-of-turn and end-of-message
    tokens, if any.  chat_template: the model's Jinja chat template (a GGUF's
    ``tokenizer.chat_template``), rendered by ``apply_chat_template``.

    ``encode(text, parse_special=True)`` -> int32 (n,) ids: control and
    user-defined tokens written in the text (``<|im_start|>``) become their ids,
    as Hugging Face's tokenizers and llama.cpp's ``parse_special=true`` do (with
    ``parse_special=False`` control tokens stay plain text, user-defined ones are
    still matched, as llama.cpp does).  ``decode(ids, skip_special=False)`` ->
    str (invalid UTF-8 replaced by U+FFFD; control tokens dropped with
    skip_special).  ``eog_ids``: the ids that end a generation, llama.cpp's EOG
    set (eos, eot, eom and the tokens it knows by their text: ``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>`` ...).
    """

    #: tokenizer.ggml.model of the vocabulary in a GGUF file
    gguf_model = "gpt2"

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], *,
                 token_types: Sequence[int] | None = None, eos_id: int | None = None,
                 bos_id: int | None = None, add_bos: bool = False, pre: str = "gpt-2",
                 eot_id: int | None = None, eom_id: int | None = None,
                 chat_template: str | None = None, add_eos: bool = False):
        tk = import_optional("tokenizers", "tokenizers", "BPETokenizer")
        self.tokens = [str(t) for t in tokens]
        self.merges = [str(m) for m in merges]
        n = len(self.tokens)
        self.token_types = [1] * n if token_types is None else [int(t) for t in token_types]
        if len(self.token_types) != n:
            raise ValueError(f"token_types: expected {n} values (one per token), got "
                             f"{len(self.token_types)}")
        self.vocab_size = n
        # (each checked as it is set: ggmlopt.text._special_id)
        self.eos_id, self.bos_id, self.eot_id, self.eom_id = eos_id, bos_id, eot_id, eom_id
        self.add_bos = add_bos
        self.add_eos = add_eos_flag(add_eos, self.eos_id)
        self.pre = str(pre)
        vocab = {t: i for i, t in enumerate(self.tokens)}
        self._ids = vocab
        pairs = []
        for m in self.merges:
            left, sep, right = m.partition(" ")
            if not sep:
                raise ValueError(f"merges: {m!r} is not 'left right'")
            # tokenizers wants every merge's parts and result in the vocabulary; one
            # whose result is not (ByteTokenizer's GGUF vocabulary has one, which
            # never applies) is left out.  A part outside it is refused: llama.cpp
            # merges through such a symbol, which tokenizers cannot
            for part in (left, right):
                if part not in vocab:
                    raise ValueError(f"merges: {m!r} joins {part!r}, which is not in the "
                                     f"vocabulary (a damaged file?); llama.cpp would "
                                     f"tokenize through it, ggmlopt cannot")
            if left + right in vocab:
                pairs.append((left, right))
        self._tk: Any
        self._tk, self._words = self._pipelines(tk, vocab, pairs)
        self._index_special()
        # the special tokens matched in the library, in one call over the whole text
        # (leftmost, longest first, as the partition above): control tokens as special
        # ones, which encode_special_tokens leaves as text (parse_special=False), and
        # user-defined ones, always matched, as llama.cpp does
        self._tk.add_special_tokens([tk.AddedToken(self.tokens[i], normalized=False,
                                                   special=True) for i in self._control])
        self._tk.add_tokens([tk.AddedToken(self.tokens[i], normalized=False, special=False)
                             for i in self._user])
        self._flag_lock = threading.Lock()
        self.chat_template = chat_template
        self._byte_values = {c: b for b, c in enumerate(GPT2_BYTE_STRINGS)}

    def _pipelines(self, tk: Any, vocab: dict[str, int],
                   pairs: list[tuple[str, str]]) -> tuple[Any, WordEncoder | None]:
        """(the library's tokenizer for whole texts, without added tokens yet; the
        WordEncoder for long texts, or None): byte-level BPE behind llama.cpp's
        pre-tokenizer regexes."""
        regexes = pre_tokenizer_regexes(self.pre)
        if regexes is None:
            warnings.warn(f"pre: llama.cpp's pre-tokenizer {self.pre!r} is not reproduced; "
                          "GPT-2's is used, so some texts may tokenize differently",
                          UserWarning, stacklevel=3)
            regexes = pre_tokenizer_regexes("gpt-2")
            assert regexes is not None
        ignore_merges = self.pre in IGNORE_MERGES
        whole = tk.Tokenizer(tk.models.BPE(vocab, pairs, ignore_merges=ignore_merges))
        whole.pre_tokenizer = tk.pre_tokenizers.Sequence([
            *(tk.pre_tokenizers.Split(tk.Regex(r), behavior="isolated") for r in regexes),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        whole.decoder = tk.decoders.ByteLevel()
        # long texts word by word (ggmlopt._bpe_words), where the regex package is
        # installed: one word's BPE, nothing else, in the library
        word_tk = tk.Tokenizer(tk.models.BPE(vocab, pairs, ignore_merges=ignore_merges))
        word_tk.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                            use_regex=False)
        words = WordEncoder.make(regexes, word_tk, vocab if ignore_merges else None)
        return whole, words

    def hf_tokenizer(self) -> Any:
        """A copy of the ``tokenizers.Tokenizer`` this vocabulary encodes with (BPE,
        llama.cpp's pre-tokenizer regexes, its control tokens as special added
        tokens, its user-defined ones as plain added tokens): its tokenizer.json."""
        return type(self._tk).from_str(self._tk.to_str())

    @property
    def special_tokens_map(self) -> dict[str, str]:
        named = {"bos_token": self.bos_id, "eos_token": self.eos_id}
        return {k: self.tokens[i] for k, i in named.items() if i is not None}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token_id stands for in text: a control or user-defined token's
        own text, a byte-level token's bytes (GPT-2's byte-to-unicode undone)."""
        text = self.tokens[token_id]
        if self.token_types[token_id] in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            return text.encode("utf-8")
        values = self._byte_values
        try:
            return bytes(values[c] for c in text)
        except KeyError:
            return text.encode("utf-8")

    def encode(self, text: str, *, parse_special: bool = True) -> npt.NDArray[np.int32]:
        """text (str) -> int32 ids of shape (n,), without BOS; special tokens
        written in the text become their ids (see the class docstring)."""
        check_text(text)
        splitter = self._splitters[bool(parse_special)]
        if self._words is None and isinstance(splitter, LongestFirstPartition):
            # the library's added tokens match leftmost: where that differs from
            # llama.cpp's partition, the partition cuts and the library encodes the rest
            ids = ids_around_special(text, splitter, self._ids, lambda part: self._library_encode(
                self._tk, part, False).ids)
        elif self._words is None:
            ids = self._library_encode(self._tk, text, parse_special).ids
        else:
            ids = self._encode_words(text, parse_special)
        return np.asarray(ids, dtype=np.int32)

    def _encode_words(self, text: str, parse_special: bool) -> list[int]:
        """encode's ids word by word: the special tokens written in the text cut
        it first (as the library's added tokens do), each plain part goes
        through the WordEncoder."""
        words = self._words
        assert words is not None   # encode's check
        return ids_around_special(text, self._splitters[bool(parse_special)], self._ids,
                                  words.encode)

    def decode(self, ids: npt.ArrayLike, *, skip_special: bool = False) -> str:
        """ids (integers in [0, vocab_size), shape (n,)) -> str; control tokens
        (bos, eos, ``<|im_end|>`` ...) are left out with skip_special."""
        skip_special = bool_arg(skip_special, "skip_special")
        ids_list = checked_ids(ids, self.vocab_size).tolist()
        special = set(self._control + self._user)
        if not special:
            return str(self._tk.decode(ids_list, skip_special_tokens=False))
        # control and user-defined tokens hold their text as is (no byte form)
        pieces: list[str] = []
        run: list[int] = []
        for i in ids_list:
            if i in special:
                if skip_special and i in self._control_ids:
                    continue   # left out: the bytes around it still join (one character)
                if run:
                    pieces.append(str(self._tk.decode(run, skip_special_tokens=False)))
                    run = []
                pieces.append(self.tokens[i])
            else:
                run.append(i)
        if run:
            pieces.append(str(self._tk.decode(run, skip_special_tokens=False)))
        return "".join(pieces)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, pre={self.pre!r})"


def ids_around_special(text: str, splitter, special_ids: dict[str, int],
                       plain: Callable[[str], list[int]],
                       rstrip_ids: frozenset[int] = frozenset()) -> list[int]:
    """The ids of text cut at the special tokens written in it (splitter, from
    _splitter, or None for none): a special token's text as its id, each
    non-empty plain part through plain(part); after a token of rstrip_ids the
    next part loses its leading whitespace (llama.cpp's rstrip attribute)."""
    if splitter is None:
        return plain(text) if text else []
    ids: list[int] = []
    strip = False
    for i, piece in enumerate(splitter.split(text)):
        if i % 2:   # split() alternates plain text and a special token's text
            ids.append(special_ids[piece])
            strip = ids[-1] in rstrip_ids
            continue
        if strip:
            piece = piece.lstrip(_ISSPACE)
        if piece:
            ids += plain(piece)
    return ids


def special_splitter(texts: list[str]):
    """An object whose split() alternates plain text and one of texts (special
    tokens' texts in the order of their ids) as llama.cpp's special-token
    partition cuts it, or None for no texts: the regex of _splitter, which
    finds the same parts unless a text can end inside the match of one the
    partition tries first (then LongestFirstPartition)."""
    ordered = _partition_order([t for t in texts if t])
    if ordered and _leftmost_can_differ(ordered):
        return LongestFirstPartition(ordered)
    return _splitter(ordered)


def _partition_order(texts: list[str]) -> list[str]:
    """texts (in the order of their ids) in the order llama.cpp's partition tries
    them: the longest in UTF-8 bytes first (its text.size()), ties in id order."""
    unique = list(dict.fromkeys(texts))
    return sorted(unique, key=lambda t: -len(t.encode("utf-8")))


def _splitter(texts: list[str]):
    """A regex whose split() alternates plain text and one of texts (the longest
    that matches where one does, as llama.cpp's partition tries them), or None
    for no texts."""
    texts = sorted({t for t in texts if t}, key=lambda t: (-len(t), t))
    if not texts:
        return None
    if len(texts[0]) > _TRIE_DEPTH:
        return re.compile("(" + "|".join(re.escape(t) for t in texts) + ")")
    return re.compile("(" + _trie_pattern(texts) + ")")


def _leftmost_can_differ(ordered: list[str]) -> bool:
    """Whether, of texts in the partition's order, a text a's end is the start
    of a text b tried before it that does not also start where a does
    (falcon's ">>TITLE<<" and "<|endoftext|>" share a "<"): in
    ">>TITLE<<|endoftext|>" the leftmost match takes a, llama.cpp's partition,
    longest first, takes b.  (Runs of one character, such as space tokens,
    overlap but never differ: the longer run starts where the shorter does.)"""
    rank = {t: i for i, t in enumerate(ordered)}
    starts: dict[str, list[str]] = {}
    for t in ordered:
        starts.setdefault(t[0], []).append(t)
    for a in ordered:
        for i in range(1, len(a)):
            for b in starts.get(a[i], ()):
                if rank[b] < rank[a] and len(b) > len(a) - i and b.startswith(a[i:]) \
                        and not (a[:i] + b).startswith(b):
                    return True
    return False


class LongestFirstPartition:
    """llama.cpp's special-token partition (tokenizer_st_partition): each text,
    the longest first, cut out of the plain fragments the longer ones left, at
    every occurrence from the left.  split(text) alternates plain text and a
    special token's text, as a capturing regex's split does."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = _partition_order(texts)   # (given in the order of their ids)

    def split(self, text: str) -> list[str]:
        fragments: list[tuple[str, bool]] = [(text, False)]
        for t in self.texts:
            cut: list[tuple[str, bool]] = []
            for piece, special in fragments:
                if special or t not in piece:
                    cut.append((piece, special))
                    continue
                start = 0
                while (at := piece.find(t, start)) >= 0:
                    if at > start:
                        cut.append((piece[start:at], False))
                    cut.append((t, True))
                    start = at + len(t)
                if start < len(piece):
                    cut.append((piece[start:], False))
            fragments = cut
        out = [""]
        for piece, special in fragments:
            if special:
                out += [piece, ""]
            else:
                out[-1] += piece
        return out


# the longest text _splitter factors into a trie (its groups nest one a character)
_TRIE_DEPTH = 256


def _trie_pattern(texts: list[str]) -> str:
    """texts (non-empty) as one pattern of their shared prefixes, a character at a
    time: at each point the alternatives start with different characters and a
    text that ends there is an optional rest (greedy, so the longest text that
    matches wins, as with the longest-first alternation), so the engine tries
    one branch per character instead of every text at every position (2,000
    special tokens of deepseek's took 29 ms a megabyte that way)."""
    end = ""   # a node's key for "a text ends here" (a character is never empty)
    trie: dict[str, dict] = {}
    for t in texts:
        node = trie
        for ch in t:
            node = node.setdefault(ch, {})
        node[end] = {}

    def rest(node: dict[str, dict]) -> str:
        alternatives = [re.escape(ch) + rest(child) for ch, child in sorted(node.items())
                        if ch != end]
        if not alternatives:
            return ""
        body = alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"
        if end in node:
            return body + "?" if len(alternatives) == 1 and len(body) == 1 else \
                "(?:" + body + ")?"
        return body

    return rest(trie)
