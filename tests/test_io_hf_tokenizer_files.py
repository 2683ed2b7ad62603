"""save_hf(..., tokenizer=...) writes tokenizer.json, tokenizer_config.json and
generation_config.json that transformers' AutoTokenizer and GenerationConfig
load, encoding as ggmlopt's tokenizer does (special tokens written in the text
included), with its BOS rule, chat template and end-of-generation ids; and
ggmlopt's own load_hf_tokenizer reads the same back.  With llama.cpp's source
(GGMLOPT_LLAMA_CPP_SRC) every BPE vocabulary llama.cpp ships goes through it on
its test vectors."""
import glob
import json
import os

import numpy as np
import pytest

from ggmlopt.io import save_hf
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.text import BPETokenizer, ByteTokenizer, load_hf_tokenizer

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["Hello world", " leading space", "naïve café ✓ 日本語", "tabs\tand\nnewlines  ",
         "<|endoftext|> inside", "a<|im_start|>user\nhi<|im_end|>b", "1234567 + 89", ""]


def _model(vocab):
    return Llama(LlamaConfig(vocab_size=vocab, dim=16, n_layers=1, n_heads=2, max_seq_len=32))


def _tiny_bpe():
    """A byte-level BPE with a few merges, a BOS the vocabulary puts first, and
    ChatML's control tokens."""
    from ggmlopt.text import GPT2_BYTE_STRINGS
    tokens = list(GPT2_BYTE_STRINGS)
    merges = ["Ġ w", "Ġw o", "l l", "e ll", "h ell", "Ġ t"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    tokens += ["<|bos|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    types = [1] * (len(tokens) - 4) + [3, 3, 3, 3]
    ids = {t: i for i, t in enumerate(tokens)}
    return BPETokenizer(tokens, merges, token_types=types, bos_id=ids["<|bos|>"],
                        eos_id=ids["<|endoftext|>"], add_bos=True, pre="llama-bpe",
                        chat_template=CHATML)


def _check_auto_tokenizer(tok, directory):
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(directory)
    bos = [tok.bos_id] if getattr(tok, "add_bos", False) else []
    for text in TEXTS:
        ours = tok.encode(text, parse_special=True).tolist()
        assert auto(text, add_special_tokens=True)["input_ids"] == bos + ours, text
        assert auto.decode(ours) == tok.decode(np.asarray(ours, np.int32)), text
    back = load_hf_tokenizer(directory)
    for text in TEXTS:
        assert back.encode(text).tolist() == tok.encode(text, parse_special=True).tolist()
    assert back.add_bos == bool(getattr(tok, "add_bos", False))
    if tok.chat_template:
        chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Yo"}]
        text = tok.apply_chat_template(chat, tokenize=False)
        assert auto.apply_chat_template(chat, tokenize=False) == text
        assert auto(text, add_special_tokens=False)["input_ids"] == \
            tok.apply_chat_template(chat).tolist()
    return auto


def test_a_byte_tokenizer_is_written_as_auto_tokenizer_reads_it(tmp_path):
    tok = ByteTokenizer(chat_template=CHATML.replace("<|im_start|>", "").replace(
        "<|im_end|>", "<|endoftext|>"))
    save_hf(_model(257), tmp_path, tokenizer=tok)
    auto = _check_auto_tokenizer(tok, tmp_path)
    assert auto.eos_token == "<|endoftext|>" and auto.eos_token_id == 256
    config = json.loads((tmp_path / "generation_config.json").read_text())
    assert config["eos_token_id"] == 256 and "bos_token_id" not in config


def test_a_bpe_vocabulary_with_a_bos_and_control_tokens(tmp_path):
    tok = _tiny_bpe()
    save_hf(_model(tok.vocab_size), tmp_path, tokenizer=tok)
    auto = _check_auto_tokenizer(tok, tmp_path)
    assert auto.bos_token == "<|bos|>"
    transformers = pytest.importorskip("transformers")
    gen = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert gen.bos_token_id == tok.bos_id
    assert set(np.atleast_1d(gen.eos_token_id).tolist()) == set(tok.eog_ids)


def test_refusals_write_nothing(tmp_path):
    tok = _tiny_bpe()
    with pytest.raises(ValueError, match="tokenizer: it has 266 tokens, more than the model's "
                                         "vocab_size 257"):
        save_hf(_model(257), tmp_path / "a", tokenizer=tok)
    with pytest.raises(TypeError, match="tokenizer: expected a ggmlopt tokenizer"):
        save_hf(_model(257), tmp_path / "b", tokenizer="gpt2")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


SRC = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
VOCABS = sorted(glob.glob(os.path.join(SRC, "models", "ggml-vocab-*.gguf"))) if SRC else []


@pytest.mark.skipif(not VOCABS, reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source) is not set")
@pytest.mark.parametrize("path", VOCABS, ids=lambda p: os.path.basename(p)[len("ggml-vocab-"):-5])
def test_every_vocabulary_of_llama_cpp_round_trips(tmp_path, path):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from ggmlopt.io import load_gguf_tokenizer
    from ggmlopt.io.gguf_reader import GgufFile
    if GgufFile(path).fields.get("tokenizer.ggml.model") not in ("gpt2", "llama", "gemma4") \
            or not os.path.isfile(path + ".inp"):
        pytest.skip("not a BPE or SentencePiece vocabulary with test vectors")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = load_gguf_tokenizer(path)
    save_hf(_model(tok.vocab_size), tmp_path, tokenizer=tok)
    import transformers
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    with open(path + ".inp", encoding="utf-8") as f:
        texts = f.read().split("\n__ggml_vocab_test__\n")
    bos = [tok.bos_id] if tok.add_bos else []
    texts += ["<s>[INST] hi [/INST]</s>", "<|user|>\nhello<|end|>\n<|assistant|>",
              "x<|im_start|>y", "  two spaces first"]
    wrong = [t for t in texts
             if auto(t, add_special_tokens=True)["input_ids"] != bos + tok.encode(t).tolist()]
    assert not wrong, f"{len(wrong)} of {len(texts)} texts differ, e.g. {wrong[0]!r}"
    # generation stops where llama.cpp's does after the round trip too (Gemma 4's
    # "</s>" is a normal token beside its <|tool_response>, in the HF files as in GGUF)
    from ggmlopt.hf_tokenizer import load_hf_tokenizer
    assert load_hf_tokenizer(tmp_path).eog_ids == tok.eog_ids
    # the pad and unknown tokens llama.cpp names are named for transformers too
    fields = GgufFile(path).fields
    for key, name in (("padding", "pad_token_id"), ("unknown", "unk_token_id")):
        want = fields.get(f"tokenizer.ggml.{key}_token_id")
        if want is not None and tok.token_types[want] in (2, 3):   # unknown, control
            assert getattr(auto, name) == want, name


def test_named_templates_are_files_as_transformers_writes_them(tmp_path):
    # Command R's tool_use and rag: chat_template.jinja and additional_chat_templates/
    transformers = pytest.importorskip("transformers")
    tok = _tiny_bpe()
    tok.named_chat_templates = {"tool_use": "T:{{ messages[0]['content'] }}{{ tools|length }}",
                                "rag": "R:{{ messages[0]['content'] }}"}
    save_hf(_model(tok.vocab_size), tmp_path, tokenizer=tok)
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    auto, back = transformers.AutoTokenizer.from_pretrained(tmp_path), load_hf_tokenizer(tmp_path)
    chat = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    for kwargs, want in (({}, tok.apply_chat_template(chat, tokenize=False)),
                         ({"tools": tools}, "T:hi1"), ({"chat_template": "rag"}, "R:hi")):
        assert auto.apply_chat_template(chat, tokenize=False, **kwargs) == want, kwargs
        assert back.apply_chat_template(chat, tokenize=False, **kwargs) == want, kwargs
        assert tok.apply_chat_template(chat, tokenize=False, **kwargs) == want, kwargs


def test_a_bos_llama_cpp_knows_by_its_text_is_written(tmp_path):
    # aquila's <|endoftext|> is typed normal in the file; llama.cpp (and ggmlopt)
    # match it whole by its text: it is a special token in the files too
    from ggmlopt.text import GPT2_BYTE_STRINGS
    tokens = list(GPT2_BYTE_STRINGS) + ["<|endoftext|>"]
    tok = BPETokenizer(tokens, [], token_types=[1] * 257, bos_id=256, eos_id=256,
                       add_bos=True, pre="llama-bpe")
    save_hf(_model(257), tmp_path, tokenizer=tok)
    _check_auto_tokenizer(tok, tmp_path)


def test_a_bos_that_is_a_word_is_refused(tmp_path):
    # transformers would make the named bos_token special and find it inside words
    from ggmlopt.text import GPT2_BYTE_STRINGS
    tokens = list(GPT2_BYTE_STRINGS) + ["th", "the", "<|endoftext|>"]
    tok = BPETokenizer(tokens, ["t h", "th e"], token_types=[1] * 258 + [3],
                       bos_id=257, eos_id=258, add_bos=True, pre="llama-bpe")
    with pytest.raises(ValueError, match="its bos_token 'the' \\(id 257\\) is a normal token"):
        save_hf(_model(259), tmp_path / "w", tokenizer=tok)
    assert not (tmp_path / "w").exists()

