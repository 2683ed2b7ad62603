/* SIMD mapping for x86-64 with AVX2, FMA and F16C: 8 floats a register. */
#ifndef GGMLOPT_SIMD_AVX2_H
#define GGMLOPT_SIMD_AVX2_H

#include <immintrin.h>
#include "simd/scalar_math.h"

#define GO_FN(name) name##_avx2
#define GO_EPR 8

typedef __m256 go_vf;
typedef struct { __m256d lo, hi; } go_dacc;

#define go_vload(p) _mm256_loadu_ps(p)
#define go_vstore(p, v) _mm256_storeu_ps((p), (v))
/* a store around the caches (p on a whole vector's alignment): go_vstream_done()
 * after the last, before another thread reads what they wrote */
#define go_vstream(p, v) _mm256_stream_ps((p), (v))
#define go_vstream_done() _mm_sfence()
#define go_vset1(x) _mm256_set1_ps(x)
#define go_vadd(a, b) _mm256_add_ps((a), (b))
#define go_vsub(a, b) _mm256_sub_ps((a), (b))
#define go_vmul(a, b) _mm256_mul_ps((a), (b))
#define go_vdiv(a, b) _mm256_div_ps((a), (b))
#define go_vfma(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define go_vsqrt(a) _mm256_sqrt_ps(a)
/* 1/a within 2 ulp: the 12-bit estimate and one Newton step.  vdivps shares the
 * divide unit with vsqrtps, and the pair made AdamW compute-bound in cache. */
static inline __m256 go_vrecip(__m256 a) {
    const __m256 r = _mm256_rcp_ps(a);
    return _mm256_mul_ps(r, _mm256_fnmadd_ps(a, r, _mm256_set1_ps(2.0f)));
}
/* maxps returns its second operand when either is NaN: a NaN in a yields b */
#define go_vmax(a, b) _mm256_max_ps((a), (b))
/* x > 0 ? x : 0 with NaN kept: maxps(0, x) returns x when x is NaN, and the
 * added +0 turns maxps's -0 (for x = -0) into +0 */
#define go_vrelu(x) \
    _mm256_add_ps(_mm256_max_ps(_mm256_setzero_ps(), (x)), _mm256_setzero_ps())
#define go_vmask_nonzero(a, b) \
    _mm256_and_ps(_mm256_cmp_ps((a), _mm256_setzero_ps(), _CMP_NEQ_UQ), (b))
#define go_vany_eq(v, s) (_mm256_movemask_ps(_mm256_cmp_ps((v), (s), _CMP_EQ_OQ)) != 0)
/* index of the last lane of v equal to s, -1 for none */
static inline int go_vlast_eq(__m256 v, __m256 s) {
    const int m = _mm256_movemask_ps(_mm256_cmp_ps(v, s, _CMP_EQ_OQ));
    return m ? 31 - __builtin_clz((unsigned)m) : -1;
}

static inline double go_vreduce_add(__m256 v) {
    __m256d d = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)),
                              _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(d), _mm256_extractf128_pd(d, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

static inline float go_vreduce_max(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline go_dacc go_dacc_zero(void) {
    go_dacc a = {_mm256_setzero_pd(), _mm256_setzero_pd()};
    return a;
}
static inline go_dacc go_dacc_add(go_dacc acc, __m256 v) {
    acc.lo = _mm256_add_pd(acc.lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    acc.hi = _mm256_add_pd(acc.hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    return acc;
}
static inline go_dacc go_dacc_add_sq(go_dacc acc, __m256 v) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    acc.lo = _mm256_fmadd_pd(lo, lo, acc.lo);
    acc.hi = _mm256_fmadd_pd(hi, hi, acc.hi);
    return acc;
}
static inline double go_dacc_reduce(go_dacc acc) {
    const __m256d d = _mm256_add_pd(acc.lo, acc.hi);
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(d), _mm256_extractf128_pd(d, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

/* exp(r) for a reduced argument r (about ln2/2 at most): 1 + r + r^2 * P(r), the
 * polynomial both exponentials below share */
static inline __m256 go_vexp_poly(__m256 r) {
    __m256 p = _mm256_set1_ps(GO_EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(GO_EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(GO_EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(GO_EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(GO_EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(GO_EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    return p;
}

/* exp(x) for x <= 0, as the softmax needs it (x - max): go_expf_scalar's
 * polynomial, 8 lanes at a time.  Nothing can overflow, and n = round(x*log2(e))
 * is read from the low bits of x*log2(e) + 1.5*2^23, which spares the rounding
 * and the conversion instructions.  Lanes below GO_EXP_LO (and -inf) give 0;
 * NaN stays NaN. */
static inline __m256 go_vexp_nonpos(__m256 x) {
    const __m256 too_small = _mm256_cmp_ps(x, _mm256_set1_ps(GO_EXP_LO), _CMP_LT_OQ);
    const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(GO_EXP_LOG2E), _mm256_set1_ps(GO_ROUND_MAGIC));
    const __m256 n = _mm256_sub_ps(t, _mm256_set1_ps(GO_ROUND_MAGIC));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(GO_EXP_C1), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(GO_EXP_C2), r);
    const __m256 p = go_vexp_poly(r);
    /* bits(t) = bits(1.5*2^23) + n, so (bits(t) - bits(1.5*2^23) + 127) << 23 is 2^n */
    const __m256 pow2n = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(127 - GO_ROUND_MAGIC_BITS)), 23));
    /* andnot: lanes below GO_EXP_LO become 0; NaN lanes compare false and stay NaN */
    return _mm256_andnot_ps(too_small, _mm256_mul_ps(p, pow2n));
}

/* The first n (0 < n < 8) lanes of p, the others set to fill; never touches
 * memory past p + n (masked loads do not fault on masked-off lanes). */
static const int32_t go_mask_table[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
static inline __m256 go_vload_partial(const float *p, int64_t n, float fill) {
    const __m256i mask = _mm256_loadu_si256((const __m256i *)(go_mask_table + 8 - n));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, mask),
                            _mm256_castsi256_ps(mask));
}
static inline void go_vstore_partial(float *p, __m256 v, int64_t n) {
    _mm256_maskstore_ps(p, _mm256_loadu_si256((const __m256i *)(go_mask_table + 8 - n)), v);
}

/* lanes p[idx[0]], ..., p[idx[7]] for 8 int32 offsets */
#define go_vgather(p, idx) \
    _mm256_i32gather_ps((p), _mm256_loadu_si256((const __m256i *)(idx)), 4)

/* r[0..7] transposed in place (lane j of r[i] <-> lane i of r[j]): pairs, pairs
 * of pairs, then the 128-bit halves */
static inline void go_vtranspose(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

static inline __m256 go_vload_u8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 go_vload_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#include "simd/x86_bytes.h"
#include "simd/x86_int8.h"
/* lanes (float)((x >> (j0 + lane)) & 1) */
static inline __m256 go_vbits(uint32_t x, int j0) {
    const __m256i lanes = _mm256_add_epi32(_mm256_set1_epi32(j0),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i b = _mm256_srlv_epi32(_mm256_set1_epi32((int)x), lanes);
    return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(1)));
}
/* v + 16 in the lanes whose bit (j0 + lane) of x is set */
#define go_vadd16_bits(v, x, j0) go_vfma(go_vbits((x), (j0)), go_vset1(16.0f), (v))
static inline __m256 go_vload_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
/* bfloat16 is float32's upper half: widen, shift into place */
static inline __m256 go_vload_bf16(const uint16_t *p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

/* bfloat16 pairs (kernels/gemm_bf16.inc): each lane holds two bf16 values, the
 * even one in its low half; a pair vector from 8 values of each of two rows,
 * and each half of a pair vector as float32 */
static inline __m256 go_vpair_bf16(const uint16_t *even, const uint16_t *odd) {
    const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)even));
    const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)odd));
    return _mm256_castsi256_ps(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 16)));
}
/* the pairs of 16 consecutive bf16 values of one row (p[2i], p[2i + 1] in lane i) */
static inline __m256 go_vload_bf16_pairs(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline __m256 go_vbf16_even(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(v), 16));
}
static inline __m256 go_vbf16_odd(__m256 v) {
    return _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32((int)0xffff0000u)));
}

/* 8 floats to bfloat16 bits at p, as go_f32_to_bf16 rounds each. */
static inline void go_vstore_bf16(uint16_t *p, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), nan)), 16);
    /* each lane <= 0xffff, so the unsigned saturating pack is exact; it packs
     * within 128-bit halves, the permute puts the halves in order */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

/* Equal entries among 8 int32 pairs. */
static inline int64_t go_count_eq_i32(const int32_t *a, const int32_t *b) {
    const __m256i eq = _mm256_cmpeq_epi32(_mm256_loadu_si256((const __m256i *)a),
                                          _mm256_loadu_si256((const __m256i *)b));
    return __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(eq)));
}

/* ---- for the activations (simd/vmath.h) ---- */

/* exp(x + lo) for x <= 0, |lo| <= 4: go_exp_sum_scalar's algorithm, 8 lanes */
static inline __m256 go_vexp_sum(__m256 x, __m256 lo) {
    /* maxps returns its second operand for a NaN: NaN lanes of x stay NaN */
    x = _mm256_max_ps(_mm256_set1_ps(GO_EXPS_MIN), x);
    const __m256 t = _mm256_fmadd_ps(_mm256_add_ps(x, lo), _mm256_set1_ps(GO_EXP_LOG2E),
                                     _mm256_set1_ps(GO_ROUND_MAGIC));
    const __m256 n = _mm256_sub_ps(t, _mm256_set1_ps(GO_ROUND_MAGIC));
    __m256 r = _mm256_add_ps(_mm256_fnmadd_ps(n, _mm256_set1_ps(GO_EXP_C1), x), lo);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(GO_EXP_C2), r);
    const __m256 p = go_vexp_poly(r);
    const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(GO_ROUND_MAGIC_BITS));
    const __m256i n1 = _mm256_srai_epi32(ni, 1);
    const __m256i n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
#define go_vsplit_hi(x) \
    _mm256_and_ps((x), _mm256_castsi256_ps(_mm256_set1_epi32((int)0xFFFFF000u)))
#define go_vabs(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), (x))
static inline __m256 go_vcopysign(__m256 mag, __m256 s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return _mm256_or_ps(_mm256_andnot_ps(sign, mag), _mm256_and_ps(sign, s));
}
/* maxps/minps return the second operand for a NaN: x last keeps NaN lanes */
#define go_vclamp(x, lo, hi) _mm256_min_ps((hi), _mm256_max_ps((lo), (x)))
#define go_vsel_lt(a, b, x, y) _mm256_blendv_ps((y), (x), _mm256_cmp_ps((a), (b), _CMP_LT_OQ))

/* even = p[0], p[2], ..., p[14], odd = p[1], ..., p[15]: the 16 floats at p split
 * by parity (shufps works within 128-bit halves; permute4x64 puts them in order) */
#define GO_HAS_LOAD_PAIRS 1
static inline void go_vload_pairs(const float *p, __m256 *even, __m256 *odd) {
    const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
    *even = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

#endif
