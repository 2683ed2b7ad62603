"""float32 -> bfloat16 rounding (kernels.to_bfloat16), the operands of the bf16
products: every path against an integer reference of round-to-nearest-even."""
import numpy as np
import pytest

from ggmlopt import kernels

F32 = np.float32


def bf16_reference(x):
    """Round-to-nearest-even of float32 to its top 16 bits, done in integers;
    NaN: the top half with the quiet bit set (never rounded into inf)."""
    u = np.asarray(x, F32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, F32))
    rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def widen(bits):
    return (bits.astype(np.uint32) << 16).view(F32)


def test_random_values_round_to_nearest_even(simd_path, layout, rng, place):
    size, offset = layout
    vals = (rng.standard_normal(size) * 10.0 ** rng.integers(-30, 30, size)).astype(F32)
    src = place(vals, offset)
    out = place(np.zeros(size, np.uint16), offset)
    assert kernels.to_bfloat16(src, out) is out
    np.testing.assert_array_equal(out, bf16_reference(vals))


def test_special_values_and_ties(simd_path, place):
    u = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000,   # zeros, infinities
                  0x7FC00000, 0x7F800001, 0xFF812345, 0x7FBFFFFF,   # quiet, signalling NaNs
                  0x00000001, 0x807FFFFF, 0x00008000, 0x00018000,   # subnormals, ties
                  0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF,   # ties to even, either side
                  0x7F7FFFFF, 0xFF7F8000, 0x7F7F7FFF, 0x3F800000,   # to inf, just below, 1.0
                  0x40490FDB, 0xC2F6E979, 0x00800000], dtype=np.uint32)
    vals = u.view(F32)
    out = kernels.to_bfloat16(place(vals, 3))
    np.testing.assert_array_equal(out, bf16_reference(vals))
    wide = widen(out)
    assert np.isnan(wide[4:8]).all()              # NaN stays NaN, payloads never round to inf
    assert wide[16] == np.inf and wide[17] == -np.inf   # max finite rounds up, as RNE must
    assert out[8] == 0 and out[10] == 0 and out[11] == 2   # tiny subnormals: kept, tie to even
    assert out[12] == 0x3F80 and out[13] == 0x3F82      # 1 + half an ulp ties to even


def test_every_upper_half_with_every_rounding_case(simd_path):
    # all 65536 upper halves, each with a low half below, at and above the tie
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    u = np.concatenate([hi | 0x7FFF, hi | 0x8000, hi | 0x8001, hi])
    vals = u.view(F32)
    np.testing.assert_array_equal(kernels.to_bfloat16(vals), bf16_reference(vals))


def test_shape_is_kept():
    x = np.arange(12, dtype=F32).reshape(3, 4)
    out = kernels.to_bfloat16(x)
    assert out.shape == (3, 4) and out.dtype == np.uint16
    np.testing.assert_array_equal(widen(out), x)    # small integers are exact


def test_bad_arguments_are_refused_and_leave_out_alone():
    out = np.full(4, 7, np.uint16)
    with pytest.raises(TypeError, match="src"):
        kernels.to_bfloat16(np.zeros(4))               # float64
    with pytest.raises(TypeError, match="out"):
        kernels.to_bfloat16(np.zeros(4, F32), np.zeros(4, np.int16))
    with pytest.raises(ValueError, match="out"):
        kernels.to_bfloat16(np.zeros(5, F32), out)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.to_bfloat16(np.zeros(8, F32)[::2], out)
    shared = np.zeros(8, F32)
    with pytest.raises(ValueError):
        kernels.to_bfloat16(shared[:4], shared[2:4].view(np.uint16))   # in place: overlap
    np.testing.assert_array_equal(out, 7)
