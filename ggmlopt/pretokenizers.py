"""llama.cpp's BPE pre-tokenizers: the regexes that cut text into words before the
merges run, by the name a GGUF's ``tokenizer.ggml.pre`` gives (llama-vocab.cpp's
``llm_tokenizer_bpe``).  A pre-tokenizer is a sequence of regexes, each cutting
the pieces the previous ones left (matches and the text between them both stay
pieces), as llama.cpp's ``unicode_regex_split`` applies them.  ``ignore_merges``
names the vocabularies whose words are looked up whole before any merge (Llama
3's: a word in the vocabulary is one token).
"""
from __future__ import annotations

__all__ = ["IGNORE_MERGES", "PIECE_END", "PRE_TOKENIZERS", "pre_tokenizer_regexes",
           "staged_patterns", "word_patterns"]

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
# those are written as escapes; llama.cpp matches the patterns without a \p class with
# every non-ASCII space turned into \v first, which only the third one's class notices)
_DEEPSEEK_LLM = (
    r"[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟、-。]+",
    r"\s+$",
    _DEEPSEEK_CJK,
    r"\p{N}+",
)
# the same as a Hugging Face tokenizer.json writes them (its library matches U+3000 in
# the third pattern's class)
_DEEPSEEK_LLM_HF = _DEEPSEEK_LLM[:2] + (_DEEPSEEK_LLM[2].replace("、-。", "\u3000-。"),) + \
    _DEEPSEEK_LLM[3:]
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
_BLOOM = (r" ?[^(\s|.,!?…。，、।۔،)]+",)
# llama.cpp's own sequence for a vocabulary that names none, or "default"
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
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
    **{name: (_GPT2,) for name in ("gpt-2", "phi-2", "mpt", "olmo", "jais")},
    "default": _DEFAULT,
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
# falcon's three in one pass: its punctuation and ASCII symbols (P) are runs of their
# own, so GPT-2's pattern never sees them (its contractions start with one: they never
# match), a run of spaces before a P char ends as at the end of a piece, and a number
# is cut into ASCII digit triples and what lies between them, leftmost first
_FALCON_P = r"[\p{P}\$\+<=>\^~\|`]"
_FALCON_ONE_PASS = (_FALCON_P + r"+|[0-9]{3}| ?(?:(?![0-9]{3})\p{N})+| ?\p{L}+"
                    r"| ?[^\s\p{L}\p{N}\p{P}\$\+<=>\^~\|`]+|\s+(?!(?!" + _FALCON_P + r")\S)|\s+")
_ONE_PASS: dict[tuple[str, ...], tuple[str, ...]] = {_STARCODER: (_STARCODER_ONE_PASS,),
                                                    _FALCON: (_FALCON_ONE_PASS,)}


#: joined between the pieces one pattern has cut, so the next runs over the whole text
#: in one call and still stops at every piece's end: a Unicode noncharacter, which no
#: pattern below matches and text in practice never holds (a text that does is cut
#: piece by piece)
PIECE_END = "\ufdd0"
# the regex package's \s (Unicode's White_Space) for the standard library's re, whose
# own \s also takes U+001C..U+001F; re runs deepseek-llm's long explicit classes
# three to four times faster
_WHITE_SPACE = "[\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"


def _re_form(pattern: str) -> str:
    assert "[\\s" not in pattern and "\\S" not in pattern   # \s only outside classes
    return pattern.replace("\\s", _WHITE_SPACE)


# (engine, pattern) per step, each after the first ending at PIECE_END as at the end of
# the text: only `$` needs saying so; no class below holds PIECE_END
def _deepseek_llm_staged(regexes: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    return (("re", regexes[0]), ("re", _re_form(regexes[1])), ("re", _re_form(regexes[2])),
            ("re", _WHITE_SPACE + "+(?=" + PIECE_END + r"|\Z)"), ("re", _DEEPSEEK_CJK),
            ("regex", regexes[5]))


_STAGED: dict[tuple[str, ...], tuple[tuple[str, str], ...]] = {
    _DEEPSEEK_LLM: _deepseek_llm_staged(_DEEPSEEK_LLM),
    _DEEPSEEK_LLM_HF: _deepseek_llm_staged(_DEEPSEEK_LLM_HF),
    _DEEPSEEK_CODER: tuple(("regex", r) for r in _DEEPSEEK_CODER),
}
assert _DEEPSEEK_LLM[3] == r"\s+$"


def staged_patterns(regexes: tuple[str, ...]) -> tuple[tuple[str, str], ...] | None:
    """The (engine "re" or "regex", pattern) steps that cut a text into regexes'
    words with the pieces joined by PIECE_END between steps, or None where the
    regexes have no such form (they then run piece by piece)."""
    return _STAGED.get(tuple(regexes))


def word_patterns(regexes: tuple[str, ...]) -> tuple[str, ...]:
    """regexes (a pre-tokenizer's, applied in turn) as the fewest patterns that cut
    a text into the same words (ggmlopt._bpe_words runs each as one pass)."""
    return _ONE_PASS.get(tuple(regexes), tuple(regexes))
