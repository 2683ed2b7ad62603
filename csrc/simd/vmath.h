/* Vector math for the activations, written once over the SIMD mapping (include
 * after simd/<isa>.h): every path runs the same algorithm, built on the
 * per-path go_vexp_sum, so the paths agree to a few ulp.
 *
 * All exponentials here take a non-positive argument (exp(-|x|), exp(-x*x/2)):
 * nothing overflows, and the accuracy holds over the whole float range,
 * subnormal results included. */
#ifndef GGMLOPT_SIMD_VMATH_H
#define GGMLOPT_SIMD_VMATH_H

#include <float.h>

/* sqrt(2/pi) and ggml's GELU_COEF_A: GELU's tanh form uses
 * tanh(sqrt(2/pi) * (x + 0.044715 x^3)) = 2*sigmoid(2u) - 1 */
#define GO_SQRT_2_OVER_PI 0.79788456080286535588f
#define GO_GELU_COEF_A 0.044715f
#define GO_SQRT1_2 0.70710678118654752440f
#define GO_INV_SQRT_2PI 0.39894228040143267794f
/* the tanh form's argument is cut to +-GO_GELU_TANH_CLAMP: beyond it the
 * sigmoid is saturated anyway, and x^3 would overflow */
#define GO_GELU_TANH_CLAMP 1.0e4f

static inline go_vf go_vzero(void) { return go_vset1(0.0f); }

/* For e = exp(-|x|): sigmoid(x) and 1 - sigmoid(x), both without cancellation,
 * as q = 1/(1+e) and e*q (which one is which depends on the sign of x; -0
 * counts as positive).  Relative error about 3 ulp each. */
static inline void go_vsigmoid2(go_vf x, go_vf *s, go_vf *one_minus_s) {
    const go_vf e = go_vexp_sum(go_vsub(go_vzero(), go_vabs(x)), go_vzero());
    const go_vf q = go_vdiv(go_vset1(1.0f), go_vadd(go_vset1(1.0f), e));
    const go_vf r = go_vmul(e, q);
    *s = go_vsel_lt(x, go_vzero(), r, q);
    *one_minus_s = go_vsel_lt(x, go_vzero(), q, r);
}

/* tanh: an odd polynomial below |x| = 0.625 (fitted to float64 tanh for
 * relative error), (1 - e)/(1 + e) with e = exp(-2|x|) above, where 1 - e no
 * longer cancels; the sign put back last, so tanh(-0) = -0. */
#define GO_TANH_SMALL 0.625f
#define GO_TANH_P0 (-5.7981000281870365e-3f)
#define GO_TANH_P1 2.0720280706882477e-2f
#define GO_TANH_P2 (-5.3763799369335175e-2f)
#define GO_TANH_P3 1.3331718742847443e-1f
#define GO_TANH_P4 (-3.3333292603492737e-1f)

static inline go_vf go_vtanh(go_vf x) {
    const go_vf a = go_vabs(x);
    const go_vf s = go_vmul(a, a);
    go_vf p = go_vset1(GO_TANH_P0);
    p = go_vfma(p, s, go_vset1(GO_TANH_P1));
    p = go_vfma(p, s, go_vset1(GO_TANH_P2));
    p = go_vfma(p, s, go_vset1(GO_TANH_P3));
    p = go_vfma(p, s, go_vset1(GO_TANH_P4));
    const go_vf small = go_vfma(go_vmul(a, s), p, a);
    const go_vf e = go_vexp_sum(go_vmul(a, go_vset1(-2.0f)), go_vzero());
    const go_vf large = go_vdiv(go_vsub(go_vset1(1.0f), e), go_vadd(go_vset1(1.0f), e));
    return go_vcopysign(go_vsel_lt(a, go_vset1(GO_TANH_SMALL), small, large), x);
}

/* -x*x/2 as hi + lo for x >= 0: hi from the 12-bit head of x (exact), lo the
 * small rest.  exp(hi + lo) then has no error from rounding x*x, which would
 * cost x*x/2 * 2^-24 of relative accuracy (3e-6 at x = 9). */
static inline void go_vneg_half_square(go_vf x, go_vf *hi, go_vf *lo) {
    const go_vf h = go_vsplit_hi(x);
    *hi = go_vmul(go_vmul(h, h), go_vset1(-0.5f));
    *lo = go_vmul(go_vmul(go_vsub(x, h), go_vadd(x, h)), go_vset1(-0.5f));
}

/* erfc(z) = t * exp(-z*z) * Q(t), t = 1/(1 + 0.4 z), z >= 0: Q is a degree-10
 * polynomial fitted to float64 erfc for relative error (over z in [0, 14.2],
 * where t >= 0.149; 0.06 ulp before rounding the coefficients to float, some 2
 * ulp after float evaluation).  exp(-z*z) is the Gaussian the derivative needs
 * too, so GELU's backward pass takes one exponential, not two. */
#define GO_ERFCX_P 0.4f
#define GO_ERFCX_Q10 (-2.3922365e-02f)
#define GO_ERFCX_Q9 1.10468626e-01f
#define GO_ERFCX_Q8 (-1.6155812e-01f)
#define GO_ERFCX_Q7 3.32025e-02f
#define GO_ERFCX_Q6 4.5993954e-02f
#define GO_ERFCX_Q5 2.9628802e-02f
#define GO_ERFCX_Q4 1.4001715e-01f
#define GO_ERFCX_Q3 1.6644584e-01f
#define GO_ERFCX_Q2 2.0844159e-01f
#define GO_ERFCX_Q1 2.256035e-01f
#define GO_ERFCX_Q0 2.2567852e-01f
/* beyond |x| = 20 the normal tail is exp(-200) = 0 in float */
#define GO_CDF_CLAMP 20.0f

/* The standard normal CDF Phi(x) = (1 + erf(x/sqrt2))/2 = erfc(-x/sqrt2)/2,
 * from one erfc of |x|/sqrt2: erfc/2 for x < 0 and 1 - erfc/2 for x >= 0, so
 * neither side cancels (Phi(-10) = 7.6e-24 keeps its digits, where
 * 1 + erf(x) would give 0).  When gauss is not NULL it receives
 * exp(-x*x/2), the factor erfc was built on. */
static inline go_vf go_vnormal_cdf(go_vf x, go_vf *gauss) {
    const go_vf a = go_vclamp(go_vabs(x), go_vzero(), go_vset1(GO_CDF_CLAMP));
    const go_vf t = go_vdiv(go_vset1(1.0f),
                            go_vfma(a, go_vset1(GO_ERFCX_P * GO_SQRT1_2), go_vset1(1.0f)));
    go_vf q = go_vset1(GO_ERFCX_Q10);
    q = go_vfma(q, t, go_vset1(GO_ERFCX_Q9));
    q = go_vfma(q, t, go_vset1(GO_ERFCX_Q8));
    q = go_vfma(q, t, go_vset1(GO_ERFCX_Q7));
    q = go_vfma(q, t, go_vset1(GO_ERFCX_Q6));
    q = go_vfma(q, t, go_vset1(GO_ERFCX_Q5));
    q = go_vfma(q, t, go_vset1(GO_ERFCX_Q4));
    q = go_vfma(q, t, go_vset1(GO_ERFCX_Q3));
    q = go_vfma(q, t, go_vset1(GO_ERFCX_Q2));
    q = go_vfma(q, t, go_vset1(GO_ERFCX_Q1));
    q = go_vfma(q, t, go_vset1(GO_ERFCX_Q0));
    go_vf hi, lo;
    go_vneg_half_square(a, &hi, &lo);
    const go_vf e = go_vexp_sum(hi, lo);
    if (gauss) *gauss = e;
    const go_vf half_erfc = go_vmul(go_vmul(t, q), go_vmul(e, go_vset1(0.5f)));
    return go_vsel_lt(x, go_vzero(), half_erfc, go_vsub(go_vset1(1.0f), half_erfc));
}

/* x with -inf raised to -FLT_MAX (and, with hi = FLT_MAX, +inf lowered): a
 * product x * f with f = 0 at that end then gives 0, the limit, not NaN */
#define go_vfinite_below(x) go_vclamp((x), go_vset1(-FLT_MAX), go_vset1(INFINITY))
#define go_vfinite(x) go_vclamp((x), go_vset1(-FLT_MAX), go_vset1(FLT_MAX))

#endif
