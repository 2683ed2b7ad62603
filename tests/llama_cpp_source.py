"""llama.cpp's own source tree as the tests read it (GGMLOPT_LLAMA_CPP_SRC, as
llama-cpp-python's sdist holds it): its vocabularies with their test vectors."""
import os
import warnings

import pytest

SRC = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
MODELS = os.path.join(SRC or "", "models")


def vocabulary(name):
    """(path, ggmlopt's tokenizer) of llama.cpp's vocabulary file name; a skip where
    this llama.cpp has none."""
    from ggmlopt.io import load_gguf_tokenizer
    path = os.path.join(MODELS, f"ggml-vocab-{name}.gguf")
    if not os.path.isfile(path):
        pytest.skip(f"{path} is not in this llama.cpp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return path, load_gguf_tokenizer(path)
