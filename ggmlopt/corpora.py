"""Text corpora that need no download.

``python_docstrings()`` collects the docstrings of the Python standard library
from its source files (parsed with ``ast``, never imported, so nothing runs), in
a fixed order: the same text on every machine with the same Python version.  It
is English prose about programming, several megabytes of it, enough to train
and evaluate a small language model offline.
"""
from __future__ import annotations

import ast
import os
import sysconfig
from collections.abc import Iterator

__all__ = ["python_docstrings"]

# test suites and demos are code-heavy and not prose; idlelib, lib2to3 and
# turtledemo vary between distributions
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo",
                        "site-packages", "dist-packages", "__pycache__", "ensurepip"})


def _sources(root: str) -> Iterator[str]:
    """The .py files under root, in sorted order, outside _SKIP_DIRS."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def _docstrings(path: str) -> Iterator[str]:
    """The module, class and function docstrings of one source file, in order."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:   # one-liners like "Return x." teach little
                yield doc


def python_docstrings(min_bytes: int = 0, stdlib: str | None = None) -> str:
    """The docstrings of the standard library's modules, classes and functions,
    separated by blank lines (UTF-8 text, deterministic for a Python version).

    min_bytes: stop once the text holds at least this many UTF-8 bytes (0: all
    of it); ValueError when the library has less.  stdlib: the folder to read
    (default: this interpreter's, ``sysconfig.get_paths()["stdlib"]``).
    """
    root = stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise ValueError(f"stdlib: {root!r} is not a folder")
    parts: list[str] = []
    size = -1   # the text's bytes: each docstring and two newlines, less one at the end
    for path in _sources(root):
        for doc in _docstrings(path):
            parts.append(doc)
            size += len(doc.encode("utf-8")) + 2
            if min_bytes and size >= min_bytes:
                return "\n\n".join(parts) + "\n"
    if min_bytes and size < min_bytes:
        raise ValueError(f"min_bytes: the docstrings under {root!r} hold {max(size, 0)} bytes, "
                         f"fewer than {min_bytes}")
    return "\n\n".join(parts) + "\n"
