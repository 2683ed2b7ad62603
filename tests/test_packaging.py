"""Packaging: the build's setuptools floor, what the sdist holds, release builds
without debug info.  Needs the source tree (skips for an installed package)."""
import os
import re
import runpy
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if not (ROOT / "setup.py").is_file() or not (ROOT / "pyproject.toml").is_file():
    pytest.skip("needs the source tree (setup.py, pyproject.toml); the tests run from an "
                "installed package skip it", allow_module_level=True)

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = pytest.importorskip("tomli")


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def setuptools_floor(requirements):
    (req,) = [r for r in requirements if re.match(r"setuptools\b", r)]
    m = re.search(r">=\s*(\d+)", req)
    assert m, f"{req!r}: expected a >= floor"
    return int(m.group(1))


def test_setuptools_floor_allows_the_license_field():
    conf = pyproject()
    if isinstance(conf["project"].get("license"), str) or "license-files" in conf["project"]:
        # an SPDX license string and license-files need setuptools 77 (PEP 639)
        assert setuptools_floor(conf["build-system"]["requires"]) >= 77
        assert setuptools_floor(conf["project"]["optional-dependencies"]["test"]) >= 77
    for name in conf["project"].get("license-files", []):
        assert (ROOT / name).is_file(), f"license-files: {name} is missing"


def test_release_builds_drop_debug_info(monkeypatch):
    import setuptools

    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("GGMLOPT_DEBUG", raising=False)
    ns = runpy.run_path(str(ROOT / "setup.py"))
    if os.name == "nt":
        pytest.skip("POSIX compilers only")
    for ext in captured["ext_modules"]:
        assert "-g0" in ext.extra_compile_args, ext.name
    assert "-g0" in ns["BASE_CFLAGS"]   # the ISA units are compiled with BASE_CFLAGS too
    monkeypatch.setenv("GGMLOPT_DEBUG", "1")
    ns = runpy.run_path(str(ROOT / "setup.py"))
    assert "-g0" not in ns["BASE_CFLAGS"]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("sdist")
    proc = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation",
                           "--outdir", str(out), str(ROOT)], capture_output=True, text=True,
                          check=False, timeout=300)
    if proc.returncode != 0:
        pytest.skip(f"cannot build an sdist here: {proc.stderr.strip().splitlines()[-1:]}")
    (path,) = out.glob("*.tar.gz")
    with tarfile.open(path) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    return names, proc.stdout + proc.stderr


def test_sdist_holds_the_whole_test_suite_and_the_license(sdist):
    names, _ = sdist
    for f in sorted((ROOT / "tests").glob("*.py")):
        assert f"tests/{f.name}" in names
    for required in ("LICENSE", "CHANGELOG.md", "README.md", "setup.py", "pyproject.toml",
                     "ggmlopt/include/ggmlopt.h", "ggmlopt/py.typed"):
        assert required in names
    assert "x" not in names and not any(n.endswith((".so", ".o")) for n in names)


def test_build_warns_of_no_package_left_out(tmp_path):
    # build_py is where setuptools checks that data folders are listed packages
    proc = subprocess.run([sys.executable, "setup.py", "build_py", "-d", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "absent from the `packages` configuration" not in proc.stdout + proc.stderr
    assert (tmp_path / "ggmlopt" / "include" / "ggmlopt.h").is_file()
    assert (tmp_path / "ggmlopt" / "py.typed").is_file()


def test_no_stray_files_at_the_root():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    proc = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                          check=True)
    top = {p.split("/", 1)[0] for p in proc.stdout.splitlines()}
    assert top <= {".ci", ".gitignore", "CHANGELOG.md", "LICENSE", "MANIFEST.in", "README.md",
                   "bench", "csrc", "docs", "ggmlopt", "pyproject.toml", "setup.py", "tests"}, top
