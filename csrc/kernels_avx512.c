/* The kernels compiled for the avx512 path. */
#if defined(__x86_64__) || defined(_M_X64)
#include <math.h>
#include <stddef.h>

#include "ggmlopt.h"
#include "kernel_table.h"
#include "simd/avx512.h"

#define GO_ISA_NAME "avx512"
#include "kernels/table.inc"
#endif
