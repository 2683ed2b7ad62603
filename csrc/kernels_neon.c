/* The kernels compiled for the neon path. */
#if defined(__aarch64__)
#include <math.h>
#include <stddef.h>

#include "ggmlopt.h"
#include "kernel_table.h"
#include "simd/neon.h"

#define GO_ISA_NAME "neon"
#include "kernels/table.inc"
#endif
