/* Scalar helpers every path uses for its leftover elements. */
#ifndef GGMLOPT_SCALAR_MATH_H
#define GGMLOPT_SCALAR_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float go_bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t go_f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* Two bfloat16 values as the bits of one float, the even one in the low half:
 * a k pair of the bf16 products (kernels/gemm_bf16.inc), carried in float
 * storage so every path loads and broadcasts it as a float.  go_bf16_pair_at
 * reads p[0], p[1] in one 32-bit load (little-endian, as x86-64 and aarch64). */
static inline float go_bf16_pair(uint16_t even, uint16_t odd) {
    return go_bits_to_f32((uint32_t)even | (uint32_t)odd << 16);
}
static inline float go_bf16_pair_at(const uint16_t *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    return go_bits_to_f32(u);
}

/* Ask for the cache line at p ahead of its use (a read, kept in every level):
 * a no-op where the compiler has no prefetch; never faults, even past an array. */
#if defined(__GNUC__) || defined(__clang__)
#define go_prefetch(p) __builtin_prefetch((p), 0, 3)
/* the same into the level-2 cache and below, not level 1 (prefetcht1): data for
 * later, kept out of the way of what the loop reads now */
#define go_prefetch_l2(p) __builtin_prefetch((p), 0, 2)
#else
#define go_prefetch(p) ((void)(p))
#define go_prefetch_l2(p) ((void)(p))
#endif

/* IEEE half to float, exact for every input (subnormals, inf, NaN). */
static inline float go_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    if (exp == 0x1fu) return go_bits_to_f32(sign | 0x7f800000u | (mant << 13));
    if (exp != 0) return go_bits_to_f32(sign | ((exp + 112u) << 23) | (mant << 13));
    /* zero or subnormal: mant * 2^-24, exact in float */
    const float mag = (float)mant * (1.0f / 16777216.0f);
    return sign ? -mag : mag;
}

/* float to bfloat16 bits, rounded to nearest even (as torch and ggml round); a NaN
 * stays a NaN (quiet, its sign kept) instead of rounding its payload into inf;
 * subnormals are kept, not flushed (vcvtneps2bf16 would flush them). */
static inline uint16_t go_f32_to_bf16(float f) {
    const uint32_t u = go_f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* x > 0 ? x : 0, NaN kept (as torch; a NaN must reach the loss, where training
 * stops, not vanish in a hidden layer), -0 gives +0 */
static inline float go_relu_scalar(float x) { return x > 0.0f || x != x ? x : 0.0f; }

/* Cephes-style expf: range reduction by ln2 in two parts, degree-6 polynomial.
 * Within 2 ulp of expf on [-87, 88]; 0 below -88 (and for -inf), clamped at 88
 * (the kernels only call it on x - max(x) <= 0).  Written without libm so the
 * scalar path matches the vector paths' algorithm. */
#define GO_EXP_HI 88.0f
#define GO_EXP_LO (-88.0f)
#define GO_EXP_LOG2E 1.44269504088896341f
#define GO_EXP_C1 0.693359375f
#define GO_EXP_C2 (-2.12194440e-4f)
#define GO_EXP_P0 1.9875691500e-4f
#define GO_EXP_P1 1.3981999507e-3f
#define GO_EXP_P2 8.3334519073e-3f
#define GO_EXP_P3 4.1665795894e-2f
#define GO_EXP_P4 1.6666665459e-1f
#define GO_EXP_P5 5.0000001201e-1f
/* 1.5 * 2^23: adding and subtracting it rounds a float to the nearest integer */
#define GO_ROUND_MAGIC 12582912.0f
#define GO_ROUND_MAGIC_BITS 0x4B400000

static inline float go_expf_scalar(float x) {
    if (!(x >= GO_EXP_LO)) return x != x ? x : 0.0f; /* NaN stays NaN */
    if (x > GO_EXP_HI) x = GO_EXP_HI;
    volatile float t = x * GO_EXP_LOG2E + GO_ROUND_MAGIC; /* volatile: keep the rounding trick */
    const float n = t - GO_ROUND_MAGIC;
    float r = x - n * GO_EXP_C1;
    r = r - n * GO_EXP_C2;
    float p = GO_EXP_P0;
    p = p * r + GO_EXP_P1;
    p = p * r + GO_EXP_P2;
    p = p * r + GO_EXP_P3;
    p = p * r + GO_EXP_P4;
    p = p * r + GO_EXP_P5;
    p = p * (r * r) + r + 1.0f;
    const int32_t ni = (int32_t)n;
    return p * go_bits_to_f32((uint32_t)(ni + 127) << 23);
}

/* ---- exp over the whole non-positive range, for the activations ----------
 * exp(x + lo) for x <= 0 and a small correction |lo| <= 4 (the low part of an
 * argument that does not fit one float, such as -x*x/2).  The same range
 * reduction and polynomial as go_expf_scalar, with lo added to the reduced
 * argument (x - n*C1 is exact, so lo keeps its bits), and 2^n applied as two
 * factors 2^(n/2) * 2^(n - n/2): results between 2^-149 and 2^-126 come out as
 * correctly scaled subnormals instead of 0.  x below GO_EXPS_MIN (and -inf)
 * gives 0; NaN stays NaN.  Every path runs this algorithm (simd/avx2.h and
 * simd/neon.h with fused multiply-adds, which moves the last bit only). */
#define GO_EXPS_MIN (-110.0f)

static inline float go_exp_sum_scalar(float x, float lo) {
    if (x < GO_EXPS_MIN) x = GO_EXPS_MIN; /* NaN compares false and stays */
    volatile float t = (x + lo) * GO_EXP_LOG2E + GO_ROUND_MAGIC; /* volatile: keep the rounding */
    const float tv = t;
    const float n = tv - GO_ROUND_MAGIC;
    float r = (x - n * GO_EXP_C1) + lo;
    r = r - n * GO_EXP_C2;
    float p = GO_EXP_P0;
    p = p * r + GO_EXP_P1;
    p = p * r + GO_EXP_P2;
    p = p * r + GO_EXP_P3;
    p = p * r + GO_EXP_P4;
    p = p * r + GO_EXP_P5;
    p = p * (r * r) + (r + 1.0f);
    /* n from the bits of t (no float-to-int conversion, which NaN would make
     * undefined); unsigned arithmetic keeps garbage lanes of a NaN defined */
    const int32_t ni = (int32_t)(go_f32_to_bits(tv) - (uint32_t)GO_ROUND_MAGIC_BITS);
    const int32_t n1 = ni / 2, n2 = ni - n1;
    const float s1 = go_bits_to_f32((uint32_t)(n1 + 127) << 23);
    const float s2 = go_bits_to_f32((uint32_t)(n2 + 127) << 23);
    return (p * s1) * s2;
}

/* x with the low 12 bits of its significand cleared: squaring the 12-bit head
 * is exact, which is how -x*x/2 is split into a float and a small remainder */
static inline float go_split_hi_scalar(float x) {
    return go_bits_to_f32(go_f32_to_bits(x) & 0xFFFFF000u);
}

#endif
