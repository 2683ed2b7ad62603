"""Build and run-time information: where the C header is, what SIMD paths exist."""
from __future__ import annotations

import os
import sys
from typing import TextIO

from . import kernels


def get_include() -> str:
    """The folder holding ggmlopt.h, for C or Cython code that uses the kernels
    (``include_dirs=[ggmlopt.get_include()]``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


def show_config(file: TextIO | None = None) -> None:
    """Print what was compiled, what the CPU offers, what is active and what
    overrode it (the GGMLOPT_SIMD environment variable)."""
    file = sys.stdout if file is None else file
    info = kernels.simd_info()
    cpu = " ".join(f"{k}={'yes' if v else 'no'}" for k, v in info["cpu"].items()) or "(none)"
    print("ggmlopt configuration", file=file)
    print(f"  SIMD paths compiled : {', '.join(info['compiled'])}", file=file)
    print(f"  CPU features        : {cpu}", file=file)
    print(f"  active path         : {info['active']}", file=file)
    print(f"  override            : {info['override'] or '(none; set GGMLOPT_SIMD to pin one)'}",
          file=file)
    print(f"  kernel threads      : {kernels.get_num_threads()}", file=file)
    print(f"  C header            : {get_include()}", file=file)
    _print_blas(file)
    _print_gemm(file)


def _print_gemm(file: TextIO) -> None:
    """The products' section of show_config: the float32 engine and the bf16 one."""
    from . import gemm

    name = gemm.engine()
    source = {"env": "set by GGMLOPT_GEMM", "call": "set by ggmlopt.gemm.use_engine"}.get(
        gemm.engine_source(), "the default; GGMLOPT_GEMM=mkl for MKL, =native for ggmlopt's own")
    # (MKL's path only when it is the engine: asking for it loads it, and its threads)
    where = f" ({gemm.mkl_library()})" if name == "mkl" else \
        " (ggmlopt's own kernels, the active SIMD path and kernel threads)" \
        if name == "native" else " (NumPy's BLAS, above)"
    print(f"  GEMM engine         : {name}{where} [{source}]", file=file)
    native, why = gemm.bf16_support()
    print(f"  bf16 products       : {'yes: ' if native else 'no: '}{why}", file=file)
    choice = gemm._bf16_choice
    print(f"  bf16 engine         : {gemm.bf16_engine()} [{choice}; GGMLOPT_GEMM_BF16="
          f"auto|native|mkl, or ggmlopt.gemm.use_bf16_engine]", file=file)


def _print_blas(file: TextIO) -> None:
    """The BLAS section of show_config: the library, the kernel it chose, its
    threads, and what decides its threads while training."""
    from ._blas_threads import blas_config

    cfg = blas_config()
    for lib in cfg["libraries"] or [{}]:
        if not lib:
            print("  BLAS                : none that threadpoolctl knows (threads left alone)",
                  file=file)
            break
        print(f"  BLAS                : {lib['internal_api']} {lib['version']}, "
              f"kernel {lib['architecture'] or '(not reported)'}, "
              f"threads={lib['num_threads']} ({lib['filepath']})", file=file)
    forced = ", ".join(f"{k}={v}" for k, v in cfg["kernel_env"].items())
    print(f"  BLAS kernel forced  : {forced or '(no; OPENBLAS_CORETYPE unset)'}", file=file)
    setting = cfg["setting"]
    if setting == "auto":
        what = ("auto: each epoch cuts BLAS to the cores other processes leave idle "
                "(1 thread for models whose own kernels do most of the work)")
    elif setting == "keep":
        what = "keep: BLAS keeps its own threads while training"
    elif isinstance(setting, int):
        what = f"{setting} BLAS threads while training"
    else:
        what = setting
    print(f"  BLAS in training    : {what}; from {cfg['source']}", file=file)
