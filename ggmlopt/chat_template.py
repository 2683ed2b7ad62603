"""Chat templates: a model's Jinja template (a GGUF's ``tokenizer.chat_template``,
a Hugging Face ``tokenizer_config.json``'s ``chat_template``) rendered as
transformers' ``apply_chat_template`` renders it.

The environment is transformers': Jinja2's ImmutableSandboxedEnvironment with
``trim_blocks`` and ``lstrip_blocks``, the loop controls, a ``tojson`` that does
not escape HTML, and the globals ``raise_exception``, ``strftime_now``,
``dict`` and ``namespace``; the special tokens (``bos_token``, ``eos_token``
...) are bound as transformers binds its ``special_tokens_map``.  A
``{% generation %}`` block (TRL's marker) renders its body and records where it
lies, which gives the exact assistant spans of templates that have markers.
jinja2 (>= 3.1.6, the ``chat`` extra) is imported when a template is first used.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from ._optional import import_optional

__all__ = ["ChatTemplate", "check_messages"]

# what transformers appends to the message continue_final_message continues
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _jinja():
    jinja2 = import_optional("jinja2", "chat", "chat templates")
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < (3, 1, 6):
        raise ImportError(f"chat templates need jinja2 >= 3.1.6 (older ones have sandbox "
                          f"escapes), found {jinja2.__version__}: pip install -U jinja2")
    return jinja2


# transformers' names of a message's reasoning: each template reads one of them
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def check_messages(messages, name: str = "messages") -> list[dict[str, Any]]:
    """messages as a list of dicts, each with a str ``role``, as transformers'
    apply_chat_template hands them to a template: keys whose value is None left
    out (an OpenAI message's ``content=None`` beside its tool calls; templates
    test for a missing key, and some would write "None"), and the reasoning
    under every name templates read (``reasoning_content`` and ``thinking``,
    from any of REASONING_FIELDS), numpy scalars as their Python values (_plain).
    TypeError or ValueError naming the message otherwise."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"{name}: expected a list of messages (dicts with 'role' and "
                        f"'content'), got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"{name}[{i}]: expected a dict with 'role' and 'content', got "
                            f"{type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise TypeError(f"{name}[{i}]: expected a str 'role', got {m.get('role')!r}")
        message = {k: _plain(v) for k, v in m.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value):
    """value with its numpy scalars (a dataset column's np.False_, np.int64)
    as the Python values transformers' copy of a template's inputs makes them:
    np.False_ ``is false`` to the template."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _check_listed(value, name: str, what: str) -> None:
    """TypeError unless value (tools, documents) is None or a list of dicts
    (what: the kind of dict), as transformers refuses others (a function among
    the tools: transformers turns it into its JSON schema, which a template
    reads; the function itself would be rendered without its name)."""
    if value is None:
        return
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise TypeError(f"{name}: expected a list, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            hint = " (transformers.utils.get_json_schema(f) makes one of a function)" \
                if callable(item) else ""
            raise TypeError(f"{name}[{i}]: expected a {what}, got {type(item).__name__}{hint}")


class ChatTemplate:
    """ChatTemplate(source, *, special_tokens=None): a compiled chat template.

    source: the Jinja text.  special_tokens: the names bound for the template
    (``{"bos_token": "<s>", "eos_token": "</s>"}``), transformers'
    special_tokens_map.  ``render(messages, add_generation_prompt=False,
    **kwargs)`` -> str; ``render_spans`` also gives the (start, end) character
    spans of its ``{% generation %}`` blocks; ``has_generation_markers``.
    """

    def __init__(self, source: str, *, special_tokens: Mapping[str, str] | None = None):
        if not isinstance(source, str) or not source:
            raise TypeError(f"source: expected a non-empty str (a Jinja chat template), got "
                            f"{type(source).__name__}")
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template: Any = None
        # while render_spans streams: each {% generation %} block's (start, text), and
        # the characters written before the chunk being rendered
        self._spans: list[tuple[int, str]] | None = None
        self._streamed = 0

    @property
    def has_generation_markers(self) -> bool:
        """Whether the template marks assistant text with ``{% generation %}``."""
        import re
        return re.search(r"\{%-?\s*generation\s*-?%\}", self.source) is not None

    def _compiled(self):
        if self._template is None:
            self._template = self._compile()
        return self._template

    def _compile(self):
        jinja2 = _jinja()
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        owner = self

        # TRL's {% generation %} marker: renders its body and records it
        def parse(ext, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(ext.call_method("_mark"), [], [], body
                                          ).set_lineno(lineno)

        def mark(ext, caller):
            text = caller()
            if owner._spans is not None:
                # the output streamed so far ends where this block starts (transformers'
                # AssistantTracker): its place, whatever text came before
                owner._spans.append((owner._streamed, text))
            return text

        # made with type(): the class needs jinja2, imported only here
        generation_spans = type("GenerationSpans", (Extension,),
                                {"tags": {"generation"}, "parse": parse, "_mark": mark})

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[generation_spans,
                                                        jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        env.globals["dict"] = dict
        try:
            return env.from_string(self.source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"source: the chat template does not parse ({e})") from None

    def render(self, messages, add_generation_prompt: bool = False, **kwargs) -> str:
        """The conversation as the template writes it.  messages: list of dicts
        with ``role`` and ``content`` (and whatever else the template reads);
        add_generation_prompt: end with the assistant's opening (for generation);
        kwargs: further template variables (``tools``, ``enable_thinking`` ...),
        and transformers' ``continue_final_message`` (True, or the field to
        continue): the text cut right after the last message's content, left
        open for the model to go on with it."""
        final = kwargs.pop("continue_final_message", False)
        if not final:
            return "".join(self._stream(messages, add_generation_prompt, kwargs))
        return self._continued(messages, add_generation_prompt, kwargs, final)

    def _continued(self, messages, add_generation_prompt, kwargs, final) -> str:
        """transformers' continue_final_message: the last message's field marked with
        a tag, rendered, and the text cut where the tag is (before the space the
        template trimmed off the end of the message, if it did)."""
        if add_generation_prompt:
            raise ValueError("continue_final_message: continues the last message, where "
                             "add_generation_prompt opens another; give one of them")
        field = final if isinstance(final, str) else "content"
        messages = check_messages(messages)   # copies: the caller's stay as they are
        last = messages[-1] if messages else {}
        value = last.get(field)
        if isinstance(value, (list, tuple)):   # content blocks: the last one with text
            blocks = [dict(b) if isinstance(b, Mapping) else b for b in value]
            at = next((i for i in range(len(blocks) - 1, -1, -1)
                       if isinstance(blocks[i], dict) and isinstance(blocks[i].get("text"), str)),
                      None)
            if at is None:
                raise ValueError("continue_final_message: the last message has no text block "
                                 "to continue")
            text = blocks[at]["text"]
            blocks[at]["text"] = text + _CONTINUE_TAG
            last[field] = blocks
        elif isinstance(value, str):
            text = value
            # reasoning is written under several names: every copy of it continues
            fields = [k for k in REASONING_FIELDS if last.get(k) == text] \
                if field in REASONING_FIELDS else [field]
            for k in fields:
                last[k] = text + _CONTINUE_TAG
        else:   # as transformers: a value the messages lack
            raise ValueError(f"continue_final_message: the last message has no {field!r} "  # noqa: TRY004
                             "to continue")
        rendered = "".join(self._stream(messages, False, kwargs))
        if text.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
            raise ValueError("continue_final_message: the template does not write the last "
                             "message's text as it is, so there is nothing to continue")
        at = rendered.rindex(_CONTINUE_TAG.strip())
        if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:at]
        return rendered[:at].rstrip()

    def _stream(self, messages, add_generation_prompt, kwargs):
        """The rendered text's chunks as Jinja streams them (self._streamed
        counts the characters before the one being rendered)."""
        messages = check_messages(messages)
        variables = {**self.special_tokens, **_plain(kwargs)}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        _check_listed(variables["tools"], "tools", "JSON schema (dict)")
        _check_listed(variables["documents"], "documents", "dict")
        chunks = []
        self._streamed = 0
        try:
            for chunk in self._compiled().generate(
                    messages=messages, add_generation_prompt=bool(add_generation_prompt),
                    **variables):
                chunks.append(chunk)
                self._streamed += len(chunk)
        except _jinja().exceptions.TemplateError as e:
            raise ValueError(f"messages: the chat template refuses them: {e}") from None
        return chunks

    def render_spans(self, messages, add_generation_prompt: bool = False, **kwargs
                     ) -> tuple[str, list[tuple[int, int]]]:
        """(text, [(start, end) character spans of the {% generation %} blocks]):
        each block's place is where the output streamed so far ends when the
        block is rendered, as transformers' assistant masks take it (an answer
        whose text also appears earlier, in a user's message, is still the
        answer's)."""
        self._spans = []
        try:
            text = self.render(messages, add_generation_prompt, **kwargs)
            blocks = self._spans
        finally:
            self._spans = None
        # a block rendered inside a macro or a {% set %} reaches the output later, or
        # changed: its place cannot be told from the stream
        if any(text[start:start + len(body)] != body for start, body in blocks):
            raise ValueError("the chat template writes its {% generation %} blocks elsewhere "
                             "than where it renders them (in a macro or a {% set %}); their "
                             "places cannot be told")
        return text, [(start, start + len(body)) for start, body in blocks]

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} characters)"
