"""Arguments the compiled entry points took and should not have: sizes that wrap
int64 (a buffer of nothing, then a crash), parameters that are not finite as a
float32, a kernel's refusal returned as its unwritten output, bytes of another
kind or byte order read as a weight's, products of mismatched shapes.  Each is
refused with the argument named, and nothing changes."""
import numpy as np
import pytest

from ggmlopt import kernels_attention as ka
from ggmlopt import kernels_quant as kq
from ggmlopt._arena import ParamArena
from ggmlopt.nn.quantized import rows_times, rows_times_transpose


@pytest.mark.parametrize("args, error", [
    ((2 ** 61,), ValueError), ((2 ** 63 - 1,), ValueError), ((2 ** 60, True), ValueError),
    ((10, False, 2 ** 62), ValueError), ((1.5,), TypeError), ((True,), TypeError),
    ((10, False, -1), ValueError),
])
def test_an_arena_too_large_to_address_is_refused(args, error):
    # nsections * section * 4 wrapped to 0 bytes: the gradients' pointer landed on
    # the weights and zero_grads wrote far past the buffer
    with pytest.raises(error):
        ParamArena(*args)


def test_an_arena_view_past_its_end_is_refused_and_writes_nothing():
    arena = ParamArena(16, True)
    arena.flat("weights")[:] = 1.0
    for start, shape in ((2 ** 63 - 1, (1,)), (2 ** 63 - 4, (8,)), (15, (2,)), (-1, (1,))):
        with pytest.raises(ValueError, match="start|outside"):
            arena.view("grads", start, shape)
    with pytest.raises(TypeError, match="shape"):
        arena.view("grads", 0, (1.5,))
    assert (arena.flat("weights") == 1.0).all() and (arena.flat("grads") == 0.0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e39, "0.1"])
def test_arena_steps_refuse_parameters_that_are_not_finite_float32(bad):
    arena = ParamArena(8, True)
    arena.flat("weights")[:] = 2.0
    arena.flat("grads")[:] = 0.5
    with pytest.raises((ValueError, TypeError), match="alpha"):
        arena.adamw_step(bad, 0.9, 0.999, 1e-8, 0.0, 10.0, 1000.0)
    with pytest.raises((ValueError, TypeError), match="eps"):
        arena.adamw_step(1e-3, 0.9, 0.999, bad, 0.0, 10.0, 1000.0)
    with pytest.raises((ValueError, TypeError), match="wd"):
        arena.sgd_step(0.1, bad)
    assert (arena.flat("weights") == 2.0).all()
    assert (arena.flat("m") == 0.0).all() and (arena.flat("v") == 0.0).all()


def test_arena_clipping_refuses_a_negative_or_nan_limit():
    # -1 flipped every gradient's sign; NaN clipped nothing without a word
    arena = ParamArena(4, False)
    arena.flat("grads")[:] = [1.0, 2.0, 3.0, 4.0]
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="max_norm"):
            arena.clip_grad_norm(bad)
    assert list(arena.flat("grads")) == [1.0, 2.0, 3.0, 4.0]
    assert arena.clip_grad_norm(float("inf")) == pytest.approx(30 ** 0.5)   # the norm only
    assert list(arena.flat("grads")) == [1.0, 2.0, 3.0, 4.0]


def _qkv(heads_kv=2):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
    k = rng.standard_normal((1, 5, heads_kv, 8)).astype(np.float32)
    return q, k, k.copy()


@pytest.mark.parametrize("cap", [1e39, 1e-50, -1.0, float("nan")])
def test_an_attention_cap_that_is_no_float32_cap_is_refused(cap):
    # 1e39 is finite as a double and inf as a float32: the kernel refused it with a
    # return code nobody read, and out came back as it was (np.empty's bytes)
    q, k, v = _qkv()
    out = np.full(q.shape, 7.0, np.float32)
    lse = np.full((1, 2, 5), 7.0, np.float32)
    with pytest.raises(ValueError, match="softcap"):
        ka.attention_forward(q, k, v, out=out, lse=lse, softcap=cap)
    assert (out == 7.0).all() and (lse == 7.0).all()
    cache = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="softcap"):
        ka.attention_decode(q[:, 0], cache, cache, 3, softcap=cap)


def test_attention_with_keys_of_no_head_is_a_value_error():
    q, k, v = _qkv(heads_kv=0)
    with pytest.raises(ValueError, match="kv head"):
        ka.attention_forward(q, k, v)


def test_attention_of_no_query_head_names_q():
    # an empty product the kernel refuses: named, not "the kernel refused (code -1)"
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="q: expected at least one head"):
        ka.attention_forward(q[:, :, :0], k, v)
    cache = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="q: expected at least one head"):
        ka.attention_decode(np.zeros((1, 0, 8), np.float32), cache, cache, 3)


@pytest.mark.parametrize("raw", [np.array([[1], [2]], dtype=object),
                                 np.ones((1, 4), ">f2"), np.ones((1, 4), np.complex64)])
def test_quantized_bytes_of_another_kind_or_byte_order_are_refused(raw):
    # object pointers and big-endian halves were read as the rows' bytes
    qtype = "F16" if raw.dtype.kind == "f" else "F32"
    with pytest.raises(TypeError, match="raw"):
        kq.dequantize(qtype, raw, 4 if raw.shape[1] == 4 else 2)


def test_the_quantized_layer_products_check_their_shapes():
    rng = np.random.default_rng(1)
    raw = np.empty((5, 34), np.uint8)   # Q8_0 rows of one block: an f16 scale, 32 int8
    raw[:, :2] = np.full((5, 1), 0.01, np.float16).view(np.uint8)
    raw[:, 2:] = rng.integers(-127, 128, (5, 32)).astype(np.int8).view(np.uint8)
    g, out = rng.standard_normal((3, 6)).astype(np.float32), np.full((3, 32), 7.0, np.float32)
    with pytest.raises(ValueError, match="g: expected 5 columns"):
        rows_times(g, "Q8_0", raw, 32, out)    # used g[:, :5] and said nothing
    with pytest.raises(ValueError, match="out"):
        rows_times(g[:, :5].copy(), "Q8_0", raw, 32, np.zeros((3, 32)))
    assert (out == 7.0).all()
    x = rng.standard_normal((20, 32)).astype(np.float32)
    with pytest.raises(ValueError, match="out"):
        rows_times_transpose(x, "Q8_0", raw, np.full((20, 6), 7.0, np.float32))
    with pytest.raises(ValueError, match="activations"):
        rows_times_transpose(x, "Q8_0", raw, np.empty((20, 5), np.float32), activations="bogus")
    got = rows_times_transpose(x, "Q8_0", raw, np.empty((20, 5), np.float32))
    want = x.astype(np.float64) @ kq.dequantize("Q8_0", raw, 32).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_pickled_dataset_whose_arrays_do_not_fit_its_sizes_is_refused():
    # np.copyto broadcast one pickled row into every row of the new dataset
    import pickle

    import ggmlopt as go
    ds = go.Dataset.from_arrays(np.arange(12, dtype=np.float32).reshape(4, 3),
                                np.arange(4, dtype=np.int32))
    again = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(again.data, ds.data)
    make, args = ds.__reduce__()
    for at, part in ((8, args[8][:1]), (9, args[9][:2])):
        bad = list(args)
        bad[at] = part
        with pytest.raises(ValueError, match="pickled dataset"):
            make(*bad)
