# The parameter arena's C level, for other Cython code:
#
#     from ggmlopt._arena cimport ParamArena
#     cdef ParamArena arena = ctx.arena
#     with nogil:
#         arena.zero_grads_c()
#         arena.adamw_step_c(params)      # params: the 7 floats of ggmlopt.h
#
# All methods run over the whole arena in one kernel call, never allocate and
# never need the GIL.
from libc.stdint cimport int64_t

from ggmlopt._memory cimport AlignedBuffer

cdef class ParamArena:
    cdef AlignedBuffer _buf
    cdef float *_w        # parameters
    cdef float *_g        # gradients, accumulated over a logical batch (NULL without)
    cdef float *_state    # the optimizer's first state section
    cdef float *_m        # AdamW first moment (NULL without momenta)
    cdef float *_v        # AdamW second moment (NULL without momenta)
    cdef readonly int64_t size         # parameter elements
    cdef readonly int64_t section      # floats per section (size rounded up to 16)
    cdef readonly bint momenta         # holds optimizer state (AdamW: m and v)
    cdef readonly bint has_grads       # has a gradient section
    cdef readonly tuple state_names    # the optimizer's state sections, in order
    cdef readonly int64_t nstate       # len(state_names)

    cdef void zero_grads_c(self) noexcept nogil
    cdef void zero_momenta_c(self) noexcept nogil
    cdef void adamw_step_c(self, const float *params) noexcept nogil
    cdef void sgd_step_c(self, float alpha, float wd) noexcept nogil
    cdef double clip_grad_norm_c(self, double max_norm) noexcept nogil  # returns the norm
    cdef int64_t _offset(self, str which) except -1
