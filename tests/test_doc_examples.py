"""Every fenced ``python`` block of README.md and of the pages in docs/ runs as
written: the blocks of one file in order, in one namespace, in a temporary
folder.  A block whose first line is ``# requires: a, b`` skips when one of those
modules cannot be imported (the blocks after it must not depend on it)."""
import contextlib
import importlib.util
import io
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
REQUIRES = re.compile(r"#\s*requires:\s*(.+)")


def documents():
    """README.md and docs/**/*.md that exist here (an installed package's test run
    from outside the source tree has neither)."""
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.is_file() and "_build" not in f.parts]


def python_blocks(path):
    """(line number, source) of each ```python block of path, in order."""
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def missing_requirements(source):
    first = source.lstrip().splitlines()[0] if source.strip() else ""
    m = REQUIRES.match(first)
    if not m:
        return []
    names = [n.strip() for n in m.group(1).split(",") if n.strip()]
    return [n for n in names if importlib.util.find_spec(n) is None]


BLOCKS = [(doc, i, line, src) for doc in documents()
          for i, (line, src) in enumerate(python_blocks(doc))]


class _Document:
    """The namespace and folder one document's blocks share, and how far they ran."""

    def __init__(self, folder):
        self.namespace = {"__name__": "__doc_example__"}
        self.folder = folder
        self.ran = 0
        self.failed = None


@pytest.fixture(scope="module")
def document_states(tmp_path_factory):
    states = {}

    def get(doc):
        if doc not in states:
            states[doc] = _Document(tmp_path_factory.mktemp(doc.stem))
        return states[doc]

    yield get


def _run(state, doc, line, source):
    code = compile(source, f"{doc.name}:{line}", "exec")
    old = os.getcwd()
    os.chdir(state.folder)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code, state.namespace)  # noqa: S102 (the documents' own examples)
    finally:
        os.chdir(old)


def _catch_up(state, doc, upto):
    """Run the blocks of doc before block upto that have not run (a block picked
    alone with -k still sees what the blocks before it defined)."""
    blocks = python_blocks(doc)
    while state.ran < upto:
        line, src = blocks[state.ran]
        state.ran += 1
        if not missing_requirements(src):
            try:
                _run(state, doc, line, src)
            except Exception as e:  # noqa: BLE001 (reported by that block's own test)
                state.failed = f"{doc.name}:{line}: {type(e).__name__}: {e}"


@pytest.mark.skipif(not BLOCKS, reason="no README.md or docs/ here (installed package)")
@pytest.mark.parametrize("doc,index,line,source", BLOCKS or [(None, 0, 0, "")],
                         ids=[f"{b[0].relative_to(ROOT)}:{b[2]}" for b in BLOCKS] or ["none"])
def test_block_runs_as_written(document_states, doc, index, line, source):
    state = document_states(doc)
    _catch_up(state, doc, index)
    if state.failed:
        pytest.fail(f"an earlier block of {doc.name} failed: {state.failed}")
    state.ran = index + 1
    missing = missing_requirements(source)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    try:
        _run(state, doc, line, source)
    except Exception:
        state.failed = f"{doc.name}:{line}"
        raise


def test_the_collector_finds_blocks_and_requirements(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\nx = 1\n```\n```sh\nls\n```\n"
                    "```python\n# requires: surely_not_a_module, os\ny = x\n```\n")
    blocks = python_blocks(page)
    assert [line for line, _ in blocks] == [3, 9]
    assert blocks[0][1] == "x = 1\n"
    assert missing_requirements(blocks[1][1]) == ["surely_not_a_module"]
    assert missing_requirements(blocks[0][1]) == []
