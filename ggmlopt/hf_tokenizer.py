"""A Hugging Face checkpoint's own tokenizer: ``tokenizer.json`` run by the
``tokenizers`` library (as transformers' fast tokenizers run it) with
``tokenizer_config.json``'s special tokens, BOS rule and chat template.

``load_hf_tokenizer(directory)`` gives the tokenizer ggmlopt's generation, chat,
datasets and finetune command take, equal to ``AutoTokenizer.from_pretrained``
(two exceptions below): the same ids for the same text, special tokens written
in the text matched (``parse_special=True``, transformers' default) or left as text
(``parse_special=False``, transformers' ``split_special_tokens=True``), the
same decoding, the same chat template rendering.

The exceptions, where transformers 5 departs from the checkpoint's own files and
ggmlopt reads them as llama.cpp's converter does:

* a tokenizer_config.json ``add_bos_token`` / ``add_eos_token`` of true where the
  tokenizer.json's post-processor adds no such token: ggmlopt adds it (with a
  warning naming how to leave it out), transformers 5 does not;
* a ``tokenizer_class`` of ``LlamaTokenizer`` (Llama 2, Mistral v0.1): transformers
  5 rebuilds the pipeline (a Metaspace pre-tokenizer in place of the file's
  Prepend + Replace normalizer), which differs for text that starts with a space
  or follows a special token; ggmlopt runs tokenizer.json as written, as the
  ``tokenizers`` library and llama.cpp do.
"""
from __future__ import annotations

import json
import os
import threading
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from ._args import bool_arg
from ._bpe_words import WordEncoder
from ._optional import import_optional
from .metaspace_bpe import LINES, joined_before_space, word_pattern
from .pretokenizers import PRE_TOKENIZERS, staged_patterns
from .text import (
    EOG_TEXTS,
    _ChatTemplated,
    _FlagLock,
    _splitter,
    add_eos_flag,
    check_text,
    checked_ids,
    ids_around_special,
    not_eog_beside,
)

__all__ = ["HFTokenizer", "load_hf_tokenizer"]

SPACE = "\u2581"   # SentencePiece's visible space

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named tokens a chat template sees
_NAMED_KEYS = (*_SPECIAL_KEYS, "sep_token", "cls_token", "mask_token")
# transformers' clean_up_tokenization, in its order
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _token_text(value: Any) -> str | None:
    """A tokenizer_config entry's token text (a str or an AddedToken dict)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(_FlagLock, _ChatTemplated):
    """HFTokenizer(tokenizer_json, config=None): a ``tokenizers.Tokenizer`` loaded
    from tokenizer_json (a path) and the settings of a ``tokenizer_config.json``
    dict (bos_token, eos_token, add_bos_token, add_eos_token, chat_template).  Use
    ``load_hf_tokenizer(directory)``.

    ``encode(text, parse_special=True)`` -> int32 ids without the BOS
    (``add_bos`` says whether the model wants one first, ``add_eos`` whether a
    text is a document ending with the EOS: what the tokenizer.json's
    post-processor adds, as transformers and llama.cpp's converter read it, the
    config's add_bos_token / add_eos_token where it says nothing); ``decode(ids,
    skip_special=False)``; ``token_to_id``, ``id_to_token``; ``bos_id``,
    ``eos_id``, ``eog_ids`` (eos and the end-of-turn tokens llama.cpp knows by
    their text, ``<|im_end|>``, ``<|eot_id|>`` ...); ``chat_template`` and
    ``apply_chat_template``."""

    def __init__(self, tokenizer_json: str | os.PathLike[str],
                 config: dict[str, Any] | None = None, eos_ids: Iterable[int] = (),
                 config_token_ids: dict[str, int] | None = None):
        tk = import_optional("tokenizers", "tokenizers", "load_hf_tokenizer")
        self.path = os.fspath(tokenizer_json)
        self._tk: Any = tk.Tokenizer.from_file(self.path)
        # transformers' call neither cuts nor pads unless asked, whatever the file keeps
        self._tk.no_truncation()
        self._tk.no_padding()
        self._flag_lock = threading.Lock()
        config = dict(config or {})
        self.vocab_size = int(self._tk.get_vocab_size(with_added_tokens=True))
        added = self._tk.get_added_tokens_decoder()
        self._special = {t.content for t in added.values() if t.special}
        # the added tokens that take the whitespace after them (Phi-3's)
        self.rstrip_ids = frozenset(int(i) for i, t in added.items() if t.rstrip)
        # config.json's bos/eos/pad/unk/sep ids: where llama.cpp's converter looks for a
        # special token tokenizer_config.json does not name (Qwen2's bos)
        self.config_token_ids = {k: int(v) for k, v in (config_token_ids or {}).items()
                                 if isinstance(v, int) and not isinstance(v, bool)
                                 and 0 <= v < self.vocab_size}
        _refuse_what_is_not_read(self._tk, config, self.path)
        self._texts = {k: _token_text(config.get(k)) for k in _SPECIAL_KEYS}
        # what a chat template sees, as transformers' special_tokens_map: the named
        # tokens and a config's model-specific ones (any key ending in _token,
        # extra_special_tokens given by name: image_token, boi_token ...)
        extra = config.get("extra_special_tokens")
        named = {**config, **(extra if isinstance(extra, dict) else {})}
        self._named_texts = {k: t for k, v in named.items()
                             if k.endswith("_token") and (t := _token_text(v)) is not None}
        self.bos_id = self.token_to_id(self._texts["bos_token"]) if self._texts["bos_token"] \
            else None
        self.eos_id = self.token_to_id(self._texts["eos_token"]) if self._texts["eos_token"] \
            else None
        self.unk_id = self.token_to_id(self._texts["unk_token"])
        self.pad_id = self.token_to_id(self._texts["pad_token"])
        before, after = self._post_processor_parts()
        adopted = len(before) == 1 and self.bos_id is None
        if adopted:   # a config naming no bos_token: transformers still adds the post-processor's
            self.bos_id = int(before[0])
        if before not in ([], [self.bos_id]) or after not in ([], [self.eos_id]):
            # its other tokens would be silently missing from every encoded text
            names = [self._tk.id_to_token(i) for i in before], \
                [self._tk.id_to_token(i) for i in after]
            raise ValueError(f"tokenizer_json: {self.path!r}'s post-processor puts "
                             f"{names[0]} before a text and {names[1]} after it; "
                             "ggmlopt adds the BOS first and the EOS last only (bos_token "
                             "and eos_token in tokenizer_config.json)")
        # the post-processor decides where it says something: transformers adds what
        # it adds whatever the config's add_bos_token / add_eos_token say, and
        # llama.cpp's converter (gguf-py's SpecialVocab) opts for it over a config
        # key that disagrees; the key decides only where the post-processor says
        # nothing (none, or a template without a special token at that end)
        says_none = "ByteLevel" in self._post_processor_types()
        add_bos = _added(bool(before), says_none, config.get("add_bos_token"))
        self.add_bos = True if adopted else add_bos
        add_eos = _added(bool(after), says_none, config.get("add_eos_token"))
        # nothing to append without an eos
        self.add_eos = add_eos_flag(add_eos and self.eos_id is not None, self.eos_id)
        _warn_config_only_specials(self.path, add_bos and not before and not adopted
                                   and self.bos_id is not None,
                                   self.add_eos and not after)
        # what transformers' decode(skip_special_tokens=True) leaves out: the added
        # special tokens and every token the config names (an eos that is a word too)
        self._skipped = frozenset(i for t in [*self._texts.values(), *_extra_specials(config)]
                                  if (i := self.token_to_id(t)) is not None)
        self.eot_id = self.eom_id = None
        eog = {i for i in (self.eos_id,) if i is not None}
        by_text = {t: i for t in EOG_TEXTS if (i := self.token_to_id(t)) is not None}
        eog |= set(by_text.values())
        # the ones llama.cpp's loader takes out beside others (Gemma 4's </s> is a
        # normal token), unless the checkpoint names them itself
        eog -= {i for i in not_eog_beside(by_text, eog) if i is not None} - \
            {self.eos_id} - {int(i) for i in eos_ids}
        # the checkpoint's own (generation_config.json's eos_token_id list: what
        # transformers' generate stops at)
        eog |= {int(i) for i in eos_ids if 0 <= int(i) < self.vocab_size}
        self.eog_ids = frozenset(eog)
        # as the checkpoint lists them, what save_hf writes back (the first is
        # transformers' default pad)
        self.generation_eos_ids = tuple(int(i) for i in eos_ids
                                        if 0 <= int(i) < self.vocab_size)
        self._words = _word_path(self._tk)
        # transformers' clean-up of spaces before punctuation on decode, where the
        # config asks for it and the model is not BPE (WordPiece's; it skips BPE)
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False)) \
            and type(self._tk.model).__name__ != "BPE"
        template = config.get("chat_template")
        named = {}
        if isinstance(template, list):   # named templates: transformers' default is "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        # the template first: assigning it clears the named ones
        self.chat_template = template if isinstance(template, str) else None
        self.named_chat_templates = {k: v for k, v in named.items()
                                     if isinstance(k, str) and isinstance(v, str) and v}

    def _post_processor_parts(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer.json's post-processor puts before and after a text."""
        plain = self._tk.encode("a", add_special_tokens=False).ids
        full = self._tk.encode("a", add_special_tokens=True).ids
        at = next((i for i in range(len(full) - len(plain) + 1)
                   if full[i:i + len(plain)] == plain), 0)
        return list(full[:at]), list(full[at + len(plain):])

    def _post_processor_types(self) -> list[str]:
        """The types of the tokenizer.json's post-processor (a Sequence's parts)."""
        processor = self._tk.post_processor
        if processor is None:
            return []
        spec = json.loads(processor.__getstate__())
        return [str(p.get("type")) for p in spec.get("processors", [spec])
                if isinstance(p, dict)]

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """bos_token, eos_token ... as tokenizer_config.json names them (what a chat
        template sees)."""
        return dict(self._named_texts)

    def token_to_id(self, token: str | None) -> int | None:
        """The id of a token's text, or None."""
        if token is None:
            return None
        found = self._tk.token_to_id(token)
        return None if found is None else int(found)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary's text of an id (IndexError outside it)."""
        text = self._tk.id_to_token(int(token_id)) if 0 <= int(token_id) < self.vocab_size \
            else None
        if text is None:
            raise IndexError(f"token_id: {token_id} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return str(text)

    def encode(self, text: str, *, parse_special: bool = True) -> npt.NDArray[np.int32]:
        """text (str) -> int32 ids of shape (n,), without BOS; parse_special=False
        leaves special tokens written in the text as text."""
        check_text(text)
        if self._words is None:
            ids = self._library_encode(self._tk, text, parse_special).ids
        else:
            ids = self._words.encode(text, parse_special)
        return np.asarray(ids, dtype=np.int32)

    def encode_with_offsets(self, text: str, *, parse_special: bool = True
                            ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
        """(ids, offsets): encode's ids and int64 (n + 1,) byte offsets into the
        text's UTF-8, token i starting at offsets[i] (from the library's character
        offsets; the tokens of one character share its start), the text's length
        last: where Dataset.from_chat places each token to mask the prompt."""
        check_text(text)
        enc = self._library_encode(self._tk, text, parse_special)
        char_bytes = np.zeros(len(text) + 1, dtype=np.int64)
        np.cumsum([len(c.encode("utf-8")) for c in text], out=char_bytes[1:])
        starts = np.array([char_bytes[min(a, len(text))] for a, _ in enc.offsets] +
                          [char_bytes[-1]], dtype=np.int64)
        return np.asarray(enc.ids, dtype=np.int32), np.maximum.accumulate(starts)

    def decode(self, ids: npt.ArrayLike, *, skip_special: bool = False) -> str:
        """ids (integers in [0, vocab_size)) -> str; special tokens left out with
        skip_special; the spaces before punctuation cleaned up as transformers
        does where the config's clean_up_tokenization_spaces asks (not for BPE)."""
        skip_special = bool_arg(skip_special, "skip_special")
        ids_list = checked_ids(ids, self.vocab_size).tolist()
        if skip_special:
            ids_list = [i for i in ids_list if i not in self._skipped]
        text = str(self._tk.decode(ids_list, skip_special_tokens=skip_special))
        if self._clean_up:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


# added tokens' settings a tokenizer_config.json may give over tokenizer.json's that change
# the ids (transformers applies them; the special flag there it leaves)
_GENERIC_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")
_ADDED_FLAGS = ("lstrip", "rstrip", "single_word", "normalized")


def _refuse_what_is_not_read(tk: Any, config: dict[str, Any], path: str) -> None:
    """ValueError naming a tokenizer_config.json setting transformers applies over
    tokenizer.json and ggmlopt does not: special tokens matched as text
    (split_special_tokens), an added token's flags other than the file's, special
    tokens the file lacks (transformers adds them as new ids), a space prefix
    the file's pre-tokenizer does not write."""
    where = "tokenizer_config.json"
    if config.get("split_special_tokens"):
        raise ValueError(f"{where}: split_special_tokens=true (special tokens read as text) is "
                         "not read; encode(text, parse_special=False) does that per call")
    added = {t.content: t for t in tk.get_added_tokens_decoder().values()}
    for entry in (config.get("added_tokens_decoder") or {}).values():
        if not isinstance(entry, dict) or entry.get("content") not in added:
            continue
        token = added[entry["content"]]
        for flag in _ADDED_FLAGS:
            if flag in entry and bool(entry[flag]) != bool(getattr(token, flag)):
                raise ValueError(f"{where}: added_tokens_decoder gives {entry['content']!r} "
                                 f"{flag}={bool(entry[flag])}, {path!r} {flag}="
                                 f"{bool(getattr(token, flag))}; ggmlopt reads the "
                                 "tokenizer.json's (make them agree)")
    named = [_token_text(config.get(k)) for k in _SPECIAL_KEYS] + _extra_specials(config)
    missing = [t for t in named if t is not None and tk.token_to_id(t) is None]
    if missing:
        raise ValueError(f"{where}: names special tokens {missing} that {path!r} does not "
                         "have (transformers would add them as new ids the model lacks)")
    # null is "not set" (transformers 4 writes it); the generic classes ignore the key
    if config.get("add_prefix_space") is not None and config.get("tokenizer_class") not in \
            _GENERIC_CLASSES and bool(config["add_prefix_space"]) != _writes_space_prefix(tk):
        raise ValueError(f"{where}: add_prefix_space={bool(config['add_prefix_space'])} "
                         f"disagrees with {path!r}'s pre-tokenizer, which ggmlopt runs as it is")


def _added(by_post_processor: bool, says_none: bool, config_key: Any) -> bool:
    """Whether a BOS (EOS) is added, as gguf-py's SpecialVocab reads it: a
    post-processor's special token at that end says yes, a ByteLevel one says no
    (its setdefault), and otherwise tokenizer_config.json's boolean key decides."""
    if by_post_processor:
        return True
    if says_none:
        return False
    return bool(config_key) if isinstance(config_key, bool) else False


def _warn_config_only_specials(path: str, bos: bool, eos: bool) -> None:
    """Warn where tokenizer_config.json's add_bos_token / add_eos_token asks for
    a token tokenizer.json's post-processor does not add: llama.cpp's converter
    adds it (a GGUF of the checkpoint does), transformers 5 does not."""
    keys = [k for k, on in (("add_bos_token", bos), ("add_eos_token", eos)) if on]
    if not keys:
        return
    attrs = " and ".join(f"tokenizer.{k[:-6]} = False" for k in keys)
    warnings.warn(f"tokenizer: {path!r}'s post-processor does not add what "
                  f"tokenizer_config.json's {' and '.join(keys)} "
                  f"{'ask' if len(keys) > 1 else 'asks'} for; ggmlopt adds it, as "
                  "llama.cpp's converter (a GGUF of this checkpoint) does, where transformers "
                  f"5 leaves it out: set {attrs} for transformers' ids", UserWarning,
                  stacklevel=4)


def _extra_specials(config: dict[str, Any]) -> list[str | None]:
    """The texts of a config's additional_special_tokens and extra_special_tokens
    (a list, or a dict by name)."""
    texts: list[str | None] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key)
        texts += [_token_text(t) for t in (extra.values() if isinstance(extra, dict)
                                           else extra or ())]
    return texts


def _writes_space_prefix(tk: Any) -> bool:
    """Whether a tokenizer.json's pipeline puts a space before a text (a
    ByteLevel or Metaspace pre-tokenizer's prefix, or a Prepend normalizer)."""
    plain = tk.encode("a", add_special_tokens=False)
    return any(t.startswith(("\u0120", SPACE)) for t in plain.tokens[:1])


def load_hf_tokenizer(directory: str | os.PathLike[str]) -> HFTokenizer:
    """The tokenizer of a Hugging Face checkpoint directory (its tokenizer.json,
    and tokenizer_config.json when present: special tokens, add_bos_token,
    chat_template; special_tokens_map.json's special tokens over the config's
    where the config has no added_tokens_decoder, as transformers reads the
    older layout; a chat_template.jinja file as transformers 4.43+ writes it).
    FileNotFoundError without tokenizer.json (a slow-only tokenizer: convert it
    with transformers first); the ``tokenizers`` extra runs it."""
    directory = os.fspath(directory)
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"directory: no tokenizer.json in {directory!r} (save the "
                                "tokenizer with transformers' save_pretrained, which writes "
                                "one for fast tokenizers)")
    config: dict[str, Any] = {}
    config_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"directory: {config_path!r} is not valid JSON: {e}") from None
    # the older layout (a config without added_tokens_decoder) keeps the special
    # tokens in special_tokens_map.json, which transformers then reads over the config
    map_path = os.path.join(directory, "special_tokens_map.json")
    if "added_tokens_decoder" not in config and os.path.isfile(map_path):
        with open(map_path, encoding="utf-8") as f:
            try:
                special = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"directory: {map_path!r} is not valid JSON: {e}") from None
        if isinstance(special, dict):
            for key in _NAMED_KEYS:
                if special.get(key) is not None:
                    config[key] = special[key]
    # template files win over the config's entries, as transformers reads them:
    # chat_template.jinja the default, additional_chat_templates/NAME.jinja by name
    files = {"default": os.path.join(directory, "chat_template.jinja")}
    extra = os.path.join(directory, "additional_chat_templates")
    if os.path.isdir(extra):
        files.update({name.removesuffix(".jinja"): os.path.join(extra, name)
                      for name in sorted(os.listdir(extra)) if name.endswith(".jinja")})
    templates = {}
    for name, file in files.items():
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                templates[name] = f.read()
    if list(templates) == ["default"]:
        config["chat_template"] = templates["default"]
    elif templates:
        config["chat_template"] = [{"name": k, "template": v} for k, v in templates.items()]
    return HFTokenizer(path, config, generation_eos_ids(directory), _config_token_ids(directory))


def _config_token_ids(directory: str) -> dict[str, int]:
    """config.json's bos/eos/pad/unk/sep token ids (an id each; a list is left out)."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(config, dict):
        return {}
    return {k: v for k in ("bos", "eos", "pad", "unk", "sep")
            if isinstance(v := config.get(f"{k}_token_id"), int) and not isinstance(v, bool)}


def generation_eos_ids(directory: str | os.PathLike[str]) -> tuple[int, ...]:
    """The ids a checkpoint directory's generation stops at, as transformers'
    generate reads them: generation_config.json's eos_token_id (an id or a
    list), else config.json's; () when neither file says."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(os.fspath(directory), name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            try:
                eos = json.load(f).get("eos_token_id")
            except (json.JSONDecodeError, AttributeError):
                raise ValueError(f"directory: {path!r} is not a JSON object") from None
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise ValueError(f"{path}: eos_token_id: expected an id or a list of ids, got "
                             f"{eos!r}")
        return tuple(ids)
    return ()


class _WordPath:
    """A tokenizer.json encoded a word at a time (ggmlopt._bpe_words): its added
    tokens cut the text (the special ones only with parse_special), each plain
    part, normalized as the library would (prefix: SentencePiece's space prefix,
    and spaces as U+2581, when metaspace), goes through the WordEncoder."""

    def __init__(self, words: WordEncoder, added: list[dict[str, Any]], *,
                 metaspace: bool = False, prefix: str = "") -> None:
        self.words = words
        self.metaspace, self.prefix = metaspace, prefix
        self.ids = {t["content"]: int(t["id"]) for t in added}
        self.special = {t["content"] for t in added if t["special"]}
        self.splitter = _splitter([t["content"] for t in added])

    def encode(self, text: str, parse_special: bool) -> list[int]:
        def plain(piece: str) -> list[int]:
            if self.metaspace:
                piece = self.prefix + piece.replace(" ", SPACE)
            return self.words.encode(piece)

        if parse_special or self.splitter is None:
            return ids_around_special(text, self.splitter, self.ids, plain)
        # the library still finds every added token, leftmost and longest, and then
        # reads a special one's text as text: a plain added token inside it ("im_end"
        # in "<|im_end|>") is not matched
        ids: list[int] = []
        run = ""
        for i, piece in enumerate(self.splitter.split(text)):
            if i % 2 and piece not in self.special:
                ids += plain(run) if run else []
                ids.append(self.ids[piece])
                run = ""
            else:
                run += piece
        return ids + (plain(run) if run else [])


def _word_path(tk: Any) -> _WordPath | None:
    """The word-at-a-time path of a tokenizer.json the library would run as
    BPE with plain added tokens (none stripping spaces or matching whole words
    only) and either no normalizer and a byte-level pre-tokenizer of one to three
    regexes (Llama 3's, Qwen's, GPT-2's, SmolLM's kind) or deepseek's, or SentencePiece's
    normalizer (the space prefix, spaces as U+2581) and no pre-tokenizer (Llama
    2's, Mistral's, Phi-3's) or one that isolates lines (Gemma 4's); None for any
    other pipeline, which stays with the library."""
    spec = json.loads(tk.to_str())
    model = spec.get("model") or {}
    added = spec.get("added_tokens") or []
    if model.get("type") != "BPE" or any(model.get(k) for k in (
            "dropout", "continuing_subword_prefix", "end_of_word_suffix")) or any(
            t.get(k) for t in added for k in ("lstrip", "rstrip", "single_word")):
        return None
    if len({bool(t.get("normalized")) for t in added}) > 1:
        return None   # two passes of matching in the library: keep its order
    types = import_optional("tokenizers", "tokenizers", "load_hf_tokenizer")
    words_tk = types.Tokenizer(tk.model)   # the model alone: one word's merges
    if spec.get("normalizer") is None:
        regexes = _split_regexes(spec.get("pre_tokenizer"))
        if regexes is None:
            return None
        words_tk.pre_tokenizer = types.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                use_regex=False)
        whole = tk.get_vocab(with_added_tokens=False) if model.get("ignore_merges") else None
        words = WordEncoder.make(regexes, words_tk, whole)
        return None if words is None else _WordPath(words, added)
    if any(t.get("normalized") for t in added):
        return None   # the library matches them in the normalized text (spaces as U+2581)
    prefix = _metaspace_prefix(spec.get("normalizer"))
    pre = spec.get("pre_tokenizer")
    if prefix is None or pre is not None and not _splits_lines(pre):
        return None
    # cut before runs of spaces, except after a character some piece joins to a space
    # (no merge crosses such a cut); lines first where the pipeline splits them
    joined = joined_before_space(tk.get_vocab(with_added_tokens=False))
    patterns = ([] if pre is None else [LINES]) + [word_pattern(joined)]
    words = WordEncoder.make(patterns, words_tk)
    return None if words is None else _WordPath(words, added, metaspace=True, prefix=prefix)


def _splits_lines(pre: dict[str, Any]) -> bool:
    """Whether a pre-tokenizer is Gemma 4's: lines and runs of newlines isolated."""
    return pre.get("type") == "Split" and pre.get("behavior") == "Isolated" \
        and not pre.get("invert") and (pre.get("pattern") or {}).get("Regex") == LINES


def _metaspace_prefix(normalizer: Any) -> str | None:
    """SentencePiece's normalizer as tokenizer.json writes it: Replace(" ", U+2581)
    after an optional Prepend(U+2581); the prefix ("" without it), else None."""
    steps = normalizer.get("normalizers", []) if isinstance(normalizer, dict) and \
        normalizer.get("type") == "Sequence" else [normalizer]
    if not steps or not all(isinstance(n, dict) for n in steps):
        return None
    *first, last = steps
    if last.get("type") != "Replace" or last.get("pattern") != {"String": " "} \
            or last.get("content") != SPACE:
        return None
    if not first:
        return ""
    if len(first) == 1 and first[0].get("type") == "Prepend" and \
            first[0].get("prepend") == SPACE:
        return SPACE
    return None


def _split_regexes(pre: Any) -> list[str] | None:
    """The regexes of a ByteLevel pre-tokenizer (GPT-2's own with use_regex) after
    isolating Splits, at most three in all or a sequence that
    pretokenizers.staged_patterns knows; else None."""
    steps = pre.get("pretokenizers", []) if isinstance(pre, dict) and \
        pre.get("type") == "Sequence" else [pre]
    if not steps or not all(isinstance(p, dict) for p in steps):
        return None
    *splits, last = steps
    if last.get("type") != "ByteLevel" or last.get("add_prefix_space"):
        return None
    regexes = []
    for step in splits:
        pattern = step.get("pattern") or {}
        if step.get("type") != "Split" or step.get("behavior") != "Isolated" \
                or step.get("invert") or "Regex" not in pattern:
            return None
        regexes.append(pattern["Regex"])
    if last.get("use_regex", True):
        regexes.append(PRE_TOKENIZERS["gpt-2"][0])
    # past three, each more is one more pass over the pieces, unless the sequence has
    # a form that cuts all pieces at once (deepseek's five and six)
    if len(regexes) > 3 and staged_patterns(tuple(regexes)) is None:
        return None
    return regexes or None
