"""A Hugging Face checkpoint's tokenizer (load_hf_tokenizer) written by save_gguf
tokenizes in llama.cpp as it does in ggmlopt and in transformers' AutoTokenizer:
special tokens, whitespace runs, digits, CJK, emoji, for each kind of vocabulary
save_gguf writes (checkpoints made from llama.cpp's own vocabularies by
save_hf, GGMLOPT_LLAMA_CPP_SRC)."""
import os
import warnings

import pytest

from ggmlopt.hf_tokenizer import load_hf_tokenizer
from ggmlopt.io import load_gguf_tokenizer, load_hf, save_gguf, save_hf
from ggmlopt.models import GPT2, Llama, LlamaConfig, Qwen2, Qwen2Config
from ggmlopt.models.config import GPT2Config
from ggmlopt.models.phi3 import Phi3, Phi3Config
from ggmlopt.text import EOG_TEXTS, TOKEN_CONTROL, TOKEN_USER_DEFINED

llama_cpp = pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("gguf")
SRC = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
pytestmark = pytest.mark.skipif(not SRC, reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source, "
                                "as llama-cpp-python's sdist holds it) is not set")


def _llama(n):
    return Llama(LlamaConfig(vocab_size=n, dim=32, n_layers=1, n_heads=2, max_seq_len=32))


FAMILIES = {
    "gpt-2": lambda n: GPT2(GPT2Config(vocab_size=n, dim=32, n_layers=1, n_heads=2,
                                       max_seq_len=32)),
    "llama-bpe": _llama,
    "qwen2": lambda n: Qwen2(Qwen2Config(vocab_size=n, dim=32, n_layers=1, n_heads=2,
                                         max_seq_len=32)),
    "qwen35": lambda n: Qwen2(Qwen2Config(vocab_size=n, dim=32, n_layers=1, n_heads=2,
                                          max_seq_len=32)),
    "starcoder": _llama,
    "falcon": _llama,
    "llama-spm": _llama,
    "phi-3": lambda n: Phi3(Phi3Config(vocab_size=n, dim=32, n_layers=1, n_heads=2,
                                       max_seq_len=32)),
}
TEXTS = ["Hello world", " leading space", "  two  spaces   three   ", "\t\ttabs\n\n\nlines \r\n",
         "1 12 123 1234 12345 3.14159 1,000,000", "日本語のテキスト、中文。한국어",
         "emoji 🚀🦙 😶\u200d🌫️ 👍🏽 🇫🇷", "naïve café ÅÆØ ß", "I've 'RE we'll DON'T",
         "def f(x):\n    return x**2  # done\n", "     ", "a\u00a0b\u3000c", "x" * 50,
         "<s>[INST] hi [/INST]</s>", "<|user|>\nhello<|end|>\n<|assistant|>",
         "x<|im_start|>user\nhi<|im_end|>\n", "<|begin_of_text|>hi<|eot_id|>", ""]


def _specials(tok, most=8):
    control = [t for t, k in zip(tok.tokens, tok.token_types) if k == TOKEN_CONTROL]
    user = [t for t, k in zip(tok.tokens, tok.token_types) if k == TOKEN_USER_DEFINED]
    eog = [t for t in sorted(EOG_TEXTS) if tok.token_to_id(t) is not None]
    return [t for t in dict.fromkeys(control[:most] + user[:most] + eog) if t.strip()]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_llama_cpp_tokenizes_the_written_file_as_ggmlopt_and_transformers(tmp_path, name):
    path = os.path.join(SRC, "models", f"ggml-vocab-{name}.gguf")
    if not os.path.isfile(path):
        pytest.skip(f"{path} is not in this llama.cpp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vocab = load_gguf_tokenizer(path)
        save_hf(FAMILIES[name](vocab.vocab_size), tmp_path / "hf", tokenizer=vocab)
        model = load_hf(tmp_path / "hf")
        tok = load_hf_tokenizer(tmp_path / "hf")
        save_gguf(model, tmp_path / "model.gguf", tokenizer=tok, dtype="q8_0")
    llm = llama_cpp.Llama(model_path=str(tmp_path / "model.gguf"), vocab_only=True,
                          verbose=False)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    specials = _specials(vocab)
    assert specials
    texts = list(TEXTS)
    for i, s in enumerate(specials):
        t = specials[(i + 1) % len(specials)]
        texts += [f"{s}\nHi there{t}\n", f"a{s} b  {t}\t\nc", f"{s}{t}  x", f"x {s}  12"]
    bos = [tok.bos_id] if tok.add_bos else []
    for text in texts:
        ours = tok.encode(text).tolist()
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ours, text
        assert auto(text, add_special_tokens=False)["input_ids"] == ours, text
        if text:   # the BOS llama.cpp puts first is the one transformers does
            assert llm.tokenize(text.encode(), add_bos=True, special=True) == bos + ours, text
    # generation stops at the same tokens
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    handle = llama_cpp.llama_model_load_from_file(str(tmp_path / "model.gguf").encode(), params)
    try:
        v = llama_cpp.llama_model_get_vocab(handle)
        eog = {i for i in range(llama_cpp.llama_vocab_n_tokens(v))
               if llama_cpp.llama_vocab_is_eog(v, i)}
    finally:
        llama_cpp.llama_model_free(handle)
    assert tok.eog_ids <= eog


def test_the_converter_s_tokenizer_json_only_scores_would_tokenize_otherwise(tmp_path):
    """Why a SentencePiece tokenizer.json's scores are made from its merges: with
    -1000 for every piece (llama.cpp's converter without tokenizer.model,
    LlamaHfVocab), llama.cpp tokenizes Llama 2's text otherwise."""
    import gguf
    path = os.path.join(SRC, "models", "ggml-vocab-llama-spm.gguf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vocab = load_gguf_tokenizer(path)
        save_hf(_llama(vocab.vocab_size), tmp_path / "hf", tokenizer=vocab)
        model, tok = load_hf(tmp_path / "hf"), load_hf_tokenizer(tmp_path / "hf")
        save_gguf(model, tmp_path / "ours.gguf", tokenizer=tok)
    from ggmlopt.io.gguf_reader import GgufFile
    fields = GgufFile(str(tmp_path / "ours.gguf")).fields
    writer = gguf.GGUFWriter(str(tmp_path / "flat.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_scores([-1000.0] * vocab.vocab_size)
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    text = "Hello world, the quick brown fox jumps over the lazy dog."
    ours = llama_cpp.Llama(model_path=str(tmp_path / "ours.gguf"), vocab_only=True,
                           verbose=False).tokenize(text.encode(), add_bos=False)
    flat = llama_cpp.Llama(model_path=str(tmp_path / "flat.gguf"), vocab_only=True,
                           verbose=False).tokenize(text.encode(), add_bos=False)
    assert ours == tok.encode(text).tolist() != flat
