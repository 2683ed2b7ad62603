/* SIMD mapping for the portable path: a "vector" of one float.  The kernels'
 * main loops then run over every element and their leftover loops never run. */
#ifndef GGMLOPT_SIMD_SCALAR_H
#define GGMLOPT_SIMD_SCALAR_H

#include "simd/k_scales.h"
#include "simd/scalar_math.h"

#define GO_FN(name) name##_scalar
#define GO_EPR 1

typedef float go_vf;
typedef double go_dacc;

#define go_vload(p) (*(p))
#define go_vstore(p, v) (*(p) = (v))
/* stores around the caches: a plain store here */
#define go_vstream(p, v) (*(p) = (v))
#define go_vstream_done() ((void)0)
#define go_vset1(x) ((float)(x))
#define go_vadd(a, b) ((a) + (b))
#define go_vsub(a, b) ((a) - (b))
#define go_vmul(a, b) ((a) * (b))
#define go_vdiv(a, b) ((a) / (b))
#define go_vfma(a, b, c) ((a) * (b) + (c))
#define go_vsqrt(a) sqrtf(a)
#define go_vrecip(a) (1.0f / (a))
/* a NaN in a yields b */
#define go_vmax(a, b) ((a) > (b) ? (a) : (b))
/* b where a != 0, else 0 (a NaN counts as nonzero) */
#define go_vmask_nonzero(a, b) ((a) != 0.0f ? (b) : 0.0f)
#define go_vrelu(x) go_relu_scalar(x)
#define go_vexp_nonpos(x) go_expf_scalar(x)
#define go_vreduce_add(v) ((double)(v))
#define go_vreduce_max(v) (v)
#define go_vany_eq(v, s) ((v) == (s))
#define go_vlast_eq(v, s) ((v) == (s) ? 0 : -1)

#define go_dacc_zero() 0.0
#define go_dacc_add(acc, v) ((acc) + (double)(v))
#define go_dacc_add_sq(acc, v) ((acc) + (double)(v) * (double)(v))
#define go_dacc_reduce(acc) (acc)

/* one-lane vectors are never partial; defined for kernels written for every path */
#define go_vload_partial(p, n, fill) ((n) > 0 ? *(p) : (fill))
#define go_vstore_partial(p, v, n) ((void)((n) > 0 ? (*(p) = (v)) : 0.0f))

#define go_vgather(p, idx) ((p)[(idx)[0]])
/* one lane: a 1 x 1 block is its own transpose */
static inline void go_vtranspose(float r[1]) { (void)r; }

/* bfloat16 pairs (kernels/gemm_bf16.inc): each lane holds two bf16 values, the
 * even one in its low half; a pair vector from two rows of bf16, and each half
 * of a pair vector as float32 */
#define go_vpair_bf16(even, odd) go_bf16_pair(*(even), *(odd))
#define go_vload_bf16_pairs(p) go_bf16_pair_at(p)
#define go_vbf16_even(v) go_bits_to_f32(go_f32_to_bits(v) << 16)
#define go_vbf16_odd(v) go_bits_to_f32(go_f32_to_bits(v) & 0xffff0000u)

#define go_vload_u8(p) ((float)*(p))
#define go_vload_i8(p) ((float)*(p))
static inline void go_nibbles16(const uint8_t *src, uint8_t *lo, uint8_t *hi) {
    for (int j = 0; j < 16; ++j) {
        lo[j] = src[j] & 15;
        hi[j] = src[j] >> 4;
    }
}
/* the sums a row's Q8_0 / Q4_0 blocks go into (kernels/quant.inc's
 * quant_dot_q8_rows) */
typedef float go_vq;
#define go_vq_zero() 0.0f
#define go_vq_reduce(v) (v)

/* acc plus sa * dot(wa, x[0:32]) + sb * dot(wb, x[32:64]): two Q8_0 blocks'
 * int8 quants against 64 int8 activations (within [-127, 127]), each block's
 * integer dot exact; and the same for two Q4_0 blocks' 16 bytes of nibbles
 * (low nibbles the first 16 values, each nibble minus 8) */
static inline float go_dot_q8_pair(const int8_t *wa, const int8_t *wb, const int8_t *x,
                                   float sa, float sb, float acc) {
    int32_t a = 0, b = 0;
    for (int i = 0; i < 32; ++i) {
        a += (int32_t)wa[i] * x[i];
        b += (int32_t)wb[i] * x[32 + i];
    }
    return (float)b * sb + ((float)a * sa + acc);
}
/* dot(nibbles - off, x[0:32]) of one block's 16 bytes of nibbles */
static inline int32_t go_q4_dot_scalar(const uint8_t *n, const int8_t *x, int off) {
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) s += ((n[i] & 15) - off) * x[i] + ((n[i] >> 4) - off) * x[16 + i];
    return s;
}
static inline float go_dot_q4_pair(const uint8_t *na, const uint8_t *nb, const int8_t *x,
                                   float sa, float sb, float acc) {
    const int32_t a = go_q4_dot_scalar(na, x, 8), b = go_q4_dot_scalar(nb, x + 32, 8);
    return (float)b * sb + ((float)a * sa + acc);
}
/* acc plus sa * dot(a's quants, x[0:32]) + sb * dot(b's, x[32:64]) for two
 * Q5_0 blocks, each from its 4 bytes of fifth bits on (value j: nibble |
 * bit j << 4, minus 16 (off); low nibbles the first 16) */
static inline int32_t go_q5_dot_scalar(const uint8_t *blk, const int8_t *x, int off) {
    const uint32_t bits = (uint32_t)blk[0] | (uint32_t)blk[1] << 8 | (uint32_t)blk[2] << 16 |
                          (uint32_t)blk[3] << 24;
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) {
        s += ((int)((blk[4 + i] & 15) | ((bits >> i) & 1) << 4) - off) * x[i];
        s += ((int)((blk[4 + i] >> 4) | ((bits >> (i + 16)) & 1) << 4) - off) * x[16 + i];
    }
    return s;
}
static inline float go_dot_q5_pair(const uint8_t *a, const uint8_t *b, const int8_t *x, float sa,
                                   float sb, float acc) {
    const int32_t da = go_q5_dot_scalar(a, x, 16), db = go_q5_dot_scalar(b, x + 32, 16);
    return (float)db * sb + ((float)da * sa + acc);
}
/* the same for two Q4_1 blocks' nibbles and two Q5_1 blocks: their quants as
 * they are (nothing taken off), values d q + m, and the m parts, m times x's
 * sum, summed apart by the caller as llama.cpp's vec_dot does */
static inline float go_dot_q4_1_pair(const uint8_t *na, const uint8_t *nb, const int8_t *x,
                                     float sa, float sb, float acc) {
    const int32_t a = go_q4_dot_scalar(na, x, 0), b = go_q4_dot_scalar(nb, x + 32, 0);
    return (float)b * sb + ((float)a * sa + acc);
}
static inline float go_dot_q5_1_pair(const uint8_t *a, const uint8_t *b, const int8_t *x,
                                     float sa, float sb, float acc) {
    const int32_t da = go_q5_dot_scalar(a, x, 0), db = go_q5_dot_scalar(b, x + 32, 0);
    return (float)db * sb + ((float)da * sa + acc);
}
/* The K types against activations rounded to Q8_K (see simd/x86_int8.h): a
 * super-block's sub-block products times their integer scales, in int32 */
typedef int32_t go_vqi;
#define go_vqi_zero() 0
#define go_vq_add_scaled(s, d, acc) ((float)(s) * (d) + (acc))
/* acc plus s_lo * dot(low nibbles of q[0:32], x[0:32]) + s_hi * dot(high
 * nibbles, x[32:64]): two Q4_K sub-blocks */
static inline int32_t go_dot_q4k_pair_i(const uint8_t *q, const int8_t *x, go_ksc sc, int c,
                                        int32_t acc) {
    int32_t a = 0, b = 0;
    for (int i = 0; i < 32; ++i) {
        a += (q[i] & 15) * x[i];
        b += (q[i] >> 4) * x[32 + i];
    }
    return acc + sc.s[2 * c] * a + sc.s[2 * c + 1] * b;
}
/* two Q5_K sub-blocks, pair c: the fifth bits bits 2c and 2c + 1 of qh */
static inline int32_t go_dot_q5k_pair_i(const uint8_t *ql, const uint8_t *qh, int c,
                                        const int8_t *x, go_ksc sc, int32_t acc) {
    int32_t a = 0, b = 0;
    for (int i = 0; i < 32; ++i) {
        a += ((ql[i] & 15) | ((qh[i] >> (2 * c)) & 1) << 4) * x[i];
        b += ((ql[i] >> 4) | ((qh[i] >> (2 * c + 1)) & 1) << 4) * x[32 + i];
    }
    return acc + sc.s[2 * c] * a + sc.s[2 * c + 1] * b;
}
/* 32 values of a Q6_K super-block, block c of a half: ((ql >> 4 (c >> 1)) & 15
 * | ((qh >> 2c) & 3) << 4) - 32, the first 16 times sc[2c], the next sc[2c + 1] */
static inline int32_t go_dot_q6k_32_i(const uint8_t *ql, const uint8_t *qh, int c, const int8_t *x,
                                      go_ksc sc, int32_t acc) {
    const int ls = 4 * (c >> 1), hs = 2 * c;
    int32_t a = 0, b = 0;
    for (int i = 0; i < 16; ++i) {
        a += ((((ql[i] >> ls) & 15) | ((qh[i] >> hs) & 3) << 4) - 32) * x[i];
        b += ((((ql[16 + i] >> ls) & 15) | ((qh[16 + i] >> hs) & 3) << 4) - 32) * x[16 + i];
    }
    return acc + sc.s[2 * c] * a + sc.s[2 * c + 1] * b;
}
/* 32 values of a Q2_K super-block without their mins, block c of a half:
 * (q >> 2c) & 3 */
static inline int32_t go_dot_q2k_32_i(const uint8_t *q, int c, const int8_t *x, go_ksc sc,
                                      int32_t acc) {
    int32_t a = 0, b = 0;
    for (int i = 0; i < 16; ++i) {
        a += ((q[i] >> (2 * c)) & 3) * x[i];
        b += ((q[16 + i] >> (2 * c)) & 3) * x[16 + i];
    }
    return acc + sc.s[2 * c] * a + sc.s[2 * c + 1] * b;
}
/* 32 values of a Q3_K super-block, block c of half n: ((q >> 2c) & 3 | ((hm >>
 * (4n + c)) & 1) << 2) - 4 */
static inline int32_t go_dot_q3k_32_i(const uint8_t *q, const uint8_t *hm, int n, int c,
                                      const int8_t *x, go_ksc sc, int32_t acc) {
    const int hb = 4 * n + c;
    int32_t a = 0, b = 0;
    for (int i = 0; i < 16; ++i) {
        a += ((((q[i] >> (2 * c)) & 3) | ((hm[i] >> hb) & 1) << 2) - 4) * x[i];
        b += ((((q[16 + i] >> (2 * c)) & 3) | ((hm[16 + i] >> hb) & 1) << 2) - 4) * x[16 + i];
    }
    return acc + sc.s[2 * c] * a + sc.s[2 * c + 1] * b;
}
/* two IQ4-coded runs of 32 (16 bytes each, low nibbles first) times x[0:64],
 * each run times its integer scale */
static inline int32_t go_dot_iq4_pair_i(const uint8_t *qa, const uint8_t *qb, const int8_t *grid,
                                        const int8_t *x, int sa, int sb, int32_t acc) {
    int32_t a = 0, b = 0;
    for (int i = 0; i < 16; ++i) {
        a += grid[qa[i] & 15] * x[i] + grid[qa[i] >> 4] * x[16 + i];
        b += grid[qb[i] & 15] * x[32 + i] + grid[qb[i] >> 4] * x[48 + i];
    }
    return acc + sa * a + sb * b;
}
static inline void go_bitfield16(const uint8_t *src, int shift, uint8_t mask, uint8_t *out) {
    for (int j = 0; j < 16; ++j) out[j] = (uint8_t)((src[j] >> shift) & mask);
}
/* out[j] = lo[j] + 16 hi[j] - off for 16 bytes (hi[j] < 16; see simd/x86_bytes.h) */
static inline void go_merge16(const uint8_t *lo, const uint8_t *hi, int8_t off, int8_t *out) {
    for (int j = 0; j < 16; ++j) out[j] = (int8_t)(lo[j] + 16 * hi[j] - off);
}
/* out[j] = lo[j] + 4 hi[j] - off for 16 bytes (see simd/x86_bytes.h) */
static inline void go_merge16_2(const uint8_t *lo, const uint8_t *hi, int8_t off, int8_t *out) {
    for (int j = 0; j < 16; ++j) out[j] = (int8_t)(lo[j] + 4 * hi[j] - off);
}
/* lo[j] = grid[src[j] & 15], hi[j] = grid[src[j] >> 4] for 16 bytes */
static inline void go_grid16(const uint8_t *src, const int8_t *grid, int8_t *lo, int8_t *hi) {
    for (int j = 0; j < 16; ++j) {
        lo[j] = grid[src[j] & 15];
        hi[j] = grid[src[j] >> 4];
    }
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
#define go_vbits(x, j0) ((float)(((x) >> (j0)) & 1u))
/* v + 16 in the lanes whose bit (j0 + lane) of x is set */
#define go_vadd16_bits(v, x, j0) go_vfma(go_vbits((x), (j0)), go_vset1(16.0f), (v))
#define go_vload_f16(p) go_f16_to_f32(*(p))
#define go_vload_bf16(p) go_bits_to_f32((uint32_t)*(p) << 16)
#define go_vstore_bf16(p, v) (*(p) = go_f32_to_bf16(v))

#define go_count_eq_i32(a, b) ((int64_t)(*(a) == *(b)))

/* ---- for the activations (simd/vmath.h) ---- */
#define go_vexp_sum(x, lo) go_exp_sum_scalar((x), (lo))
#define go_vsplit_hi(x) go_split_hi_scalar(x)
#define go_vabs(x) fabsf(x)
/* |mag| with the sign bit of s */
#define go_vcopysign(mag, s) copysignf((mag), (s))
/* lo <= x <= hi, NaN kept */
#define go_vclamp(x, lo, hi) ((x) < (lo) ? (lo) : (x) > (hi) ? (hi) : (x))
/* a < b ? x : y, per lane (a NaN compares false: y) */
#define go_vsel_lt(a, b, x, y) ((a) < (b) ? (x) : (y))

/* even = p[0], odd = p[1]: the lanes of 2 vectors split by parity */
#define GO_HAS_LOAD_PAIRS 1
#define go_vload_pairs(p, even, odd) (*(even) = (p)[0], *(odd) = (p)[1])

#endif
