# C-level embedding kernels for other Cython code (ggmlopt.h documents them);
# raw pointers, no checks, no allocation, no GIL.
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t

cdef void embedding_f32(int64_t n, int64_t dim, const int32_t *ids, const float *weight,
                        float *out) noexcept nogil
cdef void embedding_backward_f32(int64_t n, int64_t dim, const int32_t *ids, const float *grad,
                                 int64_t num, float *grad_weight) noexcept nogil
# IndexError unless every int32 id of ids lies in [0, num); name: the argument's
cdef check_ids(cnp.ndarray ids, int64_t num, str name)
