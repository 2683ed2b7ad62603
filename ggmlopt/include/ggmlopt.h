/*
 * ggmlopt: the C kernels behind ggml's training engine for Python.
 *
 * Every function here goes through a dispatch table filled once from CPU
 * detection (scalar, AVX2+FMA, AVX-512 or NEON; GGMLOPT_SIMD=scalar|avx2|avx512|neon
 * pins one)
 * and splits large calls across the library's worker threads.  Kernels never
 * allocate, never touch Python and may be called without the GIL.
 *
 * All arrays are dense; n counts elements, not bytes.  Sums accumulate in double.
 */
#ifndef GGMLOPT_H
#define GGMLOPT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Index of each AdamW hyper-parameter in the 7-float array, laid out as ggml's
 * adamw_params tensor.  beta1h = 1/(1 - beta1^t), beta2h = 1/(1 - beta2^t) are
 * computed once per step by the caller (ggml does it on the host). */
enum {
    GGMLOPT_ADAMW_ALPHA = 0,
    GGMLOPT_ADAMW_BETA1 = 1,
    GGMLOPT_ADAMW_BETA2 = 2,
    GGMLOPT_ADAMW_EPS = 3,
    GGMLOPT_ADAMW_WD = 4,
    GGMLOPT_ADAMW_BETA1H = 5,
    GGMLOPT_ADAMW_BETA2H = 6,
    GGMLOPT_ADAMW_NPARAMS = 7
};

/* ---- optimizer steps ---------------------------------------------------- */

/* m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*g^2;
 * w = w*(1 - alpha*wd) - alpha * (m*beta1h) / (sqrt(v*beta2h) + eps) */
void ggmlopt_adamw_step_f32(int64_t n, float *w, const float *g, float *m, float *v,
                            const float params[GGMLOPT_ADAMW_NPARAMS]);

/* w = w*(1 - alpha*wd) - alpha*g */
void ggmlopt_sgd_step_f32(int64_t n, float *w, const float *g, float alpha, float wd);

/* ---- elementwise helpers for gradients ----------------------------------- */

void ggmlopt_axpy_f32(int64_t n, float a, const float *x, float *y); /* y += a*x */
void ggmlopt_scale_f32(int64_t n, float a, float *x);                /* x *= a   */
void ggmlopt_fill_f32(int64_t n, float value, float *x);             /* x = value */

/* ---- layer helpers ------------------------------------------------------------ */

/* x[r, :] += bias for each row r of a (nrows, ncols) matrix */
void ggmlopt_add_bias_rows_f32(int64_t nrows, int64_t ncols, float *x, const float *bias);
/* y = x > 0 ? x : 0, NaN kept (as torch: a NaN reaches the loss) and -0 giving
 * +0; y may be x */
void ggmlopt_relu_f32(int64_t n, const float *x, float *y);
/* out = y != 0 ? g : 0, with y a relu output; out may be g */
void ggmlopt_relu_backward_f32(int64_t n, const float *y, const float *g, float *out);

/* ---- reductions ----------------------------------------------------------- */

double ggmlopt_sum_f32(int64_t n, const float *x);
double ggmlopt_sumsq_f32(int64_t n, const float *x); /* sum of x^2 */
/* Per row of a (nrows, ncols) matrix: the index of the maximum; ties go to the
 * LAST maximal index (ggml's rule); NaN entries are ignored, and a row with no
 * comparable value (all NaN) gives 0. */
void ggmlopt_argmax_rows_f32(int64_t nrows, int64_t ncols, const float *x, int32_t *out);
int64_t ggmlopt_count_equal_i32(int64_t n, const int32_t *a, const int32_t *b);

/* ---- losses ------------------------------------------------------------- */

/* Cross-entropy of rows of logits against probability labels, (nrows, ncols):
 * returns mean over rows of -sum(labels * log_softmax(row)).  When grad is not
 * NULL it receives (softmax(row) - labels) * grad_scale / nrows (ggml's
 * cross_entropy_loss_back with upstream gradient grad_scale).  Terms whose label
 * is 0 contribute nothing, so -inf logits with zero labels give no NaN; a NaN
 * logit makes its row's loss NaN. */
double ggmlopt_cross_entropy_f32(int64_t nrows, int64_t ncols, const float *logits,
                                 const float *labels, float *grad, float grad_scale);

/* Returns sum((out - labels)^2); when grad is not NULL it receives
 * 2*(out - labels)*grad_scale. */
double ggmlopt_squared_error_f32(int64_t n, const float *out, const float *labels, float *grad,
                                 float grad_scale);

/* ggmlopt_cross_entropy_f32 with labels given as class indices: row r's label
 * is one-hot at classes[r], which must lie in [0, ncols) (not checked here) or
 * be negative: a masked row (torch's ignore_index) that adds no loss and gets a
 * zero gradient, the mean and the gradient scale then taken over the labelled
 * rows only (0 when none is).  Same loss and gradient as the one-hot call,
 * without a (nrows, ncols) label array. */
double ggmlopt_cross_entropy_index_f32(int64_t nrows, int64_t ncols, const float *logits,
                                       const int32_t *classes, float *grad, float grad_scale);
/* The same, also writing each row's argmax (ggmlopt_argmax_rows_f32's, ties to the
 * last maximal index) into pred (nrows,) when pred is not NULL: one pass over the
 * logits where two calls would read them twice. */
double ggmlopt_cross_entropy_index_argmax_f32(int64_t nrows, int64_t ncols, const float *logits,
                                              const int32_t *classes, float *grad,
                                              float grad_scale, int32_t *pred);
/* The same with the gradient written as bfloat16 bits into grad16 (nrows,
 * ncols; not NULL, not overlapping logits): the float32 gradient's values
 * rounded to nearest even, as ggmlopt_convert_f32_bf16 rounds them, and the
 * same loss.  What a bf16 backward multiplies, without the float32 gradient. */
double ggmlopt_cross_entropy_index_g16_f32(int64_t nrows, int64_t ncols, const float *logits,
                                           const int32_t *classes, uint16_t *grad16,
                                           float grad_scale, int32_t *pred);

/* ---- datasets ------------------------------------------------------------- */

void ggmlopt_convert_u8_f32(int64_t n, const uint8_t *src, float *dst, float scale);
void ggmlopt_convert_f16_f32(int64_t n, const uint16_t *src, float *dst, float scale);
/* float32 to bfloat16 bits, rounded to nearest even; NaN stays NaN, subnormals kept. */
void ggmlopt_convert_f32_bf16(int64_t n, const float *src, uint16_t *dst);

/* dst shard j = src shard perm[j], for j < nshards; a shard is shard_bytes bytes. */
void ggmlopt_gather_shards(int64_t nshards, int64_t shard_bytes, const int64_t *perm,
                           const void *src, void *dst);
/* The same, converting to float32 times scale; a shard is shard_elems elements. */
void ggmlopt_gather_shards_u8_f32(int64_t nshards, int64_t shard_elems, const int64_t *perm,
                                  const uint8_t *src, float *dst, float scale);
void ggmlopt_gather_shards_f16_f32(int64_t nshards, int64_t shard_elems, const int64_t *perm,
                                   const uint16_t *src, float *dst, float scale);

/* ---- convolution and pooling (NCHW float32) ------------------------------- */

/* A 2-D convolution of n images (c, h, w) with a kh*kw kernel, stride (sh, sw)
 * and zero padding (ph, pw) has oh = (h + 2*ph - kh)/sh + 1 output rows and
 * ow = (w + 2*pw - kw)/sw + 1 columns; the caller ensures h + 2*ph >= kh,
 * w + 2*pw >= kw and every size and stride >= 1.
 *
 * im2col writes the receptive fields as columns: col row r = (ci*kh + ky)*kw + kx
 * of image i, at col + i*col_image + r*col_row, holds the oh*ow inputs
 * x[i, ci, oy*sh - ph + ky, ox*sw - pw + kx] (0 outside the image) in row-major
 * (oy, ox) order.  col_image = c*kh*kw*oh*ow, col_row = oh*ow gives one
 * (c*kh*kw, oh*ow) matrix per image; col_image = oh*ow, col_row = n*oh*ow one
 * matrix for the batch.  col2im is its adjoint: dx (overwritten) receives, at
 * every input position, the sum of the col entries im2col copied it to.
 * Results do not depend on the number of threads. */
void ggmlopt_im2col_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw,
                        int64_t sh, int64_t sw, int64_t ph, int64_t pw, const float *x,
                        float *col, int64_t col_image, int64_t col_row);
void ggmlopt_col2im_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw,
                        int64_t sh, int64_t sw, int64_t ph, int64_t pw, const float *col,
                        int64_t col_image, int64_t col_row, float *dx);
/* x[i, ci, :] += bias[ci] for n images of c planes of plane elements */
void ggmlopt_add_bias_planes_f32(int64_t n, int64_t c, int64_t plane, float *x, const float *bias);

/* A stride-1 convolution of n images (c, h, w) with weights (o, c, kh, kw),
 * zero padding (ph, pw), computed directly (no im2col): y (n, o, oh, ow) =
 * weight * x + bias (bias may be NULL), oh = h + 2*ph - kh + 1 and likewise
 * ow (the caller ensures both >= 1).  The backward overwrites dw (o, c, kh, kw)
 * and db (o; may be NULL) with the sums over the batch and dx (n, c, h, w; may
 * be NULL) with the input gradient, for the output gradient dy (n, o, oh, ow).
 * Both take caller-provided scratch of work_size floats, at least
 * ggmlopt_conv2d_direct_workspace(..., nthreads) of them (more threads than
 * that sized for share the slots); they return -1 and touch nothing when
 * work_size is too small for one thread, else 0.  Results do not depend on
 * the number of threads: the gradient sums over fixed groups of images. */
int64_t ggmlopt_conv2d_direct_workspace(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o,
                                        int64_t kh, int64_t kw, int64_t ph, int64_t pw,
                                        int nthreads);
int ggmlopt_conv2d_direct_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh,
                              int64_t kw, int64_t ph, int64_t pw, const float *x,
                              const float *weight, const float *bias, float *y, float *work,
                              int64_t work_size);
int ggmlopt_conv2d_direct_backward_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o,
                                       int64_t kh, int64_t kw, int64_t ph, int64_t pw,
                                       const float *x, const float *weight, const float *dy,
                                       float *dx, float *dw, float *db, float *work,
                                       int64_t work_size);
/* The same convolution followed by a ReLU and max pooling (windows pkh*pkw
 * every (psh, psw) over the (oh, ow) output, as ggmlopt_maxpool2d_relu_f32),
 * without the full-size convolution output: each image's stays in the
 * workspace while it is pooled.  y and idx (n, o, poh, pow) as
 * ggmlopt_maxpool2d_relu_f32 gives them for the convolution's output; the
 * backward takes the pool's output gradient dy, idx and y and gives dx, dw,
 * db as ggmlopt_conv2d_direct_backward_f32 would for the convolution's output
 * gradient ggmlopt_maxpool2d_relu_backward_f32 gives (the same bits).  The
 * workspace is the one ggmlopt_conv2d_direct_workspace sizes. */
int ggmlopt_conv2d_direct_relu_maxpool_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o,
                                           int64_t kh, int64_t kw, int64_t ph, int64_t pw,
                                           int64_t pkh, int64_t pkw, int64_t psh, int64_t psw,
                                           const float *x, const float *weight,
                                           const float *bias, float *y, int32_t *idx,
                                           float *work, int64_t work_size);
int ggmlopt_conv2d_direct_relu_maxpool_backward_f32(
    int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh, int64_t kw, int64_t ph,
    int64_t pw, int64_t pkh, int64_t pkw, int64_t psh, int64_t psw, const float *x,
    const float *weight, const float *dy, const int32_t *idx, const float *y, float *dx,
    float *dw, float *db, float *work, int64_t work_size);

/* Pooling over nplanes planes (h, w) with kh*kw windows every (sh, sw), no
 * padding, torch's floor mode: oh = (h - kh)/sh + 1, ow = (w - kw)/sw + 1 (the
 * caller ensures h >= kh, w >= kw, sizes and strides >= 1).
 * maxpool2d: y = each window's maximum, idx its position iy*w + ix in the
 * plane; the first maximal position in row-major window order wins a tie, and
 * a NaN counts as the maximum (the first NaN).  The backward functions
 * overwrite dx: maxpool sends dy to idx (summing where windows overlap),
 * avgpool spreads dy/(kh*kw) over each window. */
void ggmlopt_maxpool2d_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                           int64_t sh, int64_t sw, const float *x, float *y, int32_t *idx);
void ggmlopt_maxpool2d_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh,
                                    int64_t kw, int64_t sh, int64_t sw, const float *dy,
                                    const int32_t *idx, float *dx);
/* ReLU followed by max pooling, in one pass: y = max(each window's maximum,
 * 0) with NaN kept (the two commute), idx the position of the window's
 * maximum as maxpool2d's; the backward sends dy to idx only where y != 0 (the
 * ReLU's rule: y > 0 or NaN).  Outputs and gradients equal those of relu then
 * maxpool2d, ties, zeros and NaN included. */
void ggmlopt_maxpool2d_relu_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                                int64_t sh, int64_t sw, const float *x, float *y, int32_t *idx);
void ggmlopt_maxpool2d_relu_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh,
                                         int64_t kw, int64_t sh, int64_t sw, const float *dy,
                                         const int32_t *idx, const float *y, float *dx);
void ggmlopt_avgpool2d_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                           int64_t sh, int64_t sw, const float *x, float *y);
void ggmlopt_avgpool2d_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh,
                                    int64_t kw, int64_t sh, int64_t sw, const float *dy,
                                    float *dx);

/* ---- run time ----------------------------------------------------------- */

/* Paths, best first.  A path is "compiled" when this build holds its code and
 * "supported" when the CPU can run it. */
int ggmlopt_simd_count(void);
const char *ggmlopt_simd_name(int i);
int ggmlopt_simd_compiled(int i);
int ggmlopt_simd_supported(int i);
/* Pin a path by name; returns 0 on success, -1 for an unknown name, -2 for a
 * path not compiled in, -3 for one this CPU cannot run.  NULL: best available. */
int ggmlopt_simd_select(const char *name);
const char *ggmlopt_simd_active(void);
/* CPU features the dispatcher looks at, as a space-separated list of "name=0|1". */
const char *ggmlopt_cpu_features(void);

/* Threads for large calls (1 = the calling thread only).  n < 1 is clamped to 1. */
void ggmlopt_set_num_threads(int n);
/* How long (ns) an idle kernel thread keeps polling for the next call, yielding
 * its core to other runnable threads, before it sleeps: for callers that call
 * small kernels every few microseconds (decoding); 0 (the default) sleeps
 * after some 10 us.  Returns the previous value. */
int64_t ggmlopt_set_pool_linger_ns(int64_t ns);
int ggmlopt_get_num_threads(void);

/* ---- activations ------------------------------------------------------------ */

/* Forward: y = f(x); y may be x.  Backward: out = g * f'(x), taking the forward
 * output y (tanh, sigmoid) or the forward input x (the others); out may be g.
 * Accuracy against float64 over the whole float range (measured on a sweep of
 * every 4099th float): tanh 1.5 ulp, sigmoid 3 ulp (subnormal results
 * included), SiLU 3.5 ulp, GELU 6 ulp; the tanh-form GELU 2.2 ulp plus the
 * rounding of its exponent's argument 2u (up to 2.7|2u| ulp: 33 ulp at most
 * where |y| > 1e-8, some 300 in the far negative tail).  Products x * f whose factor f is below
 * FLT_MIN may be off by |x| * 2^-149.  Backward: within 7 ulp of the sum of the
 * magnitudes of the derivative's terms.  NaN gives NaN; +-inf give the limits
 * (silu(-inf) = gelu(-inf) = 0). */
void ggmlopt_tanh_f32(int64_t n, const float *x, float *y);
/* out = g * (1 - y^2) */
void ggmlopt_tanh_backward_f32(int64_t n, const float *y, const float *g, float *out);
/* y = 1 / (1 + exp(-x)) */
void ggmlopt_sigmoid_f32(int64_t n, const float *x, float *y);
/* out = g * y * (1 - y) */
void ggmlopt_sigmoid_backward_f32(int64_t n, const float *y, const float *g, float *out);
/* y = x * sigmoid(x) */
void ggmlopt_silu_f32(int64_t n, const float *x, float *y);
/* out = g * s * (1 + x * (1 - s)), s = sigmoid(x) */
void ggmlopt_silu_backward_f32(int64_t n, const float *x, const float *g, float *out);
/* y = x * Phi(x) = x/2 * (1 + erf(x/sqrt(2))) (ggml_gelu_erf) */
void ggmlopt_gelu_f32(int64_t n, const float *x, float *y);
/* out = g * (Phi(x) + x * exp(-x^2/2) / sqrt(2 pi)) */
void ggmlopt_gelu_backward_f32(int64_t n, const float *x, const float *g, float *out);
/* y = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) (ggml_gelu) */
void ggmlopt_gelu_tanh_f32(int64_t n, const float *x, float *y);
/* out = g * dy/dx of the tanh form */
void ggmlopt_gelu_tanh_backward_f32(int64_t n, const float *x, const float *g, float *out);
/* y = x > 0 ? x : negative_slope * x */
void ggmlopt_leaky_relu_f32(int64_t n, const float *x, float *y, float negative_slope);
/* out = x > 0 ? g : negative_slope * g */
void ggmlopt_leaky_relu_backward_f32(int64_t n, const float *x, const float *g, float *out,
                                     float negative_slope);

/* ---- language-model layers -------------------------------------------------- */

/* Embedding: out (n, dim) row i = weight (num, dim) row ids[i].  Every id must
 * lie in [0, num): nothing is checked here. */
void ggmlopt_embedding_f32(int64_t n, int64_t dim, const int32_t *ids, const float *weight,
                           float *out);
/* grad_weight (num, dim) row ids[i] += grad (n, dim) row i, for every i.  Each
 * weight row gets its contributions in the order of the ids (repeated ids
 * included), so the result is the same bits on any number of threads. */
void ggmlopt_embedding_backward_f32(int64_t n, int64_t dim, const int32_t *ids,
                                    const float *grad, int64_t num, float *grad_weight);

/* RMSNorm over the rows of x (nrows, dim): rstd[r] = 1/sqrt(mean(x_r^2) + eps),
 * y = x * rstd * weight (torch.nn.RMSNorm).  Sums in double. */
void ggmlopt_rmsnorm_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                         float eps, float *y, float *rstd);
/* Floats of the work area the backward passes of both norms need for
 * (nrows, dim) when they compute a parameter gradient (8-byte aligned). */
int64_t ggmlopt_norm_backward_work_size(int64_t nrows, int64_t dim);
/* From the forward's x and rstd and grad_y: grad_x (may be NULL) =
 * rstd * (g - xhat * mean(g * xhat)), g = grad_y * weight, xhat = x * rstd;
 * grad_weight (may be NULL) += sum over rows of grad_y * xhat, summed in
 * blocks of rows that depend on the shape only and added in block order (the
 * same bits on any number of threads).  work: ggmlopt_norm_backward_work_size
 * floats (NULL when grad_weight is NULL). */
void ggmlopt_rmsnorm_backward_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                                  const float *rstd, const float *grad_y, float *grad_x,
                                  float *grad_weight, float *work);
/* LayerNorm over the rows of x (nrows, dim): mean[r], rstd[r] =
 * 1/sqrt(var(x_r) + eps) (the biased variance), y = (x - mean) * rstd * weight
 * + bias (bias may be NULL; torch.nn.LayerNorm).  Sums in double. */
void ggmlopt_layernorm_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                           const float *bias, float eps, float *y, float *mean, float *rstd);
/* grad_x (may be NULL) = rstd * (g - mean(g) - xhat * mean(g * xhat)),
 * g = grad_y * weight, xhat = (x - mean) * rstd; grad_weight += sum over rows of
 * grad_y * xhat, grad_bias += sum over rows of grad_y (either may be NULL),
 * summed as for RMSNorm; work: ggmlopt_norm_backward_work_size floats (NULL
 * when both are NULL). */
void ggmlopt_layernorm_backward_f32(int64_t nrows, int64_t dim, const float *x,
                                    const float *weight, const float *mean, const float *rstd,
                                    const float *grad_y, float *grad_x, float *grad_weight,
                                    float *grad_bias, float *work);

/* SwiGLU's product, elementwise over n entries: h = silu(gate) * up. */
void ggmlopt_swiglu_f32(int64_t n, const float *gate, const float *up, float *h);
/* grad_gate = grad_h * up * silu'(gate), grad_up = grad_h * silu(gate), one pass. */
void ggmlopt_swiglu_backward_f32(int64_t n, const float *gate, const float *up,
                                 const float *grad_h, float *grad_gate, float *grad_up);

/* ---- causal attention and rotary embedding ----------------------------------- */

/* Causal scaled dot-product attention, grouped-query, in the flash-attention
 * way (key tiles, an online softmax, no seq x seq matrix):
 *     s_ij = q_i . k_j / sqrt(head_dim) for j <= i,  lse_i = log sum_j exp(s_ij),
 *     out_i = sum_j exp(s_ij - lse_i) v_j
 * with query head h reading kv head h / (n_heads / n_kv_heads).  Token rows:
 * q[b, t, h, :] is at q + (b*seq + t) * q_stride + h * head_dim (k, v, out
 * alike with their strides), so projections' (batch*seq, heads*head_dim)
 * outputs and views into a fused q|k|v row are read in place.  lse receives
 * (batch, n_heads, seq) floats for the backward.  Returns 0, or -1 for a bad
 * shape (n_heads not a multiple of n_kv_heads, head_dim outside 1..256).
 * Threaded over (batch, head, query block); the result does not depend on the
 * number of threads. */
int ggmlopt_attention_forward_f32(int64_t batch, int64_t seq, int64_t n_heads, int64_t n_kv_heads,
                                  int64_t head_dim, const float *q, int64_t q_stride,
                                  const float *k, int64_t k_stride, const float *v,
                                  int64_t v_stride, float *out, int64_t out_stride, float *lse);
/* The gradients for dout (rows of out_stride) of the forward above, given its
 * out and lse: dq (rows of q_stride), dk, dv (rows of k_stride, v_stride; for
 * grouped heads summed over the group's query heads).  dq, dk, dv are
 * written, not added to.  Threaded over (batch, kv head): deterministic,
 * bit-identical for any number of threads. */
int ggmlopt_attention_backward_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                   int64_t n_kv_heads, int64_t head_dim, const float *q,
                                   int64_t q_stride, const float *k, int64_t k_stride,
                                   const float *v, int64_t v_stride, const float *out,
                                   int64_t out_stride, const float *lse, const float *dout,
                                   float *dq, float *dk, float *dv);
/* The two above with a first key per query row: kv_start NULL (plain causal),
 * or (batch, seq) int32, query i of item b seeing keys kv_start[b*seq + i] .. i
 * (each in [0, i], non-decreasing along an item; -1 otherwise): documents
 * packed into one window (each row's document start) or a sliding window
 * (max(0, i - window + 1)).  The work follows the keys seen.  The keys before a
 * row's first are masked by exact zeros: exact for finite inputs, but an inf or
 * NaN in a key or value a row cannot see reaches it as NaN. */
int ggmlopt_attention_forward_ranged_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                         int64_t n_kv_heads, int64_t head_dim, const float *q,
                                         int64_t q_stride, const float *k, int64_t k_stride,
                                         const float *v, int64_t v_stride, float *out,
                                         int64_t out_stride, float *lse,
                                         const int32_t *kv_start);
int ggmlopt_attention_backward_ranged_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                          int64_t n_kv_heads, int64_t head_dim, const float *q,
                                          int64_t q_stride, const float *k, int64_t k_stride,
                                          const float *v, int64_t v_stride, const float *out,
                                          int64_t out_stride, const float *lse,
                                          const float *dout, float *dq, float *dk, float *dv,
                                          const int32_t *kv_start);
/* The two above with Gemma 2's soft cap on the scores: softcap 0 (none, the
 * same as above) or c > 0, each score s becoming c * tanh(s / c) before the
 * softmax (the backward through the cap's slope); -1 for a cap that is
 * negative or not finite. */
int ggmlopt_attention_forward_capped_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                         int64_t n_kv_heads, int64_t head_dim, const float *q,
                                         int64_t q_stride, const float *k, int64_t k_stride,
                                         const float *v, int64_t v_stride, float *out,
                                         int64_t out_stride, float *lse, const int32_t *kv_start,
                                         float softcap);
int ggmlopt_attention_backward_capped_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                          int64_t n_kv_heads, int64_t head_dim, const float *q,
                                          int64_t q_stride, const float *k, int64_t k_stride,
                                          const float *v, int64_t v_stride, const float *out,
                                          int64_t out_stride, const float *lse,
                                          const float *dout, float *dq, float *dk, float *dv,
                                          const int32_t *kv_start, float softcap);
/* Rotary position embedding (Hugging Face's Llama, rotate_half): nrows rows
 * of n_heads heads of head_dim (even) floats, row r at position
 * pos0 + r % seq; with c = cos[p, :], s = sin[p, :] ((positions, head_dim/2)
 * tables) and x1, x2 the halves of each head:
 *     y1 = x1 * c - x2 * s,   y2 = x2 * c + x1 * s.
 * inverse != 0 rotates by the opposite angle (the backward pass).  y may be x. */
/* One decode step's attention: for each of batch items, query head h of q
 * (batch, n_heads, head_dim) over the first `length` positions of the item's
 * cached keys and values (position l of kv head g at k + b * kv_item_stride +
 * l * n_kv_heads * head_dim + g * head_dim; v likewise), kv head h / (n_heads /
 * n_kv_heads): softmax(q . k_l * scale) weighting v_l, into out (batch,
 * n_heads, head_dim).  scores: scratch of n_heads * length floats.  Returns 0,
 * or -1 for a size that is not positive or heads not a multiple of kv heads. */
int ggmlopt_attention_decode_f32(int64_t batch, int64_t n_heads, int64_t n_kv_heads,
                                 int64_t head_dim, int64_t length, const float *q,
                                 const float *k, const float *v, int64_t kv_item_stride,
                                 float *out, float *scores, float scale);
/* The same with the scores soft-capped (softcap 0: none; as the capped
 * attention above). */
int ggmlopt_attention_decode_capped_f32(int64_t batch, int64_t n_heads, int64_t n_kv_heads,
                                        int64_t head_dim, int64_t length, const float *q,
                                        const float *k, const float *v, int64_t kv_item_stride,
                                        float *out, float *scores, float scale, float softcap);
void ggmlopt_rope_f32(int64_t nrows, int64_t seq, int64_t pos0, int64_t n_heads,
                      int64_t head_dim, const float *x, int64_t x_stride, float *y,
                      int64_t y_stride, const float *cos, const float *sin, int inverse);

/* ---- GGUF block types ---------------------------------------------------------- */

/* The bytes of a row of ncols values of ggml type `type` (ggml.h's numbers:
 * F32 0, F16 1, Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q2_K 10, Q3_K 11,
 * Q4_K 12, Q5_K 13, Q6_K 14, IQ4_NL 20, IQ4_XS 23, BF16 30), or -1 when these
 * kernels do not read the type or ncols is not a whole number of its blocks (32
 * values, 256 for the K types and IQ4_XS). */
int64_t ggmlopt_quant_row_bytes(int type, int64_t ncols);
/* Rows [r0, r1) of src (rows of row_bytes = ggmlopt_quant_row_bytes(type,
 * ncols)) as float32 into dst (row r at dst + (r - r0) * dst_stride),
 * bit-identical to ggml's dequantize_row_* and gguf-py's dequantize.
 * Returns 0, or -1 for a type or width ggmlopt_quant_row_bytes refuses. */
int ggmlopt_dequantize_rows(int type, int64_t r0, int64_t r1, int64_t ncols, const uint8_t *src,
                            float *dst, int64_t dst_stride);
/* dst (n, ncols) row i = row ids[i] of src dequantized (a quantized token
 * embedding's lookup).  Every id must be a row of src: nothing is checked here
 * but the type and width (-1 as ggmlopt_dequantize_rows). */
int ggmlopt_dequantize_gather(int type, int64_t n, const int32_t *ids, int64_t ncols,
                              const uint8_t *src, float *dst);
/* y (nx, nout; rows of y_stride) = x (nx, ncols; rows of x_stride) times the
 * transpose of w (nout rows of ncols values of type `type`): y[i, j] =
 * dot(x row i, w row j), each weight row dequantized a chunk at a time and
 * never whole (the product of few input rows: decoding, short batches).
 * Threaded over the weight rows; returns 0, or -1 as ggmlopt_dequantize_rows. */
int ggmlopt_quant_matmul_f32(int type, int64_t nx, int64_t ncols, const float *x,
                             int64_t x_stride, int64_t nout, const uint8_t *w, float *y,
                             int64_t y_stride);
/* y as ggmlopt_quant_matmul_f32 for a weight llama.cpp multiplies in
 * integers, each x row first rounded as llama.cpp rounds it for that type:
 * to Q8_0 blocks (as llama.cpp's x86 quantize_row_q8_0) for a Q8_0 (8), Q4_0 (2),
 * Q5_0 (6), IQ4_NL (20) or IQ4_XS (23) weight, to Q8_K blocks
 * (quantize_row_q8_K_ref) for a Q4_K (12), Q5_K (13) or Q6_K (14) one; each
 * block's dot is taken in integers (a K type's super-block's in one integer
 * sum): the result differs from the float product by that rounding of x.
 * xqs, xd and xsum: scratch of ncols + 32 int8 and ncols / 32 floats each.
 * Returns 0, -1 as ggmlopt_dequantize_rows, -2 for another type. */
/* n floats (a multiple of 32) rounded to Q8_0 blocks as llama.cpp's x86
 * quantize_row_q8_0 / q8_1 round them (d = amax / 127, each quant
 * x * (127 / amax) rounded to nearest, ties to even; ggml's scalar _ref
 * rounds halves away from zero): the int8 quants into qs (n of them) and
 * each block's scale (the f16 it stores, as a float) into scales and, unless
 * sums is NULL, Q8_1's s, f16(d * the sum of its quants), into sums; a block
 * holding a non-finite value gets zero quants and a NaN scale and s. */
void ggmlopt_quantize_q8_0_row(const float *x, int64_t n, int8_t *qs, float *scales,
                               float *sums);
/* n floats (a multiple of 256) rounded to Q8_K blocks as ggml's
 * quantize_row_q8_K_ref rounds them: per 256 values, iscale = -127 / (the
 * value of largest magnitude), each quant iscale * x rounded to nearest, ties
 * to even (at most 127), the scale 1 / iscale into scales (n / 256), each 16
 * quants' sum into sums (n / 16); a block of zeros gets a zero scale, a block
 * holding a non-finite value zero quants and a NaN scale. */
void ggmlopt_quantize_q8_k_row(const float *x, int64_t n, int8_t *qs, float *scales,
                               int16_t *sums);
int ggmlopt_quant_matmul_q8(int type, int64_t nx, int64_t ncols, const float *x,
                            int64_t x_stride, int64_t nout, const uint8_t *w, float *y,
                            int64_t y_stride, int8_t *xqs, float *xd, float *xsum);
/* y (nx rows of y_stride, nout columns) = x (nx rows of x_stride, ncols) times
 * w, a float32 (ncols, ld) weight (ld >= nout) as a Linear stores it, of which
 * the first nout columns: the product of a few rows (decoding's), each weight
 * byte read once, each thread a run of whole rows of w.  A y value is the sum,
 * in order, of chains of multiply-adds over 64 rows of w each: the same bits
 * on any number of threads.  partials: scratch of
 * ggmlopt_matmul_columns_scratch(nx, ncols, nout) floats, or NULL (then the
 * call allocates it).  Returns 0, -1 for ld < nout, -2 with no memory. */
int64_t ggmlopt_matmul_columns_scratch(int64_t nx, int64_t ncols, int64_t nout);
int ggmlopt_matmul_columns_f32(int64_t nx, int64_t ncols, const float *x, int64_t x_stride,
                               int64_t nout, const float *w, int64_t ld, float *y,
                               int64_t y_stride, float *partials);
/* One product of ggmlopt_quant_matmul_many: y (nx rows of y_stride) = x times
 * the transpose of w (nout rows of ncols values of type `type`). */
typedef struct {
    int type;
    int64_t nout;
    const uint8_t *w;
    float *y;
    int64_t y_stride;
} ggmlopt_qproduct;
#define GGMLOPT_QPRODUCTS_MAX 8
/* The n (at most GGMLOPT_QPRODUCTS_MAX) products of the same rows x (nx, ncols;
 * rows of x_stride) as one threaded job over all their weight rows: each y the
 * same bits as ggmlopt_quant_matmul_q8 (q8 != 0, for a type it multiplies in
 * integers) or ggmlopt_quant_matmul_f32 gives it alone.  With q8, xqs is
 * scratch of nx * (ncols + 32) int8, xd and xsum of nx * ncols / 32 floats
 * each (else they may be NULL).  Returns 0, -1 for a type or width
 * ggmlopt_quant_row_bytes refuses, -3 for n out of range. */
int ggmlopt_quant_matmul_many(int n, const ggmlopt_qproduct *products, int64_t nx,
                              int64_t ncols, const float *x, int64_t x_stride, int q8,
                              int8_t *xqs, float *xd, float *xsum);
/* One product of ggmlopt_matmul_columns_many: y (nx rows of y_stride) = x
 * times w, a float32 weight of ncols rows of ld >= nout floats (a Linear's),
 * of which the first nout columns. */
typedef struct {
    int64_t nout;
    const float *w;
    int64_t ld;
    float *y;
    int64_t y_stride;
} ggmlopt_columns_product;
/* The n (at most GGMLOPT_QPRODUCTS_MAX) products of the same rows x as one
 * threaded job, each y the bits ggmlopt_matmul_columns_f32 gives it alone.
 * partials: scratch of nx * ceil(ncols / 64) * (the products' nout summed)
 * floats when ncols > 64, or NULL (then the call allocates it).  Returns 0, -1
 * for a product's ld < nout, -2 with no memory, -3 for n out of range. */
int ggmlopt_matmul_columns_many(int n, const ggmlopt_columns_product *products, int64_t nx,
                                int64_t ncols, const float *x, int64_t x_stride,
                                float *partials);

/* ---- a decode step of a Llama-layout block ------------------------------------ */

/* A frozen weight of the block: nout rows of the block's input width ncols in
 * type `type` (as ggmlopt_quant_matmul_f32 reads them), or with columns_ld > 0
 * a float32 (ncols, columns_ld) weight whose first nout columns are the
 * product's (a Linear's, as ggmlopt_matmul_columns_f32), a bias (nout) or NULL,
 * and a LoRA adapter or none (lora_a NULL): y += lora_scale * (x A) B, A
 * (ncols, rank) float32 rows of rank, B (rank, nout) rows of lora_b_stride
 * floats (>= nout: a column range of a fused projection's B). */
typedef struct {
    int type;
    int64_t nout;
    const uint8_t *w;
    const float *bias;
    const float *lora_a, *lora_b;
    int64_t rank, lora_b_stride;
    float lora_scale;
    int64_t columns_ld;
} ggmlopt_block_weight;

/* Llama's pre-norm block (Mistral's, Qwen2's, Qwen3's, SmolLM's):
 *     h = x + o(attention(rope(qnorm(q(n1))), rope(knorm(k(n1))), v(n1))), n1 = rmsnorm(x)
 *     y = h + down(silu(gate(n2)) * up(n2)),                                n2 = rmsnorm(h)
 * with grouped-query heads (query head h reads kv head h / (n_heads / n_kv_heads)). */
typedef struct {
    int64_t dim, n_heads, n_kv_heads, head_dim, ffn_dim;
    float eps;                          /* every RMSNorm's */
    const float *attn_norm, *ffn_norm;  /* (dim) */
    const float *q_norm, *k_norm;       /* (head_dim): per-head RMSNorms, or both NULL */
    ggmlopt_block_weight q, k, v, o, gate, up, down;
    int64_t window;                     /* a query sees this many positions; 0: all */
    int q8;                             /* activations rounded (see quant_matmul_q8) */
} ggmlopt_llama_block;

/* Bytes of the work area ggmlopt_decode_block_f32 needs for batch rows over a
 * cache of max_len positions; -1 for a block whose sizes do not fit together
 * (heads not a multiple of kv heads, a weight's nout or type wrong). */
int64_t ggmlopt_decode_block_work_size(const ggmlopt_llama_block *blk, int64_t batch,
                                       int64_t max_len);
/* One decode step of blk for batch sequences, each's new token at position
 * pos: x (batch, dim) is the block's input and becomes its output; the new
 * keys and values go to position pos of cache_k and cache_v (batch, max_len,
 * n_kv_heads, head_dim), and the attention reads positions 0 .. pos (the last
 * `window` of them).  cos, sin: the rotary tables ((> pos, head_dim / 2),
 * ggmlopt_rope_f32's; head_dim even), or NULL for a block without RoPE.  work: 64-byte
 * aligned, ggmlopt_decode_block_work_size bytes.  The same kernels in the same
 * order as the layers one by one, so the same bits (an adapter's two small
 * products are float32 sums of their own).  Returns 0, -1 as the work size,
 * -2 for pos outside the cache. */
int ggmlopt_decode_block_f32(const ggmlopt_llama_block *blk, int64_t batch, int64_t pos,
                             float *x, float *cache_k, float *cache_v, int64_t max_len,
                             const float *cos, const float *sin, void *work);
/* nrows rows of ncols float32 values (src, rows of ncols) quantized to type
 * Q4_K (12), Q5_K (13) or Q6_K (14) into dst (rows of
 * ggmlopt_quant_row_bytes(type, ncols)), byte for byte as ggml's
 * quantize_row_q*_K_ref (llama-quantize without an importance matrix).  The
 * values must be finite (nothing is checked here).  Threaded over rows; the
 * bytes do not depend on the threads.  Returns 0, or -1 for another type or a
 * width that is not a whole number of 256-value blocks. */
int ggmlopt_quantize_rows_f32(int type, int64_t nrows, int64_t ncols, const float *src,
                              uint8_t *dst);

/* ---- float32 products -------------------------------------------------------- */

/* C (m, n; rows of ldc >= n floats) = A B, or C += A B with accumulate != 0,
 * A[i, p] = a[i * a_row + p * a_col] (a_col == 1, or a_row == 1 for a
 * transposed view), B[p, j] = b[p * b_row + j * b_col] (any non-negative
 * strides).  C must not overlap A or B.  Each value is one chain of float32
 * FMAs over p in order (C's old value first with accumulate), in chunks that
 * depend on k alone: the same bits on any number of threads.  Threaded over
 * column (or row) blocks.  Returns 0; -1 for a negative size or stride, ldc <
 * n, or an A with neither stride 1; -2 when its scratch (about 0.5 MiB a
 * block) cannot be allocated (C untouched). */
int ggmlopt_sgemm_f32(int64_t m, int64_t n, int64_t k, const float *a, int64_t a_row,
                      int64_t a_col, const float *b, int64_t b_row, int64_t b_col, float *c,
                      int64_t ldc, int accumulate);

/* ---- bfloat16 products -------------------------------------------------------- */

/* C (m, n; float32 rows of ldc >= n) = A B, or C += A B with accumulate != 0,
 * where A and B hold bfloat16 bits: A[i, p] = a[i * a_row + p * a_col]
 * (a_col == 1, or a_row == 1 for a transposed view), B[p, j] = b[p * b_row + j
 * * b_col] (b_col == 1, or b_row == 1 for a transposed view).  Each product
 * of two bf16 values is exact in float32 (barring underflow); the sums are
 * float32, over k in pairs (the odd product of a pair first), in chunks that
 * depend on k alone:
 * the same bits on any number of threads.  With AVX512-BF16 (see
 * ggmlopt_gemm_bf16_instruction) the pairs go through vdpbf16ps, which flushes
 * subnormal inputs and sums to zero.  C must not overlap A or B.  Returns 0;
 * -1 for a negative size or stride, ldc < n, an A with neither stride 1, or a
 * B with neither stride 1 when k > 1; -2 when its scratch cannot be allocated
 * (C untouched). */
int ggmlopt_gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t a_row,
                      int64_t a_col, const uint16_t *b, int64_t b_row, int64_t b_col, float *c,
                      int64_t ldc, int accumulate);
/* 1 when ggmlopt_gemm_bf16 runs on AVX512-BF16's vdpbf16ps (the avx512 path on
 * a CPU that has it), 0 when each pair is two float32 FMAs */
int ggmlopt_gemm_bf16_instruction(void);

#ifdef __cplusplus
}
#endif

#endif /* GGMLOPT_H */
