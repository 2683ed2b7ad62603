# cython: language_level=3
"""The SIMD kernels, callable on NumPy arrays.

Each function checks its arguments (dtype, C-contiguity, shapes, writability,
overlap) and raises TypeError or ValueError naming the argument before any
memory is touched; the work then runs without the GIL.  Outputs are written in
place or into ``out=``.  The C-level forms are in ``kernels.pxd``.
"""
import os

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t

from ggmlopt._kernel_args cimport as_array as _array
from ggmlopt._kernel_args cimport f32_ptr as _f32
from ggmlopt._kernel_args cimport adamw_params
from ggmlopt._kernel_args cimport finite_float as _finite_float
from ggmlopt._kernel_args cimport no_overlap as _no_overlap
from ggmlopt._kernel_args cimport outputs_apart as _outputs_apart
from ggmlopt._kernel_args cimport real_number as _real
from ggmlopt._kernel_args cimport same_size as _same_size

cnp.import_array()

cdef extern from "ggmlopt.h" nogil:
    void ggmlopt_adamw_step_f32(int64_t n, float *w, const float *g, float *m, float *v,
                                const float *params)
    void ggmlopt_sgd_step_f32(int64_t n, float *w, const float *g, float alpha, float wd)
    void ggmlopt_axpy_f32(int64_t n, float a, const float *x, float *y)
    void ggmlopt_scale_f32(int64_t n, float a, float *x)
    void ggmlopt_fill_f32(int64_t n, float value, float *x)
    void ggmlopt_add_bias_rows_f32(int64_t nrows, int64_t ncols, float *x, const float *bias)
    void ggmlopt_relu_f32(int64_t n, const float *x, float *y)
    void ggmlopt_relu_backward_f32(int64_t n, const float *y, const float *g, float *out)
    double ggmlopt_sum_f32(int64_t n, const float *x)
    double ggmlopt_sumsq_f32(int64_t n, const float *x)
    void ggmlopt_argmax_rows_f32(int64_t nrows, int64_t ncols, const float *x, int32_t *out)
    int64_t ggmlopt_count_equal_i32(int64_t n, const int32_t *a, const int32_t *b)
    double ggmlopt_cross_entropy_f32(int64_t nrows, int64_t ncols, const float *logits,
                                     const float *labels, float *grad, float grad_scale)
    double ggmlopt_squared_error_f32(int64_t n, const float *out, const float *labels,
                                     float *grad, float grad_scale)
    double ggmlopt_cross_entropy_index_f32(int64_t nrows, int64_t ncols, const float *logits,
                                           const int32_t *classes, float *grad,
                                           float grad_scale)
    double ggmlopt_cross_entropy_index_argmax_f32(int64_t nrows, int64_t ncols,
                                                  const float *logits, const int32_t *classes,
                                                  float *grad, float grad_scale, int32_t *pred)
    double ggmlopt_cross_entropy_index_g16_f32(int64_t nrows, int64_t ncols,
                                               const float *logits, const int32_t *classes,
                                               uint16_t *grad16, float grad_scale,
                                               int32_t *pred)
    void ggmlopt_convert_u8_f32(int64_t n, const uint8_t *src, float *dst, float scale)
    void ggmlopt_convert_f16_f32(int64_t n, const uint16_t *src, float *dst, float scale)
    void ggmlopt_convert_f32_bf16(int64_t n, const float *src, uint16_t *dst)
    void ggmlopt_gather_shards(int64_t nshards, int64_t shard_bytes, const int64_t *perm,
                               const void *src, void *dst)
    void ggmlopt_gather_shards_u8_f32(int64_t nshards, int64_t shard_elems,
                                      const int64_t *perm, const uint8_t *src, float *dst,
                                      float scale)
    void ggmlopt_gather_shards_f16_f32(int64_t nshards, int64_t shard_elems,
                                       const int64_t *perm, const uint16_t *src, float *dst,
                                       float scale)
    void ggmlopt_im2col_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw,
                            int64_t sh, int64_t sw, int64_t ph, int64_t pw, const float *x,
                            float *col, int64_t col_image, int64_t col_row)
    void ggmlopt_col2im_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw,
                            int64_t sh, int64_t sw, int64_t ph, int64_t pw, const float *col,
                            int64_t col_image, int64_t col_row, float *dx)
    void ggmlopt_add_bias_planes_f32(int64_t n, int64_t c, int64_t plane, float *x,
                                     const float *bias)
    void ggmlopt_maxpool2d_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                               int64_t sh, int64_t sw, const float *x, float *y, int32_t *idx)
    void ggmlopt_maxpool2d_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh,
                                        int64_t kw, int64_t sh, int64_t sw, const float *dy,
                                        const int32_t *idx, float *dx)
    void ggmlopt_maxpool2d_relu_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh,
                                    int64_t kw, int64_t sh, int64_t sw, const float *x, float *y,
                                    int32_t *idx)
    void ggmlopt_maxpool2d_relu_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh,
                                             int64_t kw, int64_t sh, int64_t sw, const float *dy,
                                             const int32_t *idx, const float *y, float *dx)
    void ggmlopt_avgpool2d_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                               int64_t sh, int64_t sw, const float *x, float *y)
    void ggmlopt_avgpool2d_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh,
                                        int64_t kw, int64_t sh, int64_t sw, const float *dy,
                                        float *dx)
    int64_t ggmlopt_conv2d_direct_workspace(int64_t n, int64_t c, int64_t h, int64_t w,
                                            int64_t o, int64_t kh, int64_t kw, int64_t ph,
                                            int64_t pw, int nthreads)
    int ggmlopt_conv2d_direct_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o,
                                  int64_t kh, int64_t kw, int64_t ph, int64_t pw, const float *x,
                                  const float *weight, const float *bias, float *y, float *work,
                                  int64_t work_size)
    int ggmlopt_conv2d_direct_backward_f32(int64_t n, int64_t c, int64_t h, int64_t w,
                                           int64_t o, int64_t kh, int64_t kw, int64_t ph,
                                           int64_t pw, const float *x, const float *weight,
                                           const float *dy, float *dx, float *dw, float *db,
                                           float *work, int64_t work_size)
    int ggmlopt_conv2d_direct_relu_maxpool_f32(int64_t n, int64_t c, int64_t h, int64_t w,
                                               int64_t o, int64_t kh, int64_t kw, int64_t ph,
                                               int64_t pw, int64_t pkh, int64_t pkw,
                                               int64_t psh, int64_t psw, const float *x,
                                               const float *weight, const float *bias, float *y,
                                               int32_t *idx, float *work, int64_t work_size)
    int ggmlopt_conv2d_direct_relu_maxpool_backward_f32(
        int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh, int64_t kw,
        int64_t ph, int64_t pw, int64_t pkh, int64_t pkw, int64_t psh, int64_t psw,
        const float *x, const float *weight, const float *dy, const int32_t *idx,
        const float *y, float *dx, float *dw, float *db, float *work, int64_t work_size)
    int ggmlopt_simd_count()
    const char *ggmlopt_simd_name(int i)
    int ggmlopt_simd_compiled(int i)
    int ggmlopt_simd_supported(int i)
    int ggmlopt_simd_select(const char *name)
    const char *ggmlopt_simd_active()
    const char *ggmlopt_cpu_features()
    void ggmlopt_set_num_threads(int n)
    int64_t ggmlopt_set_pool_linger_ns(int64_t ns)
    int ggmlopt_get_num_threads()
    void ggmlopt_tanh_f32(int64_t n, const float *x, float *y)
    void ggmlopt_tanh_backward_f32(int64_t n, const float *y, const float *g, float *out)
    void ggmlopt_sigmoid_f32(int64_t n, const float *x, float *y)
    void ggmlopt_sigmoid_backward_f32(int64_t n, const float *y, const float *g, float *out)
    void ggmlopt_silu_f32(int64_t n, const float *x, float *y)
    void ggmlopt_silu_backward_f32(int64_t n, const float *x, const float *g, float *out)
    void ggmlopt_gelu_f32(int64_t n, const float *x, float *y)
    void ggmlopt_gelu_backward_f32(int64_t n, const float *x, const float *g, float *out)
    void ggmlopt_gelu_tanh_f32(int64_t n, const float *x, float *y)
    void ggmlopt_gelu_tanh_backward_f32(int64_t n, const float *x, const float *g, float *out)
    void ggmlopt_leaky_relu_f32(int64_t n, const float *x, float *y, float negative_slope)
    void ggmlopt_leaky_relu_backward_f32(int64_t n, const float *x, const float *g, float *out,
                                         float negative_slope)


# ---- C-level API (declared in kernels.pxd) ----------------------------------

cdef void adamw_step_f32(int64_t n, float *w, const float *g, float *m, float *v,
                         const float *params) noexcept nogil:
    ggmlopt_adamw_step_f32(n, w, g, m, v, params)

cdef void sgd_step_f32(int64_t n, float *w, const float *g, float alpha,
                       float wd) noexcept nogil:
    ggmlopt_sgd_step_f32(n, w, g, alpha, wd)

cdef void axpy_f32(int64_t n, float a, const float *x, float *y) noexcept nogil:
    ggmlopt_axpy_f32(n, a, x, y)

cdef void scale_f32(int64_t n, float a, float *x) noexcept nogil:
    ggmlopt_scale_f32(n, a, x)

cdef void fill_f32(int64_t n, float value, float *x) noexcept nogil:
    ggmlopt_fill_f32(n, value, x)

cdef void add_bias_rows_f32(int64_t nrows, int64_t ncols, float *x,
                            const float *bias) noexcept nogil:
    ggmlopt_add_bias_rows_f32(nrows, ncols, x, bias)

cdef void relu_f32(int64_t n, const float *x, float *y) noexcept nogil:
    ggmlopt_relu_f32(n, x, y)

cdef void relu_backward_f32(int64_t n, const float *y, const float *g, float *out) noexcept nogil:
    ggmlopt_relu_backward_f32(n, y, g, out)

cdef double sum_f32(int64_t n, const float *x) noexcept nogil:
    return ggmlopt_sum_f32(n, x)

cdef double sumsq_f32(int64_t n, const float *x) noexcept nogil:
    return ggmlopt_sumsq_f32(n, x)

cdef void argmax_rows_f32(int64_t nrows, int64_t ncols, const float *x,
                          int32_t *out) noexcept nogil:
    ggmlopt_argmax_rows_f32(nrows, ncols, x, out)

cdef int64_t count_equal_i32(int64_t n, const int32_t *a, const int32_t *b) noexcept nogil:
    return ggmlopt_count_equal_i32(n, a, b)

cdef double cross_entropy_f32(int64_t nrows, int64_t ncols, const float *logits,
                              const float *labels, float *grad,
                              float grad_scale) noexcept nogil:
    return ggmlopt_cross_entropy_f32(nrows, ncols, logits, labels, grad, grad_scale)

cdef double squared_error_f32(int64_t n, const float *out, const float *labels, float *grad,
                              float grad_scale) noexcept nogil:
    return ggmlopt_squared_error_f32(n, out, labels, grad, grad_scale)

cdef void convert_u8_f32(int64_t n, const uint8_t *src, float *dst, float scale) noexcept nogil:
    ggmlopt_convert_u8_f32(n, src, dst, scale)

cdef void convert_f16_f32(int64_t n, const uint16_t *src, float *dst,
                          float scale) noexcept nogil:
    ggmlopt_convert_f16_f32(n, src, dst, scale)

cdef void convert_f32_bf16(int64_t n, const float *src, uint16_t *dst) noexcept nogil:
    ggmlopt_convert_f32_bf16(n, src, dst)

cdef void gather_shards_bytes(int64_t nshards, int64_t shard_bytes, const int64_t *perm,
                              const void *src, void *dst) noexcept nogil:
    ggmlopt_gather_shards(nshards, shard_bytes, perm, src, dst)

cdef void gather_shards_u8_f32(int64_t nshards, int64_t shard_elems, const int64_t *perm,
                               const uint8_t *src, float *dst, float scale) noexcept nogil:
    ggmlopt_gather_shards_u8_f32(nshards, shard_elems, perm, src, dst, scale)

cdef void gather_shards_f16_f32(int64_t nshards, int64_t shard_elems, const int64_t *perm,
                                const uint16_t *src, float *dst, float scale) noexcept nogil:
    ggmlopt_gather_shards_f16_f32(nshards, shard_elems, perm, src, dst, scale)

cdef void im2col_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw,
                     int64_t sh, int64_t sw, int64_t ph, int64_t pw, const float *x,
                     float *col, int64_t col_image, int64_t col_row) noexcept nogil:
    ggmlopt_im2col_f32(n, c, h, w, kh, kw, sh, sw, ph, pw, x, col, col_image, col_row)

cdef void col2im_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw,
                     int64_t sh, int64_t sw, int64_t ph, int64_t pw, const float *col,
                     int64_t col_image, int64_t col_row, float *dx) noexcept nogil:
    ggmlopt_col2im_f32(n, c, h, w, kh, kw, sh, sw, ph, pw, col, col_image, col_row, dx)

cdef void add_bias_planes_f32(int64_t n, int64_t c, int64_t plane, float *x,
                              const float *bias) noexcept nogil:
    ggmlopt_add_bias_planes_f32(n, c, plane, x, bias)

cdef void maxpool2d_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                        int64_t sh, int64_t sw, const float *x, float *y,
                        int32_t *idx) noexcept nogil:
    ggmlopt_maxpool2d_f32(nplanes, h, w, kh, kw, sh, sw, x, y, idx)

cdef void maxpool2d_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                                 int64_t sh, int64_t sw, const float *dy, const int32_t *idx,
                                 float *dx) noexcept nogil:
    ggmlopt_maxpool2d_backward_f32(nplanes, h, w, kh, kw, sh, sw, dy, idx, dx)

cdef int conv2d_direct_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh,
                           int64_t kw, int64_t ph, int64_t pw, const float *x,
                           const float *weight, const float *bias, float *y, float *work,
                           int64_t work_size) noexcept nogil:
    return ggmlopt_conv2d_direct_f32(n, c, h, w, o, kh, kw, ph, pw, x, weight, bias, y, work,
                                     work_size)

cdef int conv2d_direct_backward_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o,
                                    int64_t kh, int64_t kw, int64_t ph, int64_t pw,
                                    const float *x, const float *weight, const float *dy,
                                    float *dx, float *dw, float *db, float *work,
                                    int64_t work_size) noexcept nogil:
    return ggmlopt_conv2d_direct_backward_f32(n, c, h, w, o, kh, kw, ph, pw, x, weight, dy, dx,
                                              dw, db, work, work_size)

cdef int conv2d_direct_relu_maxpool_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o,
                                        int64_t kh, int64_t kw, int64_t ph, int64_t pw,
                                        int64_t pkh, int64_t pkw, int64_t psh, int64_t psw,
                                        const float *x, const float *weight, const float *bias,
                                        float *y, int32_t *idx, float *work,
                                        int64_t work_size) noexcept nogil:
    return ggmlopt_conv2d_direct_relu_maxpool_f32(n, c, h, w, o, kh, kw, ph, pw, pkh, pkw, psh,
                                                  psw, x, weight, bias, y, idx, work, work_size)

cdef int conv2d_direct_relu_maxpool_backward_f32(
        int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh, int64_t kw,
        int64_t ph, int64_t pw, int64_t pkh, int64_t pkw, int64_t psh, int64_t psw,
        const float *x, const float *weight, const float *dy, const int32_t *idx,
        const float *y, float *dx, float *dw, float *db, float *work,
        int64_t work_size) noexcept nogil:
    return ggmlopt_conv2d_direct_relu_maxpool_backward_f32(n, c, h, w, o, kh, kw, ph, pw, pkh,
                                                           pkw, psh, psw, x, weight, dy, idx, y,
                                                           dx, dw, db, work, work_size)

cdef void maxpool2d_relu_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                             int64_t sh, int64_t sw, const float *x, float *y,
                             int32_t *idx) noexcept nogil:
    ggmlopt_maxpool2d_relu_f32(nplanes, h, w, kh, kw, sh, sw, x, y, idx)

cdef void maxpool2d_relu_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh,
                                      int64_t kw, int64_t sh, int64_t sw, const float *dy,
                                      const int32_t *idx, const float *y,
                                      float *dx) noexcept nogil:
    ggmlopt_maxpool2d_relu_backward_f32(nplanes, h, w, kh, kw, sh, sw, dy, idx, y, dx)

cdef void avgpool2d_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                        int64_t sh, int64_t sw, const float *x, float *y) noexcept nogil:
    ggmlopt_avgpool2d_f32(nplanes, h, w, kh, kw, sh, sw, x, y)

cdef void avgpool2d_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                                 int64_t sh, int64_t sw, const float *dy,
                                 float *dx) noexcept nogil:
    ggmlopt_avgpool2d_backward_f32(nplanes, h, w, kh, kw, sh, sw, dy, dx)
# activations: forward y = f(x); backward out = g * f'(...) from y (tanh, sigmoid)
# or from x (the others)
cdef void tanh_f32(int64_t n, const float *x, float *y) noexcept nogil:
    ggmlopt_tanh_f32(n, x, y)

cdef void tanh_backward_f32(int64_t n, const float *y, const float *g, float *out) noexcept nogil:
    ggmlopt_tanh_backward_f32(n, y, g, out)

cdef void sigmoid_f32(int64_t n, const float *x, float *y) noexcept nogil:
    ggmlopt_sigmoid_f32(n, x, y)

cdef void sigmoid_backward_f32(int64_t n, const float *y, const float *g,
                               float *out) noexcept nogil:
    ggmlopt_sigmoid_backward_f32(n, y, g, out)

cdef void silu_f32(int64_t n, const float *x, float *y) noexcept nogil:
    ggmlopt_silu_f32(n, x, y)

cdef void silu_backward_f32(int64_t n, const float *x, const float *g, float *out) noexcept nogil:
    ggmlopt_silu_backward_f32(n, x, g, out)

cdef void gelu_f32(int64_t n, const float *x, float *y) noexcept nogil:
    ggmlopt_gelu_f32(n, x, y)

cdef void gelu_backward_f32(int64_t n, const float *x, const float *g, float *out) noexcept nogil:
    ggmlopt_gelu_backward_f32(n, x, g, out)

cdef void gelu_tanh_f32(int64_t n, const float *x, float *y) noexcept nogil:
    ggmlopt_gelu_tanh_f32(n, x, y)

cdef void gelu_tanh_backward_f32(int64_t n, const float *x, const float *g,
                                 float *out) noexcept nogil:
    ggmlopt_gelu_tanh_backward_f32(n, x, g, out)

cdef void leaky_relu_f32(int64_t n, const float *x, float *y,
                         float negative_slope) noexcept nogil:
    ggmlopt_leaky_relu_f32(n, x, y, negative_slope)

cdef void leaky_relu_backward_f32(int64_t n, const float *x, const float *g, float *out,
                                  float negative_slope) noexcept nogil:
    ggmlopt_leaky_relu_backward_f32(n, x, g, out, negative_slope)
cdef double cross_entropy_index_f32(int64_t nrows, int64_t ncols, const float *logits,
                                    const int32_t *classes, float *grad,
                                    float grad_scale) noexcept nogil:
    return ggmlopt_cross_entropy_index_f32(nrows, ncols, logits, classes, grad, grad_scale)


# ---- Python entry points ---------------------------------------------------------

def adamw_bias_corrections(beta1, beta2, iteration):
    """(beta1h, beta2h) = (1/(1 - beta1^t), 1/(1 - beta2^t)) in float32, as ggml
    computes them on the host once per step (t = iteration >= 1).

    beta1, beta2: finite real numbers (float32); iteration: an int in [1, 2**63)."""
    if isinstance(iteration, bool) or not isinstance(iteration, (int, np.integer)):
        raise TypeError(f"iteration: expected an int, got {type(iteration).__name__}")
    if iteration < 1:
        raise ValueError(f"iteration: expected >= 1, got {iteration}")
    if iteration > 2**63 - 1:
        raise ValueError(f"iteration: expected < 2**63, got {iteration}")
    b1 = np.float32(_finite_float(beta1, "beta1"))
    b2 = np.float32(_finite_float(beta2, "beta2"))
    t = np.float32(iteration)
    one = np.float32(1.0)
    with np.errstate(divide="ignore", over="ignore"):
        return (float(one / (one - b1 ** t)), float(one / (one - b2 ** t)))


def adamw_step(w, g, m, v, *, alpha, beta1, beta2, eps, wd, beta1h, beta2h):
    """One AdamW step over flat float32 arrays of one size, in place on w, m, v.

    m = beta1*m + (1-beta1)*g; v = beta2*v + (1-beta2)*g^2;
    w = w*(1 - alpha*wd) - alpha*(m*beta1h)/(sqrt(v*beta2h) + eps).
    beta1h, beta2h: see adamw_bias_corrections.
    """
    cdef cnp.ndarray aw = _array(w, "w", np.float32, True)
    cdef cnp.ndarray ag = _array(g, "g", np.float32, False)
    cdef cnp.ndarray am = _array(m, "m", np.float32, True)
    cdef cnp.ndarray av = _array(v, "v", np.float32, True)
    _same_size(aw, "w", ag, "g")
    _same_size(aw, "w", am, "m")
    _same_size(aw, "w", av, "v")
    _no_overlap([("w", aw), ("g", ag), ("m", am), ("v", av)])
    cdef float params[7]
    adamw_params(params, alpha, beta1, beta2, eps, wd, beta1h, beta2h)
    cdef int64_t n = aw.size
    cdef float *_p0 = _f32(aw)
    cdef float *_p1 = _f32(ag)
    cdef float *_p2 = _f32(am)
    cdef float *_p3 = _f32(av)
    with nogil:
        ggmlopt_adamw_step_f32(n, _p0, _p1, _p2, _p3, params)


def sgd_step(w, g, *, alpha, wd=0.0):
    """w = w*(1 - alpha*wd) - alpha*g, in place on the float32 array w."""
    cdef cnp.ndarray aw = _array(w, "w", np.float32, True)
    cdef cnp.ndarray ag = _array(g, "g", np.float32, False)
    _same_size(aw, "w", ag, "g")
    _no_overlap([("w", aw), ("g", ag)])
    cdef float a = _finite_float(alpha, "alpha"), d = _finite_float(wd, "wd")
    cdef int64_t n = aw.size
    cdef float *_p0 = _f32(aw)
    cdef float *_p1 = _f32(ag)
    with nogil:
        ggmlopt_sgd_step_f32(n, _p0, _p1, a, d)


def axpy(a, x, y):
    """y += a*x over float32 arrays of one size (x may be y itself)."""
    cdef float fa = _finite_float(a, "a")
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    cdef cnp.ndarray ay = _array(y, "y", np.float32, True)
    _same_size(ay, "y", ax, "x")
    if not (cnp.PyArray_DATA(ax) == cnp.PyArray_DATA(ay)):
        _no_overlap([("x", ax), ("y", ay)])
    cdef int64_t n = ay.size
    cdef float *_p0 = _f32(ax)
    cdef float *_p1 = _f32(ay)
    with nogil:
        ggmlopt_axpy_f32(n, fa, _p0, _p1)


def scale(x, a):
    """x *= a, in place on a float32 array."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, True)
    cdef float fa = _finite_float(a, "a")
    cdef int64_t n = ax.size
    cdef float *_p0 = _f32(ax)
    with nogil:
        ggmlopt_scale_f32(n, fa, _p0)


def fill(x, value):
    """x[...] = value, in place on a float32 array."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, True)
    cdef float fv = <float>_real(value, "value")
    cdef int64_t n = ax.size
    cdef float *_p0 = _f32(ax)
    with nogil:
        ggmlopt_fill_f32(n, fv, _p0)


def add_bias_rows(x, bias):
    """x[r, :] += bias for every row of a 2-D float32 array x (rows, n); bias has n
    elements."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, True)
    cdef cnp.ndarray ab = _array(bias, "bias", np.float32, False)
    if ax.ndim != 2:
        raise ValueError(f"x: expected a 2-D array (rows, columns), got {ax.ndim}-D")
    cdef int64_t nrows = ax.shape[0], ncols = ax.shape[1]
    if ab.size != ncols:
        raise ValueError(f"bias: expected {ncols} elements (one per column of x), got {ab.size}")
    _no_overlap([("x", ax), ("bias", ab)])
    cdef float *_p0 = _f32(ax)
    cdef float *_p1 = _f32(ab)
    with nogil:
        ggmlopt_add_bias_rows_f32(nrows, ncols, _p0, _p1)


def relu(x, out=None):
    """y = x > 0 ? x : 0 for a float32 array; NaN stays NaN (as torch's relu, so
    that a NaN reaches the loss), -0 gives +0.
    out: float32 of x's size, may be x itself.  Returns out."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    if out is None:
        out = np.empty((<object>ax).shape, dtype=np.float32)
    cdef cnp.ndarray ao = _array(out, "out", np.float32, True)
    _same_size(ax, "x", ao, "out")
    if cnp.PyArray_DATA(ax) != cnp.PyArray_DATA(ao):
        _no_overlap([("x", ax), ("out", ao)])
    cdef int64_t n = ax.size
    cdef float *_p0 = _f32(ax)
    cdef float *_p1 = _f32(ao)
    with nogil:
        ggmlopt_relu_f32(n, _p0, _p1)
    return out


def relu_backward(y, g, out=None):
    """out = g where the ReLU output y is nonzero, else 0 (float32 arrays of one
    size; out may be g itself).  Returns out."""
    cdef cnp.ndarray ay = _array(y, "y", np.float32, False)
    cdef cnp.ndarray ag = _array(g, "g", np.float32, False)
    _same_size(ay, "y", ag, "g")
    if out is None:
        out = np.empty((<object>ag).shape, dtype=np.float32)
    cdef cnp.ndarray ao = _array(out, "out", np.float32, True)
    _same_size(ag, "g", ao, "out")
    if cnp.PyArray_DATA(ag) != cnp.PyArray_DATA(ao):
        _no_overlap([("g", ag), ("out", ao)])
    _no_overlap([("y", ay), ("out", ao)])
    cdef int64_t n = ay.size
    cdef float *_p0 = _f32(ay)
    cdef float *_p1 = _f32(ag)
    cdef float *_p2 = _f32(ao)
    with nogil:
        ggmlopt_relu_backward_f32(n, _p0, _p1, _p2)
    return out


def sum(x):
    """Sum of a float32 array, accumulated in double; 0.0 when empty."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    cdef int64_t n = ax.size
    cdef double s
    cdef float *_p0 = _f32(ax)
    with nogil:
        s = ggmlopt_sum_f32(n, _p0)
    return s


def mean(x):
    """Mean of a non-empty float32 array, accumulated in double."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    if ax.size == 0:
        raise ValueError("x: the mean of an empty array is undefined")
    return sum(ax) / ax.size


def sumsq(x):
    """Sum of squares of a float32 array, accumulated in double; 0.0 when empty."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    cdef int64_t n = ax.size
    cdef double s
    cdef float *_p0 = _f32(ax)
    with nogil:
        s = ggmlopt_sumsq_f32(n, _p0)
    return s


cdef tuple _matrix(cnp.ndarray a, str name):
    if a.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array (rows, columns), got {a.ndim}-D")
    if a.shape[1] == 0:
        raise ValueError(f"{name}: rows must have at least one column")
    return a.shape[0], a.shape[1]


def argmax_rows(x, out=None):
    """Index of the maximum of each row of a 2-D float32 array, as int32; ties go
    to the last maximal index (ggml's rule).  Returns out (shape (rows,))."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    cdef int64_t nrows, ncols
    nrows, ncols = _matrix(ax, "x")
    if ncols > 2**31 - 1:
        raise ValueError(f"x: rows of {ncols} columns do not fit an int32 index")
    if out is None:
        out = np.empty(nrows, dtype=np.int32)
    cdef cnp.ndarray ao = _array(out, "out", np.int32, True)
    if ao.size != nrows:
        raise ValueError(f"out: expected {nrows} elements (one per row of x), got {ao.size}")
    _no_overlap([("x", ax), ("out", ao)])
    cdef float *_p0 = _f32(ax)
    cdef int32_t *_p1 = <int32_t *>cnp.PyArray_DATA(ao)
    with nogil:
        ggmlopt_argmax_rows_f32(nrows, ncols, _p0, _p1)
    return out


def count_equal(a, b):
    """Number of positions where two int32 arrays of one size hold equal values."""
    cdef cnp.ndarray aa = _array(a, "a", np.int32, False)
    cdef cnp.ndarray ab = _array(b, "b", np.int32, False)
    _same_size(aa, "a", ab, "b")
    cdef int64_t n = aa.size, c
    cdef int32_t *_p0 = <int32_t *>cnp.PyArray_DATA(aa)
    cdef int32_t *_p1 = <int32_t *>cnp.PyArray_DATA(ab)
    with nogil:
        c = ggmlopt_count_equal_i32(n, _p0,
                                    _p1)
    return c


cdef _check_classes(cnp.ndarray ac, int64_t ncols, bint masked):
    """IndexError unless every int32 class lies in [0, ncols) (or is -1, a masked
    row, when masked)."""
    cdef const int32_t *c = <const int32_t *>cnp.PyArray_DATA(ac)
    cdef int64_t i, n = ac.size, bad = -1
    cdef int32_t lowest = -1 if masked else 0
    with nogil:
        for i in range(n):
            if c[i] < lowest or c[i] >= ncols:
                bad = i
                break
    if bad >= 0:
        also = " or -1 (ignore_index)" if masked else ""
        raise IndexError(f"labels: class {c[bad]} at row {bad} is out of range; expected "
                         f"class indices in [0, {ncols}){also} (one per column of logits)")


def cross_entropy(logits, labels, grad=None, grad_scale=1.0, *, ignore_index=None, pred=None):
    """Mean over rows of -sum(labels * log_softmax(logits)) for 2-D float32
    (rows, classes) logits.  When grad is given it receives
    (softmax(logits) - labels) * grad_scale / rows (the gradient of the loss
    times grad_scale).  With class indices, grad may be logits itself: the
    gradient is written over the logits (each row read before it is written;
    the same loss and bits as into another array).

    labels: float32 (rows, classes) probabilities (one-hot or soft), or int32
    class indices of shape (rows,) or (rows, 1), each in [0, classes): the same
    loss and gradient as their one-hot encoding, without building it (IndexError
    for a class out of range, before anything is written).
    ignore_index: None, or -1 with class indices: rows labelled -1 are masked
    (torch's ignore_index): no loss, a zero gradient, and the mean and the
    gradient's 1/rows over the labelled rows only (loss 0 when none is).
    pred: None, or an int32 array of rows elements (class indices only) that
    receives each row's argmax as argmax_rows gives it (masked rows included),
    read in the same pass as the loss.

    With class indices, grad may be uint16, of logits' size and not sharing its
    memory: it receives the gradient as bfloat16 bits, the float32 gradient's
    values rounded as to_bfloat16 rounds them (what a bf16 backward multiplies),
    with the same loss; no float32 gradient is written."""
    if ignore_index is not None and (isinstance(ignore_index, bool) or ignore_index != -1):
        raise ValueError(f"ignore_index: expected None or -1, got {ignore_index!r}")
    cdef cnp.ndarray ax = _array(logits, "logits", np.float32, False)
    cdef int64_t nrows, ncols
    nrows, ncols = _matrix(ax, "logits")
    if nrows == 0:
        raise ValueError("logits: the cross-entropy of zero rows is undefined")
    cdef bint by_class = isinstance(labels, np.ndarray) and labels.dtype == np.int32
    cdef cnp.ndarray al
    if by_class:
        al = _array(labels, "labels", np.int32, False)
        if not (al.ndim == 1 or (al.ndim == 2 and al.shape[1] == 1)) or al.shape[0] != nrows:
            raise ValueError(f"labels: int32 class indices must have shape ({nrows},) or "
                             f"({nrows}, 1) (one per row of logits), got {(<object>al).shape}")
    else:
        if isinstance(labels, np.ndarray) and labels.dtype.kind in "iu":
            raise TypeError(f"labels: expected float32 probabilities or int32 class indices, "
                            f"got dtype {labels.dtype}")
        al = _array(labels, "labels", np.float32, False)
        if al.ndim != 2 or al.shape[0] != nrows or al.shape[1] != ncols:
            raise ValueError(f"labels: expected shape {(nrows, ncols)} like logits (or int32 "
                             f"class indices of shape ({nrows},)), got {(<object>al).shape}")
    cdef float scale_ = _finite_float(grad_scale, "grad_scale")
    cdef cnp.ndarray agr = None
    cdef float *pgrad = NULL
    cdef uint16_t *pgrad16 = NULL
    cdef bint in_place = False
    if isinstance(grad, np.ndarray) and grad.dtype == np.uint16:
        if not by_class:
            raise ValueError("grad: a bfloat16 (uint16) gradient only with int32 class indices "
                             "as labels")
        agr = _array(grad, "grad", np.uint16, True)
        if agr.size != ax.size:
            raise ValueError(f"grad: expected {ax.size} elements like logits, got {agr.size}")
        _no_overlap([("grad", agr), ("logits", ax), ("labels", al)])
        pgrad16 = <uint16_t *>cnp.PyArray_DATA(agr)
    elif grad is not None:
        agr = _array(grad, "grad", np.float32, True)
        if agr.size != ax.size:
            raise ValueError(f"grad: expected {ax.size} elements like logits, got {agr.size}")
        in_place = by_class and cnp.PyArray_DATA(agr) == cnp.PyArray_DATA(ax)
        if in_place:
            # each row's logits are read before its gradient is written
            _no_overlap([("grad", agr), ("labels", al)])
        else:
            _no_overlap([("grad", agr), ("logits", ax), ("labels", al)])
        pgrad = _f32(agr)
    cdef cnp.ndarray apr = None
    cdef int32_t *ppred = NULL
    if pred is not None:
        if not by_class:
            raise ValueError("pred: only with int32 class indices as labels")
        if ncols > 2**31 - 1:
            raise ValueError(f"logits: rows of {ncols} columns do not fit an int32 index")
        apr = _array(pred, "pred", np.int32, True)
        if apr.size != nrows:
            raise ValueError(f"pred: expected {nrows} elements (one per row of logits), "
                             f"got {apr.size}")
        _no_overlap([("pred", apr), ("logits", ax), ("labels", al)]
                    + ([("grad", agr)] if agr is not None and not in_place else []))
        ppred = <int32_t *>cnp.PyArray_DATA(apr)
    if by_class:
        _check_classes(al, ncols, ignore_index is not None)
    elif ignore_index is not None:
        raise ValueError("ignore_index: only for int32 class indices")
    cdef double loss
    cdef float *_p0 = _f32(ax)
    cdef float *_p1 = NULL
    cdef int32_t *_pc = NULL
    if by_class:
        _pc = <int32_t *>cnp.PyArray_DATA(al)
    else:
        _p1 = _f32(al)
    with nogil:
        if pgrad16 != NULL:
            loss = ggmlopt_cross_entropy_index_g16_f32(nrows, ncols, _p0, _pc, pgrad16, scale_,
                                                       ppred)
        elif by_class:
            loss = ggmlopt_cross_entropy_index_argmax_f32(nrows, ncols, _p0, _pc, pgrad, scale_,
                                                          ppred)
        else:
            loss = ggmlopt_cross_entropy_f32(nrows, ncols, _p0, _p1, pgrad, scale_)
    return loss


def squared_error(out, labels, grad=None, grad_scale=1.0):
    """sum((out - labels)^2) over float32 arrays of one size.  When grad is given
    it receives 2*(out - labels)*grad_scale."""
    cdef cnp.ndarray ao = _array(out, "out", np.float32, False)
    cdef cnp.ndarray al = _array(labels, "labels", np.float32, False)
    _same_size(ao, "out", al, "labels")
    cdef float scale_ = _finite_float(grad_scale, "grad_scale")
    cdef cnp.ndarray agr = None
    cdef float *pgrad = NULL
    cdef bint in_place = False
    if grad is not None:
        agr = _array(grad, "grad", np.float32, True)
        _same_size(ao, "out", agr, "grad")
        _no_overlap([("grad", agr), ("out", ao), ("labels", al)])
        pgrad = _f32(agr)
    cdef int64_t n = ao.size
    cdef double s
    cdef float *_p0 = _f32(ao)
    cdef float *_p1 = _f32(al)
    with nogil:
        s = ggmlopt_squared_error_f32(n, _p0, _p1, pgrad, scale_)
    return s


def to_float32(src, out=None, scale=1.0):
    """src (uint8 or float16) converted to float32 and multiplied by scale."""
    if not isinstance(src, np.ndarray) or src.dtype not in (np.uint8, np.float16):
        raise TypeError("src: expected a numpy.ndarray of uint8 or float16, got "
                        + (str(src.dtype) if isinstance(src, np.ndarray) else type(src).__name__))
    cdef cnp.ndarray asrc = _array(src, "src", src.dtype, False)
    if out is None:
        out = np.empty((<object>asrc).shape, dtype=np.float32)
    cdef cnp.ndarray ao = _array(out, "out", np.float32, True)
    _same_size(asrc, "src", ao, "out")
    _no_overlap([("src", asrc), ("out", ao)])
    cdef float fs = _finite_float(scale, "scale")
    cdef int64_t n = asrc.size
    cdef bint is_u8 = asrc.dtype == np.uint8
    cdef uint8_t *_p0 = <uint8_t *>cnp.PyArray_DATA(asrc)
    cdef float *_p1 = _f32(ao)
    cdef uint16_t *_p2 = <uint16_t *>cnp.PyArray_DATA(asrc)
    with nogil:
        if is_u8:
            ggmlopt_convert_u8_f32(n, _p0, _p1, fs)
        else:
            ggmlopt_convert_f16_f32(n, _p2, _p1, fs)
    return out


def to_bfloat16(src, out=None):
    """src (float32) rounded to bfloat16 (to nearest even), as the bits of a
    uint16 array of src's shape (NumPy has no bfloat16 dtype); a NaN stays a NaN,
    subnormals are kept."""
    cdef cnp.ndarray asrc = _array(src, "src", np.float32, False)
    if out is None:
        out = np.empty((<object>asrc).shape, dtype=np.uint16)
    cdef cnp.ndarray ao = _array(out, "out", np.uint16, True)
    _same_size(asrc, "src", ao, "out")
    _no_overlap([("src", asrc), ("out", ao)])
    cdef int64_t n = asrc.size
    cdef float *_p0 = _f32(asrc)
    cdef uint16_t *_p1 = <uint16_t *>cnp.PyArray_DATA(ao)
    with nogil:
        ggmlopt_convert_f32_bf16(n, _p0, _p1)
    return out


def gather_shards(src, dst, perm, scale=None):
    """dst shard j = src shard perm[j], for j < len(perm).

    src: C-contiguous array whose first axis indexes shards (nshards, ...).
    dst: C-contiguous, writable, holding exactly len(perm) shards; of src's dtype,
    or float32 from uint8/float16 src (then multiplied by scale, default 1).
    perm: int64 shard indices, each in [0, nshards).
    """
    if not isinstance(src, np.ndarray):
        raise TypeError(f"src: expected a numpy.ndarray, got {type(src).__name__}")
    if src.dtype.hasobject:
        raise TypeError(f"src: expected an array of plain numbers, got dtype {src.dtype}")
    cdef cnp.ndarray asrc = _array(src, "src", src.dtype, False)
    if asrc.ndim < 1:
        raise ValueError("src: expected at least one axis (the shards)")
    cdef cnp.ndarray ap = _array(perm, "perm", np.int64, False)
    cdef int64_t nsrc = asrc.shape[0], nperm = ap.size
    # a shard is one index of the first axis: the product of the other axes (also
    # when src holds no shard at all)
    cdef int64_t shard_elems = 1
    cdef int k
    for k in range(1, asrc.ndim):
        shard_elems *= asrc.shape[k]
    convert = isinstance(dst, np.ndarray) and dst.dtype == np.float32 \
        and asrc.dtype in (np.uint8, np.float16)
    cdef cnp.ndarray ad = _array(dst, "dst", np.float32 if convert else asrc.dtype, True)
    if ad.size != nperm * shard_elems:
        raise ValueError(f"dst: expected {nperm * shard_elems} elements ({nperm} shards of "
                         f"{shard_elems}), got {ad.size}")
    _no_overlap([("src", asrc), ("dst", ad)])
    _no_overlap([("perm", ap), ("dst", ad)])
    if nperm and (ap.min() < 0 or ap.max() >= nsrc):
        raise IndexError(f"perm: shard indices must lie in [0, {nsrc})")
    if scale is not None and not convert:
        raise ValueError("scale: only used when converting uint8/float16 to float32")
    cdef float fs = 1.0 if scale is None else _finite_float(scale, "scale")
    cdef const int64_t *pp = <int64_t *>cnp.PyArray_DATA(ap)
    cdef void *ps = cnp.PyArray_DATA(asrc)
    cdef void *pd = cnp.PyArray_DATA(ad)
    cdef int kind = 0 if not convert else (1 if asrc.dtype == np.uint8 else 2)
    cdef int64_t shard_bytes = shard_elems * asrc.itemsize
    with nogil:
        if kind == 0:
            ggmlopt_gather_shards(nperm, shard_bytes, pp, ps, pd)
        elif kind == 1:
            ggmlopt_gather_shards_u8_f32(nperm, shard_elems, pp, <uint8_t *>ps, <float *>pd, fs)
        else:
            ggmlopt_gather_shards_f16_f32(nperm, shard_elems, pp, <uint16_t *>ps,
                                          <float *>pd, fs)


# ---- convolution and pooling ------------------------------------------------------

def pair(value, name, minimum=1):
    """(a, b) from an int or a pair of ints, each >= minimum; TypeError for
    anything else (bool included), ValueError for a value below minimum."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name}: expected an int or a pair (height, width) of ints, "
                             f"got {len(value)} values")
        items = tuple(value)
    else:
        items = (value, value)
    for v in items:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}: expected an int or a pair (height, width) of ints, "
                            f"got {type(v).__name__}")
        if v < minimum:
            raise ValueError(f"{name}: expected ints >= {minimum}, got {value!r}")
    return int(items[0]), int(items[1])


cdef tuple _images(cnp.ndarray a, str name):
    if a.ndim != 4:
        raise ValueError(f"{name}: expected a 4-D array (batch, channels, height, width), "
                         f"got {a.ndim}-D with shape {(<object>a).shape}")
    return a.shape[0], a.shape[1], a.shape[2], a.shape[3]


def conv2d_output_size(height, width, kernel_size, stride=1, padding=0):
    """(oh, ow) of a 2-D convolution (or pooling with padding 0) of an image
    (height, width): (height + 2*ph - kh)//sh + 1 and likewise for width.
    ValueError when the padded image is smaller than the kernel."""
    kh, kw = pair(kernel_size, "kernel_size")
    sh, sw = pair(stride, "stride")
    ph, pw = pair(padding, "padding", 0)
    if height + 2 * ph < kh or width + 2 * pw < kw:
        raise ValueError(f"x: the input ({height}, {width}) with padding ({ph}, {pw}) is "
                         f"smaller than the kernel ({kh}, {kw})")
    return (height + 2 * ph - kh) // sh + 1, (width + 2 * pw - kw) // sw + 1


cdef tuple _col_geometry(tuple xs, object kernel_size, object stride, object padding,
                         bint batch_matrix):
    """im2col's geometry for images xs = (n, c, h, w): ((kh, kw, sh, sw, ph, pw),
    the col shape, (col_image, col_row): where row r of image i starts)."""
    n, c, h, w = xs
    kh, kw = pair(kernel_size, "kernel_size")
    sh, sw = pair(stride, "stride")
    ph, pw = pair(padding, "padding", 0)
    oh, ow = conv2d_output_size(h, w, (kh, kw), (sh, sw), (ph, pw))
    rows = c * kh * kw
    if batch_matrix:
        return (kh, kw, sh, sw, ph, pw), (rows, n * oh * ow), (oh * ow, n * oh * ow)
    return (kh, kw, sh, sw, ph, pw), (n, rows, oh * ow), (rows * oh * ow, oh * ow)


def im2col(x, kernel_size, stride=1, padding=0, out=None, *, batch_matrix=False):
    """The receptive fields of a 2-D convolution as columns.

    x: float32 (n, c, h, w).  kernel_size, stride (>= 1) and padding (>= 0): an
    int or a pair (height, width).  Returns out, float32 (n, c*kh*kw, oh*ow): row
    (ci*kh + ky)*kw + kx of image i holds x[i, ci, oy*sh - ph + ky, ox*sw - pw + kx]
    (0 in the padding) in row-major (oy, ox) order.  batch_matrix=True lays the
    images side by side in one (c*kh*kw, n*oh*ow) matrix instead.
    """
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    xs = _images(ax, "x")
    window, shape, layout = _col_geometry(xs, kernel_size, stride, padding, batch_matrix)
    cdef cnp.ndarray ao = _out(out, shape, "out", np.float32)
    _no_overlap([("x", ax), ("out", ao)])
    cdef int64_t n = xs[0], c = xs[1], h = xs[2], w = xs[3]
    cdef int64_t kh_ = window[0], kw_ = window[1], sh_ = window[2], sw_ = window[3]
    cdef int64_t ph_ = window[4], pw_ = window[5], col_image = layout[0], col_row = layout[1]
    cdef float *px = _f32(ax)
    cdef float *po = _f32(ao)
    with nogil:
        ggmlopt_im2col_f32(n, c, h, w, kh_, kw_, sh_, sw_, ph_, pw_, px, po, col_image, col_row)
    return ao


def col2im(col, x_shape, kernel_size, stride=1, padding=0, out=None, *, batch_matrix=False):
    """The adjoint of im2col: out (float32 of x_shape = (n, c, h, w), overwritten)
    receives at each input position the sum of the col entries that im2col
    copies it to.  col: float32 of im2col's output shape for x_shape and these
    arguments.  Returns out."""
    cdef cnp.ndarray acol = _array(col, "col", np.float32, False)
    xs = _shape4(x_shape)
    window, shape, layout = _col_geometry(xs, kernel_size, stride, padding, batch_matrix)
    if (<object>acol).shape != shape:
        raise ValueError(f"col: expected shape {shape}, got {(<object>acol).shape}")
    cdef cnp.ndarray ao = _out(out, xs, "out", np.float32)
    _no_overlap([("col", acol), ("out", ao)])
    cdef int64_t n = xs[0], c = xs[1], h = xs[2], w = xs[3]
    cdef int64_t kh_ = window[0], kw_ = window[1], sh_ = window[2], sw_ = window[3]
    cdef int64_t ph_ = window[4], pw_ = window[5], col_image = layout[0], col_row = layout[1]
    cdef float *pc = _f32(acol)
    cdef float *po = _f32(ao)
    with nogil:
        ggmlopt_col2im_f32(n, c, h, w, kh_, kw_, sh_, sw_, ph_, pw_, pc, col_image, col_row, po)
    return ao


def add_bias_planes(x, bias):
    """x[i, ci, ...] += bias[ci], in place on float32 x of shape (n, c, ...) (at
    least 2-D); bias: float32 with c elements."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, True)
    cdef cnp.ndarray ab = _array(bias, "bias", np.float32, False)
    if ax.ndim < 2:
        raise ValueError(f"x: expected at least 2 axes (batch, channels, ...), got {ax.ndim}")
    cdef int64_t n = ax.shape[0], c = ax.shape[1]
    if ab.size != c:
        raise ValueError(f"bias: expected {c} elements (one per channel of x), got {ab.size}")
    _no_overlap([("x", ax), ("bias", ab)])
    cdef int64_t plane = ax.size // (n * c) if n * c else 0
    cdef float *px = _f32(ax)
    cdef float *pb = _f32(ab)
    with nogil:
        ggmlopt_add_bias_planes_f32(n, c, plane, px, pb)


cdef tuple _pool_args(tuple xs, kernel_size, stride):
    kh, kw = pair(kernel_size, "kernel_size")
    sh, sw = pair(kernel_size if stride is None else stride, "stride")
    h, w = xs[2], xs[3]
    if h < kh or w < kw:
        raise ValueError(f"x: the input ({h}, {w}) is smaller than the window ({kh}, {kw})")
    return kh, kw, sh, sw, (h - kh) // sh + 1, (w - kw) // sw + 1


cdef tuple _shape4(object x_shape):
    try:
        xs = tuple(int(v) for v in x_shape)
    except (TypeError, ValueError):
        raise TypeError(f"x_shape: expected a tuple of 4 ints, got {x_shape!r}") from None
    if len(xs) != 4 or xs[0] < 0 or min(xs[1:]) < 1:
        raise ValueError(f"x_shape: expected 4 sizes (n, c, h, w), n >= 0 and the others "
                         f">= 1, got {x_shape!r}")
    return xs


cdef cnp.ndarray _out(object out, tuple shape, str name, object dtype):
    if out is None:
        out = np.empty(shape, dtype=dtype)
    cdef cnp.ndarray ao = _array(out, name, dtype, True)
    if (<object>ao).shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {(<object>ao).shape}")
    return ao


cdef tuple _maxpool(object x, object kernel_size, object stride, object out, object indices,
                    bint relu):
    """maxpool2d, or with relu maxpool2d_relu: (out, indices)."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    xs = _images(ax, "x")
    kh, kw, sh, sw, oh, ow = _pool_args(xs, kernel_size, stride)
    shape = (xs[0], xs[1], oh, ow)
    cdef cnp.ndarray ao = _out(out, shape, "out", np.float32)
    cdef cnp.ndarray ai = _out(indices, shape, "indices", np.int32)
    _no_overlap([("x", ax), ("out", ao), ("indices", ai)])
    cdef int64_t nplanes = xs[0] * xs[1], h = xs[2], w = xs[3]
    cdef int64_t kh_ = kh, kw_ = kw, sh_ = sh, sw_ = sw
    cdef float *px = _f32(ax)
    cdef float *po = _f32(ao)
    cdef int32_t *pi = <int32_t *>cnp.PyArray_DATA(ai)
    with nogil:
        if relu:
            ggmlopt_maxpool2d_relu_f32(nplanes, h, w, kh_, kw_, sh_, sw_, px, po, pi)
        else:
            ggmlopt_maxpool2d_f32(nplanes, h, w, kh_, kw_, sh_, sw_, px, po, pi)
    return ao, ai


cdef tuple _maxpool_grad_inputs(object grad_out, object indices, object x_shape,
                                object kernel_size, object stride):
    """The checks both max-pool backward passes share: (x_shape as a tuple,
    (kh, kw, sh, sw), grad_out, indices), the positions checked to lie in a plane."""
    xs = _shape4(x_shape)
    kh, kw, sh, sw, oh, ow = _pool_args(xs, kernel_size, stride)
    shape = (xs[0], xs[1], oh, ow)
    cdef cnp.ndarray ag = _array(grad_out, "grad_out", np.float32, False)
    if (<object>ag).shape != shape:
        raise ValueError(f"grad_out: expected shape {shape}, got {(<object>ag).shape}")
    cdef cnp.ndarray ai = _array(indices, "indices", np.int32, False)
    if (<object>ai).shape != shape:
        raise ValueError(f"indices: expected shape {shape}, got {(<object>ai).shape}")
    if ai.size and (ai.min() < 0 or ai.max() >= xs[2] * xs[3]):
        raise IndexError(f"indices: positions must lie in [0, {xs[2] * xs[3]})")
    return xs, (kh, kw, sh, sw), ag, ai


def maxpool2d(x, kernel_size, stride=None, out=None, indices=None):
    """Max pooling of float32 x (n, c, h, w) over kh*kw windows every stride
    (default: kernel_size), no padding, floor mode (a trailing remainder that
    fills no window is dropped).  Returns (out, indices): out float32
    (n, c, oh, ow), indices int32 (n, c, oh, ow), the position iy*w + ix of each
    maximum in its plane.  The first maximal position in row-major window order
    wins a tie; a NaN counts as the maximum."""
    return _maxpool(x, kernel_size, stride, out, indices, False)


def maxpool2d_backward(grad_out, indices, x_shape, kernel_size, stride=None, out=None):
    """The input gradient of maxpool2d: out (float32 of x_shape, overwritten)
    receives grad_out at the positions in indices (summed where windows overlap),
    0 elsewhere.  grad_out float32 and indices int32, both (n, c, oh, ow) as
    maxpool2d returned them."""
    xs, window, ag, ai = _maxpool_grad_inputs(grad_out, indices, x_shape, kernel_size, stride)
    cdef cnp.ndarray g = ag, idx = ai
    cdef cnp.ndarray ao = _out(out, xs, "out", np.float32)
    _no_overlap([("grad_out", g), ("indices", idx), ("out", ao)])
    cdef int64_t nplanes = xs[0] * xs[1], h = xs[2], w = xs[3]
    cdef int64_t kh_ = window[0], kw_ = window[1], sh_ = window[2], sw_ = window[3]
    cdef float *pg = _f32(g)
    cdef int32_t *pi = <int32_t *>cnp.PyArray_DATA(idx)
    cdef float *po = _f32(ao)
    with nogil:
        ggmlopt_maxpool2d_backward_f32(nplanes, h, w, kh_, kw_, sh_, sw_, pg, pi, po)
    return ao


def maxpool2d_relu(x, kernel_size, stride=None, out=None, indices=None):
    """ReLU then max pooling in one pass: maxpool2d(relu(x)) without the ReLU's
    full-size output.  Returns (out, indices) as maxpool2d: out float32
    (n, c, oh, ow) = max(each window's maximum, 0), a NaN kept; indices int32
    the position iy*w + ix of the maximum of x in its plane (first maximal
    position in row-major order; a NaN counts as the maximum).  Outputs and
    maxpool2d_relu_backward's gradients equal those of relu then maxpool2d."""
    return _maxpool(x, kernel_size, stride, out, indices, True)


def maxpool2d_relu_backward(grad_out, indices, out_forward, x_shape, kernel_size, stride=None,
                            out=None):
    """The input gradient of maxpool2d_relu: out (float32 of x_shape,
    overwritten) receives grad_out at the positions in indices where
    out_forward (the forward output) is not 0, summed where windows overlap, 0
    elsewhere.  grad_out and out_forward float32, indices int32, all
    (n, c, oh, ow) as maxpool2d_relu returned them."""
    xs, window, ag, ai = _maxpool_grad_inputs(grad_out, indices, x_shape, kernel_size, stride)
    cdef cnp.ndarray g = ag, idx = ai
    shape = (<object>g).shape
    cdef cnp.ndarray ay = _array(out_forward, "out_forward", np.float32, False)
    if (<object>ay).shape != shape:
        raise ValueError(f"out_forward: expected shape {shape}, got {(<object>ay).shape}")
    cdef cnp.ndarray ao = _out(out, xs, "out", np.float32)
    _outputs_apart([("grad_out", g), ("out_forward", ay), ("indices", idx)], [("out", ao)])
    cdef int64_t nplanes = xs[0] * xs[1], h = xs[2], w = xs[3]
    cdef int64_t kh_ = window[0], kw_ = window[1], sh_ = window[2], sw_ = window[3]
    cdef float *pg = _f32(g)
    cdef float *py = _f32(ay)
    cdef int32_t *pi = <int32_t *>cnp.PyArray_DATA(idx)
    cdef float *po = _f32(ao)
    with nogil:
        ggmlopt_maxpool2d_relu_backward_f32(nplanes, h, w, kh_, kw_, sh_, sw_, pg, pi, py, po)
    return ao


def avgpool2d(x, kernel_size, stride=None, out=None):
    """Average pooling of float32 x (n, c, h, w) over kh*kw windows every stride
    (default: kernel_size), no padding, floor mode.  Returns out, float32
    (n, c, oh, ow)."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    xs = _images(ax, "x")
    kh, kw, sh, sw, oh, ow = _pool_args(xs, kernel_size, stride)
    cdef cnp.ndarray ao = _out(out, (xs[0], xs[1], oh, ow), "out", np.float32)
    _no_overlap([("x", ax), ("out", ao)])
    cdef int64_t nplanes = xs[0] * xs[1], h = xs[2], w = xs[3]
    cdef int64_t kh_ = kh, kw_ = kw, sh_ = sh, sw_ = sw
    cdef float *px = _f32(ax)
    cdef float *po = _f32(ao)
    with nogil:
        ggmlopt_avgpool2d_f32(nplanes, h, w, kh_, kw_, sh_, sw_, px, po)
    return ao


def avgpool2d_backward(grad_out, x_shape, kernel_size, stride=None, out=None):
    """The input gradient of avgpool2d: out (float32 of x_shape, overwritten)
    receives grad_out/(kh*kw) at every position of each window (summed where
    windows overlap).  grad_out: float32 (n, c, oh, ow)."""
    xs = _shape4(x_shape)
    kh, kw, sh, sw, oh, ow = _pool_args(xs, kernel_size, stride)
    shape = (xs[0], xs[1], oh, ow)
    cdef cnp.ndarray ag = _array(grad_out, "grad_out", np.float32, False)
    if (<object>ag).shape != shape:
        raise ValueError(f"grad_out: expected shape {shape}, got {(<object>ag).shape}")
    cdef cnp.ndarray ao = _out(out, xs, "out", np.float32)
    _no_overlap([("grad_out", ag), ("out", ao)])
    cdef int64_t nplanes = xs[0] * xs[1], h = xs[2], w = xs[3]
    cdef int64_t kh_ = kh, kw_ = kw, sh_ = sh, sw_ = sw
    cdef float *pg = _f32(ag)
    cdef float *po = _f32(ao)
    with nogil:
        ggmlopt_avgpool2d_backward_f32(nplanes, h, w, kh_, kw_, sh_, sw_, pg, po)
    return ao


def conv2d_direct_workspace(x_shape, out_channels, kernel_size, padding=0, threads=None):
    """Floats of scratch conv2d_direct, conv2d_direct_relu_maxpool and their
    backwards need for images x_shape = (n, c, h, w), out_channels filters of
    kernel_size and padding (an int or a pair each) on threads kernel threads
    (default: get_num_threads()); a smaller workspace (down to the size for one
    thread) gives the same results on fewer threads."""
    xs = _shape4(x_shape)
    o = _positive(out_channels, "out_channels")
    kh, kw = pair(kernel_size, "kernel_size")
    ph, pw = pair(padding, "padding", 0)
    conv2d_output_size(xs[2], xs[3], (kh, kw), 1, (ph, pw))
    t = ggmlopt_get_num_threads() if threads is None else _positive(threads, "threads")
    return int(ggmlopt_conv2d_direct_workspace(xs[0], xs[1], xs[2], xs[3], o, kh, kw, ph, pw,
                                               min(t, _MAX_THREADS)))


cdef int _positive(object v, str name) except -1:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"{name}: expected >= 1, got {v}")
    return <int>min(v, 1 << 30)


cdef tuple _direct_args(cnp.ndarray ax, cnp.ndarray aw, padding):
    xs = _images(ax, "x")
    if aw.ndim != 4 or aw.shape[1] != xs[1]:
        raise ValueError(f"weight: expected shape (out_channels, {xs[1]}, kh, kw), got "
                         f"{(<object>aw).shape}")
    if min((<object>aw).shape) < 1:
        raise ValueError(f"weight: expected sizes >= 1, got {(<object>aw).shape}")
    kh, kw = aw.shape[2], aw.shape[3]
    ph, pw = pair(padding, "padding", 0)
    oh, ow = conv2d_output_size(xs[2], xs[3], (kh, kw), 1, (ph, pw))
    return xs, aw.shape[0], kh, kw, ph, pw, oh, ow


cdef cnp.ndarray _workspace(object workspace, tuple xs, int64_t o, int64_t kh, int64_t kw,
                            int64_t ph, int64_t pw):
    need = ggmlopt_conv2d_direct_workspace(xs[0], xs[1], xs[2], xs[3], o, kh, kw, ph, pw, 1)
    if workspace is None:
        return np.empty(ggmlopt_conv2d_direct_workspace(xs[0], xs[1], xs[2], xs[3], o, kh, kw,
                                                        ph, pw, ggmlopt_get_num_threads()),
                        dtype=np.float32)
    cdef cnp.ndarray a = _array(workspace, "workspace", np.float32, True)
    if a.size < need:
        raise ValueError(f"workspace: expected at least {need} float32 elements "
                         f"(conv2d_direct_workspace), got {a.size}")
    return a


cdef cnp.ndarray _conv_bias(object bias, int64_t o):
    """bias checked as float32 with o elements, or None."""
    if bias is None:
        return None
    cdef cnp.ndarray ab = _array(bias, "bias", np.float32, False)
    if ab.size != o:
        raise ValueError(f"bias: expected {o} elements (one per output channel), got {ab.size}")
    return ab


cdef tuple _conv_grads(object grad_weight, object grad_bias, object grad_input,
                       cnp.ndarray aw, tuple xs, bint bias, bint input_grad, cnp.ndarray work):
    """The gradient arrays of a direct-convolution backward (grad_bias None unless
    bias, grad_input None unless input_grad) and the (name, array) list of every
    array it writes, the workspace included."""
    o = (<object>aw).shape[0]
    adw = _out(grad_weight, (<object>aw).shape, "grad_weight", np.float32)
    adb = _out(grad_bias, (o,), "grad_bias", np.float32) if bias else None
    adx = _out(grad_input, xs, "grad_input", np.float32) if input_grad else None
    outputs = [("grad_weight", adw), ("workspace", work)]
    if adb is not None:
        outputs.append(("grad_bias", adb))
    if adx is not None:
        outputs.append(("grad_input", adx))
    return adw, adb, adx, outputs


def conv2d_direct(x, weight, bias=None, padding=0, out=None, workspace=None):
    """A stride-1 convolution computed directly (no im2col, no BLAS).

    x: float32 (n, c, h, w); weight: float32 (o, c, kh, kw); bias: float32 (o,)
    or None; padding (>= 0): an int or a pair (height, width).  Returns out,
    float32 (n, o, oh, ow) with oh = h + 2*ph - kh + 1, ow likewise:
    out[i, o] = bias[o] + sum over c, ky, kx of weight[o, c, ky, kx] *
    x[i, c, oy - ph + ky, ox - pw + kx] (0 outside the image).  workspace:
    float32 scratch of conv2d_direct_workspace(...) elements (one is allocated
    when None); the results do not depend on its size or the thread count."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    cdef cnp.ndarray aw = _array(weight, "weight", np.float32, False)
    xs, o, kh, kw, ph, pw, oh, ow = _direct_args(ax, aw, padding)
    cdef cnp.ndarray ab = _conv_bias(bias, o)
    cdef cnp.ndarray ao = _out(out, (xs[0], o, oh, ow), "out", np.float32)
    cdef cnp.ndarray work = _workspace(workspace, xs, o, kh, kw, ph, pw)
    inputs = [("x", ax), ("weight", aw)]
    if ab is not None:
        inputs.append(("bias", ab))
    _outputs_apart(inputs, [("out", ao), ("workspace", work)])
    cdef int64_t n = xs[0], c = xs[1], h = xs[2], w = xs[3], o_ = o
    cdef int64_t kh_ = kh, kw_ = kw, ph_ = ph, pw_ = pw, nwork = work.size
    cdef const float *pb = NULL if ab is None else _f32(ab)
    cdef float *px = _f32(ax)
    cdef float *pwt = _f32(aw)
    cdef float *po = _f32(ao)
    cdef float *pk = _f32(work)
    with nogil:
        ggmlopt_conv2d_direct_f32(n, c, h, w, o_, kh_, kw_, ph_, pw_, px, pwt, pb, po, pk, nwork)
    return ao


def conv2d_direct_backward(x, weight, grad_out, padding=0, grad_weight=None, grad_bias=None,
                           grad_input=None, *, bias=True, input_grad=True, workspace=None):
    """The gradients of conv2d_direct for the output gradient grad_out (float32
    (n, o, oh, ow)): returns (grad_input, grad_weight, grad_bias), each
    overwritten: grad_weight float32 (o, c, kh, kw) and grad_bias (o,) the sums
    over the batch, grad_input float32 (n, c, h, w).  bias=False leaves
    grad_bias out (None), input_grad=False grad_input.  x, weight, padding and
    workspace as for conv2d_direct.  The sums run over fixed groups of images:
    the same bits for any thread count."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    cdef cnp.ndarray aw = _array(weight, "weight", np.float32, False)
    xs, o, kh, kw, ph, pw, oh, ow = _direct_args(ax, aw, padding)
    cdef cnp.ndarray ag = _array(grad_out, "grad_out", np.float32, False)
    if (<object>ag).shape != (xs[0], o, oh, ow):
        raise ValueError(f"grad_out: expected shape {(xs[0], o, oh, ow)}, got "
                         f"{(<object>ag).shape}")
    cdef cnp.ndarray work = _workspace(workspace, xs, o, kh, kw, ph, pw)
    adw, adb, adx, outputs = _conv_grads(grad_weight, grad_bias, grad_input, aw, xs, bias,
                                         input_grad, work)
    _outputs_apart([("x", ax), ("weight", aw), ("grad_out", ag)], outputs)
    cdef int64_t n = xs[0], c = xs[1], h = xs[2], w = xs[3], o_ = o
    cdef int64_t kh_ = kh, kw_ = kw, ph_ = ph, pw_ = pw, nwork = work.size
    cdef float *pdb = NULL if adb is None else _f32(<cnp.ndarray>adb)
    cdef float *pdx = NULL if adx is None else _f32(<cnp.ndarray>adx)
    cdef float *px = _f32(ax)
    cdef float *pwt = _f32(aw)
    cdef float *pg = _f32(ag)
    cdef float *pdw = _f32(<cnp.ndarray>adw)
    cdef float *pk = _f32(work)
    with nogil:
        ggmlopt_conv2d_direct_backward_f32(n, c, h, w, o_, kh_, kw_, ph_, pw_, px, pwt, pg, pdx,
                                           pdw, pdb, pk, nwork)
    return adx, adw, adb


def conv2d_direct_relu_maxpool(x, weight, bias, padding, pool_kernel, pool_stride=None,
                               out=None, indices=None, workspace=None):
    """conv2d_direct, then ReLU, then max pooling (pool_kernel, pool_stride:
    an int or a pair, stride default pool_kernel), without the convolution's
    full-size output.  Returns (out, indices), float32 and int32 (n, o, poh,
    pow): what maxpool2d_relu returns for conv2d_direct's output, bit for bit.
    x, weight, bias, padding, workspace as for conv2d_direct."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    cdef cnp.ndarray aw = _array(weight, "weight", np.float32, False)
    xs, o, kh, kw, ph, pw, oh, ow = _direct_args(ax, aw, padding)
    cdef cnp.ndarray ab = _conv_bias(bias, o)
    pkh, pkw, psh, psw, poh, pow_ = _pool_args((xs[0], o, oh, ow), pool_kernel, pool_stride)
    shape = (xs[0], o, poh, pow_)
    cdef cnp.ndarray ao = _out(out, shape, "out", np.float32)
    cdef cnp.ndarray ai = _out(indices, shape, "indices", np.int32)
    cdef cnp.ndarray work = _workspace(workspace, xs, o, kh, kw, ph, pw)
    inputs = [("x", ax), ("weight", aw)]
    if ab is not None:
        inputs.append(("bias", ab))
    _outputs_apart(inputs, [("out", ao), ("indices", ai), ("workspace", work)])
    cdef int64_t n = xs[0], c = xs[1], h = xs[2], w = xs[3], o_ = o
    cdef int64_t kh_ = kh, kw_ = kw, ph_ = ph, pw_ = pw, nwork = work.size
    cdef int64_t pkh_ = pkh, pkw_ = pkw, psh_ = psh, psw_ = psw
    cdef const float *pb = NULL if ab is None else _f32(ab)
    cdef float *px = _f32(ax)
    cdef float *pwt = _f32(aw)
    cdef float *po = _f32(ao)
    cdef int32_t *pi = <int32_t *>cnp.PyArray_DATA(ai)
    cdef float *pk = _f32(work)
    with nogil:
        ggmlopt_conv2d_direct_relu_maxpool_f32(n, c, h, w, o_, kh_, kw_, ph_, pw_, pkh_, pkw_,
                                               psh_, psw_, px, pwt, pb, po, pi, pk, nwork)
    return ao, ai


def conv2d_direct_relu_maxpool_backward(x, weight, grad_out, indices, out_forward, padding,
                                        pool_kernel, pool_stride=None, grad_weight=None,
                                        grad_bias=None, grad_input=None, *, bias=True,
                                        input_grad=True, workspace=None):
    """The gradients of conv2d_direct_relu_maxpool for the pool's output
    gradient grad_out (float32 (n, o, poh, pow)), with the indices and
    out_forward the forward returned: (grad_input, grad_weight, grad_bias) as
    conv2d_direct_backward returns them for the convolution's output gradient
    that maxpool2d_relu_backward gives (the same bits), without that
    full-size gradient."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    cdef cnp.ndarray aw = _array(weight, "weight", np.float32, False)
    xs, o, kh, kw, ph, pw, oh, ow = _direct_args(ax, aw, padding)
    # the pool's checks, on the convolution's output shape
    _, window, grad, idx = _maxpool_grad_inputs(grad_out, indices, (xs[0], o, oh, ow),
                                                pool_kernel, pool_stride)
    pkh, pkw, psh, psw = window
    cdef cnp.ndarray ag = grad, ai = idx
    shape = (<object>ag).shape
    cdef cnp.ndarray ay = _array(out_forward, "out_forward", np.float32, False)
    if (<object>ay).shape != shape:
        raise ValueError(f"out_forward: expected shape {shape}, got {(<object>ay).shape}")
    cdef cnp.ndarray work = _workspace(workspace, xs, o, kh, kw, ph, pw)
    adw, adb, adx, outputs = _conv_grads(grad_weight, grad_bias, grad_input, aw, xs, bias,
                                         input_grad, work)
    _outputs_apart([("x", ax), ("weight", aw), ("grad_out", ag), ("out_forward", ay),
                    ("indices", ai)], outputs)
    cdef int64_t n = xs[0], c = xs[1], h = xs[2], w = xs[3], o_ = o
    cdef int64_t kh_ = kh, kw_ = kw, ph_ = ph, pw_ = pw, nwork = work.size
    cdef int64_t pkh_ = pkh, pkw_ = pkw, psh_ = psh, psw_ = psw
    cdef float *pdb = NULL if adb is None else _f32(<cnp.ndarray>adb)
    cdef float *pdx = NULL if adx is None else _f32(<cnp.ndarray>adx)
    cdef float *px = _f32(ax)
    cdef float *pwt = _f32(aw)
    cdef float *pg = _f32(ag)
    cdef float *py = _f32(ay)
    cdef int32_t *pi = <int32_t *>cnp.PyArray_DATA(ai)
    cdef float *pdw = _f32(<cnp.ndarray>adw)
    cdef float *pk = _f32(work)
    with nogil:
        ggmlopt_conv2d_direct_relu_maxpool_backward_f32(n, c, h, w, o_, kh_, kw_, ph_, pw_, pkh_,
                                                        pkw_, psh_, psw_, px, pwt, pg, pi, py,
                                                        pdx, pdw, pdb, pk, nwork)
    return adx, adw, adb


# ---- activations ------------------------------------------------------------------

cdef enum _Act:
    ACT_TANH, ACT_SIGMOID, ACT_SILU, ACT_GELU, ACT_GELU_TANH, ACT_LEAKY_RELU


cdef int _gelu_kind(object approximate) except -1:
    if not isinstance(approximate, str):
        raise TypeError(f"approximate: expected 'none' or 'tanh', got "
                        f"{type(approximate).__name__}")
    if approximate == "none":
        return ACT_GELU
    if approximate == "tanh":
        return ACT_GELU_TANH
    raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")


cdef object _activation(object x, object out, int kind, float param):
    """out = f(x) for float32 arrays of one size; out may be x itself."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    if out is None:
        out = np.empty((<object>ax).shape, dtype=np.float32)
    cdef cnp.ndarray ao = _array(out, "out", np.float32, True)
    _same_size(ax, "x", ao, "out")
    if cnp.PyArray_DATA(ax) != cnp.PyArray_DATA(ao):
        _no_overlap([("x", ax), ("out", ao)])
    cdef int64_t n = ax.size
    cdef float *px = _f32(ax)
    cdef float *po = _f32(ao)
    with nogil:
        if kind == ACT_TANH:
            ggmlopt_tanh_f32(n, px, po)
        elif kind == ACT_SIGMOID:
            ggmlopt_sigmoid_f32(n, px, po)
        elif kind == ACT_SILU:
            ggmlopt_silu_f32(n, px, po)
        elif kind == ACT_GELU:
            ggmlopt_gelu_f32(n, px, po)
        elif kind == ACT_GELU_TANH:
            ggmlopt_gelu_tanh_f32(n, px, po)
        else:
            ggmlopt_leaky_relu_f32(n, px, po, param)
    return out


cdef object _activation_backward(object a, str aname, object g, object out, int kind,
                                 float param):
    """out = g * f'(...) from a (the forward output or input, named aname); out may
    be g itself, never a."""
    cdef cnp.ndarray aa = _array(a, aname, np.float32, False)
    cdef cnp.ndarray ag = _array(g, "g", np.float32, False)
    _same_size(aa, aname, ag, "g")
    if out is None:
        out = np.empty((<object>ag).shape, dtype=np.float32)
    cdef cnp.ndarray ao = _array(out, "out", np.float32, True)
    _same_size(ag, "g", ao, "out")
    if cnp.PyArray_DATA(ag) != cnp.PyArray_DATA(ao):
        _no_overlap([("g", ag), ("out", ao)])
    _no_overlap([(aname, aa), ("out", ao)])
    cdef int64_t n = aa.size
    cdef float *pa = _f32(aa)
    cdef float *pg = _f32(ag)
    cdef float *po = _f32(ao)
    with nogil:
        if kind == ACT_TANH:
            ggmlopt_tanh_backward_f32(n, pa, pg, po)
        elif kind == ACT_SIGMOID:
            ggmlopt_sigmoid_backward_f32(n, pa, pg, po)
        elif kind == ACT_SILU:
            ggmlopt_silu_backward_f32(n, pa, pg, po)
        elif kind == ACT_GELU:
            ggmlopt_gelu_backward_f32(n, pa, pg, po)
        elif kind == ACT_GELU_TANH:
            ggmlopt_gelu_tanh_backward_f32(n, pa, pg, po)
        else:
            ggmlopt_leaky_relu_backward_f32(n, pa, pg, po, param)
    return out


def tanh(x, out=None):
    """y = tanh(x) for a float32 array of any shape, within 4 ulp of float64 (NaN
    stays NaN, tanh(-0) = -0).  out: float32 of x's size, may be x itself.
    Returns out."""
    return _activation(x, out, ACT_TANH, 0.0)


def tanh_backward(y, g, out=None):
    """out = g * (1 - y^2), with y = tanh(x) the forward output (float32 arrays
    of one size; out may be g itself).  Returns out."""
    return _activation_backward(y, "y", g, out, ACT_TANH, 0.0)


def sigmoid(x, out=None):
    """y = 1/(1 + exp(-x)) for a float32 array, within 4 ulp of float64 over the
    whole range (subnormal results included).  out may be x.  Returns out."""
    return _activation(x, out, ACT_SIGMOID, 0.0)


def sigmoid_backward(y, g, out=None):
    """out = g * y * (1 - y), with y = sigmoid(x) the forward output (float32
    arrays of one size; out may be g itself).  Returns out."""
    return _activation_backward(y, "y", g, out, ACT_SIGMOID, 0.0)


def silu(x, out=None):
    """y = x * sigmoid(x) for a float32 array (silu(-inf) = 0, the limit).
    out may be x.  Returns out."""
    return _activation(x, out, ACT_SILU, 0.0)


def silu_backward(x, g, out=None):
    """out = g * s * (1 + x(1 - s)), s = sigmoid(x), with x the forward input
    (float32 arrays of one size; out may be g itself).  Returns out."""
    return _activation_backward(x, "x", g, out, ACT_SILU, 0.0)


def gelu(x, out=None, approximate="none"):
    """GELU of a float32 array: approximate='none' gives x * Phi(x) =
    x/2 * (1 + erf(x/sqrt2)) (ggml_gelu_erf), 'tanh' gives
    x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (ggml_gelu, computed
    in float32 without ggml's float16 table).  out may be x.  Returns out."""
    cdef int kind = _gelu_kind(approximate)
    return _activation(x, out, kind, 0.0)


def gelu_backward(x, g, out=None, approximate="none"):
    """out = g * dGELU/dx at the forward input x, for the form named by
    approximate (float32 arrays of one size; out may be g itself).  Returns out."""
    cdef int kind = _gelu_kind(approximate)
    return _activation_backward(x, "x", g, out, kind, 0.0)


cdef float _slope(object negative_slope) except? -1:
    if isinstance(negative_slope, bool):
        raise TypeError("negative_slope: expected a real number, got bool")
    return _finite_float(negative_slope, "negative_slope")


def leaky_relu(x, negative_slope=0.01, out=None):
    """y = x > 0 ? x : negative_slope * x for a float32 array (negative_slope a
    finite real number).  out may be x.  Returns out."""
    cdef float s = _slope(negative_slope)
    return _activation(x, out, ACT_LEAKY_RELU, s)


def leaky_relu_backward(x, g, negative_slope=0.01, out=None):
    """out = x > 0 ? g : negative_slope * g, with x the forward input (torch's
    rule: slope at x = 0; float32 arrays of one size; out may be g itself).
    Returns out."""
    cdef float s = _slope(negative_slope)
    return _activation_backward(x, "x", g, out, ACT_LEAKY_RELU, s)


# ---- run time: SIMD paths and threads ------------------------------------------

def _paths():
    return [(ggmlopt_simd_name(i).decode(), bool(ggmlopt_simd_compiled(i)),
             bool(ggmlopt_simd_supported(i))) for i in range(ggmlopt_simd_count())]


def use_simd(name=None):
    """Pin the SIMD path ('scalar', 'avx2', 'avx512', 'neon', in any case, as the
    GEMM engine's names), or None for the best one this CPU runs.  Returns the
    name of the path that was active before."""
    previous = ggmlopt_simd_active().decode()
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name: expected a str or None, got {type(name).__name__}")
    cdef int rc
    if name is None:
        rc = ggmlopt_simd_select(NULL)
    else:
        bname = name.strip().lower().encode()
        rc = ggmlopt_simd_select(bname)
    if rc == -1:
        raise ValueError(f"SIMD path {name!r} is unknown; expected one of "
                         f"{[p[0] for p in _paths()]}")
    if rc == -2:
        raise ValueError(f"SIMD path {name!r} is not compiled into this build "
                         f"(compiled: {[p[0] for p in _paths() if p[1]]})")
    if rc == -3:
        raise ValueError(f"SIMD path {name!r} is compiled in but this CPU cannot run it "
                         f"(CPU: {ggmlopt_cpu_features().decode()})")
    global _pinned
    _pinned = None if name is None else name.strip().lower()
    return previous


def simd_paths():
    """The paths this CPU can run, best first (always ending with 'scalar')."""
    return [p[0] for p in _paths() if p[1] and p[2]]


_override = os.environ.get("GGMLOPT_SIMD") or None
_pinned = None   # the path use_simd (or GGMLOPT_SIMD at import) pinned, or None


def simd_info():
    """{'compiled': [...], 'cpu': {feature: bool}, 'active': name, 'override': the
    path pinned now (GGMLOPT_SIMD at import, or use_simd since), or None}"""
    cpu = {}
    for item in ggmlopt_cpu_features().decode().split():
        key, _, val = item.partition("=")
        cpu[key] = val == "1"
    return {
        "compiled": [p[0] for p in reversed(_paths()) if p[1]],
        "cpu": cpu,
        "active": ggmlopt_simd_active().decode(),
        # the path's name as use_simd reads it (" Scalar " pins "scalar")
        "override": _pinned,
    }


def set_num_threads(n):
    """Threads the kernels use for large arrays (1: only the calling thread; more
    than 64, the pool's limit, run as 64)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n: expected an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"n: expected at least 1 thread, got {n}")
    ggmlopt_set_num_threads(min(int(n), _MAX_THREADS))


def get_num_threads():
    """Threads the kernels use for large arrays."""
    return ggmlopt_get_num_threads()


def set_pool_linger(seconds):
    """How long an idle kernel thread keeps polling for the next call (yielding
    its core to any other runnable thread) before it sleeps, in seconds; 0,
    the default, sleeps after some 10 microseconds.  Decoding, which calls
    small kernels every few tens of microseconds with Python in between, sets
    it for its steps.  Returns the previous value."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float, np.integer, np.floating)):
        raise TypeError(f"seconds: expected a number, got {type(seconds).__name__}")
    if not 0 <= seconds <= 1:
        raise ValueError(f"seconds: expected 0 <= seconds <= 1, got {seconds}")
    return ggmlopt_set_pool_linger_ns(int(round(float(seconds) * 1e9))) / 1e9


_MAX_THREADS = 64  # the thread pool's limit


def _threads_from_env(value):
    """GGMLOPT_NUM_THREADS as a thread count; ValueError for anything but an int
    from 1 to _MAX_THREADS."""
    try:
        n = int(value.strip())
    except ValueError:
        raise ValueError(f"expected a whole number of threads from 1 to {_MAX_THREADS}") from None
    if not 1 <= n <= _MAX_THREADS:
        raise ValueError(f"expected a number of threads from 1 to {_MAX_THREADS}, got {n}")
    return n


# CPU detection happens here, once, at import; GGMLOPT_SIMD pins a path and
# GGMLOPT_NUM_THREADS sets the threads.  A bad value of either stops the import
# with a message naming the variable (rather than being ignored or clamped).
if _override is not None:
    try:
        use_simd(_override)
    except ValueError as e:
        raise ImportError(f"GGMLOPT_SIMD={_override!r}: {e}") from None
else:
    use_simd(None)
_threads_override = os.environ.get("GGMLOPT_NUM_THREADS") or None
if _threads_override is not None:
    try:
        set_num_threads(_threads_from_env(_threads_override))
    except ValueError as e:
        raise ImportError(f"GGMLOPT_NUM_THREADS={_threads_override!r}: {e}") from None


# language-model layers: C forwarders for ggmlopt.kernels_embedding,
# kernels_norm and kernels_glu (C symbols are not shared between extensions)
cdef extern from "ggmlopt.h" nogil:
    void ggmlopt_embedding_f32(int64_t n, int64_t dim, const int32_t *ids, const float *weight,
                               float *out)
    void ggmlopt_embedding_backward_f32(int64_t n, int64_t dim, const int32_t *ids,
                                        const float *grad, int64_t num, float *grad_weight)
    void ggmlopt_rmsnorm_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                             float eps, float *y, float *rstd)
    void ggmlopt_rmsnorm_backward_f32(int64_t nrows, int64_t dim, const float *x,
                                      const float *weight, const float *rstd,
                                      const float *grad_y, float *grad_x, float *grad_weight,
                                      float *work)
    void ggmlopt_layernorm_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                               const float *bias, float eps, float *y, float *mean, float *rstd)
    void ggmlopt_layernorm_backward_f32(int64_t nrows, int64_t dim, const float *x,
                                        const float *weight, const float *mean,
                                        const float *rstd, const float *grad_y, float *grad_x,
                                        float *grad_weight, float *grad_bias, float *work)
    int64_t ggmlopt_norm_backward_work_size(int64_t nrows, int64_t dim)
    void ggmlopt_swiglu_f32(int64_t n, const float *gate, const float *up, float *h)
    void ggmlopt_swiglu_backward_f32(int64_t n, const float *gate, const float *up,
                                     const float *grad_h, float *grad_gate, float *grad_up)

cdef void embedding_f32(int64_t n, int64_t dim, const int32_t *ids, const float *weight,
                        float *out) noexcept nogil:
    ggmlopt_embedding_f32(n, dim, ids, weight, out)

cdef void embedding_backward_f32(int64_t n, int64_t dim, const int32_t *ids, const float *grad,
                                 int64_t num, float *grad_weight) noexcept nogil:
    ggmlopt_embedding_backward_f32(n, dim, ids, grad, num, grad_weight)

cdef void rmsnorm_f32(int64_t nrows, int64_t dim, const float *x, const float *weight, float eps,
                      float *y, float *rstd) noexcept nogil:
    ggmlopt_rmsnorm_f32(nrows, dim, x, weight, eps, y, rstd)

cdef void rmsnorm_backward_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                               const float *rstd, const float *grad_y, float *grad_x,
                               float *grad_weight, float *work) noexcept nogil:
    ggmlopt_rmsnorm_backward_f32(nrows, dim, x, weight, rstd, grad_y, grad_x, grad_weight,
                                 work)

cdef void layernorm_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                        const float *bias, float eps, float *y, float *mean,
                        float *rstd) noexcept nogil:
    ggmlopt_layernorm_f32(nrows, dim, x, weight, bias, eps, y, mean, rstd)

cdef void layernorm_backward_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                                 const float *mean, const float *rstd, const float *grad_y,
                                 float *grad_x, float *grad_weight, float *grad_bias,
                                 float *work) noexcept nogil:
    ggmlopt_layernorm_backward_f32(nrows, dim, x, weight, mean, rstd, grad_y, grad_x,
                                   grad_weight, grad_bias, work)

cdef int64_t norm_backward_work_size(int64_t nrows, int64_t dim) noexcept nogil:
    return ggmlopt_norm_backward_work_size(nrows, dim)

cdef void swiglu_f32(int64_t n, const float *gate, const float *up, float *h) noexcept nogil:
    ggmlopt_swiglu_f32(n, gate, up, h)

cdef void swiglu_backward_f32(int64_t n, const float *gate, const float *up, const float *grad_h,
                              float *grad_gate, float *grad_up) noexcept nogil:
    ggmlopt_swiglu_backward_f32(n, gate, up, grad_h, grad_gate, grad_up)


# ---- causal attention and rotary embedding (wrapped in kernels_attention) ----------

cdef extern from "ggmlopt.h" nogil:
    int ggmlopt_attention_forward_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                      int64_t n_kv_heads, int64_t head_dim, const float *q,
                                      int64_t q_stride, const float *k, int64_t k_stride,
                                      const float *v, int64_t v_stride, float *out,
                                      int64_t out_stride, float *lse)
    int ggmlopt_attention_backward_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                       int64_t n_kv_heads, int64_t head_dim, const float *q,
                                       int64_t q_stride, const float *k, int64_t k_stride,
                                       const float *v, int64_t v_stride, const float *out,
                                       int64_t out_stride, const float *lse, const float *dout,
                                       float *dq, float *dk, float *dv)
    int ggmlopt_attention_forward_ranged_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                             int64_t n_kv_heads, int64_t head_dim,
                                             const float *q, int64_t q_stride, const float *k,
                                             int64_t k_stride, const float *v, int64_t v_stride,
                                             float *out, int64_t out_stride, float *lse,
                                             const int32_t *kv_start)
    int ggmlopt_attention_backward_ranged_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                              int64_t n_kv_heads, int64_t head_dim,
                                              const float *q, int64_t q_stride, const float *k,
                                              int64_t k_stride, const float *v,
                                              int64_t v_stride, const float *out,
                                              int64_t out_stride, const float *lse,
                                              const float *dout, float *dq, float *dk,
                                              float *dv, const int32_t *kv_start)
    void ggmlopt_rope_f32(int64_t nrows, int64_t seq, int64_t pos0, int64_t n_heads,
                          int64_t head_dim, const float *x, int64_t x_stride, float *y,
                          int64_t y_stride, const float *cos, const float *sin, int inverse)
    int ggmlopt_attention_decode_f32(int64_t batch, int64_t n_heads, int64_t n_kv_heads,
                                     int64_t head_dim, int64_t length, const float *q,
                                     const float *k, const float *v, int64_t kv_item_stride,
                                     float *out, float *scores, float scale)
    int ggmlopt_attention_forward_capped_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                             int64_t n_kv_heads, int64_t head_dim,
                                             const float *q, int64_t q_stride, const float *k,
                                             int64_t k_stride, const float *v, int64_t v_stride,
                                             float *out, int64_t out_stride, float *lse,
                                             const int32_t *kv_start, float softcap)
    int ggmlopt_attention_backward_capped_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                              int64_t n_kv_heads, int64_t head_dim,
                                              const float *q, int64_t q_stride, const float *k,
                                              int64_t k_stride, const float *v,
                                              int64_t v_stride, const float *out,
                                              int64_t out_stride, const float *lse,
                                              const float *dout, float *dq, float *dk,
                                              float *dv, const int32_t *kv_start, float softcap)
    int ggmlopt_attention_decode_capped_f32(int64_t batch, int64_t n_heads, int64_t n_kv_heads,
                                            int64_t head_dim, int64_t length, const float *q,
                                            const float *k, const float *v,
                                            int64_t kv_item_stride, float *out, float *scores,
                                            float scale, float softcap)


cdef int attention_forward_f32(int64_t batch, int64_t seq, int64_t n_heads, int64_t n_kv_heads,
                               int64_t head_dim, const float *q, int64_t q_stride,
                               const float *k, int64_t k_stride, const float *v,
                               int64_t v_stride, float *out, int64_t out_stride,
                               float *lse) noexcept nogil:
    return ggmlopt_attention_forward_f32(batch, seq, n_heads, n_kv_heads, head_dim, q, q_stride,
                                         k, k_stride, v, v_stride, out, out_stride, lse)

cdef int attention_backward_f32(int64_t batch, int64_t seq, int64_t n_heads, int64_t n_kv_heads,
                                int64_t head_dim, const float *q, int64_t q_stride,
                                const float *k, int64_t k_stride, const float *v,
                                int64_t v_stride, const float *out, int64_t out_stride,
                                const float *lse, const float *dout, float *dq, float *dk,
                                float *dv) noexcept nogil:
    return ggmlopt_attention_backward_f32(batch, seq, n_heads, n_kv_heads, head_dim, q,
                                          q_stride, k, k_stride, v, v_stride, out, out_stride,
                                          lse, dout, dq, dk, dv)

cdef int attention_forward_ranged_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                      int64_t n_kv_heads, int64_t head_dim, const float *q,
                                      int64_t q_stride, const float *k, int64_t k_stride,
                                      const float *v, int64_t v_stride, float *out,
                                      int64_t out_stride, float *lse,
                                      const int32_t *kv_start) noexcept nogil:
    return ggmlopt_attention_forward_ranged_f32(batch, seq, n_heads, n_kv_heads, head_dim, q,
                                                q_stride, k, k_stride, v, v_stride, out,
                                                out_stride, lse, kv_start)

cdef int attention_backward_ranged_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                       int64_t n_kv_heads, int64_t head_dim, const float *q,
                                       int64_t q_stride, const float *k, int64_t k_stride,
                                       const float *v, int64_t v_stride, const float *out,
                                       int64_t out_stride, const float *lse, const float *dout,
                                       float *dq, float *dk, float *dv,
                                       const int32_t *kv_start) noexcept nogil:
    return ggmlopt_attention_backward_ranged_f32(batch, seq, n_heads, n_kv_heads, head_dim, q,
                                                 q_stride, k, k_stride, v, v_stride, out,
                                                 out_stride, lse, dout, dq, dk, dv, kv_start)

cdef void rope_f32(int64_t nrows, int64_t seq, int64_t pos0, int64_t n_heads, int64_t head_dim,
                   const float *x, int64_t x_stride, float *y, int64_t y_stride,
                   const float *cos, const float *sin, int inverse) noexcept nogil:
    ggmlopt_rope_f32(nrows, seq, pos0, n_heads, head_dim, x, x_stride, y, y_stride, cos, sin,
                     inverse)


cdef int attention_decode_f32(int64_t batch, int64_t n_heads, int64_t n_kv_heads,
                              int64_t head_dim, int64_t length, const float *q, const float *k,
                              const float *v, int64_t kv_item_stride, float *out, float *scores,
                              float scale) noexcept nogil:
    return ggmlopt_attention_decode_f32(batch, n_heads, n_kv_heads, head_dim, length, q, k, v,
                                        kv_item_stride, out, scores, scale)

cdef int attention_forward_capped_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                      int64_t n_kv_heads, int64_t head_dim, const float *q,
                                      int64_t q_stride, const float *k, int64_t k_stride,
                                      const float *v, int64_t v_stride, float *out,
                                      int64_t out_stride, float *lse, const int32_t *kv_start,
                                      float softcap) noexcept nogil:
    return ggmlopt_attention_forward_capped_f32(batch, seq, n_heads, n_kv_heads, head_dim, q,
                                                q_stride, k, k_stride, v, v_stride, out,
                                                out_stride, lse, kv_start, softcap)

cdef int attention_backward_capped_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                       int64_t n_kv_heads, int64_t head_dim, const float *q,
                                       int64_t q_stride, const float *k, int64_t k_stride,
                                       const float *v, int64_t v_stride, const float *out,
                                       int64_t out_stride, const float *lse, const float *dout,
                                       float *dq, float *dk, float *dv, const int32_t *kv_start,
                                       float softcap) noexcept nogil:
    return ggmlopt_attention_backward_capped_f32(batch, seq, n_heads, n_kv_heads, head_dim, q,
                                                 q_stride, k, k_stride, v, v_stride, out,
                                                 out_stride, lse, dout, dq, dk, dv, kv_start,
                                                 softcap)

cdef int attention_decode_capped_f32(int64_t batch, int64_t n_heads, int64_t n_kv_heads,
                                     int64_t head_dim, int64_t length, const float *q,
                                     const float *k, const float *v, int64_t kv_item_stride,
                                     float *out, float *scores, float scale,
                                     float softcap) noexcept nogil:
    return ggmlopt_attention_decode_capped_f32(batch, n_heads, n_kv_heads, head_dim, length, q,
                                               k, v, kv_item_stride, out, scores, scale, softcap)


cdef extern from "ggmlopt.h" nogil:
    int64_t ggmlopt_quant_row_bytes(int type, int64_t ncols)
    int ggmlopt_dequantize_rows(int type, int64_t r0, int64_t r1, int64_t ncols,
                                const uint8_t *src, float *dst, int64_t dst_stride)
    int ggmlopt_dequantize_gather(int type, int64_t n, const int32_t *ids, int64_t ncols,
                                  const uint8_t *src, float *dst)
    int ggmlopt_quant_matmul_f32(int type, int64_t nx, int64_t ncols, const float *x,
                                 int64_t x_stride, int64_t nout, const uint8_t *w, float *y,
                                 int64_t y_stride)
    int ggmlopt_quantize_rows_f32(int type, int64_t nrows, int64_t ncols, const float *src,
                                  uint8_t *dst)
    void ggmlopt_quantize_q8_0_row(const float *x, int64_t n, int8_t *qs, float *scales,
                                   float *sums)
    void ggmlopt_quantize_q8_k_row(const float *x, int64_t n, int8_t *qs, float *scales,
                                   int16_t *sums)
    int ggmlopt_quant_matmul_q8(int type, int64_t nx, int64_t ncols, const float *x,
                                int64_t x_stride, int64_t nout, const uint8_t *w, float *y,
                                int64_t y_stride, int8_t *xqs, float *xd, float *xsum)


cdef int64_t quant_row_bytes(int type, int64_t ncols) noexcept nogil:
    return ggmlopt_quant_row_bytes(type, ncols)


cdef int dequantize_rows(int type, int64_t r0, int64_t r1, int64_t ncols, const uint8_t *src,
                         float *dst, int64_t dst_stride) noexcept nogil:
    return ggmlopt_dequantize_rows(type, r0, r1, ncols, src, dst, dst_stride)


cdef int quant_matmul_f32(int type, int64_t nx, int64_t ncols, const float *x, int64_t x_stride,
                          int64_t nout, const uint8_t *w, float *y,
                          int64_t y_stride) noexcept nogil:
    return ggmlopt_quant_matmul_f32(type, nx, ncols, x, x_stride, nout, w, y, y_stride)


cdef int quant_matmul_q8(int type, int64_t nx, int64_t ncols, const float *x, int64_t x_stride,
                         int64_t nout, const uint8_t *w, float *y, int64_t y_stride,
                         int8_t *xqs, float *xd, float *xsum) noexcept nogil:
    return ggmlopt_quant_matmul_q8(type, nx, ncols, x, x_stride, nout, w, y, y_stride, xqs, xd, xsum)


cdef void quantize_q8_0_row(const float *x, int64_t n, int8_t *qs, float *scales) noexcept nogil:
    ggmlopt_quantize_q8_0_row(x, n, qs, scales, NULL)


cdef void quantize_q8_k_row(const float *x, int64_t n, int8_t *qs, float *scales,
                            int16_t *sums) noexcept nogil:
    ggmlopt_quantize_q8_k_row(x, n, qs, scales, sums)


cdef extern from "ggmlopt.h" nogil:
    int ggmlopt_quant_matmul_many(int n, const ggmlopt_qproduct *products, int64_t nx,
                                  int64_t ncols, const float *x, int64_t x_stride, int q8,
                                  int8_t *xqs, float *xd, float *xsum)
    int64_t ggmlopt_decode_block_work_size(const ggmlopt_llama_block *blk, int64_t batch,
                                           int64_t max_len)
    int ggmlopt_decode_block_f32(const ggmlopt_llama_block *blk, int64_t batch, int64_t pos,
                                 float *x, float *cache_k, float *cache_v, int64_t max_len,
                                 const float *cos, const float *sin, void *work)


cdef int quant_matmul_many(int n, const ggmlopt_qproduct *products, int64_t nx, int64_t ncols,
                           const float *x, int64_t x_stride, int q8, int8_t *xqs, float *xd,
                           float *xsum) noexcept nogil:
    return ggmlopt_quant_matmul_many(n, products, nx, ncols, x, x_stride, q8, xqs, xd, xsum)


cdef int64_t decode_block_work_size(const ggmlopt_llama_block *blk, int64_t batch,
                                    int64_t max_len) noexcept nogil:
    return ggmlopt_decode_block_work_size(blk, batch, max_len)


cdef int decode_block_f32(const ggmlopt_llama_block *blk, int64_t batch, int64_t pos, float *x,
                          float *cache_k, float *cache_v, int64_t max_len, const float *cos,
                          const float *sin, void *work) noexcept nogil:
    return ggmlopt_decode_block_f32(blk, batch, pos, x, cache_k, cache_v, max_len, cos, sin,
                                    work)


cdef int dequantize_gather(int type, int64_t n, const int32_t *ids, int64_t ncols,
                           const uint8_t *src, float *dst) noexcept nogil:
    return ggmlopt_dequantize_gather(type, n, ids, ncols, src, dst)


cdef int quantize_rows_f32(int type, int64_t nrows, int64_t ncols, const float *src,
                           uint8_t *dst) noexcept nogil:
    return ggmlopt_quantize_rows_f32(type, nrows, ncols, src, dst)


cdef extern from "ggmlopt.h" nogil:
    int ggmlopt_sgemm_f32(int64_t m, int64_t n, int64_t k, const float *a, int64_t a_row,
                          int64_t a_col, const float *b, int64_t b_row, int64_t b_col, float *c,
                          int64_t ldc, int accumulate)

cdef int sgemm_f32(int64_t m, int64_t n, int64_t k, const float *a, int64_t a_row, int64_t a_col,
                   const float *b, int64_t b_row, int64_t b_col, float *c, int64_t ldc,
                   int accumulate) noexcept nogil:
    return ggmlopt_sgemm_f32(m, n, k, a, a_row, a_col, b, b_row, b_col, c, ldc, accumulate)


cdef extern from "ggmlopt.h" nogil:
    int ggmlopt_matmul_columns_f32(int64_t nx, int64_t ncols, const float *x, int64_t x_stride,
                                   int64_t nout, const float *w, int64_t ld, float *y,
                                   int64_t y_stride, float *partials)

cdef int matmul_columns_f32(int64_t nx, int64_t ncols, const float *x, int64_t x_stride,
                            int64_t nout, const float *w, int64_t ld, float *y,
                            int64_t y_stride, float *partials) noexcept nogil:
    return ggmlopt_matmul_columns_f32(nx, ncols, x, x_stride, nout, w, ld, y, y_stride, partials)


cdef extern from "ggmlopt.h" nogil:
    int ggmlopt_gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t a_row,
                          int64_t a_col, const uint16_t *b, int64_t b_row, int64_t b_col,
                          float *c, int64_t ldc, int accumulate)
    int ggmlopt_gemm_bf16_instruction()

cdef int gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t a_row,
                   int64_t a_col, const uint16_t *b, int64_t b_row, int64_t b_col, float *c,
                   int64_t ldc, int accumulate) noexcept nogil:
    return ggmlopt_gemm_bf16(m, n, k, a, a_row, a_col, b, b_row, b_col, c, ldc, accumulate)


def gemm_bf16_instruction():
    """True when the bf16 products run on AVX512-BF16's vdpbf16ps (the avx512
    path on a CPU that has it); False: each pair of products is two float32 FMAs."""
    return bool(ggmlopt_gemm_bf16_instruction())
