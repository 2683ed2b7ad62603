"""TRL's SFTTrainer as the oracle of ggmlopt's supervised fine-tuning data: the
train_dataset it prepares (input_ids, labels; seq_lengths when packing) over a tiny
transformers model and a tokenizer of llama.cpp's vocabularies, against
from_texts / from_completions / from_chat's windows (ggmlopt's labels are the
next token's: label[t] = id[t + 1] where trained, -1 elsewhere)."""
import os
import random
import tempfile
import warnings

import numpy as np
import pytest
from llama_cpp_source import SRC, vocabulary

import ggmlopt as go
from ggmlopt.instruct import pack_examples

needs_llama_cpp = pytest.mark.skipif(not SRC, reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's "
                                     "source, as llama-cpp-python's sdist holds it) is not set")


def _trl():
    pytest.importorskip("trl")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bar()
    return datasets


def _template(name):
    """TRL's own copy of a model's chat template (its training variant: '_training')."""
    import trl
    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", f"{name}.jinja"),
              encoding="utf-8") as f:
        return f.read()


def _auto(tok, template, tmp_path):
    from test_sft_tokens_audit import _transformers_dir
    auto = _transformers_dir(tok, template, tmp_path)
    tok.chat_template = template
    return auto


def _prepared(auto, rows, **config):
    """SFTTrainer's train_dataset of rows, as lists of dicts."""
    datasets = _trl()
    import transformers
    from trl import SFTConfig, SFTTrainer
    transformers.logging.set_verbosity_error()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(auto), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1))
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = SFTConfig(output_dir=out, report_to="none", use_cpu=True, bf16=False, **config)
        trainer = SFTTrainer(model=model, args=args, processing_class=auto,
                             train_dataset=datasets.Dataset.from_list(rows))
        return [dict(r) for r in trainer.train_dataset]


def _documents(row):
    """TRL's row as its documents' (inputs, next-token labels) in ggmlopt's convention."""
    ids, labels = list(row["input_ids"]), list(row["labels"])
    docs, at = [], 0
    for n in row.get("seq_lengths") or [len(ids)]:
        docs.append((ids[at:at + n - 1], [-1 if t == -100 else t for t in labels[at + 1:at + n]]))
        at += n
    return docs


def _assert_rows_equal(prepared, x, y):
    """One TRL row a window: the same inputs and labels, the window's rest unlabelled."""
    x, y = np.asarray(x), np.asarray(y)
    assert x.shape[0] == len(prepared)
    for k, row in enumerate(prepared):
        (ids, labels), = _documents(row)
        n = len(ids)
        assert x[k, :n].tolist() == ids, k
        assert y[k, :n].tolist() == labels, k
        assert (y[k, n:] == -1).all(), k


TEXTS = ["Hello world, this is a test.", "Short", " leading space and trailing\n",
         "é 😀 <b>x</b>"]
PAIRS = [{"prompt": "Q: What is 2+2?\nA:", "completion": " 4"},
         {"prompt": "Translate: chat", "completion": " → cat é 😀"},
         {"prompt": "A: ", "completion": "Paris"}]   # TRL and ggmlopt both train 'ĠParis'
CONVERSATIONAL = [
    {"prompt": [{"role": "user", "content": "What is 2+2? é"}],
     "completion": [{"role": "assistant", "content": "It is 4."}]},
    {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Again?"}],
     "completion": [{"role": "assistant", "content": "Yes, again.\n"}]}]
CHATS = [{"messages": [{"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello."},
                       {"role": "user", "content": "Again? é 😀"},
                       {"role": "assistant", "content": "Yes.\n"}]},
         {"messages": [{"role": "user", "content": "2+2?"},
                       {"role": "assistant", "content": " 4 "}]}]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "went", "to", "sleep"]
SYSTEM = {"messages": [{"role": "system", "content": "Be terse."}] + CHATS[0]["messages"]}


@needs_llama_cpp
@pytest.mark.parametrize("name, template", [("qwen2", "qwen3"), ("llama-bpe", "llama3"),
                                            ("gemma-4", "gemma3")])
def test_text_and_prompt_completion_rows_are_sfttrainers(name, template, tmp_path):
    """Text rows (TRL appends the EOS, once; BOS where the tokenizer adds it),
    string pairs (the completion and its EOS trained) and conversational pairs
    (the template's turn end, no EOS added): the same ids and labels."""
    _trl()
    _, tok = vocabulary(name)
    auto = _auto(tok, _template(template), tmp_path)
    texts = [{"text": t} for t in TEXTS] + [{"text": "ends with its eos" + auto.eos_token}]
    _assert_rows_equal(_prepared(auto, texts, max_length=512),
                       *go.instruct.text_windows(texts, tok, 511))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the straddling token of 'A: ' + 'Paris'
        ours = go.instruct.completion_windows(PAIRS, tok, 511)
    _assert_rows_equal(_prepared(auto, PAIRS, max_length=512), *ours)
    _assert_rows_equal(_prepared(auto, CONVERSATIONAL, max_length=512),
                       *go.instruct.completion_windows(CONVERSATIONAL, tok, 511))


@needs_llama_cpp
@pytest.mark.parametrize("name, template", [("qwen2", "qwen3_training"),
                                            ("qwen2", "qwen2_5_training"),
                                            ("llama-bpe", "llama3_training"),
                                            ("llama-bpe", "llama3"),
                                            ("gemma-4", "gemma3_training"),
                                            ("gemma-4", "gemma3")])
def test_assistant_turns_are_sfttrainers_assistant_masks(name, template, tmp_path):
    """assistant_only_loss over TRL's {% generation %} templates (TRL swaps its
    training variant in for llama3 and gemma3) is from_chat's train_on='assistant'
    over the template itself; assistant_only_loss=False is train_on='all'."""
    _trl()
    _, tok = vocabulary(name)
    auto = _auto(tok, _template(template), tmp_path)
    chats = CHATS + ([SYSTEM] if name != "gemma-4" else [])   # Gemma's has no system role
    _assert_rows_equal(_prepared(auto, chats, max_length=512, assistant_only_loss=True),
                       *go.instruct.chat_windows(chats, tok, 511))
    _assert_rows_equal(_prepared(auto, chats, max_length=512),
                       *go.instruct.chat_windows(chats, tok, 511, train_on="all"))


@needs_llama_cpp
@pytest.mark.parametrize("length", [20, 28, 36])
def test_truncation_is_sfttrainers_keep_start(length, tmp_path):
    """TRL's max_length (keep_start, then the rows left with no label dropped) is
    too_long='truncate' with n_ctx = max_length - 1 (n_ctx inputs, and the last
    label's token)."""
    _trl()
    _, tok = vocabulary("llama-bpe")
    auto = _auto(tok, _template("llama3_training"), tmp_path)
    rnd = random.Random(length)
    words = WORDS

    def sentence(n):
        return " ".join(rnd.choice(words) for _ in range(n))
    texts = [{"text": sentence(n)} for n in (3, 40, 9, 25, 60)]
    pairs = [{"prompt": sentence(n), "completion": " " + sentence(m)}
             for n, m in ((3, 4), (30, 5), (12, 20), (50, 3))]
    chats = [{"messages": [{"role": "user", "content": sentence(8)},
                           {"role": "assistant", "content": sentence(6)},
                           {"role": "user", "content": "Again?"},
                           {"role": "assistant", "content": sentence(12)}]}]
    for rows, windows, config in [(texts, go.instruct.text_windows, {}),
                                  (pairs, go.instruct.completion_windows, {}),
                                  (chats, go.instruct.chat_windows,
                                   {"assistant_only_loss": True})]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the counts of rows cut and left out
            ours = windows(rows, tok, length - 1, too_long="truncate")
        _assert_rows_equal(_prepared(auto, rows, max_length=length, **config), *ours)


@needs_llama_cpp
def test_packing_holds_sfttrainers_documents_with_positions_restarted(tmp_path):
    """packing=True: each document's ids and labels as TRL's packed rows hold them
    (its seq_lengths), and its positions restarting at 0 (TRL's position_ids)."""
    _trl()
    _, tok = vocabulary("qwen2")
    auto = _auto(tok, _template("qwen3"), tmp_path)
    rnd = random.Random(0)
    words = WORDS
    texts = [{"text": " ".join(rnd.choice(words) for _ in range(n))}
             for n in (3, 40, 9, 25, 14, 7, 33, 2, 18)]
    prepared = _prepared(auto, texts, max_length=64, packing=True)
    theirs = sorted((tuple(a), tuple(b)) for row in prepared for a, b in _documents(row))
    ds = go.Dataset.from_texts(texts, tok, 63, packing=True)
    x, y = np.asarray(ds.data), np.asarray(ds.labels)
    ids = np.where(x < 0, -1 - x, x)
    documents, positions = np.asarray(ds.document_ids), np.asarray(ds.positions)
    ours = []
    for r in range(x.shape[0]):
        for d in np.unique(documents[r]):
            at = documents[r] == d
            if (y[r, at] >= 0).any():   # (the window's padding is a document of its own)
                assert positions[r, at].tolist() == list(range(at.sum()))
                ours.append((tuple(ids[r, at].tolist()), tuple(y[r, at].tolist())))
    assert sorted(ours) == theirs


def test_pack_examples_groups_as_trls_bfd():
    """The same examples share a window as in trl.pack_dataset(strategy='bfd'), ties
    included: of the windows with the least room that fits, the one that came to
    that room first (ggmlopt took the lowest-numbered window: 23 of these 300
    length sets grouped otherwise)."""
    datasets = _trl()
    from trl.data_utils import pack_dataset
    for seed in range(300):
        rnd = random.Random(seed)
        n_ctx = rnd.choice([8, 16, 32, 64])
        lengths = [rnd.randint(1, n_ctx) for _ in range(rnd.randint(1, 30))]
        packed = pack_dataset(datasets.Dataset.from_dict(
            {"input_ids": [[k] * n for k, n in enumerate(lengths)]}), n_ctx, "bfd")
        theirs = [sorted(set(row)) for row in packed["input_ids"]]
        assert pack_examples(lengths, n_ctx) == theirs, (seed, lengths)
