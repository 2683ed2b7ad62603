/* Integer dot products of Q8_0 / Q4_0 weight blocks with activations rounded to
 * Q8_0 (kernels/quant.inc's quant_dot_q8_rows) on x86-64 with AVX2: shared by
 * the AVX2 and AVX-512 mappings, which include it.  One 32-value block a 256-bit
 * register, also on AVX-512: two blocks in one 512-bit register measured slower
 * (Sapphire Rapids: 17 against 22 G weights/s on one core), their scales and
 * nibbles costing lane shuffles on the one port that does them, where 256-bit
 * operations spread over three. */
#ifndef GGMLOPT_SIMD_X86_INT8_H
#define GGMLOPT_SIMD_X86_INT8_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* the sums a row's blocks go into */
typedef __m256 go_vq;

static inline go_vq go_vq_zero(void) { return _mm256_setzero_ps(); }
static inline float go_vq_reduce(go_vq v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* lanes summing to dot(a, b) over 32 int8 pairs (b within [-127, 127]): |a|
 * (unsigned) times b with a's sign, pairs summed by maddubs within int16 (at
 * most 2 * 128 * 127), then by madd into int32: exact */
static inline __m256 go_dot_i8x32(__m256i a, __m256i b) {
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

/* lanes summing to dot(u, b) over 32 pairs, u unsigned within [0, 31]: no
 * sign to move, maddubs takes u as it is (pairs within int16: 2 * 31 * 127) */
static inline __m256 go_dot_u8x32(__m256i u, __m256i b) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, b), _mm256_set1_epi16(1)));
}

/* acc plus sa times a's lanes plus sb times b's: a pair of blocks' dots scaled */
static inline go_vq go_pair_scaled(__m256 a, __m256 b, float sa, float sb, go_vq acc) {
    return _mm256_fmadd_ps(b, _mm256_set1_ps(sb), _mm256_fmadd_ps(a, _mm256_set1_ps(sa), acc));
}
/* the 32 int8 values at x */
static inline __m256i go_x32(const int8_t *x) { return _mm256_loadu_si256((const __m256i *)x); }

/* the 32 nibbles of 16 bytes as they are (0..15, low nibbles first): a Q4_1
 * block's quants */
static inline __m256i go_nibbles32(const uint8_t *nibbles) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)nibbles);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
}
/* a Q4_0 block's 32 quants (nibble - 8, low nibbles first) from its 16 bytes */
static inline __m256i go_q4_0_quants(const uint8_t *nibbles) {
    return _mm256_sub_epi8(go_nibbles32(nibbles), _mm256_set1_epi8(8));
}

/* acc plus sa * dot(wa, x[0:32]) + sb * dot(wb, x[32:64]) for two Q8_0 blocks'
 * quants, and for two Q4_0 blocks' nibbles (see the scalar path) */
static inline go_vq go_dot_q8_pair(const int8_t *wa, const int8_t *wb, const int8_t *x,
                                   float sa, float sb, go_vq acc) {
    return go_pair_scaled(go_dot_i8x32(go_x32(wa), go_x32(x)),
                          go_dot_i8x32(go_x32(wb), go_x32(x + 32)), sa, sb, acc);
}
static inline go_vq go_dot_q4_pair(const uint8_t *na, const uint8_t *nb, const int8_t *x,
                                   float sa, float sb, go_vq acc) {
    return go_pair_scaled(go_dot_i8x32(go_q4_0_quants(na), go_x32(x)),
                          go_dot_i8x32(go_q4_0_quants(nb), go_x32(x + 32)), sa, sb, acc);
}

/* the 32 values an IQ4-coded run of 16 bytes stands for (low nibbles first):
 * the 16-entry grid looked up in registers by a byte shuffle (built in bytes
 * on the stack, a 32-byte load of two 16-byte stores would wait on their
 * forwarding) */
static inline __m256i go_iq4_values32(const uint8_t *q, const int8_t *grid) {
    const __m256i g = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)grid));
    return _mm256_shuffle_epi8(g, go_nibbles32(q));
}
/* acc plus sa * dot(grid[a's nibbles], x[0:32]) + sb * dot(grid[b's], x[32:64]) for
 * two IQ4_NL-coded runs of 32 */
static inline go_vq go_dot_iq4_pair(const uint8_t *qa, const uint8_t *qb, const int8_t *grid,
                                    const int8_t *x, float sa, float sb, go_vq acc) {
    return go_pair_scaled(go_dot_i8x32(go_iq4_values32(qa, grid), go_x32(x)),
                          go_dot_i8x32(go_iq4_values32(qb, grid), go_x32(x + 32)), sa, sb, acc);
}

/* Q4_0 blocks without the signs: the nibbles as they are (0..15, unsigned:
 * maddubs takes them) times x, less 8 times x's sums over each lane's four
 * values, which go_q4_x_lanes gives once per block of x (every weight row
 * reads them): each lane's integer is go_dot_q4_pair's, exactly, in two
 * operations fewer a block. */
#define GO_Q4_LANES 1
typedef __m256i go_q4_lanes;
static inline go_q4_lanes go_q4_x_lanes(const int8_t *x) {
    return _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_set1_epi8(8), _mm256_loadu_si256((const __m256i *)x)),
        _mm256_set1_epi16(1));
}
static inline __m256 go_dot_q4_lanes(const uint8_t *nibbles, const int8_t *x, go_q4_lanes lanes) {
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(go_nibbles32(nibbles), go_x32(x)),
                                        _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(p, lanes));
}
static inline go_vq go_dot_q4_pair_lanes(const uint8_t *na, const uint8_t *nb, const int8_t *x,
                                         const go_q4_lanes *lanes, float sa, float sb,
                                         go_vq acc) {
    return go_pair_scaled(go_dot_q4_lanes(na, x, lanes[0]), go_dot_q4_lanes(nb, x + 32, lanes[1]),
                          sa, sb, acc);
}

/* a Q5_1 block's 32 quants (nibble | fifth bit << 4, 0..31; low nibbles
 * first) from its 4 bytes of fifth bits and 16 of nibbles: bit j of the 32
 * becomes byte j (each byte of the word spread over 8 bytes, or-ed with all
 * bits but its own, equal to 0xff where that bit is set) */
static inline __m256i go_q5_quants(const uint8_t *qh_qs) {
    uint32_t bits;
    memcpy(&bits, qh_qs, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i set = _mm256_cmpeq_epi8(
        _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
    return _mm256_or_si256(go_nibbles32(qh_qs + 4), _mm256_and_si256(set, _mm256_set1_epi8(16)));
}
/* a Q5_0 block's: the same minus 16 */
static inline __m256i go_q5_0_quants(const uint8_t *qh_qs) {
    return _mm256_sub_epi8(go_q5_quants(qh_qs), _mm256_set1_epi8(16));
}
/* acc plus sa * dot(a's quants, x[0:32]) + sb * dot(b's, x[32:64]) for two
 * Q5_0 blocks (each from its fifth bits on) */
static inline go_vq go_dot_q5_pair(const uint8_t *a, const uint8_t *b, const int8_t *x, float sa,
                                   float sb, go_vq acc) {
    return go_pair_scaled(go_dot_i8x32(go_q5_0_quants(a), go_x32(x)),
                          go_dot_i8x32(go_q5_0_quants(b), go_x32(x + 32)), sa, sb, acc);
}

/* acc plus sa * dot(a's quants, x[0:32]) + sb * dot(b's, x[32:64]) for two
 * Q4_1 blocks' nibbles and for two Q5_1 blocks (each from its fifth bits on):
 * their quants unsigned, their mins summed apart (see the scalar path) */
static inline go_vq go_dot_q4_1_pair(const uint8_t *na, const uint8_t *nb, const int8_t *x,
                                     float sa, float sb, go_vq acc) {
    return go_pair_scaled(go_dot_u8x32(go_nibbles32(na), go_x32(x)),
                          go_dot_u8x32(go_nibbles32(nb), go_x32(x + 32)), sa, sb, acc);
}
static inline go_vq go_dot_q5_1_pair(const uint8_t *a, const uint8_t *b, const int8_t *x,
                                     float sa, float sb, go_vq acc) {
    return go_pair_scaled(go_dot_u8x32(go_q5_quants(a), go_x32(x)),
                          go_dot_u8x32(go_q5_quants(b), go_x32(x + 32)), sa, sb, acc);
}

/* The K types against activations rounded to Q8_K (kernels/quant.inc's
 * quant_dot_q8k_rows): a super-block's sub-block products, each times its
 * integer scale, summed in int32 lanes (exact), one float product a
 * super-block.  The quants are unsigned (0..63: maddubs takes them as they
 * are, pairs within int16), their offsets taken off within each lane. */
typedef __m256i go_vqi;
static inline go_vqi go_vqi_zero(void) { return _mm256_setzero_si256(); }
/* acc plus d times s's lanes */
static inline go_vq go_vq_add_scaled(go_vqi s, float d, go_vq acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d), acc);
}
/* A super-block's (or half's) 8 integer scales as 16-bit words in both
 * 128-bit lanes, built once (from 8 signed bytes less bias, or 8 bytes' low
 * nibbles); the products take each with one byte shuffle where a broadcast
 * from an integer register took two operations (Q6_K 20 -> 27 G values/s) */
typedef __m256i go_ksc;
static inline go_ksc go_ksc_i8(const int8_t *sc, int bias) {
    const __m128i w = _mm_sub_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)sc)),
                                    _mm_set1_epi16((short)bias));
    return _mm256_broadcastsi128_si256(w);
}
static inline go_ksc go_ksc_low_nibbles(const uint8_t *b) {
    const __m128i v = _mm_and_si128(_mm_loadl_epi64((const __m128i *)b), _mm_set1_epi8(15));
    return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(v));
}
/* byte shuffles of a go_ksc: lane 0 word 2c, lane 1 word 2c + 1, repeated */
static const uint8_t go_ksc_pick[4][32] = {
#define GO_W(k) (k) * 2, (k) * 2 + 1
#define GO_W8(k) GO_W(k), GO_W(k), GO_W(k), GO_W(k), GO_W(k), GO_W(k), GO_W(k), GO_W(k)
    {GO_W8(0), GO_W8(1)}, {GO_W8(2), GO_W8(3)}, {GO_W8(4), GO_W8(5)}, {GO_W8(6), GO_W8(7)},
};
/* and word k in both lanes */
static const uint8_t go_ksc_one[8][32] = {
#define GO_W16(k) GO_W8(k), GO_W8(k)
    {GO_W16(0)}, {GO_W16(1)}, {GO_W16(2)}, {GO_W16(3)},
    {GO_W16(4)}, {GO_W16(5)}, {GO_W16(6)}, {GO_W16(7)},
#undef GO_W16
#undef GO_W8
#undef GO_W
};
static inline __m256i go_ksc_word(go_ksc sc, int k) {
    return _mm256_shuffle_epi8(sc, _mm256_loadu_si256((const __m256i *)go_ksc_one[k]));
}
/* acc plus sc[2c] * dot(lo, x[0:32]) + sc[2c + 1] * dot(hi, x[32:64]), lo and
 * hi 32 unsigned quants each */
static inline go_vqi go_dot_u8_pair_i(__m256i lo, __m256i hi, const int8_t *x, go_ksc sc, int c,
                                      go_vqi acc) {
    const __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x));
    const __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32)));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(plo, go_ksc_word(sc, 2 * c)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(phi, go_ksc_word(sc, 2 * c + 1)));
}
/* two Q4_K sub-blocks, pair c, from their 32 bytes: low nibbles then high ones */
static inline go_vqi go_dot_q4k_pair_i(const uint8_t *q, const int8_t *x, go_ksc sc, int c,
                                       go_vqi acc) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)q), m = _mm256_set1_epi8(15);
    return go_dot_u8_pair_i(_mm256_and_si256(raw, m),
                            _mm256_and_si256(_mm256_srli_epi16(raw, 4), m), x, sc, c, acc);
}
/* two Q5_K sub-blocks, pair c of a super-block: ql's nibbles, the fifth bits
 * bits 2c and 2c + 1 of the 32 bytes qh */
static inline go_vqi go_dot_q5k_pair_i(const uint8_t *ql, const uint8_t *qh, int c,
                                       const int8_t *x, go_ksc sc, go_vqi acc) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)ql), m = _mm256_set1_epi8(15);
    const __m256i h = _mm256_loadu_si256((const __m256i *)qh), one = _mm256_set1_epi8(1);
    const __m256i h_lo = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c)), one);
    const __m256i h_hi = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c + 1)), one);
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, m), _mm256_slli_epi16(h_lo, 4));
    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m),
                                       _mm256_slli_epi16(h_hi, 4));
    return go_dot_u8_pair_i(lo, hi, x, sc, c, acc);
}
/* acc plus sc[2c] * dot(u[0:16] - off, x[0:16]) + sc[2c + 1] * dot(u[16:32] -
 * off, x[16:32]) for 32 unsigned quants u (lanes 0-3 hold bytes 0-15): the
 * offset taken off each pair's product within int16 (u x and off x at most 2 *
 * 63 * 127 each), so each lane holds its own values' sum, as ggml's kernels do */
static inline go_vqi go_dot_u8_halves_i(__m256i u, int off, const int8_t *x, go_ksc sc, int c,
                                        go_vqi acc) {
    const __m256i vx = _mm256_loadu_si256((const __m256i *)x);
    __m256i p = _mm256_maddubs_epi16(u, vx);
    if (off) p = _mm256_sub_epi16(p, _mm256_maddubs_epi16(_mm256_set1_epi8((char)off), vx));
    const __m256i s = _mm256_shuffle_epi8(sc, _mm256_loadu_si256((const __m256i *)go_ksc_pick[c]));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
}
/* (v >> shift) & mask in each of 32 bytes */
static inline __m256i go_bits32(const uint8_t *v, int shift, int mask) {
    return _mm256_and_si256(
        _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)v), _mm_cvtsi32_si128(shift)),
        _mm256_set1_epi8((char)mask));
}
/* 32 values of a Q6_K super-block, block c of a half: q = (ql >> 4 (c >> 1)) &
 * 15 | ((qh >> 2c) & 3) << 4, less 32, the first 16 times sc[2c], the next 16
 * times sc[2c + 1] */
static inline go_vqi go_dot_q6k_32_i(const uint8_t *ql, const uint8_t *qh, int c, const int8_t *x,
                                     go_ksc sc, go_vqi acc) {
    const __m256i q = _mm256_or_si256(go_bits32(ql, 4 * (c >> 1), 15),
                                      _mm256_slli_epi16(go_bits32(qh, 2 * c, 3), 4));
    return go_dot_u8_halves_i(q, 32, x, sc, c, acc);
}
/* 32 values of a Q2_K super-block without their mins, block c of a half:
 * (q >> 2c) & 3 */
static inline go_vqi go_dot_q2k_32_i(const uint8_t *q, int c, const int8_t *x, go_ksc sc,
                                     go_vqi acc) {
    return go_dot_u8_halves_i(go_bits32(q, 2 * c, 3), 0, x, sc, c, acc);
}
/* 32 values of a Q3_K super-block, block c of half n: (q >> 2c) & 3 | ((hm >>
 * (4n + c)) & 1) << 2, less 4 */
static inline go_vqi go_dot_q3k_32_i(const uint8_t *q, const uint8_t *hm, int n, int c,
                                     const int8_t *x, go_ksc sc, go_vqi acc) {
    const __m256i u = _mm256_or_si256(go_bits32(q, 2 * c, 3),
                                      _mm256_slli_epi16(go_bits32(hm, 4 * n + c, 1), 2));
    return go_dot_u8_halves_i(u, 4, x, sc, c, acc);
}
/* two IQ4-coded runs of 32 (16 bytes each, low nibbles first), the grid's
 * values looked up by a byte shuffle, times x[0:64], each run times its
 * integer scale (the grid's values are signed: maddubs takes |w| and x with
 * w's sign, pairs at most 2 * 127 * 127 within int16) */
static inline go_vqi go_dot_iq4_pair_i(const uint8_t *qa, const uint8_t *qb, const int8_t *grid,
                                       const int8_t *x, int sa, int sb, go_vqi acc) {
    const __m256i wa = go_iq4_values32(qa, grid), wb = go_iq4_values32(qb, grid);
    const __m256i xa = _mm256_loadu_si256((const __m256i *)x);
    const __m256i xb = _mm256_loadu_si256((const __m256i *)(x + 32));
    const __m256i pa = _mm256_maddubs_epi16(_mm256_sign_epi8(wa, wa), _mm256_sign_epi8(xa, wa));
    const __m256i pb = _mm256_maddubs_epi16(_mm256_sign_epi8(wb, wb), _mm256_sign_epi8(xb, wb));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pa, _mm256_set1_epi16((short)sa)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pb, _mm256_set1_epi16((short)sb)));
}

#endif
