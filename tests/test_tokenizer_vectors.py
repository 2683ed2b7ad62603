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
    if kind not in ("gpt2", "llama"):
        pytest.skip(f"{os.path.basename(path)}: a {kind!r} vocabulary, a type ggmlopt does not "
                    "read yet (it reads gpt2 and llama)")
    if kind == "gpt2":
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
    for text, want in vectors:
        # decoding gives the text back (llama.cpp's test checks the same round trip)
        assert tok.decode(np.asarray(want, np.int32)) == text or not want
