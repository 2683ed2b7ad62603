"""Supervised fine-tuning data: chat templates rendered as transformers renders
them, assistant-only labels exact for every turn, prompt/completion pairs, JSONL
files, and ggmlopt.chat answering with what it was taught."""
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

# SmolLM2's ChatML (with its default system prompt left out)
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# a template that ends each assistant turn with the eos token and marks it for TRL
MARKED = ("{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}"
          "{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
          "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
          "{% if add_generation_prompt %}assistant: {% endif %}")
UNMARKED = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# only the answer in the block (the form of transformers' docs, NeMo's Llama 3.1 template)
MARKED_CONTENT = ("{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}"
                  "{% generation %}{{ m['content'] }}{% endgeneration %}{{ eos_token }}"
                  "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}")

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": "6, é"}],
]
# the answers' text also in the user's turns, before them
ECHOED = [{"role": "user", "content": "Reply with OK"}, {"role": "assistant", "content": "OK"},
          {"role": "user", "content": "Again, OK?"}, {"role": "assistant", "content": "OK"}]


def test_chatml_renders_as_written():
    tok = ByteTokenizer(chat_template=CHATML)
    text = tok.apply_chat_template(CONVERSATIONS[0], tokenize=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    prompt = tok.apply_chat_template(CONVERSATIONS[0][:1], add_generation_prompt=True,
                                     tokenize=False)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(CONVERSATIONS[0][:1], add_generation_prompt=True)
    assert ids.dtype == np.int32 and tok.decode(ids) == prompt


@pytest.mark.parametrize("option, value", [("sanitize_control_tokens", True),
                                           ("truncation", True), ("max_length", 5),
                                           ("padding", "max_length"), ("return_dict", True),
                                           ("return_assistant_tokens_mask", True),
                                           ("return_tensors", "pt"),
                                           ("tokenizer_kwargs", {"add_special_tokens": True})])
def test_transformers_tokenizer_options_are_refused_not_dropped(option, value):
    # passed on as template variables, the template would never read them: a user
    # asking transformers' tokenizer for sanitised or truncated ids got neither
    tok = ByteTokenizer(chat_template=CHATML)
    with pytest.raises(ValueError, match=rf"^{option}={value!r}: transformers' tokenizer "
                                         r"option is not supported"):
        tok.apply_chat_template(CONVERSATIONS[0], **{option: value})


def test_transformers_tokenizer_options_asking_for_what_comes_back_pass():
    tok = ByteTokenizer(chat_template=CHATML)
    want = tok.apply_chat_template(CONVERSATIONS[0])
    got = tok.apply_chat_template(CONVERSATIONS[0], sanitize_control_tokens=False,
                                  truncation=False, max_length=None, padding=False,
                                  return_dict=False, return_assistant_tokens_mask=False,
                                  return_tensors="np", tokenizer_kwargs={})
    np.testing.assert_array_equal(got, want)


def test_template_environment_is_transformers():
    t = ChatTemplate("{{ messages[0]['content'] | tojson }}{{ raise_exception('no') "
                     "if messages|length > 1 }}")
    assert t.render([{"role": "user", "content": "<é>"}]) == '"<é>"'   # no HTML escaping
    with pytest.raises(ValueError, match="refuses them: no"):
        t.render(CONVERSATIONS[0])
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for %}").render([])
    sandboxed = ChatTemplate("{{ ''.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|access"):
        sandboxed.render([])
    with pytest.raises(ValueError, match="has no chat_template"):
        ByteTokenizer().apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(TypeError, match="messages"):
        ChatTemplate(CHATML).render("hi")


def _transformers_render(source, messages, add_generation_prompt, **special):
    from transformers.utils.chat_template_utils import render_jinja_template
    rendered, spans = render_jinja_template([messages], chat_template=source,
                                            add_generation_prompt=add_generation_prompt,
                                            return_assistant_tokens_mask=True, **special)
    return rendered[0], [tuple(s) for s in spans[0]]


def test_generation_spans_are_the_answers_not_earlier_copies_of_their_text():
    t = ChatTemplate(MARKED_CONTENT, special_tokens={"eos_token": "</s>"})
    text, spans = t.render_spans(ECHOED)
    assert text.count("OK") == 4
    answers = [i + len("assistant: ") for i in range(len(text))
               if text.startswith("assistant: ", i)]
    assert len(answers) == 2 and spans == [(a, a + 2) for a in answers]
    # a block rendered in a macro reaches the output elsewhere: refused, not guessed
    macro = ChatTemplate("{% macro turn(m) %}{{ m['role'] }}: {% generation %}"
                         "{{ m['content'] }}{% endgeneration %}\n{% endmacro %}"
                         "{% for m in messages %}{{ turn(m) }}{% endfor %}")
    assert macro.render(ECHOED).startswith("user: Reply with OK")
    with pytest.raises(ValueError, match="generation %} blocks elsewhere"):
        macro.render_spans(ECHOED)


@pytest.mark.parametrize("source", [CHATML, MARKED, MARKED_CONTENT])
@pytest.mark.parametrize("gen", [False, True])
def test_renderings_equal_transformers(source, gen):
    pytest.importorskip("transformers")
    special = {"eos_token": "</s>", "bos_token": "<s>"}
    for messages in [*CONVERSATIONS, ECHOED]:
        want, want_spans = _transformers_render(source, messages, gen, **special)
        t = ChatTemplate(source, special_tokens=special)
        assert t.render(messages, gen) == want
        assert t.render_spans(messages, gen) == (want, want_spans)


def _llama_cpp_templates():
    src = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
    if not src:
        return []
    folder = os.path.join(src, "models", "templates")
    names = ["HuggingFaceTB-SmolLM3-3B", "meta-llama-Llama-3.1-8B-Instruct",
             "meta-llama-Llama-3.2-3B-Instruct", "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B",
             "google-gemma-2-2b-it", "microsoft-Phi-3.5-mini-instruct",
             "mistralai-Mistral-Nemo-Instruct-2407"]
    return [os.path.join(folder, n + ".jinja") for n in names
            if os.path.isfile(os.path.join(folder, n + ".jinja"))]


@pytest.mark.skipif(not _llama_cpp_templates(),
                    reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source, as llama-cpp-python's "
                           "sdist holds it) is not set")
@pytest.mark.parametrize("path", _llama_cpp_templates(), ids=os.path.basename)
def test_model_templates_equal_transformers(path):
    pytest.importorskip("transformers")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    t = ChatTemplate(source, special_tokens=special)
    user_only = [m for m in CONVERSATIONS[1] if m["role"] != "system"]
    for messages in (CONVERSATIONS[0], CONVERSATIONS[1], user_only):
        for gen in (False, True):
            try:
                want, _ = _transformers_render(source, messages, gen, **special)
            except Exception as e:  # noqa: BLE001  the template refuses (Gemma: no system)
                with pytest.raises(ValueError, match=f"refuses them: {e}"):
                    t.render(messages, gen)
                continue
            assert t.render(messages, gen) == want


# ---- assistant-only labels --------------------------------------------------------------

def _labelled_text(tok, x, y):
    """The text of the labels of each row (the trained tokens), as str."""
    out = []
    for row_x, row_y in zip(x, y):
        out.append(tok.decode(row_y[row_y >= 0]))
    return out


@pytest.mark.parametrize("source", [CHATML, UNMARKED, MARKED])
def test_labels_cover_exactly_the_assistant_turns(source):
    tok = ByteTokenizer(chat_template=source)
    ds = go.Dataset.from_chat(CONVERSATIONS, tok, 200)
    x, y = np.asarray(ds.data), np.asarray(ds.labels)
    assert x.shape == (2, 200) and x.dtype == np.int32 and y.dtype == np.int32
    end = "<|im_end|>\n" if source == CHATML else "<|endoftext|>"
    got = _labelled_text(tok, x, y)
    assert got == [f"Hello!{end}", f"4{end}6, é{end}"]
    # labels are the next tokens of the rendered conversation, inputs all but its last
    full = tok.apply_chat_template(CONVERSATIONS[1])
    n = full.size - 1
    np.testing.assert_array_equal(x[1, :n], full[:-1])
    np.testing.assert_array_equal(y[1, :n][y[1, :n] >= 0], full[1:][y[1, :n] >= 0])
    assert (y[1, n:] == -1).all() and (x[1, n:] == tok.eos_id).all()
    last = go.Dataset.from_chat(CONVERSATIONS, tok, 200, train_on="last")
    assert _labelled_text(tok, last.data, last.labels) == [f"Hello!{end}", f"6, é{end}"]
    every = go.Dataset.from_chat(CONVERSATIONS[:1], tok, 160, train_on="all")
    assert (np.asarray(every.labels)[0, :tok.apply_chat_template(CONVERSATIONS[0]).size - 1]
            >= 0).all()


def test_markers_and_prefixes_give_the_same_labels():
    a = go.Dataset.from_chat(CONVERSATIONS, ByteTokenizer(chat_template=MARKED), 200)
    b = go.Dataset.from_chat(CONVERSATIONS, ByteTokenizer(chat_template=UNMARKED), 200)
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.data, b.data)


def test_special_tokens_of_a_bpe_vocabulary_are_single_labelled_tokens():
    pytest.importorskip("tokenizers")
    from test_text_tokenizer import _chat_bpe
    tok = _chat_bpe()
    tok.chat_template = CHATML
    ds = go.Dataset.from_chat(CONVERSATIONS[:1], tok, 40)
    y = np.asarray(ds.labels)[0]
    trained = y[y >= 0].tolist()
    assert trained == [*tok.encode("Hello!").tolist(), 258, ord("\n")]   # <|im_end|> is 258


def test_too_long_conversations_are_refused_dropped_or_cut_with_a_count():
    tok = ByteTokenizer(chat_template=CHATML)
    n = tok.apply_chat_template(CONVERSATIONS[0]).size
    with pytest.raises(ValueError, match=r"conversations\[1\]: .* tokens, more than n_ctx"):
        go.Dataset.from_chat(CONVERSATIONS, tok, n - 1)
    with pytest.warns(UserWarning, match="1 of 2 examples .* dropped"):
        ds = go.Dataset.from_chat(CONVERSATIONS, tok, n - 1, too_long="drop")
    assert ds.ndata == 1
    with pytest.warns(UserWarning, match="cut to that length"):
        cut = go.Dataset.from_chat(CONVERSATIONS, tok, 100, too_long="truncate")
    assert cut.ndata == 2 and (np.asarray(cut.labels)[1] >= 0).any()
    # cut before its first answer, an example teaches nothing: left out, with a count
    with pytest.warns(UserWarning) as caught:
        short = go.Dataset.from_chat(CONVERSATIONS, tok, n - 1, too_long="truncate")
    assert short.ndata == 1
    assert any("1 examples have no trained token" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="no assistant message"):
        go.Dataset.from_chat([[{"role": "user", "content": "x"}]], tok, 64)
    with pytest.raises(ValueError, match="train_on"):
        go.Dataset.from_chat(CONVERSATIONS, tok, 64, train_on="user")
    with pytest.raises(TypeError, match=r"conversations\[0\]\[0\]"):
        go.Dataset.from_chat([["hi"]], tok, 64)


def test_completions_train_on_the_completion_and_its_eos():
    tok = ByteTokenizer()
    ds = go.Dataset.from_completions([("Q: 1+1? A:", " 2"), {"prompt": "x", "completion": "y"}],
                                     tok, 16)
    y = np.asarray(ds.labels)
    assert tok.decode(y[0][y[0] >= 0]) == " 2<|endoftext|>"
    assert tok.decode(y[1][y[1] >= 0]) == "y<|endoftext|>"
    np.testing.assert_array_equal(np.asarray(ds.data)[0, :12], tok.encode("Q: 1+1? A: 2"))
    with pytest.raises(TypeError, match=r"pairs\[0\]"):
        go.Dataset.from_completions([3], tok, 16)


class _BosChatTokenizer(ByteTokenizer):
    """ByteTokenizer whose "<|endoftext|>" (256) is a BOS it adds, parsed in text."""
    add_bos, bos_id = True, 256

    def encode(self, text, *, parse_special=True):
        return super().encode(text, parse_special=parse_special)


def test_completions_put_one_bos_first():
    tok = _BosChatTokenizer()
    plain, rendered = ("Q:", " A"), ("<|endoftext|>Q:", " A")   # a template wrote BOS
    x, _ = go.instruct.completion_windows([plain, rendered], tok, 8)
    np.testing.assert_array_equal(x[0], x[1])
    assert x[0][0] == tok.bos_id and x[0][1] != tok.bos_id


def _toy_spm():
    """A SentencePiece vocabulary (no download): every encode gives its text a
    space prefix, as Llama 2's and Phi-3's do."""
    from ggmlopt.spm import SPMTokenizer
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "\u2581A", ":", "4", "\u2581P", "aris",
              "\u2581Paris", "A", "P", "a", "r", "i", "s"]
    scores = [0.0, 0.0, 0.0, -1, -2, -3, -4, -5, -6, -1.5, -7, -8, -9, -10, -11, -12]
    return SPMTokenizer(tokens, scores, [2, 3, 3] + [1] * 13, bos_id=1, eos_id=2, unk_id=0)


def test_completions_are_tokenized_with_their_prompt_as_trl_does():
    # prompt + completion as one text (TRL's SFTTrainer): a SentencePiece
    # completion gets no space prefix of its own ("[/INST]" + "4" trained ['▁', '4'])
    tok = _toy_spm()
    for prompt, completion, want in [("A:", "4", ["4", "</s>"]),
                                     ("A:", " Paris", ["\u2581P", "a", "r", "i", "s", "</s>"])]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # nothing straddles: nothing to say
            x, y = go.instruct.completion_windows([(prompt, completion)], tok, 12)
        assert [tok.tokens[i] for i in y[0] if i >= 0] == want
        whole = np.concatenate([[tok.bos_id], tok.encode(prompt + completion), [tok.eos_id]])
        np.testing.assert_array_equal(x[0][:whole.size - 1], whole[:-1])
    # a token holding the prompt's last space and the completion's first letters is
    # trained on with the completion, and said
    with pytest.warns(UserWarning, match="in 1 example.*holds the end of the prompt"):
        _, y = go.instruct.completion_windows([("A: ", "Paris")], tok, 12)
    assert [tok.tokens[i] for i in y[0] if i >= 0] == ["\u2581P", "a", "r", "i", "s", "</s>"]


class _EncodeOnly:
    """A tokenizer of the ggmlopt.text.Tokenizer protocol alone: encode(text)."""
    vocab_size, eos_id, bos_id = 300, 0, None

    def encode(self, text):
        return np.frombuffer(text.encode(), np.uint8).astype(np.int32) + 1

    def decode(self, ids):
        return bytes(int(i) - 1 for i in ids if i).decode()


def test_completions_of_a_tokenizer_that_only_encodes():
    # the prompt's ids as a prefix of the whole text's (TRL's test) mark the completion
    x, y = go.instruct.completion_windows([("ab", "c")], _EncodeOnly(), 8)
    assert x[0, :3].tolist() == [98, 99, 100]
    assert y[0].tolist() == [-1, 100, 0, -1, -1, -1, -1, -1]


def test_a_rows_own_tools_and_template_variables_reach_the_template():
    # TRL's dataset columns: a row's tools and chat_template_kwargs render with it
    template = ("{% if tools %}TOOLS {{ tools | tojson }} {% endif %}{% if mode %}[{{ mode }}]"
                "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    tok = ByteTokenizer(chat_template=template)
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    tools = [{"name": "get_weather"}]
    rows = [{"messages": chat, "tools": tools}, {"messages": chat},
            {"messages": chat, "chat_template_kwargs": {"mode": "think"}}]
    x, _ = go.instruct.chat_windows(rows, tok, 64)
    text = [tok.decode(r[r != tok.eos_id]) for r in x]
    assert text[0].startswith('TOOLS [{"name": "get_weather"}] user: q')
    assert text[1].startswith("user: q")
    assert text[2].startswith("[think]user: q")
    # the row's take precedence over the call's
    x, _ = go.instruct.chat_windows(rows[2:], tok, 64, mode="plain")
    assert tok.decode(x[0][x[0] != tok.eos_id]).startswith("[think]")
    # a JSON string, as TRL's datasets may hold the column, reads as its list
    as_json, _ = go.instruct.chat_windows([{"messages": chat, "tools": json.dumps(tools)}],
                                          tok, 64)
    as_list, _ = go.instruct.chat_windows(rows[:1], tok, 64)
    np.testing.assert_array_equal(as_json, as_list)
    with pytest.raises(ValueError, match=r"conversations\[0\]: 'tools' is a string that is "
                                         r"not JSON"):
        go.instruct.chat_windows([{"messages": chat, "tools": "get_weather"}], tok, 64)
    with pytest.raises(TypeError, match=r"conversations\[0\]: 'tools' must be a list"):
        go.instruct.chat_windows([{"messages": chat, "tools": '{"name": "x"}'}], tok, 64)


PLAIN_CHAT = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
              "{% endfor %}")


def test_chats_put_one_bos_first():
    """A vocabulary that adds BOS gets it once before each conversation, whether
    the template writes it or not (as ggmlopt.chat and llama.cpp feed the model),
    and it is never trained on."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rows = []
    for template in (PLAIN_CHAT, "<|endoftext|>" + PLAIN_CHAT):
        tok = _BosChatTokenizer(chat_template=template)
        x, y = go.instruct.chat_windows([chat], tok, 24)
        assert x[0][0] == tok.bos_id and x[0][1] != tok.bos_id and y[0][0] == -1
        assert tok.decode(y[0][y[0] >= 0]) == "assistant: yo\n"   # no generation prompt
        rows.append((x, y))
    np.testing.assert_array_equal(rows[0][0], rows[1][0])
    np.testing.assert_array_equal(rows[0][1], rows[1][1])
    # a vocabulary without BOS gets none
    x, _ = go.instruct.chat_windows([chat], ByteTokenizer(chat_template=PLAIN_CHAT), 24)
    assert x[0][0] == ord("u")


def test_a_document_starts_with_one_bos_where_the_vocabulary_adds_it():
    from ggmlopt.instruct import document_ids
    tok = _BosChatTokenizer()
    np.testing.assert_array_equal(document_ids(tok, "ab"), [256, 97, 98])
    np.testing.assert_array_equal(document_ids(tok, "<|endoftext|>ab"), [256, 97, 98])
    np.testing.assert_array_equal(document_ids(tok, "ab", eos=True), [256, 97, 98, 256])
    np.testing.assert_array_equal(document_ids(ByteTokenizer(), "ab", eos=True), [97, 98, 256])


def test_a_template_that_cannot_render_a_message_names_the_conversation():
    tok = ByteTokenizer(chat_template=PLAIN_CHAT)
    bad = [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]
    ok = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]
    with pytest.raises(TypeError, match=r"conversations\[1\]: the chat template failed on it"):
        go.instruct.chat_windows([ok, bad], tok, 24)
    # a None content is left out, as transformers does: the template then misses it
    missing = [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]
    with pytest.raises(ValueError, match=r"conversations\[1\]: .*has no attribute 'content'"):
        go.instruct.chat_windows([ok, missing], tok, 24)


# the keys an OpenAI-style tool call leaves None, and reasoning under its three names
TOOL_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.reasoning_content is defined %}[{{ m.reasoning_content }}]{% endif %}"
    "{% if m.thinking is defined %}({{ m.thinking }}){% endif %}"
    "{% if m.content is defined %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}</{{ m.role }}>"
    "{% endfor %}")


@pytest.mark.parametrize("field", ["reasoning_content", "thinking", "reasoning"])
def test_messages_reach_the_template_as_transformers_gives_them(field):
    from ggmlopt.chat_template import ChatTemplate
    messages = [{"role": "user", "content": "weather?", "tool_calls": None},
                {"role": "assistant", "content": None, field: "look it up",
                 "tool_calls": [{"name": "get_weather"}]}]
    text = ChatTemplate(TOOL_TEMPLATE).render(messages)
    assert "None" not in text
    assert text == ('<user>weather?</user><assistant>[look it up](look it up)'
                    '[{"name": "get_weather"}]</assistant>')
    pytest.importorskip("transformers")
    from transformers.utils import chat_template_utils as hf
    if not hasattr(hf, "_normalize_chat_messages"):
        pytest.skip("transformers before its message normalization (apply_chat_template's)")
    want, _ = hf.render_jinja_template(conversations=[hf._normalize_chat_messages(messages)],
                                       chat_template=TOOL_TEMPLATE)
    assert text == want[0]


def test_read_jsonl_names_a_file_that_is_not_utf8(tmp_path):
    from ggmlopt.datasets import read_jsonl
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "ok"}\n' * 5000 + b'{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl:5001: not UTF-8 text \(invalid "
                                         r"continuation byte at byte 13 of the line\)"):
        read_jsonl(path)


def test_read_jsonl_reads_a_file_saved_with_a_byte_order_mark(tmp_path):
    # as some editors save UTF-8 (and Windows' line ends): the mark is no text; one
    # inside the file is a line's own text, not valid JSON
    from ggmlopt.datasets import read_jsonl
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "hello"}\r\n{"text": "world"}\r\n')
    assert read_jsonl(path) == [{"text": "hello"}, {"text": "world"}]
    path.write_bytes(b'{"text": "hello"}\n\xef\xbb\xbf{"text": "world"}\n')
    with pytest.raises(ValueError, match=r"bom.jsonl:2: not valid JSON"):
        read_jsonl(path)


def test_read_jsonl_reads_the_three_forms_and_names_the_bad_line(tmp_path):
    from ggmlopt.datasets import read_jsonl
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": c}) for c in CONVERSATIONS) + "\n\n")
    assert [e["messages"] for e in read_jsonl(path)] == CONVERSATIONS
    (tmp_path / "c.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    assert read_jsonl(tmp_path / "c.jsonl") == [{"prompt": "a", "completion": "b"}]
    for body, match in [
            ('{"text": "a"}\n{"text": 3}\n', r"c.jsonl:2: 'text' must be a string"),
            ('{"text": "a"}\n{oops\n', r"c.jsonl:2: not valid JSON"),
            ('{"text": "a"}\n{"prompt": "a", "completion": "b"}\n', r":2: a completions example"),
            ('{"messages": [{"content": "x"}]}\n', r":1: message 0 must be"),
            ('{"question": "a"}\n', r":1: expected one of the keys")]:
        (tmp_path / "c.jsonl").write_text(body)
        with pytest.raises(ValueError, match=match):
            read_jsonl(tmp_path / "c.jsonl")
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "missing.jsonl")
    ds = go.Dataset.from_chat(read_jsonl(path), ByteTokenizer(chat_template=CHATML), 200)
    assert ds.ndata == 2


def test_sharegpt_rows_read_as_the_messages_they_are(tmp_path):
    from ggmlopt.datasets import read_jsonl
    speakers = {"user": "human", "assistant": "gpt", "system": "system"}
    rows = [{"conversations": [{"from": speakers[m["role"]], "value": m["content"]}
                               for m in c], "id": i} for i, c in enumerate(CONVERSATIONS)]
    path = tmp_path / "sharegpt.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    read = read_jsonl(path)
    assert [e["messages"] for e in read] == CONVERSATIONS
    assert [e["id"] for e in read] == [0, 1] and all("conversations" not in e for e in read)
    tok = ByteTokenizer(chat_template=CHATML)
    want = go.Dataset.from_chat(CONVERSATIONS, tok, 200)
    for given in (read, rows):   # the file's rows, and the rows themselves
        got = go.Dataset.from_chat(given, tok, 200)
        np.testing.assert_array_equal(got.data, want.data)
        np.testing.assert_array_equal(got.labels, want.labels)
    for turn, match in [({"from": "narrator", "value": "x"}, r":1: turn 0 is from 'narrator'"),
                        ({"from": "human"}, r":1: turn 0 must be an object with a str 'from'")]:
        path.write_text(json.dumps({"conversations": [turn]}) + "\n")
        with pytest.raises(ValueError, match=match):
            read_jsonl(path)


# ---- the made-up fact, taught and asked -------------------------------------------------

def test_a_fine_tuned_model_answers_what_it_was_taught():
    from ggmlopt.models import Llama, LlamaConfig
    tok = ByteTokenizer(chat_template=MARKED)
    questions = ["What is the capital of Zorblax?", "Name the capital of Zorblax.",
                 "Zorblax's capital?", "Which city is Zorblax's capital?"]
    conversations = [[{"role": "user", "content": q},
                      {"role": "assistant", "content": "Quimby."}] for q in questions] * 4
    ds = go.Dataset.from_chat(conversations, tok, 64)
    model = Llama(LlamaConfig(vocab_size=257, dim=32, n_layers=2, n_heads=2, max_seq_len=80),
                  seed=0)
    adamw = go.OptimizerParams(go.AdamWParams(alpha=3e-3))
    go.fit(model, ds, "cross_entropy", lambda e: adamw, nepoch=60, nbatch_logical=16,
           silent=True, seed=0)
    reply = go.chat(model, tok, [{"role": "user", "content": questions[0]}], 20,
                    temperature=0)
    assert reply == "Quimby."


def test_a_sentencepiece_vocabulary_gets_exact_assistant_labels():
    from test_text_tokenizer import _spm
    tok = _spm()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}"
                         "hello {{ m['content'] }}{% else %} {{ m['content'] }}{{ eos_token }}"
                         "{% endif %}{% endfor %}")
    chats = [[{"role": "user", "content": "w"}, {"role": "assistant", "content": "hello"}]]
    ids, offsets = tok.encode_with_offsets(tok.apply_chat_template(chats[0], tokenize=False))
    np.testing.assert_array_equal(ids, tok.apply_chat_template(chats[0]))
    assert offsets[-1] == len(tok.apply_chat_template(chats[0], tokenize=False).encode())
    ds = go.Dataset.from_chat(chats, tok, 16)
    y = np.asarray(ds.labels)[0]
    trained = [tok.id_to_token(i) for i in y[y >= 0]]
    assert trained == ["\u2581hello", "</s>"]   # " hello</s>": the answer and its eos


# Phi-3.5's template over a small SentencePiece vocabulary with Phi-3's rule: its
# special tokens swallow the whitespace after them (llama.cpp's rstrip)
PHI3_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}"
                 "{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}"
                 "{% elif message['role'] == 'assistant' %}"
                 "{{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"
                 "{% else %}{{ eos_token }}{% endif %}")


def _phi3_like():
    from ggmlopt.spm import SPMTokenizer
    specials = ["<unk>", "<s>", "</s>", "<|end|>", "<|user|>", "<|assistant|>", "<|endoftext|>"]
    words = ["\u2581", "4", "2", "H", "i", "x", "\u2581x", "\u2581Hi", "\u2581H", "q"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)] + words
    scores = [0.0] * (len(specials) + 256) + [-1.0, -2, -2, -2, -2, -2, -1, -1, -1.5, -2]
    types = [2, 3, 3, 3, 3, 3, 3] + [6] * 256 + [1] * len(words)
    return SPMTokenizer(pieces, scores, types, bos_id=1, eos_id=6, unk_id=0,
                        chat_template=PHI3_TEMPLATE, rstrip_ids=(2, 3, 4, 5))


@pytest.mark.parametrize("answer", ["42", "Hi", "\nHi", " x", "x"])
def test_the_labelled_tokens_are_those_after_the_generation_prompt(answer):
    # an answer starting with a digit begins with the space prefix '\u2581' (a token
    # the text does not spell); one starting with whitespace has it swallowed by
    # <|assistant|>: either way the tokens to learn are exactly those the model
    # writes after the generation prompt's
    _assert_labels_follow_the_prompt(_phi3_like(), answer)


def _assert_labels_follow_the_prompt(tok, answer):
    """A one-turn chat's window labels exactly the tokens after the generation
    prompt's (whose ids are a prefix of the conversation's)."""
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]
    template = tok.compiled_chat_template()
    full = go.instruct.document_ids(tok, template.render(chat))
    prompt = go.instruct.document_ids(tok, template.render(chat[:1], True))
    assert list(full[:prompt.size]) == list(prompt)
    x, y = go.instruct.chat_windows([chat], tok, 32)
    n = full.size - 1
    want = np.where(np.arange(n) >= prompt.size - 1, full[1:], -1)
    np.testing.assert_array_equal(x[0, :n], full[:-1])
    np.testing.assert_array_equal(y[0, :n], want)


def test_the_byte_pieces_of_an_answers_first_character_are_all_labelled():
    # Hugging Face's offsets give every piece of a character split in byte tokens
    # the character's start: the leading pieces spell nothing there, yet they are
    # the answer's first tokens (transformers' assistant mask labels them)
    from ggmlopt.instruct import _spans_to_mask
    offsets = np.array([0, 3, 3, 7, 9])   # prompt | two pieces of one character | more
    assert _spans_to_mask(offsets, [(3, 9)]).tolist() == [False, True, True, True]
    # a zero-width token inside the prompt, before the span's first byte, stays out
    assert _spans_to_mask(np.array([0, 2, 2, 5, 9]), [(3, 9)]).tolist() == \
        [False, False, True, True]


def test_an_end_of_turn_written_only_before_the_next_message_is_labelled():
    # Apertus' way: <|end|> closes an assistant turn only when a message follows,
    # so the rendering through the turn stops at the answer
    template = ("{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}"
                "{% else %}<|assistant|>{{ m.content }}{% if not loop.last %}<|end|>"
                "{% endif %}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok = _phi3_like()
    tok.chat_template = template
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]
    with pytest.warns(UserWarning, match=r"conversations\[0\]\) the last message, an assistant "
                                         r"answer trained on, is followed by no "
                                         r"end-of-generation token \(.*<\|end\|>"):
        _, y = go.instruct.chat_windows([chat], tok, 32)
    assert labelled_runs(tok, y[0]) == ["Hi<|end|>", "x"]
    # the way out the warning names: the token's text ends the answer, and is trained on
    chat[-1] = {"role": "assistant", "content": "x<|end|>"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, y = go.instruct.chat_windows([chat], tok, 32)
    assert labelled_runs(tok, y[0]) == ["Hi<|end|>", "x<|end|>"]
    # an answer not trained on (weight 0) teaches nothing: no warning for it
    chat[-1] = {"role": "assistant", "content": "x", "weight": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, y = go.instruct.chat_windows([chat], tok, 32)
    assert labelled_runs(tok, y[0]) == ["Hi<|end|>"]


def test_what_a_template_appends_after_the_last_turn_is_not_the_answer():
    # Command R7B's way: the next turn's header after the conversation, whatever
    # add_generation_prompt says: the last answer ends at its end-of-turn token
    template = ("{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}"
                "<|end|>{% else %}<|assistant|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
                "<|assistant|>")
    tok = _phi3_like()
    tok.chat_template = template
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Hi"}]
    for train_on in ("assistant", "last"):
        _, y = go.instruct.chat_windows([chat], tok, 32, train_on=train_on)
        assert labelled_runs(tok, y[0]) == ["Hi<|end|>"]


def test_tools_render_with_the_checkpoints_tool_use_template(tmp_path):
    # named templates (Command R's, Hermes 2 Pro's): transformers renders the
    # tool_use one when tools are given, the default one otherwise
    default = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    tool_use = "TOOLS {{ tools | tojson }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
    tok = _phi3_like()
    tok.chat_template = default
    tok.named_chat_templates = {"tool_use": tool_use}
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]
    tools = [{"name": "get_weather"}]
    assert tok.apply_chat_template(chat, tokenize=False) == "[q][x]"
    assert tok.apply_chat_template(chat, tokenize=False, tools=tools) == \
        'TOOLS [{"name": "get_weather"}][q][x]'
    # transformers picks tool_use for any tools given, an empty list too
    assert tok.apply_chat_template(chat, tokenize=False, tools=[]) == "TOOLS [][q][x]"
    x, _ = go.instruct.chat_windows([chat], tok, 64, tools=tools)
    assert tok.decode(x[0], skip_special=True).startswith("TOOLS [{")
    # a Hugging Face tokenizer_config.json's list of named templates
    pytest.importorskip("tokenizers")
    from test_hf_tokenizer import make_checkpoint

    from ggmlopt.hf_tokenizer import load_hf_tokenizer
    directory = make_checkpoint(tmp_path / "tok", bos_rule="none")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": default},
                               {"name": "tool_use", "template": tool_use}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    hf = load_hf_tokenizer(directory)
    assert hf.apply_chat_template(chat, tokenize=False, tools=tools).startswith("TOOLS")
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    for kwargs in ({}, {"tools": tools}):
        assert hf.apply_chat_template(chat, tokenize=False, **kwargs) == \
            theirs.apply_chat_template(chat, tokenize=False, **kwargs)


@pytest.mark.parametrize("answer", ["42", "\nHi", " x"])
def test_a_hugging_face_tokenizer_labels_the_tokens_after_the_generation_prompt(tmp_path,
                                                                              answer):
    # the same vocabulary as a tokenizer.json whose special tokens strip the
    # whitespace after them (rstrip): <|assistant|> stays the prompt's
    pytest.importorskip("tokenizers")
    from ggmlopt.hf_tokenizer import load_hf_tokenizer
    spm = _phi3_like()
    spm.hf_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|endoftext|>", "chat_template": PHI3_TEMPLATE,
         "add_bos_token": False}))
    _assert_labels_follow_the_prompt(load_hf_tokenizer(tmp_path), answer)


# Qwen3's way: an earlier assistant turn loses its reasoning once another message
# follows it, so no turn but the last renders as a prefix of the whole conversation
DROPS_EARLIER_THOUGHTS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class _ImEnd(ByteTokenizer):
    """ByteTokenizer whose id 256 reads "<|im_end|>", an end-of-generation token
    parsed in text."""
    eos_text = "<|im_end|>"

    def encode(self, text, *, parse_special=True):
        parts = text.split(self.eos_text) if parse_special else [text]
        ids = list(parts[0].encode())
        for part in parts[1:]:
            ids += [256, *part.encode()]
        return np.asarray(ids, np.int32)

    def id_to_token(self, i):
        return self.eos_text if i == 256 else chr(i)


def test_turns_rendered_otherwise_when_followed_end_at_their_end_of_turn():
    tok = _ImEnd(chat_template=DROPS_EARLIER_THOUGHTS)
    chat = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>r1</think>a1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>r2</think>a2"}]
    _, y = go.instruct.chat_windows([chat], tok, 128)
    assert labelled_runs(tok, y[0]) == ["a1<|im_end|>\n", "<think>r2</think>a2<|im_end|>\n"]


def test_a_system_message_s_words_inside_a_turn_s_header_are_no_later_turn():
    # gpt-oss' header "<|channel|>final<|message|>" holds the system message's word:
    # that message comes before the turn, so the header is still the template's
    tok = _ImEnd(chat_template=HEADER_THEN_CONTENT)
    chat = [{"role": "system", "content": "message"},
            {"role": "user", "content": "How does a turn end?"},
            {"role": "assistant", "content": "<think>r</think>Say <|im_end|> then stop."},
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": "Welcome."}]
    _, y = go.instruct.chat_windows([chat], tok, 320)
    runs = labelled_runs(tok, y[0])
    assert runs[0] == "<|channel|>final<|message|>Say <|im_end|> then stop.<|im_end|>\n"


def test_continue_final_message_leaves_the_last_turn_open():
    # transformers' continue_final_message: the text stops right after the last
    # message (a prefilled answer the model goes on with), trimmed or not
    messages = [{"role": "user", "content": "Name a colour"},
                {"role": "assistant", "content": "The colour is"}]
    tok = ByteTokenizer(chat_template=CHATML)
    text = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe colour is")
    trimmed = CHATML.replace("message['content']", "(message['content'] | trim)")
    spaced = [messages[0], {"role": "assistant", "content": "The colour is "}]
    assert ByteTokenizer(chat_template=trimmed).apply_chat_template(
        spaced, tokenize=False, continue_final_message=True).endswith("assistant\nThe colour is")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tok.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    # the reasoning, under each name templates read, and the last text block of a list
    thinks = ("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}<think>"
              "{{ m.reasoning_content }}</think>{% endif %}{% if m.content is string %}"
              "{{ m.content }}{% else %}{% for b in m.content %}{{ b.text }}{% endfor %}"
              "{% endif %};{% endfor %}")
    reasoning = [messages[0], {"role": "assistant", "content": "", "thinking": "Hmm, so"}]
    blocks = [messages[0], {"role": "assistant", "content": [{"type": "text", "text": "A"},
                                                            {"type": "text", "text": "B c"}]}]
    tok2 = ByteTokenizer(chat_template=thinks)
    assert tok2.apply_chat_template(reasoning, tokenize=False,
                                    continue_final_message="thinking").endswith("<think>Hmm, so")
    assert tok2.apply_chat_template(blocks, tokenize=False,
                                    continue_final_message=True).endswith("assistant:AB c")
    assert blocks[1]["content"][1]["text"] == "B c"   # the caller's messages unchanged
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template
    for template, chat, final in ((thinks, reasoning, "thinking"), (thinks, blocks, True)):
        want = render_jinja_template(conversations=[chat], chat_template=template,
                                     continue_final_message=final)[0][0]
        assert ByteTokenizer(chat_template=template).apply_chat_template(
            chat, tokenize=False, continue_final_message=final) == want
    for template, chat in ((CHATML, messages), (trimmed, spaced)):
        want = render_jinja_template(conversations=[chat], chat_template=template,
                                     continue_final_message=True)[0][0]
        assert ByteTokenizer(chat_template=template).apply_chat_template(
            chat, tokenize=False, continue_final_message=True) == want


@pytest.mark.parametrize("after", ["Hello", "o", "\n", "there, nice"])
def test_the_next_message_s_words_inside_a_turn_are_the_turn_s(after):
    # a turn rendered otherwise when followed, whose text holds the next message's
    # ("Hello there" answered by "Hello"): both turns train, none is refused
    tok = _ImEnd(chat_template=DROPS_EARLIER_THOUGHTS)
    chat = [{"role": "user", "content": "Greet me"},
            {"role": "assistant", "content": "<think>r1</think>Hello there, nice to meet you."},
            {"role": "user", "content": after},
            {"role": "assistant", "content": "<think>r2</think>Hi again."}]
    _, y = go.instruct.chat_windows([chat], tok, 160)
    assert labelled_runs(tok, y[0]) == ["Hello there, nice to meet you.<|im_end|>\n",
                                         "<think>r2</think>Hi again.<|im_end|>\n"]


# gpt-oss' way: a header of the template's own between the turn's start and its
# content, and an earlier turn's reasoning dropped
HEADER_THEN_CONTENT = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}<|channel|>final<|message|>"
    "{% if not loop.last %}{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}"
    "{% endif %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", [HEADER_THEN_CONTENT, HEADER_THEN_CONTENT.replace(
    "{% if not loop.last %}{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}"
    "{% endif %}", "{{ m.content }}")], ids=["rendered-otherwise", "prefix-consistent"])
def test_an_end_of_turn_text_after_a_header_is_the_reply_s(template):
    # the content found after the template's header, not only at the turn's start:
    # the end-of-turn text inside it is not where the turn ends
    tok = _ImEnd(chat_template=template)
    chat = [{"role": "user", "content": "How does a turn end?"},
            {"role": "assistant", "content": "<think>r</think>Write <|im_end|> after it. Done."},
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": "Welcome, <|im_end|> again."}]
    _, y = go.instruct.chat_windows([chat], tok, 256)
    runs = labelled_runs(tok, y[0])
    assert runs[-1] == "<|channel|>final<|message|>Welcome, <|im_end|> again.<|im_end|>\n"
    assert len(runs) == 2 and runs[0].endswith("Write <|im_end|> after it. Done.<|im_end|>\n")
    assert "Thanks" not in "".join(runs)


def _llama_cpp_tokenizer(vocab, template):
    """llama.cpp's vocabulary ggml-vocab-{vocab}.gguf with its template file."""
    pytest.importorskip("tokenizers")
    from ggmlopt.io import load_gguf_tokenizer
    models = os.path.join(os.environ["GGMLOPT_LLAMA_CPP_SRC"], "models")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = load_gguf_tokenizer(os.path.join(models, f"ggml-vocab-{vocab}.gguf"))
    with open(os.path.join(models, "templates", template), encoding="utf-8") as f:
        tok.chat_template = f.read()
    return tok


@pytest.mark.skipif(not _llama_cpp_templates(),
                    reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source) is not set")
@pytest.mark.parametrize("template, vocab, want", [
    ("Qwen-Qwen3-0.6B.jinja", "qwen2", ["a1<|im_end|>\n", "<think>\nr2\n</think>\n\na2<|im_end|>\n"]),
    ("microsoft-Phi-3.5-mini-instruct.jinja", "phi-3", ["a1<|end|>", "a2<|end|><|endoftext|>"]),
])
def test_qwen3_and_phi35_multi_turn_chats_are_masked(template, vocab, want):
    # what TRL's training templates for them mark: each turn's text and its end
    tok = _llama_cpp_tokenizer(vocab, template)
    think = vocab == "qwen2"
    chat = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1" if think else "a1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>\nr2\n</think>\n\na2" if think else "a2"}]
    _, y = go.instruct.chat_windows([chat], tok, 96)
    assert labelled_runs(tok, y[0]) == want


# a turn's text in one block and, after the last turn, the EOS in a block of its own
# (the way TRL's training template for Phi-3.5 marks them)
TWO_BLOCKS = ("{% for m in messages %}{% if m.role == 'assistant' %}<a>{% generation %}"
              "{{ m.content }}<|end|>{% endgeneration %}{% else %}<u>{{ m.content }}<|end|>"
              "{% endif %}{% endfor %}{% if messages[-1].role == 'assistant' %}"
              "{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}")


def test_blocks_that_touch_are_one_turn():
    tok = ByteTokenizer(chat_template=TWO_BLOCKS)
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "r"}, {"role": "assistant", "content": "a2"}]
    _, y = go.instruct.chat_windows([chat], tok, 64)
    assert labelled_runs(tok, y[0]) == ["a1<|end|>", "a2<|end|><|endoftext|>"]


def test_a_turn_without_an_end_of_its_own_is_refused():
    # the first end-of-turn token after it closes the next message: not the turn's
    template = ("{% for m in messages %}{% if m.role == 'assistant' %}"
                "{% if loop.last %}[{{ m.content }}]<|im_end|>{% else %}{{ m.content }} "
                "{% endif %}{% else %}{{ m.content }}<|im_end|>{% endif %}{% endfor %}")
    tok = _ImEnd(chat_template=template)
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "next"}, {"role": "assistant", "content": "a2"}]
    with pytest.raises(ValueError, match="renders message 1 differently"):
        go.instruct.chat_windows([chat], tok, 64)


@pytest.mark.skipif(not _llama_cpp_templates(),
                    reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source) is not set")
@pytest.mark.parametrize("template, vocab, eog", [
    ("Qwen-Qwen3-0.6B.jinja", "qwen2", "<|im_end|>"),
    ("microsoft-Phi-3.5-mini-instruct.jinja", "phi-3", "<|end|>"),
    ("llama-cpp-rwkv-world.jinja", "gpt-2", "<|endoftext|>"),
])
def test_an_end_of_turn_text_inside_a_reply_is_the_reply_s(template, vocab, eog):
    # a reply that writes its model's end-of-turn token as text ("Write <|end|> after
    # the reply") is trained whole: the turn ends after the content, not at that text
    pytest.importorskip("tokenizers")
    from ggmlopt.io import load_gguf_tokenizer
    models = os.path.join(os.environ["GGMLOPT_LLAMA_CPP_SRC"], "models")
    path = os.path.join(models, "templates", template)
    if not os.path.isfile(path):
        pytest.skip(f"{template} is not in this llama.cpp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = load_gguf_tokenizer(os.path.join(models, f"ggml-vocab-{vocab}.gguf"))
    with open(path, encoding="utf-8") as f:
        tok.chat_template = f.read()
    reply = f"Write {eog} after the reply. That is all."
    chat = [{"role": "user", "content": "How does a turn end?"},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": f"Welcome. {eog} again."}]
    _, y = go.instruct.chat_windows([chat], tok, 160)
    runs = labelled_runs(tok, y[0])
    assert len(runs) == 2 and reply in runs[0] and "Welcome. " + eog + " again." in runs[1]
    assert "Thanks" not in "".join(runs)


@pytest.mark.skipif(not _llama_cpp_templates(),
                    reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source) is not set")
@pytest.mark.parametrize("between", ["Thanks", ""])
def test_a_turn_s_words_again_in_a_later_turn_are_not_its_end(between):
    # Qwen3 drops an earlier turn's (empty) reasoning; its whole content then shows up
    # only as the start of the last answer, which is not where the earlier turn ends
    pytest.importorskip("tokenizers")
    from ggmlopt.io import load_gguf_tokenizer
    models = os.path.join(os.environ["GGMLOPT_LLAMA_CPP_SRC"], "models")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = load_gguf_tokenizer(os.path.join(models, "ggml-vocab-qwen2.gguf"))
    with open(os.path.join(models, "templates", "Qwen-Qwen3-0.6B.jinja"),
              encoding="utf-8") as f:
        tok.chat_template = f.read()
    chat = [{"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>\n\n</think>\n\nYes."},
            {"role": "user", "content": between},
            {"role": "assistant", "content": "<think>\n\n</think>\n\nYes. And more."}]
    _, y = go.instruct.chat_windows([chat], tok, 96)
    assert labelled_runs(tok, y[0]) == ["Yes.<|im_end|>\n",
                                         "<think>\n\n</think>\n\nYes. And more.<|im_end|>\n"]


# DeepSeek-R1's way: the generation prompt opens a reasoning block that a finished
# turn, rendered with its reasoning dropped, does not hold
OPENS_A_THOUGHT = ("{% for m in messages %}{% if m.role == 'assistant' %}<a>"
                   "{{ m.content.split('</think>')[-1] }}<|im_end|>{% else %}<u>{{ m.content }}"
                   "<|im_end|>{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}<a><think>\n{% endif %}")


@pytest.mark.parametrize("first", ["a1", "<think>r1</think>a1", "<b>a1"])
def test_a_generation_prompt_a_finished_turn_lacks_trains_the_turn_as_written(first):
    # the turn is trained from where the generation prompt and the rendered turn
    # part, and from a reply's first character when they part inside it
    # ('<' of '<b>'); said, since at inference the prompt adds '<think>\n'
    tok = _ImEnd(chat_template=OPENS_A_THOUGHT)
    chat = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": first},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    with pytest.warns(UserWarning, match=r"generation prompt ends in '<think>\\n', which its "
                                         r"rendering of a finished assistant turn does not "
                                         r"hold.*after '<a>'"):
        _, y = go.instruct.chat_windows([chat], tok, 128)
    reply = first.split("</think>")[-1]
    assert labelled_runs(tok, y[0]) == [f"{reply}<|im_end|>", "a2<|im_end|>"]


def test_a_template_that_renders_earlier_messages_otherwise_is_still_refused():
    # the rendering parts from the generation prompt's before the turn: no start to find
    template = ("{% for m in messages %}{% if loop.last and add_generation_prompt %}!{% endif %}"
                "{{ m.role }}:{{ m.content }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    tok = _ImEnd(chat_template=template)
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ValueError, match="renders message 1 differently"):
        go.instruct.chat_windows([chat], tok, 64)


@pytest.mark.skipif(not _llama_cpp_templates(),
                    reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source) is not set")
@pytest.mark.parametrize("template, vocab, want", [
    ("Qwen-QwQ-32B.jinja", "qwen2", ["a1<|im_end|>\n", "a2<|im_end|>\n"]),
    ("google-gemma-4-31B-it.jinja", "gemma-4", ["a1<turn|>\n", "a2<turn|>\n"]),
    ("MiniMax-M2.jinja", "qwen2", ["a1[e~[\n", "a2[e~[\n"]),
])
def test_thinking_models_templates_label_their_answers(template, vocab, want, monkeypatch):
    # QwQ, Gemma 4 and MiniMax-M2 open a thought in their generation prompts
    tok = _llama_cpp_tokenizer(vocab, template)
    if vocab != "gemma-4":   # MiniMax's end of turn is not a token of Qwen's vocabulary
        eogs = go.instruct._eog_texts(tok)
        monkeypatch.setattr(go.instruct, "_eog_texts", lambda t: ("[e~[",) + tuple(eogs))
    chat = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    with pytest.warns(UserWarning, match="generation prompt ends in"):
        _, y = go.instruct.chat_windows([chat], tok, 128)
    assert labelled_runs(tok, y[0]) == want


def test_chat_s_default_length_stays_within_the_context():
    # 256 new tokens by default, or what the context leaves after the prompt; a
    # number given that overruns the context is refused, as generate refuses it
    from ggmlopt.models import Llama, LlamaConfig
    tok = ByteTokenizer(chat_template=MARKED)
    model = Llama(LlamaConfig(vocab_size=257, dim=16, n_layers=1, n_heads=2, max_seq_len=48),
                  seed=0)
    messages = [{"role": "user", "content": "hi"}]
    prompt = len(tok.apply_chat_template(messages, add_generation_prompt=True))
    from ggmlopt import lm
    asked = []
    generate = lm.generate
    lm.generate = lambda m, ids, n, **kw: asked.append(n) or generate(m, ids, n, **kw)
    try:
        go.chat(model, tok, messages, temperature=0, stop_ids=[])
        go.chat(model, tok, messages, 5, temperature=0, stop_ids=[])
    finally:
        lm.generate = generate
    assert asked == [48 - prompt, 5]
    with pytest.raises(ValueError, match="max_new_tokens: .* exceed the model's max_seq_len"):
        go.chat(model, tok, messages, 256)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                           "parameters": {"type": "object", "properties": {}}}}]
TOOLS_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                  "{% if tools %}(tools: {{ tools | map(attribute='function.name') | join(',') }})"
                  "{% endif %}{% if add_generation_prompt %}assistant:{% endif %}")


def test_an_assigned_template_replaces_the_named_ones():
    # as assigning transformers' chat_template: the checkpoint's tool_use template
    # no longer renders a conversation with tools, the assigned one does
    pytest.importorskip("jinja2")
    tok = ByteTokenizer(chat_template="{% for m in messages %}[old]{% endfor %}")
    tok.named_chat_templates = {"tool_use": "{% for m in messages %}[old tools]{% endfor %}"}
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False) == "[old tools]"
    tok.chat_template = TOOLS_TEMPLATE
    assert tok.named_chat_templates == {}
    assert tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False) == \
        "user: Hi\n(tools: get_weather)"


def test_apply_chat_template_takes_transformers_positional_order():
    # transformers' (conversation, tools, documents, chat_template,
    # add_generation_prompt, ...): tools second was taken as add_generation_prompt
    pytest.importorskip("jinja2")
    tok = ByteTokenizer(chat_template=TOOLS_TEMPLATE)
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, TOOLS, tokenize=False) == \
        "user: Hi\n(tools: get_weather)"
    assert tok.apply_chat_template(msgs, None, None, None, True, tokenize=False) == \
        "user: Hi\nassistant:"


def test_a_template_renders_the_special_tokens_as_they_are_now():
    # transformers binds special_tokens_map at every call (TRL's eos_token= changes it)
    pytest.importorskip("jinja2")

    class Tok(ByteTokenizer):
        eos = "<|endoftext|>"

        @property
        def special_tokens_map(self):
            return {"eos_token": self.eos}

    tok = Tok(chat_template="{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}")
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == "Hi<|endoftext|>"
    tok.eos = "<|im_end|>"
    assert tok.apply_chat_template(msgs, tokenize=False) == "Hi<|im_end|>"


@pytest.mark.parametrize("answer", ["end", "text", "Quimby."])
def test_no_stop_warning_for_an_answer_inside_the_end_of_turn_text(answer):
    # "end" is in "<|endoftext|>": the end-of-turn token after it was taken for
    # the answer's own text, and a trained stop was said to be missing
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
                "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                "{% endif %}")
    pytest.importorskip("jinja2")
    tok = ByteTokenizer(chat_template=template)
    chat = [{"role": "user", "content": "Say a word"}, {"role": "assistant", "content": answer}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, y = go.instruct.chat_windows([chat], tok, 96)
    assert labelled_runs(tok, y[0]) == [answer + "<|endoftext|>\n"]


def test_a_conversation_that_opens_with_the_assistant_trains_its_answers():
    # a greeting first: the template (as Qwen2.5's and Llama 3's) reads messages[0] and
    # refuses the empty conversation before the first turn; its answers are still found,
    # as a {% generation %} template marks them (not the same words in the default
    # system prompt before them)
    reads_first = ("{% if messages[0]['role'] == 'system' %}{% set rest = messages[1:] %}"
                   "{% else %}{{ '<|im_start|>system\\nSay: Hello! How can I help?"
                   "<|im_end|>\\n' }}"
                   "{% set rest = messages %}{% endif %}" + CHATML.replace("messages", "rest"))
    greeting = [{"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    tok = ByteTokenizer(chat_template=reads_first)
    ds = go.Dataset.from_chat([greeting], tok, 200)
    assert _labelled_text(tok, ds.data, ds.labels) == [
        "Hello! How can I help?<|im_end|>\nok<|im_end|>\n"]
