"""A tokenizer as a Hugging Face checkpoint holds it: ``tokenizer.json`` (run by
the ``tokenizers`` library, as transformers' fast tokenizers run it),
``tokenizer_config.json`` (the special tokens, the chat template) and
``generation_config.json`` (the ids generation starts and stops at), written by
``save_hf(model, directory, tokenizer=...)`` so that ``AutoTokenizer`` loads the
tokenizer the model was trained with and encodes as ggmlopt does.

- A tokenizer read from a checkpoint (``load_hf_tokenizer``) writes its own
  tokenizer.json back.
- A byte-level BPE vocabulary (``BPETokenizer``: a GGUF's gpt2-type one) is its
  ``tokenizers`` model (vocabulary, merges, llama.cpp's pre-tokenizer regexes,
  Llama 3's ignore_merges) with its control tokens as special added tokens and
  its user-defined ones as plain added tokens (both matched whole in text, as
  llama.cpp's parse_special does), and a post-processor that puts the BOS first
  where the vocabulary says so.
- ``ByteTokenizer``: a BPE of its 256 byte tokens and no merges.
- A SentencePiece vocabulary (``SPMTokenizer``: a GGUF's llama-type one) as
  transformers' Llama tokenizers hold one: BPE merges ordered by the joined
  piece's score, byte fallback, the space prefix as llama.cpp adds it.
"""
from __future__ import annotations

import json
from typing import Any

from .._optional import import_optional

__all__ = ["generation_config", "named_templates", "tokenizer_config", "tokenizer_json"]

def _tokenizers():
    return import_optional("tokenizers", "tokenizers", "save_hf(..., tokenizer=...)")


def _with_specials(tk, tok, tokenizer) -> None:
    """The post-processor that adds what transformers adds with special tokens:
    the BOS first (add_bos), the EOS last (add_eos)."""
    first = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    last = [tokenizer.eos_id] if getattr(tokenizer, "add_eos", False) else []
    if not first and not last:
        return
    texts = {i: tokenizer.tokens[i] for i in first + last}
    one = [texts[i] for i in first] + ["$A"] + [texts[i] for i in last]
    two = one + [texts[i] for i in first] + ["$B"] + [texts[i] for i in last]
    tok.post_processor = tk.processors.TemplateProcessing(
        single=" ".join(one), pair=" ".join(two),
        special_tokens=[(text, i) for i, text in texts.items()])


def tokenizer_json(tokenizer) -> str:
    """tokenizer.json's text for a ggmlopt tokenizer (see the module's docstring);
    TypeError for a tokenizer it has no form for."""
    from ..hf_tokenizer import HFTokenizer
    from ..spm import SPMTokenizer
    from ..text import GPT2_BYTE_STRINGS, BPETokenizer, ByteTokenizer
    if isinstance(tokenizer, HFTokenizer):
        with open(tokenizer.path, encoding="utf-8") as f:
            return f.read()
    tk = _tokenizers()
    if isinstance(tokenizer, ByteTokenizer):
        vocab = {s: i for i, s in enumerate(GPT2_BYTE_STRINGS)}
        vocab[tokenizer.eos_text] = tokenizer.eos_id
        tok = tk.Tokenizer(tk.models.BPE(vocab, []))   # a byte a token: no merges
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                        use_regex=False)
        tok.decoder = tk.decoders.ByteLevel()
        tok.add_special_tokens([tk.AddedToken(tokenizer.eos_text, normalized=False,
                                              special=True)])
        if getattr(tokenizer, "add_eos", False):
            eos = tokenizer.eos_text
            tok.post_processor = tk.processors.TemplateProcessing(
                single=f"$A {eos}", pair=f"$A {eos} $B {eos}",
                special_tokens=[(eos, tokenizer.eos_id)])
        return str(tok.to_str())
    if isinstance(tokenizer, (BPETokenizer, SPMTokenizer)):
        tok = tokenizer.hf_tokenizer()   # the library's form of what encode runs
        _with_specials(tk, tok, tokenizer)
        return str(tok.to_str())
    raise TypeError(f"tokenizer: expected a ggmlopt tokenizer (ByteTokenizer, BPETokenizer, "
                    f"SPMTokenizer, load_hf_tokenizer's), got {type(tokenizer).__name__}")


def _special_text(tokenizer, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    return str(tokenizer.id_to_token(token_id)) if hasattr(tokenizer, "id_to_token") else \
        getattr(tokenizer, "eos_text", None)


def _special_kind_problem(tokenizer, key: str, token_id: int) -> str | None:
    """Why a vocabulary token cannot be named as tokenizer_config.json's key: a
    normal token (a word), which transformers would make special and match
    inside words; None where it can be."""
    # the tokens llama.cpp matches whole (its control and user-defined ones, by type
    # or by text: aquila's <|endoftext|> is typed normal), which the file holds as
    # added tokens
    control, user = getattr(tokenizer, "_control", None), getattr(tokenizer, "_user", None)
    if control is None or user is None or token_id in control or token_id in user:
        return None
    return (f"tokenizer: its {key} {_special_text(tokenizer, token_id)!r} (id {token_id}) is a "
            "normal token, which transformers would make special and find inside words")


def named_templates(tokenizer) -> dict[str, str]:
    """A tokenizer's named chat templates (Command R's tool_use and rag), each a
    file additional_chat_templates/<name>.jinja as transformers writes them."""
    named = dict(getattr(tokenizer, "named_chat_templates", None) or {})
    for name in named:
        if not name or any(c in name for c in "/\\") or name.startswith("."):
            raise ValueError(f"tokenizer: a chat template named {name!r} makes no file name")
    return named


def tokenizer_config(tokenizer, max_len: int) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens' texts, whether a BOS comes
    first, the chat template (in chat_template.jinja instead where there are
    named ones too) and the context length; ValueError for a BOS or EOS that is
    a normal token."""
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "model_max_length": int(max_len),
                              # a checkpoint's own tokenizer decodes as its config says
                              "clean_up_tokenization_spaces":
                                  bool(getattr(tokenizer, "_clean_up", False)),
                              "add_bos_token": bool(getattr(tokenizer, "add_bos", False)),
                              "add_eos_token": bool(getattr(tokenizer, "add_eos", False))}
    for key, token_id in (("bos_token", getattr(tokenizer, "bos_id", None)),
                          ("eos_token", getattr(tokenizer, "eos_id", None)),
                          ("unk_token", getattr(tokenizer, "unk_id", None)),
                          ("pad_token", getattr(tokenizer, "pad_id", None))):
        text = _special_text(tokenizer, token_id)
        if token_id is None or text is None:
            continue
        problem = _special_kind_problem(tokenizer, key, token_id)
        if problem is not None and key in ("bos_token", "eos_token"):
            raise ValueError(problem)
        if problem is None:   # a pad or unk that is a word is left unnamed
            config[key] = text
    if getattr(tokenizer, "chat_template", None) and not named_templates(tokenizer):
        config["chat_template"] = tokenizer.chat_template
    return config


def generation_config(tokenizer) -> dict[str, Any]:
    """generation_config.json: the BOS and the ids generation stops at (a
    checkpoint's own tokenizer: its generation_config.json's, in its order;
    else the tokenizer's end-of-generation set, llama.cpp's EOG ids)."""
    config: dict[str, Any] = {"_from_model_config": False}
    bos = getattr(tokenizer, "bos_id", None)
    if bos is not None:
        config["bos_token_id"] = int(bos)
    eos = getattr(tokenizer, "eos_id", None)
    eog = [int(i) for i in getattr(tokenizer, "generation_eos_ids", ())]
    if not eog:
        eog = sorted(int(i) for i in getattr(tokenizer, "eog_ids", ()))
        if eos is not None and int(eos) not in eog:
            eog.insert(0, int(eos))
    if eog:
        config["eos_token_id"] = eog[0] if len(eog) == 1 else eog
    return config


def dumps(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, ensure_ascii=False) + "\n"
