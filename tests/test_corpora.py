"""python_docstrings: an offline corpus from the standard library's sources,
parsed (never imported), in a fixed order, skipping test suites."""
import pytest

from ggmlopt.corpora import python_docstrings

LONG = "This sentence is long enough to count as prose in the corpus."


def _tree(tmp_path):
    (tmp_path / "b.py").write_text(f'"""B module. {LONG}"""\ndef f():\n    """Short."""\n')
    (tmp_path / "a.py").write_text(
        f'"""A module. {LONG}"""\nclass C:\n    """C class. {LONG}"""\n'
        f'    def m(self):\n        """C.m method. {LONG}"""\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "z.py").write_text(f'"""Z in pkg. {LONG}"""\n')
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text(f'"""A test suite. {LONG}"""\n')
    (tmp_path / "bad.py").write_text("def (:\n")            # not Python: skipped
    (tmp_path / "boom.py").write_text("raise SystemExit('imported!')\n")  # never run
    return tmp_path


def test_docstrings_in_file_order_without_tests_or_short_ones(tmp_path):
    text = python_docstrings(stdlib=str(_tree(tmp_path)))
    docs = text.strip().split("\n\n")
    assert [d.split(".")[0] for d in docs] == ["A module", "C class", "C", "B module", "Z in pkg"]
    assert "Short" not in text and "test suite" not in text


def test_min_bytes_stops_early_and_refuses_too_little(tmp_path):
    root = str(_tree(tmp_path))
    assert python_docstrings(min_bytes=10, stdlib=root).count("\n\n") == 0
    with pytest.raises(ValueError, match="fewer than 100000"):
        python_docstrings(min_bytes=100_000, stdlib=root)
    with pytest.raises(ValueError, match="is not a folder"):
        python_docstrings(stdlib=str(tmp_path / "missing"))


def test_min_bytes_is_a_lower_bound_of_the_text_returned(tmp_path):
    # the text's own bytes: each docstring's separator counted once too often
    root = str(_tree(tmp_path))
    whole = len(python_docstrings(stdlib=root).encode())
    for n in range(1, whole + 1, 7):
        assert len(python_docstrings(min_bytes=n, stdlib=root).encode()) >= n
    assert len(python_docstrings(min_bytes=whole, stdlib=root).encode()) == whole
    with pytest.raises(ValueError, match=f"hold {whole} bytes, fewer than {whole + 1}"):
        python_docstrings(min_bytes=whole + 1, stdlib=root)


def test_the_real_library_gives_the_same_text_twice():
    a = python_docstrings(min_bytes=200_000)
    assert len(a.encode()) >= 200_000
    assert a == python_docstrings(min_bytes=200_000)
