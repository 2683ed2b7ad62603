"""The error bound of a float32 matrix product, for the tests of the GEMM engines.

A float32 product of inner length k is within gamma_k = k u / (1 - k u) (u =
2^-24) of sum_j |a_ij b_jk| from the exact one, whatever the order of its sums
(blocked, fused or in pairs); one more term for an accumulated old value.  A
bf16 product sums exact products of its bf16 operands in float32, so the same
bound holds against the float64 product of those operands.
"""
import numpy as np
import pytest

from ggmlopt import gemm

U = 2.0 ** -24

needs_mkl = pytest.mark.skipif(gemm.mkl_library() is None, reason="Intel MKL not installed "
                               "(pip install mkl)")


def gamma(k):
    return k * U / (1 - k * U)


def assert_product_close(got, a64, b64, base=None):
    """got within gamma_(k+1) of |a||b| (+ |base|) of a64 @ b64 (+ base)."""
    k = a64.shape[1]
    want = a64 @ b64 + (0.0 if base is None else base)
    bound = gamma(k + 1) * (np.abs(a64) @ np.abs(b64) + (0.0 if base is None else np.abs(base)))
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound + 1e-300).all(), f"worst excess {np.max(err - bound):.3g}"
