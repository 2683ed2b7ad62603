# C-level normalisation kernels for other Cython code (ggmlopt.h documents
# them); raw pointers, no checks, no allocation, no GIL.
from libc.stdint cimport int64_t

cdef void rmsnorm_f32(int64_t nrows, int64_t dim, const float *x, const float *weight, float eps,
                      float *y, float *rstd) noexcept nogil
cdef void rmsnorm_backward_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                               const float *rstd, const float *grad_y, float *grad_x,
                               float *grad_weight, float *work) noexcept nogil
cdef void layernorm_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                        const float *bias, float eps, float *y, float *mean,
                        float *rstd) noexcept nogil
cdef void layernorm_backward_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                                 const float *mean, const float *rstd, const float *grad_y,
                                 float *grad_x, float *grad_weight, float *grad_bias,
                                 float *work) noexcept nogil
# float32 elements of the work area of both backward passes (when they compute
# a parameter gradient), 8-byte aligned
cdef int64_t norm_backward_work_size(int64_t nrows, int64_t dim) noexcept nogil
