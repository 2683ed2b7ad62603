"""TRL's conversational prompt/completion rows ({"prompt": [messages], "completion":
[messages]}) as SFTTrainer tokenizes them (trl/trainer/sft_trainer.py, tokenize_fn):
the ids of apply_chat_template(prompt + completion), the loss on those after
apply_chat_template(prompt, add_generation_prompt=True), each with the row's tools
and chat_template_kwargs; checked against transformers on llama.cpp's vocabularies
and templates, through read_jsonl and the finetune command, and the rows refused."""
import json
import os
import warnings

import numpy as np
import pytest
from finetune_files import CHATML, QUESTIONS, labelled_runs, write_files
from llama_cpp_source import MODELS, SRC, vocabulary

import ggmlopt as go
from ggmlopt import finetune
from ggmlopt.datasets import read_jsonl
from ggmlopt.text import ByteTokenizer

pytest.importorskip("jinja2")

needs_llama_cpp = pytest.mark.skipif(not SRC, reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's "
                                     "source, as llama-cpp-python's sdist holds it) is not set")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2+2? é 😀"}],
     "completion": [{"role": "assistant", "content": "It is 4."}]},
    {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": " Again?"}],
     "completion": [{"role": "assistant", "content": "Yes, again.\n"}]},
]
SYSTEM_ROW = {"prompt": [{"role": "system", "content": "Be terse."},
                         {"role": "user", "content": "Capital of France?"}],
              "completion": [{"role": "assistant", "content": "Paris."}]}
TOOL_ROW = {"prompt": [{"role": "user", "content": "Weather in Paris?"}],
            "completion": [{"role": "assistant", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "Sunny, 21C"},
                {"role": "assistant", "content": "Sunny."}],
            "tools": TOOLS}
THINK_ROW = {**SYSTEM_ROW, "chat_template_kwargs": {"enable_thinking": False}}


def _template(name):
    with open(os.path.join(MODELS, "templates", f"{name}.jinja"), encoding="utf-8") as f:
        return f.read()


def _transformers(name, tok, template, tmp_path):
    """transformers' tokenizer of llama.cpp's vocabulary name with template: its own
    GGUF converter where it reads the file, else the files ggmlopt's save_hf writes
    (Gemma 4's GGUF it cannot read; Phi-3's converter drops the special tokens' rstrip)."""
    transformers = pytest.importorskip("transformers")
    if name in ("qwen2", "llama-bpe"):
        pytest.importorskip("gguf")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            auto = transformers.AutoTokenizer.from_pretrained(
                MODELS, gguf_file=f"ggml-vocab-{name}.gguf")
        auto.chat_template = template
        return auto
    from test_sft_tokens_audit import _transformers_dir
    return _transformers_dir(tok, template, tmp_path)


def _ids(out):
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def _trl(auto, row):
    """(input_ids, completion_mask) of row as TRL's SFTTrainer computes them."""
    kwargs = {"tools": row.get("tools"), **row.get("chat_template_kwargs", {})}
    prompt_ids = _ids(auto.apply_chat_template(row["prompt"], tokenize=True,
                                               add_generation_prompt=True, **kwargs))
    ids = _ids(auto.apply_chat_template(row["prompt"] + row["completion"], tokenize=True,
                                        **kwargs))
    assert ids[:len(prompt_ids)] == prompt_ids   # TRL's check: no mismatch warning
    return ids, [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))


def _ours(tok, x, y, want):
    """The ids of a window (its inputs and its last label's token) as many as
    want's, and which are trained on, less the BOS ggmlopt puts first where the
    template writes none (transformers' apply_chat_template adds none; chat_windows'
    rule)."""
    n = len(want)
    n_ours = n + (1 if tok.add_bos and want[0] != tok.bos_id else 0)
    ids = x[:n_ours - 1].tolist() + [int(y[n_ours - 2])]
    trained = [0] + [int(t >= 0) for t in y[:n_ours - 1]]
    # every label is the next input (or, last, the token TRL's ids end with)
    assert all(int(y[t]) in (-1, ids[t + 1]) for t in range(n_ours - 1))
    assert (y[n_ours - 1:] == -1).all()
    return (ids[1:], trained[1:]) if n_ours > n else (ids, trained)


CASES = [("qwen2", "chatml", [SYSTEM_ROW]),
         ("qwen2", "Qwen-Qwen3-0.6B", [SYSTEM_ROW, THINK_ROW]),
         ("qwen2", "Qwen-Qwen2.5-7B-Instruct", [SYSTEM_ROW, TOOL_ROW]),
         ("llama-bpe", "meta-llama-Llama-3.1-8B-Instruct", [SYSTEM_ROW, TOOL_ROW]),
         ("llama-bpe", "meta-llama-Llama-3.2-3B-Instruct", [SYSTEM_ROW]),
         ("gemma-4", "google-gemma-2-2b-it", []),   # Gemma 3's turns; no system role
         ("phi-3", "microsoft-Phi-3.5-mini-instruct", [SYSTEM_ROW])]


@needs_llama_cpp
@pytest.mark.parametrize("name, template_name, extra", CASES,
                         ids=[f"{t}-{n}" for n, t, _ in CASES])
def test_ids_and_labels_are_trls(name, template_name, extra, tmp_path):
    pytest.importorskip("tokenizers")
    _, tok = vocabulary(name)
    template = CHATML if template_name == "chatml" else _template(template_name)
    auto = _transformers(name, tok, template, tmp_path)
    tok.chat_template = template
    rows = ROWS + extra
    ds = go.Dataset.from_completions(rows, tok, 512)
    x, y = np.asarray(ds.data), np.asarray(ds.labels)
    for k, row in enumerate(rows):
        want_ids, want_mask = _trl(auto, row)
        ids, trained = _ours(tok, x[k], y[k], want_ids)
        assert ids == want_ids, k
        assert trained == want_mask, k
    # packed, several rows a window, with a string pair among them: the same
    # labelled runs (each row's, restarted at its own first token)
    packed = go.Dataset.from_completions(rows + [("Q: hi", " A: yes")], tok, 512, packing=True)
    alone = go.Dataset.from_completions(rows + [("Q: hi", " A: yes")], tok, 512)

    def runs(labels):
        return sorted(run for row in np.asarray(labels) for run in labelled_runs(tok, row))
    assert packed.ndata < alone.ndata
    assert runs(packed.labels) == runs(alone.labels)


@needs_llama_cpp
@pytest.mark.parametrize("name, template_name", [
    ("gemma-4", "google-gemma-4-31B-it"),
    ("llama-bpe", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B"),
    ("qwen2", "Qwen-QwQ-32B")])
def test_a_prompt_that_is_not_the_start_of_the_whole_is_refused(name, template_name,
                                                                tmp_path):
    """A generation prompt the finished turn does not begin with (an empty thought
    channel, an open '<think>'): TRL warns and masks the first len(prompt ids) all
    the same, which leaves the answer's first tokens out (or all of them)."""
    pytest.importorskip("tokenizers")
    _, tok = vocabulary(name)
    template = _template(template_name)
    auto = _transformers(name, tok, template, tmp_path)
    tok.chat_template = template
    row = ROWS[1]
    prompt_ids = _ids(auto.apply_chat_template(row["prompt"], tokenize=True,
                                               add_generation_prompt=True))
    ids = _ids(auto.apply_chat_template(row["prompt"] + row["completion"], tokenize=True))
    assert ids[:len(prompt_ids)] != prompt_ids
    assert not auto.decode(ids[len(prompt_ids):]).startswith("Yes, again.")
    with pytest.raises(ValueError, match=r"pairs\[1\]: the prompt's ids .*\(Dataset.from_chat\)"):
        go.Dataset.from_completions([("a", "b"), row],
                                    tok, 512)


def test_one_answer_is_labelled_as_from_chat_labels_its_last_turn():
    tok = ByteTokenizer(chat_template=CHATML)
    row = {"prompt": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."},
                      {"role": "user", "content": "R?"}],
           "completion": [{"role": "assistant", "content": "B."}]}
    x, y = go.instruct.completion_windows([row], tok, 128, add_eos=True)
    cx, cy = go.instruct.chat_windows([row["prompt"] + row["completion"]], tok, 128,
                                      train_on="last")
    np.testing.assert_array_equal(x, cx)
    np.testing.assert_array_equal(y, cy)
    # the template writes the turn's end: add_eos adds nothing to a conversational row
    assert labelled_runs(tok, y[0]) == ["B.<|endoftext|>\n"]


def test_too_long_rows_are_cut_dropped_or_named():
    tok = ByteTokenizer(chat_template=CHATML)
    long = {"prompt": [{"role": "user", "content": "Q"}],
            "completion": [{"role": "assistant", "content": "x" * 100}]}
    with pytest.raises(ValueError, match=r"pairs\[1\]: \d+ tokens, more than n_ctx"):
        go.Dataset.from_completions([ROWS[0], long], tok, 80)
    with pytest.warns(UserWarning, match="1 of 2 examples are longer"):
        ds = go.Dataset.from_completions([ROWS[0], long], tok, 80, too_long="drop")
    assert ds.ndata == 1
    with pytest.warns(UserWarning, match="cut to that length"):
        ds = go.Dataset.from_completions([ROWS[0], long], tok, 80, too_long="truncate")
    # the first n_ctx + 1 bytes kept: the completion's first of them trained on
    head = tok.apply_chat_template(long["prompt"], add_generation_prompt=True, tokenize=False)
    assert labelled_runs(tok, np.asarray(ds.labels)[1]) == ["x" * (80 + 1 - len(head))]


@pytest.mark.parametrize("bad, error, match", [
    ({"prompt": [{"role": "user", "content": "Q"}], "completion": "A"}, TypeError,
     r"pairs\[1\]: prompt and completion must both be str, or both lists of messages"),
    ({"prompt": [{"role": "user", "content": "Q"}], "completion": []}, ValueError,
     r"pairs\[1\]: the completion is an empty list of messages"),
    ({"prompt": [], "completion": [{"role": "assistant", "content": "A"}]}, ValueError,
     r"pairs\[1\]: the prompt is an empty list of messages"),
    ({"prompt": [{"role": "user", "content": "Q"}, "hi"],
      "completion": [{"role": "assistant", "content": "A"}]}, TypeError,
     r"pairs\[1\] prompt\[1\]: expected a dict"),
    ({"prompt": [{"role": "user", "content": "Q"}],
      "completion": [{"role": "assistant", "content": "A"}], "tools": "get_weather"},
     ValueError, r"pairs\[1\]: 'tools' is a string that is not JSON"),
    ({"prompt": [{"role": "user", "content": "Q"}],
      "completion": [{"role": "assistant", "content": "A"}], "tools": 3},
     TypeError, r"pairs\[1\]: 'tools' must be a list"),
])
def test_bad_rows_are_refused_naming_the_row(bad, error, match):
    tok = ByteTokenizer(chat_template=CHATML)
    with pytest.raises(error, match=match):
        go.Dataset.from_completions([ROWS[0], bad], tok, 128)


def test_a_tokenizer_without_a_chat_template_is_refused():
    with pytest.raises(ValueError, match=r"pairs\[0\]: .*the tokenizer's chat template, and "
                                         "it has none"):
        go.Dataset.from_completions(ROWS, ByteTokenizer(), 128)


def test_read_jsonl_reads_the_rows_and_names_a_bad_line(tmp_path):
    path = tmp_path / "pc.jsonl"
    rows = [*ROWS, {"prompt": "Q: a", "completion": " b"}]   # string pairs may be mixed in
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert read_jsonl(path) == rows
    for bad, match in [({"prompt": [{"role": "user", "content": "Q"}], "completion": "A"},
                        "'prompt' and 'completion' must both be strings, or both non-empty lists"),
                       ({"prompt": [{"role": "user", "content": "Q"}], "completion": []},
                        "'completion' must be a non-empty list"),
                       ({"prompt": [{"role": "user", "content": "Q"}, 3],
                         "completion": [{"role": "assistant", "content": "A"}]},
                        "prompt message 1 must be an object with a str 'role'")]:
        path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(bad) + "\n", encoding="utf-8")
        with pytest.raises(ValueError, match=f"pc.jsonl:2: {match}"):
            read_jsonl(path)


@pytest.fixture
def files(tmp_path):
    pytest.importorskip("gguf")
    folder = write_files(tmp_path)
    with open(folder / "pc.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": [{"role": "user", "content": q}],
                                 "completion": [{"role": "assistant", "content": "Quimby."}]})
                     + "\n" for q in QUESTIONS * 3)
    return folder


def test_the_command_trains_on_conversational_pairs(files):
    from ggmlopt.io import load_gguf
    base, tok = load_gguf(files / "base.gguf")
    args = finetune.parser().parse_args(["-m", "m.gguf", "--data", str(files / "pc.jsonl"),
                                         "-c", "96", "--batch", "8"])
    ds, _ = finetune._dataset(args, tok)
    y = np.asarray(ds.labels)
    assert [labelled_runs(tok, row) for row in y[:15]] == [["Quimby.<|endoftext|>\n"]] * 15
    assert finetune.main(["-m", str(files / "base.gguf"), "--data", str(files / "pc.jsonl"),
                          "--full", "-c", "96", "--batch", "8", "-lr", "3e-3", "--epochs", "60",
                          "--merge-out", str(files / "tuned.gguf"), "--out-type", "f32",
                          "--silent"]) == 0
    tuned, _ = load_gguf(files / "tuned.gguf")
    prompt = [{"role": "user", "content": QUESTIONS[0]}]
    assert go.chat(base, tok, prompt, 20, temperature=0) != "Quimby."
    assert go.chat(tuned, tok, prompt, 20, temperature=0) == "Quimby."


def test_the_commands_template_variables_render_the_rows(files):
    # a variable the template reads: the command's for every row, a row's own wins
    tok = ByteTokenizer(chat_template="{% if greeting is defined %}{{ greeting }}{% endif %}"
                        + CHATML)
    rows = [{"prompt": [{"role": "user", "content": "Q"}],
             "completion": [{"role": "assistant", "content": "A"}]}]
    rows.append({**rows[0], "chat_template_kwargs": {"greeting": "Yo"}})
    (files / "vars.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = finetune.parser().parse_args(["-m", "m.gguf", "--data", str(files / "vars.jsonl"),
                                         "-c", "64", "--batch", "2",
                                         "--chat-template-kwargs", '{"greeting": "Hi"}'])
    ds, _ = finetune._dataset(args, tok)
    x = np.asarray(ds.data)
    assert [bytes(x[r][:2].astype(np.uint8)) for r in range(2)] == [b"Hi", b"Yo"]
    # string pairs alone are not rendered by a template: the option is refused there
    (files / "s.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    args.data = str(files / "s.jsonl")
    with pytest.raises(ValueError, match="--chat-template-kwargs: renders the conversations"):
        finetune._dataset(args, tok)
