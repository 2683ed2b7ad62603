"""A vocabulary's add_eos flag, read as llama.cpp reads a GGUF's
tokenizer.ggml.add_eos_token and the Hugging Face converter a checkpoint's
add_eos_token (or its tokenizer.json's post-processor): a text tokenized as a
whole document (llama-finetune's text file) ends with the EOS where the flag says
so, and a file written back says what it read.  (llama-finetune's text file
never reaches its last token: its windows stop a stride before the end.)  Against llama.cpp's own
tokenization: tests/llamacpp/test_llamacpp_special_tokens.py."""
import json
import warnings

import pytest

from ggmlopt.instruct import document_ids
from ggmlopt.io.gguf_llama import tokenizer_from_fields

SPM_FIELDS = {"tokenizer.ggml.model": "llama",
              "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "\u2581a", "a", "b", "\u2581"],
              "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0],
              "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1],
              "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
              "tokenizer.ggml.unknown_token_id": 0}
KEY = "tokenizer.ggml.add_eos_token"


@pytest.mark.parametrize("said", [True, False, None])
def test_the_gguf_key_decides_and_its_absence_means_no_eos(said):
    fields = dict(SPM_FIELDS) if said is None else {**SPM_FIELDS, KEY: said}
    tok = tokenizer_from_fields(fields, "f")
    assert tok.add_eos is bool(said)
    ids = document_ids(tok, "a b")
    assert ids[0] == 1                       # the BOS llama.cpp puts first
    assert bool(ids[-1] == 2) is bool(said)    # and the EOS it puts last only then
    # asked outright, the document ends with the EOS or not whatever the flag says
    assert document_ids(tok, "a b", eos=True)[-1] == 2
    assert document_ids(tok, "a b", eos=False)[-1] != 2


def test_a_sentencepiece_file_without_its_ids_takes_llama_cpps():
    # llama.cpp's SPM defaults (bos 1, eos 2, unk 0): the BOS first and the EOS last
    # of a text it tokenizes with its special tokens
    fields = {k: v for k, v in SPM_FIELDS.items() if not k.endswith("_token_id")}
    tok = tokenizer_from_fields({**fields, KEY: True}, "f")
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (1, 2, 0)
    assert document_ids(tok, "a").tolist() == [1, 3, 2]


def test_an_eos_the_file_does_not_name_is_refused():
    pytest.importorskip("tokenizers")
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
              "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"],
              "tokenizer.ggml.token_type": [1, 1, 1]}
    with pytest.raises(ValueError, match="add_eos_token is true but the file has no "
                                         "tokenizer.ggml.eos_token_id"):
        tokenizer_from_fields({**fields, KEY: True}, "f")


def test_a_bpe_vocabulary_reads_the_key_too():
    pytest.importorskip("tokenizers")
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
              "tokenizer.ggml.tokens": ["a", "b", "ab", "<|endoftext|>"],
              "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1, 3],
              "tokenizer.ggml.eos_token_id": 3}
    assert tokenizer_from_fields(fields, "f").add_eos is False
    tok = tokenizer_from_fields({**fields, KEY: True}, "f")
    assert tok.add_eos is True
    assert document_ids(tok, "ab").tolist() == [2, 3]


def test_a_spm_vocabulary_written_back_keeps_its_flag(tmp_path):
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.io.gguf_reader import GgufFile
    from ggmlopt.models import Llama, LlamaConfig
    from ggmlopt.spm import SPMTokenizer
    model = Llama(LlamaConfig(vocab_size=7, dim=16, n_layers=1, n_heads=2, max_seq_len=8),
                  seed=0)
    for add_eos in (True, False):
        tok = SPMTokenizer(SPM_FIELDS["tokenizer.ggml.tokens"],
                           SPM_FIELDS["tokenizer.ggml.scores"],
                           SPM_FIELDS["tokenizer.ggml.token_type"], bos_id=1, eos_id=2,
                           unk_id=0, add_eos=add_eos)
        save_gguf(model, tmp_path / "m.gguf", tokenizer=tok)
        assert GgufFile(str(tmp_path / "m.gguf")).fields[KEY] is add_eos
        assert load_gguf(tmp_path / "m.gguf")[1].add_eos is add_eos


def test_a_tokenizer_asking_for_an_eos_it_lacks_is_refused():
    from ggmlopt.spm import SPMTokenizer
    with pytest.raises(ValueError, match="add_eos: True needs an eos_id"):
        SPMTokenizer(["<unk>", "a"], [0.0, 0.0], [2, 1], unk_id=0, add_eos=True)


def _hf_checkpoint(directory, *, eos_in_post_processor, config_says):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    if eos_in_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", vocab["</s>"])])
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
    if config_says is not None:
        config["add_eos_token"] = config_says
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return vocab["</s>"]


@pytest.mark.parametrize("post, config, want", [(True, None, True), (False, None, False),
                                                (False, True, True), (True, False, True)])
def test_a_hugging_face_tokenizer_adds_the_eos_where_the_converter_would(tmp_path, post,
                                                                         config, want):
    # what the tokenizer.json's post-processor appends, over a config's add_eos_token
    # that disagrees, and the key where it appends nothing: what llama.cpp's converter
    # (gguf-py's SpecialVocab) writes as the flag.  transformers 5 appends what the
    # post-processor does only: where the key alone asks, a warning says so
    pytest.importorskip("tokenizers")
    from ggmlopt.hf_tokenizer import load_hf_tokenizer
    eos = _hf_checkpoint(tmp_path / "c", eos_in_post_processor=post, config_says=config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = load_hf_tokenizer(tmp_path / "c")
    said = [str(w.message) for w in caught if "post-processor does not add" in str(w.message)]
    assert len(said) == (1 if want and not post else 0)
    assert all("add_eos_token asks for" in m and "tokenizer.add_eos = False" in m for m in said)
    assert tok.eos_id == eos and tok.add_eos is want
    assert bool(document_ids(tok, "hi")[-1] == eos) is want


def test_no_warning_of_a_bos_the_tokenizer_does_not_have(tmp_path):
    # add_bos_token: true with no bos_token: nothing is added, so nothing to warn of
    pytest.importorskip("tokenizers")
    from ggmlopt.hf_tokenizer import load_hf_tokenizer
    _hf_checkpoint(tmp_path / "c", eos_in_post_processor=False, config_says=None)
    config = json.loads((tmp_path / "c" / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (tmp_path / "c" / "tokenizer_config.json").write_text(json.dumps(config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = load_hf_tokenizer(tmp_path / "c")
    assert tok.bos_id is None
    assert not [w for w in caught if "post-processor does not add" in str(w.message)]
    assert document_ids(tok, "hi")[0] == tok.token_to_id("h")


def test_hugging_face_files_written_for_an_add_eos_vocabulary_append_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from ggmlopt.io.hf_tokenizer_files import tokenizer_config, tokenizer_json
    from ggmlopt.spm import SPMTokenizer
    tok = SPMTokenizer(SPM_FIELDS["tokenizer.ggml.tokens"], SPM_FIELDS["tokenizer.ggml.scores"],
                       SPM_FIELDS["tokenizer.ggml.token_type"], bos_id=1, eos_id=2, unk_id=0,
                       add_eos=True)
    (tmp_path / "tokenizer.json").write_text(tokenizer_json(tok))
    config = tokenizer_config(tok, 8)
    assert config["add_eos_token"] is True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert theirs("a")["input_ids"] == document_ids(tok, "a").tolist() == [1, 3, 2]


def test_no_eos_to_add_is_no_add_eos(tmp_path):
    # transformers turns add_eos_token off for a tokenizer without an eos_token
    pytest.importorskip("tokenizers")
    from ggmlopt.hf_tokenizer import load_hf_tokenizer
    _hf_checkpoint(tmp_path / "c", eos_in_post_processor=False, config_says=True)
    config = json.loads((tmp_path / "c" / "tokenizer_config.json").read_text())
    del config["eos_token"]
    (tmp_path / "c" / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_hf_tokenizer(tmp_path / "c")
    assert tok.eos_id is None and tok.add_eos is False


def test_a_byte_tokenizers_files_append_the_eos_where_it_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from ggmlopt.io.hf_tokenizer_files import tokenizer_config, tokenizer_json
    from ggmlopt.text import ByteTokenizer
    for add_eos in (True, False):
        tok = ByteTokenizer(add_eos=add_eos)
        d = tmp_path / str(add_eos)
        d.mkdir()
        (d / "tokenizer.json").write_text(tokenizer_json(tok))
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok, 8)))
        theirs = transformers.AutoTokenizer.from_pretrained(d)
        assert theirs("hi")["input_ids"] == document_ids(tok, "hi").tolist()


def test_a_gpt2_vocabulary_without_its_ids_takes_llama_cpps():
    # llama.cpp's defaults for a gpt2-type vocabulary: BOS and EOS 11 (llama-vocab.cpp),
    # so a file without the keys starts and stops generation where llama.cpp does
    pytest.importorskip("tokenizers")
    tokens = [chr(c) for c in range(ord("a"), ord("a") + 14)] + ["ab"]
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
              "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"],
              "tokenizer.ggml.token_type": [1] * len(tokens),
              "tokenizer.ggml.add_bos_token": True}
    tok = tokenizer_from_fields(fields, "f")
    assert (tok.bos_id, tok.eos_id) == (11, 11) and 11 in tok.eog_ids
    assert list(document_ids(tok, "ab")) == [11, 14]
    # the file's own ids win
    tok = tokenizer_from_fields({**fields, "tokenizer.ggml.bos_token_id": 2,
                                 "tokenizer.ggml.eos_token_id": 3}, "f")
    assert (tok.bos_id, tok.eos_id) == (2, 3) and 11 not in tok.eog_ids
