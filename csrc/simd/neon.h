/* SIMD mapping for aarch64 NEON: 4 floats a register. */
#ifndef GGMLOPT_SIMD_NEON_H
#define GGMLOPT_SIMD_NEON_H

#include <arm_neon.h>
#include "simd/k_scales.h"
#include "simd/scalar_math.h"

#define GO_FN(name) name##_neon
#define GO_EPR 4

typedef float32x4_t go_vf;
typedef struct { float64x2_t lo, hi; } go_dacc;

#define go_vload(p) vld1q_f32(p)
#define go_vstore(p, v) vst1q_f32((p), (v))
/* stores around the caches: a plain store here */
#define go_vstream(p, v) vst1q_f32((p), (v))
#define go_vstream_done() ((void)0)
#define go_vset1(x) vdupq_n_f32(x)
#define go_vadd(a, b) vaddq_f32((a), (b))
#define go_vsub(a, b) vsubq_f32((a), (b))
#define go_vmul(a, b) vmulq_f32((a), (b))
#define go_vdiv(a, b) vdivq_f32((a), (b))
#define go_vfma(a, b, c) vfmaq_f32((c), (a), (b))
#define go_vsqrt(a) vsqrtq_f32(a)
/* 1/a within 2 ulp: the 8-bit estimate and two Newton steps */
static inline float32x4_t go_vrecip(float32x4_t a) {
    float32x4_t r = vrecpeq_f32(a);
    r = vmulq_f32(r, vrecpsq_f32(a, r));
    return vmulq_f32(r, vrecpsq_f32(a, r));
}
/* maxNum: a NaN lane in one operand yields the other operand's lane */
#define go_vmax(a, b) vmaxnmq_f32((a), (b))
/* x > 0 ? x : 0 with NaN kept: FMAX propagates NaN and gives +0 for (-0, +0) */
#define go_vrelu(x) vmaxq_f32((x), vdupq_n_f32(0.0f))
/* b where a != 0: clear lanes whose a compares equal to 0 */
#define go_vmask_nonzero(a, b) \
    vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(b), vceqzq_f32(a)))
#define go_vany_eq(v, s) (vmaxvq_u32(vceqq_f32((v), (s))) != 0)
/* index of the last lane of v equal to s, -1 for none: the largest of
 * (lane + 1) over equal lanes */
static inline int go_vlast_eq(float32x4_t v, float32x4_t s) {
    static const uint32_t lane_plus_one[4] = {1, 2, 3, 4};
    return (int)vmaxvq_u32(vandq_u32(vceqq_f32(v, s), vld1q_u32(lane_plus_one))) - 1;
}
#define go_vreduce_max(v) vmaxnmvq_f32(v)

static inline double go_vreduce_add(float32x4_t v) {
    const float64x2_t d = vaddq_f64(vcvt_f64_f32(vget_low_f32(v)), vcvt_high_f64_f32(v));
    return vaddvq_f64(d);
}

static inline go_dacc go_dacc_zero(void) {
    go_dacc a = {vdupq_n_f64(0.0), vdupq_n_f64(0.0)};
    return a;
}
static inline go_dacc go_dacc_add(go_dacc acc, float32x4_t v) {
    acc.lo = vaddq_f64(acc.lo, vcvt_f64_f32(vget_low_f32(v)));
    acc.hi = vaddq_f64(acc.hi, vcvt_high_f64_f32(v));
    return acc;
}
static inline go_dacc go_dacc_add_sq(go_dacc acc, float32x4_t v) {
    const float64x2_t lo = vcvt_f64_f32(vget_low_f32(v));
    const float64x2_t hi = vcvt_high_f64_f32(v);
    acc.lo = vfmaq_f64(acc.lo, lo, lo);
    acc.hi = vfmaq_f64(acc.hi, hi, hi);
    return acc;
}
static inline double go_dacc_reduce(go_dacc acc) { return vaddvq_f64(vaddq_f64(acc.lo, acc.hi)); }

/* exp(r) for a reduced argument r (about ln2/2 at most): 1 + r + r^2 * P(r), the
 * polynomial both exponentials below share */
static inline float32x4_t go_vexp_poly(float32x4_t r) {
    float32x4_t p = vdupq_n_f32(GO_EXP_P0);
    p = vfmaq_f32(vdupq_n_f32(GO_EXP_P1), p, r);
    p = vfmaq_f32(vdupq_n_f32(GO_EXP_P2), p, r);
    p = vfmaq_f32(vdupq_n_f32(GO_EXP_P3), p, r);
    p = vfmaq_f32(vdupq_n_f32(GO_EXP_P4), p, r);
    p = vfmaq_f32(vdupq_n_f32(GO_EXP_P5), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
    return p;
}

/* exp(x) for x <= 0 (see simd/avx2.h): go_expf_scalar's polynomial, 4 lanes at
 * a time, with n read from the low bits of x*log2(e) + 1.5*2^23. */
static inline float32x4_t go_vexp_nonpos(float32x4_t x) {
    const uint32x4_t too_small = vcltq_f32(x, vdupq_n_f32(GO_EXP_LO));
    const float32x4_t t = vfmaq_f32(vdupq_n_f32(GO_ROUND_MAGIC), x, vdupq_n_f32(GO_EXP_LOG2E));
    const float32x4_t n = vsubq_f32(t, vdupq_n_f32(GO_ROUND_MAGIC));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(GO_EXP_C1));
    r = vfmsq_f32(r, n, vdupq_n_f32(GO_EXP_C2));
    const float32x4_t p = go_vexp_poly(r);
    const float32x4_t pow2n = vreinterpretq_f32_s32(vshlq_n_s32(
        vaddq_s32(vreinterpretq_s32_f32(t), vdupq_n_s32(127 - GO_ROUND_MAGIC_BITS)), 23));
    const float32x4_t e = vmulq_f32(p, pow2n);
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(e), too_small));
}

/* The first n (0 < n < 4) lanes of p, the others set to fill; through a stack
 * copy, so nothing past p + n is read. */
static inline float32x4_t go_vload_partial(const float *p, int64_t n, float fill) {
    float tmp[4] = {fill, fill, fill, fill};
    memcpy(tmp, p, (size_t)n * sizeof(float));
    return vld1q_f32(tmp);
}
static inline void go_vstore_partial(float *p, float32x4_t v, int64_t n) {
    float tmp[4];
    vst1q_f32(tmp, v);
    memcpy(p, tmp, (size_t)n * sizeof(float));
}

/* lanes p[idx[0]], ..., p[idx[3]] for 4 int32 offsets */
static inline float32x4_t go_vgather(const float *p, const int32_t *idx) {
    const float lanes[4] = {p[idx[0]], p[idx[1]], p[idx[2]], p[idx[3]]};
    return vld1q_f32(lanes);
}
/* r[0..3] transposed in place (lane j of r[i] <-> lane i of r[j]) */
static inline void go_vtranspose(float32x4_t r[4]) {
    const float32x4x2_t p01 = vtrnq_f32(r[0], r[1]), p23 = vtrnq_f32(r[2], r[3]);
    r[0] = vcombine_f32(vget_low_f32(p01.val[0]), vget_low_f32(p23.val[0]));
    r[1] = vcombine_f32(vget_low_f32(p01.val[1]), vget_low_f32(p23.val[1]));
    r[2] = vcombine_f32(vget_high_f32(p01.val[0]), vget_high_f32(p23.val[0]));
    r[3] = vcombine_f32(vget_high_f32(p01.val[1]), vget_high_f32(p23.val[1]));
}

static inline float32x4_t go_vload_u8(const uint8_t *p) {
    uint32_t four;
    memcpy(&four, p, 4); /* exactly 4 bytes: never reads past the array */
    const uint16x8_t w = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(four)));
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(w)));
}
static inline float32x4_t go_vload_i8(const int8_t *p) {
    int32_t four;
    memcpy(&four, p, 4); /* exactly 4 bytes: never reads past the array */
    const int16x8_t w = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
}
/* 16 bytes' low and high nibbles into lo[16] and hi[16] */
static inline void go_nibbles16(const uint8_t *src, uint8_t *lo, uint8_t *hi) {
    const uint8x16_t v = vld1q_u8(src);
    vst1q_u8(lo, vandq_u8(v, vdupq_n_u8(15)));
    vst1q_u8(hi, vshrq_n_u8(v, 4));
}
/* the sums a row's Q8_0 / Q4_0 blocks go into (kernels/quant.inc's
 * quant_dot_q8_rows) */
typedef float32x4_t go_vq;
#define go_vq_zero() vdupq_n_f32(0.0f)
#define go_vq_reduce(v) vaddvq_f32(v)

/* int32 lanes summing to dot(a, b) over 32 int8 pairs: int16 products (at
 * most 128 * 128) added pairwise into int32, exact */
static inline int32x4_t go_idot_i8x32(int8x16_t a0, int8x16_t a1, const int8_t *b) {
    const int8x16_t b0 = vld1q_s8(b), b1 = vld1q_s8(b + 16);
    int32x4_t s = vpaddlq_s16(vmull_s8(vget_low_s8(a0), vget_low_s8(b0)));
    s = vpadalq_s16(s, vmull_s8(vget_high_s8(a0), vget_high_s8(b0)));
    s = vpadalq_s16(s, vmull_s8(vget_low_s8(a1), vget_low_s8(b1)));
    return vpadalq_s16(s, vmull_s8(vget_high_s8(a1), vget_high_s8(b1)));
}
/* the same over 16 pairs */
static inline int32x4_t go_idot_i8x16(int8x16_t a, const int8_t *b) {
    const int8x16_t v = vld1q_s8(b);
    const int32x4_t s = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(v)));
    return vpadalq_s16(s, vmull_s8(vget_high_s8(a), vget_high_s8(v)));
}
static inline float32x4_t go_dot_i8x32(int8x16_t a0, int8x16_t a1, const int8_t *b) {
    return vcvtq_f32_s32(go_idot_i8x32(a0, a1, b));
}
/* acc plus sa * dot(wa, x[0:32]) + sb * dot(wb, x[32:64]) for two Q8_0
 * blocks' quants, and for two Q4_0 blocks' nibbles (see the scalar path) */
static inline float32x4_t go_dot_q8_pair(const int8_t *wa, const int8_t *wb, const int8_t *x,
                                         float sa, float sb, float32x4_t acc) {
    acc = vfmaq_f32(acc, go_dot_i8x32(vld1q_s8(wa), vld1q_s8(wa + 16), x), vdupq_n_f32(sa));
    return vfmaq_f32(acc, go_dot_i8x32(vld1q_s8(wb), vld1q_s8(wb + 16), x + 32),
                     vdupq_n_f32(sb));
}
/* two blocks' nibbles less off (8: Q4_0, 0: Q4_1) against x[0:64] */
static inline float32x4_t go_dot_q4_pair_off(const uint8_t *na, const uint8_t *nb,
                                             const int8_t *x, float sa, float sb, int8_t off,
                                             float32x4_t acc) {
    const int8x16_t o = vdupq_n_s8(off);
    const uint8x16_t va = vld1q_u8(na), vb = vld1q_u8(nb);
    const int8x16_t alo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(va, vdupq_n_u8(15))), o);
    const int8x16_t ahi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(va, 4)), o);
    const int8x16_t blo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(vb, vdupq_n_u8(15))), o);
    const int8x16_t bhi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(vb, 4)), o);
    acc = vfmaq_f32(acc, go_dot_i8x32(alo, ahi, x), vdupq_n_f32(sa));
    return vfmaq_f32(acc, go_dot_i8x32(blo, bhi, x + 32), vdupq_n_f32(sb));
}
#define go_dot_q4_pair(na, nb, x, sa, sb, acc) go_dot_q4_pair_off(na, nb, x, sa, sb, 8, acc)
/* Q4_1's nibbles as they are (see the scalar path) */
#define go_dot_q4_1_pair(na, nb, x, sa, sb, acc) go_dot_q4_pair_off(na, nb, x, sa, sb, 0, acc)
/* a Q5_0 (off 16) or Q5_1 (off 0) block's quants (nibble | fifth bit << 4,
 * minus off; low nibbles first) as two vectors, from its 4 bytes of fifth
 * bits on */
static inline void go_q5_quants(const uint8_t *blk, int8_t off, int8x16_t *lo, int8x16_t *hi) {
    uint32_t bits;
    memcpy(&bits, blk, 4);
    static const uint8_t one_bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t sel = vld1q_u8(one_bit);
    const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(bits));
    /* byte j of the first vector: bit j (bytes 0-1 of the word), of the second bit 16 + j */
    const uint8x16_t w0 = vcombine_u8(vdup_lane_u8(b, 0), vdup_lane_u8(b, 1));
    const uint8x16_t w1 = vcombine_u8(vdup_lane_u8(b, 2), vdup_lane_u8(b, 3));
    const uint8x16_t h0 = vandq_u8(vtstq_u8(w0, sel), vdupq_n_u8(16));
    const uint8x16_t h1 = vandq_u8(vtstq_u8(w1, sel), vdupq_n_u8(16));
    const uint8x16_t q = vld1q_u8(blk + 4);
    *lo = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vandq_u8(q, vdupq_n_u8(15)), h0)), vdupq_n_s8(off));
    *hi = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(q, 4), h1)), vdupq_n_s8(off));
}
/* acc plus sa * dot(a's quants, x[0:32]) + sb * dot(b's, x[32:64]) for two
 * Q5_0 (off 16) or Q5_1 (off 0) blocks */
static inline float32x4_t go_dot_q5_pair_off(const uint8_t *a, const uint8_t *b, const int8_t *x,
                                             float sa, float sb, int8_t off, float32x4_t acc) {
    int8x16_t lo, hi;
    go_q5_quants(a, off, &lo, &hi);
    acc = vfmaq_f32(acc, go_dot_i8x32(lo, hi, x), vdupq_n_f32(sa));
    go_q5_quants(b, off, &lo, &hi);
    return vfmaq_f32(acc, go_dot_i8x32(lo, hi, x + 32), vdupq_n_f32(sb));
}
#define go_dot_q5_pair(a, b, x, sa, sb, acc) go_dot_q5_pair_off(a, b, x, sa, sb, 16, acc)
#define go_dot_q5_1_pair(a, b, x, sa, sb, acc) go_dot_q5_pair_off(a, b, x, sa, sb, 0, acc)
/* The K types against activations rounded to Q8_K (see simd/x86_int8.h): a
 * super-block's sub-block products times their integer scales, in int32 lanes */
typedef int32x4_t go_vqi;
#define go_vqi_zero() vdupq_n_s32(0)
#define go_vq_add_scaled(s, d, acc) vfmaq_f32((acc), vcvtq_f32_s32(s), vdupq_n_f32(d))
/* two Q4_K sub-blocks from their 32 bytes: low nibbles then high ones */
static inline int32x4_t go_dot_q4k_pair_i(const uint8_t *q, const int8_t *x, go_ksc sc, int c,
                                          int32x4_t acc) {
    const int s_lo = sc.s[2 * c], s_hi = sc.s[2 * c + 1];
    const uint8x16_t q0 = vld1q_u8(q), q1 = vld1q_u8(q + 16), m = vdupq_n_u8(15);
    acc = vmlaq_n_s32(acc, go_idot_i8x32(vreinterpretq_s8_u8(vandq_u8(q0, m)),
                                         vreinterpretq_s8_u8(vandq_u8(q1, m)), x), s_lo);
    return vmlaq_n_s32(acc, go_idot_i8x32(vreinterpretq_s8_u8(vshrq_n_u8(q0, 4)),
                                          vreinterpretq_s8_u8(vshrq_n_u8(q1, 4)), x + 32), s_hi);
}
/* two Q5_K sub-blocks, pair c: the fifth bits bits 2c and 2c + 1 of qh */
static inline int32x4_t go_dot_q5k_pair_i(const uint8_t *ql, const uint8_t *qh, int c,
                                          const int8_t *x, go_ksc sc, int32x4_t acc) {
    const int s_lo = sc.s[2 * c], s_hi = sc.s[2 * c + 1];
    const int8x16_t lo_shift = vdupq_n_s8((int8_t)(-2 * c)), hi_shift = vdupq_n_s8((int8_t)(-2 * c - 1));
    const uint8x16_t m = vdupq_n_u8(15), one = vdupq_n_u8(1);
    int8x16_t lo[2], hi[2];
    for (int k = 0; k < 2; ++k) {
        const uint8x16_t q = vld1q_u8(ql + 16 * k), h = vld1q_u8(qh + 16 * k);
        lo[k] = vreinterpretq_s8_u8(vorrq_u8(
            vandq_u8(q, m), vshlq_n_u8(vandq_u8(vshlq_u8(h, lo_shift), one), 4)));
        hi[k] = vreinterpretq_s8_u8(vorrq_u8(
            vshrq_n_u8(q, 4), vshlq_n_u8(vandq_u8(vshlq_u8(h, hi_shift), one), 4)));
    }
    acc = vmlaq_n_s32(acc, go_idot_i8x32(lo[0], lo[1], x), s_lo);
    return vmlaq_n_s32(acc, go_idot_i8x32(hi[0], hi[1], x + 32), s_hi);
}
/* sc[2c] * dot(u[0:16] - off, x[0:16]) + sc[2c + 1] * dot(u[16:32] - off,
 * x[16:32]) added to acc for quants u of at most 127 as two vectors */
static inline int32x4_t go_dot_u8_halves_i(uint8x16_t u0, uint8x16_t u1, int off, const int8_t *x,
                                           go_ksc sc, int c, int32x4_t acc) {
    const int8x16_t o = vdupq_n_s8((int8_t)off);
    acc = vmlaq_n_s32(acc, go_idot_i8x16(vsubq_s8(vreinterpretq_s8_u8(u0), o), x), sc.s[2 * c]);
    return vmlaq_n_s32(acc, go_idot_i8x16(vsubq_s8(vreinterpretq_s8_u8(u1), o), x + 16),
                       sc.s[2 * c + 1]);
}
/* (v >> shift) & mask for 16 bytes */
static inline uint8x16_t go_bits16(const uint8_t *v, int shift, int mask) {
    return vandq_u8(vshlq_u8(vld1q_u8(v), vdupq_n_s8((int8_t)-shift)), vdupq_n_u8((uint8_t)mask));
}
/* 32 values of a Q6_K super-block, block c of a half: ((ql >> 4 (c >> 1)) & 15
 * | ((qh >> 2c) & 3) << 4) - 32, the first 16 times sc[2c], the next sc[2c + 1] */
static inline int32x4_t go_dot_q6k_32_i(const uint8_t *ql, const uint8_t *qh, int c,
                                        const int8_t *x, go_ksc sc, int32x4_t acc) {
    uint8x16_t u[2];
    for (int k = 0; k < 2; ++k)
        u[k] = vorrq_u8(go_bits16(ql + 16 * k, 4 * (c >> 1), 15),
                        vshlq_n_u8(go_bits16(qh + 16 * k, 2 * c, 3), 4));
    return go_dot_u8_halves_i(u[0], u[1], 32, x, sc, c, acc);
}
/* 32 values of a Q2_K super-block without their mins, block c of a half:
 * (q >> 2c) & 3 */
static inline int32x4_t go_dot_q2k_32_i(const uint8_t *q, int c, const int8_t *x, go_ksc sc,
                                        int32x4_t acc) {
    return go_dot_u8_halves_i(go_bits16(q, 2 * c, 3), go_bits16(q + 16, 2 * c, 3), 0, x, sc, c,
                              acc);
}
/* 32 values of a Q3_K super-block, block c of half n: ((q >> 2c) & 3 | ((hm >>
 * (4n + c)) & 1) << 2) - 4 */
static inline int32x4_t go_dot_q3k_32_i(const uint8_t *q, const uint8_t *hm, int n, int c,
                                        const int8_t *x, go_ksc sc, int32x4_t acc) {
    uint8x16_t u[2];
    for (int k = 0; k < 2; ++k)
        u[k] = vorrq_u8(go_bits16(q + 16 * k, 2 * c, 3),
                        vshlq_n_u8(go_bits16(hm + 16 * k, 4 * n + c, 1), 2));
    return go_dot_u8_halves_i(u[0], u[1], 4, x, sc, c, acc);
}
/* two IQ4-coded runs of 32 (16 bytes each, low nibbles first), the grid's
 * values looked up by a table instruction, times x[0:64], each run times its
 * integer scale */
static inline int32x4_t go_dot_iq4_pair_i(const uint8_t *qa, const uint8_t *qb,
                                          const int8_t *grid, const int8_t *x, int sa, int sb,
                                          int32x4_t acc) {
    const int8x16_t g = vld1q_s8(grid);
    const uint8x16_t a = vld1q_u8(qa), b = vld1q_u8(qb), m = vdupq_n_u8(15);
    acc = vmlaq_n_s32(acc, go_idot_i8x32(vqtbl1q_s8(g, vandq_u8(a, m)),
                                         vqtbl1q_s8(g, vshrq_n_u8(a, 4)), x), sa);
    return vmlaq_n_s32(acc, go_idot_i8x32(vqtbl1q_s8(g, vandq_u8(b, m)),
                                          vqtbl1q_s8(g, vshrq_n_u8(b, 4)), x + 32), sb);
}
/* out[j] = (src[j] >> shift) & mask for 16 bytes */
static inline void go_bitfield16(const uint8_t *src, int shift, uint8_t mask, uint8_t *out) {
    const uint8x16_t v = vshlq_u8(vld1q_u8(src), vdupq_n_s8((int8_t)-shift));
    vst1q_u8(out, vandq_u8(v, vdupq_n_u8(mask)));
}
/* out[j] = lo[j] + 16 hi[j] - off for 16 bytes (hi[j] < 16; see simd/x86_bytes.h) */
static inline void go_merge16(const uint8_t *lo, const uint8_t *hi, int8_t off, int8_t *out) {
    const uint8x16_t v = vorrq_u8(vld1q_u8(lo), vshlq_n_u8(vld1q_u8(hi), 4));
    vst1q_s8(out, vreinterpretq_s8_u8(vsubq_u8(v, vdupq_n_u8((uint8_t)off))));
}
/* out[j] = lo[j] + 4 hi[j] - off for 16 bytes (see simd/x86_bytes.h) */
static inline void go_merge16_2(const uint8_t *lo, const uint8_t *hi, int8_t off, int8_t *out) {
    const uint8x16_t v = vorrq_u8(vld1q_u8(lo), vshlq_n_u8(vld1q_u8(hi), 2));
    vst1q_s8(out, vreinterpretq_s8_u8(vsubq_u8(v, vdupq_n_u8((uint8_t)off))));
}
/* lo[j] = grid[src[j] & 15], hi[j] = grid[src[j] >> 4] for 16 bytes (see
 * simd/x86_bytes.h): one table lookup a vector */
static inline void go_grid16(const uint8_t *src, const int8_t *grid, int8_t *lo, int8_t *hi) {
    const int8x16_t t = vld1q_s8(grid);
    const uint8x16_t v = vld1q_u8(src);
    vst1q_s8(lo, vqtbl1q_s8(t, vandq_u8(v, vdupq_n_u8(15))));
    vst1q_s8(hi, vqtbl1q_s8(t, vshrq_n_u8(v, 4)));
}
/* acc plus sa * dot(grid[a's nibbles], x[0:32]) + sb * dot(grid[b's], x[32:64]) for
 * two IQ4_NL-coded runs of 32 (see simd/x86_int8.h): the values looked up into
 * bytes, then go_dot_q8_pair's integer dots */
static inline go_vq go_dot_iq4_pair(const uint8_t *qa, const uint8_t *qb, const int8_t *grid,
                                    const int8_t *x, float sa, float sb, go_vq acc) {
    int8_t wa[32], wb[32];
    go_grid16(qa, grid, wa, wa + 16);
    go_grid16(qb, grid, wb, wb + 16);
    return go_dot_q8_pair(wa, wb, x, sa, sb, acc);
}
/* lanes (float)((x >> (j0 + lane)) & 1) */
static inline float32x4_t go_vbits(uint32_t x, int j0) {
    const int32_t shifts[4] = {-j0, -j0 - 1, -j0 - 2, -j0 - 3};
    const uint32x4_t b = vshlq_u32(vdupq_n_u32(x), vld1q_s32(shifts));
    return vcvtq_f32_u32(vandq_u32(b, vdupq_n_u32(1)));
}
/* v + 16 in the lanes whose bit (j0 + lane) of x is set */
#define go_vadd16_bits(v, x, j0) go_vfma(go_vbits((x), (j0)), go_vset1(16.0f), (v))
static inline float32x4_t go_vload_f16(const uint16_t *p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}
/* bfloat16 is float32's upper half: widen, shift into place */
static inline float32x4_t go_vload_bf16(const uint16_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

/* bfloat16 pairs (kernels/gemm_bf16.inc): each lane holds two bf16 values, the
 * even one in its low half; a pair vector from 4 values of each of two rows,
 * and each half of a pair vector as float32 */
static inline float32x4_t go_vpair_bf16(const uint16_t *even, const uint16_t *odd) {
    return vreinterpretq_f32_u32(vorrq_u32(vmovl_u16(vld1_u16(even)), vshll_n_u16(vld1_u16(odd), 16)));
}
/* the pairs of 8 consecutive bf16 values of one row (p[2i], p[2i + 1] in lane i) */
static inline float32x4_t go_vload_bf16_pairs(const uint16_t *p) {
    return vreinterpretq_f32_u16(vld1q_u16(p));
}
static inline float32x4_t go_vbf16_even(float32x4_t v) {
    return vreinterpretq_f32_u32(vshlq_n_u32(vreinterpretq_u32_f32(v), 16));
}
static inline float32x4_t go_vbf16_odd(float32x4_t v) {
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(v), vdupq_n_u32(0xffff0000u)));
}

/* 4 floats to bfloat16 bits at p, as go_f32_to_bf16 rounds each. */
static inline void go_vstore_bf16(uint16_t *p, float32x4_t v) {
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t rounded = vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fff)));
    const uint32x4_t quiet = vorrq_u32(u, vdupq_n_u32(0x400000));
    const uint32x4_t is_num = vceqq_f32(v, v);
    vst1_u16(p, vshrn_n_u32(vbslq_u32(is_num, rounded, quiet), 16));
}

static inline int64_t go_count_eq_i32(const int32_t *a, const int32_t *b) {
    const uint32x4_t eq = vceqq_s32(vld1q_s32(a), vld1q_s32(b));
    return (int64_t)vaddvq_u32(vshrq_n_u32(eq, 31));
}

/* ---- for the activations (simd/vmath.h) ---- */

/* exp(x + lo) for x <= 0, |lo| <= 4: go_exp_sum_scalar's algorithm, 4 lanes */
static inline float32x4_t go_vexp_sum(float32x4_t x, float32x4_t lo) {
    x = vmaxq_f32(x, vdupq_n_f32(GO_EXPS_MIN)); /* FMAX propagates NaN */
    const float32x4_t t = vfmaq_f32(vdupq_n_f32(GO_ROUND_MAGIC), vaddq_f32(x, lo),
                                    vdupq_n_f32(GO_EXP_LOG2E));
    const float32x4_t n = vsubq_f32(t, vdupq_n_f32(GO_ROUND_MAGIC));
    float32x4_t r = vaddq_f32(vfmsq_f32(x, n, vdupq_n_f32(GO_EXP_C1)), lo);
    r = vfmsq_f32(r, n, vdupq_n_f32(GO_EXP_C2));
    const float32x4_t p = go_vexp_poly(r);
    const int32x4_t ni = vsubq_s32(vreinterpretq_s32_f32(t), vdupq_n_s32(GO_ROUND_MAGIC_BITS));
    const int32x4_t n1 = vshrq_n_s32(ni, 1);
    const int32x4_t n2 = vsubq_s32(ni, n1);
    const float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, vdupq_n_s32(127)), 23));
    const float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, vdupq_n_s32(127)), 23));
    return vmulq_f32(vmulq_f32(p, s1), s2);
}
#define go_vsplit_hi(x) \
    vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(x), vdupq_n_u32(0xFFFFF000u)))
#define go_vabs(x) vabsq_f32(x)
#define go_vcopysign(mag, s) vbslq_f32(vdupq_n_u32(0x80000000u), (s), (mag))
/* FMIN/FMAX propagate NaN */
#define go_vclamp(x, lo, hi) vminq_f32(vmaxq_f32((x), (lo)), (hi))
#define go_vsel_lt(a, b, x, y) vbslq_f32(vcltq_f32((a), (b)), (x), (y))

/* even = p[0], p[2], p[4], p[6], odd = p[1], ..., p[7] */
#define GO_HAS_LOAD_PAIRS 1
static inline void go_vload_pairs(const float *p, float32x4_t *even, float32x4_t *odd) {
    const float32x4x2_t t = vld2q_f32(p);
    *even = t.val[0];
    *odd = t.val[1];
}

#endif
