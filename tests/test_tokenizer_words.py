"""Encoding a word at a time (ggmlopt._bpe_words): the pre-tokenizer's regexes by
the regex package, each distinct word merged once by the tokenizers library and
cached, gives the library's ids for the whole text: on every vocabulary llama.cpp
ships (GGMLOPT_LLAMA_CPP_SRC), and on a small vocabulary built here, with special
tokens in the text either way, a cold and a warm cache, a cache that overflows,
and threads encoding at once."""
import os
import random
import sys
import threading

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("regex")

from ggmlopt import _bpe_words

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
from test_tokenizer_vectors import SRC, VOCABS, _samples, _tokenizer


def _library_ids(tok, text, parse_special):
    """The ids of the whole text through the tokenizers library alone."""
    lib = tok._fast_tokenizer() if tok.pre == "spm" else tok._tk
    return tok._library_encode(lib, text, parse_special).ids


def _texts(path):
    out = _samples(path, 300, 7)
    with open(os.path.join(SRC, "README.md"), encoding="utf-8") as f:
        out.append(f.read())   # one long text of many words
    out += ["", " ", "  two  spaces ", "\n\n x", "<s>x</s> y", " <s> ", "\u2581x", "\u2581\u2581 \u2581",
            "<b>x</b> <i> </i>", ">\u2581</", ">  \u2581</"]
    return out


@pytest.mark.parametrize("path", VOCABS, ids=lambda p: os.path.basename(p)[len("ggml-vocab-"):-5])
def test_word_by_word_equals_the_library_on_the_whole_text(path):
    tok = _tokenizer(path)
    if tok.pre == "bert":
        pytest.skip("WordPiece: ggmlopt's own code, no library path")
    if tok._fast_tokenizer() is None if tok.pre == "spm" else False:
        pytest.skip("no library path for this vocabulary")
    if getattr(tok, "_words", None) is None:
        pytest.skip(f"pre-tokenizer {tok.pre!r}: encoded by the library alone")
    texts = _texts(path)
    for parse in (True, False):
        for cache in ("cold", "warm"):
            if cache == "cold":
                tok._words._cache.clear()
            wrong = [t for t in texts
                     if tok.encode(t, parse_special=parse).tolist() != _library_ids(tok, t, parse)]
            assert not wrong, (f"parse_special={parse}, {cache} cache: {len(wrong)} of "
                               f"{len(texts)} texts differ, e.g. {wrong[0][:80]!r}")


def _small_bpe():
    """A byte-level BPE with a few merges and special tokens, llama-bpe's regex."""
    from ggmlopt.io.gguf_llama import byte_vocabulary
    from ggmlopt.text import BPETokenizer
    vocab = byte_vocabulary()
    merges = ["h e", "l l", "he ll", "Ġ w", "Ġw o", "o r", "Ġwo r"]
    vocab += ["he", "ll", "hell", "Ġw", "Ġwo", "or", "Ġwor", "<|im_start|>", "<|im_end|>",
              "<tool>"]
    types = [1] * (len(vocab) - 3) + [3, 3, 4]
    return BPETokenizer(vocab, merges, token_types=types, pre="llama-bpe")


def _random_texts(count, seed):
    rng = random.Random(seed)
    alphabet = list("hello world HELLO 0123456789 .,;'s're\n\t  éß中文🙂") + [
        "<|im_start|>", "<|im_end|>", "<tool>", "<|im_", "tool>"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 400)))
            for _ in range(count)]


def test_a_small_vocabulary_word_by_word():
    tok = _small_bpe()
    assert tok._words is not None
    for parse in (True, False):
        for text in _random_texts(200, int(parse)):
            assert tok.encode(text, parse_special=parse).tolist() == \
                tok._library_encode(tok._tk, text, parse).ids, repr(text)


def test_an_overflowing_cache_starts_afresh(monkeypatch):
    tok = _small_bpe()
    texts = _random_texts(40, 3)
    want = [tok._library_encode(tok._tk, t, True).ids for t in texts]
    monkeypatch.setattr(_bpe_words, "CACHE_WORDS", 16)
    got = [tok.encode(t).tolist() for t in texts]
    assert got == want
    assert len(tok._words._cache) <= max(16, max(len(set(tok._words.words(t))) for t in texts))


def test_threads_encoding_at_once_get_their_own_ids(monkeypatch):
    tok = _small_bpe()
    monkeypatch.setattr(_bpe_words, "CACHE_WORDS", 64)   # caches replaced while others read
    texts = _random_texts(64, 5)
    want = [tok._library_encode(tok._tk, t, True).ids for t in texts]
    got = [None] * len(texts)

    def work(k):
        for i in range(k, len(texts), 4):
            got[i] = tok.encode(texts[i]).tolist()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_without_the_regex_package_the_library_encodes(monkeypatch):
    with_words = _small_bpe()
    monkeypatch.setitem(sys.modules, "regex", None)
    tok = _small_bpe()
    assert tok._words is None and with_words._words is not None
    text = "<|im_start|>hello world<|im_end|> or <tool>x"
    np.testing.assert_array_equal(tok.encode(text), with_words.encode(text))
    assert tok.encode(text).tolist() == tok._library_encode(tok._tk, text, True).ids


@pytest.mark.parametrize("path", VOCABS, ids=lambda p: os.path.basename(p)[len("ggml-vocab-"):-5])
def test_a_tokenizer_json_word_by_word_equals_the_library(tmp_path, path):
    """load_hf_tokenizer of the tokenizer.json save_hf writes for each of llama.cpp's
    vocabularies: where the pipeline is a byte-level BPE of one to three regexes, or
    SentencePiece's (the space prefix and U+2581 for spaces, no pre-tokenizer), it
    encodes word by word, with the library's ids."""
    from ggmlopt.hf_tokenizer import load_hf_tokenizer
    from ggmlopt.io import save_hf
    from ggmlopt.models import Llama, LlamaConfig
    tok = _tokenizer(path)
    if tok.pre == "bert":
        pytest.skip("WordPiece: save_hf writes the decoders' vocabularies (BPE, SentencePiece)")
    save_hf(Llama(LlamaConfig(vocab_size=tok.vocab_size, dim=8, n_layers=1, n_heads=1,
                              max_seq_len=8)), tmp_path, tokenizer=tok)
    hf = load_hf_tokenizer(tmp_path)
    if tok.pre == "spm":
        tok._fast_tokenizer()   # (made on the first encode)
    if getattr(tok, "rstrip_ids", None):
        # added tokens that drop the whitespace after them (Phi-3's): the library runs
        # that pipeline, with this tokenizer's ids
        assert hf._words is None
        texts = _texts(path) + ["<|user|>\n Hi<|end|>\n\t<|assistant|>  Yes.<|end|>\n"]
        for parse in (True, False):
            wrong = [t for t in texts if hf.encode(t, parse_special=parse).tolist()
                     != tok.encode(t, parse_special=parse).tolist()]
            assert not wrong, f"parse_special={parse}: e.g. {wrong[0][:80]!r}"
        return
    if getattr(tok, "_words", None) is None:
        assert hf._words is None   # a pipeline the library runs alone
        return
    assert hf._words is not None
    texts = _texts(path)
    for parse in (True, False):
        wrong = [t for t in texts if hf.encode(t, parse_special=parse).tolist()
                 != hf._library_encode(hf._tk, t, parse).ids]
        assert not wrong, f"parse_special={parse}: {len(wrong)} texts differ, e.g. {wrong[0][:80]!r}"


def test_a_trained_gpt2_style_tokenizer_json(tmp_path):
    """The library's own ByteLevel pre-tokenizer (GPT-2's regex inside it) and added
    tokens special or not."""
    from test_hf_tokenizer import make_checkpoint

    from ggmlopt.hf_tokenizer import load_hf_tokenizer
    hf = load_hf_tokenizer(make_checkpoint(tmp_path / "tok", bos_rule="none"))
    assert hf._words is not None
    for parse in (True, False):
        for text in _random_texts(100, 11) + ["<s>x</s>", "<|im_start|>user\nhi<|im_end|>"]:
            assert hf.encode(text, parse_special=parse).tolist() == \
                hf._library_encode(hf._tk, text, parse).ids, repr(text)


def _small_spm_json(tmp_path, *, prefix=True, normalizer=None):
    """A small SentencePiece vocabulary's tokenizer.json, as SPMTokenizer.hf_tokenizer
    builds it (or with another normalizer), loaded by load_hf_tokenizer."""
    import tokenizers
    from test_text_tokenizer import _spm

    from ggmlopt.hf_tokenizer import load_hf_tokenizer
    tk = _spm().hf_tokenizer()
    if not prefix:
        tk.normalizer = tokenizers.normalizers.Replace(" ", "\u2581")
    if normalizer is not None:
        tk.normalizer = normalizer
    tk.save(str(tmp_path / "tokenizer.json"))
    return load_hf_tokenizer(tmp_path)


@pytest.mark.parametrize("prefix", [True, False])
def test_a_sentencepiece_tokenizer_json_word_by_word(tmp_path, prefix):
    hf = _small_spm_json(tmp_path, prefix=prefix)
    assert hf._words is not None and hf._words.prefix == ("\u2581" if prefix else "")
    rng = random.Random(2)
    alphabet = list("hello world  é\n🙂") + ["<s>", "</s>", "<|im_end|>", "<unk>", "\u2581"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 80)))
             for _ in range(300)] + ["", " ", "<s></s>", "hello  hello <|im_end|>hello"]
    for parse in (True, False):
        for text in texts:
            assert hf.encode(text, parse_special=parse).tolist() == \
                hf._library_encode(hf._tk, text, parse).ids, repr(text)


def test_another_normalizer_stays_with_the_library(tmp_path):
    import tokenizers
    hf = _small_spm_json(tmp_path, normalizer=tokenizers.normalizers.Sequence([
        tokenizers.normalizers.Lowercase(), tokenizers.normalizers.Replace(" ", "\u2581")]))
    assert hf._words is None
    assert hf.encode("Hello hello").tolist() == hf._library_encode(hf._tk, "Hello hello", True).ids


def test_starcoders_two_patterns_in_one_pass_cut_the_same_words():
    """word_patterns' one pattern for starcoder's (\\p{N}, then GPT-2's) against the
    two applied in turn, on random texts dense in digits, spaces and their mixes."""
    from ggmlopt._bpe_words import WordEncoder
    from ggmlopt.pretokenizers import PRE_TOKENIZERS, word_patterns
    two = PRE_TOKENIZERS["starcoder"]
    assert len(word_patterns(two)) == 1
    import regex
    sequential = WordEncoder([regex.compile(f"({r})") for r in two], None)   # as given
    one = WordEncoder.make(two, None)
    assert len(one._patterns) == 1 and len(sequential._patterns) == 2
    rng = random.Random(4)
    alphabet = list("  \t\n\r ab'sreXY0123456789٣.,;:!?()[]-_中é🙂\u00a0\u2003")
    for _ in range(20000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        assert one.words(text) == sequential.words(text), repr(text)


def _sequential_and_fast(name):
    import regex

    from ggmlopt._bpe_words import WordEncoder
    from ggmlopt.pretokenizers import PRE_TOKENIZERS
    given = PRE_TOKENIZERS[name]
    return WordEncoder([regex.compile(f"({r})") for r in given], None), \
        WordEncoder.make(given, None)


# characters of every class these pre-tokenizers tell apart: ASCII and fullwidth letters
# and symbols, letters outside ASCII, CJK and Hangul, CJK punctuation and numbers,
# digits of other scripts, every kind of white space (U+3000 is both white space and
# CJK punctuation; U+001C is white space to re but not to regex), lines' ends
_MIXED = (list("  \t\n\r ab'sreXY0123456789٣١.,;:!?()[]-_$+<=>^~|`@#%&*©€中文、。“”①Ⅻ←〇가Ａｚé"
               "À\u3000\u2003🙂\u00a0\u001c\u0085\u000b") + ["\u3000a", " \n", "'s", "1234"])


@pytest.mark.parametrize("name", ["falcon", "deepseek-llm", "deepseek-coder"])
def test_fast_cuts_equal_the_patterns_in_turn(name):
    """falcon's one pattern, deepseek's steps over the joined pieces: the words of
    the regexes applied piece by piece, on random texts of every class they split."""
    sequential, fast = _sequential_and_fast(name)
    assert len(fast._patterns) == 1 or fast._staged is not None
    rng = random.Random(5)
    for _ in range(20000):
        text = "".join(rng.choice(_MIXED) for _ in range(rng.randrange(0, 40)))
        assert fast.words(text) == sequential.words(text), repr(text)


def test_a_text_holding_the_piece_mark_is_cut_piece_by_piece():
    from ggmlopt.pretokenizers import PIECE_END
    sequential, fast = _sequential_and_fast("deepseek-llm")
    for text in (f"ab{PIECE_END}cd", f" x {PIECE_END} 12\n", PIECE_END, f"中{PIECE_END}\u3000 "):
        assert fast.words(text) == sequential.words(text)
        assert "".join(fast.words(text)) == text


def test_the_white_space_class_given_to_re_is_the_regex_packages():
    import re

    import regex

    from ggmlopt.pretokenizers import _WHITE_SPACE
    ours, theirs = re.compile(_WHITE_SPACE), regex.compile(r"\s")
    differ = [hex(c) for c in range(0x110000)
              if 0xD800 > c or c > 0xDFFF
              if bool(ours.match(chr(c))) != bool(theirs.match(chr(c)))]
    assert not differ


def _longest_first(texts):
    import re
    texts = sorted({t for t in texts if t}, key=lambda t: (-len(t), t))
    return re.compile("(" + "|".join(re.escape(t) for t in texts) + ")")


@pytest.mark.parametrize("texts", [
    ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|im", "<"],
    [" " * k for k in range(2, 25)] + ["\t", "\t\t\n"],
    [f"[PAD{100000 + i}]" for i in range(300)] + ["<｜begin▁of▁sentence｜>", "[PAD1"],
    ["a", "ab", "abc", "abd", "b", "bcd", "x.y", "x*y", "\\", "(", ")"],
], ids=["chat", "space-runs", "pads", "prefixes"])
def test_the_special_token_splitter_cuts_as_the_longest_first_alternation(texts):
    """_splitter's trie of shared prefixes against the plain alternation, longest
    text first: the same parts on random texts dense in the tokens and their
    prefixes (overlaps, a token inside another, runs of spaces)."""
    from ggmlopt.text import _splitter, _trie_pattern
    trie, plain = _splitter(texts), _longest_first(texts)
    assert trie.pattern == "(" + _trie_pattern(sorted(set(texts), key=lambda t: (-len(t), t))) + ")"
    rng = random.Random(len(texts))
    pieces = texts + [t[:k] for t in texts for k in range(1, len(t))] + list(" \n<|>[]ab0")
    for _ in range(5000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 14)))
        assert trie.split(text) == plain.split(text), repr(text)


@pytest.mark.parametrize("path", VOCABS, ids=lambda p: os.path.basename(p)[len("ggml-vocab-"):-5])
def test_every_vocabularys_special_splitter_cuts_as_the_alternation(path):
    tok = _tokenizer(path)
    texts = [tok.tokens[i] for i in getattr(tok, "_control", []) + getattr(tok, "_user", [])]
    if not [t for t in texts if t]:
        pytest.skip("no special tokens")
    from ggmlopt.text import _splitter
    trie, plain = _splitter(texts), _longest_first(texts)
    sample = _texts(path)
    rng = random.Random(3)
    sample += ["".join(rng.choice(texts + [" ", "x", "<", "["]) for _ in range(20))
               for _ in range(300)]
    for text in sample:
        assert trie.split(text) == plain.split(text), repr(text[:80])


def test_added_tokens_matched_in_the_normalized_text_stay_with_the_library(tmp_path):
    # older SentencePiece conversions mark every added token normalized: the library
    # matches them in the text after its normalizer (spaces as U+2581), where the
    # word path would match them in the raw text and give other ids
    import json
    _small_spm_json(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        token["normalized"] = True
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    from ggmlopt.hf_tokenizer import load_hf_tokenizer
    hf = load_hf_tokenizer(tmp_path)
    assert hf._words is None
    transformers = pytest.importorskip("transformers")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for text in ("hello<|im_end|>\n<s>", "<s> hello</s> hello", " <|im_end|>  hello"):
        assert hf.encode(text).tolist() == theirs(text, add_special_tokens=False)["input_ids"]


def test_overlapping_special_tokens_are_cut_longest_first():
    # llama.cpp's partition: the longer token first, wherever it is; the leftmost
    # match would take the shorter one that starts before it
    from ggmlopt.text import LongestFirstPartition, _splitter, special_splitter
    texts = [">>T<<", "<|eot|>", "  ", "   "]
    cut = special_splitter(texts)
    assert isinstance(cut, LongestFirstPartition)
    assert cut.split(">>T<<|eot|>") == [">>T<", "<|eot|>", ""]
    assert _splitter(texts).split(">>T<<|eot|>") == ["", ">>T<<", "|eot|>"]
    assert cut.split("<|eot|>>T<<") == ["", "<|eot|>", ">T<<"]
    assert cut.split("a >>T<< b     c") == ["a ", ">>T<<", " b", "   ", "", "  ", "c"]
    # runs of one character overlap without ever differing: the regex stays
    assert not isinstance(special_splitter([" " * k for k in range(2, 9)]),
                          LongestFirstPartition)
