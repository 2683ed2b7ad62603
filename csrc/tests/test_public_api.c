/*
 * The public, dispatched API of ggmlopt.h: the run-time surface (paths, pins,
 * threads), then every function on each path the CPU runs, with 1 and 2
 * threads, on sizes that cross the block and threading thresholds of
 * dispatch.c.  Results must match float64 references and be bitwise the same
 * whatever the number of threads.
 */
#include "harness.h"

void test_public_api(int64_t big);

#define RTOL_ROUND 5e-7
#define RTOL_EXP 1e-5
/* double sums over up to ~1e6 terms, added in a different order */
#define RTOL_SUM 1e-10

/* What one run of every function produced, to compare runs across threads. */
typedef struct {
    int64_t n, argmax_rows, ce_rows;
    float *adam_w, *adam_m, *adam_v, *sgd_w, *axpy_y, *scale_x, *fill_x, *ce_grad, *se_grad;
    float *u8_out, *f16_out;
    int32_t *argmax;
    double sum, sumsq, ce_loss, ce_loss_nograd, se_loss;
    int64_t count;
} api_out;

#define ARGMAX_COLS 7
#define CE_COLS 10

static void api_run(int64_t n, const char *tag, api_out *o) {
    char ctx[200];
    th_seed(0xa11ULL + (uint64_t)n);
    o->n = n;

    /* AdamW */
    float params[GGMLOPT_ADAMW_NPARAMS];
    th_adamw_params(params, 0.01f, 0.9f, 0.999f, 1e-8f, 0.01f, 5);
    float *w = th_rand_f32(n, 1, -1.0f, 1.0f), *g = th_rand_f32(n, 2, -1.0f, 1.0f);
    float *m = th_rand_f32(n, 3, -0.1f, 0.1f), *v = th_rand_f32(n, 0, 0.0f, 0.01f);
    const float *w0 = th_dup(w, 4, n), *g0 = th_dup(g, 4, n), *m0 = th_dup(m, 4, n);
    const float *v0 = th_dup(v, 4, n);
    ggmlopt_adamw_step_f32(n, w, g, m, v, params);
    th_miss miss = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i) {
        double want[3], scale[3];
        th_adamw_ref(params, w0[i], g0[i], m0[i], v0[i], want, scale);
        th_expect(&miss, "w", i, w[i], want[0], RTOL_ROUND * scale[0]);
        th_expect(&miss, "m", i, m[i], want[1], RTOL_ROUND * scale[1]);
        th_expect(&miss, "v", i, v[i], want[2], RTOL_ROUND * scale[2]);
    }
    snprintf(ctx, sizeof ctx, "ggmlopt_adamw_step_f32 %s n=%lld", tag, (long long)n);
    th_report(&miss, ctx);
    o->adam_w = w, o->adam_m = m, o->adam_v = v;

    /* SGD, axpy, scale, fill */
    const float alpha = 0.03f, wd = 0.1f, a = 0.37f;
    float *sw = th_dup(w0, 4, n);
    ggmlopt_sgd_step_f32(n, sw, g0, alpha, wd);
    float *y = th_dup(m0, 4, n);
    ggmlopt_axpy_f32(n, a, g0, y);
    float *sx = th_dup(w0, 4, n);
    ggmlopt_scale_f32(n, a, sx);
    float *fx = th_dup(w0, 4, n);
    ggmlopt_fill_f32(n, -2.5f, fx);
    th_miss elem = TH_MISS_INIT;
    const double keep = 1.0 - (double)alpha * wd;
    for (int64_t i = 0; i < n; ++i) {
        const double ws = w0[i] * keep - (double)alpha * g0[i];
        th_expect(&elem, "sgd w", i, sw[i], ws,
                  RTOL_ROUND * (fabs(w0[i] * keep) + fabs((double)alpha * g0[i]) + fabs(ws)));
        const double ya = m0[i] + (double)a * g0[i];
        th_expect(&elem, "axpy y", i, y[i], ya,
                  RTOL_ROUND * (fabs(m0[i]) + fabs((double)a * g0[i]) + fabs(ya)));
        th_expect_bits(&elem, "scale x", i, sx[i], (float)((double)w0[i] * a));
        th_expect_bits(&elem, "fill x", i, fx[i], -2.5f);
    }
    snprintf(ctx, sizeof ctx, "ggmlopt_sgd_step/axpy/scale/fill_f32 %s n=%lld", tag, (long long)n);
    th_report(&elem, ctx);
    o->sgd_w = sw, o->axpy_y = y, o->scale_x = sx, o->fill_x = fx;

    /* sums */
    float *x = th_rand_f32(n, 1, -1.0f, 4.0f);
    double sum = 0.0, sumsq = 0.0, sabs = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        sum += x[i];
        sumsq += (double)x[i] * x[i];
        sabs += fabs(x[i]);
    }
    o->sum = ggmlopt_sum_f32(n, x);
    o->sumsq = ggmlopt_sumsq_f32(n, x);
    th_check(th_near(o->sum, sum, RTOL_SUM * sabs) && th_near(o->sumsq, sumsq, RTOL_SUM * sumsq),
             "ggmlopt_sum_f32/sumsq_f32 %s n=%lld: %.17g %.17g, want %.17g %.17g", tag,
             (long long)n, o->sum, o->sumsq, sum, sumsq);

    /* argmax over rows of 7, ties everywhere, every fifth row all -inf */
    const int64_t arows = (n + ARGMAX_COLS - 1) / ARGMAX_COLS;
    float *ax = (float *)th_alloc(4, arows * ARGMAX_COLS, 2);
    for (int64_t i = 0; i < arows * ARGMAX_COLS; ++i)
        ax[i] = (i / ARGMAX_COLS) % 5 == 4 ? -INFINITY : (float)th_randint(0, 4);
    int32_t *amax = (int32_t *)th_alloc(4, arows, 1);
    ggmlopt_argmax_rows_f32(arows, ARGMAX_COLS, ax, amax);
    int64_t bad_row = -1;
    for (int64_t r = 0; r < arows && bad_row < 0; ++r)
        if (amax[r] != th_argmax_ref(ARGMAX_COLS, ax + r * ARGMAX_COLS)) bad_row = r;
    th_check(bad_row < 0, "ggmlopt_argmax_rows_f32 %s nrows=%lld ncols=%d: row %lld gives %d, want %d",
             tag, (long long)arows, ARGMAX_COLS, (long long)bad_row, bad_row < 0 ? 0 : amax[bad_row],
             bad_row < 0 ? 0 : th_argmax_ref(ARGMAX_COLS, ax + bad_row * ARGMAX_COLS));
    o->argmax = amax, o->argmax_rows = arows;

    /* count_equal */
    int32_t *ca = (int32_t *)th_alloc(4, n, 3), *cb = (int32_t *)th_alloc(4, n, 0);
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) {
        ca[i] = (int32_t)th_randint(0, 3);
        cb[i] = (int32_t)th_randint(0, 3);
        count += ca[i] == cb[i];
    }
    o->count = ggmlopt_count_equal_i32(n, ca, cb);
    th_check(o->count == count, "ggmlopt_count_equal_i32 %s n=%lld: %lld, want %lld", tag,
             (long long)n, (long long)o->count, (long long)count);

    /* cross-entropy: mean over rows of 10 one-hot classes */
    const int64_t crows = (n + CE_COLS - 1) / CE_COLS, ctotal = crows * CE_COLS;
    const float gs = 1.5f;
    float *logits = th_rand_f32(ctotal, 1, -4.0f, 4.0f);
    float *labels = (float *)th_alloc(4, ctotal, 2);
    for (int64_t r = 0; r < crows; ++r) {
        const int64_t hot = th_randint(0, CE_COLS);
        for (int64_t c = 0; c < CE_COLS; ++c) labels[r * CE_COLS + c] = c == hot ? 1.0f : 0.0f;
    }
    float *cgrad = th_rand_f32(ctotal, 3, -9.0f, 9.0f);
    double *gwant = (double *)th_alloc(8, ctotal, 0), *gscale = (double *)th_alloc(8, ctotal, 0);
    o->ce_loss = ggmlopt_cross_entropy_f32(crows, CE_COLS, logits, labels, cgrad, gs);
    o->ce_loss_nograd = ggmlopt_cross_entropy_f32(crows, CE_COLS, logits, labels, NULL, gs);
    double ce = 0.0, ce_scale = 0.0;
    for (int64_t r = 0; r < crows; ++r) {
        double s;
        ce += th_cross_entropy_row_ref(CE_COLS, logits + r * CE_COLS, labels + r * CE_COLS,
                                       (double)gs / (double)crows, &s, gwant + r * CE_COLS,
                                       gscale + r * CE_COLS);
        ce_scale += s;
    }
    if (crows > 0) ce /= (double)crows, ce_scale /= (double)crows;
    th_miss cmiss = TH_MISS_INIT;
    th_expect(&cmiss, "loss", 0, o->ce_loss, ce, RTOL_EXP * ce_scale + 1e-30);
    th_expect(&cmiss, "loss without grad", 0, o->ce_loss_nograd, ce, RTOL_EXP * ce_scale + 1e-30);
    for (int64_t i = 0; i < ctotal; ++i)
        th_expect(&cmiss, "grad", i, cgrad[i], gwant[i], RTOL_EXP * gscale[i] + 1e-37);
    snprintf(ctx, sizeof ctx, "ggmlopt_cross_entropy_f32 %s nrows=%lld ncols=%d", tag,
             (long long)crows, CE_COLS);
    th_report(&cmiss, ctx);
    o->ce_grad = cgrad, o->ce_rows = crows;

    /* the same rows as class indices: the one-hot call's loss and gradient */
    int32_t *classes = (int32_t *)th_alloc(4, crows, 1);
    for (int64_t r = 0; r < crows; ++r)
        for (int32_t c = 0; c < CE_COLS; ++c)
            if (labels[r * CE_COLS + c] != 0.0f) classes[r] = c;
    float *igrad = th_rand_f32(ctotal, 2, -9.0f, 9.0f);
    const double iloss = ggmlopt_cross_entropy_index_f32(crows, CE_COLS, logits, classes, igrad, gs);
    th_miss imiss = TH_MISS_INIT;
    th_expect(&imiss, "loss vs one-hot", 0, iloss, o->ce_loss, RTOL_EXP * ce_scale + 1e-30);
    for (int64_t i = 0; i < ctotal; ++i)
        th_expect(&imiss, "grad vs one-hot", i, igrad[i], cgrad[i], RTOL_EXP * gscale[i] + 1e-37);
    snprintf(ctx, sizeof ctx, "ggmlopt_cross_entropy_index_f32 %s nrows=%lld ncols=%d", tag,
             (long long)crows, CE_COLS);
    th_report(&imiss, ctx);

    /* and with the gradient as bf16 bits: the float32 gradient rounded, its argmax
     * and loss the argmax call's */
    if (crows > 0) {
        uint16_t *g16 = (uint16_t *)th_alloc(2, ctotal, 1), *want16 = (uint16_t *)th_alloc(2, ctotal, 0);
        int32_t *pred = (int32_t *)th_alloc(4, crows, 0), *pred16 = (int32_t *)th_alloc(4, crows, 0);
        float *agrad = th_rand_f32(ctotal, 2, -9.0f, 9.0f);
        const double aloss = ggmlopt_cross_entropy_index_argmax_f32(crows, CE_COLS, logits, classes,
                                                                    agrad, gs, pred);
        ggmlopt_convert_f32_bf16(ctotal, agrad, want16);
        const double loss16 = ggmlopt_cross_entropy_index_g16_f32(crows, CE_COLS, logits, classes,
                                                                  g16, gs, pred16);
        th_check(loss16 == aloss, "ggmlopt_cross_entropy_index_g16_f32 %s: loss %.17g, the "
                 "float32 call's %.17g", tag, loss16, aloss);
        th_miss bmiss = TH_MISS_INIT;
        for (int64_t i = 0; i < ctotal; ++i)
            th_expect_bits(&bmiss, "bf16 grad", i, (float)g16[i], (float)want16[i]);
        for (int64_t r = 0; r < crows; ++r)
            th_expect_bits(&bmiss, "argmax", r, (float)pred16[r], (float)pred[r]);
        snprintf(ctx, sizeof ctx, "ggmlopt_cross_entropy_index_g16_f32 %s nrows=%lld ncols=%d", tag,
                 (long long)crows, CE_COLS);
        th_report(&bmiss, ctx);
    }

    /* squared error */
    float *sgrad = th_rand_f32(n, 2, -9.0f, 9.0f);
    o->se_loss = ggmlopt_squared_error_f32(n, w0, g0, sgrad, 0.25f);
    double se = 0.0;
    th_miss smiss = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i) {
        const double d = (double)w0[i] - g0[i];
        se += d * d;
        th_expect(&smiss, "grad", i, sgrad[i], 0.5 * d, RTOL_ROUND * fabs(0.5 * d));
    }
    th_expect(&smiss, "loss", 0, o->se_loss, se, 3e-7 * se + 1e-300);
    snprintf(ctx, sizeof ctx, "ggmlopt_squared_error_f32 %s n=%lld", tag, (long long)n);
    th_report(&smiss, ctx);
    o->se_grad = sgrad;

    /* conversions */
    uint8_t *u8 = (uint8_t *)th_alloc(1, n, 1);
    uint16_t *f16 = (uint16_t *)th_alloc(2, n, 3);
    for (int64_t i = 0; i < n; ++i) {
        u8[i] = (uint8_t)th_next();
        f16[i] = (uint16_t)th_next();
    }
    float *u8_out = (float *)th_alloc(4, n, 2), *f16_out = (float *)th_alloc(4, n, 1);
    ggmlopt_convert_u8_f32(n, u8, u8_out, 1.0f / 255.0f);
    ggmlopt_convert_f16_f32(n, f16, f16_out, 0.5f);
    th_miss cv = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i) {
        th_expect_bits(&cv, "u8", i, u8_out[i], (float)(u8[i] * (double)(1.0f / 255.0f)));
        th_expect_bits(&cv, "f16", i, f16_out[i], (float)(th_f16_to_double(f16[i]) * 0.5));
    }
    snprintf(ctx, sizeof ctx, "ggmlopt_convert_u8/f16_f32 %s n=%lld", tag, (long long)n);
    th_report(&cv, ctx);
    o->u8_out = u8_out, o->f16_out = f16_out;
}

static int same_bits(const void *a, const void *b, int64_t n, size_t elem) {
    return n <= 0 || memcmp(a, b, (size_t)n * elem) == 0;
}
static int same_double(double a, double b) { return memcmp(&a, &b, sizeof a) == 0; }

static void api_compare_threads(const api_out *a, const api_out *b, const char *path) {
    const int64_t n = a->n;
    th_check(same_double(a->sum, b->sum) && same_double(a->sumsq, b->sumsq) &&
                 same_double(a->ce_loss, b->ce_loss) &&
                 same_double(a->ce_loss_nograd, b->ce_loss_nograd) &&
                 same_double(a->se_loss, b->se_loss) && a->count == b->count,
             "[%s] n=%lld: reductions differ between 1 and 2 threads: sum %.17g/%.17g sumsq "
             "%.17g/%.17g ce %.17g/%.17g se %.17g/%.17g count %lld/%lld",
             path, (long long)n, a->sum, b->sum, a->sumsq, b->sumsq, a->ce_loss, b->ce_loss,
             a->se_loss, b->se_loss, (long long)a->count, (long long)b->count);
    const char *diff = NULL;
    if (!same_bits(a->adam_w, b->adam_w, n, 4) || !same_bits(a->adam_m, b->adam_m, n, 4) ||
        !same_bits(a->adam_v, b->adam_v, n, 4))
        diff = "adamw";
    else if (!same_bits(a->sgd_w, b->sgd_w, n, 4)) diff = "sgd";
    else if (!same_bits(a->axpy_y, b->axpy_y, n, 4)) diff = "axpy";
    else if (!same_bits(a->scale_x, b->scale_x, n, 4)) diff = "scale";
    else if (!same_bits(a->fill_x, b->fill_x, n, 4)) diff = "fill";
    else if (!same_bits(a->argmax, b->argmax, a->argmax_rows, 4)) diff = "argmax";
    else if (!same_bits(a->ce_grad, b->ce_grad, a->ce_rows * CE_COLS, 4)) diff = "cross-entropy grad";
    else if (!same_bits(a->se_grad, b->se_grad, n, 4)) diff = "squared-error grad";
    else if (!same_bits(a->u8_out, b->u8_out, n, 4) || !same_bits(a->f16_out, b->f16_out, n, 4))
        diff = "conversions";
    th_check(diff == NULL, "[%s] n=%lld: %s output differs between 1 and 2 threads", path,
             (long long)n, diff ? diff : "");
}

/* ---- shard gathers -------------------------------------------------------- */

typedef struct { int64_t nshards, nsrc, shard; } gather_case;

static int64_t *random_perm(int64_t nshards, int64_t nsrc) {
    int64_t *perm = (int64_t *)th_alloc(8, nshards, 1);
    for (int64_t j = 0; j < nshards; ++j) perm[j] = th_randint(0, nsrc);
    if (nshards > 1) perm[nshards - 1] = nsrc - 1, perm[0] = 0; /* both ends of src */
    return perm;
}

static void api_gather(const char *tag) {
    th_seed(0x9a7);
    /* a 4096-byte shard moves 600 shards on threads (>= 1 MiB); 7 bytes stays on one */
    static const gather_case raw[] = {{0, 3, 16}, {1, 1, 1}, {1000, 300, 7}, {600, 200, 4096}};
    for (size_t c = 0; c < sizeof raw / sizeof raw[0]; ++c) {
        const gather_case k = raw[c];
        uint8_t *src = (uint8_t *)th_alloc(1, k.nsrc * k.shard, 1);
        for (int64_t i = 0; i < k.nsrc * k.shard; ++i) src[i] = (uint8_t)th_next();
        const int64_t *perm = random_perm(k.nshards, k.nsrc);
        uint8_t *dst = (uint8_t *)th_alloc(1, k.nshards * k.shard, 3);
        ggmlopt_gather_shards(k.nshards, k.shard, perm, src, dst);
        int64_t bad = -1;
        for (int64_t j = 0; j < k.nshards && bad < 0; ++j)
            if (memcmp(dst + j * k.shard, src + perm[j] * k.shard, (size_t)k.shard) != 0) bad = j;
        th_check(bad < 0, "ggmlopt_gather_shards %s nshards=%lld shard_bytes=%lld: shard %lld wrong",
                 tag, (long long)k.nshards, (long long)k.shard, (long long)bad);
    }

    static const gather_case conv[] = {{0, 2, 5}, {3, 4, 5}, {9, 5, 17}, {700, 100, 784}, {1000, 50, 300}};
    for (size_t c = 0; c < sizeof conv / sizeof conv[0]; ++c) {
        const gather_case k = conv[c];
        const int64_t nsrc_el = k.nsrc * k.shard, ndst_el = k.nshards * k.shard;
        uint8_t *u8 = (uint8_t *)th_alloc(1, nsrc_el, 2);
        uint16_t *f16 = (uint16_t *)th_alloc(2, nsrc_el, 1);
        for (int64_t i = 0; i < nsrc_el; ++i) {
            u8[i] = (uint8_t)th_next();
            f16[i] = (uint16_t)th_next();
        }
        const int64_t *perm = random_perm(k.nshards, k.nsrc);
        float *du8 = (float *)th_alloc(4, ndst_el, 1), *df16 = (float *)th_alloc(4, ndst_el, 2);
        ggmlopt_gather_shards_u8_f32(k.nshards, k.shard, perm, u8, du8, 1.0f / 255.0f);
        ggmlopt_gather_shards_f16_f32(k.nshards, k.shard, perm, f16, df16, 0.25f);
        th_miss m = TH_MISS_INIT;
        for (int64_t j = 0; j < k.nshards; ++j) {
            for (int64_t e = 0; e < k.shard; ++e) {
                const int64_t d = j * k.shard + e, s = perm[j] * k.shard + e;
                th_expect_bits(&m, "u8 dst", d, du8[d], (float)(u8[s] * (double)(1.0f / 255.0f)));
                th_expect_bits(&m, "f16 dst", d, df16[d], (float)(th_f16_to_double(f16[s]) * 0.25));
            }
        }
        char ctx[200];
        snprintf(ctx, sizeof ctx, "ggmlopt_gather_shards_u8/f16_f32 %s nshards=%lld shard_elems=%lld",
                 tag, (long long)k.nshards, (long long)k.shard);
        th_report(&m, ctx);
    }
    th_release_all();
}

/* ---- the run-time surface ------------------------------------------------- */

static void test_runtime_surface(void) {
    const int count = ggmlopt_simd_count();
    th_check(count >= 1, "ggmlopt_simd_count() = %d", count);
    th_check(ggmlopt_simd_name(-1) == NULL && ggmlopt_simd_name(count) == NULL,
             "ggmlopt_simd_name out of range must give NULL");
    int scalar_ok = 0, best = -1;
    for (int i = 0; i < count; ++i) {
        const char *name = ggmlopt_simd_name(i);
        if (name && strcmp(name, "scalar") == 0)
            scalar_ok = ggmlopt_simd_compiled(i) && ggmlopt_simd_supported(i);
        if (best < 0 && ggmlopt_simd_compiled(i) && ggmlopt_simd_supported(i)) best = i;
        th_check(!ggmlopt_simd_supported(i) || ggmlopt_simd_compiled(i),
                 "path %s supported but not compiled", name ? name : "(null)");
    }
    th_check(scalar_ok, "the scalar path must be compiled and supported");
    th_check(ggmlopt_simd_select("no-such-path") == -1, "select of an unknown name must give -1");
#if defined(__x86_64__) || defined(_M_X64)
    th_check(ggmlopt_simd_select("neon") == -2, "select(\"neon\") on x86-64 must give -2");
    const int cpu_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
    const int rc = ggmlopt_simd_select("avx2");
    th_check(rc == (cpu_avx2 ? 0 : -3), "select(\"avx2\") = %d on a CPU with avx2+fma+f16c=%d", rc,
             cpu_avx2);
    th_check(strstr(ggmlopt_cpu_features(), "avx2=") != NULL, "ggmlopt_cpu_features() = '%s'",
             ggmlopt_cpu_features());
    /* GCC's check also asks XGETBV whether the OS saves the ZMM and mask registers */
    const int cpu_avx512 = cpu_avx2 && __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    const int rc512 = ggmlopt_simd_select("avx512");
    th_check(rc512 == (cpu_avx512 ? 0 : -3), "select(\"avx512\") = %d on a CPU with avx512=%d",
             rc512, cpu_avx512);
    th_check(strstr(ggmlopt_cpu_features(), "os_zmm=") != NULL, "ggmlopt_cpu_features() = '%s'",
             ggmlopt_cpu_features());
#endif
#if defined(__aarch64__)
    th_check(ggmlopt_simd_select("avx2") == -2, "select(\"avx2\") on aarch64 must give -2");
    th_check(ggmlopt_simd_select("avx512") == -2, "select(\"avx512\") on aarch64 must give -2");
    th_check(ggmlopt_simd_select("neon") == 0, "select(\"neon\") on aarch64 must give 0");
#endif
    th_check(ggmlopt_simd_select(NULL) == 0 && best >= 0 &&
                 strcmp(ggmlopt_simd_active(), ggmlopt_simd_name(best)) == 0,
             "select(NULL) must restore the best path %s, active is %s",
             best >= 0 ? ggmlopt_simd_name(best) : "?", ggmlopt_simd_active());

    ggmlopt_set_num_threads(0);
    th_check(ggmlopt_get_num_threads() == 1, "set_num_threads(0) must clamp to 1, got %d",
             ggmlopt_get_num_threads());
    ggmlopt_set_num_threads(-3);
    th_check(ggmlopt_get_num_threads() == 1, "set_num_threads(-3) must clamp to 1, got %d",
             ggmlopt_get_num_threads());
    ggmlopt_set_num_threads(2);
    th_check(ggmlopt_get_num_threads() == 2, "set_num_threads(2): get gives %d",
             ggmlopt_get_num_threads());
}

void test_public_api(int64_t big) {
    const int threads_before = ggmlopt_get_num_threads();
    test_runtime_surface();

    const int64_t sizes[] = {0, 1, 17, 4097, big};
    for (int p = 0; p < ggmlopt_simd_count(); ++p) {
        if (!ggmlopt_simd_supported(p)) continue;
        const char *path = ggmlopt_simd_name(p);
        const int rc = ggmlopt_simd_select(path);
        th_check(rc == 0 && strcmp(ggmlopt_simd_active(), path) == 0,
                 "select(\"%s\") = %d, active %s", path, rc, ggmlopt_simd_active());
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; ++s) {
            char tag1[64], tag2[64];
            snprintf(tag1, sizeof tag1, "[%s, 1 thread]", path);
            snprintf(tag2, sizeof tag2, "[%s, 2 threads]", path);
            api_out one, two;
            th_set_stage("public API [%s] n=%lld", path, (long long)sizes[s]);
            ggmlopt_set_num_threads(1);
            api_run(sizes[s], tag1, &one);
            ggmlopt_set_num_threads(2);
            api_run(sizes[s], tag2, &two);
            api_compare_threads(&one, &two, path);
            th_release_all();
        }
        char tag[64];
        th_set_stage("public API [%s] shard gathers", path);
        snprintf(tag, sizeof tag, "[%s, 1 thread]", path);
        ggmlopt_set_num_threads(1);
        api_gather(tag);
        snprintf(tag, sizeof tag, "[%s, 2 threads]", path);
        ggmlopt_set_num_threads(2);
        api_gather(tag);
    }
    ggmlopt_simd_select(NULL);
    ggmlopt_set_num_threads(threads_before);
}
