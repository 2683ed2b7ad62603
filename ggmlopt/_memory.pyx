# cython: language_level=3
"""AlignedBuffer: the one owner of a zeroed, 64-byte aligned block of memory.

Datasets, the parameter arena and batch buffers allocate through it and hand
Python NumPy views whose base is the buffer: a view kept after its owner is
dropped keeps the memory alive, and the memory is freed exactly once, when the
last reference goes.
"""
import numpy as np

cimport numpy as cnp
from cpython.mem cimport PyMem_RawCalloc, PyMem_RawFree
from cpython.ref cimport Py_INCREF
from libc.stdint cimport uintptr_t

cdef extern from *:
    Py_ssize_t PY_SSIZE_T_MAX

cdef extern from "numpy/arrayobject.h":
    # steals a reference to descr (numpy's .pxd leaves it out for that reason)
    object PyArray_NewFromDescr(type subtype, cnp.dtype descr, int nd, cnp.npy_intp *dims,
                                cnp.npy_intp *strides, void *data, int flags, object obj)

cnp.import_array()

ALIGNMENT = 64  # a cache line, and enough for any SIMD load


cdef class AlignedBuffer:
    """AlignedBuffer(nbytes): nbytes of zeroed memory aligned to 64 bytes."""

    def __cinit__(self, Py_ssize_t nbytes):
        if nbytes < 0:
            raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
        self.raw = PyMem_RawCalloc(<size_t>nbytes + 64, 1)
        if self.raw == NULL:
            raise MemoryError(f"cannot allocate {nbytes} bytes")
        self.data = <char *>((<uintptr_t>self.raw + 63) & ~(<uintptr_t>63))
        self.nbytes = nbytes

    def __dealloc__(self):
        PyMem_RawFree(self.raw)
        self.raw = NULL
        self.data = NULL

    @property
    def address(self):
        """The start address (a multiple of 64)."""
        return <uintptr_t>self.data

    cdef cnp.ndarray view(self, object dtype, tuple shape, Py_ssize_t offset=0):
        """A writable C-contiguous view of the given dtype and shape at a byte offset."""
        cdef cnp.dtype dt = np.dtype(dtype)
        if dt.hasobject:
            # references stored in this memory would never be released
            raise TypeError(f"dtype: {dt} holds Python objects; expected plain data")
        cdef int nd = len(shape)
        cdef cnp.npy_intp dims[32]
        if nd > 32:
            raise ValueError("shape: at most 32 dimensions")
        # sizes in Python ints: a product or an offset past 2^63 must not wrap into
        # a small number that passes the bounds check
        count = 1
        for i in range(nd):
            if shape[i] < 0:
                raise ValueError(f"shape: negative dimension in {shape}")
            count *= shape[i]
        if offset < 0 or offset > self.nbytes or count * dt.itemsize > self.nbytes - offset:
            raise ValueError(f"a view of {count} x {dt} at byte {offset} does not fit in "
                             f"{self.nbytes} bytes")
        for i in range(nd):  # an empty view may have any other dimension: keep npy_intp's range
            if shape[i] > PY_SSIZE_T_MAX:
                raise ValueError(f"shape: dimension {shape[i]} is too large")
            dims[i] = shape[i]
        Py_INCREF(dt)  # PyArray_NewFromDescr steals this reference
        cdef cnp.ndarray arr = PyArray_NewFromDescr(
            np.ndarray, dt, nd, dims, NULL, <void *>(self.data + offset), cnp.NPY_ARRAY_CARRAY,
            None)
        Py_INCREF(self)  # PyArray_SetBaseObject steals this reference
        cnp.PyArray_SetBaseObject(arr, self)
        return arr

    def as_array(self, dtype, shape, Py_ssize_t offset=0):
        """Python access to view(): a writable view that keeps this buffer alive."""
        return self.view(dtype, tuple(shape), offset)
