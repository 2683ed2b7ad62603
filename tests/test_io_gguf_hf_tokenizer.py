"""save_gguf(model, path, tokenizer=load_hf_tokenizer(directory)): a Hugging Face
checkpoint's tokenizer written as llama.cpp's converter (convert_hf_to_gguf.py,
gguf-py's SpecialVocab) writes the same tokenizer.json and tokenizer_config.json,
or refused where llama.cpp would tokenize otherwise.  The checkpoints are made
from llama.cpp's own vocabularies (GGMLOPT_LLAMA_CPP_SRC) by save_hf, then read
back by load_hf and load_hf_tokenizer, as a fine-tuning session reads them; the
byte-level BPE keys are compared with the converter's own functions run on the
same directory, the SentencePiece ones with the vocabulary they were made from.
llama.cpp's tokenization of the files: tests/llamacpp/test_llamacpp_hf_tokenizer_gguf.py."""
import json
import os
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

from ggmlopt.hf_tokenizer import load_hf_tokenizer
from ggmlopt.io import load_gguf_tokenizer, load_hf, save_gguf, save_hf
from ggmlopt.models import GPT2, Llama, LlamaConfig, Qwen2, Qwen2Config
from ggmlopt.models.config import GPT2Config
from ggmlopt.models.phi3 import Phi3, Phi3Config
from ggmlopt.text import llama_cpp_special

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")
pytest.importorskip("gguf")

SRC = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
needs_src = pytest.mark.skipif(not SRC, reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source) "
                               "is not set")
# vocabulary -> the model family a checkpoint of it is
FAMILIES = {
    "gpt-2": lambda n: GPT2(GPT2Config(vocab_size=n, dim=32, n_layers=1, n_heads=2,
                                       max_seq_len=32)),
    "llama-bpe": lambda n: Llama(LlamaConfig(vocab_size=n, dim=32, n_layers=1, n_heads=2,
                                             max_seq_len=32)),
    "qwen2": lambda n: Qwen2(Qwen2Config(vocab_size=n, dim=32, n_layers=1, n_heads=2,
                                         max_seq_len=32)),
    "starcoder": lambda n: Llama(LlamaConfig(vocab_size=n, dim=32, n_layers=1, n_heads=2,
                                             max_seq_len=32)),
    "llama-spm": lambda n: Llama(LlamaConfig(vocab_size=n, dim=32, n_layers=1, n_heads=2,
                                             max_seq_len=32)),
    "phi-3": lambda n: Phi3(Phi3Config(vocab_size=n, dim=32, n_layers=1, n_heads=2,
                                       max_seq_len=32)),
}
BYTE_LEVEL = ["gpt-2", "llama-bpe", "qwen2", "starcoder"]
SENTENCEPIECE = ["llama-spm", "phi-3"]


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def vocab_path(name):
    return os.path.join(SRC or "", "models", f"ggml-vocab-{name}.gguf")


def checkpoint(directory, name, extra_rows=0):
    """A checkpoint directory of a random model of name's family with llama.cpp's
    vocabulary name as its tokenizer.json; (model, tokenizer) load_hf and
    load_hf_tokenizer read back from it."""
    if not os.path.isfile(vocab_path(name)):
        pytest.skip(f"{vocab_path(name)} is not in this llama.cpp")
    tok = _quiet(load_gguf_tokenizer, vocab_path(name))
    if not os.path.isdir(directory):
        save_hf(FAMILIES[name](tok.vocab_size + extra_rows), directory, tokenizer=tok)
    return _quiet(load_hf, directory), load_hf_tokenizer(directory)


def gguf_fields(path):
    from ggmlopt.io.gguf_reader import GgufFile
    return GgufFile(str(path)).fields


def converter():
    """llama.cpp's converter's vocabulary functions: (get_vocab_base, SpecialVocab)
    run on a directory as convert_hf_to_gguf.py runs them for a gpt2 vocabulary."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    for path in (os.path.join(SRC, "gguf-py"), SRC):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        import gguf
        from conversion.base import TextModel
    except ImportError as e:
        pytest.skip(f"llama.cpp's converter does not import here: {e}")

    def run(directory):
        d = Path(directory)
        model = types.SimpleNamespace(dir_model=d,
                                      hparams=json.loads((d / "config.json").read_text()))
        model.get_vocab_base_pre = lambda tok: TextModel.get_vocab_base_pre(model, tok)
        model.does_token_look_special = lambda t: TextModel.does_token_look_special(model, t)
        tokens, types_, pre = _quiet(TextModel.get_vocab_base, model)
        return tokens, [int(t) for t in types_], pre, gguf.SpecialVocab(d, load_merges=True)
    return run


@needs_src
@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_byte_level_keys_are_the_converter_s(tmp_path_factory, name):
    run = converter()
    directory = tmp_path_factory.getbasetemp() / f"hf-{name}"
    model, tok = checkpoint(directory, name)
    out = tmp_path_factory.mktemp("out") / "model.gguf"
    _quiet(save_gguf, model, out, tokenizer=tok, dtype="q8_0")
    fields = gguf_fields(out)
    tokens, types_, pre, special = run(directory)
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == pre
    assert pre == gguf_fields(vocab_path(name))["tokenizer.ggml.pre"]
    assert fields["tokenizer.ggml.tokens"] == tokens
    assert fields["tokenizer.ggml.token_type"] == types_
    assert fields["tokenizer.ggml.merges"] == special.merges
    for which, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"),
                       ("sep", "seperator")):
        want = special.special_token_ids.get(which)
        if want is not None:
            assert fields[f"tokenizer.ggml.{key}_token_id"] == want, which
    # the converter leaves add_bos/add_eos out where the files say nothing: llama.cpp's
    # default for the pre-tokenizer (BOS for Llama 3's), which the file states
    from ggmlopt.io._gguf_tokenizer import BOS_BY_DEFAULT_PRE
    assert fields["tokenizer.ggml.add_bos_token"] == \
        special.add_special_token.get("bos", pre in BOS_BY_DEFAULT_PRE)
    assert fields["tokenizer.ggml.add_eos_token"] == special.add_special_token.get("eos", False)
    assert fields.get("tokenizer.chat_template") == special.chat_template
    # and the vocabulary llama.cpp made it from, as llama.cpp reads both
    original = gguf_fields(vocab_path(name))
    assert fields["tokenizer.ggml.tokens"] == original["tokenizer.ggml.tokens"]
    assert fields["tokenizer.ggml.merges"] == original["tokenizer.ggml.merges"]
    assert _as_llama_cpp_reads(fields) == _as_llama_cpp_reads(original)


def _as_llama_cpp_reads(fields):
    """(control, user-defined, end-of-generation) ids as llama.cpp's loader makes
    them from a file's types (it overrides some by their text; an unknown-type
    token is matched and skipped as a control one)."""
    tokens = fields["tokenizer.ggml.tokens"]
    ids = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    named = [fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return llama_cpp_special(fields["tokenizer.ggml.token_type"], ids, named)


@needs_src
@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_sentencepiece_keys_are_the_vocabulary_s(tmp_path_factory, name):
    """A Llama 2 / Phi-3 tokenizer.json: the vocabulary it was made from, but the
    scores, which order the same merges (llama.cpp's converter has no
    tokenizer.model here to take them from)."""
    directory = tmp_path_factory.getbasetemp() / f"hf-{name}"
    model, tok = checkpoint(directory, name)
    out = tmp_path_factory.mktemp("out") / "model.gguf"
    _quiet(save_gguf, model, out, tokenizer=tok, dtype="q8_0")
    fields, original = gguf_fields(out), gguf_fields(vocab_path(name))
    for key in ("model", "pre", "tokens", "bos_token_id", "eos_token_id", "unknown_token_id",
                "add_bos_token", "add_eos_token"):
        assert fields.get(f"tokenizer.ggml.{key}") == original.get(f"tokenizer.ggml.{key}"), key
    assert fields["tokenizer.ggml.add_space_prefix"] is True
    assert fields.get("tokenizer.chat_template") == original.get("tokenizer.chat_template")
    assert _as_llama_cpp_reads(fields) == _as_llama_cpp_reads(original)
    # the scores order the pieces the merges make as the vocabulary's own do, where
    # those differ (Llama 2's runs of spaces share one score: they share one here)
    from ggmlopt.spm import SPMTokenizer
    ours = SPMTokenizer(fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"],
                        fields["tokenizer.ggml.token_type"])
    theirs = SPMTokenizer(original["tokenizer.ggml.tokens"], original["tokenizer.ggml.scores"],
                          original["tokenizer.ggml.token_type"])
    assert ours._merges() == theirs._merges()
    # a Phi-3's special tokens drop the whitespace after them only under a Phi-3 name
    if tok.rstrip_ids:
        assert "phi3" in fields["general.name"].lower()


@needs_src
def test_the_file_reads_back_as_the_tokenizer_encodes(tmp_path_factory):
    directory = tmp_path_factory.getbasetemp() / "hf-llama-bpe"
    model, tok = checkpoint(directory, "llama-bpe")
    out = tmp_path_factory.mktemp("out") / "model.gguf"
    _quiet(save_gguf, model, out, tokenizer=tok, dtype="q8_0")
    back = load_gguf_tokenizer(out)
    for text in ("<|begin_of_text|>Hi  there\n\n 12345 日本 🦙<|eot_id|>", "   ", ""):
        assert back.encode(text).tolist() == tok.encode(text).tolist()
    assert back.add_bos and back.bos_id == tok.bos_id and back.eog_ids >= {tok.eos_id}


@needs_src
def test_a_model_with_more_rows_gets_the_converter_s_placeholders(tmp_path):
    model, tok = checkpoint(tmp_path / "hf", "gpt-2", extra_rows=7)
    n = tok.vocab_size
    _quiet(save_gguf, model, tmp_path / "m.gguf", tokenizer=tok)
    fields = gguf_fields(tmp_path / "m.gguf")
    assert fields["tokenizer.ggml.tokens"][n:] == [f"[PAD{i}]" for i in range(n, n + 7)]
    assert fields["tokenizer.ggml.token_type"][n:] == [5] * 7   # unused
    assert fields["gpt2.vocab_size"] == n + 7


def _edited(tmp_path, source, edit, name="edited"):
    """A copy of the checkpoint directory source's tokenizer files with
    tokenizer.json's spec changed by edit (in place)."""
    directory = tmp_path / name
    directory.mkdir()
    for f in ("tokenizer_config.json", "config.json", "generation_config.json"):
        if (source / f).is_file():
            (directory / f).write_text((source / f).read_text())
    spec = json.loads((source / "tokenizer.json").read_text())
    edit(spec)
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return load_hf_tokenizer(directory)


def _refused(model, tok, path, match):
    with pytest.raises(ValueError, match=match) as info:
        _quiet(save_gguf, model, path, tokenizer=tok)
    # and what to do instead
    assert "load_gguf_tokenizer(path)" in str(info.value)
    assert not os.path.exists(path)


@needs_src
def test_a_pre_tokenizer_the_converter_does_not_know_is_refused(tmp_path_factory, tmp_path):
    directory = tmp_path_factory.getbasetemp() / "hf-llama-bpe"
    model, _ = checkpoint(directory, "llama-bpe")

    def two_digits(spec):   # Llama 3's numbers cut in twos: a pre-tokenizer of no name
        for step in spec["pre_tokenizer"]["pretokenizers"]:
            if "pattern" in step:
                step["pattern"]["Regex"] = step["pattern"]["Regex"].replace("{1,3}", "{1,2}")
    tok = _edited(tmp_path, directory, two_digits)
    assert tok.encode("12345").tolist() != load_hf_tokenizer(directory).encode("12345").tolist()
    _refused(model, tok, tmp_path / "a.gguf", "not one llama.cpp's converter knows")


@needs_src
def test_merges_looked_up_otherwise_than_the_name_says_are_refused(tmp_path_factory,
                                                                   tmp_path):
    directory = tmp_path_factory.getbasetemp() / "hf-llama-bpe"
    model, _ = checkpoint(directory, "llama-bpe")

    def merge_words(spec):
        spec["model"]["ignore_merges"] = False
    tok = _edited(tmp_path, directory, merge_words)
    _refused(model, tok, tmp_path / "a.gguf", "ignore_merges=False, but llama.cpp's "
             "'llama-bpe' pre-tokenizer looks words up whole")


@needs_src
def test_an_added_token_llama_cpp_would_match_otherwise_is_refused(tmp_path_factory,
                                                                   tmp_path):
    """An added token taking the spaces before it (lstrip): the keys name the
    right pre-tokenizer, but llama.cpp would keep the spaces; the check on the
    adversarial texts finds it."""
    directory = tmp_path_factory.getbasetemp() / "hf-qwen2"
    model, _ = checkpoint(directory, "qwen2")

    def lstrip(spec):
        for t in spec["added_tokens"]:
            if t["content"] == "<|im_start|>":
                t["lstrip"] = True
    tok = _edited(tmp_path, directory, lstrip)
    _refused(model, tok, tmp_path / "a.gguf", "llama.cpp would tokenize")


@needs_src
def test_sentencepiece_refusals(tmp_path_factory, tmp_path):
    directory = tmp_path_factory.getbasetemp() / "hf-llama-spm"
    model, _ = checkpoint(directory, "llama-spm")

    def metaspace(spec):   # transformers' legacy=False: the prefix at the text's start only
        spec["normalizer"] = {"type": "Replace", "pattern": {"String": " "},
                              "content": "\u2581"}
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                                 "prepend_scheme": "first", "split": False}
    tok = _edited(tmp_path, directory, metaspace, "metaspace")
    _refused(model, tok, tmp_path / "a.gguf", "a Metaspace pre-tokenizer is not "
             "SentencePiece's")

    def drop_merge(spec):   # llama.cpp's SentencePiece would still join "▁t"
        spec["model"]["merges"] = [m for m in spec["model"]["merges"]
                                   if m not in ("\u2581 t", ["\u2581", "t"])]
    tok = _edited(tmp_path, directory, drop_merge, "dropped")
    _refused(model, tok, tmp_path / "b.gguf", "'▁t' splits into the pieces '▁' and 't', "
             "which no merge joins")


@needs_src
def test_nfc_is_written_with_a_warning(tmp_path_factory, tmp_path):
    directory = tmp_path_factory.getbasetemp() / "hf-qwen2"
    model, _ = checkpoint(directory, "qwen2")

    def nfc(spec):   # Qwen's own tokenizer.json
        spec["normalizer"] = {"type": "NFC"}
    tok = _edited(tmp_path, directory, nfc)
    with pytest.warns(UserWarning, match="llama.cpp does not: a text not in NFC"):
        save_gguf(model, tmp_path / "a.gguf", tokenizer=tok, dtype=np.float32)
    assert gguf_fields(tmp_path / "a.gguf")["tokenizer.ggml.pre"] == "qwen2"


@needs_src
def test_digits_split_by_a_digits_step_are_written(tmp_path_factory, tmp_path):
    """StarCoder's and SmolLM's own tokenizer.json split digits with a Digits
    step, not a Split: refused as a pre-tokenizer of another kind, though the
    vocabulary's hash names llama.cpp's starcoder, which splits them alike."""
    directory = tmp_path_factory.getbasetemp() / "hf-starcoder"
    model, plain = checkpoint(directory, "starcoder")

    def digits(spec):
        steps = spec["pre_tokenizer"]["pretokenizers"]
        assert steps[0]["pattern"] == {"Regex": "\\p{N}"}
        steps[0] = {"type": "Digits", "individual_digits": True}
    tok = _edited(tmp_path, directory, digits)
    texts = ["x = 12345 + 0.75", "v1.2.3-rc10", "٣٤٥ and ½"]
    assert [tok.encode(t).tolist() for t in texts] == [plain.encode(t).tolist() for t in texts]
    _quiet(save_gguf, model, tmp_path / "a.gguf", tokenizer=tok, dtype=np.float32)
    assert gguf_fields(tmp_path / "a.gguf")["tokenizer.ggml.pre"] == "starcoder"
    back = _quiet(load_gguf_tokenizer, tmp_path / "a.gguf")
    assert [back.encode(t).tolist() for t in texts] == [tok.encode(t).tolist() for t in texts]


@needs_src
def test_a_word_llama_cpp_makes_a_control_token_is_written_with_a_warning(tmp_path_factory,
                                                                           tmp_path):
    """Qwen2's own vocabulary holds </s> as a word; llama.cpp's loader makes it a
    control token by its text (as in the converter's GGUF of any Qwen2): every
    Qwen2 checkpoint was refused for it."""
    directory = tmp_path_factory.getbasetemp() / "hf-qwen2"
    model, _ = checkpoint(directory, "qwen2")

    def a_word(spec):
        spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "</s>"]
    tok = _edited(tmp_path, directory, a_word)
    assert len(tok.encode("</s>")) > 1          # the letters, to this tokenizer
    with pytest.warns(UserWarning, match="makes the vocabulary's '</s>' a control token"):
        save_gguf(model, tmp_path / "a.gguf", tokenizer=tok, dtype=np.float32)
    assert gguf_fields(tmp_path / "a.gguf")["tokenizer.ggml.pre"] == "qwen2"


def test_a_tokenizer_of_no_known_pre_tokenizer_is_refused(tmp_path):
    """A small byte-level BPE of its own: no hash llama.cpp's converter knows."""
    from ggmlopt.text import GPT2_BYTE_STRINGS, BPETokenizer
    merges = ["Ġ w", "Ġw o", "l l"]
    tokens = list(GPT2_BYTE_STRINGS) + [m.replace(" ", "") for m in merges] + ["<|endoftext|>"]
    bpe = BPETokenizer(tokens, merges, token_types=[1] * (len(tokens) - 1) + [3],
                       eos_id=len(tokens) - 1)
    model = Llama(LlamaConfig(vocab_size=len(tokens), dim=32, n_layers=1, n_heads=2,
                              max_seq_len=16))
    save_hf(model, tmp_path / "hf", tokenizer=bpe)
    tok = load_hf_tokenizer(tmp_path / "hf")
    _refused(model, tok, tmp_path / "a.gguf", "not one llama.cpp's converter knows and "
             "ggmlopt reproduces")
    small = Llama(LlamaConfig(vocab_size=len(tokens) - 1, dim=32, n_layers=1, n_heads=2,
                              max_seq_len=16))
    _refused(small, tok, tmp_path / "b.gguf", f"it has {len(tokens)} tokens, more than the "
             f"model's vocab_size {len(tokens) - 1}")


def test_a_wordpiece_tokenizer_is_refused(tmp_path):
    tk = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "[SEP]": 1, "hello": 2, "world": 3, "##s": 4}
    tok = tk.Tokenizer(tk.models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    (tmp_path / "hf").mkdir()
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    model = Llama(LlamaConfig(vocab_size=5, dim=32, n_layers=1, n_heads=2, max_seq_len=16))
    _refused(model, load_hf_tokenizer(tmp_path / "hf"), tmp_path / "a.gguf",
             "is a WordPiece model; save_gguf writes a tokenizer.json's byte-level BPE or "
             "SentencePiece BPE")
