"""`import ggmlopt` works from any folder, also the one that holds a clone of the
repository (a folder named ggmlopt without an __init__.py, which Python would
otherwise import as an empty namespace package)."""
import os
import subprocess
import sys

import pytest

import ggmlopt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = "import ggmlopt, sys; ggmlopt.Dataset; ggmlopt.fit; print(ggmlopt.__file__)"


def _import_from(cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_from_the_folder_that_holds_a_clone(tmp_path):
    clone = tmp_path / "ggmlopt"  # `git clone .../ggmlopt` makes this folder
    (clone / "ggmlopt").mkdir(parents=True)
    (clone / "README.md").write_text("# ggmlopt\n")
    (clone / "setup.py").write_text("")
    assert _import_from(tmp_path) == ggmlopt.__file__


@pytest.mark.skipif(not os.path.isfile(os.path.join(ROOT, "setup.py")),
                    reason="needs the source tree (runs from a checkout)")
def test_import_beside_this_checkout_named_ggmlopt(tmp_path):
    # the real checkout, seen from its parent under the name a clone gets
    os.symlink(ROOT, tmp_path / "ggmlopt")
    assert _import_from(tmp_path) == ggmlopt.__file__


def test_import_from_an_unrelated_folder(tmp_path):
    assert _import_from(tmp_path) == ggmlopt.__file__
