/* ggml's K block types from float32 rows (quantize_k.c): the bytes
 * llama-quantize writes without an importance matrix; and activations as
 * Q8_0 and Q8_K blocks, as llama.cpp rounds them for its integer dot products. */
#ifndef GGMLOPT_QUANTIZE_K_H
#define GGMLOPT_QUANTIZE_K_H

#include <stdint.h>

/* ggml's type numbers */
enum { GO_QK_Q4_K = 12, GO_QK_Q5_K = 13, GO_QK_Q6_K = 14 };

/* bytes of one 256-value block of type, or 0 for a type quantize_k.c does not write */
int64_t go_quantize_k_block_bytes(int type);

/* rows [r0, r1) of src (rows of ncols floats, ncols a multiple of 256) into
 * dst (rows of ncols / 256 blocks); type must be one of the three above */
void go_quantize_k_rows(int type, int64_t r0, int64_t r1, int64_t ncols, const float *src,
                        uint8_t *dst);

/* n floats (a multiple of 32) as Q8_0 blocks: the int8 quants into qs (n of
 * them), each block's scale, the f16 it stores as a float, into scales and,
 * unless sums is NULL, the sum of its quants into sums */
void go_quantize_q8_0_row(const float *x, int64_t n, int8_t *qs, float *scales, float *sums);

/* n floats (a multiple of 256) as Q8_K blocks, as llama.cpp rounds activations
 * for the K types' dot products: the int8 quants into qs (n of them), each
 * 256-value block's scale into scales (n / 256) and the sums of each 16
 * quants into sums (n / 16) */
void go_quantize_q8_k_row(const float *x, int64_t n, int8_t *qs, float *scales, int16_t *sums);

#endif
