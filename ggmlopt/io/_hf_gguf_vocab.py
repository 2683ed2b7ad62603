"""A Hugging Face tokenizer (``load_hf_tokenizer``'s HFTokenizer: tokenizer.json
and tokenizer_config.json) as llama.cpp's GGUF keys hold it, what save_gguf
writes for one: the keys llama.cpp's converter (convert_hf_to_gguf.py and
gguf-py's SpecialVocab) writes for the same files, for the two kinds ggmlopt
reproduces as llama.cpp tokenizes them.

- Byte-level BPE (GPT-2, Llama 3, Qwen2/3, SmolLM ...): ``gpt2``, the tokens and
  types as the converter's get_vocab_base gives them, the merges, and
  ``tokenizer.ggml.pre`` found as the converter finds it: the hash of the ids of
  its fixed text (get_vocab_base_pre), here for the names ggmlopt reproduces.
- SentencePiece's BPE with byte fallback (Llama 2, Mistral, Phi-3): ``llama``,
  types as the converter's SentencePiece path gives them, and scores made from
  the merges' order (llama.cpp's SentencePiece merges the pair whose joined
  piece scores highest; the converter's tokenizer.json-only path, LlamaHfVocab,
  writes -1000 for every piece, which tokenizes otherwise).

Anything else is refused (ValueError): a pre-tokenizer llama.cpp would not know,
or one ggmlopt cannot check, would make llama.cpp cut the words otherwise, with
no error.  Before the keys are used, the tokenizer they describe (as load_gguf
reads them back, ggmlopt's model of llama.cpp's tokenizer) must encode a set of
adversarial texts as the HFTokenizer does; ValueError naming the first that differs.
"""
from __future__ import annotations

import hashlib
import json
import re
import warnings
from typing import Any

from ..pretokenizers import IGNORE_MERGES, PRE_TOKENIZERS
from ..text import (
    EOG_TEXTS,
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_USER_DEFINED,
)
from ._gguf_tokenizer import tokenizer_from_fields

__all__ = ["CHKTXT", "hf_tokenizer_keys"]

TOKEN_UNUSED = 5
SPACE = "\u2581"
# the converter's text (get_vocab_base_pre): the hash of its ids names the pre-tokenizer
CHKTXT = ("\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis "
          "concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
          "កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български "
          "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M "
          "not sure I'll make it, 'D you like some tea? We'Ve a'lL")
# the converter's hashes (llama.cpp's conversion/base.py, get_vocab_base_pre) of the
# pre-tokenizers ggmlopt reproduces (ggmlopt.pretokenizers); where it tests a hash twice
# the later name wins (mpt-7b's hash is olmo's: both GPT-2's regex)
_CHKHSH = {
    "b6e8e1518dc4305be2fe39c313ed643381c4da5db34a98f6a04c093f8afbe99b": "chatglm-bpe",
    "81d72c7348a9f0ebe86f23298d37debe0a5e71149e29bd283904c02262b27516": "chatglm-bpe",
    "1431a23e583c97432bc230bff598d103ddb5a1f89960c8f1d1051aaa944d0b35": "minerva-7b",
    "7e57df22b1fe23a7b1e1c7f3dc4e3f96d43a4eb0836d0c6bdc3436d7b2f1c664": "hunyuan",
    "a6b57017d60e6edb4d88ecc2845188e0eb333a70357e45dcc9b53964a73bbae6": "falcon-h1",
    "60476e1243776c4fb1b993dbd7a5f15ac22f83c80afdf425fa5ae01c8d44ef86": "falcon-h1",
    "3eda48b4c4dc7de733d1a8b3e3b4a85243dbbf704da2ee9d42c6beced8897896": "falcon-h1",
    "48f8e02c0359c0bbdd82f26909171fac1c18a457bb47573ed1fe3bbb2c1cfd4b": "falcon-h1",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": "qwen35",
    "0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4": "gpt-2",
    "9e454714343b69b99b71795c1d27a68c2a1d15dab111f4d353109f966af29da7": "lfm2",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",
    "8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed": "falcon",
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3": "stablelm2",
    "6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff": "refact",
    "9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8": "command-r",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen/Qwen1.5-7B
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "olmo",
    "a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e": "dbrx",
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",
    "c7ea5862a53e4272c035c8238367063e2b270d51faa48c0f09e9d5b54746c360": "poro-chat",
    "7fc505bd3104ca1083b150b17d088b59534ede9bde81f0dd2090967d7fe52cee": "viking",
    "b53802fb28e26d645c3a310b34bfe07da813026ec7c7716883404d5e0f8b1901": "jais",  # core42/jais-13b
    "7b3e7548e4308f52a76e8229e4e6cc831195d0d1df43aed21ac6c93da05fec5f": "codeshell",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "3c30d3ad1d6b64202cd222813e7736c2db6e1bd6d67197090fc1211fbc612ae7": "bloom",  # bigscience/bloom
    "bc01ce58980e1db43859146dc51b1758b3b88729b217a74792e9f8d43e479d21": "gpt3-finnish",
    "4e2b24cc4770243d65a2c9ec19770a72f08cffc161adbb73fcbb6b7dd45a0aae": "exaone",
    "fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085": "phi-2",  # microsoft/phi-2
    "d4c8f286ea6b520b3d495c4455483cfa2302c0cfcd4be05d781b6a8a0a7cdaf1": "megrez",
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",  # Xenova/gpt-4o
    "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3": "pixtral",
    "f6791d196f87ce6b56a7d234be618e0d58f8cda3549416635b2bebcd22cd95c4": "midm-2.0",
    "169bf0296a13c4d9b7672313f749eb36501d931022de052aad6e36f2bf34dd51": "lfm2",
    "f4f37b6c8eb9ea29b3eac6bb8c8487c5ab7885f8d8022e67edc1c68ce8403e95": "minimax-m2",
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",
}
# texts where tokenizers differ: whitespace runs, digits, CJK, emoji, accents, code
_PROBES = (
    CHKTXT, "Hello world", " leading space", "  two  spaces   three", "trailing   ",
    "\t\ttabs\n\n\nnewlines \n \r\n\r\nend", "1 12 123 1234 12345 3.14159 1,000,000 2024-05-06",
    "日本語のテキスト、中文字符。한국어 텍스트", "emoji 🚀🦙 😶\u200d🌫️ 👍🏽 🇫🇷", "naïve café ÅÆØ ß Ωμέγα",
    "I've 'RE we'll DON'T", "def f(x):\n    return x**2  # done\n\n", "     ", "a\u00a0b\u3000c",
    "\u200bzero width", "<s> </s> <unk> <|endoftext|> [INST] <<SYS>>", "Ġ ▁ Ċ ĉ", "x" * 40,
    "\n", " ", "")


# what a refusal of hf_tokenizer_keys leaves a user to do
_WAY_OUT = ("; save with the tokenizer of a GGUF of this model instead "
            "(load_gguf_tokenizer(path); the finetune command's --tokenizer), whose "
            "vocabulary llama.cpp's converter wrote")


def hf_tokenizer_keys(tokenizer, vocab_size: int) -> dict[str, Any]:
    """tokenizer_keys' dict for an HFTokenizer and a model of vocab_size tokens
    (a vocabulary shorter than the model's is padded with ``[PAD<id>]`` tokens
    as the converter pads it); ValueError for a tokenizer llama.cpp would not
    tokenize as it does (see the module's docstring), saying what to do
    instead."""
    try:
        return _hf_tokenizer_keys(tokenizer, vocab_size)
    except ValueError as e:
        raise ValueError(f"{e}{_WAY_OUT}") from None


def _hf_tokenizer_keys(tokenizer, vocab_size: int) -> dict[str, Any]:
    spec = json.loads(tokenizer._tk.to_str())
    model = spec.get("model") or {}
    where = f"tokenizer: {tokenizer.path!r}"
    if model.get("type") != "BPE":
        raise ValueError(f"{where} is a {model.get('type')} model; save_gguf writes a "
                         "tokenizer.json's byte-level BPE or SentencePiece BPE (byte "
                         "fallback) only")
    n = tokenizer.vocab_size
    if n > vocab_size:
        raise ValueError(f"tokenizer: it has {n} tokens, more than the model's vocab_size "
                         f"{vocab_size}")
    if model.get("byte_fallback"):
        keys = _sentencepiece_keys(tokenizer, spec, where)
    else:
        keys = _byte_level_keys(tokenizer, spec, where)
    # the ids past the tokenizer's (a model's rows it never gives): the converter's
    # placeholders, unused tokens
    keys["tokens"] += [f"[PAD{i}]" for i in range(n, vocab_size)]
    keys["types"] += [TOKEN_UNUSED] * (vocab_size - n)
    if "scores" in keys:
        keys["scores"] += [-1000.0] * (vocab_size - n)
    ids = getattr(tokenizer, "config_token_ids", None) or {}
    # tokenizer_config.json's tokens, else config.json's ids, as SpecialVocab reads them
    for which in ("bos", "eos", "unk", "pad", "sep"):
        own = getattr(tokenizer, f"{which}_id", None)
        value = own if own is not None else ids.get(which)
        keys[which] = value if isinstance(value, int) and 0 <= value < n else None
    if keys["bos"] is None and keys["model"] == "gpt2":
        keys["bos"] = keys["eos"]   # llama.cpp's default otherwise: id 11, a word
    keys["add_bos"] = bool(tokenizer.add_bos)
    keys["eot"] = keys["eom"] = None
    check_reads_as(tokenizer, keys, where)
    return keys


def _looks_special(text: str) -> bool:
    """The converter's does_token_look_special: added tokens it makes control
    ones whatever their special flag."""
    return text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") \
        or (text.startswith("<|") and text.endswith("|>")) \
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>")) \
        or (text.startswith("<unused") and text.endswith(">"))


def _vocabulary(tokenizer) -> tuple[list[str | None], dict[int, Any]]:
    """(the text of each id, None for an id no token has; the added tokens by id)."""
    tk = tokenizer._tk
    tokens: list[str | None] = [None] * tokenizer.vocab_size
    for text, i in tk.get_vocab(with_added_tokens=True).items():
        if 0 <= i < len(tokens):
            tokens[i] = text
    return tokens, {int(i): t for i, t in tk.get_added_tokens_decoder().items()}


def _byte_level_keys(tokenizer, spec: dict[str, Any], where: str) -> dict[str, Any]:
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        raise ValueError(f"{where} has a {normalizer.get('type')} normalizer, which llama.cpp's "
                         "byte-level BPE does not run")
    if normalizer is not None:   # Qwen's: llama.cpp tokenizes the text as it comes
        warnings.warn(f"{where} puts text in Unicode's NFC form first, which llama.cpp does "
                      "not: a text not in NFC (decomposed accents) tokenizes otherwise there",
                      UserWarning, stacklevel=5)
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    # (StarCoder's, SmolLM's and DeepSeek's split digits with a Digits step: llama.cpp's
    # pre-tokenizer, named by the vocabulary's hash, does with a regex; the probes check)
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("add_prefix_space") \
            or any(s.get("type") not in ("Split", "Digits") for s in steps[:-1]):
        raise ValueError(f"{where}: its pre-tokenizer ({pre.get('type')}) is not a byte-level "
                         "one without a space prefix (GPT-2's kind), which llama.cpp's gpt2 "
                         "vocabulary needs")
    name = _pre_name(tokenizer, where)
    model = spec["model"]
    if bool(model.get("ignore_merges")) != (name in IGNORE_MERGES):
        raise ValueError(f"{where}: ignore_merges={bool(model.get('ignore_merges'))}, but "
                         f"llama.cpp's {name!r} pre-tokenizer "
                         f"{'looks' if name in IGNORE_MERGES else 'does not look'} words up "
                         "whole before merging")
    tokens, added = _vocabulary(tokenizer)
    out, types = [], []
    tk = tokenizer._tk
    for i, text in enumerate(tokens):
        if text is None:
            out.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
        elif i in added:
            # llama.cpp reads control and user-defined tokens as the text they stand
            # for: the converter decodes an added token that skips the normalizer
            if not added[i].normalized:
                text = tk.decode(tk.encode(text, add_special_tokens=False).ids,
                                 skip_special_tokens=False)
            if added[i].special or _looks_special(text):
                types.append(TOKEN_CONTROL)
            else:
                text = text.replace(SPACE, " ")
                types.append(TOKEN_USER_DEFINED)
            out.append(text)
        else:
            out.append(text)
            types.append(TOKEN_NORMAL)
    return {"model": "gpt2", "pre": name, "tokens": out, "types": types,
            "merges": _merges(spec["model"].get("merges") or [], where)}


def _merges(merges: list, where: str) -> list[str]:
    """The merges as "left right" (the pairs form's spaces as U+0120 + 256, as
    gguf-py's SpecialVocab writes them)."""
    if not merges or isinstance(merges[0], str):
        return [str(m) for m in merges]
    if not all(isinstance(m, list) and len(m) == 2 for m in merges):
        raise ValueError(f"{where}: its merges are neither 'left right' nor [left, right]")
    return [" ".join(p.replace(" ", chr(ord(" ") + 256)) for p in pair) for pair in merges]


def _pre_name(tokenizer, where: str) -> str:
    """tokenizer.ggml.pre as the converter finds it: the hash of the ids of its
    text with the special tokens added (transformers' encode)."""
    tk = tokenizer._tk
    plain = tk.encode(CHKTXT, add_special_tokens=False).ids
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    eos = [tokenizer.eos_id] if tokenizer.add_eos else []
    # the post-processor's ids, and the config's add_bos_token/add_eos_token applied
    candidates = [tk.encode(CHKTXT, add_special_tokens=True).ids, bos + plain + eos]
    hashes = [hashlib.sha256(str(list(ids)).encode()).hexdigest() for ids in candidates]
    names = {_CHKHSH[h] for h in hashes if h in _CHKHSH}
    if len(names) != 1:
        raise ValueError(f"{where}: its pre-tokenizer is not one llama.cpp's converter knows "
                         f"and ggmlopt reproduces (chkhsh {hashes[0]}); written with another "
                         "name llama.cpp would cut its words otherwise")
    name = names.pop()
    assert name in PRE_TOKENIZERS
    return name


def _sentencepiece_keys(tokenizer, spec: dict[str, Any], where: str) -> dict[str, Any]:
    from ..hf_tokenizer import _metaspace_prefix
    prefix = _metaspace_prefix(spec.get("normalizer"))
    pre = spec.get("pre_tokenizer")
    if prefix is None or pre is not None:
        what = f"a {pre.get('type')} pre-tokenizer" if isinstance(pre, dict) else \
            "its normalizer"
        raise ValueError(f"{where}: {what} is not SentencePiece's as llama.cpp runs it (the "
                         "normalizer writing spaces as U+2581 after an optional space "
                         "prefix, no pre-tokenizer: a space prefix after every special token)")
    model = spec["model"]
    tokens, added = _vocabulary(tokenizer)
    if None in tokens:
        raise ValueError(f"{where}: id {tokens.index(None)} has no token")
    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
             for m in model.get("merges") or []]
    scores = _scores(tokens, pairs, where)
    unk = model.get("unk_token")
    out, types = [], []
    for i, text in enumerate(tokens):
        assert text is not None
        if i in added and text != unk:
            # the converter's SentencePiece path (tokenizer_config's added tokens)
            if added[i].special or _looks_special(text):
                types.append(TOKEN_CONTROL)
            else:
                text = text.replace(SPACE, " ")
                types.append(TOKEN_USER_DEFINED)
            scores[i] = -1000.0
        elif text == unk:
            types.append(TOKEN_UNKNOWN)
        elif re.fullmatch(r"<0x[0-9A-F]{2}>", text):
            types.append(TOKEN_BYTE)
        else:
            types.append(TOKEN_NORMAL)
        out.append(text)
    return {"model": "llama", "pre": "default", "tokens": out, "types": types,
            "scores": scores, "add_space_prefix": bool(prefix)}


def _scores(tokens: list, pairs: list[tuple], where: str) -> list[float]:
    """Scores under which llama.cpp's SentencePiece (the adjacent pair whose joined
    piece scores highest merges first, ties leftmost) merges as the tokenizer.json's
    BPE does (the pair of lowest rank first): minus the rank of the first merge
    making each piece, one score for pieces whose merges interleave (pieces of
    one score in SentencePiece, e.g. Llama 2's runs of spaces, which transformers
    orders by the lengths of their parts).  ValueError for a split of a piece
    into two pieces that is no merge (llama.cpp would join them, the BPE never)."""
    ids = {t: i for i, t in enumerate(tokens) if t is not None}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for rank, (left, right) in enumerate(pairs):
        first.setdefault(left + right, rank)
        last[left + right] = rank
    # the runs of ranks where pieces' merges interleave: one score each
    group_start: dict[str, int] = {}
    start, reach = -1, -1
    members: list[str] = []
    for piece in sorted(first, key=first.__getitem__):
        if first[piece] > reach:
            group_start.update((m, start) for m in members)
            start, members = first[piece], []
        members.append(piece)
        reach = max(reach, last[piece])
    group_start.update((m, start) for m in members)
    merged = set(pairs)
    for piece in ids:
        for k in range(1, len(piece)):
            if piece[:k] in ids and piece[k:] in ids and (piece[:k], piece[k:]) not in merged:
                raise ValueError(f"{where}: {piece!r} splits into the pieces {piece[:k]!r} and "
                                 f"{piece[k:]!r}, which no merge joins; llama.cpp's "
                                 "SentencePiece would join them")
    # (float32 holds these ranks exactly)
    return [-float(group_start[t]) - 1.0 if t in group_start else 0.0 for t in tokens]


def _probe_texts(tokenizer, keys: dict[str, Any]) -> list[str]:
    """_PROBES and the vocabulary's control and user-defined tokens written in
    text, with whitespace and words beside them."""
    texts = list(_PROBES)
    special = [t for t, k in zip(keys["tokens"], keys["types"])
               if k in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)]
    spaces = [" ", "  ", "\n", "\t", "", " \n "]
    for start in range(0, len(special), 64):
        chunk = special[start:start + 64]
        texts.append("".join(f"{spaces[i % 6]}{s}{spaces[(i + 3) % 6]}Hi{i % 10}"
                             for i, s in enumerate(chunk)))
        texts.append("".join(chunk))
        texts.append("".join(f"x{s} y" for s in chunk))
    return texts


def _forced_control_texts(tokenizer, ours) -> list[str]:
    """The texts of tokens the checkpoint holds as words (not added special
    tokens) that llama.cpp's loader turns into control tokens by their text
    (Qwen2's ``</s>``): ours, the model of llama.cpp's tokenizer, matches them
    whole in text."""
    control = getattr(ours, "_control", None) or []
    special = {tokenizer.token_to_id(t) for t in getattr(tokenizer, "_special", ())}
    return sorted(t for i in control if i not in special
                  and (t := tokenizer.id_to_token(i)) in EOG_TEXTS)


def check_reads_as(tokenizer, keys: dict[str, Any], where: str) -> None:
    """ValueError unless the tokenizer the keys describe, as load_gguf reads it
    (ggmlopt's model of llama.cpp's tokenizer), encodes the probe texts as
    tokenizer does, special tokens matched."""
    fields: dict[str, Any] = {
        "tokenizer.ggml.model": keys["model"], "tokenizer.ggml.pre": keys["pre"],
        "tokenizer.ggml.tokens": keys["tokens"], "tokenizer.ggml.token_type": keys["types"],
        "tokenizer.ggml.add_bos_token": keys["add_bos"],
        "tokenizer.ggml.add_eos_token": bool(tokenizer.add_eos),
        # llama.cpp strips the whitespace after Phi-3's special tokens by the file's name
        "general.name": "phi3" if tokenizer.rstrip_ids else ""}
    for key in ("merges", "scores"):
        if key in keys:
            fields[f"tokenizer.ggml.{key}"] = keys[key]
    if "add_space_prefix" in keys:
        fields["tokenizer.ggml.add_space_prefix"] = keys["add_space_prefix"]
    for which, name in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown")):
        if keys.get(which) is not None:
            fields[f"tokenizer.ggml.{name}_token_id"] = keys[which]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a pre-tokenizer it would only approximate
        ours = tokenizer_from_fields(fields, where)
    if ours is not None and getattr(ours, "rstrip_ids", frozenset()) != tokenizer.rstrip_ids:
        raise ValueError(f"{where}: the added tokens that strip the whitespace after them "
                         f"({sorted(tokenizer.rstrip_ids)[:5]}...) are not those llama.cpp "
                         "strips after (Phi-3's special tokens)")
    forced = _forced_control_texts(tokenizer, ours)
    if forced:
        named = ", ".join(repr(t) for t in forced)
        kind = "a control token" if len(forced) == 1 else "control tokens"
        warnings.warn(f"{where}: llama.cpp's loader makes the vocabulary's {named} {kind} "
                      "(by the text), so it reads the text as that token where this tokenizer "
                      "reads the letters; a GGUF of this model from llama.cpp's converter does "
                      "the same", UserWarning, stacklevel=5)
    for text in _probe_texts(tokenizer, keys):
        for t in forced:   # (the one difference said above)
            text = text.replace(t, "")
        want = tokenizer.encode(text).tolist()
        got = None if ours is None else ours.encode(text, parse_special=True).tolist()
        if got != want:
            raise ValueError(f"{where}: llama.cpp would tokenize {text[:60]!r} as {got}, "
                             f"this tokenizer as {want}; not written")
