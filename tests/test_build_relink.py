"""setup.py: a change to any C file that goes into ggmlopt.kernels must relink it.

setuptools relinks an extension only when one of its sources or depends is newer
than the built module; the ISA units are compiled apart (their own flags) and
linked in as extra objects, which setuptools does not look at."""
import os
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if not (ROOT / "setup.py").is_file() or not (ROOT / "csrc").is_dir():
    pytest.skip("needs the source tree (setup.py, csrc/); the tests run from an installed "
                "package skip it", allow_module_level=True)

import setuptools  # after the skip: an installed package may lack it


def setup_py_extensions(monkeypatch):
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    monkeypatch.chdir(ROOT)
    namespace = runpy.run_path(str(ROOT / "setup.py"))
    return captured["ext_modules"], namespace


def test_every_c_file_of_the_kernels_extension_triggers_a_relink(monkeypatch):
    exts, ns = setup_py_extensions(monkeypatch)
    (kernels,) = [e for e in exts if e.name == "ggmlopt.kernels"]
    watched = {os.path.normpath(p) for p in list(kernels.sources) + list(kernels.depends)}
    compiled = {os.path.normpath(p) for p in list(ns["KERNEL_SOURCES"]) + list(ns["ISA_SOURCES"])}
    assert compiled <= watched, f"not watched: {sorted(compiled - watched)}"
