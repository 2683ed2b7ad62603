# C-level SwiGLU kernels for other Cython code (ggmlopt.h documents them); raw
# pointers, no checks, no allocation, no GIL.
from libc.stdint cimport int64_t

cdef void swiglu_f32(int64_t n, const float *gate, const float *up, float *h) noexcept nogil
cdef void swiglu_backward_f32(int64_t n, const float *gate, const float *up, const float *grad_h,
                              float *grad_gate, float *grad_up) noexcept nogil
