# The argument checks every kernel wrapper module shares (kernels.pyx and the
# wrappers of each kernel family): each raises TypeError or ValueError naming
# the argument before any memory is touched.
cimport numpy as cnp

cdef cnp.ndarray as_array(object a, str name, object dtype, bint writable)
cdef same_size(cnp.ndarray a, str aname, cnp.ndarray b, str bname)
cdef no_overlap(list named)
cdef outputs_apart(list inputs, list outputs)
cdef object count(object value, str name)
cdef double real_number(object x, str name) except? -1
cdef float finite_float(object x, str name) except? -1
cdef int adamw_params(float *params, object alpha, object beta1, object beta2, object eps,
                      object wd, object beta1h, object beta2h) except -1


cdef inline float *f32_ptr(cnp.ndarray a) noexcept:
    return <float *>cnp.PyArray_DATA(a)
