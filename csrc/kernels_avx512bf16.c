/* The avx512 path's bfloat16 products with AVX512-BF16's vdpbf16ps
 * (kernels/gemm_bf16.inc), for the CPUs that have it (Intel since Cooper Lake,
 * AMD since Zen 4): dispatch.c takes them in place of the avx512 table's, which
 * run each pair of products as two FMAs.  Only this unit gets -mavx512bf16. */
#if defined(__x86_64__) || defined(_M_X64)
#include <stddef.h>

#include "ggmlopt.h"
#include "kernel_table.h"
#include "simd/avx512.h"

#undef GO_FN
#define GO_FN(name) name##_avx512bf16
#define GO_BF16_DOT(acc, x, b) \
    _mm512_dpbf16_ps((acc), (__m512bh)_mm512_castps_si512(x), (__m512bh)_mm512_castps_si512(b))
#include "kernels/gemm_bf16.inc"

void ggmlopt_gemm_block_bf16_avx512bf16(const go_gemm_bf16_args *g, int64_t r0, int64_t r1,
                                        int64_t j0, int64_t j1, float *work) {
    gemm_block_bf16_avx512bf16(g, r0, r1, j0, j1, work);
}
#endif
