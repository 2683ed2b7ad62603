"""An assistant turn's "weight" (OpenAI's fine-tuning files: 0 or 1 on an
assistant message; axolotl's ShareGPT turns): 0 keeps the turn out of the loss,
as those trainers do, where passing over the key would train on it silently."""
import json

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.text import ByteTokenizer

pytest.importorskip("jinja2")

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
          "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
TOK = ByteTokenizer(chat_template=CHATML)


def _trained(conversations, **kw):
    ds = go.Dataset.from_chat(conversations, TOK, n_ctx=96, **kw)
    labels = np.asarray(ds.labels)[0]
    return TOK.decode(labels[labels >= 0])


def _chat(weight):
    return [{"role": "user", "content": "a"},
            {"role": "assistant", "content": "BAD", "weight": weight},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "GOOD"}]


def test_a_turn_of_weight_0_is_not_trained_on():
    assert _trained([_chat(0)]) == "GOOD<|endoftext|>\n"
    assert _trained([_chat(1)]) == "BAD<|endoftext|>\nGOOD<|endoftext|>\n"
    assert "BAD" in _trained([_chat(0)], train_on="all")   # every token, as asked


def test_sharegpt_turn_weights_are_read(tmp_path):
    path = tmp_path / "sharegpt.jsonl"
    path.write_text(json.dumps({"conversations": [
        {"from": "human", "value": "a"}, {"from": "gpt", "value": "BAD", "weight": 0},
        {"from": "human", "value": "b"}, {"from": "gpt", "value": "GOOD"}]}) + "\n")
    assert _trained(go.datasets.read_jsonl(path)) == "GOOD<|endoftext|>\n"


def test_other_weights_and_nothing_left_to_train_are_refused():
    with pytest.raises(ValueError, match=r"message 1: 'weight' must be 0 .* or 1, got 0.5"):
        _trained([_chat(0.5)])
    last_zero = _chat(1)[:3] + [{"role": "assistant", "content": "GOOD", "weight": 0}]
    with pytest.raises(ValueError, match="every one it would train on has 'weight' 0"):
        _trained([last_zero], train_on="last")


def test_unwritten_tool_calls_are_said_beside_a_turn_of_weight_0():
    # the warning reads the trained turns' spans: a turn left out must not shift them
    chat = [{"role": "user", "content": "a"},
            {"role": "assistant", "content": "x", "weight": 0},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"function": {"name": "lookup", "arguments": {}}}]}]
    with pytest.warns(UserWarning, match="tool_calls are not"):
        go.Dataset.from_chat([chat], TOK, n_ctx=96)
