"""Build: Cython extensions plus the C kernels in csrc/.

Only the AVX2 translation unit gets -mavx2 -mfma (and -mf16c for the float16
conversion), only the AVX-512 one -mavx512f/bw/dq/vl (and the unit of the bf16
products' vdpbf16ps those and -mavx512bf16); every other object is
compiled for the baseline ISA, so the package imports on any x86-64 and picks
the best path the CPU runs at run time.  On aarch64
the NEON unit is compiled instead (NEON is baseline there).
"""

import glob
import os
import platform

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.editable_wheel import editable_wheel

MACHINE = platform.machine().lower()
IS_X86_64 = MACHINE in ("x86_64", "amd64")
IS_AARCH64 = MACHINE in ("aarch64", "arm64")

INCLUDE_DIRS = ["ggmlopt/include", "csrc", np.get_include()]
# -fno-math-errno lets GCC vectorise the scalar fallback's sqrt; no -ffast-math:
# the kernels rely on IEEE inf/NaN handling.
BASE_CFLAGS = ["-O3", "-fno-math-errno", "-std=c11"] if os.name != "nt" else ["/O2"]
# Release builds carry no debug info (Python's own CFLAGS add -g; -g0 after it wins):
# the modules shrink to about a third.  GGMLOPT_DEBUG=1 keeps it for debugging.
if os.name != "nt" and not os.environ.get("GGMLOPT_DEBUG"):
    BASE_CFLAGS.append("-g0")

# Python's own CFLAGS carry -fwrapv (CPython relies on signed overflow wrapping);
# the SIMD units do not, and without it GCC keeps the GEMM tile's index arithmetic
# in registers (a 256 x 576 x 576 product on one core: 171-175 -> 181-186 GFLOP/s).
# Their C tests run under UBSan's signed-overflow check.
ISA_CFLAGS = ["-fno-wrapv"] if os.name != "nt" else []

KERNEL_SOURCES = ["csrc/dispatch.c", "csrc/threadpool.c", "csrc/kernels_scalar.c",
                  "csrc/quantize_k.c", "csrc/decode_block.c"]
# Sources compiled apart with their own ISA flags: {source: extra flags}.
ISA_SOURCES = {}
if IS_X86_64:
    ISA_SOURCES["csrc/kernels_avx2.c"] = ["-mavx2", "-mfma", "-mf16c"]
    ISA_SOURCES["csrc/kernels_avx512.c"] = [
        "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma", "-mf16c"]
    # the bf16 products' vdpbf16ps, taken only on CPUs that report AVX512-BF16
    ISA_SOURCES["csrc/kernels_avx512bf16.c"] = [
        "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma", "-mf16c", "-mavx512bf16"]
elif IS_AARCH64:
    KERNEL_SOURCES.append("csrc/kernels_neon.c")


class BuildExtWithIsaFlags(build_ext):
    """Compiles each ISA-specific C file with its own flags and links the objects in;
    the extensions build in parallel, one per core, unless --parallel says otherwise."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def build_extension(self, ext):
        if getattr(ext, "isa_sources", None):
            for src, flags in ext.isa_sources.items():
                objects = self.compiler.compile(
                    [src],
                    output_dir=self.build_temp,
                    include_dirs=ext.include_dirs,
                    extra_postargs=BASE_CFLAGS + ISA_CFLAGS + flags,
                    depends=glob.glob("csrc/**/*.h", recursive=True)
                    + glob.glob("csrc/**/*.inc", recursive=True)
                    + ["ggmlopt/include/ggmlopt.h"],
                )
                ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extension(ext)


class EditableWheelOnSysPath(editable_wheel):
    """`pip install -e .` puts the project folder on sys.path (setuptools' "compat"
    mode) instead of installing an import hook.  The hook comes after Python's own
    path search, so from the folder that holds the clone (itself named ggmlopt,
    without an __init__.py) `import ggmlopt` found the clone folder as an empty
    namespace package; with the project folder on sys.path the real package wins,
    as a regular package always does over a namespace one."""

    def initialize_options(self):
        super().initialize_options()
        self.mode = "compat"


def extensions():
    # the ISA units are linked as extra objects, which setuptools does not compare
    # with the built module: without them here an edit to one would not relink
    kernel_deps = (
        glob.glob("csrc/**/*.h", recursive=True)
        + glob.glob("csrc/**/*.inc", recursive=True)
        + ["ggmlopt/include/ggmlopt.h"]
        + list(ISA_SOURCES)
    )
    kernels = Extension(
        "ggmlopt.kernels",
        ["ggmlopt/kernels.pyx"] + KERNEL_SOURCES,
        include_dirs=INCLUDE_DIRS,
        extra_compile_args=BASE_CFLAGS,
        extra_link_args=["-pthread"] if os.name != "nt" else [],
        depends=kernel_deps,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    exts = [kernels]
    # Every other Cython module reaches the kernels through `cimport ggmlopt.kernels`
    # (one copy of the dispatch table and thread pool per process), so none of
    # them links csrc/ itself.
    for pyx in sorted(glob.glob("ggmlopt/*.pyx")):
        name = "ggmlopt." + os.path.splitext(os.path.basename(pyx))[0]
        if name == "ggmlopt.kernels":
            continue
        exts.append(
            Extension(
                name,
                [pyx],
                include_dirs=INCLUDE_DIRS,
                extra_compile_args=BASE_CFLAGS,
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            )
        )
    exts = cythonize(
        exts,
        nthreads=os.cpu_count() or 1,
        compiler_directives={
            "language_level": 3,
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "embedsignature": True,
        },
    )
    # set after cythonize, which rebuilds the Extension objects
    for ext in exts:
        ext.isa_sources = ISA_SOURCES if ext.name == "ggmlopt.kernels" else {}
    return exts


setup(ext_modules=extensions(),
      cmdclass={"build_ext": BuildExtWithIsaFlags, "editable_wheel": EditableWheelOnSysPath})
