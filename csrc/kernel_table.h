/*
 * The dispatch table: one instance per SIMD path (kernels_<isa>.c), each
 * filled with that path's compilation of the kernels in kernels/ (*.inc files).
 * dispatch.c picks one at load time; the public functions in ggmlopt.h split
 * large calls into ranges and call the active table on each range.
 */
#ifndef GGMLOPT_KERNEL_TABLE_H
#define GGMLOPT_KERNEL_TABLE_H

#include <stdint.h>

/* The geometry of a 2-D convolution on images (c, h, w): kernel kh*kw, stride
 * (sh, sw), zero padding (ph, pw), output oh*ow. */
typedef struct {
    int64_t c, h, w, kh, kw, sh, sw, ph, pw, oh, ow;
} go_conv_geom;

/* The geometry of a 2-D pooling over planes h*w: window kh*kw, stride (sh, sw),
 * output oh*ow, no padding. */
typedef struct {
    int64_t h, w, kh, kw, sh, sw, oh, ow;
} go_pool_geom;

/* A stride-1 convolution computed directly (kernels/conv_direct.inc): source
 * images (cin, hs, ws) sit at (top, left) of zero planes (hp, wp) (negative:
 * cropped), convolved with weights (cout, cin, kh, kw) into (cout, oh, ow),
 * oh = hp - kh + 1, ow = wp - kw + 1.  Outputs are computed in the "wide"
 * layout q = oy*wp + ox over whole vectors; columns ox >= ow are dropped. */
typedef struct {
    int64_t cin, hs, ws, cout, kh, kw, top, left, hp, wp;
} go_direct_geom;

/* The widest vector any path uses, for scratch sizes that fit every path. */
#define GO_DIRECT_MAX_EPR 16

/* Floats of one padded image (cin planes hp*wp, then slack read by the last
 * vectors of the wide layout; rounded up to 64 bytes, so consecutive images
 * keep the alignment of the first) and of one wide output (cout planes of
 * oh*wp rounded up to whole vectors of epr floats). */
static inline int64_t go_direct_padded_size(const go_direct_geom *g, int64_t epr) {
    const int64_t n = g->cin * g->hp * g->wp + 2 * epr + g->kw;
    return (n + GO_DIRECT_MAX_EPR - 1) / GO_DIRECT_MAX_EPR * GO_DIRECT_MAX_EPR;
}
static inline int64_t go_direct_wide_stride(const go_direct_geom *g, int64_t epr) {
    const int64_t wide = (g->hp - g->kh + 1) * g->wp;
    return (wide + epr - 1) / epr * epr;
}

/* Causal attention (kernels/attention.inc): token rows of q_stride, k_stride,
 * v_stride and out_stride floats (head h at h * head_dim); dq, dk, dv have the
 * strides of q, k, v and dout that of out; lse is (batch, n_heads, seq). */
typedef struct {
    int64_t batch, seq, n_heads, n_kv_heads, head_dim;
    const float *q, *k, *v;
    int64_t q_stride, k_stride, v_stride, out_stride;
    float *out, *lse;
    const float *dout;
    float *dq, *dk, *dv;
    float scale;
    /* NULL, or (batch, seq) first keys: query i of item b sees keys
     * kv_start[b * seq + i] .. i (0 <= kv_start[i] <= i, non-decreasing in i):
     * documents packed into one window, or a sliding window */
    const int32_t *kv_start;
    /* 0, or Gemma 2's soft cap c on the scores: s -> c * tanh(s / c) */
    float softcap;
} go_attn_args;

/* One new query per head (a decode step) over `length` cached keys and values:
 * q (n_heads, head_dim); key and value l of kv head g at k + l * kv_stride +
 * g * head_dim (and v likewise); query head h reads kv head h / (n_heads /
 * n_kv_heads); scores: scratch of n_heads * length floats; out (n_heads,
 * head_dim). */
typedef struct {
    int64_t n_heads, n_kv_heads, head_dim, length, kv_stride;
    const float *q, *k, *v;
    float *out, *scores;
    float scale;
    float softcap; /* 0, or the scores' soft cap (as go_attn_args) */
} go_attn_decode_args;

/* keys per tile (forward, backward), query rows per backward block, the widest head */
#define GO_ATTN_BK 32
#define GO_ATTN_BK_BWD 64
#define GO_ATTN_BQ_BWD 32
#define GO_ATTN_MAX_D 256
/* the forward's accumulators (query rows x padded head) on the stack */
#define GO_ATTN_ACC_FLOATS 16384
#define GO_ATTN_MAX_ROWS 128

/* head_dim rounded up to the widest vector: the stride of stack rows */
static inline int64_t go_attn_dpad(int64_t d) { return (d + 15) & ~(int64_t)15; }
/* query rows per forward call: as many as the accumulators hold, whole tiles */
static inline int64_t go_attn_forward_rows(int64_t d) {
    int64_t r = GO_ATTN_ACC_FLOATS / go_attn_dpad(d);
    if (r > GO_ATTN_MAX_ROWS) r = GO_ATTN_MAX_ROWS;
    return r / GO_ATTN_BK * GO_ATTN_BK;
}

/* Rotary embedding of rows [r0, r1) of (rows, n_heads, head_dim), row r at
 * position pos0 + r % seq; cos, sin are (positions, head_dim / 2). */
typedef struct {
    int64_t seq, pos0, n_heads, head_dim;
    const float *x;
    int64_t x_stride;
    float *y;
    int64_t y_stride;
    const float *cos, *sin;
    int inverse;
} go_rope_args;

/* GGUF tensor types the quantized kernels read (ggml's enum ggml_type numbers),
 * their values per block and bytes per block. */
enum {
    GO_QTYPE_F32 = 0, GO_QTYPE_F16 = 1, GO_QTYPE_Q4_0 = 2, GO_QTYPE_Q4_1 = 3,
    GO_QTYPE_Q5_0 = 6, GO_QTYPE_Q5_1 = 7, GO_QTYPE_Q8_0 = 8, GO_QTYPE_Q2_K = 10,
    GO_QTYPE_Q3_K = 11, GO_QTYPE_Q4_K = 12, GO_QTYPE_Q5_K = 13, GO_QTYPE_Q6_K = 14,
    GO_QTYPE_IQ4_NL = 20, GO_QTYPE_IQ4_XS = 23, GO_QTYPE_BF16 = 30
};
/* How llama.cpp rounds the activations a weight type multiplies in integers:
 * to Q8_0 blocks of 32 (quant_dot_q8_rows) or, for the types of 256-value
 * super-blocks, to Q8_K blocks (quant_dot_q8k_rows), whose one scale a
 * super-block lets its sub-blocks' products add up in integers; GO_Q8_NONE:
 * float32 activations. */
enum { GO_Q8_NONE = 0, GO_Q8_0 = 1, GO_Q8_K = 2 };
static inline int go_qtype_q8_form(int type) {
    switch (type) {
    case GO_QTYPE_Q8_0: case GO_QTYPE_Q4_0: case GO_QTYPE_Q5_0: case GO_QTYPE_IQ4_NL:
    case GO_QTYPE_Q4_1: case GO_QTYPE_Q5_1:
        return GO_Q8_0;
    case GO_QTYPE_Q2_K: case GO_QTYPE_Q3_K: case GO_QTYPE_Q4_K: case GO_QTYPE_Q5_K:
    case GO_QTYPE_Q6_K: case GO_QTYPE_IQ4_XS: return GO_Q8_K;
    default: return GO_Q8_NONE;
    }
}
static inline int go_qtype_has_q8_dot(int type) { return go_qtype_q8_form(type) != GO_Q8_NONE; }
static inline int64_t go_qtype_block(int type) {
    switch (type) {
    case GO_QTYPE_F32: case GO_QTYPE_F16: case GO_QTYPE_BF16: return 1;
    case GO_QTYPE_Q4_0: case GO_QTYPE_Q4_1: case GO_QTYPE_Q5_0: case GO_QTYPE_Q5_1:
    case GO_QTYPE_Q8_0: case GO_QTYPE_IQ4_NL: return 32;
    case GO_QTYPE_Q2_K: case GO_QTYPE_Q3_K: case GO_QTYPE_Q4_K: case GO_QTYPE_Q5_K:
    case GO_QTYPE_Q6_K: case GO_QTYPE_IQ4_XS: return 256;
    default: return 0;
    }
}
static inline int64_t go_qtype_size(int type) {
    switch (type) {
    case GO_QTYPE_F32: return 4;
    case GO_QTYPE_F16: case GO_QTYPE_BF16: return 2;
    case GO_QTYPE_Q4_0: return 18;
    case GO_QTYPE_Q4_1: return 20;
    case GO_QTYPE_Q5_0: return 22;
    case GO_QTYPE_Q5_1: return 24;
    case GO_QTYPE_Q8_0: return 34;
    case GO_QTYPE_Q4_K: return 144;
    case GO_QTYPE_Q5_K: return 176;
    case GO_QTYPE_Q6_K: return 210;
    case GO_QTYPE_Q2_K: return 84;
    case GO_QTYPE_Q3_K: return 110;
    case GO_QTYPE_IQ4_NL: return 18;
    case GO_QTYPE_IQ4_XS: return 136;
    default: return 0;
    }
}
/* values per chunk of the few-rows product (a multiple of every block size) and
 * input rows that share one dequantized chunk */
#define GO_QMM_CHUNK 512
#define GO_QMM_ROWS 8

/* A float32 product C = A B (+ C with accumulate) for kernels/gemm.inc:
 * A[i, p] = a[i * a_row + p * a_col] (a_col == 1, or a_row == 1: a transposed
 * view), B[p, j] = b[p * b_row + j * b_col] (any layout), C rows of ldc. */
typedef struct {
    int64_t m, n, k;
    const float *a;
    int64_t a_row, a_col;
    const float *b;
    int64_t b_row, b_col;
    float *c;
    int64_t ldc;
    int accumulate;
} go_gemm_args;

/* A bfloat16 product C = A B (+ C) for kernels/gemm_bf16.inc: A and B hold
 * bf16 bits, C float32; A[i, p] = a[i * a_row + p * a_col] with a_col == 1 or
 * a_row == 1, B[p, j] = b[p * b_row + j * b_col] with b_col == 1 or b_row == 1
 * (or k == 1). */
typedef struct {
    int64_t m, n, k;
    const uint16_t *a;
    int64_t a_row, a_col;
    const uint16_t *b;
    int64_t b_row, b_col;
    float *c;
    int64_t ldc;
    int accumulate;
    /* C written around the caches (not accumulate; C and ldc on whole cache lines):
     * a C larger than the last-level cache, read once afterwards (a head's logits) */
    int stream_c;
    /* an A that is packed (not read in place: go_gemm_bf16_a_direct) is packed
     * once per k chunk into the first go_gemm_bf16_a_floats(rows, k) floats of
     * the block's scratch, not again for every column block */
    int pack_a_once;
} go_gemm_bf16_args;

/* whether a bf16 product reads A's pairs in place from its rows: contiguous
 * rows not a multiple of 16 KB apart (rows that far apart share their cache
 * sets, more rows than the sets have ways) */
static inline int go_gemm_bf16_a_direct(int64_t a_row, int64_t a_col) {
    return a_col == 1 && (a_row * 2) % 16384 != 0;
}

/* columns of C per packed block (a multiple of every path's panel width) and
 * the longest k chunk; a block's scratch is at most their product in floats */
#define GO_GEMM_NC 256
#define GO_GEMM_KC_MAX 768
/* products of at most this many rows with B's rows contiguous read B in place
 * (gemm.inc's thin product) */
#define GO_GEMM_THIN 8
/* k chunks as even as the limit allows: they fix each value's sum order, so
 * they depend on k alone */
static inline int64_t go_gemm_kc(int64_t k) {
    if (k <= GO_GEMM_KC_MAX) return k;
    const int64_t chunks = (k + GO_GEMM_KC_MAX - 1) / GO_GEMM_KC_MAX;
    return (k + chunks - 1) / chunks;
}

/* the k chunk of the bf16 products: the float32 one made even, so every chunk
 * but the last holds whole pairs (768 is even: still at most GO_GEMM_KC_MAX) */
static inline int64_t go_gemm_bf16_kc(int64_t k) { return (go_gemm_kc(k) + 1) / 2 * 2; }

/* The widest column block a product packs at once, its packed panels depth
 * floats a column (a k chunk of float32, or its bf16 pairs): as many columns as
 * fit the floats of GO_GEMM_NC columns of the longest bf16 chunk (393 KB), a
 * multiple of 32 (every path's panel width divides it), and at least
 * GO_GEMM_NC.  A short k packs more columns: each block is a pass over A's
 * rows, and 288 columns of a k of 410 in one block instead of 160 + 128 took a
 * head's bf16 weight gradient (32000 x 288 x 410, A transposed) from 332 to
 * 367 GFLOP/s on a Zen 4.  (Float32 blocks of twice those bytes, 672 columns of
 * a k of 288, took a head's forward from 190 down to 170.) */
static inline int64_t go_gemm_block_cols(int64_t depth) {
    const int64_t budget = (int64_t)GO_GEMM_NC * (GO_GEMM_KC_MAX / 2);
    const int64_t cols = depth > 0 ? budget / depth / 32 * 32 : GO_GEMM_NC;
    return cols > GO_GEMM_NC ? cols : GO_GEMM_NC;
}
/* the scratch floats of one block of a float32 / a bf16 product of depth k */
static inline int64_t go_gemm_work_floats(int64_t k) {
    return go_gemm_block_cols(go_gemm_kc(k)) * go_gemm_kc(k);
}
static inline int64_t go_gemm_bf16_work_floats(int64_t k) {
    return go_gemm_block_cols(go_gemm_bf16_kc(k) / 2) * (go_gemm_bf16_kc(k) / 2);
}
/* the floats of rows of a packed A over one k chunk, on any path: tiles of MR
 * rows padded to AP lanes a pair (14 in 16, 6 in 8, 12 in 12, 4 in 4), at most
 * ceil(rows / 6) * 8 + 16 lanes */
static inline int64_t go_gemm_bf16_a_floats(int64_t rows, int64_t k) {
    return ((rows + 5) / 6 * 8 + 16) * ((go_gemm_bf16_kc(k) + 1) / 2);
}

typedef struct ggmlopt_kernel_table {
    const char *name;
    void (*adamw_step_f32)(int64_t n, float *w, const float *g, float *m, float *v,
                           const float *params);
    void (*sgd_step_f32)(int64_t n, float *w, const float *g, float alpha, float wd);
    void (*axpy_f32)(int64_t n, float a, const float *x, float *y);
    void (*scale_f32)(int64_t n, float a, float *x);
    void (*fill_f32)(int64_t n, float value, float *x);
    void (*add_bias_rows_f32)(int64_t nrows, int64_t ncols, float *x, const float *bias);
    void (*relu_f32)(int64_t n, const float *x, float *y);
    void (*relu_backward_f32)(int64_t n, const float *y, const float *g, float *out);
    double (*sum_f32)(int64_t n, const float *x);
    double (*sumsq_f32)(int64_t n, const float *x);
    void (*argmax_rows_f32)(int64_t nrows, int64_t ncols, const float *x, int32_t *out);
    int64_t (*count_equal_i32)(int64_t n, const int32_t *a, const int32_t *b);
    /* Sum over the given rows of each row's loss (not the mean); grad rows get
     * (softmax - labels) * grad_scale, the caller folding 1/nrows into grad_scale. */
    double (*cross_entropy_rows_f32)(int64_t nrows, int64_t ncols, const float *logits,
                                     const float *labels, float *grad, float grad_scale);
    double (*squared_error_f32)(int64_t n, const float *out, const float *labels, float *grad,
                                float grad_scale);
    void (*convert_u8_f32)(int64_t n, const uint8_t *src, float *dst, float scale);
    void (*convert_f16_f32)(int64_t n, const uint16_t *src, float *dst, float scale);
    void (*convert_f32_bf16)(int64_t n, const float *src, uint16_t *dst);
    /* convolution and pooling: nimages / nplanes consecutive ones */
    void (*im2col_f32)(const go_conv_geom *g, int64_t nimages, const float *x, float *col,
                       int64_t col_image, int64_t col_row);
    void (*col2im_f32)(const go_conv_geom *g, int64_t nimages, const float *col,
                       int64_t col_image, int64_t col_row, float *dx);
    void (*add_bias_planes_f32)(int64_t nimages, int64_t channels, int64_t plane, float *x,
                                const float *bias);
    void (*maxpool2d_f32)(const go_pool_geom *g, int64_t nplanes, const float *x, float *y,
                          int32_t *idx);
    void (*maxpool2d_backward_f32)(const go_pool_geom *g, int64_t nplanes, const float *dy,
                                   const int32_t *idx, float *dx);
    void (*avgpool2d_f32)(const go_pool_geom *g, int64_t nplanes, const float *x, float *y);
    void (*avgpool2d_backward_f32)(const go_pool_geom *g, int64_t nplanes, const float *dy,
                                   float *dx);
    /* activations: forward (x -> y) and backward (first input, g -> out); the
     * backward of tanh and sigmoid takes y, the others x */
    void (*tanh_f32)(int64_t n, const float *x, float *y);
    void (*tanh_backward_f32)(int64_t n, const float *y, const float *g, float *out);
    void (*sigmoid_f32)(int64_t n, const float *x, float *y);
    void (*sigmoid_backward_f32)(int64_t n, const float *y, const float *g, float *out);
    void (*silu_f32)(int64_t n, const float *x, float *y);
    void (*silu_backward_f32)(int64_t n, const float *x, const float *g, float *out);
    void (*gelu_f32)(int64_t n, const float *x, float *y);
    void (*gelu_backward_f32)(int64_t n, const float *x, const float *g, float *out);
    void (*gelu_tanh_f32)(int64_t n, const float *x, float *y);
    void (*gelu_tanh_backward_f32)(int64_t n, const float *x, const float *g, float *out);
    void (*leaky_relu_f32)(int64_t n, const float *x, float *y, float slope);
    void (*leaky_relu_backward_f32)(int64_t n, const float *x, const float *g, float *out,
                                    float slope);
    /* cross_entropy_rows_f32 with labels one-hot at classes[r] (each in [0, ncols)) */
    double (*cross_entropy_index_rows_f32)(int64_t nrows, int64_t ncols, const float *logits,
                                           const int32_t *classes, float *grad, float grad_scale);
    /* the same, its gradient (never NULL) as bfloat16 bits: the float32 values
     * rounded as convert_f32_bf16 rounds them; argmax (or NULL): each row's
     * argmax, known already; keep (or NULL): ncols floats of scratch */
    double (*cross_entropy_index_rows_g16_f32)(int64_t nrows, int64_t ncols, const float *logits,
                                               const int32_t *classes, uint16_t *grad16,
                                               float grad_scale, const int32_t *argmax,
                                               float *keep);
    /* direct stride-1 convolution of nimages images (kernels/conv_direct.inc):
     * y = w * x (+ bias, may be NULL); scratch holds go_direct_padded_size +
     * cout * go_direct_wide_stride floats */
    void (*conv2d_direct_f32)(const go_direct_geom *g, int64_t nimages, const float *x,
                              const float *w, const float *bias, float *y, float *scratch);
    /* dw (cout, cin, kh, kw) and db (cout, may be NULL) = the sums over nimages
     * images of the weight and bias gradients for output gradients dy (cout,
     * oh, ow); scratch holds nimages * (go_direct_padded_size + cout *
     * go_direct_wide_stride) floats */
    void (*conv2d_direct_weight_grad_f32)(const go_direct_geom *g, int64_t nimages,
                                          const float *x, const float *dy, float *dw, float *db,
                                          float *scratch);
    /* ReLU then max pooling in one pass (kernels/pool.inc): y = max(maximum, 0)
     * with NaN kept, idx as maxpool2d_f32; the backward passes dy where y != 0 */
    void (*maxpool2d_relu_f32)(const go_pool_geom *g, int64_t nplanes, const float *x, float *y,
                               int32_t *idx);
    void (*maxpool2d_relu_backward_f32)(const go_pool_geom *g, int64_t nplanes, const float *dy,
                                        const int32_t *idx, const float *y, float *dx);
    /* language-model layers (kernels/embedding.inc, norm.inc, glu.inc) */
    void (*embedding_f32)(int64_t n, int64_t dim, const int32_t *ids, const float *weight,
                          float *out);
    /* grad_weight rows in [row_begin, row_end) only, in the order of the ids */
    void (*embedding_backward_f32)(int64_t n, int64_t dim, const int32_t *ids, const float *grad,
                                   int64_t row_begin, int64_t row_end, float *grad_weight);
    void (*rmsnorm_f32)(int64_t nrows, int64_t dim, const float *x, const float *w, float eps,
                        float *y, float *rstd);
    void (*layernorm_f32)(int64_t nrows, int64_t dim, const float *x, const float *w,
                          const float *b, float eps, float *y, float *mean, float *rstd);
    /* dx of either norm (mean NULL: RMSNorm; dx may be NULL) and, when pw is
     * not NULL, the partial sums of the parameter gradients over these rows
     * (pb may be NULL); acc: 2 * dim floats of scratch */
    void (*norm_backward_f32)(int64_t nrows, int64_t dim, const float *x, const float *w,
                              const float *mean, const float *rstd, const float *dy, float *dx,
                              double *pw, double *pb, float *acc);
    void (*swiglu_f32)(int64_t n, const float *gate, const float *up, float *h);
    void (*swiglu_backward_f32)(int64_t n, const float *gate, const float *up,
                                const float *grad_h, float *grad_gate, float *grad_up);
    /* causal attention and rotary embedding (kernels/attention.inc): query rows
     * [i0, i1) of head h (at most go_attn_forward_rows), and the gradients of
     * kv head g with its query heads */
    void (*attention_forward_f32)(const go_attn_args *a, int64_t b, int64_t h, int64_t i0,
                                  int64_t i1);
    void (*attention_backward_f32)(const go_attn_args *a, int64_t b, int64_t g);
    /* the same cut for more threads than (batch, kv head) items: one key tile
     * of (b, g) storing its ds blocks, then a query block's dq from them */
    void (*attention_backward_keys_f32)(const go_attn_args *a, int64_t b, int64_t g, int64_t j0,
                                        float *dss, int64_t nib);
    void (*attention_backward_dq_f32)(const go_attn_args *a, int64_t b, int64_t h, int64_t i0,
                                      int64_t j_from, int64_t j_to, const float *dss,
                                      int64_t nib, int zero);
    void (*rope_f32)(const go_rope_args *a, int64_t r0, int64_t r1);
    void (*attention_decode_f32)(const go_attn_decode_args *a, int64_t h0, int64_t h1);
    /* GGUF block types (kernels/quant.inc): rows [r0, r1) dequantized, and the
     * product of nx float rows with weight rows [j0, j1) */
    void (*dequantize_rows)(int type, int64_t r0, int64_t r1, int64_t ncols, const uint8_t *src,
                            int64_t row_bytes, float *dst, int64_t dst_stride);
    void (*quant_matmul_rows)(int type, int64_t nx, int64_t ncols, const float *x,
                              int64_t x_stride, const uint8_t *w, int64_t row_bytes, int64_t j0,
                              int64_t j1, float *y, int64_t y_stride);
    /* dot(x rounded to Q8_0 blocks, weight rows [j0, j1)) of a weight whose
     * go_qtype_q8_form is GO_Q8_0 (xsum: each block's Q8_1 s = f16(d * its sum
     * of quants), read for Q4_1 and Q5_1; 0 returned for another type) */
    int (*quant_dot_q8_rows)(int type, int64_t ncols, const int8_t *xqs, const float *xd,
                             const float *xsum, const uint8_t *w, int64_t row_bytes, int64_t j0,
                             int64_t j1, float *y);
    /* the same with x rounded to Q8_K blocks (go_quantize_q8_k_row: xd a
     * scale per 256 values, xsums a sum per 16 quants) for a GO_Q8_K type */
    int (*quant_dot_q8k_rows)(int type, int64_t ncols, const int8_t *xqs, const float *xd,
                              const int16_t *xsums, const uint8_t *w, int64_t row_bytes,
                              int64_t j0, int64_t j1, float *y);
    /* columns [j0, j1) of x (nx rows) times a float32 weight stored (ncols, ld)
     * (kernels/matmul_columns.inc): a Linear's few-rows product */
    void (*matmul_columns_f32)(int64_t nx, int64_t ncols, const float *x, int64_t x_stride,
                               const float *w, int64_t ld, int64_t j0, int64_t j1, float *y,
                               int64_t y_stride);
    /* float32 products (kernels/gemm.inc): C rows [r0, r1) x columns [j0, j1)
     * with scratch of go_gemm_work_floats(k) floats; the packed panels'
     * width and the micro-tile's rows */
    void (*sgemm_block_f32)(const go_gemm_args *g, int64_t r0, int64_t r1, int64_t j0,
                            int64_t j1, float *work);
    int (*sgemm_panel_cols)(void);
    int (*sgemm_tile_rows)(void);
    /* bfloat16 products (kernels/gemm_bf16.inc), the same blocks, panels and
     * tiles; scratch of go_gemm_bf16_work_floats(k) floats (pairs), and
     * go_gemm_bf16_a_floats(r1 - r0, k) more with g->pack_a_once */
    void (*gemm_block_bf16)(const go_gemm_bf16_args *g, int64_t r0, int64_t r1, int64_t j0,
                            int64_t j1, float *work);
} ggmlopt_kernel_table;

extern const ggmlopt_kernel_table ggmlopt_kernels_scalar;
#if defined(__x86_64__) || defined(_M_X64)
extern const ggmlopt_kernel_table ggmlopt_kernels_avx2;
extern const ggmlopt_kernel_table ggmlopt_kernels_avx512;
/* the avx512 path's bf16 products with AVX512-BF16's vdpbf16ps
 * (kernels_avx512bf16.c), for CPUs that have it */
void ggmlopt_gemm_block_bf16_avx512bf16(const go_gemm_bf16_args *g, int64_t r0, int64_t r1,
                                        int64_t j0, int64_t j1, float *work);
#endif
#if defined(__aarch64__)
extern const ggmlopt_kernel_table ggmlopt_kernels_neon;
#endif

#endif
