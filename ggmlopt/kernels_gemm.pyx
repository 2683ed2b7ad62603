# cython: language_level=3
"""ggmlopt's own float32 matrix products (the GEMM engine ``native``): out = a @ b,
or out += a @ b, on NumPy arrays, on the active SIMD path and the kernel threads.

Operands are 2-D float32 views in the layouts the layers hand over without a
copy: a with contiguous rows (or a transposed view, ``x.T``), b in any layout
(``w`` or ``w.T``), out with contiguous rows apart from a and b.  Each value is
one chain of float32 FMAs in order of the inner index, so the result does not
depend on the threads.  ``sgemm`` checks its arguments and raises TypeError or
ValueError naming the argument before anything is written; ``try_sgemm`` is the
engine's fast path: False (nothing written) where ``sgemm`` would refuse.  The
C-level form is ``ggmlopt.kernels.sgemm_f32``.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t

from ggmlopt cimport kernels as _k

cnp.import_array()


cdef inline bint _stride(cnp.ndarray x, int axis, int64_t *out):
    """x's stride along axis in elements (0 for a length-1 axis); False when
    it is not a non-negative whole number of elements."""
    cdef Py_ssize_t s = cnp.PyArray_STRIDE(x, axis)
    if cnp.PyArray_DIM(x, axis) <= 1:
        out[0] = 0
        return True
    if s < 0 or s % 4:
        return False
    out[0] = s // 4
    return True


cdef inline bint _apart(cnp.ndarray x, cnp.ndarray y):
    """The address ranges x and y span do not meet (both non-empty, strides >= 0)."""
    cdef char *x0 = <char *>cnp.PyArray_DATA(x)
    cdef char *y0 = <char *>cnp.PyArray_DATA(y)
    cdef char *x1 = x0 + (cnp.PyArray_DIM(x, 0) - 1) * cnp.PyArray_STRIDE(x, 0) \
        + (cnp.PyArray_DIM(x, 1) - 1) * cnp.PyArray_STRIDE(x, 1) + 4
    cdef char *y1 = y0 + (cnp.PyArray_DIM(y, 0) - 1) * cnp.PyArray_STRIDE(y, 0) \
        + (cnp.PyArray_DIM(y, 1) - 1) * cnp.PyArray_STRIDE(y, 1) + 4
    return x1 <= y0 or y1 <= x0


cdef str _why_not(object a, object b, object out):
    """None when (a, b, out) suit the kernel, else what is wrong, naming the
    argument (checked in the order sgemm reports them)."""
    for name, x, writable in (("a", a, False), ("b", b, False), ("out", out, True)):
        if not isinstance(x, np.ndarray):
            return f"T{name}: expected a numpy.ndarray of float32, got {type(x).__name__}"
        if x.dtype != np.float32:
            return f"T{name}: expected dtype float32, got {x.dtype}"
        if x.ndim != 2:
            return f"V{name}: expected a 2-D array, got {x.ndim} dimensions"
    if a.shape[1] != b.shape[0] or out.shape != (a.shape[0], b.shape[1]):
        return (f"Vout: shapes {a.shape} @ {b.shape} -> {out.shape} do not match "
                f"(expected ({a.shape[0]}, {b.shape[1]}) and a.shape[1] == b.shape[0])")
    if not out.flags.writeable:
        return "Vout: the array is read-only, it must be writable"
    cdef int64_t s0, s1
    if not (_stride(<cnp.ndarray>out, 0, &s0) and _stride(<cnp.ndarray>out, 1, &s1)) \
            or (s1 not in (0, 1)) or (out.shape[0] > 1 and s0 < out.shape[1]):
        return "Vout: expected rows of contiguous float32 values, apart from each other"
    # an axis of stride 1, or of one element (stride 0 here); a broadcast axis
    # (stride 0 over several elements) is neither
    if not (_stride(<cnp.ndarray>a, 0, &s0) and _stride(<cnp.ndarray>a, 1, &s1)) \
            or not (s0 == 1 or a.shape[0] <= 1 or s1 == 1 or a.shape[1] <= 1):
        return "Va: expected contiguous rows or columns (a row-major array or its transpose)"
    if not (_stride(<cnp.ndarray>b, 0, &s0) and _stride(<cnp.ndarray>b, 1, &s1)):
        return "Vb: expected non-negative strides of whole float32 elements"
    if out.size and a.size and not _apart(<cnp.ndarray>out, <cnp.ndarray>a):
        return "Va and out overlap in memory; they must be distinct arrays"
    if out.size and b.size and not _apart(<cnp.ndarray>out, <cnp.ndarray>b):
        return "Vb and out overlap in memory; they must be distinct arrays"
    return None


cdef int _run(cnp.ndarray a, cnp.ndarray b, cnp.ndarray out, bint accumulate) except -1:
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
    cdef const float *pa = <const float *>cnp.PyArray_DATA(a)
    cdef const float *pb = <const float *>cnp.PyArray_DATA(b)
    cdef float *pc = <float *>cnp.PyArray_DATA(out)
    cdef int rc
    with nogil:
        rc = _k.sgemm_f32(m, n, k, pa, ar, ac, pb, br, bc, pc, c1, accumulate)
    if rc == -2:
        raise MemoryError("sgemm: no memory for the packed panels")
    if rc != 0:
        raise ValueError(f"sgemm: the kernel refused the layout of a {(<object>a).strides}, "
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
