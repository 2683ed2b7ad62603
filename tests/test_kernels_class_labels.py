"""Cross-entropy against int32 class indices: the same loss and gradient as the
one-hot labels they stand for, on every SIMD path and on awkward shapes; and the
kernel regressions found by differential tests (argmax over all-NaN chunks,
adamw_bias_corrections' arguments)."""
import numpy as np
import pytest

from ggmlopt import kernels

F32 = np.float32

# (rows, classes): 1 row, 1 class, narrow rows (the vector paths take 8 or 16 at
# a time), 17 classes, wide rows and a 32000-word vocabulary
SHAPES = [(1, 1), (1, 10), (7, 1), (9, 10), (35, 10), (33, 17), (16, 20), (49, 20), (17, 24),
          (33, 21), (35, 40), (17, 41), (5, 1000), (3, 4097), (2, 32000)]


def _problem(rng, rows, classes):
    logits = rng.normal(0, 3, (rows, classes)).astype(F32)
    if classes > 2:
        logits[:, 1] = -np.inf  # a -inf logit away from the class costs nothing
    cls = rng.integers(0, classes, rows).astype(np.int32)
    cls[0] = classes - 1
    if classes > 2:
        cls[cls == 1] = 0
    onehot = np.zeros((rows, classes), F32)
    onehot[np.arange(rows), cls] = 1
    return logits, cls, onehot


@pytest.mark.parametrize("rows,classes", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
@pytest.mark.parametrize("form", ["n", "n1"])
def test_index_path_equals_the_one_hot_path(simd_path, rng, rows, classes, form):
    logits, cls, onehot = _problem(rng, rows, classes)
    labels = cls if form == "n" else cls.reshape(rows, 1)
    g_idx = np.full_like(logits, 7.0)
    g_hot = np.full_like(logits, -7.0)
    loss_idx = kernels.cross_entropy(logits, labels, g_idx, grad_scale=0.5)
    loss_hot = kernels.cross_entropy(logits, onehot, g_hot, grad_scale=0.5)
    assert loss_idx == pytest.approx(loss_hot, rel=1e-6, abs=1e-7)
    np.testing.assert_allclose(g_idx, g_hot, rtol=1e-6, atol=1e-9)
    # and both against float64
    x = logits.astype(np.float64)
    t = x - x.max(axis=1, keepdims=True)
    log_p = t - np.log(np.exp(t).sum(axis=1, keepdims=True))
    want = -log_p[np.arange(rows), cls].mean()
    assert loss_idx == pytest.approx(want, rel=2e-5, abs=1e-6)
    gwant = (np.exp(log_p) - onehot) * 0.5 / rows
    np.testing.assert_allclose(g_idx, gwant, rtol=1e-4, atol=1e-6)
    assert loss_idx == kernels.cross_entropy(logits, labels)  # without grad: the same sums


def test_index_path_pred_and_ncorrect_match(simd_path, rng):
    logits, cls, onehot = _problem(rng, 41, 10)
    pred = kernels.argmax_rows(logits)
    assert kernels.count_equal(pred, cls) == kernels.count_equal(pred, kernels.argmax_rows(onehot))


def test_index_path_threads_many_rows(restore_threads, rng):
    logits, cls, onehot = _problem(rng, 20000, 10)
    g1, g2 = np.zeros_like(logits), np.zeros_like(logits)
    for n in (1, 2):
        kernels.set_num_threads(n)
        a = kernels.cross_entropy(logits, cls, g1)
        b = kernels.cross_entropy(logits, onehot, g2)
        assert a == pytest.approx(b, rel=1e-6)
        np.testing.assert_allclose(g1, g2, rtol=1e-6, atol=1e-12)


def test_a_class_out_of_range_writes_nothing():
    logits = np.zeros((3, 4), F32)
    grad = np.full((3, 4), 5.0, F32)
    for bad in ([0, 4, 1], [0, 1, -1], [2**31 - 1, 0, 0]):
        with pytest.raises(IndexError, match=r"^labels: class"):
            kernels.cross_entropy(logits, np.array(bad, np.int32), grad)
        assert (grad == 5.0).all()


# ---- argmax_rows: all-NaN chunks after a -inf maximum --------------------------------

@pytest.mark.parametrize("nan_run", [8, 61, 64, 65, 125, 128, 129, 200, 300])  # chunks: 64 or 128
def test_argmax_ignores_all_nan_chunks_after_a_neg_inf_max(simd_path, nan_run):
    x = np.array([[-np.inf] * 3 + [np.nan] * nan_run], F32)
    assert kernels.argmax_rows(x)[0] == 2
    y = np.array([[np.nan] * 70 + [-np.inf] * 3 + [np.nan] * nan_run], F32)
    assert kernels.argmax_rows(y)[0] == 72
    assert kernels.argmax_rows(np.full((1, 67 + nan_run), np.nan, F32))[0] == 0


# ---- adamw_bias_corrections checks its arguments ------------------------------------

@pytest.mark.parametrize("beta1,beta2,exc,pattern", [
    (None, 0.999, TypeError, r"^beta1: expected a real number"),
    ("0.9", 0.999, TypeError, r"^beta1: expected a real number, got str"),
    (0.9, [0.999], TypeError, r"^beta2:"),
    (float("nan"), 0.999, ValueError, r"^beta1: expected a finite"),
    (0.9, float("inf"), ValueError, r"^beta2: expected a finite"),
    (0.9, 1e300, ValueError, r"^beta2: expected a finite"),
    (10**400, 0.999, ValueError, r"^beta1: int too large"),
])
def test_adamw_bias_corrections_check_betas(beta1, beta2, exc, pattern):
    with pytest.raises(exc, match=pattern):
        kernels.adamw_bias_corrections(beta1, beta2, 1)


def test_adamw_bias_corrections_check_a_huge_iteration():
    with pytest.raises(ValueError, match=r"^iteration: expected < 2\*\*63"):
        kernels.adamw_bias_corrections(0.9, 0.999, 10**30)
    b1h, b2h = kernels.adamw_bias_corrections(0.9, 0.999, 2**63 - 1)
    assert (b1h, b2h) == (1.0, 1.0)
    assert kernels.adamw_bias_corrections(np.float32(0.9), 0.999, np.int64(1))[0] == \
        pytest.approx(10.0, rel=1e-6)
