/*
 * The activation kernels of one dispatch table against float64 references
 * (libm's tanh, exp, erfc), forward and backward, on every size and offset of
 * the harness and on a sweep of the whole float range; on the other paths,
 * also against the scalar path.  Bounds as in tests/test_kernels_activation.py:
 * in float32 spacings (ulp) of the reference, plus |x| * 2^-149 where a factor
 * of a product is subnormal, plus 4|2u| for the tanh-form GELU.
 */
#include <float.h>

#include "harness.h"

#define ULP_MIN 1.401298464324817e-45 /* 2^-149 */
static const double K1 = 1.5957691216057308; /* 2 sqrt(2/pi) */
static const double K3 = 1.5957691216057308 * 0.044715;

enum { ACT_TANH, ACT_SIGMOID, ACT_SILU, ACT_GELU, ACT_GELU_TANH, ACT_LEAKY, ACT_KINDS };
static const char *const ACT_NAMES[ACT_KINDS] = {"tanh", "sigmoid", "silu", "gelu", "gelu_tanh",
                                                 "leaky_relu"};
static const double FWD_ULP[ACT_KINDS] = {3, 4, 6, 10, 6, 0};
#define BWD_ULP 10.0
#define PATHS_ULP 8.0
#define LEAKY_SLOPE 0.1f

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 spacing at |v| (2^-149 for the subnormals) */
static double spacing(double v) {
    const float f = fabsf((float)v);
    if (!(f >= FLT_MIN)) return ULP_MIN;
    if (isinf(f)) return INFINITY;
    return ldexp(1.0, ilogbf(f) - 23);
}

static double sigmoid64(double v) {
    const double e = exp(-fabs(v));
    return v >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}
static double cdf64(double v) {
    const double h = 0.5 * erfc(fabs(v) / sqrt(2.0));
    return v < 0 ? h : 1.0 - h;
}
static double arg2u(double v) {
    const double c = v < -1e4 ? -1e4 : v > 1e4 ? 1e4 : v;
    return c * (K1 + K3 * c * c);
}
/* v * f with the limit 0 at v = -inf, f = 0 */
static double times(double v, double f) { return isinf(v) && v < 0 && f == 0 ? 0.0 : v * f; }

static double forward_ref(int kind, double v) {
    switch (kind) {
    case ACT_TANH: return tanh(v);
    case ACT_SIGMOID: return sigmoid64(v);
    case ACT_SILU: return times(v, sigmoid64(v));
    case ACT_GELU: return times(v, cdf64(v));
    case ACT_GELU_TANH: return times(v, sigmoid64(arg2u(v)));
    default: return v > 0 ? v : (double)(float)(LEAKY_SLOPE * (float)v);
    }
}

static double extra_ulp(int kind, double v) {
    return kind == ACT_GELU_TANH && isfinite(v) ? 4.0 * fabs(arg2u(v)) : 0.0;
}

/* The input gradient and the sum of the magnitudes of its terms; a is the
 * forward output for tanh/sigmoid, else the input. */
static double backward_ref(int kind, double a, double g, double *scale, double *mult) {
    *mult = fabs(a * g);
    switch (kind) {
    case ACT_TANH: *scale = fabs(g) * (1 + a * a); return g * (1 - a * a);
    case ACT_SIGMOID: *scale = fabs(g * a) * (1 + fabs(a)); return g * a * (1 - a);
    case ACT_SILU: {
        const double s = sigmoid64(a), c = sigmoid64(-a);
        *scale = fabs(g) * s * (1 + fabs(a) * c);
        return g * s * (1 + a * c);
    }
    case ACT_GELU: {
        const double sqrt_2pi = 2.5066282746310002;
        const double cdf = cdf64(a), pdf_x = a * exp(-0.5 * a * a) / sqrt_2pi;
        *scale = fabs(g) * (cdf + fabs(pdf_x));
        return g * (cdf + pdf_x);
    }
    case ACT_GELU_TANH: {
        const double c = a < -1e4 ? -1e4 : a > 1e4 ? 1e4 : a;
        const double u = arg2u(a), s = sigmoid64(u), one_minus = sigmoid64(-u);
        const double darg = K1 + 3 * K3 * c * c;
        const double term = c * s * one_minus * darg;
        *scale = fabs(g) * (s + fabs(term));
        *mult *= darg;
        return g * (s + term);
    }
    default: *scale = 0; return a > 0 ? g : (double)(float)(LEAKY_SLOPE * (float)g);
    }
}

static void run_forward(const ggmlopt_kernel_table *k, int kind, int64_t n, const float *x,
                        float *y) {
    switch (kind) {
    case ACT_TANH: k->tanh_f32(n, x, y); break;
    case ACT_SIGMOID: k->sigmoid_f32(n, x, y); break;
    case ACT_SILU: k->silu_f32(n, x, y); break;
    case ACT_GELU: k->gelu_f32(n, x, y); break;
    case ACT_GELU_TANH: k->gelu_tanh_f32(n, x, y); break;
    default: k->leaky_relu_f32(n, x, y, LEAKY_SLOPE); break;
    }
}

static void run_backward(const ggmlopt_kernel_table *k, int kind, int64_t n, const float *a,
                         const float *g, float *out) {
    switch (kind) {
    case ACT_TANH: k->tanh_backward_f32(n, a, g, out); break;
    case ACT_SIGMOID: k->sigmoid_backward_f32(n, a, g, out); break;
    case ACT_SILU: k->silu_backward_f32(n, a, g, out); break;
    case ACT_GELU: k->gelu_backward_f32(n, a, g, out); break;
    case ACT_GELU_TANH: k->gelu_tanh_backward_f32(n, a, g, out); break;
    default: k->leaky_relu_backward_f32(n, a, g, out, LEAKY_SLOPE); break;
    }
}

static void expect_forward(th_miss *m, int kind, int64_t i, float x, float y) {
    const double want = forward_ref(kind, x);
    if (kind == ACT_LEAKY) {
        th_expect_bits(m, "y", i, y, (float)want);
        return;
    }
    const double tol = (FWD_ULP[kind] + extra_ulp(kind, x)) * spacing(want) +
                       (isfinite(x) ? fabs((double)x) * ULP_MIN : 0.0);
    th_expect(m, "y", i, y, want, tol);
}

static void expect_backward(th_miss *m, int kind, int64_t i, float a, float g, float got) {
    double scale, mult;
    const double want = backward_ref(kind, a, g, &scale, &mult);
    if (kind == ACT_LEAKY) {
        th_expect_bits(m, "grad", i, got, (float)want);
        return;
    }
    const double tol = (BWD_ULP + extra_ulp(kind, a)) * spacing(scale) + 2 * mult * ULP_MIN;
    th_expect(m, "grad", i, got, want, tol);
}

/* Random values over [-12, 12] with NaN, +-inf, +-0 and large values mixed in. */
static float *activation_input(int64_t n, int off) {
    float *x = th_rand_f32(n, off, -12.0f, 12.0f);
    static const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e30f, -1e30f, -95.0f};
    for (int64_t i = 3; i < n; i += 5) x[i] = specials[(i / 5) % 8];
    return x;
}

void test_activations(const ggmlopt_kernel_table *k, const ggmlopt_kernel_table *scalar,
                      int64_t n, int off) {
    for (int kind = 0; kind < ACT_KINDS; ++kind) {
        char ctx[160];
        snprintf(ctx, sizeof ctx, "%s[%s] n=%lld off=%d", ACT_NAMES[kind], k->name, (long long)n,
                 off);
        float *x = activation_input(n, off);
        const float *x0 = th_dup(x, 4, n);
        float *y = th_alloc(4, n, off), *ys = th_alloc(4, n, 0);
        run_forward(k, kind, n, x, y);
        run_forward(scalar, kind, n, x0, ys);
        /* the backward kernels of tanh and sigmoid take the forward output */
        const float *a = kind == ACT_TANH || kind == ACT_SIGMOID ? ys : x0;
        float *g = th_rand_f32(n, off, -2.0f, 2.0f);
        float *gi = th_alloc(4, n, off), *gs = th_alloc(4, n, 0);
        float *inplace = th_dup(g, 4, n);
        run_backward(k, kind, n, a, g, gi);
        run_backward(scalar, kind, n, a, g, gs);
        run_backward(k, kind, n, a, inplace, inplace); /* out may be g */

        th_miss ref = TH_MISS_INIT, cross = TH_MISS_INIT;
        for (int64_t i = 0; i < n; ++i) {
            expect_forward(&ref, kind, i, x0[i], y[i]);
            th_expect_bits(&ref, "x (an input, changed)", i, x[i], x0[i]);
            if (isfinite(x0[i])) expect_backward(&ref, kind, i, a[i], g[i], gi[i]);
            th_expect_bits(&ref, "grad in place", i, inplace[i], gi[i]);
            const double tol = (PATHS_ULP + extra_ulp(kind, x0[i])) * spacing(ys[i]) +
                               (isfinite(x0[i]) ? 2 * fabs((double)x0[i]) * ULP_MIN : 0.0);
            th_expect(&cross, "y vs scalar", i, y[i], ys[i], tol);
        }
        th_report(&ref, ctx);
        if (k != scalar) th_report(&cross, ctx);
    }
}

/* Every 65537th positive float bit pattern and its negative: the forward bound
 * over the whole range, subnormals to FLT_MAX. */
void test_activations_sweep(const ggmlopt_kernel_table *k) {
    const int64_t half = 0x7F800000 / 65537 + 1, n = 2 * half;
    float *x = th_alloc(4, n, 0), *y = th_alloc(4, n, 0);
    for (int64_t i = 0; i < half; ++i) {
        uint32_t bits = (uint32_t)(i * 65537);
        x[i] = from_bits(bits);
        x[half + i] = -x[i];
    }
    for (int kind = 0; kind < ACT_KINDS; ++kind) {
        char ctx[160];
        snprintf(ctx, sizeof ctx, "%s[%s] sweep of %lld floats", ACT_NAMES[kind], k->name,
                 (long long)n);
        run_forward(k, kind, n, x, y);
        th_miss ref = TH_MISS_INIT;
        for (int64_t i = 0; i < n; ++i) expect_forward(&ref, kind, i, x[i], y[i]);
        th_report(&ref, ctx);
    }
    th_release_all();
}

/* The public (threaded) entry points: the same bits on 1 and 2 threads, and
 * the same as the active table on one block. */
void test_activations_public(int64_t big) {
    th_seed(0xac7ULL);
    float *x = activation_input(big, 1), *g = th_rand_f32(big, 1, -2.0f, 2.0f);
    float *y1 = th_alloc(4, big, 0), *y2 = th_alloc(4, big, 0);
    float *g1 = th_alloc(4, big, 0), *g2 = th_alloc(4, big, 0);
    const int before = ggmlopt_get_num_threads();
    for (int kind = 0; kind < ACT_KINDS; ++kind) {
        for (int t = 1; t <= 2; ++t) {
            ggmlopt_set_num_threads(t);
            float *y = t == 1 ? y1 : y2, *gi = t == 1 ? g1 : g2;
            switch (kind) {
            case ACT_TANH:
                ggmlopt_tanh_f32(big, x, y);
                ggmlopt_tanh_backward_f32(big, y, g, gi);
                break;
            case ACT_SIGMOID:
                ggmlopt_sigmoid_f32(big, x, y);
                ggmlopt_sigmoid_backward_f32(big, y, g, gi);
                break;
            case ACT_SILU:
                ggmlopt_silu_f32(big, x, y);
                ggmlopt_silu_backward_f32(big, x, g, gi);
                break;
            case ACT_GELU:
                ggmlopt_gelu_f32(big, x, y);
                ggmlopt_gelu_backward_f32(big, x, g, gi);
                break;
            case ACT_GELU_TANH:
                ggmlopt_gelu_tanh_f32(big, x, y);
                ggmlopt_gelu_tanh_backward_f32(big, x, g, gi);
                break;
            default:
                ggmlopt_leaky_relu_f32(big, x, y, LEAKY_SLOPE);
                ggmlopt_leaky_relu_backward_f32(big, x, g, gi, LEAKY_SLOPE);
                break;
            }
        }
        th_miss m = TH_MISS_INIT;
        for (int64_t i = 0; i < big; ++i) {
            th_expect_bits(&m, "y, 2 threads vs 1", i, y2[i], y1[i]);
            th_expect_bits(&m, "grad, 2 threads vs 1", i, g2[i], g1[i]);
            expect_forward(&m, kind, i, x[i], y1[i]);
        }
        char ctx[160];
        snprintf(ctx, sizeof ctx, "ggmlopt_%s_f32 public n=%lld threads 1 and 2", ACT_NAMES[kind],
                 (long long)big);
        th_report(&m, ctx);
    }
    ggmlopt_set_num_threads(before);
    th_release_all();
}
