"""The products' float32 engines (ggmlopt.gemm): NumPy's BLAS, MKL and
ggmlopt's own, against float64 references of the same operands (the bf16
products: test_kernels_gemm_bf16.py).

Each product within gamma_(k+1) of sum |a||b| (tests/product_bounds.py)."""
import os
import subprocess
import sys

import numpy as np
import pytest
from product_bounds import U, assert_product_close, needs_mkl

from ggmlopt import gemm, kernels

F32 = np.float32
ENGINES = ["numpy", pytest.param("mkl", marks=needs_mkl)]


@pytest.fixture(params=ENGINES)
def engine(request):
    before = gemm.use_engine(request.param)
    yield request.param
    gemm.use_engine(before)


def operand(rng, rows, cols, transposed):
    """A (rows, cols) float32 operand, as a transposed view when asked."""
    if transposed:
        return rng.standard_normal((cols, rows), dtype=F32).T
    return rng.standard_normal((rows, cols), dtype=F32)


SHAPES = [(1, 1, 1), (7, 13, 5), (33, 17, 65), (128, 96, 1), (1, 300, 129), (64, 257, 31)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_float32_product_on_each_engine(engine, rng, m, k, n, ta, tb):
    a, b = operand(rng, m, k, ta), operand(rng, k, n, tb)
    out = np.full((m, n), np.nan, F32)
    assert gemm.matmul(a, b, out) is out
    assert_product_close(out, a.astype(np.float64), b.astype(np.float64))


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_float32_product_accumulates(engine, rng, m, k, n):
    a, b = operand(rng, m, k, False), operand(rng, k, n, True)
    base = rng.standard_normal((m, n), dtype=F32)
    out = base.copy()
    gemm.matmul(a, b, out, accumulate=True)
    assert_product_close(out, a.astype(np.float64), b.astype(np.float64), base.astype(np.float64))


@pytest.mark.parametrize("ta,tb", [(False, False), (True, True)])
def test_accumulating_needs_no_temporary_where_the_blas_adds_in_place(engine, rng, ta, tb):
    """NumPy's bundled OpenBLAS (or MKL) adds into out (beta = 1): no array the
    size of out is made, and the sum is right (a gradient accumulated over a
    vocabulary-sized matrix would otherwise cost a second copy of it)."""
    import tracemalloc
    if not gemm.accumulates_in_place():
        pytest.skip("NumPy links a BLAS whose CBLAS ggmlopt does not find")
    m, k, n = 300, 7, 500
    a, b = operand(rng, m, k, ta), operand(rng, k, n, tb)
    base = rng.standard_normal((m, n), dtype=F32)
    out = base.copy()
    tracemalloc.start()
    gemm.matmul(a, b, out, accumulate=True)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < out.nbytes // 4
    assert_product_close(out, a.astype(np.float64), b.astype(np.float64), base.astype(np.float64))


def test_float32_product_into_rows_of_a_wider_array(engine, rng):
    # out with a row stride (a column block of a wider matrix) and empty inner length
    a, b = rng.standard_normal((9, 11), dtype=F32), rng.standard_normal((11, 6), dtype=F32)
    wide = np.full((9, 10), 5.0, F32)
    gemm.matmul(a, b, wide[:, 2:8])
    assert_product_close(wide[:, 2:8], a.astype(np.float64), b.astype(np.float64))
    assert (wide[:, :2] == 5).all() and (wide[:, 8:] == 5).all()
    out = np.full((3, 4), 2.0, F32)
    gemm.matmul(np.zeros((3, 0), F32), np.zeros((0, 4), F32), out)
    assert (out == 0).all()


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="numpy, mkl"):
        gemm.use_engine("blis")
    assert gemm.engine() in gemm.ENGINES


def run_import(env_value):
    env = dict(os.environ, GGMLOPT_GEMM=env_value)
    code = "import ggmlopt, ggmlopt.gemm as g; print(g.engine()); ggmlopt.show_config()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, check=False)


def test_environment_variable_picks_the_engine():
    bad = run_import("blis")
    assert bad.returncode != 0 and "GGMLOPT_GEMM" in bad.stderr and "ImportError" in bad.stderr
    ok = run_import("numpy")
    assert ok.returncode == 0 and ok.stdout.splitlines()[0] == "numpy"
    assert "GEMM engine         : numpy" in ok.stdout
    mkl = run_import("mkl")
    if gemm.mkl_library() is None:
        assert mkl.returncode != 0 and "pip install" in mkl.stderr
    else:
        assert mkl.returncode == 0 and mkl.stdout.splitlines()[0] == "mkl", mkl.stderr
        assert "GEMM engine         : mkl" in mkl.stdout


def test_precision_names():
    assert gemm.check_precision("bfloat16") == "bf16"
    assert gemm.check_precision("F32") == "f32"
    with pytest.raises(ValueError, match="precision"):
        gemm.check_precision("fp16")
    for bad in (16, None, b"bf16", ["bf16"]):   # not a name at all: a bad type
        with pytest.raises(TypeError, match="precision: expected a str"):
            gemm.check_precision(bad)


ALL_ENGINES = ["numpy", "native", pytest.param("mkl", marks=needs_mkl)]


@pytest.mark.parametrize("name", ALL_ENGINES)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("which", ["a", "b", "b.T", "a shifted"])
def test_out_sharing_memory_with_an_operand_gets_the_true_product(name, accumulate, which, rng):
    """The engines read a and b while they write out: an out that is (or overlaps)
    an operand gets the product of the operands as they were, as np.matmul gives."""
    before = gemm.use_engine(name)
    try:
        n = 17
        buf = rng.standard_normal((n + 1, n), dtype=F32)
        a, b = buf[:n], rng.standard_normal((n, n), dtype=F32)
        if which == "b.T":
            b = rng.standard_normal((n, n), dtype=F32).T
        out = {"a": a, "b": b, "b.T": b.T if which == "b.T" else None,
               "a shifted": buf[1:]}[which]
        if which == "b.T":
            out = np.ascontiguousarray(b.T)   # rows of its own: then alias it
            b = out.T
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        base = out.astype(np.float64) if accumulate else None
        gemm.matmul(a, b, out, accumulate=accumulate)
        assert_product_close(out, a64, b64, base)
    finally:
        gemm.use_engine(before)


@pytest.mark.parametrize("m,k", [(16, 16), (33, 20), (16, 1), (1, 16), (9, 300)])
def test_broadcast_operand_on_the_native_engine(m, k, rng):
    """A broadcast a (stride 0 along an axis of several elements) is read as
    the values it shows, by the engine and by kernels_gemm.sgemm."""
    from ggmlopt.kernels_gemm import sgemm

    before = gemm.use_engine("native")
    try:
        col = rng.standard_normal((m, 1), dtype=F32)
        row = rng.standard_normal((1, k), dtype=F32)
        b = rng.standard_normal((k, 9), dtype=F32)
        for a in (np.broadcast_to(col, (m, k)), np.broadcast_to(row, (m, k))):
            for run in (gemm.matmul, sgemm):
                out = np.full((m, 9), np.nan, F32)
                run(a, b, out)
                assert_product_close(out, a.astype(np.float64), b.astype(np.float64))
    finally:
        gemm.use_engine(before)


def test_show_config_says_where_the_engine_came_from(capsys):
    import ggmlopt

    # an engine other than the one GGMLOPT_GEMM (or the default) names
    other = "numpy" if gemm._engine_from_env() == "native" else "native"
    before = gemm.use_engine(other)
    try:
        ggmlopt.show_config()
        line = next(x for x in capsys.readouterr().out.splitlines() if "GEMM engine" in x)
        assert f": {other}" in line and "set by ggmlopt.gemm.use_engine" in line
    finally:
        gemm.use_engine(before)
    env = dict(os.environ, GGMLOPT_GEMM="numpy")
    code = ("import ggmlopt, ggmlopt.gemm as g; g.use_engine('native'); ggmlopt.show_config()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    line = next(x for x in run.stdout.splitlines() if "GEMM engine" in x)
    assert ": native" in line and "use_engine" in line and "set by GGMLOPT_GEMM" not in line
    # the variable's engine set again (a save and restore) is still the variable's
    env = dict(os.environ, GGMLOPT_GEMM="native")
    code = ("import ggmlopt, ggmlopt.gemm as g; g.use_engine(g.use_engine('numpy')); "
            "ggmlopt.show_config()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    line = next(x for x in run.stdout.splitlines() if "GEMM engine" in x)
    assert ": native" in line and "set by GGMLOPT_GEMM" in line


def test_missing_mkl_named_by_the_variable():
    """GGMLOPT_GEMM=mkl without MKL (hidden from the search) stops the import
    with a message naming the variable and how to install MKL."""
    code = ("import glob, ctypes.util\n"
            "g, f = glob.glob, ctypes.util.find_library\n"
            "glob.glob = lambda p, *a, **k: [] if 'mkl' in p else g(p, *a, **k)\n"
            "ctypes.util.find_library = lambda n: None if 'mkl' in n else f(n)\n"
            "import ggmlopt\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, GGMLOPT_GEMM="mkl"), check=False)
    assert run.returncode != 0
    assert "ImportError: GGMLOPT_GEMM=mkl" in run.stderr and "pip install" in run.stderr


def test_bf16_support_says_why_not(monkeypatch):
    monkeypatch.setattr(kernels, "simd_info", lambda: {"cpu": {"avx2": True}})
    native, why = gemm.bf16_support()
    assert not native and "AVX512-BF16" in why


@needs_mkl
def test_a_row_vector_product_goes_to_mkl(rng, monkeypatch):
    # the bias gradient's ones @ g: on MKL too (a 0-stride view would fall back)
    before = gemm.use_engine("mkl")
    try:
        calls = []
        real = gemm._call
        monkeypatch.setattr(gemm, "_call", lambda *a: calls.append(a[0]) or real(*a))
        ones = np.ones(9, F32)
        g = rng.standard_normal((9, 4), dtype=F32)
        out = np.empty(4, F32)
        gemm.matmul(ones, g, out)
        assert calls, "the product did not reach MKL"
        assert_product_close(out[None], ones[None].astype(np.float64), g.astype(np.float64))
    finally:
        gemm.use_engine(before)


@needs_mkl
def test_mkl_s_64_bit_interface_setting_is_overridden():
    # MKL_INTERFACE_LAYER=ILP64 would make MKL read the 32-bit sizes as 64-bit ones
    env = dict(os.environ, MKL_INTERFACE_LAYER="ILP64", GGMLOPT_GEMM="mkl")
    code = ("import numpy as np; from ggmlopt import gemm; r = np.random.default_rng(0); "
            "a = r.random((33, 17), dtype=np.float32); b = r.random((17, 5), dtype=np.float32); "
            "o = np.empty((33, 5), np.float32); gemm.matmul(a, b, o); "
            "print(float(np.abs(o - a.astype(float) @ b).max()))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=False)
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) < 18 * U * 17


def test_engine_names_as_the_environment_reads_them():
    before = gemm.use_engine(" NumPy ")
    try:
        assert gemm.engine() == "numpy"
        with pytest.raises(TypeError, match="name: expected a str"):
            gemm.use_engine(3)
        assert gemm.engine() == "numpy"
        bf16_before = gemm.use_bf16_engine(" Native")
        assert gemm.use_bf16_engine(bf16_before) == "native"
        with pytest.raises(TypeError, match="name: expected a str"):
            gemm.use_bf16_engine(b"native")
    finally:
        gemm.use_engine(before)


def test_a_path_switched_by_another_thread_leaves_a_running_product_whole():
    # a product sizes its panels and runs its blocks on one path: a switch in between
    # (kernels.use_simd from another thread) gave blocks of another panel width
    import threading
    import time

    from ggmlopt import kernels_gemm
    previous = kernels.use_simd(None)
    paths = []
    for p in ("avx2", "scalar", "avx512", "neon"):
        try:
            kernels.use_simd(p)
            paths.append(p)
        except (ValueError, RuntimeError):
            pass   # not compiled in, or not this CPU's
    kernels.use_simd(previous)
    if len(paths) < 2:
        pytest.skip("one SIMD path on this CPU")
    rng = np.random.default_rng(0)
    ops = [(rng.standard_normal((m, k), dtype=np.float32),
            rng.standard_normal((k, n), dtype=np.float32))
           for m, k, n in ((200, 300, 48), (130, 257, 80), (300, 96, 272))]
    wrong, stop = [], threading.Event()

    def multiply():
        while not stop.is_set():
            for a, b in ops:
                out = np.empty((a.shape[0], b.shape[1]), np.float32)
                kernels_gemm.sgemm(a, b, out)
                err = np.abs(out - a.astype(np.float64) @ b).max()
                if not err <= 1e-3:
                    wrong.append(err)

    previous = kernels.use_simd(paths[0])
    worker = threading.Thread(target=multiply)
    worker.start()
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            for p in paths:
                kernels.use_simd(p)
                time.sleep(0.0005)
    finally:
        stop.set()
        worker.join()
        kernels.use_simd(previous)
    assert wrong == []


FORKED_PRODUCT = """
import multiprocessing as mp, sys
import numpy as np
from ggmlopt import gemm
a, b = np.ones((64, 256), np.float32), np.ones((256, 256), np.float32)
def product():
    out = np.empty((64, 256), np.float32)
    gemm.matmul(a, b, out)
    sys.exit(0 if out[0, 0] == 256 else 3)
if __name__ == "__main__":
    out = np.empty((64, 256), np.float32)
    gemm.matmul(a, b, out)             # the parent's threads run first
    child = mp.get_context("fork").Process(target=product)
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
    print(child.exitcode)
"""


@needs_mkl
def test_a_forked_child_multiplies_on_mkl(tmp_path, subprocess_env):
    # GNU OpenMP's threads (MKL's default layer here) do not survive a fork: the
    # child's first product waited for them forever
    script = tmp_path / "forked.py"
    script.write_text(FORKED_PRODUCT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=False, env={**subprocess_env, "GGMLOPT_GEMM": "mkl"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0"]


def test_use_engine_by_name_reads_no_variable_set_since_import(monkeypatch):
    # GGMLOPT_GEMM is read at import: a bad value set later does not stop a call naming
    # the engine
    previous = gemm.use_engine("numpy")
    monkeypatch.setenv("GGMLOPT_GEMM", "bogus")
    try:
        assert gemm.use_engine("native") == "numpy" and gemm.engine() == "native"
        assert gemm.engine_source() == "call"
    finally:
        monkeypatch.delenv("GGMLOPT_GEMM")
        gemm.use_engine(previous)
