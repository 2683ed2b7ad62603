"""Conv2d, MaxPool2d, AvgPool2d: forward against float64 NumPy references,
gradients against central differences, buffers, bad input."""
import numpy as np
import pytest
from conv_reference import avgpool2d, conv2d, conv2d_loops, maxpool2d, numeric_grad

import ggmlopt
from ggmlopt import kernels
from ggmlopt.nn import AvgPool2d, Conv2d, MaxPool2d, Sequential

F32 = np.float32

# (n, c_in, c_out, h, w, kernel, stride, padding)
CONVS = [
    (1, 1, 1, 1, 1, 1, 1, 0),
    (1, 1, 8, 6, 6, 3, 1, 1),
    (2, 3, 5, 7, 9, 3, 1, 0),
    (1, 3, 2, 9, 8, 3, 2, 1),  # stride 2, kernel larger than stride
    (2, 2, 3, 7, 10, (3, 2), (2, 1), (1, 2)),  # rectangular everything
    (1, 5, 3, 5, 5, 5, 1, 2),
    (2, 1, 2, 4, 6, (2, 4), (3, 1), (0, 3)),
]
CONV_IDS = [f"n{c[0]}-c{c[1]}-o{c[2]}-{c[3]}x{c[4]}-k{c[5]}-s{c[6]}-p{c[7]}" for c in CONVS]


def _make(case, seed=0, bias=True):
    n, c, o, h, w, k, s, p = case
    conv = Conv2d(c, o, k, s, p, bias=bias, rng=seed)
    x = np.random.default_rng(seed + 1).standard_normal((n, c, h, w)).astype(F32)
    return conv, x


@pytest.mark.parametrize("case", CONVS[:4], ids=CONV_IDS[:4])
def test_reference_is_the_seven_loop_definition(case):
    conv, x = _make(case)
    b = conv.bias.data
    want = conv2d_loops(x, conv.weight.data, b, conv.stride, conv.padding)
    np.testing.assert_allclose(conv2d(x, conv.weight.data, b, conv.stride, conv.padding), want,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", CONVS, ids=CONV_IDS)
def test_conv2d_forward_matches_seven_loop_reference(simd_path, case, bias):
    conv, x = _make(case, bias=bias)
    y = conv(x)
    b = conv.bias.data if bias else None
    want = conv2d_loops(x, conv.weight.data, b, conv.stride, conv.padding)
    scale = conv2d_loops(np.abs(x), np.abs(conv.weight.data), None if b is None else np.abs(b),
                         conv.stride, conv.padding)
    assert y.shape == want.shape and y.dtype == F32
    assert np.all(np.abs(y - want) <= 1e-6 * scale + 1e-7)


def _loss_grads(conv, x, g):
    """d sum(conv(x) * g) / d (weight, bias, x), by central differences of the
    float64 reference."""
    w, b = conv.weight.data.astype(np.float64), conv.bias.data.astype(np.float64)
    st, pd = conv.stride, conv.padding
    return (numeric_grad(lambda a: np.sum(conv2d(x, a, b, st, pd) * g), w),
            numeric_grad(lambda a: np.sum(conv2d(x, w, a, st, pd) * g), b),
            numeric_grad(lambda a: np.sum(conv2d(a, w, b, st, pd) * g), x))


@pytest.mark.parametrize("case", CONVS, ids=CONV_IDS)
def test_conv2d_gradients_match_central_differences(simd_path, case):
    conv, x = _make(case)
    y = conv.forward(x)
    g = np.random.default_rng(7).standard_normal(y.shape).astype(F32)
    dx = conv.backward(g)
    want_w, want_b, want_x = _loss_grads(conv, x.astype(np.float64), g.astype(np.float64))
    for got, want, name in ((conv.weight.grad, want_w, "weight"), (conv.bias.grad, want_b, "bias"),
                            (dx, want_x, "x")):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=name)


def test_conv2d_backward_adds_into_grad_and_honours_grad_is_zero(rng):
    conv, x = _make(CONVS[2])
    y = conv.forward(x)
    g = rng.standard_normal(y.shape).astype(F32)
    conv.weight.grad[...] = np.nan  # garbage that grad_is_zero says to ignore
    conv.bias.grad[...] = np.nan
    dx1 = conv.backward(g).copy()
    w1, b1 = conv.weight.grad.copy(), conv.bias.grad.copy()
    assert np.isfinite(w1).all() and np.isfinite(b1).all()
    assert not conv.weight.grad_is_zero and not conv.bias.grad_is_zero
    dx2 = conv.backward(g)
    np.testing.assert_allclose(conv.weight.grad, 2 * w1, rtol=1e-6)
    np.testing.assert_allclose(conv.bias.grad, 2 * b1, rtol=1e-6)
    np.testing.assert_array_equal(dx2, dx1)


def test_conv2d_needs_input_grad_false_returns_none_and_still_adds(rng):
    conv, x = _make(CONVS[1])
    model = Sequential(conv)
    assert conv.needs_input_grad is False
    y = model.forward(x)
    assert model.backward(np.ones_like(y)) is None
    assert np.abs(conv.weight.grad).sum() > 0


def test_conv2d_call_returns_a_copy(rng):
    conv, x1 = _make(CONVS[2])
    x2 = rng.standard_normal(x1.shape).astype(F32)
    a = conv(x1)
    a0 = a.copy()
    b = conv(x2)
    np.testing.assert_array_equal(a, a0)
    assert not np.array_equal(a, b)
    # forward returns the reused buffer
    assert conv.forward(x1) is conv.forward(x2)


@pytest.mark.parametrize("stride", [1, 2], ids=["direct", "im2col"])
def test_conv2d_threads_and_paths_agree(rng, restore_threads, stride):
    """1 and 2 threads give the same bits on each path; the paths agree to
    rounding (stride 1 computes in SIMD lanes, fused multiply-adds on the
    vector paths; the im2col path only copies, so its paths agree exactly)."""
    conv = Conv2d(3, 4, 3, stride=stride, padding=1, rng=3)
    x = rng.standard_normal((40, 3, 17, 15)).astype(F32)
    oh, ow = kernels.conv2d_output_size(17, 15, 3, stride, 1)
    g = rng.standard_normal((40, 4, oh, ow)).astype(F32)
    results = {}
    for path in kernels.simd_paths():
        previous = kernels.use_simd(path)
        try:
            for threads in (1, 2):
                kernels.set_num_threads(threads)
                conv.weight.grad_is_zero = conv.bias.grad_is_zero = True
                y = conv(x)
                dx = conv.backward(g).copy()
                res = (y, dx, conv.weight.grad.copy(), conv.bias.grad.copy())
                if path in results:
                    for a, b in zip(res, results[path]):
                        np.testing.assert_array_equal(a, b, err_msg=f"{path}, 2 threads")
                results[path] = res
        finally:
            kernels.use_simd(previous)
    first = next(iter(results.values()))
    for res in results.values():
        for a, b in zip(res, first):
            if stride == 1:
                # sums of up to 10^4 terms: rounding relative to the largest
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
            else:
                np.testing.assert_array_equal(a, b)


def test_conv2d_layout_names_and_default_init():
    conv = Conv2d(3, 5, (3, 2), rng=0)
    assert conv.weight.shape == (5, 3, 3, 2) and conv.bias.shape == (5,)
    assert [n for n, _ in conv.named_parameters()] == ["weight", "bias"]
    bound = 1 / np.sqrt(3 * 3 * 2)
    for p in (conv.weight.data, conv.bias.data):
        assert np.abs(p).max() <= bound and np.abs(p).max() > 0.5 * bound
    np.testing.assert_array_equal(Conv2d(3, 5, (3, 2), rng=0).weight.data, conv.weight.data)
    gen = np.random.default_rng(0)
    np.testing.assert_array_equal(Conv2d(3, 5, (3, 2), rng=gen).weight.data, conv.weight.data)
    assert Conv2d(3, 5, 3, bias=False).bias is None
    assert ggmlopt.nn.Conv2d is Conv2d


def test_conv2d_custom_init():
    seen = []

    def init(weight, bias, rng):
        seen.append((weight.shape, None if bias is None else bias.shape))
        weight[...] = 2
        if bias is not None:
            bias[...] = -1

    conv = Conv2d(2, 4, 3, init=init, rng=1)
    assert seen == [((4, 2, 3, 3), (4,))]
    assert (conv.weight.data == 2).all() and (conv.bias.data == -1).all()


@pytest.mark.parametrize("args, exc, match", [
    ((0, 4, 3), ValueError, "in_channels: expected >= 1"),
    ((2.0, 4, 3), TypeError, "in_channels: expected an int"),
    ((2, True, 3), TypeError, "out_channels: expected an int"),
    ((2, 4, 0), ValueError, "kernel_size: expected ints >= 1"),
    ((2, 4, (3, 1.5)), TypeError, "kernel_size: expected an int"),
    ((2, 4, 3, 0), ValueError, "stride: expected ints >= 1"),
    ((2, 4, 3, 1, -1), ValueError, "padding: expected ints >= 0"),
    ((2, 4, 3, 1, (1, 2, 3)), ValueError, "padding: expected an int or a pair"),
])
def test_conv2d_bad_constructor_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        Conv2d(*args)


def test_conv2d_bad_input_leaves_state_unchanged(rng):
    conv, x = _make(CONVS[2])
    y = conv.forward(x)
    y0 = y.copy()
    w0 = conv.weight.data.copy()
    with pytest.raises(ValueError, match="x: expected 3 channels"):
        conv.forward(np.zeros((2, 4, 7, 9), F32))
    with pytest.raises(ValueError, match="x: expected a 4-D NCHW array"):
        conv.forward(np.zeros((2, 3 * 7 * 9), F32))
    with pytest.raises(ValueError, match=r"x: the input \(2, 2\) with padding \(0, 0\) is "
                                         r"smaller than the kernel \(3, 3\)"):
        conv.forward(np.zeros((2, 3, 2, 2), F32))
    with pytest.raises(TypeError, match="x: expected real numbers"):
        conv.forward(np.zeros((2, 3, 7, 9), complex))
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(2, 5, 5, 7\)"):
        conv.backward(np.zeros((2, 5, 5, 6), F32))
    np.testing.assert_array_equal(conv._out, y0)
    np.testing.assert_array_equal(conv.weight.data, w0)
    assert conv.weight.grad_is_zero and not conv.weight.grad.any()
    # the layer still works on the shape it had
    g = np.ones_like(y0)
    assert conv.backward(g).shape == x.shape
    with pytest.raises(RuntimeError, match="backward: call forward first"):
        Conv2d(1, 1, 1).backward(np.zeros((1, 1, 1, 1), F32))


# ---- pooling --------------------------------------------------------------

# (n, c, h, w, kernel, stride)
POOLS = [
    (1, 1, 2, 2, 2, None),
    (2, 3, 7, 9, 2, None),  # remainders dropped
    (1, 2, 9, 10, 3, 2),  # overlapping windows
    (2, 1, 8, 11, (3, 2), (1, 3)),
    (1, 3, 5, 5, (2, 3), 2),
]
POOL_IDS = [f"n{p[0]}-c{p[1]}-{p[2]}x{p[3]}-k{p[4]}-s{p[5]}" for p in POOLS]


@pytest.mark.parametrize("cls, ref", [(MaxPool2d, maxpool2d), (AvgPool2d, avgpool2d)])
@pytest.mark.parametrize("case", POOLS, ids=POOL_IDS)
def test_pool_forward_and_gradient(simd_path, case, cls, ref):
    n, c, h, w, k, s = case
    pool = cls(k, s)
    kk, ss = kernels.pair(k, "k"), kernels.pair(k if s is None else s, "s")
    # distinct values: no ties, so the max is differentiable everywhere
    x = np.random.default_rng(3).permutation(n * c * h * w).reshape(n, c, h, w).astype(F32) / 7
    y = pool(x)
    np.testing.assert_allclose(y, ref(x, kk, ss), rtol=1e-6)
    g = np.random.default_rng(4).standard_normal(y.shape)
    dx = pool.backward(g.astype(F32))
    want = numeric_grad(lambda a: np.sum(ref(a, kk, ss) * g.astype(F32)), x, eps=1e-3)
    np.testing.assert_allclose(dx, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [MaxPool2d, AvgPool2d])
def test_pool_buffers_and_bad_input(cls, rng):
    pool = cls(2)
    x1 = rng.standard_normal((2, 3, 6, 6)).astype(F32)
    a = pool(x1)
    a0 = a.copy()
    pool(rng.standard_normal((2, 3, 6, 6)).astype(F32))
    np.testing.assert_array_equal(a, a0)
    with pytest.raises(ValueError, match="x: expected a 4-D NCHW array"):
        pool.forward(x1[0])
    with pytest.raises(ValueError, match=r"x: the input \(1, 6\) is smaller than the window"):
        pool.forward(np.zeros((2, 3, 1, 6), F32))
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(2, 3, 3, 3\)"):
        pool.backward(np.zeros((2, 3, 3, 2), F32))
    pool.needs_input_grad = False
    assert pool.backward(np.zeros((2, 3, 3, 3), F32)) is None
    for args, exc, match in (((0,), ValueError, "kernel_size: expected ints >= 1"),
                             ((2, 0), ValueError, "stride: expected ints >= 1"),
                             ((2.5,), TypeError, "kernel_size: expected an int")):
        with pytest.raises(exc, match=match):
            cls(*args)
    with pytest.raises(RuntimeError, match="call forward first"):
        cls(2).backward(np.zeros((1, 1, 1, 1), F32))


def test_maxpool_tie_goes_to_first_position():
    x = np.array([[[[1, 1], [1, 1]]]], dtype=F32)
    pool = MaxPool2d(2)
    pool.forward(x)
    np.testing.assert_array_equal(pool.backward(np.ones((1, 1, 1, 1), F32)),
                                  [[[[1, 0], [0, 0]]]])


def test_mnist_cnn_stack_trains_a_step(rng):
    """ggml's mnist-cnn layers in one Sequential: shapes line up and the loss's
    gradient reaches the first convolution."""
    from ggmlopt.nn import ReLU
    model = Sequential(Conv2d(1, 8, 3, padding=1, rng=0), ReLU(), MaxPool2d(2),
                       Conv2d(8, 16, 3, padding=1, rng=1), ReLU(), MaxPool2d(2))
    x = rng.standard_normal((4, 1, 28, 28)).astype(F32)
    y = model.forward(x)
    assert y.shape == (4, 16, 7, 7)
    model.backward(np.ones_like(y))
    assert np.abs(model.layers[0].weight.grad).sum() > 0


class _TinyCnn(Sequential):
    """Flat (batch, 1*8*8) datapoints -> conv -> relu -> maxpool -> linear: a model
    for images reshaping itself, as the context feeds flat batches."""

    def __init__(self):
        from ggmlopt.nn import Linear, ReLU
        super().__init__(Conv2d(1, 4, 3, padding=1, rng=0), ReLU(), MaxPool2d(2))
        self.head = Linear(4 * 4 * 4, 3, rng=1)

    def parameters(self):
        return super().parameters() + self.head.parameters()

    def named_children(self):
        yield from super().named_children()
        yield "head", self.head

    def forward(self, x):
        y = super().forward(np.asarray(x, dtype=F32).reshape(-1, 1, 8, 8))
        self._pooled = y.shape
        return self.head.forward(y.reshape(y.shape[0], -1))

    def backward(self, grad_out):
        g = self.head.backward(grad_out)
        return super().backward(g.reshape(self._pooled))


def test_conv_model_trains_with_fit():
    """The layers under an OptContext: parameters in the arena, gradients added
    with grad_is_zero honoured, the loss going down."""
    rng = np.random.default_rng(0)
    n = 300
    labels = rng.integers(0, 3, n)
    data = rng.standard_normal((n, 64)).astype(F32) * 0.1
    data[np.arange(n), labels * 20] += 3  # a bright pixel says the class
    onehot = np.eye(3, dtype=F32)[labels]
    ds = ggmlopt.Dataset.from_arrays(data, onehot, ndata_shard=1)
    model = _TinyCnn()
    history = ggmlopt.fit(model, ds, ggmlopt.LossType.CROSS_ENTROPY, nepoch=8,
                          nbatch_logical=50, nbatch_physical=50, silent=True, seed=1,
                          get_opt_pars=lambda ud: ggmlopt.OptimizerParams(
                              adamw=ggmlopt.AdamWParams(alpha=1e-2)))
    losses = [e.train_loss for e in history]
    assert losses[-1] < 0.5 * losses[0], losses
    assert history[-1].train_accuracy > 0.9
    assert [n for n, _ in ggmlopt.nn.named_parameters(model)][:2] == ["0.weight", "0.bias"]


def test_empty_batch():
    x = np.zeros((0, 2, 5, 5), F32)
    conv = Conv2d(2, 3, 3, padding=1, rng=0)
    conv.weight.grad[...] = 1
    conv.weight.grad_is_zero = False
    y = conv(x)
    assert y.shape == (0, 3, 5, 5)
    assert conv.backward(np.zeros(y.shape, F32)).shape == x.shape
    assert (conv.weight.grad == 1).all()  # nothing added
    for cls in (MaxPool2d, AvgPool2d):
        pool = cls(2)
        y = pool(x)
        assert y.shape == (0, 2, 2, 2) and pool.backward(y).shape == x.shape


@pytest.mark.parametrize("c, o, stride, direct", [
    (1, 8, 1, True), (8, 16, 1, True), (16, 32, 1, True), (32, 32, (1, 1), True),
    (3, 32, 1, False), (33, 8, 1, False), (8, 40, 1, False), (8, 16, 2, False),
    (8, 16, (1, 2), False)])
def test_conv2d_picks_direct_kernels_for_thin_stride_1_layers(rng, c, o, stride, direct):
    """Thin stride-1 layers run the direct kernels, the others im2col + BLAS;
    both give the reference's forward and the same gradients."""
    conv = Conv2d(c, o, 3, stride=stride, padding=1, rng=1)
    assert conv._direct is direct
    x = rng.standard_normal((3, c, 7, 6)).astype(F32)
    y = conv(x)
    want = conv2d(x, conv.weight.data, conv.bias.data, conv.stride, conv.padding)
    scale = conv2d(np.abs(x), np.abs(conv.weight.data), np.abs(conv.bias.data), conv.stride,
                   conv.padding)
    assert np.all(np.abs(y - want) <= 1e-6 * scale + 1e-7)
    if conv.stride != (1, 1):
        return
    conv.needs_input_grad = True
    g = rng.standard_normal(y.shape).astype(F32)
    dx = conv.backward(g)
    dx2, dw2, db2 = kernels.conv2d_direct_backward(x, conv.weight.data, g, 1)
    for a, b in ((dx, dx2), (conv.weight.grad, dw2), (conv.bias.grad, db2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
