/*
 * The causal attention and rotary embedding kernels of one dispatch table
 * against naive float64 references of their formulas (kernels/attention.inc),
 * on head sizes around the vector widths and sequence lengths around the tile
 * size, with grouped heads; large scores; NaN and inf in rows; on the other
 * paths also against the scalar path.  Then the public, threaded functions:
 * 1 and 2 threads bit for bit.
 *
 * Tolerances: a score's float rounding is about eps * S, S = scale * sum |q||k|,
 * and moves each p by as much relatively, so outputs are allowed
 * (2e-6 + 3e-7 S) * max|v| and gradients (1e-5 + 1e-6 S) times their scale.
 */
#include "harness.h"

typedef struct {
    int64_t b, t, h, hkv, d;
    const int32_t *starts; /* NULL, or (b, t) first keys (the kernels' kv_start) */
    float softcap;         /* 0, or the scores' soft cap */
} attn_shape;

static int64_t q_size(const attn_shape *s) { return s->b * s->t * s->h * s->d; }
static int64_t kv_size(const attn_shape *s) { return s->b * s->t * s->hkv * s->d; }

/* Naive float64 causal attention: out, lse, and for dout the gradients; smax
 * receives the largest S of any row. */
static void attention_ref(const attn_shape *s, const float *q, const float *k, const float *v,
                          const float *dout, double *out, double *lse, double *dq, double *dk,
                          double *dv, double *smax) {
    const int64_t T = s->t, D = s->d, H = s->h, HK = s->hkv, group = H / HK;
    const double scale = 1.0 / sqrt((double)D);
    double *p = malloc(sizeof(double) * (size_t)T), *ds = malloc(sizeof(double) * (size_t)T);
    double *slope = malloc(sizeof(double) * (size_t)T); /* d capped / d score */
    const double cap = s->softcap;
    *smax = 0.0;
    for (int64_t i = 0; i < kv_size(s); ++i) dk[i] = dv[i] = 0.0;
    for (int64_t b = 0; b < s->b; ++b)
        for (int64_t h = 0; h < H; ++h) {
            const int64_t g = h / group;
#define QA(a, i) ((a) + ((b * T + (i)) * H + h) * D)
#define KA(a, j) ((a) + ((b * T + (j)) * HK + g) * D)
            for (int64_t i = 0; i < T; ++i) {
                const int64_t j0 = s->starts ? s->starts[b * T + i] : 0;
                double m = -INFINITY, sabs = 0.0;
                int nan = 0;
                for (int64_t j = j0; j <= i; ++j) {
                    double acc = 0.0, mag = 0.0;
                    for (int64_t c = 0; c < D; ++c) {
                        acc += (double)QA(q, i)[c] * KA(k, j)[c];
                        mag += fabs((double)QA(q, i)[c] * KA(k, j)[c]);
                    }
                    p[j] = acc * scale;
                    slope[j] = 1.0;
                    if (cap > 0.0) {
                        const double t = tanh(p[j] / cap);
                        p[j] = cap * t;
                        slope[j] = 1.0 - t * t;
                    }
                    if (isnan(p[j])) nan = 1;
                    if (p[j] > m) m = p[j];
                    if (mag * scale > sabs) sabs = mag * scale;
                }
                if (isfinite(sabs) && sabs > *smax) *smax = sabs;
                double l = 0.0;
                for (int64_t j = j0; j <= i; ++j) {
                    p[j] = nan ? NAN : exp(p[j] - m);
                    l += p[j];
                }
                lse[(b * H + h) * T + i] = m + log(l);
                if (!(l > 0.0)) lse[(b * H + h) * T + i] = NAN;
                for (int64_t j = j0; j <= i; ++j) p[j] /= l;
                double *o = QA(out, i);
                for (int64_t c = 0; c < D; ++c) {
                    double acc = 0.0;
                    for (int64_t j = j0; j <= i; ++j) acc += p[j] * KA(v, j)[c];
                    o[c] = acc;
                }
                if (!dout) continue;
                double delta = 0.0;
                for (int64_t c = 0; c < D; ++c) delta += (double)QA(dout, i)[c] * o[c];
                for (int64_t j = j0; j <= i; ++j) {
                    double dp = 0.0;
                    for (int64_t c = 0; c < D; ++c) dp += (double)QA(dout, i)[c] * KA(v, j)[c];
                    ds[j] = p[j] * (dp - delta) * slope[j] * scale;
                }
                for (int64_t c = 0; c < D; ++c) {
                    double acc = 0.0;
                    for (int64_t j = j0; j <= i; ++j) acc += ds[j] * KA(k, j)[c];
                    QA(dq, i)[c] = acc;
                }
                for (int64_t j = j0; j <= i; ++j)
                    for (int64_t c = 0; c < D; ++c) {
                        KA(dk, j)[c] += ds[j] * QA(q, i)[c];
                        KA(dv, j)[c] += p[j] * QA(dout, i)[c];
                    }
#undef QA
#undef KA
            }
        }
    free(p);
    free(ds);
    free(slope);
}

/* The table's kernels over the whole problem, in the dispatcher's items. */
static void run_forward(const ggmlopt_kernel_table *k, const attn_shape *s, const float *q,
                        const float *kk, const float *v, float *out, float *lse) {
    go_attn_args a;
    memset(&a, 0, sizeof a);
    a.batch = s->b;
    a.seq = s->t;
    a.n_heads = s->h;
    a.n_kv_heads = s->hkv;
    a.head_dim = s->d;
    a.q = q;
    a.k = kk;
    a.v = v;
    a.q_stride = s->h * s->d;
    a.k_stride = a.v_stride = s->hkv * s->d;
    a.out = out;
    a.out_stride = s->h * s->d;
    a.lse = lse;
    a.scale = (float)(1.0 / sqrt((double)s->d));
    a.kv_start = s->starts;
    a.softcap = s->softcap;
    const int64_t rows = go_attn_forward_rows(s->d);
    for (int64_t b = 0; b < s->b; ++b)
        for (int64_t h = 0; h < s->h; ++h)
            for (int64_t i0 = 0; i0 < s->t; i0 += rows)
                k->attention_forward_f32(&a, b, h, i0, i0 + rows < s->t ? i0 + rows : s->t);
}

static void run_backward(const ggmlopt_kernel_table *k, const attn_shape *s, const float *q,
                         const float *kk, const float *v, const float *out, const float *lse,
                         const float *dout, float *dq, float *dk, float *dv) {
    go_attn_args a;
    memset(&a, 0, sizeof a);
    a.batch = s->b;
    a.seq = s->t;
    a.n_heads = s->h;
    a.n_kv_heads = s->hkv;
    a.head_dim = s->d;
    a.q = q;
    a.k = kk;
    a.v = v;
    a.q_stride = s->h * s->d;
    a.k_stride = a.v_stride = s->hkv * s->d;
    a.out = (float *)out;
    a.out_stride = s->h * s->d;
    a.lse = (float *)lse;
    a.dout = dout;
    a.dq = dq;
    a.dk = dk;
    a.dv = dv;
    a.scale = (float)(1.0 / sqrt((double)s->d));
    a.kv_start = s->starts;
    a.softcap = s->softcap;
    for (int64_t b = 0; b < s->b; ++b)
        for (int64_t g = 0; g < s->hkv; ++g) k->attention_backward_f32(&a, b, g);
}

static double max_abs(const double *x, int64_t n) {
    double m = 0.0;
    for (int64_t i = 0; i < n; ++i)
        if (isfinite(x[i]) && fabs(x[i]) > m) m = fabs(x[i]);
    return m;
}
static double max_abs_f32(const float *x, int64_t n) {
    double m = 0.0;
    for (int64_t i = 0; i < n; ++i)
        if (isfinite(x[i]) && fabs((double)x[i]) > m) m = fabs((double)x[i]);
    return m;
}

static void expect_all(th_miss *m, const char *what, const float *got, const double *want,
                       int64_t n, double tol) {
    for (int64_t i = 0; i < n; ++i) th_expect(m, what, i, got[i], want[i], tol);
}

/* specials: 0 none, 1 NaN and inf in rows (forward only: the NaN pattern) */
static void test_one(const ggmlopt_kernel_table *k, const ggmlopt_kernel_table *scalar,
                     const attn_shape *s, float magnitude, int specials) {
    char ctx[200];
    snprintf(ctx, sizeof ctx, "attention[%s] b=%lld t=%lld h=%lld kv=%lld d=%lld mag=%g%s%s cap=%g",
             k->name, (long long)s->b, (long long)s->t, (long long)s->h, (long long)s->hkv,
             (long long)s->d, magnitude, specials ? " nan/inf" : "",
             s->starts ? " kv_start" : "", (double)s->softcap);
    th_set_stage("%s", ctx);
    const int64_t nq = q_size(s), nkv = kv_size(s), nl = s->b * s->h * s->t;
    float *q = th_rand_f32(nq, 1, -magnitude, magnitude);
    float *kk = th_rand_f32(nkv, 2, -magnitude, magnitude);
    float *v = th_rand_f32(nkv, 3, -1.0f, 1.0f);
    float *dout = th_rand_f32(nq, 0, -1.0f, 1.0f);
    if (specials) {
        q[(s->t / 2) * s->h * s->d + 1] = NAN;          /* row t/2 of head 0 */
        kk[(s->t * 2 / 3) * s->hkv * s->d] = NAN;       /* key row 2t/3 */
        v[(s->t / 3) * s->hkv * s->d + s->d - 1] = INFINITY; /* value row t/3 */
    }
    float *out = th_alloc(4, nq, 0), *lse = th_alloc(4, nl, 1);
    double *ro = malloc(sizeof(double) * (size_t)nq), *rl = malloc(sizeof(double) * (size_t)nl);
    double *rdq = malloc(sizeof(double) * (size_t)nq), *rdk = malloc(sizeof(double) * (size_t)nkv);
    double *rdv = malloc(sizeof(double) * (size_t)nkv), smax;
    attention_ref(s, q, kk, v, specials ? NULL : dout, ro, rl, rdq, rdk, rdv, &smax);
    /* a capped score: its tanh within a few ulps of the cap (the score's own
     * rounding only shrinks through the cap's slope <= 1) */
    smax += 4.0 * s->softcap;
    run_forward(k, s, q, kk, v, out, lse);
    th_miss m = TH_MISS_INIT;
    if (specials) {
        for (int64_t i = 0; i < nq; ++i)
            if (m.index < 0 && (isnan(out[i]) != isnan(ro[i]) || isinf(out[i]) != isinf(ro[i])))
                th_expect(&m, "out nan/inf pattern", i, out[i], ro[i], 0.0);
        for (int64_t i = 0; i < nl; ++i)
            if (m.index < 0 && isnan(lse[i]) != isnan(rl[i]))
                th_expect(&m, "lse nan pattern", i, lse[i], rl[i], 0.0);
        double vmax = max_abs_f32(v, nkv);
        for (int64_t i = 0; i < nq; ++i)
            if (isfinite(ro[i])) th_expect(&m, "out", i, out[i], ro[i], 2e-6 * vmax);
        th_report(&m, ctx);
    } else {
        const double vmax = max_abs_f32(v, nkv);
        expect_all(&m, "out", out, ro, nq, (2e-6 + 3e-7 * smax) * vmax);
        expect_all(&m, "lse", lse, rl, nl, 1e-6 * (1.0 + max_abs(rl, nl)) + 3e-7 * smax);
        float *dq = th_alloc(4, nq, 2), *dk = th_alloc(4, nkv, 3), *dv = th_alloc(4, nkv, 1);
        run_backward(k, s, q, kk, v, out, lse, dout, dq, dk, dv);
        double gscale = max_abs(rdq, nq);
        if (max_abs(rdk, nkv) > gscale) gscale = max_abs(rdk, nkv);
        if (max_abs(rdv, nkv) > gscale) gscale = max_abs(rdv, nkv);
        const double gtol = (1e-5 + 1e-6 * smax) * gscale;
        expect_all(&m, "dq", dq, rdq, nq, gtol);
        expect_all(&m, "dk", dk, rdk, nkv, gtol);
        expect_all(&m, "dv", dv, rdv, nkv, gtol);
        th_report(&m, ctx);
        if (k != scalar) {
            /* the same arithmetic on the scalar path, up to FMA and summation order */
            float *so = th_alloc(4, nq, 0), *sl = th_alloc(4, nl, 0);
            float *sdq = th_alloc(4, nq, 0), *sdk = th_alloc(4, nkv, 0), *sdv = th_alloc(4, nkv, 0);
            run_forward(scalar, s, q, kk, v, so, sl);
            run_backward(scalar, s, q, kk, v, so, sl, dout, sdq, sdk, sdv);
            th_miss x = TH_MISS_INIT;
            for (int64_t i = 0; i < nq; ++i) {
                th_expect(&x, "out vs scalar", i, out[i], so[i], (2e-6 + 3e-7 * smax) * vmax);
                th_expect(&x, "dq vs scalar", i, dq[i], sdq[i], gtol);
            }
            for (int64_t i = 0; i < nkv; ++i) {
                th_expect(&x, "dk vs scalar", i, dk[i], sdk[i], gtol);
                th_expect(&x, "dv vs scalar", i, dv[i], sdv[i], gtol);
            }
            th_report(&x, ctx);
        }
    }
    free(ro);
    free(rl);
    free(rdq);
    free(rdk);
    free(rdv);
}

/* y1 = x1 c - x2 s, y2 = x2 c + x1 s from HF's float32 angles */
static void test_rope(const ggmlopt_kernel_table *k, int64_t d, int64_t pos0, int inverse) {
    char ctx[160];
    snprintf(ctx, sizeof ctx, "rope_f32[%s] d=%lld pos0=%lld%s", k->name, (long long)d,
             (long long)pos0, inverse ? " inverse" : "");
    th_set_stage("%s", ctx);
    const int64_t rows = 2 * 7, seq = 7, heads = 3, half = d / 2, npos = pos0 + seq;
    float *cs = th_alloc(4, npos * half, 0), *sn = th_alloc(4, npos * half, 1);
    for (int64_t p = 0; p < npos; ++p)
        for (int64_t i = 0; i < half; ++i) {
            const float inv = (float)(1.0 / pow(10000.0, (double)(2 * i) / (double)d));
            const double angle = (double)(inv * (float)p);
            cs[p * half + i] = (float)cos(angle);
            sn[p * half + i] = (float)sin(angle);
        }
    float *x = th_rand_f32(rows * heads * d, 2, -2.0f, 2.0f);
    x[3] = NAN;
    x[d + 1] = INFINITY;
    float *y = th_alloc(4, rows * heads * d, 3);
    go_rope_args a = {seq, pos0, heads, d, x, heads * d, y, heads * d, cs, sn, inverse};
    k->rope_f32(&a, 0, rows);
    th_miss m = TH_MISS_INIT;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t p = pos0 + r % seq;
        for (int64_t h = 0; h < heads; ++h)
            for (int64_t i = 0; i < half; ++i) {
                const int64_t o = (r * heads + h) * d + i;
                const double c = cs[p * half + i];
                const double sv = inverse ? -sn[p * half + i] : sn[p * half + i];
                const double x1 = x[o], x2 = x[o + half];
                const double tol = 3e-7 * (fabs(x1) + fabs(x2));
                th_expect(&m, "y1", o, y[o], x1 * c - x2 * sv, tol);
                th_expect(&m, "y2", o + half, y[o + half], x2 * c + x1 * sv, tol);
            }
    }
    /* in place gives the same bits */
    float *z = th_dup(x, 4, rows * heads * d);
    go_rope_args b = {seq, pos0, heads, d, z, heads * d, z, heads * d, cs, sn, inverse};
    k->rope_f32(&b, 0, rows);
    for (int64_t i = 0; i < rows * heads * d; ++i) th_expect_bits(&m, "in place", i, z[i], y[i]);
    th_report(&m, ctx);
}

/* attention_decode_f32: heads [1, nh) of one step over `length` cached
 * positions (the rest of the cache NaN: never read), within float32 rounding of
 * a float64 softmax-weighted sum; head 0's output untouched. */
#define U (1.0 / 16777216.0)
static void test_decode(const ggmlopt_kernel_table *k, int64_t nh, int64_t nkv, int64_t d,
                        int64_t length, float cap) {
    char ctx[160];
    snprintf(ctx, sizeof ctx, "attention_decode_f32[%s] heads %lld/%lld d=%lld length=%lld cap=%g",
             k->name, (long long)nh, (long long)nkv, (long long)d, (long long)length, (double)cap);
    th_set_stage("%s", ctx);
    const int64_t max_len = length + 3, stride = nkv * d;
    const float *q = th_rand_f32(nh * d, 1, -2.0f, 2.0f);
    float *kc = th_rand_f32(max_len * stride, 2, -1.0f, 1.0f);
    float *vc = th_rand_f32(max_len * stride, 3, -1.0f, 1.0f);
    for (int64_t i = length * stride; i < max_len * stride; ++i) kc[i] = vc[i] = NAN;
    float *out = th_alloc(4, nh * d, 0), *scores = th_alloc(4, nh * length, 1);
    for (int64_t i = 0; i < d; ++i) out[i] = 7.0f;
    const go_attn_decode_args a = {nh, nkv, d, length, stride, q, kc, vc, out, scores,
                                   (float)(1.0 / sqrt((double)d)), cap};
    k->attention_decode_f32(&a, 1, nh);
    th_miss m = TH_MISS_INIT;
    for (int64_t i = 0; i < d; ++i) th_expect_bits(&m, "head 0 (not asked)", i, out[i], 7.0f);
    double *p = th_alloc(8, length, 0);
    for (int64_t h = 1; h < nh; ++h) {
        const int64_t g = h / (nh / nkv);
        double mx = -INFINITY, sum = 0.0;
        for (int64_t l = 0; l < length; ++l) {
            double dot = 0.0;
            for (int64_t i = 0; i < d; ++i) dot += (double)q[h * d + i] * kc[l * stride + g * d + i];
            p[l] = dot / sqrt((double)d);
            if (cap > 0.0f) p[l] = cap * tanh(p[l] / cap);
            if (p[l] > mx) mx = p[l];
        }
        for (int64_t l = 0; l < length; ++l) sum += (p[l] = exp(p[l] - mx));
        /* scores within (d + 8) u of 2 sqrt(d), weights within twice that and
         * (length + 8) u, values at most 1 */
        const double tol = 2.0 * (double)(d + 8) * U * 2.0 * sqrt((double)d) + 3.0 * (double)(length + 8) * U;
        for (int64_t i = 0; i < d; ++i) {
            double o = 0.0;
            for (int64_t l = 0; l < length; ++l) o += p[l] * vc[l * stride + g * d + i];
            th_expect(&m, "out", h * d + i, out[h * d + i], o / sum, tol);
        }
    }
    th_report(&m, ctx);
}

/* First keys per query: sliding windows (1, 5, 32, 33 keys) and packed documents
 * (random runs, single tokens among them), forward and backward. */
static void test_ranged(const ggmlopt_kernel_table *k, const ggmlopt_kernel_table *scalar) {
    static const int64_t T[] = {7, 70, 130};
    static const int64_t W[] = {1, 5, 32, 33};
    for (size_t ti = 0; ti < sizeof T / sizeof T[0]; ++ti) {
        const int64_t b = 2, t = T[ti];
        int32_t *starts = (int32_t *)th_alloc(4, b * t, 0);
        for (size_t wi = 0; wi < sizeof W / sizeof W[0]; ++wi) {
            for (int64_t r = 0; r < b; ++r)
                for (int64_t i = 0; i < t; ++i)
                    starts[r * t + i] = (int32_t)(i - W[wi] + 1 > 0 ? i - W[wi] + 1 : 0);
            const attn_shape s = {b, t, 4, 2, 16, starts, 0.0f};
            test_one(k, scalar, &s, 1.0f, 0);
        }
        for (int64_t r = 0; r < b; ++r) {   /* documents: a new one with probability 1/9 */
            int32_t start = 0;
            for (int64_t i = 0; i < t; ++i) {
                if (i > 0 && th_randint(0, 9) == 0) start = (int32_t)i;
                starts[r * t + i] = start;
            }
        }
        const attn_shape docs = {b, t, 4, 1, 9, starts, 0.0f};
        test_one(k, scalar, &docs, 1.0f, 0);
        th_release_all();
    }
}

/* Gemma 2's soft cap on the scores: caps below, near and above the scores'
 * range, plain, grouped, windowed and packed rows, forward and backward. */
static void test_capped(const ggmlopt_kernel_table *k, const ggmlopt_kernel_table *scalar) {
    static const float CAP[] = {0.5f, 3.0f, 50.0f};
    for (size_t ci = 0; ci < sizeof CAP / sizeof CAP[0]; ++ci) {
        const attn_shape plain = {2, 70, 4, 2, 24, NULL, CAP[ci]};
        const attn_shape odd = {1, 33, 3, 1, 9, NULL, CAP[ci]};
        test_one(k, scalar, &plain, 4.0f, 0);
        test_one(k, scalar, &odd, 1.0f, 0);
        th_release_all();
        const int64_t b = 2, t = 70;
        int32_t *starts = (int32_t *)th_alloc(4, b * t, 0);
        for (int64_t r = 0; r < b; ++r)
            for (int64_t i = 0; i < t; ++i) starts[r * t + i] = (int32_t)(i - 32 > 0 ? i - 32 : 0);
        const attn_shape window = {b, t, 4, 1, 16, starts, CAP[ci]};
        test_one(k, scalar, &window, 4.0f, 0);
        th_release_all();
    }
}

void test_attention_kernels(const ggmlopt_kernel_table *k, const ggmlopt_kernel_table *scalar) {
    static const int64_t T[] = {1, 2, 7, 31, 33, 70, 130};
    static const int64_t D[] = {1, 3, 8, 9, 16, 17, 64};
    th_seed(0xa77e);
    for (size_t ti = 0; ti < sizeof T / sizeof T[0]; ++ti)
        for (size_t di = 0; di < sizeof D / sizeof D[0]; ++di) {
            const attn_shape s = {ti % 2 ? 2 : 1, T[ti], 4, di % 3 == 0 ? 1 : di % 3 == 1 ? 2 : 4,
                                  D[di], NULL, 0.0f};
            test_one(k, scalar, &s, 1.0f, 0);
            th_release_all();
        }
    const attn_shape wide = {1, 40, 2, 1, 256, NULL, 0.0f}, big = {1, 300, 2, 2, 32, NULL, 0.0f};
    test_one(k, scalar, &wide, 1.0f, 0);
    test_one(k, scalar, &big, 1.0f, 0);
    th_release_all();
    /* widths whose last columns are two or three vectors of 4, 8 or 16 lanes
     * (stories15M's 48, Phi-2's 80): the accumulations' narrow tails */
    static const int64_t TAIL_D[] = {12, 24, 48, 56, 80};
    for (size_t di = 0; di < sizeof TAIL_D / sizeof TAIL_D[0]; ++di) {
        const attn_shape s = {2, 37, 4, di % 2 ? 2 : 1, TAIL_D[di], NULL, 0.0f};
        test_one(k, scalar, &s, 1.0f, 0);
        th_release_all();
    }
    const attn_shape mid = {2, 45, 2, 1, 16, NULL, 0.0f};
    test_one(k, scalar, &mid, 30.0f, 0); /* scores up to a few thousand */
    test_one(k, scalar, &mid, 1.0f, 1);
    th_release_all();
    test_ranged(k, scalar);
    static const int64_t DD[][4] = {{9, 3, 64, 80}, {4, 4, 17, 1}, {8, 2, 7, 33},
                                    {2, 1, 128, 130}, {3, 1, 1, 5}};
    for (size_t i = 0; i < sizeof DD / sizeof DD[0]; ++i) {
        test_decode(k, DD[i][0], DD[i][1], DD[i][2], DD[i][3], 0.0f);
        test_decode(k, DD[i][0], DD[i][1], DD[i][2], DD[i][3], 1.5f);  /* scores up to ~2 sqrt(d) */
        th_release_all();
    }
    test_capped(k, scalar);
    static const int64_t RD[] = {2, 6, 8, 16, 18, 34, 64, 128};
    for (size_t i = 0; i < sizeof RD / sizeof RD[0]; ++i)
        for (int inverse = 0; inverse <= 1; ++inverse) {
            test_rope(k, RD[i], 0, inverse);
            test_rope(k, RD[i], 2048, inverse);
            th_release_all();
        }
}

/* q, k, v and the output gradient of shape s, uniform in [-1, 1) */
static void random_inputs(const attn_shape *s, float **q, float **k, float **v, float **dout) {
    *q = th_rand_f32(q_size(s), 0, -1.0f, 1.0f);
    *k = th_rand_f32(kv_size(s), 0, -1.0f, 1.0f);
    *v = th_rand_f32(kv_size(s), 0, -1.0f, 1.0f);
    *dout = th_rand_f32(q_size(s), 0, -1.0f, 1.0f);
}

/* The public functions: threads split (batch, head) items; 1 and 2 threads
 * give the same bits. */
void test_attention_public(void) {
    th_set_stage("attention public api");
    th_seed(0xa77f);
    const attn_shape s = {3, 150, 4, 2, 24, NULL, 0.0f};
    const int64_t nq = q_size(&s), nkv = kv_size(&s), nl = s.b * s.h * s.t;
    float *q, *kk, *v, *dout;
    random_inputs(&s, &q, &kk, &v, &dout);
    float *res[2][5];
    const int before = ggmlopt_get_num_threads();
    for (int t = 0; t < 2; ++t) {
        ggmlopt_set_num_threads(t + 1);
        float *out = th_alloc(4, nq, 0), *lse = th_alloc(4, nl, 0);
        float *dq = th_alloc(4, nq, 0), *dk = th_alloc(4, nkv, 0), *dv = th_alloc(4, nkv, 0);
        int rc = ggmlopt_attention_forward_f32(s.b, s.t, s.h, s.hkv, s.d, q, s.h * s.d, kk,
                                               s.hkv * s.d, v, s.hkv * s.d, out, s.h * s.d, lse);
        rc |= ggmlopt_attention_backward_f32(s.b, s.t, s.h, s.hkv, s.d, q, s.h * s.d, kk,
                                             s.hkv * s.d, v, s.hkv * s.d, out, s.h * s.d, lse,
                                             dout, dq, dk, dv);
        th_check(rc == 0, "attention public api: return code %d", rc);
        res[t][0] = out;
        res[t][1] = lse;
        res[t][2] = dq;
        res[t][3] = dk;
        res[t][4] = dv;
    }
    ggmlopt_set_num_threads(before);
    const int64_t sizes[5] = {nq, nl, nq, nkv, nkv};
    th_miss m = TH_MISS_INIT;
    for (int a = 0; a < 5; ++a)
        for (int64_t i = 0; i < sizes[a]; ++i)
            th_expect_bits(&m, "1 vs 2 threads", i, res[1][a][i], res[0][a][i]);
    th_report(&m, "attention public api 1 vs 2 threads");
    th_check(ggmlopt_attention_forward_f32(1, 4, 3, 2, 8, q, 24, kk, 16, v, 16, res[0][0], 24,
                                           res[0][1]) == -1,
             "attention public api: n_heads not a multiple of n_kv_heads accepted");
    th_check(ggmlopt_attention_forward_f32(1, 1, 1, 1, 300, q, 300, kk, 300, v, 300, res[0][0],
                                           300, res[0][1]) == -1,
             "attention public api: head_dim 300 accepted");
    /* first keys out of [0, i], or decreasing: refused before any work */
    static const int32_t late[4] = {0, 0, 3, 3}, back[4] = {0, 1, 0, 1};
    th_check(ggmlopt_attention_forward_ranged_f32(1, 4, 1, 1, 8, q, 8, kk, 8, v, 8, res[0][0],
                                                  8, res[0][1], late) == -1,
             "attention public api: a first key after its query accepted");
    th_check(ggmlopt_attention_backward_ranged_f32(1, 4, 1, 1, 8, q, 8, kk, 8, v, 8, res[0][0],
                                                   8, res[0][1], dout, res[0][2], res[0][3],
                                                   res[0][4], back) == -1,
             "attention public api: decreasing first keys accepted");
    th_release_all();
}

/* Batch 1 of a grouped-query model: fewer (batch, kv head) items than 3 or 4
 * threads share evenly, so the backward runs in waves of key tiles (ds stored,
 * then each query block's dq); 1, 2, 3 and 4 threads give the same bits, with
 * documents packed into the window too. */
void test_attention_public_waves(void) {
    th_set_stage("attention backward in waves");
    th_seed(0x3a7e);
    const attn_shape s = {1, 301, 6, 3, 40, NULL, 0.0f};
    const int64_t nq = q_size(&s), nkv = kv_size(&s), nl = s.b * s.h * s.t;
    float *q, *kk, *v, *dout;
    random_inputs(&s, &q, &kk, &v, &dout);
    int32_t *starts = (int32_t *)th_alloc(4, s.t, 0);
    for (int64_t i = 0; i < s.t; ++i) starts[i] = i < 70 ? 0 : i < 200 ? 70 : 200;
    const int before = ggmlopt_get_num_threads();
    for (int packed = 0; packed <= 1; ++packed) {
        const int32_t *first = packed ? starts : NULL;
        float *out = th_alloc(4, nq, 0), *lse = th_alloc(4, nl, 0);
        float *res[4][3];
        ggmlopt_set_num_threads(1);
        int rc = ggmlopt_attention_forward_ranged_f32(s.b, s.t, s.h, s.hkv, s.d, q, s.h * s.d, kk,
                                                      s.hkv * s.d, v, s.hkv * s.d, out, s.h * s.d,
                                                      lse, first);
        for (int t = 0; t < 4; ++t) {
            ggmlopt_set_num_threads(t + 1);
            res[t][0] = th_alloc(4, nq, 0);
            res[t][1] = th_alloc(4, nkv, 0);
            res[t][2] = th_alloc(4, nkv, 0);
            rc |= ggmlopt_attention_backward_ranged_f32(
                s.b, s.t, s.h, s.hkv, s.d, q, s.h * s.d, kk, s.hkv * s.d, v, s.hkv * s.d, out,
                s.h * s.d, lse, dout, res[t][0], res[t][1], res[t][2], first);
        }
        th_check(rc == 0, "attention backward in waves: return code %d", rc);
        const int64_t sizes[3] = {nq, nkv, nkv};
        th_miss m = TH_MISS_INIT;
        for (int t = 1; t < 4; ++t)
            for (int a = 0; a < 3; ++a)
                for (int64_t i = 0; i < sizes[a]; ++i)
                    th_expect_bits(&m, packed ? "packed, threads vs 1" : "threads vs 1", i,
                                   res[t][a][i], res[0][a][i]);
        th_report(&m, packed ? "attention backward in waves, packed"
                             : "attention backward in waves");
    }
    ggmlopt_set_num_threads(before);
    th_release_all();
}
