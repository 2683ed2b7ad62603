"""Fixtures shared by the kernel tests: SIMD paths, thread counts, awkward sizes,
unaligned placement and a reproducible random generator."""
import os
import sys
import zlib

import numpy as np
import pytest

import ggmlopt
from ggmlopt import kernels

# Sizes around every vector width (1, 4, 8 lanes, and the 2-vector unrolling),
# plus sizes past the thread pool's thresholds (elementwise 32768, reductions 65536).
SIZES = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 1000, 4097, 40_000, 300_001]
# Starting offsets (in elements) inside a bigger array: never 32-byte aligned for f32.
OFFSETS = [1, 2, 3]


def simd_path_params():
    """Every SIMD path compiled into this build, as pytest params: the ones this
    CPU cannot run (avx512 on an AVX2-only x86-64, say) skip, saying why."""
    runnable = kernels.simd_paths()
    info = kernels.simd_info()
    cpu = " ".join(k for k, v in info["cpu"].items() if v) or "no listed features"
    return [
        pytest.param(p, marks=pytest.mark.skipif(
            p not in runnable, reason=f"this CPU cannot run the {p} path (it has: {cpu})"))
        for p in reversed(info["compiled"])
    ]


@pytest.fixture(params=simd_path_params())
def simd_path(request):
    """Pins each compiled SIMD path in turn (skipping those this CPU cannot run);
    puts the previous one back after."""
    previous = kernels.use_simd(request.param)
    try:
        yield request.param
    finally:
        kernels.use_simd(previous)


@pytest.fixture
def restore_threads():
    """Lets a test change the kernel thread count; puts it back after."""
    before = kernels.get_num_threads()
    try:
        yield before
    finally:
        kernels.set_num_threads(before)


# (size, offset) pairs: every offset for the small sizes, one each for the large
# ones (they exist to cross the threading thresholds; alignment is the same story).
LAYOUTS = [(n, o) for n in SIZES if n < 10_000 for o in OFFSETS] + [
    (n, OFFSETS[i % len(OFFSETS)]) for i, n in enumerate(s for s in SIZES if s >= 10_000)]


@pytest.fixture(params=LAYOUTS, ids=[f"n{n}-o{o}" for n, o in LAYOUTS])
def layout(request):
    """(size, offset): an awkward element count and an unaligned start."""
    return request.param


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id: every test sees its own fixed data."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _place(values, offset):
    """A copy of values that starts offset elements into a bigger buffer, so the
    kernels see an unaligned start (and bytes before and after it to spoil)."""
    values = np.asarray(values)
    buf = np.full(values.size + offset + 3, 7, dtype=values.dtype)
    view = buf[offset:offset + values.size].reshape(values.shape)
    view[...] = values
    assert view.flags.c_contiguous
    return view


@pytest.fixture
def place():
    """place(values, offset) -> an unaligned C-contiguous copy of values."""
    return _place


@pytest.fixture(scope="session")
def package_parent():
    """The folder that holds the ggmlopt package being tested (for subprocesses)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(ggmlopt.__file__)))


@pytest.fixture
def subprocess_env(package_parent):
    """The environment for a child Python that must import this same ggmlopt."""
    env = dict(os.environ)
    env.pop("GGMLOPT_SIMD", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [package_parent] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


# On CPUs with AMX (Intel since Sapphire Rapids), llama.cpp repacks quantized
# weights into its AMX buffer type, whose matrix product segfaults on these small
# test models (llama.cpp issue #20824, open: the first decode of a Q8_0 model of
# width 64 crashes the process here).  There, llama.cpp's extra buffer types are
# turned off for every model these tests open (``use_extra_bufts``, llama.cpp's
# ``--no-extra-bufts``), so its plain CPU kernels compute the logits we compare
# with; everywhere else nothing changes.
@pytest.fixture(autouse=True, scope="session")
def _llama_cpp_without_amx_buffers():
    # the tests that use llama.cpp import it while they are collected, before this runs;
    # a session without them does not load it here
    capi = sys.modules.get("llama_cpp.llama_cpp")
    if capi is None or b"AMX_INT8 = 1" not in capi.llama_print_system_info():
        yield
        return
    default_params = capi.llama_model_default_params

    def without_extra_buffers():
        params = default_params()
        params.use_extra_bufts = False
        return params

    capi.llama_model_default_params = without_extra_buffers
    try:
        yield
    finally:
        capi.llama_model_default_params = default_params
