"""Cross-entropy and squared error: values and gradients against float64
references, gradients also against central differences of the reference loss."""
import numpy as np
import pytest

from ggmlopt import kernels

F32 = np.float32


def cross_entropy_reference(logits, labels, grad_scale=1.0):
    """(loss, grad) in float64: loss = mean over rows of -sum(labels * log_softmax),
    terms with a zero label dropped; grad = (softmax - labels) * grad_scale / rows."""
    x = np.asarray(logits, np.float64)
    lab = np.asarray(labels, np.float64)
    t = x - x.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        log_sum = np.log(np.exp(t).sum(axis=1, keepdims=True))
        log_p = t - log_sum
        terms = np.where(lab != 0, lab * log_p, 0.0)
    loss = -terms.sum(axis=1).mean()
    grad = (np.exp(log_p) - lab) * float(F32(grad_scale)) / x.shape[0]
    return loss, grad


def softmax_rows(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(F32)


CE_SHAPES = [(1, 1), (1, 2), (2, 3), (3, 7), (2, 8), (3, 9), (2, 15), (2, 16), (3, 17),
             (2, 31), (2, 33), (5, 1000), (2, 4097), (1, 300_001), (3000, 10), (64, 1000)]
CE_IDS = [f"{r}x{c}" for r, c in CE_SHAPES]


@pytest.mark.parametrize("shape", CE_SHAPES, ids=CE_IDS)
def test_cross_entropy_matches_float64(simd_path, shape, rng, place):
    rows, cols = shape
    offset = 1 + (rows + cols) % 3
    logits = place((rng.standard_normal(shape) * 3).astype(F32), offset)
    labels = place(softmax_rows(rng.standard_normal(shape)), offset)
    grad = place(np.full(shape, np.nan, F32), offset)
    loss = kernels.cross_entropy(logits, labels, grad, grad_scale=0.5)
    ref_loss, ref_grad = cross_entropy_reference(logits, labels, 0.5)
    assert isinstance(loss, float)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=2e-6 * 0.5 / rows)
    # the loss alone (no grad) is the same number
    assert kernels.cross_entropy(logits, labels) == loss


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 9), (2, 17), (1, 33)])
def test_cross_entropy_gradient_is_the_numerical_derivative(simd_path, shape, rng):
    x = (rng.standard_normal(shape) * 2).astype(F32)
    labels = softmax_rows(rng.standard_normal(shape))
    grad = np.empty(shape, F32)
    kernels.cross_entropy(x, labels, grad)
    h = 1e-3
    x64 = x.astype(np.float64)
    numeric = np.empty(shape)
    for idx in np.ndindex(*shape):
        up, down = x64.copy(), x64.copy()
        up[idx] += h
        down[idx] -= h
        numeric[idx] = (cross_entropy_reference(up, labels)[0]
                        - cross_entropy_reference(down, labels)[0]) / (2 * h)
    # labels sum to 1 up to float32 rounding, so softmax - labels is the derivative
    np.testing.assert_allclose(grad, numeric, rtol=1e-3, atol=1e-5)


def test_cross_entropy_with_unnormalised_labels_follows_ggml(simd_path, rng):
    # ggml's backward is softmax - labels whatever the labels sum to
    x = rng.standard_normal((3, 17)).astype(F32)
    labels = rng.random((3, 17)).astype(F32)
    grad = np.empty_like(x)
    loss = kernels.cross_entropy(x, labels, grad)
    ref_loss, ref_grad = cross_entropy_reference(x, labels)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("ncols", [1, 7, 8, 9, 16, 17, 33])
def test_cross_entropy_of_equal_logits_is_log_n(simd_path, ncols):
    x = np.full((2, ncols), 4.25, F32)
    labels = np.zeros((2, ncols), F32)
    labels[:, -1] = 1.0
    grad = np.empty_like(x)
    loss = kernels.cross_entropy(x, labels, grad)
    assert loss == pytest.approx(np.log(ncols), rel=1e-6, abs=1e-7)
    expected = np.full((2, ncols), 1.0 / ncols) - labels
    np.testing.assert_allclose(grad, expected / 2, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ncols", [2, 7, 8, 9, 16, 17, 33])
def test_cross_entropy_ignores_minus_inf_logits_with_zero_labels(simd_path, ncols, rng):
    x = rng.standard_normal((3, ncols)).astype(F32)
    x[:, ::2] = -np.inf
    x[:, -1] = 0.5                            # every row keeps one finite logit
    labels = softmax_rows(rng.standard_normal((3, ncols)))
    labels[np.isinf(x)] = 0.0
    grad = np.empty_like(x)
    loss = kernels.cross_entropy(x, labels, grad)
    ref_loss, ref_grad = cross_entropy_reference(x, labels)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert np.all(grad[np.isinf(x)] == 0)


@pytest.mark.parametrize("ncols", [2, 7, 8, 9, 16, 17, 33])
def test_cross_entropy_of_huge_logits(simd_path, ncols):
    x = np.full((3, ncols), -1e30, F32)
    x[:, 0] = 1e30
    labels = np.zeros_like(x)
    labels[0, 0] = 1.0                        # on the winner: loss 0
    labels[1, 1] = 1.0                        # on a loser: loss 2e30
    labels[2, 0] = labels[2, 1] = 0.5
    grad = np.empty_like(x)
    loss = kernels.cross_entropy(x, labels, grad)
    ref_loss, ref_grad = cross_entropy_reference(x, labels)
    assert ref_loss == pytest.approx((0 + 2e30 + 1e30) / 3, rel=1e-6)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-6, atol=1e-7)


def test_cross_entropy_with_zero_labels_is_zero(simd_path, rng):
    x = rng.standard_normal((4, 9)).astype(F32)
    grad = np.empty_like(x)
    assert kernels.cross_entropy(x, np.zeros_like(x), grad) == 0.0
    np.testing.assert_allclose(grad, softmax_rows(x.astype(np.float64)) / 4, rtol=1e-5)


def test_cross_entropy_of_one_hot_labels(simd_path, rng):
    x = rng.standard_normal((50, 10)).astype(F32)
    hot = rng.integers(0, 10, 50)
    labels = np.eye(10, dtype=F32)[hot]
    x64 = x.astype(np.float64)
    log_p = x64 - x64.max(1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(1, keepdims=True))
    assert kernels.cross_entropy(x, labels) == pytest.approx(
        -log_p[np.arange(50), hot].mean(), rel=1e-5)


def test_cross_entropy_of_narrow_rows_in_any_count(simd_path, rng):
    # the vector paths take narrow rows a register's width at a time and the
    # leftover rows one by one: every count, with -inf, huge, NaN-free special rows
    # (16-lane avx512 blocks: 2 of them plus leftovers; up to 40 columns and past it)
    for cols in [*range(1, 23), 31, 39, 40, 41]:
        for rows in [*range(1, 18), 31, 32, 33, 47]:
            x = (rng.standard_normal((rows, cols)) * 3).astype(F32)
            labels = softmax_rows(rng.standard_normal((rows, cols)))
            if cols > 1:
                x[::3, 0] = -np.inf                  # -inf logit with a zero label
                labels[::3, 0] = 0.0
                x[1::4, -1] = 1e30                   # a huge winner
                x[1::4, 0] = -1e30
            labels[2::5] = 0.0                       # rows without labels add 0
            grad = np.full((rows, cols), np.nan, F32)
            loss = kernels.cross_entropy(x, labels, grad, grad_scale=0.75)
            ref_loss, ref_grad = cross_entropy_reference(x, labels, 0.75)
            where = f"{rows}x{cols}"
            assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), where
            np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=2e-6 * 0.75 / rows,
                                       err_msg=where)
            assert kernels.cross_entropy(x, labels) == loss, where


# ---- squared error -------------------------------------------------------------

def test_squared_error_matches_float64(simd_path, layout, rng, place):
    size, offset = layout
    out = place(rng.standard_normal(size).astype(F32), offset)
    labels = place(rng.standard_normal(size).astype(F32), offset)
    grad = place(np.full(size, np.nan, F32), offset)
    s = kernels.squared_error(out, labels, grad, grad_scale=0.25)
    d = out.astype(np.float64) - labels.astype(np.float64)
    assert isinstance(s, float)
    assert s == pytest.approx(np.sum(d * d), rel=1e-6)
    np.testing.assert_allclose(grad, 2 * d * 0.25, rtol=1e-6, atol=1e-7)
    assert kernels.squared_error(out, labels) == s


def test_squared_error_gradient_is_the_numerical_derivative(simd_path, rng):
    out = rng.standard_normal(17).astype(F32)
    labels = rng.standard_normal(17).astype(F32)
    grad = np.empty(17, F32)
    kernels.squared_error(out, labels, grad)

    def loss(o):
        return np.sum((o - labels.astype(np.float64)) ** 2)

    h = 1e-3
    o64 = out.astype(np.float64)
    numeric = np.array([(loss(o64 + h * e) - loss(o64 - h * e)) / (2 * h)
                        for e in np.eye(17)])
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-6)


def test_squared_error_of_equal_arrays_is_zero(simd_path, rng):
    x = rng.standard_normal(33).astype(F32)
    grad = np.full(33, np.nan, F32)
    assert kernels.squared_error(x, x.copy(), grad) == 0.0
    np.testing.assert_array_equal(grad, 0)


def test_squared_error_of_empty_arrays_is_zero(simd_path):
    e = np.zeros(0, F32)
    assert kernels.squared_error(e, e.copy()) == 0.0


@pytest.mark.parametrize("ncols", [1, 3, 10, 17, 40, 41, 300, 1027])
def test_a_bf16_gradient_is_the_float32_one_rounded(ncols):
    # the class-index loss into a uint16 gradient: to_bfloat16 of the float32
    # gradient, bit for bit, with the same loss and argmax (narrow rows take the
    # transposed kernel, wide ones the row kernel; masked rows get zeros)
    rng = np.random.default_rng(ncols)
    rows = 37
    x = (rng.standard_normal((rows, ncols)) * 4).astype(F32)
    c = rng.integers(0, ncols, rows).astype(np.int32)
    c[::5] = -1
    g = np.empty_like(x)
    pred, pred16 = np.empty(rows, np.int32), np.empty(rows, np.int32)
    loss = kernels.cross_entropy(x, c, g, 0.7, ignore_index=-1, pred=pred)
    g16 = np.full(x.shape, 0x7FC1, np.uint16)
    before = x.copy()
    loss16 = kernels.cross_entropy(x, c, g16, 0.7, ignore_index=-1, pred=pred16)
    assert loss16 == loss
    np.testing.assert_array_equal(g16, kernels.to_bfloat16(g))
    np.testing.assert_array_equal(pred16, pred)
    np.testing.assert_array_equal(x, before)
    assert (g16[c < 0] == 0).all()


def test_a_bf16_gradient_is_refused_where_it_cannot_be_written():
    x = np.zeros((4, 6), F32)
    c = np.zeros(4, np.int32)
    with pytest.raises(ValueError, match="only with int32 class indices"):
        kernels.cross_entropy(x, np.zeros((4, 6), F32), np.zeros((4, 6), np.uint16))
    with pytest.raises(ValueError, match="expected 24 elements"):
        kernels.cross_entropy(x, c, np.zeros((4, 5), np.uint16))
    shared = np.zeros(24, F32)
    with pytest.raises(ValueError, match="grad"):   # the logits' own memory
        kernels.cross_entropy(shared.reshape(4, 6), c, shared.view(np.uint16)[:24].reshape(4, 6))
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros((4, 6), np.uint16)
        ro.flags.writeable = False
        kernels.cross_entropy(x, c, ro)
