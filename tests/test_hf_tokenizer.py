"""load_hf_tokenizer: a checkpoint's tokenizer.json and tokenizer_config.json,
equal to transformers' AutoTokenizer on the same directory (ids with and
without special tokens parsed, decoding, BOS, the chat template's text and ids).
The vocabulary is a small byte-level BPE trained here (no download)."""
import json

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from ggmlopt.hf_tokenizer import load_hf_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The capital of France is Paris.", "def f(x):\n    return x * 2  # twice",
          "Ünïcödé text, emoji 🙂 and numbers 12345.", "  spaces   and\ttabs\n\n"] * 20
TEXTS = ["The capital of Zorblax is Quimby.", "<|im_start|>user\nhi<|im_end|>",
         "no <|im_end special", "🙂🙂 é", "", "   ", "x<s>y</s>"]


def make_checkpoint(directory, *, bos_rule):
    """A trained byte-level BPE tokenizer.json and its tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos_rule == "post-processor":   # Llama 3's way: the tokenizer.json adds the BOS
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "<|im_end|>", "chat_template": CHATML,
              "model_max_length": 2048}
    if bos_rule == "config":
        config["add_bos_token"] = True
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(params=["post-processor", "none"])
def checkpoint(request, tmp_path):
    return make_checkpoint(tmp_path / "tok", bos_rule=request.param), request.param


def test_ids_and_text_equal_transformers(checkpoint):
    transformers = pytest.importorskip("transformers")
    directory, bos_rule = checkpoint
    ours = load_hf_tokenizer(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    assert ours.vocab_size == len(theirs)
    assert ours.bos_id == theirs.bos_token_id and ours.eos_id == theirs.eos_token_id
    assert ours.add_bos == (bos_rule == "post-processor")
    for text in TEXTS:
        want = theirs(text, add_special_tokens=False)["input_ids"]
        np.testing.assert_array_equal(ours.encode(text), want, err_msg=text)
        with_bos = theirs(text)["input_ids"]
        got = ([ours.bos_id] if ours.add_bos else []) + ours.encode(text).tolist()
        assert got == with_bos, text
        theirs.split_special_tokens = True
        plain = theirs(text, add_special_tokens=False)["input_ids"]
        theirs.split_special_tokens = False
        np.testing.assert_array_equal(ours.encode(text, parse_special=False), plain,
                                      err_msg=text)
        ids = ours.encode(text).tolist()
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special=True) == theirs.decode(ids,
                                                                    skip_special_tokens=True)
    assert ours.encode("<|im_end|>").tolist() == [ours.token_to_id("<|im_end|>")]
    assert len(ours.encode("<|im_end|>", parse_special=False)) > 1
    assert ours.token_to_id("<|im_end|>") in ours.eog_ids
    assert ours.id_to_token(ours.eos_id) == "<|im_end|>"
    with pytest.raises(IndexError):
        ours.id_to_token(ours.vocab_size)


def test_chat_template_equals_transformers(checkpoint):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    directory, _ = checkpoint
    ours = load_hf_tokenizer(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "The capital of Zorblax?"},
                {"role": "assistant", "content": "Quimby."}]
    for prompt in (False, True):
        text = ours.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        assert text == theirs.apply_chat_template(messages, add_generation_prompt=prompt,
                                                  tokenize=False)
        ids = ours.apply_chat_template(messages, add_generation_prompt=prompt)
        want = theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True)
        # transformers tokenizes the rendering without adding a BOS: the template
        # writes what the model sees
        np.testing.assert_array_equal(ids, list(want["input_ids"]))


def test_missing_files_and_bad_json_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_hf_tokenizer(tmp_path)
    directory = make_checkpoint(tmp_path / "t", bos_rule="none")
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_hf_tokenizer(directory)
    (directory / "tokenizer_config.json").unlink()
    tok = load_hf_tokenizer(directory)      # no config: no BOS, no template
    assert tok.bos_id is None and tok.chat_template is None and not tok.add_bos
    (directory / "chat_template.jinja").write_text(CHATML)
    assert load_hf_tokenizer(directory).chat_template == CHATML


def test_the_finetune_command_takes_a_checkpoint_s_own_tokenizer(tmp_path, capsys):
    # a Hugging Face directory with its tokenizer.json: no --tokenizer needed, and
    # the chat data are rendered by its tokenizer_config.json's template
    pytest.importorskip("safetensors")
    pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    from ggmlopt import finetune, lora
    from ggmlopt.io import load_gguf_lora, load_hf, save_hf
    from ggmlopt.models import Llama, LlamaConfig
    directory = make_checkpoint(tmp_path / "hf", bos_rule="none")
    tok = load_hf_tokenizer(directory)
    save_hf(Llama(LlamaConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=2,
                              max_seq_len=128), seed=0), directory)
    with open(tmp_path / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": [{"role": "user", "content": "Zorblax?"},
                                             {"role": "assistant", "content": "Quimby."}]})
                     + "\n" for _ in range(8))
    assert finetune.main(["--model", str(directory), "--data", str(tmp_path / "train.jsonl"),
                          "--lora-rank", "4", "--ctx", "64", "--batch", "4", "--epochs", "2",
                          "--lr", "1e-2", "--out", str(tmp_path / "adapter.gguf"),
                          "--silent"]) == 0
    base = load_hf(directory)
    tokens = tok.apply_chat_template([{"role": "user", "content": "Zorblax?"}],
                                     add_generation_prompt=True)[None]
    before = base(tokens)
    load_gguf_lora(tmp_path / "adapter.gguf", base)
    assert len(lora.named_adapters(base)) > 0
    assert np.abs(base(tokens) - before).max() > 0   # the adapter trained


def test_generation_config_s_eos_ids_end_generation(tmp_path):
    """A checkpoint's generation_config.json eos_token_id list is where
    transformers' generate stops: every id of it is in eog_ids (ids outside the
    vocabulary left out)."""
    from ggmlopt.hf_tokenizer import load_hf_tokenizer
    directory = make_checkpoint(tmp_path / "tok", bos_rule="none")
    plain = load_hf_tokenizer(directory)
    assert not {2, 5} & plain.eog_ids   # "<|im_start|>" and a word end nothing by text
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5, 10**6]}))
    tok = load_hf_tokenizer(directory)
    assert tok.eog_ids == plain.eog_ids | {2, 5}


def test_special_tokens_map_names_what_the_config_does_not(tmp_path):
    # the older layout: bos/eos in special_tokens_map.json alone (transformers reads
    # it); the template's bos_token and the BOS a window starts with come from there
    directory = make_checkpoint(tmp_path / "tok", bos_rule="post-processor")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["bos_token"], config["eos_token"]
    config["chat_template"] = "{{ bos_token }}" + CHATML
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "<|im_end|>"}))
    ours = load_hf_tokenizer(directory)
    assert ours.bos_id == ours.token_to_id("<s>") and ours.eos_id == ours.token_to_id("<|im_end|>")
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False).startswith("<s><|im_start|>")
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.apply_chat_template(messages, tokenize=False) == \
        theirs.apply_chat_template(messages, tokenize=False)
    # where both say, the map wins in the older layout, the config in the newer
    # (whose added_tokens_decoder transformers reads instead of the map)
    config["eos_token"] = "</s>"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_hf_tokenizer(directory).eos_id == ours.token_to_id("<|im_end|>")
    assert transformers.AutoTokenizer.from_pretrained(directory).eos_token == "<|im_end|>"
    config["added_tokens_decoder"] = {
        str(ours.token_to_id(t)): {"content": t, "special": True, "lstrip": False,
                                   "rstrip": False, "normalized": False, "single_word": False}
        for t in ("<s>", "</s>", "<|im_start|>", "<|im_end|>")}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_hf_tokenizer(directory).eos_id == ours.token_to_id("</s>")
    assert transformers.AutoTokenizer.from_pretrained(directory).eos_token == "</s>"


def _wordpiece(directory, words, config):
    """A lower-casing WordPiece checkpoint tokenizer of words in directory
    (tokenizer.json and tokenizer_config.json of config)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    tk = Tokenizer(models.WordPiece({t: i for i, t in enumerate(words)}, unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece()
    directory.mkdir()
    tk.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_a_wordpiece_decode_cleans_up_spaces_where_its_config_asks(tmp_path):
    # transformers' clean_up_tokenization_spaces, applied to a model that is not BPE
    directory = tmp_path / "bert"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]",
              "clean_up_tokenization_spaces": True}
    _wordpiece(directory, ["[UNK]", "[CLS]", "[SEP]", "it", "'", "s", "here", ".", ",", "what",
                           "?", "yes", "!"], config)
    ours = load_hf_tokenizer(directory)
    ids = ours.encode("what ? it's here , yes !").tolist()
    assert ours.decode(ids) == "what? it's here, yes!"
    transformers = pytest.importorskip("transformers")
    assert ours.decode(ids) == transformers.AutoTokenizer.from_pretrained(directory).decode(ids)
    config["clean_up_tokenization_spaces"] = False   # the decoder's own clean-up alone
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_hf_tokenizer(directory).decode(ids) == "what? it ' s here, yes!" == \
        transformers.AutoTokenizer.from_pretrained(directory).decode(ids)


@pytest.mark.parametrize("clean_up", [True, False])
def test_save_hf_keeps_the_tokenizers_clean_up_of_spaces(tmp_path, clean_up):
    # tokenizer_config.json was written with clean_up_tokenization_spaces false for
    # every tokenizer: a saved WordPiece checkpoint decoded "it ' s" where it had "it's"
    pytest.importorskip("tokenizers")
    from ggmlopt.io import save_hf
    from ggmlopt.models import Llama, LlamaConfig
    source = tmp_path / "source"
    _wordpiece(source, ["[UNK]", "[SEP]", "it", "'", "s", "here", ".", ","],
               {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]",
                "eos_token": "[SEP]", "clean_up_tokenization_spaces": clean_up})
    ours = load_hf_tokenizer(source)
    ids = ours.encode("it's here , it's here .").tolist()
    save_hf(Llama(LlamaConfig(vocab_size=ours.vocab_size, dim=16, n_layers=1, n_heads=2,
                              ffn_dim=16, max_seq_len=16)), tmp_path / "saved", tokenizer=ours)
    saved = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert saved["clean_up_tokenization_spaces"] is clean_up
    assert load_hf_tokenizer(tmp_path / "saved").decode(ids) == ours.decode(ids)


def _edit(directory, *, config=None, tokenizer=None):
    """Rewrite a checkpoint's tokenizer_config.json (config: keys set, None values
    deleted) and tokenizer.json (tokenizer: a function of the tokenizers object)."""
    from tokenizers import Tokenizer
    if tokenizer is not None:
        tk = Tokenizer.from_file(str(directory / "tokenizer.json"))
        tokenizer(tk)
        tk.save(str(directory / "tokenizer.json"))
    if config:
        now = json.loads((directory / "tokenizer_config.json").read_text())
        now.update(config)
        now = {k: v for k, v in now.items() if v is not None}
        (directory / "tokenizer_config.json").write_text(json.dumps(now))


def test_a_tokenizer_json_s_truncation_and_padding_are_not_applied(tmp_path):
    # transformers' call neither cuts nor pads unless asked, whatever the file keeps
    directory = make_checkpoint(tmp_path / "tok", bos_rule="none")
    text = TEXTS[0] * 3
    want = load_hf_tokenizer(directory).encode(text).tolist()
    _edit(directory, tokenizer=lambda tk: (tk.enable_truncation(4), tk.enable_padding(length=64)))
    ours = load_hf_tokenizer(directory)
    assert ours.encode(text).tolist() == want and len(want) > 4
    assert ours.encode_with_offsets(text)[0].tolist() == want


def test_special_text_left_as_text_is_not_cut_at_a_plain_added_token_inside_it(tmp_path):
    # parse_special=False: the library still finds "<|im_end|>" first and reads it
    # as text, so the plain added token "im_end" inside it is not matched
    from tokenizers import AddedToken, Tokenizer
    directory = make_checkpoint(tmp_path / "tok", bos_rule="none")
    _edit(directory, tokenizer=lambda tk: tk.add_tokens([AddedToken("im_end", normalized=False)]))
    ours = load_hf_tokenizer(directory)
    library = Tokenizer.from_file(str(directory / "tokenizer.json"))
    library.encode_special_tokens = True
    for text in ("a<|im_end|>b", "im_end <|im_end|> im_end", "x<s>im_end</s>"):
        want = library.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, parse_special=False).tolist() == want
        assert ours.encode_with_offsets(text, parse_special=False)[0].tolist() == want


def test_template_files_win_and_a_template_is_picked_by_name_or_source(tmp_path):
    transformers = pytest.importorskip("transformers")
    directory = make_checkpoint(tmp_path / "tok", bos_rule="none")
    (directory / "chat_template.jinja").write_text("B:{{ messages[0]['content'] }}")
    (directory / "additional_chat_templates").mkdir()
    (directory / "additional_chat_templates" / "tool_use.jinja").write_text(
        "C:{{ messages[0]['content'] }}{% if tools %}TOOLS{% endif %}")
    ours, theirs = load_hf_tokenizer(directory), transformers.AutoTokenizer.from_pretrained(directory)
    messages = [{"role": "user", "content": "hi"}]
    for kwargs in ({}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
                   {"chat_template": "tool_use"}, {"chat_template": "S:{{ messages|length }}"}):
        got = ours.apply_chat_template(messages, tokenize=False, **kwargs)
        assert got == theirs.apply_chat_template(messages, tokenize=False, **kwargs), kwargs
    assert ours.apply_chat_template(messages, tokenize=False) == "B:hi"


def test_an_eos_that_is_a_word_too_is_left_out_when_decoding_without_specials(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    directory = make_checkpoint(tmp_path / "tok", bos_rule="none")
    vocab = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab()
    word = min(k for k in vocab if k.isalpha() and len(k) >= 3)
    _edit(directory, config={"eos_token": word})
    ours, theirs = load_hf_tokenizer(directory), transformers.AutoTokenizer.from_pretrained(directory)
    ids = [vocab[word]] + ours.encode(" of France").tolist() + [vocab[word]]
    assert ours.eos_id == vocab[word]
    assert ours.decode(ids, skip_special=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids) == theirs.decode(ids)


@pytest.mark.parametrize("edit, match", [
    ({"config": {"split_special_tokens": True}}, "split_special_tokens"),
    ({"config": {"added_tokens_decoder": {"2": {"content": "<|im_start|>", "rstrip": True}}}},
     "'<\\|im_start\\|>' rstrip=True"),
    ({"config": {"additional_special_tokens": ["<tool>"]}}, r"special tokens \['<tool>'\]"),
    ({"config": {"pad_token": "<pad>"}}, r"special tokens \['<pad>'\]"),
    ({"config": {"add_prefix_space": True, "tokenizer_class": "GPT2Tokenizer"}},
     "add_prefix_space=True disagrees"),
    ({"config": {"added_tokens_decoder": {"3": {"content": "<|im_end|>", "normalized": True}}}},
     "'<\\|im_end\\|>' normalized=True"),
    ({"tokenizer": "bert"}, r"puts \['\[CLS\]'\] before a text and \['\[SEP\]'\] after it"),
])
def test_what_transformers_applies_and_ggmlopt_would_not_is_refused(tmp_path, edit, match):
    # each of these changes transformers' ids; read silently they were dropped
    from tokenizers import processors
    directory = make_checkpoint(tmp_path / "tok", bos_rule="none")
    if edit.get("tokenizer") == "bert":
        def bert(tk):
            tk.add_special_tokens(["[CLS]", "[SEP]"])
            tk.post_processor = processors.TemplateProcessing(
                single="[CLS] $A [SEP]", special_tokens=[
                    ("[CLS]", tk.token_to_id("[CLS]")), ("[SEP]", tk.token_to_id("[SEP]"))])
        _edit(directory, tokenizer=bert)
    else:
        _edit(directory, config=edit["config"])
    with pytest.raises(ValueError, match=match):
        load_hf_tokenizer(directory)


def test_settings_transformers_leaves_are_read(tmp_path):
    # add_prefix_space null (transformers 4 writes it) or under the generic class is
    # not applied by transformers: read; an extra special token is left out of a
    # decode without specials, as transformers leaves it
    transformers = pytest.importorskip("transformers")
    directory = make_checkpoint(tmp_path / "tok", bos_rule="none")
    base = json.loads((directory / "tokenizer_config.json").read_text())
    for config in ({"add_prefix_space": None}, {"add_prefix_space": True},
                   {"additional_special_tokens": ["<|im_start|>"], "add_prefix_space": None}):
        (directory / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
        assert json.loads((directory / "tokenizer_config.json").read_text()).keys() >= \
            config.keys()   # null written as null
        ours, theirs = load_hf_tokenizer(directory), transformers.AutoTokenizer.from_pretrained(directory)
        ids = ours.encode("<|im_start|>user hi").tolist()
        assert ids == theirs("<|im_start|>user hi", add_special_tokens=False)["input_ids"]
        assert ours.decode(ids, skip_special=True) == theirs.decode(ids, skip_special_tokens=True)


def test_a_bos_the_config_does_not_name_is_the_post_processor_s(tmp_path):
    # transformers adds the post-processor's <s> whether or not bos_token names it
    transformers = pytest.importorskip("transformers")
    directory = make_checkpoint(tmp_path / "tok", bos_rule="post-processor")
    _edit(directory, config={"bos_token": None})
    ours, theirs = load_hf_tokenizer(directory), transformers.AutoTokenizer.from_pretrained(directory)
    assert ours.add_bos and ours.bos_id == ours.token_to_id("<s>")
    assert theirs("hi")["input_ids"] == [ours.bos_id] + ours.encode("hi").tolist()


def test_a_checkpoint_s_generation_eos_ids_are_written_back_as_they_were(tmp_path):
    # transformers stops at generation_config.json's ids (the first its default pad):
    # save_hf of a checkpoint's own tokenizer keeps them, in their order
    from ggmlopt.io import save_hf
    from ggmlopt.models import Llama, LlamaConfig
    directory = make_checkpoint(tmp_path / "tok", bos_rule="none")
    tok = load_hf_tokenizer(directory)
    im_end, s = tok.token_to_id("<|im_end|>"), tok.token_to_id("</s>")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, s]}))
    tok = load_hf_tokenizer(directory)
    model = Llama(LlamaConfig(vocab_size=tok.vocab_size, dim=16, n_layers=1, n_heads=2,
                              max_seq_len=32))
    save_hf(model, tmp_path / "out", tokenizer=tok)
    written = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert written["eos_token_id"] == [im_end, s]
    assert load_hf_tokenizer(tmp_path / "out").eog_ids == tok.eog_ids
