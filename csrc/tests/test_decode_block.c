/*
 * A decode step of a Llama-layout block in one call (decode_block.c), over
 * weights kept in their file's types and Linear float32 ones, and the products
 * of one input by several weights in one job it runs on
 * (ggmlopt_quant_matmul_many): each the same bits as the public kernels called
 * one by one, as the layers call them (each of those is checked against a
 * float64 reference in its own test; a LoRA adapter's two small products in
 * the float sums the header gives), on every path this CPU runs and on 1 and
 * 2 threads; the cache rows after the new one, and everything past each
 * output, never written; the refused calls write nothing.
 */
#include "harness.h"


static int has_q8_dot(int type) {
    return type == 2 || type == 3 || type == 6 || type == 7 || type == 8 ||
           (type >= 10 && type <= 14) || type == 20 || type == 23;
}

/* f16 bits of a finite v (round toward zero: any finite weight will do) */
static uint16_t f16_bits(float v) {
    const uint16_t sign = v < 0 ? 0x8000 : 0;
    double a = fabs((double)v);
    if (a < ldexp(1.0, -14)) return sign;
    int e;
    const double m = frexp(a, &e);   /* a = m 2^e, m in [0.5, 1) */
    return (uint16_t)(sign | (uint16_t)((e + 14) << 10) | (uint16_t)((m * 2.0 - 1.0) * 1024.0));
}

/* nout rows of ncols values of `type` with weights of about +-scale: random
 * quants under a finite scale for Q8_0 and Q4_0, the K types through their
 * quantizer, F16 words */
static uint8_t *weight(int type, int64_t nout, int64_t ncols, float scale) {
    const int64_t rb = ggmlopt_quant_row_bytes(type, ncols);
    uint8_t *w = th_alloc(1, nout * rb, 1);
    if (type == 12 || type == 14) {
        float *f = th_rand_f32(nout * ncols, 0, -scale, scale);
        ggmlopt_quantize_rows_f32(type, nout, ncols, f, w);
        return w;
    }
    if (type == 1) {
        for (int64_t i = 0; i < nout * ncols; ++i) {
            const uint16_t h = f16_bits(th_uniform(-scale, scale));
            memcpy(w + 2 * i, &h, 2);
        }
        return w;
    }
    const int64_t bytes = type == 8 ? 34 : 18;   /* Q8_0, Q4_0: an f16 scale, then quants */
    const uint16_t d = f16_bits(scale / (type == 8 ? 127.0f : 8.0f));
    for (int64_t b = 0; b < nout * rb / bytes; ++b) {
        memcpy(w + b * bytes, &d, 2);
        for (int64_t i = 2; i < bytes; ++i) w[b * bytes + i] = (uint8_t)(th_next() >> 56);
    }
    return w;
}

static void expect_same(const float *got, const float *want, int64_t n, const char *ctx) {
    th_miss m = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i) th_expect_bits(&m, "bits", i, got[i], want[i]);
    th_report(&m, ctx);
}

/* y = x times one weight, as a layer's product calls it */
static void one_product(int type, int q8, int64_t nx, int64_t ncols, const float *x,
                        int64_t nout, const uint8_t *w, float *y, int64_t y_stride) {
    int8_t *xq = malloc((size_t)(ncols + 32));
    float *xd = malloc((size_t)(ncols / 32 + 1) * 4), *xs = malloc((size_t)(ncols / 32 + 1) * 4);
    if (q8 && has_q8_dot(type))
        ggmlopt_quant_matmul_q8(type, nx, ncols, x, ncols, nout, w, y, y_stride, xq, xd, xs);
    else
        ggmlopt_quant_matmul_f32(type, nx, ncols, x, ncols, nout, w, y, y_stride);
    free(xq);
    free(xd);
    free(xs);
}

static void many_products(const char *path, int threads) {
    /* a Q4_K_M file's mix: K types, a 32-value type, one without integer products */
    static const int types[] = {12, 2, 1, 14, 8};
    static const int64_t nouts[] = {192, 64, 80, 17, 48};
    const int n = 5;
    const int64_t ncols = 512;
    for (int64_t nx = 1; nx <= 9; nx += 4) {
        const uint8_t *w[5];
        for (int m = 0; m < n; ++m) w[m] = weight(types[m], nouts[m], ncols, 0.1f);
        const float *x = th_rand_f32(nx * ncols, 1, -2.0f, 2.0f);
        for (int q8 = 0; q8 <= 1; ++q8) {
            ggmlopt_qproduct p[5];
            for (int m = 0; m < n; ++m) {
                p[m].type = types[m];
                p[m].nout = nouts[m];
                p[m].w = w[m];
                p[m].y_stride = nouts[m] + 3;
                p[m].y = th_sentinels(nx * p[m].y_stride);
            }
            int8_t *xq = th_alloc(1, nx * (ncols + 32), 0);
            float *xd = th_alloc(4, nx * ncols / 32, 0), *xs = th_alloc(4, nx * ncols / 32, 0);
            const int rc = ggmlopt_quant_matmul_many(n, p, nx, ncols, x, ncols, q8, xq, xd, xs);
            char ctx[128];
            snprintf(ctx, sizeof ctx, "quant_matmul_many nx=%lld q8=%d [%s, %d threads]",
                     (long long)nx, q8, path, threads);
            th_check(rc == 0, "%s: return code %d", ctx, rc);
            for (int m = 0; m < n; ++m) {
                float *want = th_sentinels(nx * p[m].y_stride);
                one_product(types[m], q8, nx, ncols, x, nouts[m], w[m], want, p[m].y_stride);
                char c2[160];
                snprintf(c2, sizeof c2, "%s: product %d (type %d) vs alone", ctx, m, types[m]);
                expect_same(p[m].y, want, nx * p[m].y_stride, c2);
            }
        }
        th_release_all();
    }
}

static void many_refused(void) {
    const int64_t ncols = 64;
    const uint8_t *w = weight(8, 4, ncols, 0.1f);
    const float *x = th_rand_f32(ncols, 0, -1.0f, 1.0f);
    float *y = th_sentinels(8);
    ggmlopt_qproduct p[2] = {{8, 4, w, y, 4}, {12, 4, w, y + 4, 4}};   /* Q4_K: 64 is no block */
    int8_t xq[96];
    float xd[2], xs[2];
    th_check(ggmlopt_quant_matmul_many(2, p, 1, ncols, x, ncols, 1, xq, xd, xs) == -1,
             "quant_matmul_many: a width of part of a Q4_K block not refused");
    th_check(ggmlopt_quant_matmul_many(GGMLOPT_QPRODUCTS_MAX + 1, p, 1, ncols, x, ncols, 0, NULL,
                                       NULL, NULL) == -3 &&
                 ggmlopt_quant_matmul_many(-1, p, 1, ncols, x, ncols, 0, NULL, NULL, NULL) == -3,
             "quant_matmul_many: a count out of range not refused");
    float *none = th_sentinels(8);
    expect_same(y, none, 8, "quant_matmul_many: refused calls write nothing");
    th_check(ggmlopt_quant_matmul_many(0, p, 1, ncols, x, ncols, 0, NULL, NULL, NULL) == 0,
             "quant_matmul_many: no products is a call that does nothing");
}

/* ---- the block ---------------------------------------------------------------- */

typedef struct {
    ggmlopt_llama_block blk;
    int64_t batch, max_len, pos;
    int rope;
    float *cos, *sin;
} block_case;

/* y += scale * (x A) B, the sums in the order the header gives: x A's sums over
 * the input in order, then each of the rank terms added into y in order */
static void ref_adapter(const ggmlopt_block_weight *w, int64_t batch, int64_t ncols,
                        const float *x, float *y, int64_t y_stride) {
    if (w->lora_a == NULL) return;
    for (int64_t b = 0; b < batch; ++b) {
        float t[16];
        for (int64_t k = 0; k < w->rank; ++k) {
            t[k] = 0.0f;
            for (int64_t i = 0; i < ncols; ++i)
                t[k] += x[b * ncols + i] * w->lora_a[i * w->rank + k];
        }
        for (int64_t k = 0; k < w->rank; ++k) {
            const float tk = t[k] * w->lora_scale;
            for (int64_t j = 0; j < w->nout; ++j)
                y[b * y_stride + j] += tk * w->lora_b[k * w->lora_b_stride + j];
        }
    }
}

/* y = x times a block's weight as the layer's product calls it: a kept type's
 * product, or a Linear's by columns */
static void weight_product(const ggmlopt_block_weight *w, int q8, int64_t nx, int64_t ncols,
                           const float *x, float *y, int64_t y_stride) {
    if (w->columns_ld != 0)
        ggmlopt_matmul_columns_f32(nx, ncols, x, ncols, w->nout, (const float *)w->w,
                                   w->columns_ld, y, y_stride, NULL);
    else
        one_product(w->type, q8, nx, ncols, x, w->nout, w->w, y, y_stride);
}

/* linear: q, v, gate and down are Linear float32 (in, out) weights, their rows
 * wider than the product (a fused one's column range), beside kept types */
static void make_block(block_case *c, int q8, int qk_norm, int64_t window, int rope,
                       int adapters, int linear) {
    ggmlopt_llama_block *b = &c->blk;
    memset(b, 0, sizeof *b);
    b->dim = 256;
    b->n_heads = 4;
    b->n_kv_heads = 2;
    b->head_dim = 64;
    b->ffn_dim = 512;
    b->eps = 1e-5f;
    b->attn_norm = th_rand_f32(b->dim, 0, 0.5f, 1.5f);
    b->ffn_norm = th_rand_f32(b->dim, 1, 0.5f, 1.5f);
    if (qk_norm) {
        b->q_norm = th_rand_f32(b->head_dim, 0, 0.5f, 1.5f);
        b->k_norm = th_rand_f32(b->head_dim, 1, 0.5f, 1.5f);
    }
    const int64_t nq = b->n_heads * b->head_dim, kv = b->n_kv_heads * b->head_dim;
    ggmlopt_block_weight *ws[7] = {&b->q, &b->k, &b->v, &b->o, &b->gate, &b->up, &b->down};
    static const int types[7] = {12, 8, 14, 2, 12, 1, 14};
    const int64_t nouts[7] = {nq, kv, kv, b->dim, b->ffn_dim, b->ffn_dim, b->dim};
    const int64_t ins[7] = {b->dim, b->dim, b->dim, nq, b->dim, b->dim, b->ffn_dim};
    for (int m = 0; m < 7; ++m) {
        ws[m]->type = types[m];
        ws[m]->nout = nouts[m];
        ws[m]->w = weight(types[m], nouts[m], ins[m], 0.08f);
        if (linear && (m == 0 || m == 2 || m == 4 || m == 6)) {
            ws[m]->type = 0;
            ws[m]->columns_ld = nouts[m] + 3;
            ws[m]->w = (const uint8_t *)th_rand_f32(ins[m] * ws[m]->columns_ld, 1, -0.08f, 0.08f);
        }
        ws[m]->bias = m < 3 ? th_rand_f32(nouts[m], 0, -0.1f, 0.1f) : NULL;   /* Qwen2's */
        if (adapters && m != 1 && m != 4) {   /* all but k and gate; B a column range */
            static const int64_t ranks[7] = {8, 0, 11, 1, 0, 16, 5};   /* whole eights, and not */
            ws[m]->rank = ranks[m];
            ws[m]->lora_b_stride = nouts[m] + 5;
            ws[m]->lora_a = th_rand_f32(ins[m] * ws[m]->rank, 0, -0.1f, 0.1f);
            ws[m]->lora_b = th_rand_f32(ws[m]->rank * ws[m]->lora_b_stride, 1, -0.1f, 0.1f);
            ws[m]->lora_scale = 1.5f;
        }
    }
    b->window = window;
    b->q8 = q8;
    c->rope = rope;
    const int64_t half = b->head_dim / 2;
    c->cos = th_alloc(4, c->max_len * half, 0);
    c->sin = th_alloc(4, c->max_len * half, 0);
    for (int64_t p = 0; p < c->max_len; ++p)
        for (int64_t i = 0; i < half; ++i) {
            const double a = p * pow(10000.0, -2.0 * i / (double)b->head_dim);
            c->cos[p * half + i] = (float)cos(a);
            c->sin[p * half + i] = (float)sin(a);
        }
}

/* The step as the layers take it, call by call (LlamaDecoderLayer.decode:
 * norm, three products, biases, q/k norms, RoPE, the cache's row, attention,
 * o, the sum, norm, gate and up, SwiGLU, down, the sum). */
static void step_call_by_call(const block_case *c, float *x, float *ck, float *cv) {
    const ggmlopt_llama_block *b = &c->blk;
    const int64_t B = c->batch, dim = b->dim, hd = b->head_dim, ffn = b->ffn_dim;
    const int64_t nq = b->n_heads * hd, kv = b->n_kv_heads * hd, item = c->max_len * kv;
    float *n1 = th_alloc(4, B * dim, 0), *rstd = th_alloc(4, B * b->n_heads, 0);
    float *q = th_alloc(4, B * nq, 0), *k = th_alloc(4, B * kv, 0), *v = th_alloc(4, B * kv, 0);
    float *att = th_alloc(4, B * nq, 0), *o = th_alloc(4, B * dim, 0);
    float *g = th_alloc(4, B * ffn, 0), *u = th_alloc(4, B * ffn, 0);
    float *scores = th_alloc(4, b->n_heads * c->max_len, 0);
    ggmlopt_rmsnorm_f32(B, dim, x, b->attn_norm, b->eps, n1, rstd);
    weight_product(&b->q, b->q8, B, dim, n1, q, nq);
    weight_product(&b->k, b->q8, B, dim, n1, k, kv);
    weight_product(&b->v, b->q8, B, dim, n1, v, kv);
    ggmlopt_add_bias_rows_f32(B, nq, q, b->q.bias);
    ref_adapter(&b->q, B, dim, n1, q, nq);
    ggmlopt_add_bias_rows_f32(B, kv, k, b->k.bias);
    ref_adapter(&b->k, B, dim, n1, k, kv);
    ggmlopt_add_bias_rows_f32(B, kv, v, b->v.bias);
    ref_adapter(&b->v, B, dim, n1, v, kv);
    if (b->q_norm) {
        ggmlopt_rmsnorm_f32(B * b->n_heads, hd, q, b->q_norm, b->eps, q, rstd);
        ggmlopt_rmsnorm_f32(B * b->n_kv_heads, hd, k, b->k_norm, b->eps, k, rstd);
    }
    if (c->rope) {
        ggmlopt_rope_f32(B, 1, c->pos, b->n_heads, hd, q, nq, q, nq, c->cos, c->sin, 0);
        ggmlopt_rope_f32(B, 1, c->pos, b->n_kv_heads, hd, k, kv, k, kv, c->cos, c->sin, 0);
    }
    for (int64_t i = 0; i < B; ++i) {
        memcpy(ck + i * item + c->pos * kv, k + i * kv, (size_t)kv * 4);
        memcpy(cv + i * item + c->pos * kv, v + i * kv, (size_t)kv * 4);
    }
    const int64_t first =
        b->window > 0 && c->pos + 1 > b->window ? c->pos + 1 - b->window : 0;
    ggmlopt_attention_decode_f32(B, b->n_heads, b->n_kv_heads, hd, c->pos + 1 - first, q,
                                 ck + first * kv, cv + first * kv, item, att, scores,
                                 1.0f / sqrtf((float)hd));
    weight_product(&b->o, b->q8, B, nq, att, o, dim);
    ref_adapter(&b->o, B, nq, att, o, dim);
    for (int64_t i = 0; i < B * dim; ++i) x[i] = x[i] + o[i];
    ggmlopt_rmsnorm_f32(B, dim, x, b->ffn_norm, b->eps, n1, rstd);
    weight_product(&b->gate, b->q8, B, dim, n1, g, ffn);
    ref_adapter(&b->gate, B, dim, n1, g, ffn);
    weight_product(&b->up, b->q8, B, dim, n1, u, ffn);
    ref_adapter(&b->up, B, dim, n1, u, ffn);
    ggmlopt_swiglu_f32(B * ffn, g, u, g);
    weight_product(&b->down, b->q8, B, ffn, g, o, dim);
    ref_adapter(&b->down, B, ffn, g, o, dim);
    for (int64_t i = 0; i < B * dim; ++i) x[i] = x[i] + o[i];
}

static void one_block(const char *path, int threads, int q8, int qk_norm, int64_t window,
                      int rope, int64_t batch, int adapters, int linear) {
    block_case c;
    c.batch = batch;
    c.max_len = 9;
    c.pos = 6;
    make_block(&c, q8, qk_norm, window, rope, adapters, linear);
    const ggmlopt_llama_block *b = &c.blk;
    const int64_t kv = b->n_kv_heads * b->head_dim, item = c.max_len * kv;
    float *x = th_rand_f32(batch * b->dim, 1, -2.0f, 2.0f);
    float *ck = th_sentinels(batch * item), *cv = th_sentinels(batch * item);
    for (int64_t i = 0; i < batch; ++i)   /* the earlier positions' keys and values */
        for (int64_t j = 0; j < c.pos * kv; ++j) {
            ck[i * item + j] = th_uniform(-1.0f, 1.0f);
            cv[i * item + j] = th_uniform(-1.0f, 1.0f);
        }
    float *x2 = th_dup(x, 4, batch * b->dim);
    float *ck2 = th_dup(ck, 4, batch * item), *cv2 = th_dup(cv, 4, batch * item);
    const int64_t bytes = ggmlopt_decode_block_work_size(b, batch, c.max_len);
    char ctx[160];
    snprintf(ctx, sizeof ctx, "decode_block q8=%d qk_norm=%d window=%lld rope=%d batch=%lld "
             "adapters=%d linear=%d [%s, %d threads]", q8, qk_norm, (long long)window, rope,
             (long long)batch, adapters, linear, path, threads);
    th_check(bytes > 0, "%s: work size %lld", ctx, (long long)bytes);
    void *work = th_alloc(64, (bytes + 63) / 64, 0);
    const int rc = ggmlopt_decode_block_f32(b, batch, c.pos, x, ck, cv, c.max_len,
                                            rope ? c.cos : NULL, rope ? c.sin : NULL, work);
    th_check(rc == 0, "%s: return code %d", ctx, rc);
    step_call_by_call(&c, x2, ck2, cv2);
    char c2[200];
    snprintf(c2, sizeof c2, "%s: output vs call by call", ctx);
    expect_same(x, x2, batch * b->dim, c2);
    snprintf(c2, sizeof c2, "%s: keys (the later rows untouched)", ctx);
    expect_same(ck, ck2, batch * item, c2);
    snprintf(c2, sizeof c2, "%s: values", ctx);
    expect_same(cv, cv2, batch * item, c2);
    th_miss m = TH_MISS_INIT;
    for (int64_t i = 0; i < batch * b->dim; ++i)
        if (!isfinite(x[i])) th_expect_bits(&m, "a finite output", i, x[i], 0.0f);
    th_report(&m, c2);
    th_release_all();
}

static void block_refused(void) {
    block_case c;
    c.batch = 1;
    c.max_len = 4;
    c.pos = 0;
    make_block(&c, 0, 0, 0, 1, 0, 0);
    const ggmlopt_llama_block good = c.blk;
    float *x = th_rand_f32(good.dim, 0, -1.0f, 1.0f), *x0 = th_dup(x, 4, good.dim);
    const int64_t item = c.max_len * good.n_kv_heads * good.head_dim;
    float *ck = th_sentinels(item), *cv = th_sentinels(item), *none = th_sentinels(item);
    void *work = th_alloc(64, ggmlopt_decode_block_work_size(&good, 1, c.max_len) / 64 + 1, 0);
    th_check(ggmlopt_decode_block_f32(&good, 1, 4, x, ck, cv, 4, c.cos, c.sin, work) == -2 &&
                 ggmlopt_decode_block_f32(&good, 1, -1, x, ck, cv, 4, c.cos, c.sin, work) == -2,
             "decode_block: a position outside the cache not refused");
    ggmlopt_llama_block bad[12];
    for (int i = 0; i < 12; ++i) bad[i] = good;
    bad[0].n_kv_heads = 3;             /* heads not a multiple of kv heads */
    bad[1].k.nout = 64;                /* k's rows are not the kv heads' width */
    bad[2].down.type = 99;             /* no type */
    bad[3].ffn_dim = 0;                /* no MLP width */
    bad[4].q_norm = good.attn_norm;    /* one per-head norm without the other */
    bad[5].ffn_norm = NULL;
    bad[6].gate.w = NULL;
    bad[7].window = -1;
    bad[8].v.lora_a = good.attn_norm;   /* an adapter without B */
    bad[8].v.rank = 1;
    bad[9].o.lora_a = bad[9].o.lora_b = good.attn_norm;   /* B's rows narrower than o's */
    bad[9].o.rank = 1;
    bad[9].o.lora_b_stride = good.dim - 1;
    bad[9].o.lora_scale = 1.0f;
    bad[10].up.columns_ld = good.ffn_dim - 1;   /* a Linear's rows narrower than up's */
    bad[10].up.type = 0;
    bad[11].up.columns_ld = good.ffn_dim;       /* a Linear's weight that is not float32 */
    bad[11].up.type = 8;
    for (int i = 0; i < 12; ++i) {
        th_check(ggmlopt_decode_block_work_size(&bad[i], 1, 4) == -1,
                 "decode_block_work_size: bad block %d not refused", i);
        th_check(ggmlopt_decode_block_f32(&bad[i], 1, 0, x, ck, cv, 4, c.cos, c.sin, work) == -1,
                 "decode_block: bad block %d not refused", i);
    }
    expect_same(x, x0, good.dim, "decode_block: refused calls leave x");
    expect_same(ck, none, item, "decode_block: refused calls write no key");
    expect_same(cv, none, item, "decode_block: refused calls write no value");
    th_check(ggmlopt_decode_block_f32(&good, 0, 0, x, ck, cv, 4, c.cos, c.sin, work) == 0,
             "decode_block: no sequences is a call that does nothing");
}

void test_decode_block_public(void) {
    const int threads_before = ggmlopt_get_num_threads();
    th_set_stage("decode block");
    th_seed(0xdec0de);
    for (int p = 0; p < ggmlopt_simd_count(); ++p) {
        if (!ggmlopt_simd_supported(p)) continue;
        const char *path = ggmlopt_simd_name(p);
        th_check(ggmlopt_simd_select(path) == 0, "select %s", path);
        for (int threads = 1; threads <= 2; ++threads) {
            ggmlopt_set_num_threads(threads);
            many_products(path, threads);
            for (int q8 = 0; q8 <= 1; ++q8) {
                one_block(path, threads, q8, 0, 0, 1, 1, 0, 0);
                one_block(path, threads, q8, 1, 0, 1, 3, 0, 0);  /* Qwen3's q/k norms, a batch */
                one_block(path, threads, q8, 0, 4, 1, 2, 0, 0);  /* a window shorter than pos */
                one_block(path, threads, q8, 0, 0, 0, 1, 0, 0);  /* SmolLM3's: no RoPE */
                one_block(path, threads, q8, 0, 0, 1, 2, 1, 0);  /* LoRA adapters */
                one_block(path, threads, q8, 0, 0, 1, 1, 0, 1);  /* Linear weights */
                one_block(path, threads, q8, 0, 0, 1, 3, 1, 1);  /* the same, adapters, a batch */
            }
            th_release_all();
        }
    }
    ggmlopt_simd_select(NULL);
    ggmlopt_set_num_threads(threads_before);
    many_refused();
    block_refused();
    th_release_all();
}
