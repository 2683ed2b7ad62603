# cython: language_level=3
"""Argument checks shared by the kernel wrapper modules (see _kernel_args.pxd)."""
import numpy as np

cimport numpy as cnp
from libc.float cimport FLT_MAX
from libc.math cimport fabs

cnp.import_array()


cdef cnp.ndarray as_array(object a, str name, object dtype, bint writable):
    """a as an ndarray of exactly dtype, C-contiguous (and writable when asked)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray of {np.dtype(dtype).name}, "
                        f"got {type(a).__name__}")
    if a.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype).name}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name}: the array is read-only, it must be writable")
    return <cnp.ndarray>a


cdef same_size(cnp.ndarray a, str aname, cnp.ndarray b, str bname):
    if a.size != b.size:
        raise ValueError(f"{bname}: expected {a.size} elements (the size of {aname}), "
                         f"got {b.size}")


cdef no_overlap(list named):
    """Raise when two of the (name, array) pairs share memory.  Every array here
    passed as_array (C-contiguous), so comparing address ranges is exact and costs
    nanoseconds, where np.may_share_memory costs a third of a microsecond."""
    cdef Py_ssize_t i, j
    cdef char *a0
    cdef char *a1
    cdef char *b0
    cdef char *b1
    for i in range(len(named)):
        a0 = <char *>cnp.PyArray_DATA(<cnp.ndarray>named[i][1])
        a1 = a0 + cnp.PyArray_NBYTES(<cnp.ndarray>named[i][1])
        for j in range(i + 1, len(named)):
            b0 = <char *>cnp.PyArray_DATA(<cnp.ndarray>named[j][1])
            b1 = b0 + cnp.PyArray_NBYTES(<cnp.ndarray>named[j][1])
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{named[i][0]} and {named[j][0]} overlap in memory; "
                                 "they must be distinct arrays")


cdef outputs_apart(list inputs, list outputs):
    """Raise when an output shares memory with another output or an input (inputs
    may share memory with each other: they are only read)."""
    no_overlap(outputs)
    for out in outputs:
        for inp in inputs:
            no_overlap([inp, out])


cdef object count(object value, str name):
    """value as a Python int >= 0 (not a bool or a float): TypeError or ValueError
    naming name."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}: expected >= 0, got {value}")
    return int(value)


cdef double real_number(object x, str name) except? -1:
    """x as a double; TypeError for anything that is not a real number (strings too,
    which float() would parse)."""
    if isinstance(x, (str, bytes, bytearray)):
        raise TypeError(f"{name}: expected a real number, got {type(x).__name__}")
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a real number, got {type(x).__name__}") from None
    except OverflowError:
        raise ValueError(f"{name}: {type(x).__name__} too large for a float") from None


cdef float finite_float(object x, str name) except? -1:
    """x as a float32 that is finite: a double past FLT_MAX would round to inf."""
    cdef double v = real_number(x, name)
    if not fabs(v) <= FLT_MAX:  # NaN fails too
        raise ValueError(f"{name}: expected a finite float32, got {v}")
    return <float>v


cdef int adamw_params(float *params, object alpha, object beta1, object beta2, object eps,
                      object wd, object beta1h, object beta2h) except -1:
    """AdamW's seven step parameters into params, in the kernel's order, each
    checked as a finite float32 and named when it is not."""
    params[0] = finite_float(alpha, "alpha")
    params[1] = finite_float(beta1, "beta1")
    params[2] = finite_float(beta2, "beta2")
    params[3] = finite_float(eps, "eps")
    params[4] = finite_float(wd, "wd")
    params[5] = finite_float(beta1h, "beta1h")
    params[6] = finite_float(beta2h, "beta2h")
    return 0
