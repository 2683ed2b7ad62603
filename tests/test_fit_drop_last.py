"""fit(..., drop_last=True): a dataset whose size is not a multiple of the
logical batch trains on whole batches, leaving the rest of each epoch's order
out (other datapoints each epoch when nothing validates), resumes bit for bit,
and without drop_last is refused with the way out named."""
import numpy as np
import pytest

import ggmlopt as go

LT = go.LossType
NDATA, BATCH = 10, 4


class Recording(go.nn.Linear):
    """A Linear that notes which datapoints (their first feature is the index)
    each training forward saw."""

    def __init__(self):
        super().__init__(3, 2, rng=0)
        self.seen = []

    def forward(self, x):
        if self.training:
            self.seen.append(np.rint(x[:, 0]).astype(int).tolist())
        return super().forward(x)


def problem():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NDATA, 3)).astype(np.float32)
    x[:, 0] = np.arange(NDATA)   # each datapoint names itself
    y = np.eye(2, dtype=np.float32)[rng.integers(0, 2, NDATA)]
    return go.Dataset.from_arrays(x, y)


def test_without_drop_last_a_ragged_dataset_is_refused_naming_it():
    with pytest.raises(ValueError, match="pass drop_last=True to leave 2 datapoints out"):
        go.fit(Recording(), problem(), LT.MEAN_SQUARED_ERROR, nbatch_logical=BATCH,
               silent=True)
    with pytest.raises(ValueError, match="makes no logical batch"):
        go.fit(Recording(), problem(), LT.MEAN_SQUARED_ERROR, nbatch_logical=NDATA + 1,
               drop_last=True, silent=True)
    with pytest.raises(TypeError, match="drop_last: expected a bool"):
        go.fit(Recording(), problem(), LT.MEAN_SQUARED_ERROR, nbatch_logical=BATCH,
               drop_last=1, silent=True)


def test_each_epoch_trains_whole_batches_and_leaves_out_others():
    model = Recording()
    hist = go.fit(model, problem(), LT.MEAN_SQUARED_ERROR, nepoch=6, nbatch_logical=BATCH,
                  drop_last=True, silent=True, seed=3)
    assert (hist.ndata_train, hist.ndata_val) == (8, 0)
    assert len(model.seen) == 12 and all(len(b) == BATCH for b in model.seen)
    epochs = [sorted(model.seen[2 * e] + model.seen[2 * e + 1]) for e in range(6)]
    assert all(len(set(e)) == 8 for e in epochs)                 # no datapoint twice
    left_out = {tuple(sorted(set(range(NDATA)) - set(e))) for e in epochs}
    assert len(left_out) > 1                                     # not the same two each time
    assert set().union(*epochs) == set(range(NDATA))


def test_with_a_validation_part_the_same_datapoints_stay_out():
    model = Recording()
    hist = go.fit(model, problem(), LT.MEAN_SQUARED_ERROR, nepoch=4, nbatch_logical=BATCH,
                  val_split=0.5, drop_last=True, silent=True, seed=1)
    assert (hist.ndata_train, hist.ndata_val) == (4, 4)
    trained = {i for b in model.seen for i in b}
    assert len(trained) == 4 and all(len(b) == BATCH for b in model.seen)
    assert np.isfinite([e.val_loss for e in hist]).all()


def test_a_drop_last_fit_resumes_bit_for_bit(tmp_path):
    straight = Recording()
    go.fit(straight, problem(), LT.MEAN_SQUARED_ERROR, nepoch=4, nbatch_logical=BATCH,
           drop_last=True, silent=True, seed=5)
    resumed = Recording()
    path = tmp_path / "ckpt.npz"
    go.fit(resumed, problem(), LT.MEAN_SQUARED_ERROR, nepoch=2, nbatch_logical=BATCH,
           drop_last=True, silent=True, seed=5, checkpoint=path)
    go.fit(resumed, problem(), LT.MEAN_SQUARED_ERROR, nepoch=4, nbatch_logical=BATCH,
           drop_last=True, silent=True, seed=5, checkpoint=path, resume=True)
    assert resumed.seen == straight.seen
    for a, b in zip(resumed.parameters(), straight.parameters()):
        np.testing.assert_array_equal(a.data, b.data)
