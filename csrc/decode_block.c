/*
 * A decode step of a Llama-layout block in one call (ggmlopt.h,
 * ggmlopt_decode_block_f32): the block's dozen kernels for one new token
 * (weights kept in their file's types, or a Linear's float32 ones),
 * one after the other, with q, k and v as one threaded product and gate and up
 * as another.  Decoding a small model is some 200 calls a token of a few
 * microseconds of work each; from Python every call also paid its argument
 * checks and a round trip through the interpreter.
 *
 * Built only on the public kernels, in the order the layers call them, so a
 * step gives the bits the layers give one by one.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "ggmlopt.h"

/* the work area's parts, each rounded up to whole cache lines */
typedef struct {
    float *normed, *q, *attended, *out, *gate, *up, *rstd, *scores, *xd, *xsum, *lora_t;
    int8_t *xqs;
    float *partials;   /* ggmlopt_matmul_columns_many's, for Linear weights */
    int64_t bytes;
} block_work;

static const ggmlopt_block_weight *weight_of(const ggmlopt_llama_block *blk, int m) {
    const ggmlopt_block_weight *ws[7] = {&blk->q, &blk->k, &blk->v, &blk->o,
                                         &blk->gate, &blk->up, &blk->down};
    return ws[m];
}

static int64_t lines(int64_t bytes) { return (bytes + 63) & ~(int64_t)63; }

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    const int64_t m = a > b ? a : b;
    return m > c ? m : c;
}

/* Lays the parts out from base (NULL: only counts the bytes). */
static block_work work_layout(const ggmlopt_llama_block *blk, int64_t batch, int64_t max_len,
                              char *base) {
    const int64_t nq = blk->n_heads * blk->head_dim;
    const int64_t widest = max3(blk->dim, nq, blk->ffn_dim);   /* a product's input */
    int64_t rank = 0;   /* the largest adapter's */
    for (int m = 0; m < 7; ++m)
        if (weight_of(blk, m)->lora_a != NULL && weight_of(blk, m)->rank > rank)
            rank = weight_of(blk, m)->rank;
    /* the widest group of Linear weights: its partial sums */
    int64_t partials = 0;
    {
        const int groups[4][3] = {{0, 1, 2}, {3, -1, -1}, {4, 5, -1}, {6, -1, -1}};
        const int64_t inputs[4] = {blk->dim, nq, blk->dim, blk->ffn_dim};
        for (int g = 0; g < 4; ++g) {
            int64_t nout = 0;
            for (int i = 0; i < 3 && groups[g][i] >= 0; ++i)
                if (weight_of(blk, groups[g][i])->columns_ld != 0)
                    nout += weight_of(blk, groups[g][i])->nout;
            const int64_t floats = ggmlopt_matmul_columns_scratch(batch, inputs[g], nout);
            if (floats > partials) partials = floats;
        }
    }
    const int64_t sizes[] = {
        batch * blk->dim * 4, batch * nq * 4, batch * nq * 4, batch * blk->dim * 4,
        batch * blk->ffn_dim * 4, batch * blk->ffn_dim * 4,
        batch * (blk->n_heads > blk->n_kv_heads ? blk->n_heads : blk->n_kv_heads) * 4,
        blk->n_heads * max_len * 4, batch * (widest / 32 + 1) * 4, batch * (widest / 32 + 1) * 4,
        rank * 4, batch * (widest + 32), partials * 4,
    };
    void *parts[sizeof sizes / sizeof sizes[0]];
    int64_t at = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; ++i) {
        parts[i] = base ? base + at : NULL;
        at += lines(sizes[i]);
    }
    block_work w = {parts[0], parts[1], parts[2], parts[3], parts[4], parts[5], parts[6],
                    parts[7], parts[8], parts[9], parts[10], parts[11], parts[12], at};
    return w;
}

static int weight_ok(const ggmlopt_block_weight *w, int64_t nout, int64_t ncols) {
    if (w->lora_a != NULL &&
        (w->lora_b == NULL || w->rank < 1 || w->lora_b_stride < nout || !isfinite(w->lora_scale)))
        return 0;
    if (w->columns_ld != 0)   /* a Linear's float32 (ncols, columns_ld) weight */
        return w->w != NULL && w->nout == nout && w->type == 0 && w->columns_ld >= nout;
    return w->w != NULL && w->nout == nout && ggmlopt_quant_row_bytes(w->type, ncols) >= 0;
}

int64_t ggmlopt_decode_block_work_size(const ggmlopt_llama_block *blk, int64_t batch,
                                       int64_t max_len) {
    if (blk->dim < 1 || blk->n_heads < 1 || blk->n_kv_heads < 1 || blk->head_dim < 1 ||
        blk->ffn_dim < 1 || blk->n_heads % blk->n_kv_heads != 0 ||
        batch < 0 || max_len < 1 || blk->window < 0 || !(blk->eps >= 0.0f) ||
        blk->attn_norm == NULL || blk->ffn_norm == NULL ||
        (blk->q_norm == NULL) != (blk->k_norm == NULL))
        return -1;
    const int64_t nq = blk->n_heads * blk->head_dim, kv = blk->n_kv_heads * blk->head_dim;
    if (!weight_ok(&blk->q, nq, blk->dim) || !weight_ok(&blk->k, kv, blk->dim) ||
        !weight_ok(&blk->v, kv, blk->dim) || !weight_ok(&blk->o, blk->dim, nq) ||
        !weight_ok(&blk->gate, blk->ffn_dim, blk->dim) ||
        !weight_ok(&blk->up, blk->ffn_dim, blk->dim) ||
        !weight_ok(&blk->down, blk->dim, blk->ffn_dim))
        return -1;
    return work_layout(blk, batch, max_len, NULL).bytes;
}

/* y (batch rows of y_stride) += bias, row by row (a row's values are contiguous) */
static void add_bias(const float *bias, int64_t batch, int64_t n, float *y, int64_t y_stride) {
    if (bias == NULL) return;
    for (int64_t b = 0; b < batch; ++b) ggmlopt_add_bias_rows_f32(1, n, y + b * y_stride, bias);
}

/* t[0..n) = x A[:, k0..k0+n) for n <= 8 columns of A (ncols, rank): eight sums
 * in registers, each over the input in order */
static void adapter_columns(const float *restrict x, int64_t ncols, const float *restrict a,
                            int64_t rank, int64_t k0, int64_t n, float *restrict t) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (n == 8) {
        for (int64_t i = 0; i < ncols; ++i) {
            const float xi = x[i];
            const float *ai = a + i * rank + k0;
            for (int k = 0; k < 8; ++k) acc[k] += xi * ai[k];
        }
    } else {
        for (int64_t i = 0; i < ncols; ++i)
            for (int64_t k = 0; k < n; ++k) acc[k] += x[i] * a[i * rank + k0 + k];
    }
    for (int64_t k = 0; k < n; ++k) t[k] = acc[k];
}

/* y (batch rows of y_stride) += scale * (x A) B of w's adapter, if any: two
 * products of rank columns, small beside the weight's, in float sums (x A's
 * over the input in order, then B's rows added into y one after another) */
static void add_adapter(const ggmlopt_block_weight *w, int64_t batch, int64_t ncols,
                        const float *x, float *y, int64_t y_stride, float *t) {
    if (w->lora_a == NULL) return;
    const int64_t r = w->rank;
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t k0 = 0; k0 < r; k0 += 8)
            adapter_columns(x + b * ncols, ncols, w->lora_a, r, k0, r - k0 < 8 ? r - k0 : 8,
                            t + k0);
        float *restrict yb = y + b * y_stride;
        for (int64_t k = 0; k < r; ++k) {
            const float tk = t[k] * w->lora_scale;
            const float *restrict bk = w->lora_b + k * w->lora_b_stride;
            for (int64_t j = 0; j < w->nout; ++j) yb[j] += tk * bk[j];
        }
    }
}

/* the products of one input (batch, ncols) by up to three weights, biases and
 * adapters after */
static void products(const ggmlopt_llama_block *blk, int n, const ggmlopt_block_weight *const *w,
                     float *const *y, const int64_t *y_stride, int64_t batch, int64_t ncols,
                     const float *x, const block_work *work) {
    ggmlopt_qproduct kept[3];            /* weights in their file's types */
    ggmlopt_columns_product linear[3];   /* Linear's float32 ones */
    int nk = 0, nl = 0;
    for (int m = 0; m < n; ++m) {
        if (w[m]->columns_ld != 0) {
            ggmlopt_columns_product *p = &linear[nl++];
            p->nout = w[m]->nout;
            p->w = (const float *)w[m]->w;
            p->ld = w[m]->columns_ld;
            p->y = y[m];
            p->y_stride = y_stride[m];
        } else {
            ggmlopt_qproduct *p = &kept[nk++];
            p->type = w[m]->type;
            p->nout = w[m]->nout;
            p->w = w[m]->w;
            p->y = y[m];
            p->y_stride = y_stride[m];
        }
    }
    if (nk > 0)
        ggmlopt_quant_matmul_many(nk, kept, batch, ncols, x, ncols, blk->q8, work->xqs, work->xd,
                                  work->xsum);
    if (nl > 0) ggmlopt_matmul_columns_many(nl, linear, batch, ncols, x, ncols, work->partials);
    for (int m = 0; m < n; ++m) {
        add_bias(w[m]->bias, batch, w[m]->nout, y[m], y_stride[m]);
        add_adapter(w[m], batch, ncols, x, y[m], y_stride[m], work->lora_t);
    }
}

int ggmlopt_decode_block_f32(const ggmlopt_llama_block *blk, int64_t batch, int64_t pos,
                             float *x, float *cache_k, float *cache_v, int64_t max_len,
                             const float *cos, const float *sin, void *work_area) {
    if (ggmlopt_decode_block_work_size(blk, batch, max_len) < 0) return -1;
    if (pos < 0 || pos >= max_len) return -2;
    if (batch == 0) return 0;
    const block_work w = work_layout(blk, batch, max_len, (char *)work_area);
    const int64_t dim = blk->dim, hd = blk->head_dim, ffn = blk->ffn_dim;
    const int64_t nq = blk->n_heads * hd, kv = blk->n_kv_heads * hd, item = max_len * kv;
    float *k_new = cache_k + pos * kv, *v_new = cache_v + pos * kv;

    /* attention: the new token's q, and its k and v straight into the cache */
    ggmlopt_rmsnorm_f32(batch, dim, x, blk->attn_norm, blk->eps, w.normed, w.rstd);
    {
        const ggmlopt_block_weight *ws[3] = {&blk->q, &blk->k, &blk->v};
        float *ys[3] = {w.q, k_new, v_new};
        const int64_t strides[3] = {nq, item, item};
        products(blk, 3, ws, ys, strides, batch, dim, w.normed, &w);
    }
    if (blk->q_norm != NULL) {
        ggmlopt_rmsnorm_f32(batch * blk->n_heads, hd, w.q, blk->q_norm, blk->eps, w.q, w.rstd);
        for (int64_t b = 0; b < batch; ++b)
            ggmlopt_rmsnorm_f32(blk->n_kv_heads, hd, k_new + b * item, blk->k_norm, blk->eps,
                                k_new + b * item, w.rstd);
    }
    if (cos != NULL) {
        ggmlopt_rope_f32(batch, 1, pos, blk->n_heads, hd, w.q, nq, w.q, nq, cos, sin, 0);
        ggmlopt_rope_f32(batch, 1, pos, blk->n_kv_heads, hd, k_new, item, k_new, item, cos, sin,
                         0);
    }
    const int64_t first = blk->window > 0 && pos + 1 > blk->window ? pos + 1 - blk->window : 0;
    ggmlopt_attention_decode_f32(batch, blk->n_heads, blk->n_kv_heads, hd, pos + 1 - first, w.q,
                                 cache_k + first * kv, cache_v + first * kv, item, w.attended,
                                 w.scores, 1.0f / sqrtf((float)hd));
    {
        const ggmlopt_block_weight *ws[1] = {&blk->o};
        float *ys[1] = {w.out};
        const int64_t strides[1] = {dim};
        products(blk, 1, ws, ys, strides, batch, nq, w.attended, &w);
    }
    ggmlopt_axpy_f32(batch * dim, 1.0f, w.out, x);

    /* the MLP */
    ggmlopt_rmsnorm_f32(batch, dim, x, blk->ffn_norm, blk->eps, w.normed, w.rstd);
    {
        const ggmlopt_block_weight *ws[2] = {&blk->gate, &blk->up};
        float *ys[2] = {w.gate, w.up};
        const int64_t strides[2] = {ffn, ffn};
        products(blk, 2, ws, ys, strides, batch, dim, w.normed, &w);
    }
    ggmlopt_swiglu_f32(batch * ffn, w.gate, w.up, w.gate);
    {
        const ggmlopt_block_weight *ws[1] = {&blk->down};
        float *ys[1] = {w.out};
        const int64_t strides[1] = {dim};
        products(blk, 1, ws, ys, strides, batch, ffn, w.gate, &w);
    }
    ggmlopt_axpy_f32(batch * dim, 1.0f, w.out, x);
    return 0;
}
