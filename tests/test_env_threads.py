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


def test_the_default_threads_are_the_cpus_this_process_may_use(subprocess_env):
    # the affinity mask (taskset, a container's cpuset), as the BLAS counts them
    import os
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs sched_setaffinity and two CPUs")
    one = min(os.sched_getaffinity(0))
    unset = dict(subprocess_env)
    unset.pop("GGMLOPT_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, "-c", PRINT_THREADS], env=unset,
                          capture_output=True, text=True, timeout=60, check=False,
                          preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1"]


def test_the_variable_is_read_at_import_only(subprocess_env):
    # a value set afterwards (before the pool first runs) was read unchecked by the pool
    unset = dict(subprocess_env)
    unset.pop("GGMLOPT_NUM_THREADS", None)
    code = ("import os, ggmlopt; os.environ['GGMLOPT_NUM_THREADS'] = '1abc'; "
            "import numpy as np; ggmlopt.kernels.tanh(np.zeros(1 << 20, np.float32)); "
            "print(ggmlopt.get_num_threads())")
    want = run_python(PRINT_THREADS, unset)
    got = run_python(code, unset)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == want.stdout.split()


def test_ranks_share_the_cpus_of_the_mask_when_the_machine_has_more(subprocess_env):
    # the pool's default is the affinity mask's CPUs: ranks sharing a mask smaller than
    # the machine (a cpuset) split it, as they split a machine they have whole
    unset = dict(subprocess_env)
    unset.pop("GGMLOPT_NUM_THREADS", None)
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                 "BLIS_NUM_THREADS"):
        unset.pop(name, None)
    code = ("import os; os.cpu_count = lambda: 64\n"
            "from ggmlopt import distributed, kernels\n"
            "class TwoRanks:\n"
            "    def Get_size(self): return 2\n"
            "mask = len(os.sched_getaffinity(0))\n"
            "print(mask, distributed.auto_rank_threads(TwoRanks())[0])")
    proc = run_python(code, unset)
    assert proc.returncode == 0, proc.stderr
    mask, threads = (int(v) for v in proc.stdout.split())
    assert threads == max(1, mask // 2)
