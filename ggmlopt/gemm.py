"""The matrix products' engine: which BLAS multiplies, chosen at run time.

``numpy`` (the default, always there): NumPy's own BLAS (OpenBLAS in its wheels)
through ``np.matmul``.  ``native``: ggmlopt's own products over its SIMD paths
and kernel threads (``ggmlopt.kernels_gemm``; each value one chain of FMAs in
order, so the same bits on any number of threads; products of fewer than 8 rows,
and layouts it cannot take, go to NumPy).  ``mkl``: Intel MKL from the ``mkl`` package
(``pip install ggmlopt[mkl]``), called through its CBLAS entry points.

The bfloat16 products of ``precision="bf16"`` (bf16 operands, float32 sums and
result; NumPy's OpenBLAS is built without them) have engines of their own:
``native``, ggmlopt's kernels (``kernels_gemm.gemm_bf16``: AVX512-BF16's
vdpbf16ps, on Intel since Cooper Lake and AMD since Zen 4), and ``mkl``, MKL's
``cblas_gemm_bf16bf16f32`` (AMX tiles on Intel since Sapphire Rapids).  ``auto``
takes MKL where the CPU has AMX tiles and MKL is installed, else ggmlopt's own
where they run vdpbf16ps (on a Zen 4 MKL's bf16 products ran at float32's
speed or below, ggmlopt's at twice it), else MKL where the CPU has bf16
products.

``GGMLOPT_GEMM=numpy|mkl|native`` picks the float32 engine and
``GGMLOPT_GEMM_BF16=auto|native|mkl`` the bf16 one (read at import;
``use_engine`` and ``use_bf16_engine`` change them later); ``show_config()``
reports both.

Operands are 2-D float32 (bf16: uint16 bit patterns) whose rows or columns are
contiguous, so transposed views (``w.T``) need no copy; anything else goes to
NumPy (a bf16 product: a ValueError).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import threading

import numpy as np

from . import _pool_linger

__all__ = ["BF16_ENGINES", "ENGINES", "PRECISIONS", "accumulates_in_place", "bf16_active",
           "bf16_engine", "bf16_support", "check_precision", "engine", "engine_source",
           "matmul", "matmul_bf16", "mkl_library", "products_in", "use_bf16_engine",
           "use_engine"]

ENGINES = ("numpy", "mkl", "native")

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_MKL_THREADING = {"INTEL": 0, "SEQUENTIAL": 1, "TBB": 2, "GNU": 3}


class _Mkl:
    """libmkl_rt, loaded once, with the two product entry points typed."""

    def __init__(self, path):
        self.path = path
        # MKL's threads: GNU OpenMP by default (MKL_THREADING_LAYER overrides), with
        # libgomp's own wait policy (a short spin, then sleep) or the one the user
        # set in OMP_WAIT_POLICY.  Forced passive, every product woke sleeping
        # threads: a LoRA step under precision="bf16" took 0.68-0.76 s against
        # 0.56-0.61 s, one on the mkl engine 0.99-1.03 s against 0.79-0.90.  (A
        # spin is costly where OpenBLAS's threads spin beside MKL's, which is why
        # inside a bf16 context every float32 product goes to MKL too.)
        self.lib = lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        # 32-bit integers, as the calls below pass them (MKL_INTERFACE_LAYER=ILP64
        # would read them as 64-bit: a crash or wrong products)
        if lib.MKL_Set_Interface_Layer(ctypes.c_int(0)) != 0:
            raise OSError("MKL would not take the LP64 interface (32-bit integers)")
        layer = os.environ.get("MKL_THREADING_LAYER", "GNU").upper()
        if layer not in _MKL_THREADING:
            raise OSError(f"MKL_THREADING_LAYER={layer!r}: expected one of "
                          f"{', '.join(_MKL_THREADING)}")
        lib.MKL_Set_Threading_Layer(ctypes.c_int(_MKL_THREADING[layer]))
        lib.MKL_Get_Max_Threads()   # the threading layer loads (and libgomp with it)
        if layer == "GNU" and hasattr(os, "register_at_fork"):
            # GNU OpenMP's threads do not survive a fork: a child's first parallel
            # product waited for them forever.  A forked child multiplies on one
            # thread (a child that wants more: the spawn start method, or
            # MKL_THREADING_LAYER=INTEL)
            os.register_at_fork(after_in_child=lambda: lib.MKL_Set_Num_Threads(ctypes.c_int(1)))
        args = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                     ctypes.c_void_p, ctypes.c_int]
        self.sgemm = lib.cblas_sgemm
        self.sgemm.argtypes, self.sgemm.restype = args, None
        self.bf16gemm = lib.cblas_gemm_bf16bf16f32
        self.bf16gemm.argtypes, self.bf16gemm.restype = args, None


def _find_mkl():
    """The path of libmkl_rt (the ``mkl`` package puts it in the environment's
    lib directory), or None."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        hits = sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
        if hits:
            return hits[0]
    return ctypes.util.find_library("mkl_rt")


_mkl: _Mkl | None = None
_mkl_error: str | None = None


def _numpy_cblas_sgemm():
    """The cblas_sgemm of the OpenBLAS NumPy's wheels bundle (already loaded with
    NumPy: the same library and threads), typed for its integer width; None when
    NumPy links another BLAS.  It accumulates (beta = 1) where np.matmul cannot
    without a temporary the size of the result."""
    folder = os.path.dirname(os.path.dirname(np.__file__))
    paths = sorted(glob.glob(os.path.join(folder, "numpy.libs", "libscipy_openblas*"))
                   + glob.glob(os.path.join(folder, "numpy", ".dylibs", "libscipy_openblas*")))
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        except OSError:
            continue
        for name, dim in (("scipy_cblas_sgemm64_", ctypes.c_int64),
                          ("scipy_cblas_sgemm", ctypes.c_int)):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_int] * 3 + [dim] * 3 + [
                    ctypes.c_float, ctypes.c_void_p, dim, ctypes.c_void_p, dim, ctypes.c_float,
                    ctypes.c_void_p, dim]
                fn.restype = None
                return fn
    return None


_numpy_sgemm = _numpy_cblas_sgemm()


def accumulates_in_place() -> bool:
    """Whether matmul(..., accumulate=True) adds into out without a temporary
    whatever the shape (MKL, or the CBLAS of NumPy's own OpenBLAS, which also
    takes the products of too few rows for the native engine)."""
    return (_engine == "mkl" and _mkl is not None) or _numpy_sgemm is not None


# the native engine takes products of at least this many rows, of any width (an
# adapter's rank-8 side through its one-vector tiles); thinner ones (a decode
# step's few rows) run faster in the BLAS, whose packing they do not repay
_NATIVE_MIN_ROWS = 8


def _native_sgemm(a, b, out, accumulate):
    """ggmlopt.kernels_gemm.try_sgemm (False: NumPy takes the product)."""
    from .kernels_gemm import try_sgemm

    return try_sgemm(a, b, out, accumulate)


def _load_mkl():
    """MKL, loaded on first use; None (and the reason in _mkl_error) without it."""
    global _mkl, _mkl_error
    if _mkl is None and _mkl_error is None:
        path = _find_mkl()
        if path is None:
            _mkl_error = ("Intel MKL is not installed (pip install ggmlopt[mkl], or: "
                          "pip install mkl)")
        else:
            try:
                _mkl = _Mkl(path)
            except (OSError, AttributeError) as err:
                _mkl_error = f"Intel MKL at {path} did not load: {err}"
    return _mkl


def mkl_library() -> str | None:
    """The path of the MKL library in use, or None when it is not there."""
    lib = _load_mkl()
    return lib.path if lib is not None else None


def _engine_name(name: object, what: str, names: tuple[str, ...]) -> str:
    """name, one of names in any case and with spaces around (as the environment
    variables are read), as its lower-case self."""
    if not isinstance(name, str):
        raise TypeError(f"{what}: expected a str, one of {', '.join(names)}, got "
                        f"{type(name).__name__}")
    if name.strip().lower() not in names:
        raise ValueError(f"{what}: expected one of {', '.join(names)}, got {name!r}")
    return name.strip().lower()


def _engine_from_env():
    return _engine_name(os.environ.get("GGMLOPT_GEMM", "").strip() or "numpy",
                        "GGMLOPT_GEMM", ENGINES)


_engine = "numpy"
# where the engine came from: "default", "env" (GGMLOPT_GEMM) or "call" (use_engine(name))
_engine_source = "default"


def use_engine(name: str | None = None) -> str:
    """Multiply float32 with engine ``name`` ('numpy', 'mkl' or 'native'; None: what
    GGMLOPT_GEMM says, else numpy) and return the previous engine's name.
    ImportError when MKL is asked for and not installed."""
    global _engine, _engine_source
    name = _engine_from_env() if name is None else _engine_name(name, "name", ENGINES)
    # the engine GGMLOPT_GEMM (or the default) names, set again (a test's restore), is
    # still theirs; a value set since import that names none does not stop a call
    try:
        from_env = _engine_from_env()
    except ValueError:
        from_env = None
    source = "call" if name != from_env else \
        "env" if os.environ.get("GGMLOPT_GEMM", "").strip() else "default"
    if name == "mkl" and _load_mkl() is None:
        raise ImportError(f"GEMM engine 'mkl': {_mkl_error}")
    previous, _engine, _engine_source = _engine, name, source
    return previous


def engine() -> str:
    """The engine that multiplies float32 now."""
    return _engine


def engine_source() -> str:
    """Where the engine in force was chosen: 'default', 'env' (GGMLOPT_GEMM) or
    'call' (use_engine(name))."""
    return _engine_source


BF16_ENGINES = ("auto", "native", "mkl")


def _bf16_engine_from_env():
    return _engine_name(os.environ.get("GGMLOPT_GEMM_BF16", "").strip() or "auto",
                        "GGMLOPT_GEMM_BF16", BF16_ENGINES)


# the bf16 engine asked for ('auto' picks per CPU: bf16_engine)
_bf16_choice = "auto"


def use_bf16_engine(name: str | None = None) -> str:
    """Multiply bf16 with engine ``name`` ('auto', 'native' or 'mkl'; None: what
    GGMLOPT_GEMM_BF16 says, else auto) and return the previous choice.
    ImportError when MKL is asked for and not installed."""
    global _bf16_choice
    name = _bf16_engine_from_env() if name is None else _engine_name(name, "name", BF16_ENGINES)
    if name == "mkl" and _load_mkl() is None:
        raise ImportError(f"bf16 engine 'mkl': {_mkl_error}")
    previous, _bf16_choice = _bf16_choice, name
    return previous


def _cpu_bf16():
    """(the CPU's bf16 product features, whether ggmlopt's kernels run vdpbf16ps)."""
    from . import kernels

    cpu = kernels.simd_info()["cpu"]
    return [f for f in ("amx_bf16", "avx512_bf16") if cpu.get(f)], \
        kernels.gemm_bf16_instruction()


def bf16_engine() -> str:
    """The engine that multiplies bf16 now: 'native' or 'mkl' (the choice, or
    for 'auto' the pick for this CPU described in the module's docstring)."""
    if _bf16_choice != "auto":
        return _bf16_choice
    features, instruction = _cpu_bf16()
    if "amx_bf16" in features and _load_mkl() is not None:
        return "mkl"
    if instruction or not features or _load_mkl() is None:
        return "native"
    return "mkl"


def bf16_support() -> tuple[bool, str]:
    """(whether bf16 products run natively here, why not / what runs them)."""
    features, instruction = _cpu_bf16()
    if not features:
        return False, "this CPU has no native bf16 products (AVX512-BF16 or AMX-BF16)"
    if bf16_engine() == "mkl":
        return True, f"Intel MKL cblas_gemm_bf16bf16f32 ({', '.join(features)})"
    if instruction:
        return True, "ggmlopt's own kernels (AVX512-BF16 vdpbf16ps)"
    from . import kernels

    path = kernels.simd_info()["active"]
    if _bf16_choice == "native":
        return False, (f"the bf16 engine is ggmlopt's own (GGMLOPT_GEMM_BF16=native) and the "
                       f"active SIMD path ({path}) has no bf16 instruction")
    return False, (f"the active SIMD path ({path}) has no bf16 instruction, and Intel MKL "
                   f"is not installed to run them: {_mkl_error}")


def _operand(a):
    """(transposed, leading dimension) of a 2-D operand whose rows (or, for a
    transposed view, columns) are contiguous, or None when the BLAS cannot take it."""
    s0, s1 = a.strides
    item = a.itemsize
    rows, cols = a.shape
    if (s1 == item or cols == 1) and s0 % item == 0 and s0 // item >= max(cols, 1):
        return False, max(s0 // item, cols, 1)
    if (s0 == item or rows == 1) and s1 % item == 0 and s1 // item >= max(rows, 1):
        return True, max(s1 // item, rows, 1)
    return None


def _call(fn, a, b, out, accumulate):
    """out (m, n) = a (m, k) @ b (k, n) (+ out when accumulating) through fn, a
    CBLAS gemm; False when an operand's layout does not suit it."""
    if out.ndim != 2 or a.ndim != 2 or b.ndim != 2 or not out.flags.writeable:
        return False
    m, k = a.shape
    n = b.shape[1]
    if b.shape[0] != k or out.shape != (m, n):
        raise ValueError(f"out: shapes {a.shape} @ {b.shape} -> {out.shape} do not match")
    if m == 0 or n == 0:
        return True
    if k == 0:
        if not accumulate:
            out[...] = 0.0
        return True
    la, lb, lc = _operand(a), _operand(b), _operand(out)
    if la is None or lb is None or lc is None or lc[0]:
        return False
    fn(_ROW_MAJOR, _TRANS if la[0] else _NO_TRANS, _TRANS if lb[0] else _NO_TRANS,
       m, n, k, 1.0, a.ctypes.data, la[1], b.ctypes.data, lb[1],
       1.0 if accumulate else 0.0, out.ctypes.data, lc[1])
    return True


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray, accumulate: bool = False) -> np.ndarray:
    """out = a @ b (float32, 2-D; a 1-D a is one row), or out += a @ b with
    ``accumulate``, on the active engine; returns out.  Inside a bf16 context
    the float32 products go where its bf16 products go (MKL, or ggmlopt's own
    kernels): one library's threads, not two taking the cores from each other
    between products (OpenBLAS's threads spin for a while after each).  An out
    that shares memory with a or b gets the product of copies of them (the
    engines read the operands while they write out), as np.matmul does."""
    if isinstance(out, np.ndarray):
        if isinstance(a, np.ndarray) and np.may_share_memory(out, a):
            a = a.copy()
        if isinstance(b, np.ndarray) and np.may_share_memory(out, b):
            b = b.copy()
    # a bf16 pass's float32 products go where its bf16 products go
    bf16_pass, bf16_on_mkl = _pass.bf16, _pass.on_mkl
    on_mkl = _engine == "mkl" if not bf16_pass else bf16_on_mkl
    if on_mkl and _mkl is not None and a.dtype == b.dtype == out.dtype == np.float32:
        # a row vector with real strides (a[None, :] has a 0 row stride, which reads as
        # a transposed operand and would leave the product to NumPy)
        a2, out2 = (a.reshape(1, -1), out.reshape(1, -1)) if a.ndim == 1 and out.ndim == 1 \
            else (a, out)
        if _call(_mkl.sgemm, a2, b, out2, accumulate):
            return out
    if not bf16_pass:
        if _engine == "native" and a.ndim == 2 and b.ndim == 2 \
                and a.shape[0] >= _NATIVE_MIN_ROWS and _native_sgemm(a, b, out, accumulate):
            return out
    elif not bf16_on_mkl and b.ndim == 2 and (a.ndim == 2 or a.ndim == out.ndim == 1):
        # every row count, a single row too: no OpenBLAS thread wakes in the pass
        a2, out2 = (a.reshape(1, -1), out.reshape(1, -1)) if a.ndim == 1 else (a, out)
        if _native_sgemm(a2, b, out2, accumulate):
            return out
    if accumulate:
        if _numpy_sgemm is not None and a.ndim == b.ndim == out.ndim == 2 \
                and a.dtype == b.dtype == out.dtype == np.float32 \
                and _call(_numpy_sgemm, a, b, out, True):
            return out
        out += a @ b
        return out
    return np.matmul(a, b, out=out)


def matmul_bf16(a16: np.ndarray, b16: np.ndarray, out: np.ndarray,
                accumulate: bool = False) -> np.ndarray:
    """out (float32) = a16 @ b16 (+ out with ``accumulate``), where a16 and b16
    hold bfloat16 bits (uint16, from kernels.to_bfloat16): the products are exact
    and summed in float32, on the bf16 engine (bf16_engine()); whether the CPU
    runs them natively: bf16_support()."""
    if a16.dtype != np.uint16 or b16.dtype != np.uint16:
        raise TypeError(f"a16, b16: expected uint16 bfloat16 bits, got {a16.dtype}, {b16.dtype}")
    if out.dtype != np.float32:
        raise TypeError(f"out: expected float32, got {out.dtype}")
    # a bf16 pass decided its engine on entry (products_in); bf16_engine asks the CPU
    if not (_pass.on_mkl if _pass.bf16 else bf16_engine() == "mkl"):
        from .kernels_gemm import gemm_bf16

        return gemm_bf16(a16, b16, out, accumulate)
    lib = _load_mkl()
    if lib is None:
        raise ImportError(f"bf16 products: {_mkl_error}")
    if not out.flags.writeable:
        raise ValueError("out: the array is read-only")
    # MKL reads the operands while it writes out: an operand that shares its
    # memory is copied first, as matmul does
    if np.may_share_memory(out, a16):
        a16 = a16.copy()
    if np.may_share_memory(out, b16):
        b16 = b16.copy()
    if not _call(lib.bf16gemm, a16, b16, out, accumulate):
        raise ValueError("a16, b16, out: expected 2-D operands with contiguous rows or "
                         "columns and an output with contiguous rows")
    return out


# GGMLOPT_GEMM is read once, here; a bad value or a missing MKL fails the import,
# as GGMLOPT_SIMD does: an explicit request is never dropped silently
for _use, _var in ((use_engine, "GGMLOPT_GEMM"), (use_bf16_engine, "GGMLOPT_GEMM_BF16")):
    try:
        _use(None)
    except (ValueError, ImportError) as _err:
        _msg = str(_err)
        if not _msg.startswith(_var + ":"):
            _msg = f"{_var}={os.environ.get(_var, '').strip()}: {_msg}"
        raise ImportError(_msg) from None


# ---- the precision of the products in a training context -------------------------------

PRECISIONS = {"f32": "f32", "float32": "f32", "fp32": "f32",
              "bf16": "bf16", "bfloat16": "bf16"}


class _PassState(threading.local):
    """The precision of the pass the calling thread is in: each thread its own,
    so a float32 forward in one thread never multiplies in bf16 because another
    thread is inside a bf16 training pass (ranks run as threads do both)."""

    bf16 = False
    # within a bf16 pass: whether its bf16 products run on MKL (its float32 ones follow)
    on_mkl = False


_pass = _PassState()


def check_precision(precision: object) -> str:
    """precision ('f32'/'float32' or 'bf16'/'bfloat16') as 'f32' or 'bf16'."""
    if not isinstance(precision, str):
        raise TypeError(f"precision: expected a str, 'f32' or 'bf16', got "
                        f"{type(precision).__name__}")
    if precision.lower() not in PRECISIONS:
        raise ValueError(f"precision: expected 'f32' or 'bf16', got {precision!r}")
    return PRECISIONS[precision.lower()]


def bf16_active() -> bool:
    """Whether the layers multiply in bf16 now: the calling thread is inside a
    bf16 context's pass."""
    return _pass.bf16


# how long the kernel threads poll for the next call while the native engine
# multiplies a training pass (kernels.set_pool_linger): its products come a few
# hundred microseconds apart, and waking a sleeping thread took 20-30 us of each
# (a LoRA step 0.665 -> 0.632 s); no BLAS thread spins beside them then, as it
# would under the numpy engine (there the linger cost a step 5%)
NATIVE_TRAINING_LINGER_S = 0.002


def _native_passes(delta: int) -> None:
    """One more (delta 1) or one fewer (-1) native training pass: each holds the
    kernel threads' linger (ranks run as threads enter and leave in any order)."""
    if delta > 0:
        _pool_linger.hold(NATIVE_TRAINING_LINGER_S)
    else:
        _pool_linger.release(NATIVE_TRAINING_LINGER_S)


class products_in:
    """``with products_in('bf16'):`` the layers' forward and backward products
    in the calling thread take bf16 operands (float32 master weights and
    gradients stay); 'f32' leaves them in float32, and under the native engine
    keeps the kernel threads polling between its products
    (NATIVE_TRAINING_LINGER_S, set by the first pass that enters and put back
    by the last that leaves, from any thread).  precision as check_precision
    takes it.  Each thread's passes are its own: other threads multiply as
    their own passes say."""

    def __init__(self, precision: str) -> None:
        self._bf16 = check_precision(precision) == "bf16"
        self._before = (False, False)
        self._lingers = False

    def __enter__(self) -> None:
        on_mkl = bf16_engine() == "mkl" if self._bf16 else _pass.on_mkl
        self._before = (_pass.bf16, _pass.on_mkl)
        _pass.bf16, _pass.on_mkl = self._bf16, on_mkl
        # the kernel threads multiply this pass: float32 on the native engine, or
        # bf16 on ggmlopt's own kernels
        self._lingers = (not self._bf16 and _engine == "native") or \
            (self._bf16 and not on_mkl)
        if self._lingers:
            _native_passes(1)

    def __exit__(self, *exc: object) -> None:
        _pass.bf16, _pass.on_mkl = self._before
        if self._lingers:
            _native_passes(-1)
            self._lingers = False
