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
