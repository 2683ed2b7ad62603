"""Every chat template of llama.cpp's models/templates rendered by ggmlopt as
transformers renders it, character for character (or refused where transformers
refuses): system prompts, generation prompts, several turns, tool calls and a
tools list, continue_final_message, content blocks, non-ASCII and whitespace at
the edges; what transformers' apply_chat_template does around the template
(an empty conversation, tools given as functions, numpy values, the special
tokens it binds); and from_chat's labels on the assistant turns of a few."""
import copy
import glob
import json
import os
import warnings

import numpy as np
import pytest
from finetune_files import labelled_runs

import ggmlopt as go
from ggmlopt.chat_template import ChatTemplate
from ggmlopt.text import ByteTokenizer

pytest.importorskip("jinja2")


def _templates_folder():
    src = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
    return os.path.join(src, "models", "templates") if src else None


def _llama_cpp_templates():
    folder = _templates_folder()
    return sorted(glob.glob(os.path.join(folder, "*.jinja"))) if folder else []


needs_llama_cpp = pytest.mark.skipif(
    not _llama_cpp_templates(),
    reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source, as llama-cpp-python's sdist holds it) "
           "is not set")

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
SYSTEM = {"role": "system", "content": "You are terse."}


def _user(text="What is 2+2?"):
    return {"role": "user", "content": text}


def _assistant(text="4"):
    return {"role": "assistant", "content": text}


def _parts(text):
    return [{"type": "text", "text": text}]


CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call12345", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
CALL_JSON = {"role": "assistant", "tool_calls": [
    {"id": "call12345", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
TOOL = {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
        "content": "Sunny, 21C"}

CASES = {
    "system-user-assistant": ([SYSTEM, _user(), _assistant()], {}),
    "user": ([_user()], {}),
    "three-turns": ([_user("a?"), _assistant("1"), _user("b?"), _assistant("2"),
                     _user("c?"), _assistant("3")], {}),
    "three-turns-system": ([SYSTEM, _user("a?"), _assistant("1"), _user("b?"),
                            _assistant("2"), _user("c?"), _assistant("3")], {}),
    "no-system-open": ([_user("a?"), _assistant("1"), _user("b?")], {}),
    "tool-call": ([_user("Weather in Paris?"), CALL, TOOL, _assistant("Sunny.")],
                  {"tools": TOOLS}),
    "tool-call-json": ([SYSTEM, _user("Weather in Paris?"), CALL_JSON, TOOL],
                       {"tools": TOOLS}),
    "tools-listed": ([_user("Weather in Paris?")], {"tools": TOOLS}),
    "content-blocks": ([{"role": "system", "content": _parts("Sys.")},
                        {"role": "user", "content": _parts("A") + _parts("B")},
                        {"role": "assistant", "content": _parts("Hello")}], {}),
    "non-ascii": ([{"role": "system", "content": "Réponds — 日本語 🙂"}, _user("  héllo\n世界  "),
                   _assistant("\nÀ bientôt 👋\n")], {}),
    "empty": ([_user(""), _assistant("")], {}),
    "whitespace": ([_user(" "), _assistant(" \n "), _user("\n\nx\n\n"), _assistant("  y  ")], {}),
    "reasoning": ([_user("q"), {**_assistant("ans"), "reasoning_content": "thought"},
                   _user("q2"), {**_assistant("ans2"), "reasoning_content": "thought2"}], {}),
    "thinking-off": ([_user("q")], {"enable_thinking": False}),
    "documents": ([_user("Summarise.")], {"documents": [{"title": "T1", "text": "Doc one."}]}),
}
CONTINUED = {
    "continue": [_user(), _assistant("The answer is")],
    "continue-space": [_user(), _assistant("The answer is ")],
    "continue-blocks": [_user(), {"role": "assistant", "content": _parts("The answer")}],
}


def _transformers(source, messages, add_generation_prompt, kwargs, continued=False):
    from transformers.utils.chat_template_utils import render_jinja_template
    kwargs = dict(kwargs)
    rendered, _ = render_jinja_template(
        [copy.deepcopy(messages)], tools=kwargs.pop("tools", None),
        documents=kwargs.pop("documents", None), chat_template=source,
        add_generation_prompt=add_generation_prompt, continue_final_message=continued,
        **SPECIAL, **kwargs)
    return rendered[0]


def _outcome(render, *args):
    try:
        return "text", render(*args)
    except Exception as e:  # noqa: BLE001  any refusal: only that both refuse is compared
        return "refused", f"{type(e).__name__}: {e}"


@needs_llama_cpp
@pytest.mark.parametrize("path", _llama_cpp_templates(), ids=os.path.basename)
def test_every_llama_cpp_template_renders_as_transformers(path):
    pytest.importorskip("transformers")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    t = ChatTemplate(source, special_tokens=SPECIAL)

    def ours(messages, gen, kwargs, continued=False):
        extra = {"continue_final_message": continued} if continued else {}
        return t.render(copy.deepcopy(messages), gen, **kwargs, **extra)

    runs = [(name, m, gen, kw, False) for name, (m, kw) in CASES.items() for gen in (False, True)]
    runs += [(name, m, False, {}, True) for name, m in CONTINUED.items()]
    runs += [("continue-reasoning", [_user(), {**_assistant("x"), "reasoning_content": "Hm"}],
              False, {}, "reasoning_content")]
    for name, messages, gen, kwargs, continued in runs:
        want = _outcome(_transformers, source, messages, gen, kwargs, continued)
        got = _outcome(ours, messages, gen, kwargs, continued)
        assert got[0] == want[0], (name, gen, want, got)
        if want[0] == "text":
            assert got[1] == want[1], (name, gen)


# ---- what apply_chat_template does around the template ----------------------------------

def test_an_empty_conversation_is_refused_as_transformers_refuses_it():
    # transformers: "Cannot apply chat template to an empty conversation"; rendered,
    # it would be the template's preamble alone (a BOS, a default system prompt)
    tok = ByteTokenizer(chat_template="{{ eos_token }}{% for m in messages %}{{ m.content }}"
                                      "{% endfor %}")
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([], tokenize=False)
    assert tok.apply_chat_template([_user("hi")], tokenize=False) == "<|endoftext|>hi"


def get_weather(city: str):
    """The weather of a city.

    Args:
        city: The city.
    """
    return "sunny"


@needs_llama_cpp
def test_tools_given_as_functions_are_refused_not_rendered_without_their_names():
    # transformers turns a function into its JSON schema; a template reading
    # tool.name of the function itself would write an empty name (Qwen3-Coder)
    with open(os.path.join(_templates_folder(), "Qwen3-Coder.jinja"), encoding="utf-8") as f:
        t = ChatTemplate(f.read(), special_tokens=SPECIAL)
    assert "<name>get_weather</name>" in t.render([_user()], True, tools=TOOLS)
    with pytest.raises(TypeError, match=r"tools\[0\]: expected a JSON schema"):
        t.render([_user()], True, tools=[get_weather])
    with pytest.raises(TypeError, match=r"documents\[0\]: expected a dict"):
        t.render([_user()], True, documents=["a text"])


@needs_llama_cpp
def test_numpy_values_are_the_python_values_transformers_hands_the_template():
    # a dataset column read through numpy/pandas: np.False_ "is false" for the
    # template as transformers' plain copy of the inputs makes it
    pytest.importorskip("transformers")
    with open(os.path.join(_templates_folder(), "Qwen-Qwen3-0.6B.jinja"), encoding="utf-8") as f:
        source = f.read()
    t = ChatTemplate(source, special_tokens=SPECIAL)
    messages = [{"role": "user", "content": np.str_("hi")},
                {"role": "assistant", "content": "ok", "weight": np.int64(1)}, _user("again")]
    want = _transformers(source, messages, True, {"enable_thinking": np.bool_(False)})
    assert want.endswith("<think>\n\n</think>\n\n")
    assert t.render(messages, True, enable_thinking=np.bool_(False)) == want


def test_the_special_tokens_bound_are_transformers_special_tokens_map(tmp_path):
    # sep/cls/mask tokens and a config's model-specific ones (image_token, ...)
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from ggmlopt.hf_tokenizer import load_hf_tokenizer
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<unk>", "<pad>", "<sep>", "<cls>", "<mask>", "<image>", "<boi>"]
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tk.save(str(tmp_path / "tokenizer.json"))
    names = ["bos", "eos", "unk", "pad", "sep", "cls", "mask", "image", "boi"]
    template = "".join("{{ " + n + "_token }}|" for n in names) + \
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
              "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
              "sep_token": "<sep>", "cls_token": "<cls>", "mask_token": "<mask>",
              "image_token": "<image>", "extra_special_tokens": {"boi_token": "<boi>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = load_hf_tokenizer(tmp_path)
    assert ours.special_tokens_map == theirs.special_tokens_map
    chat = [_user("hi")]
    assert ours.apply_chat_template(chat, tokenize=False) == \
        theirs.apply_chat_template(chat, tokenize=False) == "|".join(specials) + "|hi"


# ---- from_chat's labels: each assistant turn's content and its end of turn -----------

TURNS = [SYSTEM, _user("a?"), _assistant("one"), _user("b?"), _assistant("À bientôt 👋"),
         _user("c?"), _assistant("three")]


@needs_llama_cpp
@pytest.mark.parametrize("template, vocab, system, ends", [
    ("meta-llama-Llama-3.1-8B-Instruct", "llama-bpe", True, ["<|eot_id|>"] * 3),
    ("meta-llama-Llama-3.2-3B-Instruct", "llama-bpe", True, ["<|eot_id|>"] * 3),
    ("Qwen-Qwen2.5-7B-Instruct", "qwen2", True, ["<|im_end|>\n"] * 3),
    ("HuggingFaceTB-SmolLM3-3B", "qwen2", True, ["<|im_end|>\n"] * 3),
    ("Mistral-Small-3.2-24B-Instruct-2506", "llama-spm", True, ["</s>"] * 3),
    ("mistralai-Mistral-Nemo-Instruct-2407", "llama-spm", False, ["</s>"] * 3),
    ("microsoft-Phi-3.5-mini-instruct", "phi-3", True, ["<|end|>"] * 2 + ["<|end|><|endoftext|>"]),
    ("google-gemma-2-2b-it", "gemma-4", False, ["<end_of_turn>\n"] * 3),
])
def test_from_chat_labels_each_answer_and_its_end_of_turn(template, vocab, system, ends):
    # (Mistral Nemo writes a system prompt into the last user message only, and
    # Gemma 2 refuses one: those chats start at the user)
    pytest.importorskip("tokenizers")
    from ggmlopt.io import load_gguf_tokenizer
    models = os.path.dirname(_templates_folder())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = load_gguf_tokenizer(os.path.join(models, f"ggml-vocab-{vocab}.gguf"))
    with open(os.path.join(_templates_folder(), template + ".jinja"), encoding="utf-8") as f:
        tok.chat_template = f.read()
    chat = TURNS if system else TURNS[1:]
    _, y = go.instruct.chat_windows([chat], tok, 1024)
    answers = [m["content"] for m in chat if m["role"] == "assistant"]
    assert labelled_runs(tok, y[0]) == [a + e for a, e in zip(answers, ends)]


def _nemo_tokenizer():
    from ggmlopt.io import load_gguf_tokenizer
    models = os.path.dirname(_templates_folder())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = load_gguf_tokenizer(os.path.join(models, "ggml-vocab-llama-spm.gguf"))
    name = "mistralai-Mistral-Nemo-Instruct-2407.jinja"
    with open(os.path.join(_templates_folder(), name), encoding="utf-8") as f:
        tok.chat_template = f.read()
    return tok


@needs_llama_cpp
def test_from_chat_finds_the_answers_when_the_tools_move_to_the_last_user_message():
    # Mistral Nemo writes the tools before the last user message: a turn renders
    # otherwise when more follow, and each answer is found in the order of the
    # messages; two equal answers stay each in its own turn (labelled_runs: one
    # run a turn)
    pytest.importorskip("tokenizers")
    tok = _nemo_tokenizer()
    chat = TURNS[1:3] + [_user("b?"), _assistant("one"), _user("c?"), _assistant("three")]
    text = tok.apply_chat_template(chat, tools=TOOLS, tokenize=False)
    assert text.index("[AVAILABLE_TOOLS]") > text.rindex("one</s>")
    for train_on, answers in (("assistant", ["one", "one", "three"]), ("last", ["three"])):
        _, y = go.instruct.chat_windows([chat], tok, 512, train_on=train_on, tools=TOOLS)
        assert labelled_runs(tok, y[0]) == [a + "</s>" for a in answers]


@needs_llama_cpp
@pytest.mark.parametrize("train_on", ["assistant", "last", "all"])
def test_from_chat_refuses_a_system_message_the_template_leaves_out(train_on):
    # Mistral Nemo writes the system prompt into the last message only when that
    # is the user's: a conversation ending with an answer renders without it
    pytest.importorskip("tokenizers")
    tok = _nemo_tokenizer()
    assert SYSTEM["content"] not in tok.apply_chat_template(TURNS, tokenize=False)
    with pytest.raises(ValueError, match=r"conversations\[0\]: the chat template leaves the "
                                         r"system message out"):
        go.instruct.chat_windows([TURNS], tok, 512, train_on=train_on)
