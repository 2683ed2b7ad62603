"""Result statistics against the reference's formulas."""
import math

import numpy as np
import pytest

import ggmlopt as go


def add(res, loss, batch=2, per_datapoint=True, opt_period=1, pred=None, ncorrect=None):
    res._check(batch, per_datapoint, opt_period)
    res._add(batch, np.float32(loss), per_datapoint, opt_period, pred, ncorrect)


def test_empty():
    r = go.Result()
    assert r.ndata == 0
    loss, unc = r.loss()
    assert loss == 0.0 and math.isnan(unc)
    assert all(math.isnan(v) for v in r.accuracy())
    assert r.pred().shape == (0,) and r.pred().dtype == np.int32


def test_one_batch_has_nan_uncertainty():
    r = go.Result()
    add(r, 1.5)
    assert r.loss()[0] == 1.5 and math.isnan(r.loss()[1])


def test_per_datapoint_mean_and_standard_error():
    rng = np.random.default_rng(0)
    losses = rng.random(17).astype(np.float32)
    r = go.Result()
    for v in losses:
        add(r, v / 4, opt_period=4)  # stored scaled by 1/opt_period, as ggml does
    scaled = (losses / np.float32(4)) * np.float32(4)
    n = len(losses)
    mean = scaled.astype(np.float64).mean()
    # ggml squares the float32 loss in float32, then sums in double
    var = (scaled * scaled).astype(np.float64).mean() - mean ** 2
    loss, unc = r.loss()
    assert loss == pytest.approx(mean, rel=1e-12)
    assert unc == pytest.approx(math.sqrt(var / (n - 1)), rel=1e-9)
    assert r.ndata == 2 * n


def test_sum_loss_and_uncertainty():
    r = go.Result()
    for v in (3, 4, 5, 6, 7, 8):
        add(r, v, batch=1, per_datapoint=False)
    loss, unc = r.loss()
    assert loss == 33.0 and unc == pytest.approx(math.sqrt(3.5), abs=1e-12)


def test_accuracy_and_pred():
    r = go.Result()
    add(r, 1.0, batch=3, pred=np.array([1, 2, 3], np.int32), ncorrect=2)
    add(r, 1.0, batch=3, pred=np.array([4, 5, 6], np.int32), ncorrect=3)
    acc, unc = r.accuracy()
    assert acc == 5 / 6 and unc == pytest.approx(math.sqrt(5 / 6 * 1 / 6 / 5))
    np.testing.assert_array_equal(r.pred(), [1, 2, 3, 4, 5, 6])
    r.reset()
    assert r.ndata == 0 and r.pred().size == 0


def test_ncorrect_missing_once_means_nan_forever():
    r = go.Result()
    add(r, 1.0, ncorrect=2)
    add(r, 1.0, ncorrect=None)
    add(r, 1.0, ncorrect=2)
    assert all(math.isnan(v) for v in r.accuracy())


def test_single_datapoint_accuracy_unc_is_nan():
    r = go.Result()
    add(r, 1.0, batch=1, ncorrect=1)
    acc, unc = r.accuracy()
    assert acc == 1.0 and math.isnan(unc)


@pytest.mark.parametrize("kw", [{"batch": 3}, {"per_datapoint": False}, {"opt_period": 2}])
def test_mixing_is_an_error_and_changes_nothing(kw):
    r = go.Result()
    add(r, 1.0)
    add(r, 2.0)
    before = (r.ndata, r.loss())
    with pytest.raises(ValueError):
        add(r, 3.0, **{"batch": 2, "per_datapoint": True, "opt_period": 1, **kw})
    assert (r.ndata, r.loss()) == before


def test_empty_result_says_no_batches_and_keeps_ggml_values():
    r = go.Result()
    assert repr(r) == "Result(no batches)"
    loss, unc = r.loss()
    assert loss == 0.0 and math.isnan(unc)   # ggml's return values are kept
    add(r, 1.5)
    assert "loss=1.5" in repr(r) and "no batches" not in repr(r)
    r.reset()
    assert repr(r) == "Result(no batches)"


def test_smaller_last_batch_weighs_by_datapoints():
    r = go.Result()
    add(r, 1.0, batch=4, pred=np.zeros(4, np.int32), ncorrect=4)
    add(r, 2.0, batch=4, pred=np.zeros(4, np.int32), ncorrect=0)
    add(r, 4.0, batch=2, pred=np.ones(2, np.int32), ncorrect=1)
    assert r.ndata == 10 and r.nbatches == 3
    assert r.loss()[0] == pytest.approx((4 * 1.0 + 4 * 2.0 + 2 * 4.0) / 10)
    assert r.accuracy()[0] == pytest.approx(0.5)
    assert r.pred().tolist() == [0] * 8 + [1, 1]
    # the tail ends the Result: neither a full nor another small batch may follow
    for batch in (4, 2, 1):
        with pytest.raises(ValueError, match="smaller batch of 2"):
            add(r, 1.0, batch=batch)
    assert r.ndata == 10


def test_smaller_last_batch_of_sums_adds_up():
    r = go.Result()
    add(r, 3.0, batch=5, per_datapoint=False)
    add(r, 1.0, batch=2, per_datapoint=False)
    assert r.loss()[0] == pytest.approx(4.0)


def test_bigger_batch_is_an_error():
    r = go.Result()
    add(r, 1.0, batch=2)
    with pytest.raises(ValueError, match="only a smaller last batch"):
        add(r, 1.0, batch=3)


def add_labelled(res, loss, nlabelled, batch=2):
    res._check(batch, True, 1)
    res._add(batch, np.float32(loss), True, 1, None, None, nlabelled)


def test_a_batch_without_a_labelled_position_has_no_loss():
    """Masked sequence labels: a batch with every position masked (padding rows
    filling a last logical batch) counts its datapoints, not a loss of 0."""
    r = go.Result()
    add_labelled(r, 2.0, 5)
    add_labelled(r, 0.0, 0)
    add_labelled(r, 4.0, 3)
    assert r.ndata == 6 and r.nbatches == 3 and r.nlabelled == 8
    loss, unc = r.loss()
    assert loss == pytest.approx(3.0)
    assert unc == pytest.approx(math.sqrt(1.0 / 1))   # two losses, var 1
    only_empty = go.Result()   # batches, but none with a loss: no loss (not a perfect 0)
    add_labelled(only_empty, 0.0, 0)
    assert all(math.isnan(v) for v in only_empty.loss())
    # a smaller last batch: the mean over the batches that have a loss
    tail = go.Result()
    add_labelled(tail, 2.0, 4, batch=4)
    add_labelled(tail, 0.0, 0, batch=4)
    add_labelled(tail, 5.0, 1, batch=1)
    assert tail.loss()[0] == pytest.approx((4 * 2.0 + 1 * 5.0) / 5)
    empty_tail = go.Result()
    add_labelled(empty_tail, 2.0, 4, batch=4)
    add_labelled(empty_tail, 0.0, 0, batch=1)
    assert empty_tail.loss()[0] == pytest.approx(2.0)


def test_masked_padding_rows_leave_the_reported_loss_alone():
    """The loss evaluate (and fit) report for token windows is the same with
    rows whose every label is masked added, one micro-batch each."""
    from ggmlopt.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=40, dim=16, n_layers=1, n_heads=2, max_seq_len=16),
                  seed=0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 40, (3, 8)).astype(np.int32)
    y = rng.integers(0, 40, (3, 8)).astype(np.int32)
    padded_x = np.concatenate([x, np.zeros((2, 8), np.int32)])
    padded_y = np.concatenate([y, np.full((2, 8), -1, np.int32)])
    plain = go.evaluate(model, (x, y), "cross_entropy", batch_size=1)
    padded = go.evaluate(model, (padded_x, padded_y), "cross_entropy", batch_size=1)
    assert padded.ndata == 5 and padded.nlabelled == plain.nlabelled == 24
    assert padded.loss()[0] == pytest.approx(plain.loss()[0], rel=1e-12)
    assert padded.loss()[1] == pytest.approx(plain.loss()[1], rel=1e-12)
    assert padded.accuracy() == plain.accuracy()
