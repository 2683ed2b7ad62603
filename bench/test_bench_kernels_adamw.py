"""AdamW step over one flat float32 array: ggmlopt against torch's fused AdamW,
a careful in-place NumPy AdamW, its own avx2 path (when avx512 is active), and
the memory wall: at 1e6 the same seven streams with no arithmetic
(bench/stream_wall.c), at 5e7 the machine's copy bandwidth."""
import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import measure

from ggmlopt import kernels

ALPHA, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01
ITERATION = 10  # any t >= 1: the cost does not depend on it

# N -> highest allowed time ratio against torch.optim.AdamW(fused=True)
TORCH_TARGETS = {100_000: 0.4, 1_000_000: 0.6, 50_000_000: 1.0}
NUMPY_TARGETS = {1_000_000: 1 / 8}  # at least 8x faster than in-place NumPy
BYTES_PER_PARAM = 28  # read w, g, m, v; write w, m, v: 7 float32


# Also timed with both libraries on one thread: on a loaded machine torch's
# OpenMP threads suffer most, and one thread compares the kernels themselves.
ONE_THREAD_SIZES = [100_000, 1_000_000]


def case_name(n, nthreads=None):
    name = f"adamw n={n:.0e}".replace("e+0", "e")
    return name if nthreads is None else f"{name}, {nthreads} thread"


def make_state(n, rng):
    w = rng.standard_normal(n, dtype=np.float32)
    g = rng.standard_normal(n, dtype=np.float32)
    m = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    return w, g, m, v


def numpy_adamw(w, g, m, v, tmp, beta1h, beta2h):
    """AdamW with in-place ufuncs and one scratch array: no temporaries."""
    m *= BETA1
    np.multiply(g, 1 - BETA1, out=tmp)
    m += tmp
    v *= BETA2
    np.multiply(g, g, out=tmp)
    tmp *= 1 - BETA2
    v += tmp
    np.multiply(v, beta2h, out=tmp)
    np.sqrt(tmp, out=tmp)
    tmp += EPS
    np.divide(m, tmp, out=tmp)
    tmp *= ALPHA * beta1h
    w *= 1 - ALPHA * WD
    w -= tmp


def adamw_step_on(state):
    """One ggmlopt AdamW step over state = (w, g, m, v), as a function of nothing."""
    w, g, m, v = state
    b1h, b2h = kernels.adamw_bias_corrections(BETA1, BETA2, ITERATION)

    def step():
        kernels.adamw_step(w, g, m, v, alpha=ALPHA, beta1=BETA1, beta2=BETA2, eps=EPS, wd=WD,
                           beta1h=b1h, beta2h=b2h)

    return step


SIZES = [(n, None) for n in sorted(TORCH_TARGETS)] + [(n, 1) for n in ONE_THREAD_SIZES]


@pytest.mark.parametrize("n, nthreads", SIZES)
def test_adamw_ggmlopt(benchmark, n, nthreads, rng, threads):
    if nthreads:
        threads(nthreads)
    step = adamw_step_on(make_state(n, rng))
    measure(benchmark, step, case=case_name(n, nthreads), role="ggmlopt",
            label="ggmlopt.adamw_step", items=n, bytes_moved=BYTES_PER_PARAM * n)


@pytest.mark.parametrize("n, nthreads", SIZES)
def test_adamw_ggmlopt_on_avx2(benchmark, n, nthreads, rng, threads, avx2_instead_of_avx512):
    """The same step on the avx2 path: the ratio is avx512 / avx2."""
    if nthreads:
        threads(nthreads)
    step = adamw_step_on(make_state(n, rng))
    measure(benchmark, step, case=case_name(n, nthreads), role="baseline",
            label="ggmlopt.adamw_step on the avx2 path", items=n,
            bytes_moved=BYTES_PER_PARAM * n)


@pytest.mark.parametrize("n, nthreads", SIZES)
def test_adamw_torch_fused(benchmark, n, nthreads, rng, threads):
    torch = pytest.importorskip("torch")
    if nthreads:
        threads(nthreads)
    w, g, _, _ = make_state(n, rng)
    p = torch.nn.Parameter(torch.from_numpy(w))
    p.grad = torch.from_numpy(g)
    opt = torch.optim.AdamW([p], lr=ALPHA, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD,
                            fused=True)
    measure(benchmark, opt.step, case=case_name(n, nthreads), role="baseline",
            label="torch AdamW(fused=True).step",
            # the targets are for the default thread count; one thread is shown
            target=None if nthreads else TORCH_TARGETS[n], items=n,
            bytes_moved=BYTES_PER_PARAM * n)


@pytest.mark.parametrize("n", sorted(NUMPY_TARGETS))
def test_adamw_numpy(benchmark, n, rng):
    w, g, m, v = make_state(n, rng)
    tmp = np.empty_like(w)
    b1h, b2h = kernels.adamw_bias_corrections(BETA1, BETA2, ITERATION)
    measure(benchmark, lambda: numpy_adamw(w, g, m, v, tmp, b1h, b2h), case=case_name(n),
            role="baseline", label="NumPy in-place AdamW", target=NUMPY_TARGETS[n], items=n)


def test_copy_bandwidth(benchmark):
    """np.copyto of the largest AdamW size: the memory wall, counting read + write."""
    n = max(TORCH_TARGETS)
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    measure(benchmark, lambda: np.copyto(dst, src), case=case_name(n), role="reference",
            label="np.copyto (read+write)", items=n, bytes_moved=2 * 4 * n)


@pytest.fixture(scope="module")
def stream_same_bytes(tmp_path_factory):
    """bench/stream_wall.c built for this CPU, or a skip without gcc/OpenMP."""
    if shutil.which("gcc") is None:
        pytest.skip("the memory-wall reference needs gcc")
    lib = tmp_path_factory.mktemp("wall") / "stream_wall.so"
    src = Path(__file__).with_name("stream_wall.c")
    proc = subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
                           str(src), "-o", str(lib)], check=False, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"could not build the memory-wall reference: {proc.stderr[-300:]}")
    # idle OpenMP workers spin for ~ms by default, starving ggmlopt's and torch's
    # threads on a 2-core machine; a short spin, like ggmlopt's own pool
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    fn = ctypes.CDLL(str(lib)).stream_same_bytes
    ptr = ctypes.POINTER(ctypes.c_float)
    fn.argtypes = [ctypes.c_int64, ptr, ptr, ptr, ptr, ctypes.c_int]
    fn.restype = None
    return lambda n, *arrays, nthreads: fn(n, *(a.ctypes.data_as(ptr) for a in arrays),
                                           nthreads)


@pytest.mark.parametrize("n, nthreads", [(1_000_000, None), (1_000_000, 1)])
def test_adamw_memory_wall(benchmark, n, nthreads, rng, stream_same_bytes):
    """AdamW's seven streams (read w, g, m, v; write w, m, v) with one add each,
    on as many threads as ggmlopt uses: what moving those bytes costs here."""
    w, _, m, v = make_state(n, rng)
    # adding 0 keeps every value (and the cost) unchanged; written, not np.zeros,
    # whose untouched pages all map the one zero page and would read from cache
    g = np.empty(n, np.float32)
    g[:] = 0.0
    nt = nthreads or kernels.get_num_threads()
    measure(benchmark, lambda: stream_same_bytes(n, w, g, m, v, nthreads=nt),
            case=case_name(n, nthreads), role="reference",
            label=f"same 7 streams, 1 add each (C, OpenMP, {nt} thread)", items=n,
            bytes_moved=BYTES_PER_PARAM * n)


def test_numpy_adamw_matches_kernel(rng):
    """The NumPy baseline computes the same step (else the comparison is moot)."""
    w, g, m, v = make_state(1000, rng)
    w2, m2, v2 = w.copy(), m.copy(), v.copy()
    b1h, b2h = kernels.adamw_bias_corrections(BETA1, BETA2, ITERATION)
    kernels.adamw_step(w, g, m, v, alpha=ALPHA, beta1=BETA1, beta2=BETA2, eps=EPS, wd=WD,
                       beta1h=b1h, beta2h=b2h)
    numpy_adamw(w2, g, m2, v2, np.empty_like(w2), b1h, b2h)
    # rtol 1e-4: the kernel forms 1 - beta2 in float32 (as ggml does), NumPy in double
    np.testing.assert_allclose(w, w2, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(m, m2, rtol=1e-4)
    np.testing.assert_allclose(v, v2, rtol=1e-4)
