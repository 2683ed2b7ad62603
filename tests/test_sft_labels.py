"""Supervised fine-tuning labels at the edges the common cases miss: a
generation prompt that a finished turn holds only part of (a reply beginning
with the characters of the prompt's last token), and tool calls a template
does not write."""
import warnings

import pytest
from finetune_files import labelled_runs
from test_chat import _llama_cpp_templates, _llama_cpp_tokenizer

import ggmlopt as go

pytest.importorskip("jinja2")

# Qwen3's way without thinking: the generation prompt closes an empty thought,
# '<tool>' here (one token of the vocabulary), that a finished turn does not write;
# an empty reply then begins with '<|im_end|>' and a tool call with '<tc>', whose
# '<' the prompt's '<tool>' begins with too
OPENS_A_TOKEN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                 "{% if m.tool_calls %}<tc>{{ m.tool_calls[0].function.name }}</tc>{% endif %}"
                 "{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n<tool>{% endif %}")
CALL = {"type": "function", "function": {"name": "he", "arguments": {}}}


def _chat_bpe():
    pytest.importorskip("tokenizers")
    from test_text_tokenizer import _chat_bpe as make
    return make()


@pytest.mark.parametrize("first, want", [
    ({"role": "assistant", "content": ""}, "<|im_end|>\n"),
    ({"role": "assistant", "content": "", "tool_calls": [CALL]}, "<tc>he</tc><|im_end|>\n"),
])
def test_a_reply_beginning_as_the_prompt_s_last_token_does_is_trained_whole(first, want):
    # the characters part after the '<' both write; the tokens part before it: the
    # reply is trained from its '<' (it was cut, or refused as a turn without an end)
    tok = _chat_bpe()
    tok.chat_template = OPENS_A_TOKEN
    chat = [{"role": "user", "content": "q1"}, first,
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    with pytest.warns(UserWarning, match="generation prompt ends in '<tool>'"):
        _, y = go.instruct.chat_windows([chat], tok, 96)
    assert labelled_runs(tok, y[0]) == [want, "a2<|im_end|>\n"]


@pytest.mark.skipif(not _llama_cpp_templates(),
                    reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source) is not set")
def test_qwen3_without_thinking_trains_tool_calls_and_empty_replies_whole():
    tok = _llama_cpp_tokenizer("qwen2", "Qwen-Qwen3-0.6B.jinja")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    chats = [{"messages": [{"role": "user", "content": "Weather in Paris?"}, call,
                           {"role": "tool", "content": '{"temp": 20}'},
                           {"role": "assistant", "content": "It is 20 C."}], "tools": tools},
             [{"role": "user", "content": "q1"}, {"role": "assistant", "content": ""},
              {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the prompt's empty thought, said
        _, y = go.instruct.chat_windows(chats, tok, 256, enable_thinking=False)
    call_text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                 '</tool_call><|im_end|>\n')
    assert labelled_runs(tok, y[0]) == [call_text, "It is 20 C.<|im_end|>\n"]
    assert labelled_runs(tok, y[1]) == ["<|im_end|>\n", "a2<|im_end|>\n"]


# SmolLM3's and Granite 3.3's way: an assistant turn's tool_calls are not written
DROPS_CALLS = ("{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}assistant: {% endif %}")


def test_tool_calls_a_template_does_not_write_are_said_not_trained():
    from test_chat import _ImEnd
    call = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    chat = [{"role": "user", "content": "q"}, call, {"role": "tool", "content": "1"},
            {"role": "assistant", "content": "a"}]
    tok = _ImEnd(chat_template=DROPS_CALLS)
    with pytest.warns(UserWarning, match=r"in 1 conversation\(s\) \(the first: "
                                         r"conversations\[1\]\) an assistant turn's tool_calls"):
        _, y = go.instruct.chat_windows([chat[:1] + chat[-1:], chat], tok, 96)
    assert labelled_runs(tok, y[1]) == ["<|im_end|>\n", "a<|im_end|>\n"]   # an empty reply
    # a template that writes them: nothing to say
    tok = _ImEnd(chat_template=DROPS_CALLS.replace(
        "{{ m.content }}", "{{ m.content }}{% for c in m.tool_calls or [] %}"
        "[{{ c.function.name }}]{% endfor %}"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, y = go.instruct.chat_windows([chat], tok, 96)
    assert labelled_runs(tok, y[0]) == ["[he]<|im_end|>\n", "a<|im_end|>\n"]
