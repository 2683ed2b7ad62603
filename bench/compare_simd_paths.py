"""Every kernel on two SIMD paths, interleaved, on one thread: a markdown table of
medians and their ratio (below 1: the first path is faster).

    python bench/compare_simd_paths.py                     # avx512 against avx2
    python bench/compare_simd_paths.py --paths avx2 scalar "n=65536" "ce "

Positional arguments keep only the cases whose name contains one of them.
Sizes: 65536 floats (256 KB an array: the arrays live in L2), 1e6 (4 MB: L3),
and row shapes for the per-row kernels.  Arrays come from NumPy as allocated
(for large arrays 16-byte aligned, not 64).
"""
import argparse
import time

import numpy as np

from ggmlopt import kernels


def median_seconds(fn, reps=9, budget=0.004):
    """Median over reps rounds of the mean time of one call, each round ~budget s."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    inner = max(1, int(budget / max(one, 1e-7)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return float(np.median(times))


def flat_cases(n, rng):
    x = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    y = np.empty_like(x)
    w, m, v = x.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    u8 = rng.integers(0, 256, n, dtype=np.uint8)
    f16 = x.astype(np.float16)
    a, b = (rng.integers(0, 10, n).astype(np.int32) for _ in range(2))
    b1h, b2h = kernels.adamw_bias_corrections(0.9, 0.999, 10)
    return {
        "adamw_step": lambda: kernels.adamw_step(w, g, m, v, alpha=1e-3, beta1=0.9,
                                                 beta2=0.999, eps=1e-8, wd=0.01,
                                                 beta1h=b1h, beta2h=b2h),
        "sgd_step": lambda: kernels.sgd_step(w, g, alpha=1e-3),
        "axpy": lambda: kernels.axpy(0.5, x, y),
        "relu": lambda: kernels.relu(x, y),
        "relu_backward": lambda: kernels.relu_backward(x, g, y),
        "sum": lambda: kernels.sum(x),
        "sumsq": lambda: kernels.sumsq(x),
        "count_equal": lambda: kernels.count_equal(a, b),
        "to_float32 u8": lambda: kernels.to_float32(u8, y, scale=1 / 255),
        "to_float32 f16": lambda: kernels.to_float32(f16, y),
        "tanh": lambda: kernels.tanh(x, y),
        "sigmoid": lambda: kernels.sigmoid(x, y),
        "silu": lambda: kernels.silu(x, y),
        "gelu": lambda: kernels.gelu(x, y),
        "gelu_backward": lambda: kernels.gelu_backward(x, g, y),
        "gelu tanh": lambda: kernels.gelu(x, y, approximate="tanh"),
        "leaky_relu": lambda: kernels.leaky_relu(x, 0.01, y),
    }


def row_cases(rows, cols, rng):
    x = (3 * rng.standard_normal((rows, cols))).astype(np.float32)
    labels = rng.random((rows, cols), dtype=np.float32)
    labels /= labels.sum(axis=1, keepdims=True)
    classes = rng.integers(0, cols, rows).astype(np.int32)
    grad = np.empty_like(x)
    out = np.empty(rows, np.int32)
    bias = rng.standard_normal(cols).astype(np.float32)
    return {
        "cross_entropy": lambda: kernels.cross_entropy(x, labels, grad=grad),
        "cross_entropy classes": lambda: kernels.cross_entropy(x, classes, grad=grad),
        "argmax_rows": lambda: kernels.argmax_rows(x, out),
        "add_bias_rows": lambda: kernels.add_bias_rows(x, bias),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs=2, default=["avx512", "avx2"])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case")
    parser.add_argument("only", nargs="*", help="keep cases whose name contains one of these")
    args = parser.parse_args(argv)
    for p in args.paths:
        if p not in kernels.simd_paths():
            parser.error(f"this CPU cannot run {p!r} (it runs {kernels.simd_paths()})")
    rng = np.random.default_rng(0)
    cases = {}
    for n in (65_536, 1_000_000):
        cases.update({f"{k} n={n}": f for k, f in flat_cases(n, rng).items()})
    for shape in ((500, 10), (500, 100), (64, 32000)):
        cases.update({f"{k} {shape[0]}x{shape[1]}": f for k, f in row_cases(*shape, rng).items()})

    threads, before = kernels.get_num_threads(), kernels.simd_info()["active"]
    kernels.set_num_threads(1)
    first, second = args.paths
    print(f"| case (1 thread) | {first} | {second} | {first} / {second} |")
    print("|---|---|---|---|")
    try:
        for name, fn in cases.items():
            if args.only and not any(s in name for s in args.only):
                continue
            times = {p: [] for p in args.paths}
            for _ in range(args.rounds):
                for p in args.paths:
                    kernels.use_simd(p)
                    times[p].append(median_seconds(fn))
            a, b = (float(np.median(times[p])) for p in args.paths)
            print(f"| {name} | {a * 1e6:.2f} us | {b * 1e6:.2f} us | {a / b:.2f}x |")
    finally:
        kernels.use_simd(before)
        kernels.set_num_threads(threads)


if __name__ == "__main__":
    main()
