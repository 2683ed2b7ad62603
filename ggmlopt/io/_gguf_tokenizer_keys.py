"""A tokenizer written as llama.cpp's GGUF keys (tokenizer.ggml.*): what every
architecture's writer (gguf_llama, gguf_gpt2) puts in its file.  Reading
them back: ggmlopt.io._gguf_tokenizer."""
from __future__ import annotations

import warnings
from typing import Any

from ..text import ByteTokenizer
from ._gguf_tokenizer import BYTE_MERGES, BYTE_PRE, TOKEN_CONTROL, TOKEN_NORMAL, byte_vocabulary

__all__ = ["add_tokenizer", "tokenizer_keys"]


def tokenizer_keys(tokenizer, vocab_size: int) -> dict[str, Any]:
    """The tokenizer.ggml.* values for tokenizer (ByteTokenizer, BPETokenizer,
    SPMTokenizer, or load_hf_tokenizer's HFTokenizer: ggmlopt.io._hf_gguf_vocab)."""
    from ..hf_tokenizer import HFTokenizer
    from ..spm import SPMTokenizer
    from ..text import BPETokenizer
    if isinstance(tokenizer, HFTokenizer):
        from ._hf_gguf_vocab import hf_tokenizer_keys
        return hf_tokenizer_keys(tokenizer, vocab_size)
    if isinstance(tokenizer, ByteTokenizer):
        tokens = byte_vocabulary()
        keys: dict[str, Any] = {
            "model": "gpt2", "pre": BYTE_PRE, "tokens": tokens,
            "types": [TOKEN_NORMAL] * 256 + [TOKEN_CONTROL], "merges": list(BYTE_MERGES),
            "bos": tokenizer.eos_id, "eos": tokenizer.eos_id, "add_bos": False}
    elif isinstance(tokenizer, BPETokenizer):
        tokens = list(tokenizer.tokens)
        keys = {"model": tokenizer.gguf_model, "pre": tokenizer.pre, "tokens": tokens,
                "types": list(tokenizer.token_types), "merges": list(tokenizer.merges),
                "bos": tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id,
                "eos": tokenizer.eos_id, "add_bos": tokenizer.add_bos,
                "eot": tokenizer.eot_id, "eom": tokenizer.eom_id}
        if not keys["merges"]:
            raise ValueError(f"tokenizer: a {tokenizer.gguf_model}-type vocabulary needs at "
                             "least one merge "
                             "(llama.cpp refuses one without)")
    elif isinstance(tokenizer, SPMTokenizer):
        # llama.cpp's llama-type (SentencePiece) vocabulary: pieces with scores, no merges
        tokens = list(tokenizer.tokens)
        keys = {"model": "llama", "pre": "default", "tokens": tokens,
                "types": list(tokenizer.token_types), "scores": list(tokenizer.scores),
                "bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "unk": tokenizer.unk_id,
                "add_bos": tokenizer.add_bos, "add_space_prefix": tokenizer.add_space_prefix,
                "eot": tokenizer.eot_id, "eom": tokenizer.eom_id}
    else:
        raise TypeError(f"tokenizer: expected a ggmlopt.text.ByteTokenizer, BPETokenizer, "
                        f"SPMTokenizer or HFTokenizer, got {type(tokenizer).__name__}")
    if len(tokens) != vocab_size:
        raise ValueError(f"tokenizer: it has {len(tokens)} tokens but the model's vocab_size is "
                         f"{vocab_size}; llama.cpp needs them equal")
    return keys


def add_tokenizer(writer, tok: dict[str, Any], tokenizer) -> None:
    """Write tokenizer_keys' tok (and the tokenizer's chat templates, its
    add_eos flag, its padding id and an unknown id the vocabulary's keys
    lack) with a gguf-py GGUFWriter."""
    writer.add_tokenizer_model(tok["model"])
    writer.add_tokenizer_pre(tok["pre"])
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    if "merges" in tok:
        writer.add_token_merges(tok["merges"])
    if "scores" in tok:
        writer.add_token_scores(tok["scores"])
        writer.add_add_space_prefix(tok["add_space_prefix"])
    # what load_gguf_tokenizer read besides the vocabulary's own keys: a BPE
    # vocabulary's unknown token, the padding token (llama_vocab_pad)
    ids = {**tok, "unk": tok.get("unk") if tok.get("unk") is not None
           else _id_in(tokenizer, "unk_id", len(tok["tokens"])),
           "pad": tok.get("pad") if tok.get("pad") is not None
           else _id_in(tokenizer, "pad_id", len(tok["tokens"]))}
    for which, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                       ("unk", writer.add_unk_token_id), ("sep", writer.add_sep_token_id),
                       ("pad", writer.add_pad_token_id)):
        if ids.get(which) is not None:
            add(ids[which])
    writer.add_add_bos_token(tok["add_bos"])
    writer.add_add_eos_token(bool(getattr(tokenizer, "add_eos", False)))
    for which in ("eot", "eom"):
        if tok.get(which) is not None:
            writer.add_uint32(f"tokenizer.ggml.{which}_token_id", tok[which])
    # the default template and the named ones (Command R's tool_use, rag) as
    # llama.cpp's converter writes them: tokenizer.chat_template.<name>
    named = getattr(tokenizer, "named_chat_templates", None) or {}
    templates = [{"name": _gguf_template_name(name, named), "template": source}
                 for name, source in named.items()
                 if name != "default" and isinstance(source, str) and source]
    default = getattr(tokenizer, "chat_template", None)
    if default:
        templates.append({"name": "default", "template": default})
    if templates:
        writer.add_chat_template(templates)


def _gguf_template_name(name: str, named: dict) -> str:
    """The key name a named template gets in GGUF (gguf-py and llama.cpp's converter
    keep ASCII letters and digits, other characters become "_"): said with a
    warning when it differs; ValueError when two names would become one."""
    safe = _key_safe(name)
    if safe != name:
        clash = [other for other in named if other != name and _key_safe(other) == safe]
        if clash:
            raise ValueError(f"tokenizer: named chat templates {name!r} and {clash[0]!r} would "
                             f"both be written as tokenizer.chat_template.{safe}")
        warnings.warn(f"tokenizer: the chat template named {name!r} is written as "
                      f"tokenizer.chat_template.{safe} (a GGUF key keeps letters and digits)",
                      UserWarning, stacklevel=4)
    return safe


def _key_safe(name: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else "_" for c in name)


def _id_in(tokenizer, attribute: str, n: int) -> int | None:
    """tokenizer's id of that attribute when it is one of the n tokens."""
    value = getattr(tokenizer, attribute, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n \
        else None
