# C-level entry points of the ggmlopt kernels, for other Cython code:
#
#     from ggmlopt.kernels cimport adamw_step_f32
#     with nogil:
#         adamw_step_f32(n, w, g, m, v, params)
#
# Each forwards to the function of ggmlopt.h (see ggmlopt.get_include()) that
# documents its formula: the same name with a ggmlopt_ prefix, but
# gather_shards_bytes (ggmlopt_gather_shards) and quantize_q8_0_row (without
# the header's Q8_1 sums: NULL).  They take raw pointers and never need the
# GIL; they check nothing and never allocate, but sgemm_f32, gemm_bf16 and
# matmul_columns_f32 (partials NULL), which allocate their scratch and return
# -2 without it (sgemm_f32: -1 for strides it does not take).  The header's
# declarations are for these: its functions live inside the kernels module,
# which C code does not link against; the scratch sizes
# (ggmlopt_conv2d_direct_workspace, ...) come from the Python functions
# (kernels.conv2d_direct_workspace).
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t

cdef void adamw_step_f32(int64_t n, float *w, const float *g, float *m, float *v,
                         const float *params) noexcept nogil
cdef void sgd_step_f32(int64_t n, float *w, const float *g, float alpha,
                       float wd) noexcept nogil
cdef void axpy_f32(int64_t n, float a, const float *x, float *y) noexcept nogil
cdef void scale_f32(int64_t n, float a, float *x) noexcept nogil
cdef void fill_f32(int64_t n, float value, float *x) noexcept nogil
cdef void add_bias_rows_f32(int64_t nrows, int64_t ncols, float *x,
                            const float *bias) noexcept nogil
cdef void relu_f32(int64_t n, const float *x, float *y) noexcept nogil
cdef void relu_backward_f32(int64_t n, const float *y, const float *g, float *out) noexcept nogil
cdef double sum_f32(int64_t n, const float *x) noexcept nogil
cdef double sumsq_f32(int64_t n, const float *x) noexcept nogil
cdef void argmax_rows_f32(int64_t nrows, int64_t ncols, const float *x,
                          int32_t *out) noexcept nogil
cdef int64_t count_equal_i32(int64_t n, const int32_t *a, const int32_t *b) noexcept nogil
cdef double cross_entropy_f32(int64_t nrows, int64_t ncols, const float *logits,
                              const float *labels, float *grad,
                              float grad_scale) noexcept nogil
cdef double squared_error_f32(int64_t n, const float *out, const float *labels, float *grad,
                              float grad_scale) noexcept nogil
cdef void convert_u8_f32(int64_t n, const uint8_t *src, float *dst, float scale) noexcept nogil
cdef void convert_f16_f32(int64_t n, const uint16_t *src, float *dst,
                          float scale) noexcept nogil
cdef void convert_f32_bf16(int64_t n, const float *src, uint16_t *dst) noexcept nogil
cdef void gather_shards_bytes(int64_t nshards, int64_t shard_bytes, const int64_t *perm,
                              const void *src, void *dst) noexcept nogil
cdef void gather_shards_u8_f32(int64_t nshards, int64_t shard_elems, const int64_t *perm,
                               const uint8_t *src, float *dst, float scale) noexcept nogil
cdef void gather_shards_f16_f32(int64_t nshards, int64_t shard_elems, const int64_t *perm,
                                const uint16_t *src, float *dst, float scale) noexcept nogil
cdef void im2col_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw,
                     int64_t sh, int64_t sw, int64_t ph, int64_t pw, const float *x,
                     float *col, int64_t col_image, int64_t col_row) noexcept nogil
cdef void col2im_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw,
                     int64_t sh, int64_t sw, int64_t ph, int64_t pw, const float *col,
                     int64_t col_image, int64_t col_row, float *dx) noexcept nogil
cdef void add_bias_planes_f32(int64_t n, int64_t c, int64_t plane, float *x,
                              const float *bias) noexcept nogil
cdef void maxpool2d_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                        int64_t sh, int64_t sw, const float *x, float *y,
                        int32_t *idx) noexcept nogil
cdef void maxpool2d_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                                 int64_t sh, int64_t sw, const float *dy, const int32_t *idx,
                                 float *dx) noexcept nogil
cdef int conv2d_direct_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh,
                           int64_t kw, int64_t ph, int64_t pw, const float *x,
                           const float *weight, const float *bias, float *y, float *work,
                           int64_t work_size) noexcept nogil
cdef int conv2d_direct_backward_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o,
                                    int64_t kh, int64_t kw, int64_t ph, int64_t pw,
                                    const float *x, const float *weight, const float *dy,
                                    float *dx, float *dw, float *db, float *work,
                                    int64_t work_size) noexcept nogil
cdef int conv2d_direct_relu_maxpool_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o,
                                        int64_t kh, int64_t kw, int64_t ph, int64_t pw,
                                        int64_t pkh, int64_t pkw, int64_t psh, int64_t psw,
                                        const float *x, const float *weight, const float *bias,
                                        float *y, int32_t *idx, float *work,
                                        int64_t work_size) noexcept nogil
cdef int conv2d_direct_relu_maxpool_backward_f32(
        int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh, int64_t kw,
        int64_t ph, int64_t pw, int64_t pkh, int64_t pkw, int64_t psh, int64_t psw,
        const float *x, const float *weight, const float *dy, const int32_t *idx,
        const float *y, float *dx, float *dw, float *db, float *work,
        int64_t work_size) noexcept nogil
cdef void maxpool2d_relu_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                             int64_t sh, int64_t sw, const float *x, float *y,
                             int32_t *idx) noexcept nogil
cdef void maxpool2d_relu_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh,
                                      int64_t kw, int64_t sh, int64_t sw, const float *dy,
                                      const int32_t *idx, const float *y,
                                      float *dx) noexcept nogil
cdef void avgpool2d_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                        int64_t sh, int64_t sw, const float *x, float *y) noexcept nogil
cdef void avgpool2d_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                                 int64_t sh, int64_t sw, const float *dy,
                                 float *dx) noexcept nogil
# activations: forward y = f(x); backward out = g * f'(...) from y (tanh,
# sigmoid) or from x (the others); see ggmlopt.h
cdef void tanh_f32(int64_t n, const float *x, float *y) noexcept nogil
cdef void tanh_backward_f32(int64_t n, const float *y, const float *g, float *out) noexcept nogil
cdef void sigmoid_f32(int64_t n, const float *x, float *y) noexcept nogil
cdef void sigmoid_backward_f32(int64_t n, const float *y, const float *g,
                               float *out) noexcept nogil
cdef void silu_f32(int64_t n, const float *x, float *y) noexcept nogil
cdef void silu_backward_f32(int64_t n, const float *x, const float *g, float *out) noexcept nogil
cdef void gelu_f32(int64_t n, const float *x, float *y) noexcept nogil
cdef void gelu_backward_f32(int64_t n, const float *x, const float *g, float *out) noexcept nogil
cdef void gelu_tanh_f32(int64_t n, const float *x, float *y) noexcept nogil
cdef void gelu_tanh_backward_f32(int64_t n, const float *x, const float *g,
                                 float *out) noexcept nogil
cdef void leaky_relu_f32(int64_t n, const float *x, float *y,
                         float negative_slope) noexcept nogil
cdef void leaky_relu_backward_f32(int64_t n, const float *x, const float *g, float *out,
                                  float negative_slope) noexcept nogil
cdef double cross_entropy_index_f32(int64_t nrows, int64_t ncols, const float *logits,
                                    const int32_t *classes, float *grad,
                                    float grad_scale) noexcept nogil
# language-model layers (ggmlopt.h documents them; wrapped by kernels_embedding,
# kernels_norm, kernels_glu)
cdef void embedding_f32(int64_t n, int64_t dim, const int32_t *ids, const float *weight,
                        float *out) noexcept nogil
cdef void embedding_backward_f32(int64_t n, int64_t dim, const int32_t *ids, const float *grad,
                                 int64_t num, float *grad_weight) noexcept nogil
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
cdef int64_t norm_backward_work_size(int64_t nrows, int64_t dim) noexcept nogil
cdef void swiglu_f32(int64_t n, const float *gate, const float *up, float *h) noexcept nogil
cdef void swiglu_backward_f32(int64_t n, const float *gate, const float *up, const float *grad_h,
                              float *grad_gate, float *grad_up) noexcept nogil
# causal attention and rotary embedding (see ggmlopt.h; wrapped in kernels_attention)
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
# the same with a first key per query row (kv_start: NULL, or (batch, seq) int32)
cdef int attention_forward_ranged_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                      int64_t n_kv_heads, int64_t head_dim, const float *q,
                                      int64_t q_stride, const float *k, int64_t k_stride,
                                      const float *v, int64_t v_stride, float *out,
                                      int64_t out_stride, float *lse,
                                      const int32_t *kv_start) noexcept nogil
cdef int attention_backward_ranged_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                       int64_t n_kv_heads, int64_t head_dim, const float *q,
                                       int64_t q_stride, const float *k, int64_t k_stride,
                                       const float *v, int64_t v_stride, const float *out,
                                       int64_t out_stride, const float *lse, const float *dout,
                                       float *dq, float *dk, float *dv,
                                       const int32_t *kv_start) noexcept nogil
cdef void rope_f32(int64_t nrows, int64_t seq, int64_t pos0, int64_t n_heads, int64_t head_dim,
                   const float *x, int64_t x_stride, float *y, int64_t y_stride,
                   const float *cos, const float *sin, int inverse) noexcept nogil
cdef int attention_decode_f32(int64_t batch, int64_t n_heads, int64_t n_kv_heads,
                              int64_t head_dim, int64_t length, const float *q, const float *k,
                              const float *v, int64_t kv_item_stride, float *out, float *scores,
                              float scale) noexcept nogil
# the ranged ones and the decode step with Gemma 2's soft cap on the scores (0: none)
cdef int attention_forward_capped_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                      int64_t n_kv_heads, int64_t head_dim, const float *q,
                                      int64_t q_stride, const float *k, int64_t k_stride,
                                      const float *v, int64_t v_stride, float *out,
                                      int64_t out_stride, float *lse, const int32_t *kv_start,
                                      float softcap) noexcept nogil
cdef int attention_backward_capped_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                       int64_t n_kv_heads, int64_t head_dim, const float *q,
                                       int64_t q_stride, const float *k, int64_t k_stride,
                                       const float *v, int64_t v_stride, const float *out,
                                       int64_t out_stride, const float *lse, const float *dout,
                                       float *dq, float *dk, float *dv, const int32_t *kv_start,
                                       float softcap) noexcept nogil
cdef int attention_decode_capped_f32(int64_t batch, int64_t n_heads, int64_t n_kv_heads,
                                     int64_t head_dim, int64_t length, const float *q,
                                     const float *k, const float *v, int64_t kv_item_stride,
                                     float *out, float *scores, float scale,
                                     float softcap) noexcept nogil
# GGUF block types (see ggmlopt.h; wrapped in kernels_quant)
cdef int64_t quant_row_bytes(int type, int64_t ncols) noexcept nogil
cdef int dequantize_rows(int type, int64_t r0, int64_t r1, int64_t ncols, const uint8_t *src,
                         float *dst, int64_t dst_stride) noexcept nogil
cdef int quant_matmul_f32(int type, int64_t nx, int64_t ncols, const float *x, int64_t x_stride,
                          int64_t nout, const uint8_t *w, float *y,
                          int64_t y_stride) noexcept nogil
cdef int quant_matmul_q8(int type, int64_t nx, int64_t ncols, const float *x, int64_t x_stride,
                         int64_t nout, const uint8_t *w, float *y, int64_t y_stride,
                         int8_t *xqs, float *xd, float *xsum) noexcept nogil
cdef void quantize_q8_0_row(const float *x, int64_t n, int8_t *qs, float *scales) noexcept nogil
cdef void quantize_q8_k_row(const float *x, int64_t n, int8_t *qs, float *scales,
                            int16_t *sums) noexcept nogil
cdef extern from "ggmlopt.h" nogil:
    ctypedef struct ggmlopt_qproduct:
        int type
        int64_t nout
        const uint8_t *w
        float *y
        int64_t y_stride
    enum: GGMLOPT_QPRODUCTS_MAX
    ctypedef struct ggmlopt_block_weight:
        int type
        int64_t nout
        const uint8_t *w
        const float *bias
        const float *lora_a
        const float *lora_b
        int64_t rank, lora_b_stride
        float lora_scale
        int64_t columns_ld
    ctypedef struct ggmlopt_llama_block:
        int64_t dim, n_heads, n_kv_heads, head_dim, ffn_dim
        float eps
        const float *attn_norm
        const float *ffn_norm
        const float *q_norm
        const float *k_norm
        ggmlopt_block_weight q, k, v, o, gate, up, down
        int64_t window
        int q8
cdef int quant_matmul_many(int n, const ggmlopt_qproduct *products, int64_t nx, int64_t ncols,
                           const float *x, int64_t x_stride, int q8, int8_t *xqs, float *xd,
                           float *xsum) noexcept nogil
# one decode step of a Llama-layout block (see ggmlopt.h; wrapped in kernels_decode)
cdef int64_t decode_block_work_size(const ggmlopt_llama_block *blk, int64_t batch,
                                    int64_t max_len) noexcept nogil
cdef int decode_block_f32(const ggmlopt_llama_block *blk, int64_t batch, int64_t pos, float *x,
                          float *cache_k, float *cache_v, int64_t max_len, const float *cos,
                          const float *sin, void *work) noexcept nogil
cdef int dequantize_gather(int type, int64_t n, const int32_t *ids, int64_t ncols,
                           const uint8_t *src, float *dst) noexcept nogil
cdef int quantize_rows_f32(int type, int64_t nrows, int64_t ncols, const float *src,
                           uint8_t *dst) noexcept nogil
cdef int sgemm_f32(int64_t m, int64_t n, int64_t k, const float *a, int64_t a_row, int64_t a_col,
                   const float *b, int64_t b_row, int64_t b_col, float *c, int64_t ldc,
                   int accumulate) noexcept nogil
cdef int matmul_columns_f32(int64_t nx, int64_t ncols, const float *x, int64_t x_stride,
                            int64_t nout, const float *w, int64_t ld, float *y,
                            int64_t y_stride, float *partials) noexcept nogil
cdef int gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t a_row,
                   int64_t a_col, const uint16_t *b, int64_t b_row, int64_t b_col, float *c,
                   int64_t ldc, int accumulate) noexcept nogil
