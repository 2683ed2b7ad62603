"""GGMLOPT_NUM_THREADS is checked at import like GGMLOPT_SIMD: a value that is not
a whole number of threads from 1 to 64 stops the import with a message naming
the variable (it used to be ignored or clamped without a word)."""
import subprocess
import sys

import pytest

PRINT_THREADS = "import ggmlopt; print(ggmlopt.get_num_threads())"


def run_python(code, env, **extra_env):
    env = dict(env, **extra_env)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize("value", ["1", "3", " 2 ", "64"])
def test_a_good_thread_count_is_used(subprocess_env, value):
    proc = run_python(PRINT_THREADS, subprocess_env, GGMLOPT_NUM_THREADS=value)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [value.strip()]


@pytest.mark.parametrize("value,why", [
    ("abc", "whole number"), ("2.5", "whole number"), ("0", "got 0"), ("-3", "got -3"),
    ("1000", "from 1 to 64, got 1000"),
])
def test_a_bad_thread_count_stops_the_import(subprocess_env, value, why):
    proc = run_python("import ggmlopt", subprocess_env, GGMLOPT_NUM_THREADS=value)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: GGMLOPT_NUM_THREADS=")
    assert repr(value) in last and why in last


def test_an_empty_value_means_unset(subprocess_env):
    unset = dict(subprocess_env)
    unset.pop("GGMLOPT_NUM_THREADS", None)
    want = run_python(PRINT_THREADS, unset)
    got = run_python(PRINT_THREADS, unset, GGMLOPT_NUM_THREADS="")
    assert got.returncode == 0 and got.stdout == want.stdout
