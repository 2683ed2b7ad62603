# cython: language_level=3
"""ggmlopt's own matrix products (the GEMM engine ``native``, and the bf16
products of precision="bf16"): out = a @ b, or out += a @ b, on NumPy arrays, on
the active SIMD path and the kernel threads.

Operands are 2-D float32 views in the layouts the layers hand over without a
copy: a with contiguous rows (or a transposed view, ``x.T``), b in any layout
(``w`` or ``w.T``), out with contiguous rows apart from a and b.  Each value is
one chain of float32 FMAs in order of the inner index, so the result does not
depend on the threads.  ``sgemm`` checks its arguments and raises TypeError or
ValueError naming the argument before anything is written; ``try_sgemm`` is the
engine's fast path: False (nothing written) where ``sgemm`` would refuse.  The
C-level form is ``ggmlopt.kernels.sgemm_f32``.

``matmul_columns`` is the product of a few rows (decoding's one) by a weight
stored (in, out), as a Linear keeps it: each weight byte read once, each thread
a run of whole rows of it; each out value the sum, in order, of FMA chains over
64 rows each (``ggmlopt.kernels.matmul_columns_f32``).

``gemm_bf16`` multiplies bfloat16 bits (uint16, from ``kernels.to_bfloat16``)
into float32: each product of two bf16 values is exact, the sums float32
(``ggmlopt.kernels.gemm_bf16``; AVX512-BF16's vdpbf16ps where the CPU has it,
``kernels.gemm_bf16_instruction()``).
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t, uint16_t

from ggmlopt cimport kernels as _k

cnp.import_array()


cdef inline bint _stride(cnp.ndarray x, int axis, int64_t *out):
    """x's stride along axis in elements (0 for a length-1 axis); False when
    it is not a non-negative whole number of elements."""
    cdef Py_ssize_t s = cnp.PyArray_STRIDE(x, axis)
    cdef Py_ssize_t item = cnp.PyArray_ITEMSIZE(x)
    if cnp.PyArray_DIM(x, axis) <= 1:
        out[0] = 0
        return True
    if s < 0 or s % item:
        return False
    out[0] = s // item
    return True


cdef inline bint _apart(cnp.ndarray x, cnp.ndarray y):
    """The address ranges x and y span do not meet (both non-empty, strides >= 0)."""
    cdef char *x0 = <char *>cnp.PyArray_DATA(x)
    cdef char *y0 = <char *>cnp.PyArray_DATA(y)
    cdef char *x1 = x0 + (cnp.PyArray_DIM(x, 0) - 1) * cnp.PyArray_STRIDE(x, 0) \
        + (cnp.PyArray_DIM(x, 1) - 1) * cnp.PyArray_STRIDE(x, 1) + cnp.PyArray_ITEMSIZE(x)
    cdef char *y1 = y0 + (cnp.PyArray_DIM(y, 0) - 1) * cnp.PyArray_STRIDE(y, 0) \
        + (cnp.PyArray_DIM(y, 1) - 1) * cnp.PyArray_STRIDE(y, 1) + cnp.PyArray_ITEMSIZE(y)
    return x1 <= y0 or y1 <= x0


cdef str _operands_why_not(str an, object a, str bn, object b, object out, object want):
    """None when a and b (named an, bn) are 2-D arrays of dtype want and out a
    writable 2-D float32 array of their product's shape, else what is wrong."""
    for name, x, dtype in ((an, a, want), (bn, b, want), ("out", out, np.float32)):
        what = "uint16 bfloat16 bits" if dtype == np.uint16 else "float32"
        if not isinstance(x, np.ndarray):
            return f"T{name}: expected a numpy.ndarray of {what}, got {type(x).__name__}"
        if x.dtype != dtype:
            return f"T{name}: expected dtype {np.dtype(dtype)} ({what}), got {x.dtype}"
        if x.ndim != 2:
            return f"V{name}: expected a 2-D array, got {x.ndim} dimensions"
    if a.shape[1] != b.shape[0] or out.shape != (a.shape[0], b.shape[1]):
        return (f"Vout: shapes {a.shape} @ {b.shape} -> {out.shape} do not match "
                f"(expected ({a.shape[0]}, {b.shape[1]}) and {an}.shape[1] == "
                f"{bn}.shape[0])")
    if not out.flags.writeable:
        return "Vout: the array is read-only, it must be writable"
    return None


cdef str _why_not(object a, object b, object out, bint bf16=False):
    """None when (a, b, out) suit the kernel, else what is wrong, naming the
    argument (checked in the order sgemm reports them).  bf16: a and b hold
    bfloat16 bits (uint16), and b too needs contiguous rows or columns."""
    cdef str an = "a16" if bf16 else "a", bn = "b16" if bf16 else "b"
    cdef str why = _operands_why_not(an, a, bn, b, out, np.uint16 if bf16 else np.float32)
    if why is not None:
        return why
    cdef int64_t s0, s1
    if not (_stride(<cnp.ndarray>out, 0, &s0) and _stride(<cnp.ndarray>out, 1, &s1)) \
            or not (s1 == 1 or out.shape[1] <= 1 or out.size == 0) \
            or (out.shape[0] > 1 and s0 < out.shape[1]):
        return "Vout: expected rows of contiguous float32 values, apart from each other"
    # an axis of stride 1, or of one element (stride 0 here); a broadcast axis
    # (stride 0 over several elements) is neither
    if not (_stride(<cnp.ndarray>a, 0, &s0) and _stride(<cnp.ndarray>a, 1, &s1)) \
            or not (s0 == 1 or a.shape[0] <= 1 or s1 == 1 or a.shape[1] <= 1):
        return f"V{an}: expected contiguous rows or columns (a row-major array or its transpose)"
    if not (_stride(<cnp.ndarray>b, 0, &s0) and _stride(<cnp.ndarray>b, 1, &s1)):
        return f"V{bn}: expected non-negative strides of whole elements"
    if bf16 and not (s0 == 1 or b.shape[0] <= 1 or s1 == 1 or b.shape[1] <= 1):
        return f"V{bn}: expected contiguous rows or columns (a row-major array or its transpose)"
    if out.size and a.size and not _apart(<cnp.ndarray>out, <cnp.ndarray>a):
        return f"V{an} and out overlap in memory; they must be distinct arrays"
    if out.size and b.size and not _apart(<cnp.ndarray>out, <cnp.ndarray>b):
        return f"V{bn} and out overlap in memory; they must be distinct arrays"
    return None


cdef int _run(cnp.ndarray a, cnp.ndarray b, cnp.ndarray out, bint accumulate,
              bint bf16=False) except -1:
    cdef int64_t m = cnp.PyArray_DIM(out, 0), n = cnp.PyArray_DIM(out, 1)
    cdef int64_t k = cnp.PyArray_DIM(a, 1)
    cdef int64_t ar = 0, ac = 0, br = 0, bc = 0, c0 = 0, c1 = 0
    _stride(a, 0, &ar)
    _stride(a, 1, &ac)
    _stride(b, 0, &br)
    _stride(b, 1, &bc)
    _stride(out, 0, &c0)
    # one axis of a has stride 1 or one element (_why_not); the stride of a
    # one-element axis (0 here) reads as 1, the kernel's contiguous axis; a
    # broadcast axis keeps its 0
    if ac != 1 and k <= 1:
        ac = 1
    elif ac != 1 and m <= 1:
        ar = 1
    c1 = c0 if m > 1 else n
    cdef float *pc = <float *>cnp.PyArray_DATA(out)
    cdef int rc
    if bf16:
        # b likewise: contiguous rows (bc 1) or columns (br 1); a one-element
        # axis's stride reads as the contiguous one
        if bc != 1 and n <= 1:
            bc = 1
        elif bc != 1 and k <= 1:
            br = 1
        with nogil:
            rc = _k.gemm_bf16(m, n, k, <const uint16_t *>cnp.PyArray_DATA(a), ar, ac,
                              <const uint16_t *>cnp.PyArray_DATA(b), br, bc, pc, c1, accumulate)
    else:
        with nogil:
            rc = _k.sgemm_f32(m, n, k, <const float *>cnp.PyArray_DATA(a), ar, ac,
                              <const float *>cnp.PyArray_DATA(b), br, bc, pc, c1, accumulate)
    name = "gemm_bf16" if bf16 else "sgemm"
    if rc == -2:
        raise MemoryError(f"{name}: no memory for the packed panels")
    if rc != 0:
        raise ValueError(f"{name}: the kernel refused the layout of a {(<object>a).strides}, "
                         f"b {(<object>b).strides}, out {(<object>out).strides}")
    return 0


def sgemm(a, b, out, accumulate=False):
    """out = a @ b, or out += a @ b with ``accumulate``; returns out.

    a: float32 (m, k) with contiguous rows or columns; b: float32 (k, n), any
    non-negative strides; out: float32 (m, n), contiguous rows, writable, apart
    from a and b in memory.  Each out value is one chain of float32 FMAs over k
    in order (its old value first when accumulating): the same bits on any
    number of threads.
    """
    why = _why_not(a, b, out)
    if why is not None:
        raise (TypeError if why[0] == "T" else ValueError)(why[1:])
    _run(<cnp.ndarray>a, <cnp.ndarray>b, <cnp.ndarray>out, bool(accumulate))
    return out


def try_sgemm(a, b, out, bint accumulate=False):
    """sgemm(a, b, out, accumulate) -> True, or False (nothing written) where
    sgemm would raise: the engine's path, which hands those to NumPy."""
    if _why_not(a, b, out) is not None:
        return False
    _run(<cnp.ndarray>a, <cnp.ndarray>b, <cnp.ndarray>out, accumulate)
    return True


def gemm_bf16(a16, b16, out, accumulate=False):
    """out = a16 @ b16, or out += a16 @ b16 with ``accumulate``; returns out.

    a16 (m, k), b16 (k, n): uint16 bfloat16 bits, each with contiguous rows or
    columns (an array or its transpose); out: float32 (m, n), contiguous rows,
    writable, apart from both.  Each product of two bf16 values is exact in
    float32 and the sums are float32, over k in pairs in order: the same bits
    on any number of threads (on one machine: vdpbf16ps, where it runs them,
    flushes subnormals).
    """
    why = _why_not(a16, b16, out, True)
    if why is not None:
        raise (TypeError if why[0] == "T" else ValueError)(why[1:])
    _run(<cnp.ndarray>a16, <cnp.ndarray>b16, <cnp.ndarray>out, bool(accumulate), True)
    return out


cdef str _columns_why_not(object x, object w, object out):
    """None when (x, w, out) suit matmul_columns, else what is wrong, naming the
    argument (T: a TypeError, V: a ValueError)."""
    cdef str why = _operands_why_not("x", x, "w", w, out, np.float32)
    if why is not None:
        return why
    cdef int64_t s0, s1
    for name, a in (("x", x), ("w", w), ("out", out)):
        # rows of contiguous values, each row starting past the last one's end
        # (a one-row or one-column axis reads as any stride)
        if a.size and (not (_stride(<cnp.ndarray>a, 0, &s0) and _stride(<cnp.ndarray>a, 1, &s1))
                       or not (s1 == 1 or a.shape[1] <= 1)
                       or (a.shape[0] > 1 and s0 < a.shape[1])):
            return f"V{name}: expected rows of contiguous float32 values, apart from each other"
    if out.size and x.size and not _apart(<cnp.ndarray>out, <cnp.ndarray>x):
        return "Vx and out overlap in memory; they must be distinct arrays"
    if out.size and w.size and not _apart(<cnp.ndarray>out, <cnp.ndarray>w):
        return "Vw and out overlap in memory; they must be distinct arrays"
    return None


def matmul_columns(x, w, out):
    """out = x @ w; returns out.

    x: float32 (m, k), w: float32 (k, n), out: float32 (m, n), each with rows of
    contiguous values (a row-major array, or a range of its rows or columns);
    out writable and apart from x and w.  Made for few rows (decoding's one): w
    is read once for each row of x.  Each out value is the sum, in order, of
    chains of float32 FMAs over 64 values of k each: the same bits on any
    number of threads.
    """
    why = _columns_why_not(x, w, out)
    if why is not None:
        raise (TypeError if why[0] == "T" else ValueError)(why[1:])
    cdef cnp.ndarray xa = <cnp.ndarray>x, wa = <cnp.ndarray>w, oa = <cnp.ndarray>out
    cdef int64_t m = cnp.PyArray_DIM(oa, 0), n = cnp.PyArray_DIM(oa, 1)
    cdef int64_t k = cnp.PyArray_DIM(xa, 1)
    cdef int64_t xs = 0, ws = 0, ys = 0
    _stride(xa, 0, &xs)
    _stride(wa, 0, &ws)
    _stride(oa, 0, &ys)
    if k <= 1:   # one row of w, or none: its stride is any
        ws = n
    cdef int rc
    with nogil:
        rc = _k.matmul_columns_f32(m, k, <const float *>cnp.PyArray_DATA(xa), xs, n,
                                   <const float *>cnp.PyArray_DATA(wa), ws,
                                   <float *>cnp.PyArray_DATA(oa), ys, NULL)
    if rc == -2:
        raise MemoryError("matmul_columns: no memory for the partial sums")
    if rc != 0:
        raise ValueError(f"matmul_columns: the kernel refused w's strides {w.strides}")
    return out
