"""The bf16 products (precision="bf16"): ggmlopt's own kernels
(kernels_gemm.gemm_bf16, on the active SIMD path: vdpbf16ps where the avx512
path runs on a CPU with AVX512-BF16, two FMAs a pair elsewhere) and MKL's,
through gemm.matmul_bf16 on each bf16 engine, against float64 products of the
same bf16 operands; the engine chosen per CPU and by GGMLOPT_GEMM_BF16.

A bf16 product is the float32 sum of exact products of the bf16 operands, so
it is within gamma_(k+1) of sum |a_ij b_jk| from the float64 product of those
operands (tests/product_bounds.py).  The operands are normal numbers:
vdpbf16ps flushes subnormals.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from product_bounds import assert_product_close, gamma, needs_mkl

from ggmlopt import gemm, kernels, kernels_gemm

F32 = np.float32
BF16_ENGINES = ["native", pytest.param("mkl", marks=needs_mkl)]


def bf16(x):
    return kernels.to_bfloat16(np.ascontiguousarray(x, F32))


def widened(bits):
    return (np.ascontiguousarray(bits).astype(np.uint32) << 16).view(F32).astype(np.float64)


def operand16(rng, rows, cols, transposed, scale=1.0):
    """A (rows, cols) operand of bf16 bits, as a transposed view when asked."""
    if transposed:
        return bf16(rng.standard_normal((cols, rows)) * scale).T
    return bf16(rng.standard_normal((rows, cols)) * scale)


@pytest.fixture(params=BF16_ENGINES)
def bf16_engine(request):
    before = gemm.use_bf16_engine(request.param)
    yield request.param
    gemm.use_bf16_engine(before)


# odd k, k past a chunk (1537: 514 + 514 + 509), rows around the tiles and a
# vector, columns around the panel (32 on AVX-512) and the column block (256),
# A's rows 16 KB apart (8192 values: its tiles packed from its rows), nine
# panels of many tiles (the threads split the rows) and a short k (blocks wider
# than 256 columns)
SHAPES = [(1, 1, 1), (7, 13, 5), (33, 17, 65), (128, 96, 1), (1, 300, 129), (64, 257, 31),
          (15, 1537, 33), (31, 8, 300), (45, 64, 8), (17, 2, 530), (9, 8192, 33),
          (430, 411, 288), (430, 410, 144), (50, 300, 600)]
THREAD_SHAPES = [(300, 1000, 200), (430, 411, 288), (430, 410, 144), (50, 300, 600)]
LAYOUTS = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("ta,tb", LAYOUTS)
def test_bf16_product_sums_exact_products_in_float32(bf16_engine, rng, m, k, n, ta, tb):
    a16 = operand16(rng, m, k, ta, scale=3.0)
    b16 = operand16(rng, k, n, tb)
    out = np.full((m, n), np.nan, F32)
    gemm.matmul_bf16(a16, b16, out)
    assert_product_close(out, widened(a16), widened(b16))
    base = rng.standard_normal((m, n), dtype=F32)
    acc = base.copy()
    gemm.matmul_bf16(a16, b16, acc, accumulate=True)
    assert_product_close(acc, widened(a16), widened(b16), base.astype(np.float64))


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("ta,tb", LAYOUTS)
def test_own_kernel_on_the_active_path(rng, m, k, n, ta, tb):
    """kernels_gemm.gemm_bf16 itself (the CI runs this file on every SIMD path),
    into rows of a wider array whose other columns it leaves alone."""
    a16, b16 = operand16(rng, m, k, ta), operand16(rng, k, n, tb)
    wide = np.full((m, n + 3), 5.0, F32)
    assert kernels_gemm.gemm_bf16(a16, b16, wide[:, 1:n + 1]) is not None
    assert_product_close(wide[:, 1:n + 1], widened(a16), widened(b16))
    assert (wide[:, 0] == 5).all() and (wide[:, n + 1:] == 5).all()


def test_bf16_product_is_not_a_float32_product(bf16_engine, rng):
    # the operands really are rounded: a float32 product of the unrounded values
    # misses the bf16 product by far more than float32 rounding
    a = rng.standard_normal((16, 64), dtype=F32)
    b = rng.standard_normal((64, 8), dtype=F32)
    out = np.empty((16, 8), F32)
    gemm.matmul_bf16(bf16(a), bf16(b), out)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(out - exact)) > 100 * gamma(64) * np.max(np.abs(a) @ np.abs(b))


@pytest.mark.parametrize("m,k,n", THREAD_SHAPES)
def test_own_kernel_gives_the_same_bits_on_any_number_of_threads(rng, m, k, n):
    a16, b16 = operand16(rng, m, k, False), operand16(rng, k, n, True)
    outs = []
    before = kernels.get_num_threads()
    try:
        for threads in (1, 2, 3):
            kernels.set_num_threads(threads)
            outs.append(kernels_gemm.gemm_bf16(a16, b16, np.empty((m, n), F32)))
    finally:
        kernels.set_num_threads(before)
    assert_product_close(outs[0], widened(a16), widened(b16))
    assert all(np.array_equal(o.view(np.uint32), outs[0].view(np.uint32)) for o in outs[1:])


def test_bf16_product_refuses_bad_operands(bf16_engine):
    out = np.zeros((2, 2), F32)
    with pytest.raises(TypeError, match="uint16"):
        gemm.matmul_bf16(np.zeros((2, 2), F32), np.zeros((2, 2), np.uint16), out)
    with pytest.raises(TypeError, match="out"):
        gemm.matmul_bf16(np.zeros((2, 2), np.uint16), np.zeros((2, 2), np.uint16),
                         np.zeros((2, 2)))
    with pytest.raises(ValueError, match="shapes"):
        gemm.matmul_bf16(np.zeros((2, 3), np.uint16), np.zeros((2, 2), np.uint16), out)
    with pytest.raises(ValueError, match="contiguous"):
        gemm.matmul_bf16(np.zeros((2, 4), np.uint16)[:, ::2], np.zeros((2, 2), np.uint16), out)
    assert (out == 0).all()


def test_own_kernel_names_the_argument_it_refuses():
    u16, out = np.zeros((3, 3), np.uint16), np.full((3, 3), 4.0, F32)
    cases = [
        ((np.zeros((3, 3), F32), u16, out), TypeError, "a16: expected dtype uint16"),
        ((u16, u16.astype(np.int16), out), TypeError, "b16: expected dtype uint16"),
        ((u16, u16, out.astype(np.float64)), TypeError, "out: expected dtype float32"),
        ((u16, np.zeros((2, 3), np.uint16), out), ValueError, "shapes"),
        ((u16, np.zeros((3, 6), np.uint16)[:, ::2], out), ValueError, "b16: expected contiguous"),
        ((np.zeros((3, 6), np.uint16)[:, ::2], u16, out), ValueError, "a16: expected contiguous"),
        ((u16, u16, out[:, ::-1]), ValueError, "out"),
        ((u16, u16, np.zeros(9, F32)), ValueError, "out: expected a 2-D array"),
    ]
    for args, kind, message in cases:
        with pytest.raises(kind, match=message):
            kernels_gemm.gemm_bf16(*args)
    assert (out == 4.0).all()
    # a row of one float seen 3 times (a zero column stride): the kernel would write
    # the 2 floats after it
    mem = np.full(4, 4.0, F32)
    row = np.lib.stride_tricks.as_strided(mem[:1], shape=(1, 3), strides=(12, 0), writeable=True)
    with pytest.raises(ValueError, match="out: expected rows of contiguous"):
        kernels_gemm.gemm_bf16(u16[:1], u16, row)
    assert (mem == 4.0).all()


@pytest.mark.parametrize("m,k,n", [(0, 4, 3), (3, 0, 4), (3, 4, 0)])
def test_bf16_product_of_empty_operands(bf16_engine, m, k, n):
    """Empty operands (NumPy gives them zero strides) make an empty product, or
    zeros when only the inner length is 0, as in float32."""
    out = np.full((m, n), 7.0, F32)
    gemm.matmul_bf16(np.zeros((m, k), np.uint16), np.zeros((k, n), np.uint16), out)
    assert (out == 0).all()
    out[...] = 7.0
    gemm.matmul_bf16(np.zeros((m, k), np.uint16), np.zeros((k, n), np.uint16), out,
                     accumulate=True)
    assert (out == 7.0).all()


@pytest.mark.parametrize("features,instruction,mkl,want", [
    (["amx_bf16", "avx512_bf16"], True, True, "mkl"),      # Sapphire Rapids with MKL: AMX
    (["amx_bf16", "avx512_bf16"], True, False, "native"),  # ... without it
    (["avx512_bf16"], True, True, "native"),               # Zen 4: vdpbf16ps beats MKL's
    (["avx512_bf16"], False, True, "mkl"),                 # the avx512 path pinned away
    (["avx512_bf16"], False, False, "native"),
    ([], False, True, "native"),                           # no bf16 products at all
])
def test_auto_picks_the_bf16_engine_for_the_cpu(monkeypatch, features, instruction, mkl, want):
    monkeypatch.setattr(gemm, "_cpu_bf16", lambda: (features, instruction))
    monkeypatch.setattr(gemm, "_load_mkl", lambda: object() if mkl else None)
    monkeypatch.setattr(gemm, "_bf16_choice", "auto")   # put back whatever the run chose
    assert gemm.bf16_engine() == want
    native, why = gemm.bf16_support()
    assert native == bool(features and (instruction or want == "mkl")), why
    if not features:
        assert "AVX512-BF16" in why
    elif not native:
        assert "no bf16 instruction" in why and "MKL is not installed" in why


def test_a_forced_native_engine_without_the_instruction_says_so(monkeypatch):
    # MKL may well be installed: the reason is the choice, not a missing MKL
    monkeypatch.setattr(gemm, "_cpu_bf16", lambda: (["avx512_bf16"], False))
    monkeypatch.setattr(gemm, "_bf16_choice", "native")
    native, why = gemm.bf16_support()
    assert not native and "GGMLOPT_GEMM_BF16=native" in why and "MKL" not in why


def test_a_pass_puts_back_the_engine_of_the_pass_around_it(monkeypatch):
    engines = iter(["native", "mkl"])
    monkeypatch.setattr(gemm, "bf16_engine", lambda: next(engines))
    with gemm.products_in("bf16"):
        with gemm.products_in("bf16"):
            assert gemm._pass.on_mkl
        assert gemm.bf16_active() and not gemm._pass.on_mkl
        with gemm.products_in("f32"):
            assert not gemm.bf16_active()
        assert gemm.bf16_active() and not gemm._pass.on_mkl
    assert not gemm.bf16_active() and not gemm._pass.on_mkl


def test_unknown_bf16_engine_is_refused():
    before = gemm.bf16_engine()
    with pytest.raises(ValueError, match="auto, native, mkl"):
        gemm.use_bf16_engine("amx")
    assert gemm.bf16_engine() == before


def run_import(value, hide_mkl=False):
    hide = ("import glob, ctypes.util\n"
            "g, f = glob.glob, ctypes.util.find_library\n"
            "glob.glob = lambda p, *a, **k: [] if 'mkl' in p else g(p, *a, **k)\n"
            "ctypes.util.find_library = lambda n: None if 'mkl' in n else f(n)\n") \
        if hide_mkl else ""
    code = hide + "import ggmlopt, ggmlopt.gemm as g; print(g.bf16_engine()); ggmlopt.show_config()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, GGMLOPT_GEMM_BF16=value, GGMLOPT_GEMM="numpy"),
                          check=False)


def test_environment_variable_picks_the_bf16_engine():
    bad = run_import("amx")
    assert bad.returncode != 0 and "ImportError: GGMLOPT_GEMM_BF16" in bad.stderr
    ok = run_import("native")
    assert ok.returncode == 0 and ok.stdout.splitlines()[0] == "native", ok.stderr
    assert "bf16 engine         : native [native;" in ok.stdout
    missing = run_import("mkl", hide_mkl=True)
    assert missing.returncode != 0
    assert "ImportError: GGMLOPT_GEMM_BF16=mkl" in missing.stderr and "pip install" in missing.stderr


@pytest.mark.parametrize("bf16_engine", BF16_ENGINES, indirect=True)
def test_float32_products_of_a_bf16_pass_go_where_its_bf16_products_go(bf16_engine, rng,
                                                                        monkeypatch):
    """Inside a bf16 pass a float32 product (an adapter's) runs on the bf16
    engine's library, not on NumPy's BLAS, whose threads would spin on the
    cores the next bf16 product needs."""
    seen = []
    real_native, real_call = gemm._native_sgemm, gemm._call
    monkeypatch.setattr(gemm, "_native_sgemm", lambda *a: seen.append("native") or real_native(*a))
    monkeypatch.setattr(gemm, "_call", lambda fn, *a: seen.append(
        "mkl" if gemm._mkl is not None and fn is gemm._mkl.sgemm else "blas") or real_call(fn, *a))
    before = gemm.use_engine("numpy")
    try:
        a, b = rng.standard_normal((64, 40), dtype=F32), rng.standard_normal((40, 24), dtype=F32)
        out = np.empty((64, 24), F32)
        with gemm.products_in("bf16"):
            gemm.matmul(a, b, out)
            # a few rows, and one row as a vector (a bias's sum), likewise
            gemm.matmul(a[:3], b, out[:3])
            gemm.matmul(a[5], b, out[5])
        assert seen == [bf16_engine] * 3
        assert_product_close(out, a.astype(np.float64), b.astype(np.float64))
        seen.clear()
        with gemm.products_in("f32"):    # a float32 pass keeps the float32 engine
            gemm.matmul(a, b, out)
        assert "native" not in seen and "mkl" not in seen
    finally:
        gemm.use_engine(before)


@pytest.mark.parametrize("which", ["a", "b"])
def test_bf16_product_into_an_operands_memory(bf16_engine, rng, which):
    # out's bytes are an operand's: the product of the operands as they were
    # before the call, or a refusal; never a product of half-written values (MKL
    # wrote over its operands at 512 and not below)
    m = k = n = 520
    a = operand16(rng, m, k, False)
    b = operand16(rng, k, n, False)
    want = widened(a) @ widened(b)
    store = np.zeros((m, n), F32)
    shared = store.view(np.uint16)[:, :k] if which == "a" else store.view(np.uint16)[:k, :n]
    shared[...] = a if which == "a" else b
    ops = (shared, b) if which == "a" else (a, shared)
    try:
        gemm.matmul_bf16(*ops, store)
    except ValueError as e:
        assert "out" in str(e) or "overlap" in str(e) or "share" in str(e)
        return
    assert_product_close(store, widened(a), widened(b))
    assert np.abs(store - want).max() < 1e-3 * np.abs(want).max()


def test_bf16_product_refuses_a_read_only_out(bf16_engine, rng):
    a, b = operand16(rng, 4, 6, False), operand16(rng, 6, 5, False)
    out = np.full((4, 5), 7.0, F32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        gemm.matmul_bf16(a, b, out)
    assert (out == 7.0).all()


def test_a_pass_takes_precision_names_and_refuses_others():
    with gemm.products_in("BFloat16"):
        assert gemm.bf16_active()
    with gemm.products_in("float32"):
        assert not gemm.bf16_active()
    for bad, err in (("fp16", ValueError), (None, TypeError), (16, TypeError)):
        with pytest.raises(err, match="precision"):
            gemm.products_in(bad)
    assert not gemm.bf16_active()


def test_a_bf16_pass_is_the_threads_own():
    # another thread's products stay float32 while this one is in a bf16 pass,
    # and the other's pass leaves this one's precision as it was
    import threading

    seen = {}
    inside, done = threading.Event(), threading.Event()

    def other():
        seen["before"] = gemm.bf16_active()
        inside.wait(10)
        seen["during"] = gemm.bf16_active()
        with gemm.products_in("bf16"):
            seen["own"] = gemm.bf16_active()
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with gemm.products_in("bf16"):
        inside.set()
        done.wait(10)
        assert gemm.bf16_active()
    t.join()
    assert seen == {"before": False, "during": False, "own": True}
    assert not gemm.bf16_active()
