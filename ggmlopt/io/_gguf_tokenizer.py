"""A tokenizer as llama.cpp's GGUF keys hold it (tokenizer.ggml.*), read:
the tokenizer a file's keys describe (tokenizer_from_fields), and the
vocabulary facts both directions share (ByteTokenizer's byte vocabulary, the
pre-tokenizers after which llama.cpp puts BOS first, Phi-3's rstrip rule).
Writing the keys: ggmlopt.io._gguf_tokenizer_keys."""
from __future__ import annotations

import warnings
from typing import Any

from ..text import GPT2_BYTE_STRINGS, ByteTokenizer

__all__ = ["ADD_EOS_KEY", "BOS_BY_DEFAULT_PRE", "BYTE_MERGES", "BYTE_PRE", "byte_vocabulary",
           "rstrip_ids", "tokenizer_from_fields"]

BYTE_MERGES = ("a 1",)  # a letter then a digit: never in one word of GPT-2's pre-tokenizer
BYTE_PRE = "gpt-2"
_EOT = "<|endoftext|>"
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL / _CONTROL
# the gpt2-type pre-tokenizers after which llama.cpp puts BOS first when the file
# has no tokenizer.ggml.add_bos_token (llama-vocab.cpp; every other one: no BOS)
BOS_BY_DEFAULT_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                "pixtral", "midm-2.0", "lfm2", "jina-v5-nano", "tekken",
                                "chameleon"})
ADD_EOS_KEY = "tokenizer.ggml.add_eos_token"


def rstrip_ids(name: object, tokens: list[str], types: list[int]) -> frozenset[int]:
    """The tokens llama.cpp gives the rstrip attribute (whitespace after them
    dropped when text is tokenized), by the file's general.name: a Phi-3's
    special tokens (control, user-defined, unknown, and the end-of-generation
    ones it makes control) and ``</s>``, but ``<unk>``, ``<s>`` and
    ``<|endoftext|>`` (llama-vocab.cpp's Phi-3 rule); none for another model."""
    from ..text import TOKEN_UNKNOWN, llama_cpp_special
    lowered = str(name or "").lower()
    if "phi-3" not in lowered and "phi3" not in lowered:
        return frozenset()
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    control, user, _ = llama_cpp_special(types, ids, ())
    special = control | user | {i for i, t in enumerate(types) if t == TOKEN_UNKNOWN}
    special |= {ids["</s>"]} if "</s>" in ids else set()
    return frozenset(i for i in special if tokens[i] not in ("<unk>", "<s>", "<|endoftext|>"))


def byte_vocabulary() -> list[str]:
    """ByteTokenizer's tokens as a byte-level BPE vocabulary stores them: 257 str,
    GPT-2's byte-to-unicode string of bytes 0..255, then ``<|endoftext|>``."""
    return [*GPT2_BYTE_STRINGS, _EOT]


def _is_byte_vocabulary(fields: dict[str, Any]) -> bool:
    return (fields.get("tokenizer.ggml.model") == "gpt2"
            and fields.get("tokenizer.ggml.tokens") == byte_vocabulary()
            and fields.get("tokenizer.ggml.merges") == list(BYTE_MERGES)
            and fields.get("tokenizer.ggml.pre") == BYTE_PRE
            and not fields.get("tokenizer.ggml.add_bos_token", False))


def _add_eos(fields: dict[str, Any], where: str, eos_id: int | None = None) -> bool:
    """tokenizer.ggml.add_eos_token (False without it, llama.cpp's default for
    the SPM and BPE types); a file asking for an EOS it names nowhere (eos_id:
    the one the vocabulary takes without the key, SPM's 2) is refused."""
    add_eos = bool(fields.get(ADD_EOS_KEY, False))
    if add_eos and fields.get("tokenizer.ggml.eos_token_id", eos_id) is None:
        raise ValueError(f"{where}: {ADD_EOS_KEY} is true but the file has no "
                         "tokenizer.ggml.eos_token_id")
    return add_eos


def _spm_special(fields: dict[str, Any], which: str, default: int, n: int) -> int | None:
    """A SentencePiece vocabulary's special id: the file's, else llama.cpp's
    default for the type (bos 1, eos 2, unk 0) where the vocabulary has it."""
    value = fields.get(f"tokenizer.ggml.{which}_token_id")
    return value if value is not None else (default if default < n else None)


def tokenizer_from_fields(fields: dict[str, Any], where: str):
    """The tokenizer a GGUF's tokenizer.ggml.* keys describe: a ByteTokenizer for
    save_gguf's byte vocabulary, a BPETokenizer (the ``tokenizers`` extra) for
    another gpt2-type one, a MetaspaceBPETokenizer for a gemma4-type one, an
    SPMTokenizer for a llama-type one, a WordPieceTokenizer for a bert-type one,
    None with a UserWarning for any other.  Its chat template is
    tokenizer.chat_template, and the named ones (tokenizer.chat_template.<name>:
    Command R's tool_use and rag) are its named_chat_templates; its pad_id (and
    an unk_id it lacks) is tokenizer.ggml.padding_token_id (unknown_token_id)
    where the file has one in the vocabulary."""
    tokenizer = _tokenizer_of_kind(fields, where)
    pad = fields.get("tokenizer.ggml.padding_token_id")
    if tokenizer is not None and isinstance(pad, int) and not isinstance(pad, bool) \
            and 0 <= pad < tokenizer.vocab_size:
        tokenizer.pad_id = pad   # llama_vocab_pad's (a Hugging Face pad_token)
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    if tokenizer is not None and getattr(tokenizer, "unk_id", None) is None \
            and isinstance(unk, int) and not isinstance(unk, bool) \
            and 0 <= unk < tokenizer.vocab_size:
        tokenizer.unk_id = unk   # named, for a Hugging Face unk_token
    prefix = "tokenizer.chat_template."
    named = {k[len(prefix):]: v for k, v in fields.items()
             if k.startswith(prefix) and isinstance(v, str) and v}
    if tokenizer is not None and named:
        tokenizer.named_chat_templates = named
    return tokenizer


def _tokenizer_of_kind(fields: dict[str, Any], where: str):
    kind = fields.get("tokenizer.ggml.model")
    template = fields.get("tokenizer.chat_template")
    template = template if isinstance(template, str) and template else None
    if kind == "gpt2" and _is_byte_vocabulary(fields):
        return ByteTokenizer(chat_template=template, add_eos=_add_eos(fields, where))
    if kind in ("gpt2", "gemma4"):
        from ..metaspace_bpe import MetaspaceBPETokenizer
        from ..text import BPETokenizer
        tokens = fields.get("tokenizer.ggml.tokens")
        merges = fields.get("tokenizer.ggml.merges")
        if not isinstance(tokens, list) or not isinstance(merges, list):
            raise ValueError(f"{where}: a {kind} tokenizer without tokenizer.ggml.tokens or "
                             "tokenizer.ggml.merges")
        # llama.cpp's defaults for a gpt2-type vocabulary without the keys: 11 for both
        default = 11 if kind == "gpt2" and len(tokens) > 11 else None
        eos, bos = (fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "bos"))
        common: dict[str, Any] = {
            "token_types": fields.get("tokenizer.ggml.token_type"),
            "eos_id": default if eos is None else eos,
            "bos_id": default if bos is None else bos,
            "eot_id": fields.get("tokenizer.ggml.eot_token_id"),
            "eom_id": fields.get("tokenizer.ggml.eom_token_id"),
            "chat_template": template,
            "add_eos": _add_eos(fields, where)}
        if kind == "gemma4":   # llama.cpp puts BOS first for it whatever add_bos_token says
            return MetaspaceBPETokenizer(tokens, merges, add_bos=True, **common)
        pre = fields.get("tokenizer.ggml.pre")
        if pre is None:
            warnings.warn(f"{where}: no tokenizer.ggml.pre; the words are cut as llama.cpp "
                          "cuts them then (its 'default' pre-tokenizer, which it warns "
                          "degrades the model's text)", UserWarning, stacklevel=3)
            pre = "default"
        # without the key, llama.cpp's default for the pre-tokenizer (BOS for Llama 3's)
        add_bos = fields.get("tokenizer.ggml.add_bos_token", pre in BOS_BY_DEFAULT_PRE)
        return BPETokenizer(tokens, merges, add_bos=bool(add_bos), pre=pre, **common)
    if kind == "llama":
        from ..spm import SPMTokenizer
        tokens, scores = fields.get("tokenizer.ggml.tokens"), fields.get("tokenizer.ggml.scores")
        types = fields.get("tokenizer.ggml.token_type")
        if not isinstance(tokens, list) or not isinstance(scores, list) \
                or not isinstance(types, list):
            warnings.warn(f"{where}: a 'llama' (SentencePiece) vocabulary without "
                          "tokenizer.ggml.tokens, .scores or .token_type; the tokenizer is "
                          "None, give token ids directly", UserWarning, stacklevel=3)
            return None
        eos = _spm_special(fields, "eos", 2, len(tokens))
        return SPMTokenizer(tokens, scores, types,
                            bos_id=_spm_special(fields, "bos", 1, len(tokens)),
                            eos_id=eos,
                            unk_id=_spm_special(fields, "unknown", 0, len(tokens)),
                            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", True)),
                            add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix",
                                                             True)),
                            eot_id=fields.get("tokenizer.ggml.eot_token_id"),
                            eom_id=fields.get("tokenizer.ggml.eom_token_id"),
                            chat_template=template,
                            rstrip_ids=rstrip_ids(fields.get("general.name"), tokens, types),
                            add_eos=_add_eos(fields, where, eos))
    if kind == "bert":
        from ..wordpiece import WordPieceTokenizer
        tokens, types = fields.get("tokenizer.ggml.tokens"), fields.get("tokenizer.ggml.token_type")
        if not isinstance(tokens, list) or not isinstance(types, list):
            raise ValueError(f"{where}: a bert (WordPiece) tokenizer without "
                             "tokenizer.ggml.tokens or .token_type")

        def special(key, default):
            # llama.cpp's WPM ids: the key, else BERT's own id where the vocabulary has it
            # (it reads bos_token_id for CLS and ignores cls_token_id)
            value = fields.get(f"tokenizer.ggml.{key}")
            return value if value is not None else (default if default < len(tokens) else None)

        unk = special("unknown_token_id", 100)
        if unk is None:
            raise ValueError(f"{where}: a bert (WordPiece) tokenizer without "
                             "tokenizer.ggml.unknown_token_id (and fewer than 101 tokens)")
        # llama.cpp's defaults without the keys: lowercase (not for the 'whitespace'
        # pre-tokenizer), and strip accents as lowercase says
        lowercase = bool(fields.get("tokenizer.ggml.normalizer.lowercase",
                                    fields.get("tokenizer.ggml.pre") != "whitespace"))
        return WordPieceTokenizer(
            tokens, types, unk_id=unk, cls_id=special("bos_token_id", 101),
            sep_id=special("seperator_token_id", 102), lowercase=lowercase,
            strip_accents=bool(fields.get("tokenizer.ggml.normalizer.strip_accents", lowercase)),
            chat_template=template)
    warnings.warn(f"{where}: tokenizer type {kind!r} is not read by ggmlopt (gpt2-type BPE, "
                  "llama-type SentencePiece, gemma4-type and bert-type (WordPiece) vocabularies "
                  "are); the tokenizer "
                  "is None, "
                  "give token ids directly", UserWarning, stacklevel=3)
    return None
