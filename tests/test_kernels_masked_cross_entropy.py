"""Cross-entropy against class indices with masked rows (ignore_index=-1, the
padding and prompt positions of language-model batches): torch's
F.cross_entropy(..., ignore_index=-1), on every SIMD path and awkward shapes."""
import numpy as np
import pytest

from ggmlopt import kernels

F32 = np.float32
SHAPES = [(1, 1), (1, 10), (9, 10), (35, 10), (33, 17), (49, 20), (17, 41), (5, 1000),
          (3, 4097), (4, 32000)]


def _masked_problem(rng, rows, classes, masked_share=0.4):
    logits = rng.normal(0, 3, (rows, classes)).astype(F32)
    cls = rng.integers(0, classes, rows).astype(np.int32)
    cls[rng.random(rows) < masked_share] = -1
    if rows > 1:
        cls[0], cls[-1] = classes - 1, -1
    return logits, cls


def _reference(logits, cls, grad_scale):
    """Float64 loss and gradient: mean over the labelled rows, masked rows zero."""
    x = logits.astype(np.float64)
    t = x - x.max(axis=1, keepdims=True)
    log_p = t - np.log(np.exp(t).sum(axis=1, keepdims=True))
    keep = cls >= 0
    n = max(int(keep.sum()), 1)
    loss = -log_p[keep, cls[keep]].sum() / n
    onehot = np.zeros_like(x)
    onehot[np.flatnonzero(keep), cls[keep]] = 1
    grad = (np.exp(log_p) - onehot) * grad_scale / n
    grad[~keep] = 0
    return loss, grad


@pytest.mark.parametrize("rows,classes", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_masked_rows_add_nothing(simd_path, rng, rows, classes):
    logits, cls = _masked_problem(rng, rows, classes)
    grad = np.full_like(logits, 7.0)
    loss = kernels.cross_entropy(logits, cls, grad, grad_scale=0.5, ignore_index=-1)
    want, gwant = _reference(logits, cls, 0.5)
    assert loss == pytest.approx(want, rel=2e-5, abs=1e-6)
    np.testing.assert_allclose(grad, gwant, rtol=1e-4, atol=1e-7)
    assert (grad[cls < 0] == 0).all()
    # the labelled rows alone give the same numbers
    keep = cls >= 0
    if keep.any():
        sub_grad = np.zeros((int(keep.sum()), classes), F32)
        sub = kernels.cross_entropy(np.ascontiguousarray(logits[keep]), cls[keep], sub_grad,
                                    grad_scale=0.5)
        assert loss == pytest.approx(sub, rel=1e-6, abs=1e-7)
        np.testing.assert_allclose(grad[keep], sub_grad, rtol=1e-6, atol=1e-9)


def test_torch_agrees():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    logits, cls = _masked_problem(rng, 37, 300)
    grad = np.zeros_like(logits)
    loss = kernels.cross_entropy(logits, cls, grad, ignore_index=-1)
    t = torch.tensor(logits, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(t, torch.tensor(cls, dtype=torch.long),
                                            ignore_index=-1)
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-4, atol=1e-7)


def test_every_row_masked_gives_zero_loss_and_gradient(simd_path):
    logits = np.ones((5, 12), F32)
    grad = np.full_like(logits, 3.0)
    assert kernels.cross_entropy(logits, np.full(5, -1, np.int32), grad, ignore_index=-1) == 0
    assert (grad == 0).all()


def test_unmasked_calls_are_unchanged(rng):
    logits, cls = _masked_problem(rng, 40, 10, masked_share=0)
    cls[-1] = 3
    g1, g2 = np.zeros_like(logits), np.zeros_like(logits)
    a = kernels.cross_entropy(logits, cls, g1)
    b = kernels.cross_entropy(logits, cls, g2, ignore_index=-1)
    assert a == b
    np.testing.assert_array_equal(g1, g2)


def test_without_ignore_index_minus_one_is_out_of_range():
    grad = np.full((2, 3), 5.0, F32)
    with pytest.raises(IndexError, match=r"class -1 at row 1"):
        kernels.cross_entropy(np.zeros((2, 3), F32), np.array([0, -1], np.int32), grad)
    with pytest.raises(IndexError, match=r"class -2 at row 0.*or -1 \(ignore_index\)"):
        kernels.cross_entropy(np.zeros((2, 3), F32), np.array([-2, 0], np.int32), grad,
                              ignore_index=-1)
    assert (grad == 5.0).all()
    with pytest.raises(ValueError, match="ignore_index: expected None or -1"):
        kernels.cross_entropy(np.zeros((2, 3), F32), np.array([0, 1], np.int32),
                              ignore_index=-100)
    with pytest.raises(ValueError, match="ignore_index: only for int32 class indices"):
        kernels.cross_entropy(np.zeros((2, 3), F32), np.zeros((2, 3), F32), ignore_index=-1)


@pytest.mark.parametrize("rows,classes", SHAPES + [(40, 1500), (300, 33)],
                         ids=[f"{r}x{c}" for r, c in SHAPES + [(40, 1500), (300, 33)]])
def test_predictions_read_in_the_same_pass(simd_path, rng, rows, classes):
    """pred= gives argmax_rows' index for every row (masked ones too; ties to the
    last maximal index), and the loss and gradient bits are those without it."""
    logits, cls = _masked_problem(rng, rows, classes)
    # ties: a row whose maximum appears twice, one of all-equal values
    logits[0, :] = 1.0
    if classes > 2:
        logits[-1, 1] = logits[-1, classes - 1] = logits[-1].max() + 1.0
    grad, grad_plain = np.empty_like(logits), np.empty_like(logits)
    pred = np.full(rows, -7, np.int32)
    loss = kernels.cross_entropy(logits, cls, grad, grad_scale=0.5, ignore_index=-1, pred=pred)
    plain = kernels.cross_entropy(logits, cls, grad_plain, grad_scale=0.5, ignore_index=-1)
    np.testing.assert_array_equal(pred, kernels.argmax_rows(logits))
    np.testing.assert_array_equal(pred, classes - 1 - np.argmax(logits[:, ::-1], axis=1))
    assert loss == plain
    np.testing.assert_array_equal(grad, grad_plain)
    # without a gradient too
    pred2 = np.empty(rows, np.int32)
    assert kernels.cross_entropy(logits, cls, None, ignore_index=-1, pred=pred2) == \
        kernels.cross_entropy(logits, cls, None, ignore_index=-1)
    np.testing.assert_array_equal(pred2, pred)


def test_predictions_refused_where_they_do_not_fit(rng):
    logits, cls = _masked_problem(rng, 5, 7)
    pred = np.full(5, -7, np.int32)
    with pytest.raises(ValueError, match="pred: only with int32 class indices"):
        kernels.cross_entropy(logits, np.eye(7, dtype=F32)[:5], pred=pred)
    with pytest.raises(ValueError, match="pred: expected 5 elements"):
        kernels.cross_entropy(logits, cls, ignore_index=-1, pred=np.empty(4, np.int32))
    with pytest.raises(TypeError, match="pred"):
        kernels.cross_entropy(logits, cls, ignore_index=-1, pred=np.empty(5, np.int64))
    assert (pred == -7).all()


@pytest.mark.parametrize("rows,classes", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
@pytest.mark.parametrize("with_pred", [False, True])
def test_the_gradient_may_overwrite_the_logits(simd_path, rng, rows, classes, with_pred):
    """grad=logits (the fused head's one chunk buffer): the loss, the gradient and
    the predictions are the bits of the computation into another array."""
    logits, cls = _masked_problem(rng, rows, classes)
    grad = np.empty_like(logits)
    pred = np.empty(rows, np.int32) if with_pred else None
    loss = kernels.cross_entropy(logits, cls, grad, 0.7, ignore_index=-1, pred=pred)
    in_place = logits.copy()
    pred2 = np.empty(rows, np.int32) if with_pred else None
    loss2 = kernels.cross_entropy(in_place, cls, in_place, 0.7, ignore_index=-1, pred=pred2)
    assert loss2 == loss
    np.testing.assert_array_equal(in_place, grad)
    if with_pred:
        np.testing.assert_array_equal(pred2, pred)


def test_a_gradient_overlapping_the_logits_elsewhere_is_refused(rng):
    logits, cls = _masked_problem(rng, 6, 10)
    buf = np.concatenate([logits.ravel(), np.zeros(10, F32)])
    shifted = buf[10:].reshape(6, 10)   # one row later than the logits
    with pytest.raises(ValueError, match="overlap"):
        kernels.cross_entropy(buf[:60].reshape(6, 10), cls, shifted, ignore_index=-1)
    onehot = np.eye(10, dtype=F32)[np.maximum(cls, 0)]
    with pytest.raises(ValueError, match="overlap"):   # in place: class indices only
        kernels.cross_entropy(logits, onehot, logits)
