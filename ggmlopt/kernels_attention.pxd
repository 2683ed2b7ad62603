# C-level entry points of the attention kernels, for other Cython code:
#
#     from ggmlopt.kernels_attention cimport attention_forward_f32
#     with nogil:
#         attention_forward_f32(batch, seq, n_heads, n_kv_heads, head_dim,
#                               q, q_stride, k, k_stride, v, v_stride, out, out_stride, lse)
#
# Each forwards to the function of the same name with a ggmlopt_ prefix in
# ggmlopt.h (see ggmlopt.get_include()), which documents the formulas and the
# token-row layout.  They take raw pointers, check nothing but the head shape
# (returning -1 for a bad one), never allocate and never need the GIL.
from libc.stdint cimport int64_t

cdef int attention_forward_f32(int64_t batch, int64_t seq, int64_t n_heads, int64_t n_kv_heads,
                               int64_t head_dim, const float *q, int64_t q_stride,
                               const float *k, int64_t k_stride, const float *v,
                               int64_t v_stride, float *out, int64_t out_stride,
                               float *lse) noexcept nogil
cdef int attention_backward_f32(int64_t batch, int64_t seq, int64_t n_heads, int64_t n_kv_heads,
                                int64_t head_dim, const float *q, int64_t q_stride,
                                const float *k, int64_t k_stride, const float *v,
                                int64_t v_stride, const float *out, int64_t out_stride,
                                const float *lse, const float *dout, float *dq, float *dk,
                                float *dv) noexcept nogil
cdef void rope_f32(int64_t nrows, int64_t seq, int64_t pos0, int64_t n_heads, int64_t head_dim,
                   const float *x, int64_t x_stride, float *y, int64_t y_stride,
                   const float *cos, const float *sin, int inverse) noexcept nogil
cdef int attention_decode_f32(int64_t batch, int64_t n_heads, int64_t n_kv_heads,
                              int64_t head_dim, int64_t length, const float *q, const float *k,
                              const float *v, int64_t kv_item_stride, float *out, float *scores,
                              float scale) noexcept nogil
