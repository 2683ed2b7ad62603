"""Choosing the SIMD path: CPU detection, use_simd, and the GGMLOPT_SIMD override
(read once, at import)."""
import ast
import subprocess
import sys

import numpy as np
import pytest

import ggmlopt
from ggmlopt import kernels

PRINT_INFO = "import ggmlopt; print(repr(ggmlopt.simd_info()))"


def run_python(code, env, **extra_env):
    env = dict(env, **extra_env)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def test_runnable_paths_end_with_scalar_and_are_compiled():
    paths = kernels.simd_paths()
    info = ggmlopt.simd_info()
    assert paths[-1] == "scalar"
    assert set(paths) <= set(info["compiled"])
    cpu = info["cpu"]
    if "avx2" in info["compiled"] and all(cpu.get(f) for f in ("avx", "avx2", "fma", "f16c",
                                                               "os_ymm")):
        assert "avx2" in paths
    avx512_flags = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "os_zmm")
    if "avx512" in info["compiled"] and "avx2" in paths:
        # runnable exactly when the CPU has all four extensions and the OS saves ZMM state
        assert ("avx512" in paths) == all(cpu.get(f) for f in avx512_flags), cpu
    if "avx512" in paths:
        assert paths.index("avx512") < paths.index("avx2")    # preferred over avx2


def test_use_simd_none_picks_the_best_path():
    previous = kernels.use_simd(None)
    try:
        assert kernels.simd_info()["active"] == kernels.simd_paths()[0]
    finally:
        kernels.use_simd(previous)


def test_the_fixture_pins_each_path(simd_path):
    assert kernels.simd_info()["active"] == simd_path


def test_paths_agree_to_float32_rounding(rng):
    # the paths differ in the last bits (FMA vs mul+add), never more
    x = rng.standard_normal((40, 33)).astype(np.float32)
    labels = rng.random((40, 33)).astype(np.float32)
    answers = {}
    previous = kernels.use_simd(None)
    try:
        for path in kernels.simd_paths():
            kernels.use_simd(path)
            grad = np.empty_like(x)
            answers[path] = kernels.cross_entropy(x, labels, grad), grad
    finally:
        kernels.use_simd(previous)
    loss0, grad0 = answers["scalar"]
    for loss, grad in answers.values():
        assert loss == pytest.approx(loss0, rel=1e-6)
        np.testing.assert_allclose(grad, grad0, rtol=1e-5, atol=1e-7)


def test_override_scalar_is_reported(subprocess_env):
    proc = run_python(PRINT_INFO, subprocess_env, GGMLOPT_SIMD="scalar")
    assert proc.returncode == 0, proc.stderr
    info = ast.literal_eval(proc.stdout.strip())
    assert info["active"] == "scalar"
    assert info["override"] == "scalar"


def test_without_override_the_best_path_is_active(subprocess_env):
    proc = run_python(PRINT_INFO, subprocess_env)
    assert proc.returncode == 0, proc.stderr
    info = ast.literal_eval(proc.stdout.strip())
    assert info["override"] is None
    assert info["active"] == kernels.simd_paths()[0]


def test_override_in_any_case(subprocess_env):
    # as GGMLOPT_GEMM's names: "AVX2" or " Scalar " pin the path, not an ImportError
    proc = run_python(PRINT_INFO, subprocess_env, GGMLOPT_SIMD=" Scalar ")
    assert proc.returncode == 0, proc.stderr
    info = ast.literal_eval(proc.stdout.strip())
    assert info["active"] == info["override"] == "scalar"
    previous = kernels.use_simd(kernels.simd_paths()[0].upper())
    try:
        assert kernels.simd_info()["active"] == kernels.simd_paths()[0]
    finally:
        kernels.use_simd(previous)


@pytest.mark.skipif("avx2" not in kernels.simd_paths(), reason="this CPU cannot run AVX2")
def test_override_avx2_is_reported(subprocess_env):
    proc = run_python(PRINT_INFO, subprocess_env, GGMLOPT_SIMD="avx2")
    assert proc.returncode == 0, proc.stderr
    assert ast.literal_eval(proc.stdout.strip())["active"] == "avx2"


@pytest.mark.skipif("avx512" not in kernels.simd_paths(),
                    reason="this CPU (or its OS) cannot run AVX-512 F/BW/DQ/VL")
def test_override_avx512_is_reported(subprocess_env):
    proc = run_python(PRINT_INFO, subprocess_env, GGMLOPT_SIMD="avx512")
    assert proc.returncode == 0, proc.stderr
    info = ast.literal_eval(proc.stdout.strip())
    assert info["active"] == "avx512" and info["override"] == "avx512"
    assert all(info["cpu"][f] for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl", "os_zmm"))


def test_avx512_is_the_default_where_the_cpu_runs_it(subprocess_env):
    proc = run_python(PRINT_INFO, subprocess_env)
    assert proc.returncode == 0, proc.stderr
    info = ast.literal_eval(proc.stdout.strip())
    assert "avx512" in info["compiled"] or "neon" in info["compiled"]
    expect = "avx512" if "avx512" in kernels.simd_paths() else kernels.simd_paths()[0]
    assert info["active"] == expect


def test_unknown_override_fails_at_import_with_a_clear_message(subprocess_env):
    proc = run_python("import ggmlopt", subprocess_env, GGMLOPT_SIMD="bogus")
    # a Python exception (exit status 1), not a signal
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:")
    assert "GGMLOPT_SIMD='bogus'" in last and "unknown" in last
    assert "scalar" in last                  # it lists what would be accepted


def test_override_for_a_path_this_machine_lacks_fails_at_import(subprocess_env):
    missing = [p for p in ("avx2", "neon", "avx512") if p not in kernels.simd_paths()]
    assert missing                           # x86-64 lacks neon, aarch64 lacks avx2
    proc = run_python("import ggmlopt", subprocess_env, GGMLOPT_SIMD=missing[0])
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and repr(missing[0]) in last


def test_the_override_reported_is_the_pin_in_force(subprocess_env):
    # GGMLOPT_SIMD pins at import; use_simd(None) unpins: simd_info says so (it kept
    # reporting the variable's value)
    code = ("from ggmlopt import kernels; kernels.use_simd(None); a = kernels.simd_info(); "
            "kernels.use_simd('scalar'); b = kernels.simd_info(); "
            "print(repr((a['override'], b['override'], b['active'])))")
    proc = run_python(code, subprocess_env, GGMLOPT_SIMD="scalar")
    assert proc.returncode == 0, proc.stderr
    assert ast.literal_eval(proc.stdout.strip()) == (None, "scalar", "scalar")


def test_show_config_loads_no_library_the_engines_do_not_use(subprocess_env):
    # asking for MKL's path loads MKL (and GNU OpenMP), whose threads fit then limits
    code = ("import io, ggmlopt; from ggmlopt import gemm; ggmlopt.show_config(io.StringIO()); "
            "print(gemm._mkl is None)")
    env = {k: v for k, v in subprocess_env.items() if k not in ("GGMLOPT_GEMM",
                                                                  "GGMLOPT_GEMM_BF16")}
    proc = run_python(code, env, GGMLOPT_GEMM="numpy", GGMLOPT_GEMM_BF16="native")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True"]
