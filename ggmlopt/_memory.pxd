# Aligned memory that one owner allocates and frees, and NumPy views of it.
cimport numpy as cnp

cdef class AlignedBuffer:
    cdef void *raw        # what was allocated (freed in __dealloc__)
    cdef char *data       # raw rounded up to ALIGNMENT, zero-filled
    cdef readonly Py_ssize_t nbytes
    cdef cnp.ndarray view(self, object dtype, tuple shape, Py_ssize_t offset=*)
