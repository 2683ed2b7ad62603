/* The kernels compiled for the scalar path. */
/* always compiled: the fallback every CPU can run */
#include <math.h>
#include <stddef.h>

#include "ggmlopt.h"
#include "kernel_table.h"
#include "simd/scalar.h"

#define GO_ISA_NAME "scalar"
#include "kernels/table.inc"
