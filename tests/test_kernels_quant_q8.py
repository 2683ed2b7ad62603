"""Products of few rows with the activations rounded as llama.cpp rounds them
for its integer dot products (kernels_quant.matmul(..., activations="q8_0")):
to Q8_0 blocks for Q8_0, Q4_0, Q5_0, IQ4_NL, Q4_1 and Q5_1 weights, byte for
byte llama.cpp's x86 quantize_row_q8_0 (ties to even; Q4_1 and Q5_1 with Q8_1's
s), and to Q8_K blocks for the types
of 256-value super-blocks (Q2_K to Q6_K, IQ4_XS), as ggml's
quantize_row_q8_K_ref; the product within float32 rounding of
a float64 product of the rounded activations and the decoded weights on every
SIMD path, the same bits on any number of threads and in one job of products
of either rounding; QuantizedLinear and QuantizedEmbedding multiply so when
set_activations says so, outside training only; decoding's kernel threads
linger only while it runs."""
import numpy as np
import pytest

import ggmlopt
from ggmlopt import kernels
from ggmlopt import kernels_quant as kq
from ggmlopt.nn.quantized import FEW_ROWS, QuantizedEmbedding, QuantizedLinear, set_activations

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
U = 2.0 ** -24


def llamacpp_q8_0(x):
    """llama.cpp's x86 quantize_row_q8_0 / q8_1 in NumPy (float32 arithmetic,
    as in C): per 32 values d = amax / 127 (stored as f16), quants x * (127 /
    amax) rounded to nearest, ties to even; and Q8_1's s = f16(d * the block's
    sum of quants), d unrounded: (quants int8, scales float32, s float32)."""
    n, ncols = x.shape
    xb = x.reshape(n, ncols // 32, 32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax == 0, np.float32(0), np.float32(127) / np.where(amax == 0, 1, amax))
    quants = np.rint(xb * inv.astype(np.float32)).astype(np.int8)
    sums = quants.astype(np.int32).sum(axis=2).astype(np.float32)
    s = (d[..., 0] * sums).astype(np.float16).astype(np.float32)
    return quants.reshape(n, ncols), d[..., 0].astype(np.float16).astype(np.float32), s


def ggml_q8_k(x):
    """ggml's quantize_row_q8_K_ref in NumPy (float32 arithmetic, as in C):
    per 256 values max = the first value of largest magnitude, iscale = -127 /
    max, quants nearest(iscale * x) (ties to even) at most 127, scale 1 /
    iscale, sums of 16 quants; a block of zeros all zeros."""
    n, ncols = x.shape
    xb = x.reshape(n, ncols // 256, 256)
    first = np.abs(xb).argmax(axis=2)[..., None]
    peak = np.take_along_axis(xb, first, 2)
    zero = peak == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, np.float32(0), np.float32(-127) / np.where(zero, 1, peak))
    quants = np.minimum(np.rint(iscale * xb), 127).astype(np.int8)
    with np.errstate(divide="ignore"):
        scales = np.where(zero, np.float32(0), np.float32(1) / np.where(zero, 1, iscale))
    sums = quants.reshape(n, -1, 16).astype(np.int32).sum(axis=2).astype(np.int16)
    return quants.reshape(n, ncols), scales[..., 0].astype(np.float32), sums


def rounded_activations(x, qtype):
    """x as the integer products of qtype see it, float64: Q8_K blocks for the
    K types, Q8_0 blocks for the others; and each value's quantum (its block's
    scale)."""
    if qtype in kq.Q8_K_ACTIVATION_TYPES:
        quants, scales, _ = kq.quantize_q8_k_activations(x)
        step = np.repeat(scales.astype(np.float64), 256, axis=1)
    else:
        quants, scales = kq.quantize_q8_0_activations(x)
        step = np.repeat(scales.astype(np.float64), 32, axis=1)
    return quants.astype(np.float64) * step, step


def awkward_activations(rng, nx, ncols):
    """Rows mixing scales over many orders of magnitude, a block of zeros, a
    block of one nonzero value, values on rounding ties."""
    x = (rng.standard_normal((nx, ncols)) * np.exp(rng.uniform(-8, 8, (nx, 1)))).astype(np.float32)
    if ncols >= 64:
        x[0, :32] = 0.0
        x[-1, 32:64] = 0.0
        x[-1, 40] = -3.0
    if ncols >= 96:   # 127 * (k + 0.5) / 127 of the block's largest: ties of round()
        x[0, 64:96] = (np.arange(32) - 15.5) / 15.5 * 2.0
    return x


@pytest.mark.parametrize("nx,ncols", [(1, 32), (3, 96), (2, 608), (5, 1536)])
def test_the_rounding_is_llama_cpps_x86_one(nx, ncols):
    # x * (127 / amax) to nearest, ties to even: activations on a quantized grid
    # (a Q4_0 embedding's rows) sit on half-steps often, where ggml's scalar
    # reference (and gguf-py) round away from zero
    rng = np.random.default_rng(ncols + nx)
    x = awkward_activations(rng, nx, ncols)
    x[-1, :32] = np.arange(32) - 15.5      # halves: -15.5 .. 15.5
    x[-1, 0] = 127.0                       # amax 127: times 127 / 127 = 1, every one a tie
    quants, scales = kq.quantize_q8_0_activations(x)
    want_q, want_s, _ = llamacpp_q8_0(x)
    assert list(quants[-1, 1:5]) == [-14, -14, -12, -12]   # -14.5, -13.5, -12.5, -11.5
    np.testing.assert_array_equal(quants, want_q)
    np.testing.assert_array_equal(scales.view(np.uint32), want_s.view(np.uint32))
    assert np.abs(quants.astype(np.int32)).max() <= 127


@pytest.mark.parametrize("nx,ncols", [(1, 256), (3, 512), (2, 1536)])
def test_the_q8_k_rounding_is_ggmls(nx, ncols):
    rng = np.random.default_rng(ncols * 3 + nx)
    x = awkward_activations(rng, nx, ncols)
    x[0, 256 - 40:] = 0.0 if ncols == 256 else x[0, 256 - 40:]
    if ncols >= 512:
        x[1 % nx, 256:512] = 0.0                                  # a block of zeros
        x[-1, 300] = -np.abs(x[-1, 256:512]).max() * 2            # its largest value negative
    if ncols >= 1536:   # ties: 127 * (k + 0.5) / 127 of the largest, and the same magnitude twice
        x[0, 1024:1280] = (np.arange(256) % 64 - 31.5) / 63.5 * 3.0
        x[0, 1024] = -3.0
        x[0, 1100] = 3.0
    quants, scales, sums = kq.quantize_q8_k_activations(x)
    want_q, want_s, want_sums = ggml_q8_k(x)
    np.testing.assert_array_equal(quants, want_q)
    np.testing.assert_array_equal(scales.view(np.uint32), want_s.view(np.uint32))
    np.testing.assert_array_equal(sums, want_sums)
    assert np.abs(quants.astype(np.int32)).max() <= 127
    assert quants.dtype == np.int8 and scales.dtype == np.float32 and sums.dtype == np.int16


def test_a_non_finite_value_makes_its_q8_k_block_nan_and_nothing_else():
    x = np.ones((2, 768), np.float32)
    x[0, 300] = np.inf
    x[1, 600] = np.nan
    quants, scales, sums = kq.quantize_q8_k_activations(x)
    assert np.isnan(scales[0, 1]) and np.isnan(scales[1, 2])
    assert (quants[0, 256:512] == 0).all() and (quants[1, 512:768] == 0).all()
    assert (sums[0, 16:32] == 0).all() and (sums[1, 32:48] == 0).all()
    assert np.isfinite(scales[0, [0, 2]]).all() and np.isfinite(scales[1, :2]).all()
    w = kq.quantize(np.ones((3, 768), np.float32), "Q4_K")
    assert np.isnan(kq.matmul(x, "Q4_K", w, activations="q8_0")).all()


def test_a_non_finite_value_makes_its_block_nan_and_nothing_else():
    x = np.ones((2, 96), np.float32)
    x[0, 40] = np.inf
    x[1, 70] = np.nan
    quants, scales = kq.quantize_q8_0_activations(x)
    assert np.isnan(scales[0, 1]) and np.isnan(scales[1, 2])
    assert (quants[0, 32:64] == 0).all() and (quants[1, 64:96] == 0).all()
    assert np.isfinite(scales[0, [0, 2]]).all() and np.isfinite(scales[1, :2]).all()
    w = gguf.quants.quantize(np.ones((3, 96), np.float32), T.Q8_0)
    y = kq.matmul(x, "Q8_0", w, activations="q8_0")
    assert np.isnan(y).all()


# the types no Python quantizer writes: (values, bytes, the offsets of its f16
# scales) of a block, random bytes under small finite scales
RANDOM_BYTES = {"IQ4_NL": (32, 18, (0,)), "IQ4_XS": (256, 136, (0,)), "Q2_K": (256, 84, (80, 82)),
                "Q3_K": (256, 110, (108,))}


def random_weight(qtype, nout, ncols, rng):
    if qtype in RANDOM_BYTES:
        values, size, offsets = RANDOM_BYTES[qtype]
        raw = rng.integers(0, 256, (nout, ncols // values, size), dtype=np.uint8)
        for at in offsets:
            d = (rng.standard_normal((nout, ncols // values)) * 0.002).astype(np.float16)
            raw[..., at:at + 2] = d.view(np.uint8).reshape(nout, ncols // values, 2)
        return raw.reshape(nout, -1)
    w = (rng.standard_normal((nout, ncols)) * 0.05).astype(np.float32)
    return kq.quantize(w, qtype) if qtype.endswith("_K") else gguf.quants.quantize(w, T[qtype])


def k_mins(raw, qtype, ncols):
    """A Q4_K, Q5_K or Q2_K weight's value is d * sc * q - dmin * m, a Q4_1 or
    Q5_1 weight's d * q + m: the second part of each value, (nout, ncols),
    which the kernel sums apart from the first."""
    if qtype in ("Q4_1", "Q5_1"):   # a min per 32 values, the f16 after d
        blocks = raw.reshape(-1, 20 if qtype == "Q4_1" else 24)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
        return np.repeat(m, 32, axis=1).reshape(raw.shape[0], ncols)
    if qtype == "Q2_K":   # a min per 16 values, the high nibble of its scale byte
        blocks = raw.reshape(-1, 84)
        dmin = blocks[:, 82:84].copy().view(np.float16).astype(np.float64)
        mins = np.repeat(dmin * (blocks[:, :16] >> 4).astype(np.float64), 16, axis=1)
        return mins.reshape(raw.shape[0], ncols)
    blocks = raw.reshape(-1, 144 if qtype == "Q4_K" else 176)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
    _, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
    mins = np.repeat(dmin * m.astype(np.float64), 32, axis=1)
    return mins.reshape(raw.shape[0], ncols)


def q8_product_and_bound(x, qtype, raw):
    """The float64 product of the rounded activations and the decoded weights,
    and its float32 bound: every block's integer dot is exact (a K type's
    super-block's whole sum) and its scale product rounds once at most, so only
    the accumulation rounds: within gamma_m sum |w x| over m = nblocks + 8
    steps (nblocks of 32 values: sums of pairs of blocks, the lanes' sum, the
    final rounding)."""
    xr, _ = rounded_activations(x, qtype)
    w = np.asarray(gguf.quants.dequantize(raw, T[qtype]), np.float64)
    exact = xr @ w.T
    m = x.shape[1] // 32 + 8
    # Q4_K, Q5_K, Q2_K, Q4_1, Q5_1: their two parts are summed apart (a
    # value's may cancel), each scale product rounds once
    mag = np.abs(w) + (2 * np.abs(k_mins(raw, qtype, x.shape[1]))
                       if qtype in ("Q4_K", "Q5_K", "Q2_K", "Q4_1", "Q5_1") else 0)
    bound = (m + 1) * U / (1 - (m + 1) * U) * (np.abs(xr) @ mag.T)
    if qtype in ("Q4_1", "Q5_1"):
        # a block's m multiplies Q8_1's s = f16(d * sum of quants), not the
        # rounded values' sum (the f16 scale times it)
        delta, mins = q8_1_s_offsets(x, raw, qtype)
        exact = exact + delta @ mins.T
    return exact, bound + U * np.abs(exact)


def q8_1_s_offsets(x, raw, qtype):
    """(s - d16 * the block's sum of quants (nx, nblocks), each block's m
    (nout, nblocks)): what llama.cpp's Q8_1 s adds to the rounded values'
    product of a Q4_1 or Q5_1 weight, per block and min."""
    quants, d16, s = llamacpp_q8_0(x)
    sums = quants.reshape(x.shape[0], -1, 32).astype(np.float64).sum(axis=2)
    mins = k_mins(raw, qtype, x.shape[1])[:, ::32]
    return s.astype(np.float64) - d16.astype(np.float64) * sums, mins


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "IQ4_NL", "Q2_K",
                                   "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
@pytest.mark.parametrize("nx,nblocks,nout", [(1, 1, 1), (1, 2, 13), (3, 3, 7), (4, 5, 40),
                                             (11, 19, 13), (1, 48, 600)])
def test_matmul_q8_0_activations_within_float32_of_the_rounded_product(simd_path, qtype, nx,
                                                                       nblocks, nout):
    if qtype in kq.Q8_K_ACTIVATION_TYPES:   # super-blocks of 256 values
        nblocks *= 8
    rng = np.random.default_rng(nblocks * 7 + nout)
    ncols = 32 * nblocks
    raw = random_weight(qtype, nout, ncols, rng)
    x = awkward_activations(rng, nx, ncols)
    got = kq.matmul(x, qtype, raw, activations="q8_0")
    exact, bound = q8_product_and_bound(x, qtype, raw)
    assert got.shape == (nx, nout) and got.dtype == np.float32
    assert (np.abs(got - exact) <= bound).all()
    # and off the float32 product by the activations' rounding: at most half a
    # quantum (the block's scale) per value
    w = np.asarray(gguf.quants.dequantize(raw, T[qtype]), np.float64)
    # (a Q8_K scale is 1 / iscale, of either sign, and iscale * x rounds in
    # float32 before its rounding to an integer: 256 units more of slack)
    _, step = rounded_activations(x, qtype)
    half = np.abs(step) * (0.5 + 256 * U)
    float_product = x.astype(np.float64) @ w.T
    s_part = 0.0
    if qtype in ("Q4_1", "Q5_1"):
        delta, mins = q8_1_s_offsets(x, raw, qtype)
        s_part = np.abs(delta) @ np.abs(mins).T
    assert (np.abs(got - float_product) <= half @ np.abs(w).T + s_part + 2 * bound).all()
    assert qtype in kq.Q8_ACTIVATION_TYPES


def test_an_input_off_the_vector_alignment(simd_path):
    rng = np.random.default_rng(8)
    raw = random_weight("Q4_0", 9, 96, rng)
    flat = np.empty(3 * 96 + 1, np.float32)
    x = flat[1:].reshape(3, 96)   # C-contiguous, 4 bytes past an aligned start
    x[...] = rng.standard_normal((3, 96))
    out = np.full((3, 9), np.nan, np.float32)
    got = kq.matmul(x, "Q4_0", raw, out=out, activations="q8_0")
    assert got is out
    exact, bound = q8_product_and_bound(np.ascontiguousarray(x), "Q4_0", raw)
    assert (np.abs(got - exact) <= bound).all()


def test_the_same_bits_on_any_number_of_threads(restore_threads):
    rng = np.random.default_rng(9)
    for qtype in ("Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                  "Q6_K", "IQ4_XS"):
        raw = random_weight(qtype, 1536, 768, rng)
        x = rng.standard_normal((2, 768)).astype(np.float32)
        ggmlopt.set_num_threads(1)
        one = kq.matmul(x, qtype, raw, activations="q8_0")
        ggmlopt.set_num_threads(2)
        np.testing.assert_array_equal(kq.matmul(x, qtype, raw, activations="q8_0"), one)


def test_one_job_of_both_roundings_gives_each_product_s_bits_alone(simd_path):
    """matmul_many over Q8_0-rounded and Q8_K-rounded types at once (x rounded
    one way, then the other, in the same scratch) and float32 ones."""
    rng = np.random.default_rng(12)
    ncols = 512
    types = ["Q4_K", "Q4_0", "Q6_K", "Q4_1", "IQ4_NL", "Q3_K", "IQ4_XS", "F16"]
    raws = [random_weight(t, 7 + 5 * i, ncols, rng) if t != "F16" else
            rng.standard_normal((9, ncols)).astype(np.float16) for i, t in enumerate(types)]
    x = awkward_activations(rng, 3, ncols)
    outs = kq.matmul_many(x, list(zip(types, raws)), activations="q8_0")
    for t, raw, out in zip(types, raws, outs):
        np.testing.assert_array_equal(out, kq.matmul(x, t, raw, activations="q8_0"))


def test_other_types_multiply_the_float32_activations():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((5, 256)).astype(np.float32)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    for qtype, raw in (("F16", w.astype(np.float16)), ("F32", w),
                       ("BF16", (w.view(np.uint32) >> 16).astype(np.uint16))):
        np.testing.assert_array_equal(kq.matmul(x, qtype, raw, activations="q8_0"),
                                      kq.matmul(x, qtype, raw))
    assert kq.Q8_ACTIVATION_TYPES == ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K",
                                      "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
    assert kq.Q8_K_ACTIVATION_TYPES == ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")


def test_bad_arguments():
    raw = gguf.quants.quantize(np.ones((2, 32), np.float32), T.Q8_0)
    with pytest.raises(ValueError, match="activations"):
        kq.matmul(np.ones((1, 32), np.float32), "Q8_0", raw, activations="q4_0")
    with pytest.raises(ValueError, match="x"):
        kq.quantize_q8_0_activations(np.ones((1, 33), np.float32))
    with pytest.raises(TypeError, match="x"):
        kq.quantize_q8_0_activations(np.ones((1, 32), np.float64))
    quants, scales = kq.quantize_q8_0_activations(np.ones((0, 64), np.float32))
    assert quants.shape == (0, 64) and scales.shape == (0, 2)
    with pytest.raises(ValueError, match="x"):
        kq.quantize_q8_k_activations(np.ones((1, 288), np.float32))
    with pytest.raises(TypeError, match="x"):
        kq.quantize_q8_k_activations(np.ones((1, 256), np.float64))
    quants, scales, sums = kq.quantize_q8_k_activations(np.ones((0, 512), np.float32))
    assert quants.shape == (0, 512) and scales.shape == (0, 2) and sums.shape == (0, 32)


def test_layers_multiply_so_when_set_and_not_training():
    rng = np.random.default_rng(6)
    raw = random_weight("Q4_0", 40, 96, rng)
    emb_raw = random_weight("Q8_0", 50, 96, rng)
    layer = QuantizedLinear(raw, "Q4_0", 96, 40)
    emb = QuantizedEmbedding(emb_raw, "Q8_0", 50, 96)
    w16 = rng.standard_normal((3, 256)).astype(np.float16)
    q41 = QuantizedLinear(w16, "F16", 256, 3)
    x = rng.standard_normal((1, 96)).astype(np.float32)
    exact = layer(x)
    many = rng.standard_normal((FEW_ROWS + 1, 96)).astype(np.float32)
    exact_many = layer(many)
    assert layer.activations == "f32" and emb.activations == "f32"
    model = ggmlopt.nn.Sequential(layer, emb, q41)
    assert set_activations(model, "q8_0") == 2   # the F16 layer keeps float32
    assert layer.activations == emb.activations == q41.activations == "q8_0"
    np.testing.assert_array_equal(layer(x), kq.matmul(x, "Q4_0", raw, activations="q8_0"))
    np.testing.assert_array_equal(emb.project(x),
                                  kq.matmul(x, "Q8_0", emb_raw, activations="q8_0"))
    assert not np.array_equal(layer(x), exact)
    layer.training = True   # a training eval multiplies what its backward pass does
    np.testing.assert_array_equal(layer(x), exact)
    layer.training = False
    # many rows go through panels of float32 weights whatever the setting
    np.testing.assert_array_equal(layer(many), exact_many)
    assert set_activations(model, "f32") == 0
    np.testing.assert_array_equal(layer(x), exact)
    with pytest.raises(ValueError, match="activations"):
        set_activations(model, "int8")
    assert layer.activations == "f32"


def test_decoding_lingers_the_kernel_threads_only_while_it_runs():
    from ggmlopt.models import Llama, LlamaConfig
    assert kernels.set_pool_linger(0) == 0.0
    seen = []
    model = Llama(LlamaConfig(vocab_size=33, dim=32, n_layers=1, n_heads=2, max_seq_len=16))
    original = model._decode_hidden

    def spy(tokens, cache):
        seen.append(kernels.set_pool_linger(0.5))
        kernels.set_pool_linger(seen[-1])
        return original(tokens, cache)
    model._decode_hidden = spy
    ggmlopt.generate(model, [1, 2, 3], 3, temperature=0)
    assert seen and all(s > 0 for s in seen)
    assert kernels.set_pool_linger(0) == 0.0
    with pytest.raises(ValueError, match="seconds"):
        kernels.set_pool_linger(2)
    with pytest.raises(TypeError, match="seconds"):
        kernels.set_pool_linger("1")


def _adapted_q4_0_layer(rng):
    """(raw Q4_0 blocks, a Sequential of one LoRA adapter over them, the adapter)."""
    from ggmlopt import lora
    raw = random_weight("Q4_0", 40, 96, rng)
    model = ggmlopt.nn.Sequential(QuantizedLinear(raw, "Q4_0", 96, 40))
    lora.apply(model, rank=2, targets="all-linear", seed=0)
    return raw, model, next(m for _, m in lora.named_adapters(model))


def test_an_adapters_base_follows_set_activations_and_training():
    """A LoRA adapter's base layer is not a sub-module (its weight keeps the
    adapter's name): set_activations reaches it through the adapter, and so
    does train(), so a training step's few rows still multiply float32."""
    rng = np.random.default_rng(8)
    raw, model, adapter = _adapted_q4_0_layer(rng)
    base = adapter._base
    assert set_activations(model, "q8_0") == 1 and base.activations == "q8_0"
    x = rng.standard_normal((2, 96)).astype(np.float32)
    q8 = kq.matmul(x, "Q4_0", raw, activations="q8_0")
    f32 = kq.matmul(x, "Q4_0", raw)
    assert not np.array_equal(q8, f32)
    np.testing.assert_array_equal(adapter.infer(x), q8)   # lora_b is zero: the base alone
    model.train()
    assert base.training
    np.testing.assert_array_equal(adapter.forward(x), f32)
    model.eval()
    assert not base.training
    np.testing.assert_array_equal(adapter.forward(x), q8)


def test_inference_puts_an_adapters_base_back_in_training():
    """eval_mode (generate, perplexity) and the inference helpers (evaluate,
    predict) switch training off for a block and put every flag back, the
    adapter's base among them: left False, a training forward of few rows
    would multiply q8_0 activations while its backward differentiates float32."""
    from ggmlopt.nn.module import eval_mode
    rng = np.random.default_rng(9)
    raw, model, adapter = _adapted_q4_0_layer(rng)
    base = adapter._base
    set_activations(model, "q8_0")
    x = rng.standard_normal((2, 96)).astype(np.float32)
    f32 = kq.matmul(x, "Q4_0", raw)
    for how in ("eval_mode", "predict"):
        model.train()
        if how == "eval_mode":
            with eval_mode(model):
                assert not base.training
        else:
            ggmlopt.predict(model, x)
        assert adapter.training and base.training, how
        np.testing.assert_array_equal(adapter.forward(x), f32)
