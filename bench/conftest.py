"""Shared set-up for the kernel benchmarks (pytest-benchmark).

Each case puts ggmlopt and its baseline in one benchmark group, so one run
measures both under the same machine load.  ``measure`` picks rounds and
iterations from a quick calibration so a fast kernel is timed over many calls
and a slow one over a few; the report (bench/report.py) compares medians.

Run from the repository root (so the in-place build is imported):

    python -m pytest bench --benchmark-only --benchmark-json=bench.json
    python bench/report.py bench.json
"""
import os
import time

import numpy as np
import pytest

from ggmlopt import kernels

# Time budget of one case (ggmlopt or baseline), in seconds; slow calls are
# capped by MIN_ROUNDS instead.
CASE_SECONDS = float(os.environ.get("GGMLOPT_BENCH_SECONDS", "0.6"))
ROUND_SECONDS = 0.002  # one round lasts about this long: timer resolution is negligible
MIN_ROUNDS = 5
MAX_ROUNDS = 400


def measure(benchmark, fn, *, case, role, label, target=None, items=None, bytes_moved=None,
            ns_per_item_max=None):
    """Time fn() with benchmark.pedantic and record what the report needs.

    case: the comparison this timing belongs to (also the benchmark group).
    role: "ggmlopt", "baseline" (compared with ggmlopt) or "reference" (shown
      for scale, e.g. the machine's copy bandwidth).
    label: what was timed, as the table shows it.
    target: on a baseline, the highest allowed ggmlopt/baseline ratio of medians.
    items: elements processed per call (for ns per item).
    bytes_moved: memory traffic per call (for GB/s).
    ns_per_item_max: on ggmlopt, an absolute target in ns per item.
    """
    benchmark.group = case
    benchmark.extra_info.update(case=case, role=role, label=label)
    if target is not None:
        benchmark.extra_info["target_ratio"] = target
    if items is not None:
        benchmark.extra_info["items"] = int(items)
    if bytes_moved is not None:
        benchmark.extra_info["bytes"] = int(bytes_moved)
    if ns_per_item_max is not None:
        benchmark.extra_info["target_ns_per_item"] = ns_per_item_max

    # Calibrate on warm calls: the first call may fault pages in or start threads.
    fn()
    calls = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        calls.append(time.perf_counter() - t0)
    one = max(sorted(calls)[1], 1e-7)
    iterations = max(1, int(ROUND_SECONDS / one))
    rounds = int(CASE_SECONDS / (one * iterations))
    rounds = min(MAX_ROUNDS, max(MIN_ROUNDS, rounds))
    warmup = 1 if one > 0.05 else 3
    return benchmark.pedantic(fn, rounds=rounds, iterations=iterations, warmup_rounds=warmup)


@pytest.fixture
def threads():
    """threads(n): run both ggmlopt and torch (when imported) on n threads for
    this test; the previous counts come back afterwards."""
    before = kernels.get_num_threads()
    torch_before = None

    def set_threads(n):
        nonlocal torch_before
        kernels.set_num_threads(n)
        try:
            import torch
        except ImportError:
            return
        if torch_before is None:
            torch_before = torch.get_num_threads()
        torch.set_num_threads(n)

    yield set_threads
    kernels.set_num_threads(before)
    if torch_before is not None:
        import torch

        torch.set_num_threads(torch_before)


@pytest.fixture
def avx2_instead_of_avx512():
    """Pins the avx2 path for this test, to time it against avx512 in the same
    run; skips where avx512 is not the active path (it would time avx2 twice)."""
    if kernels.simd_info()["active"] != "avx512":
        pytest.skip("the avx512-vs-avx2 comparison needs the avx512 path active")
    previous = kernels.use_simd("avx2")
    yield
    kernels.use_simd(previous)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


_loadavg_at_start = None


def pytest_sessionstart(session):
    global _loadavg_at_start
    _loadavg_at_start = os.getloadavg()


def pytest_benchmark_update_machine_info(config, machine_info):
    """Record the SIMD path, thread counts and load, so a table says what it measured."""
    info = kernels.simd_info()
    machine_info["ggmlopt"] = {
        "simd_active": info["active"],
        "simd_compiled": info["compiled"],
        "simd_override": info["override"],
        "cpu_features": info["cpu"],
        "num_threads": kernels.get_num_threads(),
        "numpy": np.__version__,
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": _loadavg_at_start,
    }
    try:
        import torch

        machine_info["ggmlopt"]["torch"] = torch.__version__
        machine_info["ggmlopt"]["torch_num_threads"] = torch.get_num_threads()
    except ImportError:
        machine_info["ggmlopt"]["torch"] = None


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["machine_info"].setdefault("ggmlopt", {})["loadavg_at_end"] = os.getloadavg()
