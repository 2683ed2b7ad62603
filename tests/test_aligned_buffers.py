"""The layers' buffers start on 64-byte boundaries (nn._buffers.empty), so the
kernels' vector loads never straddle two cache lines; NumPy's own start 16
bytes into one."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.nn._buffers import empty


@pytest.mark.parametrize("shape", [(), 0, 1, 7, (3, 5), (2, 0, 3), (17, 33, 2), (256, 576)])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint16, bool, np.float64])
def test_empty_is_aligned_with_the_shape_and_dtype_asked(shape, dtype):
    a = empty(shape, dtype)
    want = (shape,) if isinstance(shape, int) else shape
    assert a.shape == want and a.dtype == np.dtype(dtype)
    assert a.flags.c_contiguous and a.flags.writeable
    if a.size:
        assert a.ctypes.data % 64 == 0
    a[...] = 1                          # the whole buffer is the array's own
    assert (a == 1).all()


def test_buffers_are_distinct():
    a, b = empty((100,)), empty((100,))
    assert not np.may_share_memory(a, b)
    a[...] = 1.0
    b[...] = 2.0
    assert (a == 1.0).all()


def test_a_llama_steps_buffers_are_aligned():
    """A training step's activations and their gradients: every array a block
    keeps between the passes starts on a cache line."""
    cfg = LlamaConfig(vocab_size=61, dim=24, n_layers=2, n_heads=3, n_kv_heads=1, ffn_dim=40,
                      max_seq_len=16)
    model = Llama(cfg, seed=0)
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 61, (2, 13)).astype(np.int32)
    ctx.alloc(True)
    ctx.eval(None, inputs=x, labels=np.roll(x, -1, axis=1))
    seen = 0
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, np.ndarray) and value.size and attr.startswith("_") \
                    and value.base is not None and value.dtype == np.float32:
                seen += 1
                assert value.ctypes.data % 64 == 0, f"{name}.{attr}"
    assert seen >= 10
