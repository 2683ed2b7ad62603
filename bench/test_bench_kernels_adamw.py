"""AdamW step over one flat float32 array: ggmlopt against torch's fused AdamW,
a careful in-place NumPy AdamW, and (at 5e7) the machine's copy bandwidth."""
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


SIZES = [(n, None) for n in sorted(TORCH_TARGETS)] + [(n, 1) for n in ONE_THREAD_SIZES]


@pytest.mark.parametrize("n, nthreads", SIZES)
def test_adamw_ggmlopt(benchmark, n, nthreads, rng, threads):
    if nthreads:
        threads(nthreads)
    w, g, m, v = make_state(n, rng)
    b1h, b2h = kernels.adamw_bias_corrections(BETA1, BETA2, ITERATION)

    def step():
        kernels.adamw_step(w, g, m, v, alpha=ALPHA, beta1=BETA1, beta2=BETA2, eps=EPS, wd=WD,
                           beta1h=b1h, beta2h=b2h)

    measure(benchmark, step, case=case_name(n, nthreads), role="ggmlopt",
            label="ggmlopt.adamw_step", items=n, bytes_moved=BYTES_PER_PARAM * n)


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
