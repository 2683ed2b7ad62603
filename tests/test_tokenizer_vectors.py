"""Tokenizers exact as llama.cpp: every vocabulary llama.cpp ships with test vectors
(models/ggml-vocab-*.gguf with their .inp texts and .out ids, which its
test-tokenizer-0 checks), read from the GGUF as load_gguf reads it, encodes every
text to llama.cpp's ids with parse_special=False, and decodes them back.  Needs
llama.cpp's source (GGMLOPT_LLAMA_CPP_SRC: CI's llama.cpp step extracts it from
llama-cpp-python's sdist)."""
import glob
import os

import numpy as np
import pytest

SRC = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
VOCABS = sorted(p for p in glob.glob(os.path.join(SRC or "", "models", "ggml-vocab-*.gguf"))
                if os.path.isfile(p + ".inp") and os.path.isfile(p + ".out")) if SRC else []
pytestmark = pytest.mark.skipif(not VOCABS, reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source, "
                                "as llama-cpp-python's sdist holds it) is not set")
SEPARATOR = "\n__ggml_vocab_test__\n"


def _vectors(path):
    with open(path + ".inp", encoding="utf-8") as f:
        texts = f.read().split(SEPARATOR)
    with open(path + ".out", encoding="utf-8") as f:
        ids = [[int(i) for i in line.split()] for line in f.read().split("\n")]
    return list(zip(texts, ids))


def _tokenizer(path):
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf_tokenizer
    from ggmlopt.io.gguf_reader import GgufFile
    kind = GgufFile(path).fields.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama", "gemma4", "bert"):
        pytest.skip(f"{os.path.basename(path)}: a {kind!r} vocabulary, a type ggmlopt does not "
                    "read yet (it reads gpt2, llama, gemma4 and bert)")
    if kind in ("gpt2", "gemma4"):
        pytest.importorskip("tokenizers")
    return load_gguf_tokenizer(path)


@pytest.mark.parametrize("path", VOCABS, ids=lambda p: os.path.basename(p)[len("ggml-vocab-"):-5])
def test_every_test_vector_of_llama_cpp(path):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no pre-tokenizer may fall back to another
        tok = _tokenizer(path)
    vectors = _vectors(path)
    wrong = [(text, want, tok.encode(text, parse_special=False).tolist())
             for text, want in vectors if tok.encode(text, parse_special=False).tolist() != want]
    assert not wrong, f"{len(wrong)} of {len(vectors)} texts differ; the first: {wrong[0]}"
    if getattr(tok, "pre", None) == "bert":
        return   # WordPiece drops whitespace and control characters: no way back to the text
    for text, want in vectors:
        # decoding gives the text back (llama.cpp's test checks the same round trip)
        assert tok.decode(np.asarray(want, np.int32)) == text or not want


def _samples(path, count, seed):
    """Texts of every kind: pieces of llama.cpp's README and of the vocabulary's
    test texts, and random strings over letters, digits, punctuation, spaces and
    non-Latin scripts, special tokens' texts among them."""
    import random
    rng = random.Random(seed)
    with open(os.path.join(SRC, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    with open(path + ".inp", encoding="utf-8") as f:
        inp = f.read()
    alphabet = list(" \n\t  abcXYZ0123456789.,;:!?'\"()[]<>/\\-_=+*&#@~|éñüß中文日本語한국어🙂αβ")
    alphabet += ["<s>", "</s>", "<|user|>", "<|end|>", "<unk>"]
    out = []
    for _ in range(count):
        k = rng.random()
        if k < 0.4:
            i = rng.randrange(len(readme))
            out.append(readme[i:i + rng.randrange(1, 200)])
        elif k < 0.6:
            i = rng.randrange(len(inp))
            out.append(inp[i:i + rng.randrange(1, 100)])
        else:
            out.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60))))
    return out


@pytest.mark.parametrize("path", VOCABS, ids=lambda p: os.path.basename(p)[len("ggml-vocab-"):-5])
def test_sentencepiece_through_the_tokenizers_library_equals_ggmlopts_own(path):
    """An SPMTokenizer encodes through the tokenizers library when it is installed:
    on 1,500 texts of every kind (and with parse_special both ways) the ids equal
    those of ggmlopt's own implementation of llama.cpp's algorithm, which the
    test vectors check."""
    from ggmlopt.spm import SPMTokenizer
    tok = _tokenizer(path)
    if not isinstance(tok, SPMTokenizer):
        pytest.skip("not a SentencePiece vocabulary")
    pytest.importorskip("tokenizers")
    assert tok._fast_tokenizer() is not None
    for parse in (True, False):
        wrong = [t for t in _samples(path, 750, int(parse))
                 if tok.encode(t, parse_special=parse).tolist()
                 != tok.encode_with_offsets(t, parse_special=parse)[0].tolist()]
        assert not wrong, f"parse_special={parse}: {len(wrong)} texts differ, e.g. {wrong[0]!r}"


def test_wordpiece_equals_llama_cpp_on_texts_of_every_kind():
    """The bert (WordPiece) vocabulary against llama.cpp itself on 1,400 texts, special
    tokens parsed and not: the same ids, and decode equals llama_detokenize (its
    clean-up of spaces included) with and without the special tokens."""
    import ctypes
    llama_cpp = pytest.importorskip("llama_cpp")
    path = os.path.join(SRC, "models", "ggml-vocab-bert-bge.gguf")
    if not os.path.isfile(path):
        pytest.skip("llama.cpp's source has no ggml-vocab-bert-bge.gguf")
    tok = _tokenizer(path)
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)

    def detokenize(ids, skip_special):
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_detokenize(llm._model.vocab, arr, len(ids), buf, len(buf), False,
                                       not skip_special)
        return buf.raw[:n].decode("utf-8", "replace")

    # with its special tokens llama.cpp puts CLS and SEP around a text: the ids read
    assert llm.tokenize(b"Hello there", add_bos=True, special=False) == \
        [tok.cls_id, *tok.encode("Hello there").tolist(), tok.sep_id]
    for special in (False, True):
        for text in _samples(path, 700, 3 + special):
            want = llm.tokenize(text.encode(), add_bos=False, special=special)
            assert tok.encode(text, parse_special=special).tolist() == want, (text, special)
            for skip in (False, True):
                got = tok.decode(np.asarray(want, np.int32), skip_special=skip)
                assert got == detokenize(want, skip), (text, skip)
