# C-level GGUF block-type kernels for other Cython code (ggmlopt.h documents
# them); raw pointers, no checks, no allocation, no GIL.
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t

cdef int64_t quant_row_bytes(int type, int64_t ncols) noexcept nogil
cdef int dequantize_rows(int type, int64_t r0, int64_t r1, int64_t ncols, const uint8_t *src,
                         float *dst, int64_t dst_stride) noexcept nogil
cdef int quant_matmul_f32(int type, int64_t nx, int64_t ncols, const float *x, int64_t x_stride,
                          int64_t nout, const uint8_t *w, float *y,
                          int64_t y_stride) noexcept nogil
cdef int quant_matmul_q8(int type, int64_t nx, int64_t ncols, const float *x, int64_t x_stride,
                         int64_t nout, const uint8_t *w, float *y, int64_t y_stride,
                         int8_t *xqs, float *xd, float *xsum) noexcept nogil
cdef int dequantize_gather(int type, int64_t n, const int32_t *ids, int64_t ncols,
                           const uint8_t *src, float *dst) noexcept nogil
cdef int quantize_rows_f32(int type, int64_t nrows, int64_t ncols, const float *src,
                           uint8_t *dst) noexcept nogil
