"""Linear.forward(x, out=...) (and LoRALinear's, QuantizedLinear's): the output
written into the caller's array, no output buffer kept, the same bits."""
import numpy as np
import pytest

from ggmlopt import lora
from ggmlopt.nn import Linear, QuantizedLinear


def linear():
    return Linear(12, 7, rng=0)


def adapted():
    layer = Linear(12, 7, rng=0)
    wrapped = lora.LoRALinear(layer, rank=3, alpha=6, rng=1)
    wrapped.lora_b.data[...] = np.random.default_rng(2).standard_normal((3, 7))
    return wrapped


def quantized():
    w = np.random.default_rng(3).standard_normal((7, 12)).astype(np.float16)   # (out, in)
    return QuantizedLinear(w, "F16", 12, 7, bias=np.arange(7, dtype=np.float32))


LAYERS = {"linear": linear, "lora": adapted, "quantized": quantized}


@pytest.mark.parametrize("make", LAYERS.values(), ids=LAYERS.keys())
@pytest.mark.parametrize("lead", [(5,), (2, 3), ()])
def test_out_gets_the_bits_of_the_layers_own_buffer_and_nothing_is_kept(make, lead):
    x = np.random.default_rng(4).standard_normal((*lead, 12)).astype(np.float32)
    g = np.random.default_rng(5).standard_normal((*lead, 7)).astype(np.float32)
    own_layer, out_layer = make(), make()
    want = own_layer.forward(x).copy()
    out = np.full((*lead, 7), np.nan, np.float32)
    got = out_layer.forward(x, out=out)
    assert got is out
    np.testing.assert_array_equal(got, want)
    assert out_layer._out is None   # the layer keeps no output buffer
    # the backward pass reads the kept input, not the output
    np.testing.assert_array_equal(out_layer.backward(g), own_layer.backward(g))


@pytest.mark.parametrize("make", LAYERS.values(), ids=LAYERS.keys())
def test_a_bad_out_is_refused_before_anything_changes(make):
    layer = make()
    x = np.ones((4, 12), np.float32)
    cases = [(np.zeros((4, 7), np.float64), TypeError, "float32"),
             (np.zeros((4, 8), np.float32), ValueError, r"shape \(4, 7\)"),
             (np.zeros((7, 4), np.float32).T, ValueError, "C-contiguous"),
             ([[0.0] * 7] * 4, TypeError, "numpy.ndarray")]
    for out, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            layer.forward(x, out=out)
    assert layer._x is None   # the failed calls kept no input
    shared = np.zeros(4 * 12, np.float32)   # out over the input the product reads
    with pytest.raises(ValueError, match="shares memory"):
        layer.forward(shared.reshape(4, 12), out=shared[:28].reshape(4, 7))
