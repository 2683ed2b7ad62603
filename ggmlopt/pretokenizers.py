"""llama.cpp's BPE pre-tokenizers: the regexes that cut text into words before the
merges run, by the name a GGUF's ``tokenizer.ggml.pre`` gives (llama-vocab.cpp's
``llm_tokenizer_bpe``).  A pre-tokenizer is a sequence of regexes, each cutting
the pieces the previous ones left (matches and the text between them both stay
pieces), as llama.cpp's ``unicode_regex_split`` applies them.  ``ignore_merges``
names the vocabularies whose words are looked up whole before any merge (Llama
3's: a word in the vocabulary is one token).
"""
from __future__ import annotations

__all__ = ["IGNORE_MERGES", "PRE_TOKENIZERS", "pre_tokenizer_regexes", "word_patterns"]

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_STARCODER = (r"\p{N}", _GPT2)
_DEEPSEEK_CJK = r"[一-龥ࠀ-一가-퟿]+"
# (the letters' ranges end in characters that Unicode normalisation would change, so
# those are written as escapes)
_DEEPSEEK_LLM = (
    r"[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    _DEEPSEEK_CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
_BLOOM = (r" ?[^(\s|.,!?…。，、।۔،)]+",)
_TEKKEN = ((r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),)
_GPT4O = ((r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),)

# tokenizer.ggml.pre -> its regexes, in llama.cpp's order of application
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **{name: (_GPT2,) for name in ("gpt-2", "phi-2", "mpt", "olmo", "jais", "default")},
    **{name: (_LLAMA3,) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                     "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe",
                                     "chatglm-bpe")},
    **{name: (_QWEN2,) for name in ("qwen2", "stablelm2", "hunyuan", "megrez")},
    "qwen35": (_QWEN35,),
    **{name: _STARCODER for name in ("starcoder", "refact", "command-r", "smollm", "codeshell",
                                     "exaone", "minerva-7b")},
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
    "falcon": _FALCON,
    **{name: _BLOOM for name in ("poro-chat", "bloom", "gpt3-finnish")},
    "viking": _BLOOM + (r"\p{N}",),
    "tekken": _TEKKEN,
    **{name: _GPT4O for name in ("gpt-4o", "minimax-m2")},
}
# llama.cpp's llm_tokenizer_bpe: a whole word found in the vocabulary is one token
IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                           "midm-2.0", "lfm2"})


def pre_tokenizer_regexes(name: str) -> tuple[str, ...] | None:
    """The regexes of llama.cpp's pre-tokenizer name, or None for one not here."""
    return PRE_TOKENIZERS.get(name)


# starcoder's two patterns as one: its \p{N} isolates every digit, so GPT-2's pattern
# then runs on digit-free pieces, whose ends (a digit, or the text's end) are what its
# lookahead (?!\S) sees; here a digit is its own word and the lookahead lets a digit
# end a run of spaces, which gives the same words in one pass over the text
_STARCODER_ONE_PASS = (r"\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+"
                       r"|\s+(?!(?!\p{N})\S)|\s+")
_ONE_PASS: dict[tuple[str, ...], tuple[str, ...]] = {_STARCODER: (_STARCODER_ONE_PASS,)}


def word_patterns(regexes: tuple[str, ...]) -> tuple[str, ...]:
    """regexes (a pre-tokenizer's, applied in turn) as the fewest patterns that cut
    a text into the same words (ggmlopt._bpe_words runs each as one pass)."""
    return _ONE_PASS.get(tuple(regexes), tuple(regexes))
