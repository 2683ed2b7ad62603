"""Render ggmlopt's docstrings, written as plain text with reST literals, safely.

The docstrings read well in ``help()``: ``literals`` and ``::`` examples are reST, but
the prose uses ``*`` for products (``C*H*W``), ``|x|`` for absolute values, a keyword-only
``*`` in signatures and indented continuation lines, which reST would take for emphasis,
substitutions and block quotes.  This extension escapes those characters outside literals
(so the text shows as written) and, when a docstring still does not parse cleanly, shows
everything after its summary paragraph as preformatted text, exactly as ``help()`` does.
Two more fixes for the API pages: a class whose first docstring line autodoc took for a
signature gets its real one, and "Bases:" skips private base classes.
"""
from __future__ import annotations

import inspect
import io
import re

from docutils.core import publish_doctree

_LITERAL = re.compile(r"(``.+?``)")
# reST markup that plain prose uses as ordinary characters
_SPECIAL = re.compile(r"([*|])|(?<=\w)_(?=[\s.,;:)]|$)")


def _escape_prose(segment: str) -> str:
    return _SPECIAL.sub(lambda m: "\\" + m.group(0), segment)


def _escape_line(line: str) -> str:
    parts = _LITERAL.split(line)
    return "".join(p if i % 2 else _escape_prose(p) for i, p in enumerate(parts))


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def escape(lines: list[str]) -> list[str]:
    """lines with reST's markup characters escaped outside ``literals`` and ``::`` blocks."""
    out: list[str] = []
    block_indent = None  # indentation of the paragraph that opened a literal block
    for line in lines:
        if block_indent is not None:
            if not line.strip() or _indent(line) > block_indent:
                out.append(line)
                continue
            block_indent = None
        out.append(_escape_line(line))
        if line.rstrip().endswith("::"):
            block_indent = _indent(line)
    return out


def parses_cleanly(lines: list[str]) -> bool:
    """Whether docutils reads lines without a warning or error."""
    stream = io.StringIO()
    publish_doctree("\n".join(lines), settings_overrides={
        "report_level": 2, "halt_level": 5, "warning_stream": stream,
        "file_insertion_enabled": False, "raw_enabled": False})
    return not stream.getvalue()


def _summary_and_rest(lines: list[str]) -> tuple[list[str], list[str]]:
    for i, line in enumerate(lines):
        if not line.strip():
            return lines[:i], lines[i:]
    return lines, []


def process_docstring(app, what, name, obj, options, lines) -> None:
    if id(obj) in _PROSE_FIRST_LINE and obj.__doc__:
        lines.insert(0, inspect.cleandoc(obj.__doc__).splitlines()[0])
    if not lines:
        return
    escaped = escape(lines)
    if parses_cleanly(escaped):
        lines[:] = escaped
        return
    summary, rest = _summary_and_rest(lines)
    summary = escape(summary)
    if not parses_cleanly(summary):
        summary, rest = [], lines
    body = [line.rstrip() for line in rest]
    while body and not body[0]:
        body.pop(0)
    lines[:] = summary + ["", "::", ""] + ["    " + line if line else "" for line in body]


# objects whose first docstring line autodoc mistook for a signature
_PROSE_FIRST_LINE: set[int] = set()


def process_signature(app, what, name, obj, options, signature, return_annotation):
    """A class has no return annotation: one read from the docstring means its first line
    was prose such as ``Reshape(shape): (batch, *in) -> (batch, *shape)``.  Show the real
    signature, and give the line back to the docstring (process_docstring)."""
    if what != "class" or not return_annotation:
        return None
    try:
        real = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    _PROSE_FIRST_LINE.add(id(obj))
    plain = [p.replace(annotation=inspect.Parameter.empty) for p in real.parameters.values()]
    return str(real.replace(parameters=plain, return_annotation=inspect.Signature.empty)), None


def _public_bases(cls) -> list[type]:
    if not cls.__name__.startswith("_"):
        return [cls]
    return [b for base in cls.__bases__ for b in _public_bases(base)]


def process_bases(app, name, obj, options, bases) -> None:
    """"Bases:" names public classes: a private base (_Elementwise) shows as its bases."""
    bases[:] = [b for base in bases for b in _public_bases(base)]


def setup(app):
    app.connect("autodoc-process-bases", process_bases)
    app.connect("autodoc-process-signature", process_signature)
    app.connect("autodoc-process-docstring", process_docstring)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
