"""epoch and fit: fit is epoch plus ggml's shuffles and split, bit for bit."""
import math

import numpy as np
import pytest

import ggmlopt as go

LT = go.LossType


def mlp(seed=0):
    return go.nn.Sequential(go.nn.Linear(6, 8, rng=seed), go.nn.ReLU(),
                            go.nn.Linear(8, 3, rng=seed + 1))


def dataset(ndata=120, shard=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ndata, 6)).astype(np.float32)
    y = np.eye(3, dtype=np.float32)[(x[:, 0] > 0).astype(int) + (x[:, 1] > 0.5)]
    return go.Dataset.from_arrays(x, y, ndata_shard=shard)


def split(val_split, nbatches_logical, opt_period):
    return int(np.float32(np.float32(1) - np.float32(val_split))
               * np.float32(nbatches_logical)) * opt_period


@pytest.mark.parametrize("optimizer", list(go.OptimizerType))
def test_fit_equals_epoch_loop_bit_for_bit(optimizer):
    nepoch, nbl, nbp, val_split, seed = 3, 20, 10, 0.25, 11
    seen = []

    def pars(ud):
        seen.append(ud)
        p = go.default_optimizer_params()
        p.adamw.alpha = p.sgd.alpha = 0.01 / ud
        return p

    model_fit = mlp()
    hist = go.fit(model_fit, dataset(), LT.CROSS_ENTROPY, pars, nepoch=nepoch,
                  nbatch_logical=nbl, nbatch_physical=nbp, val_split=val_split, silent=True,
                  optimizer=optimizer, seed=seed)
    assert sorted(set(seen)) == [1, 2, 3]  # the 1-based epoch as userdata

    model = mlp()
    ds = dataset()
    ctx = go.OptContext(model, batch_size=nbp, ne_datapoint=6, loss_type=LT.CROSS_ENTROPY,
                        opt_period=nbl // nbp, optimizer=optimizer, get_opt_pars=pars,
                        seed=seed)
    idata_split = split(val_split, 120 // nbl, nbl // nbp) * nbp
    assert idata_split == 80
    ds.shuffle(ctx, -1)
    for ep in range(1, nepoch + 1):
        ctx.get_opt_pars_ud = ep
        ds.shuffle(ctx, idata_split)
        rt, rv = go.Result(), go.Result()
        go.epoch(ctx, ds, rt, rv, idata_split)
        e = hist[ep - 1]
        assert (e.train_loss, e.train_loss_unc) == rt.loss()
        assert (e.train_accuracy, e.train_accuracy_unc) == rt.accuracy()
        assert (e.val_loss, e.val_loss_unc) == rv.loss()
        assert (e.val_accuracy, e.val_accuracy_unc) == rv.accuracy()
        assert rt.ndata == 80 and rv.ndata == 40
    for a, b in zip(model.parameters(), model_fit.parameters()):
        np.testing.assert_array_equal(a.data, b.data)
    assert len(hist) == 3 and hist.train_loss == [e.train_loss for e in hist]
    assert all(s >= 0 for s in hist.seconds)


def test_fit_is_deterministic_with_a_seed_and_learns():
    def run(seed):
        model = mlp(seed=4)
        h = go.fit(model, dataset(), LT.CROSS_ENTROPY,
                   lambda ep: go.OptimizerParams(go.AdamWParams(alpha=0.03)),
                   nepoch=15, nbatch_logical=20,
                   nbatch_physical=10, val_split=0.0, silent=True, seed=seed)
        return model[0].weight.data.copy(), h

    w1, h1 = run(3)
    w2, _ = run(3)
    w3, _ = run(4)
    np.testing.assert_array_equal(w1, w2)
    assert not np.array_equal(w1, w3)
    assert h1[-1].train_loss < h1[0].train_loss
    assert h1[-1].train_accuracy > 0.8
    assert math.isnan(h1[0].val_loss_unc) and math.isnan(h1[0].val_loss)  # no validation batches


@pytest.mark.parametrize("val_split,ndata,nbl,expected", [
    (0.05, 60000, 1000, 57000), (0.0, 120, 20, 120), (0.5, 120, 20, 60), (0.3, 120, 40, 80),
    (0.999, 120, 20, 0)])
def test_validation_split_in_float32(val_split, ndata, nbl, expected):
    assert split(val_split, ndata // nbl, 1) * nbl == expected


def test_fit_split_sizes_and_prints(capsys):
    model = mlp()
    hist = go.fit(model, dataset(), LT.CROSS_ENTROPY, nepoch=2, nbatch_logical=20,
                  nbatch_physical=10, val_split=0.5)
    err = capsys.readouterr().err
    assert "fit: epoch 0001/0002:\n" in err and "fit: epoch 0002/0002:\n" in err
    assert err.rstrip("\n").splitlines()[-1].startswith("fit: training took 00:00:")
    assert err.count("train: [") == 2 and err.count("val:   [") == 2
    assert "data=0000060/0000060" in err
    assert not math.isnan(hist[0].val_accuracy)
    go.fit(mlp(), dataset(), LT.CROSS_ENTROPY, nbatch_logical=20, silent=True)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("kw,exc", [
    ({"nbatch_logical": 7}, ValueError),              # 120 % 7
    ({"nbatch_logical": 20, "nbatch_physical": 8}, ValueError),
    ({"nbatch_logical": 20, "nbatch_physical": 5}, ValueError),  # shards of 2
    ({"nbatch_logical": 20, "val_split": 1.0}, ValueError),
    ({"nbatch_logical": 20, "val_split": -0.1}, ValueError),
    ({"nbatch_logical": 20, "nepoch": -1}, ValueError),
    ({"nbatch_logical": 20, "checkpoint": 3.5}, TypeError),
    ({"nbatch_logical": 20, "clip_grad_norm": -1.0}, ValueError),
    ({"nbatch_logical": 20, "clip_grad_norm": float("nan")}, ValueError),
    ({"nbatch_logical": 20, "resume": True}, ValueError),  # no checkpoint to resume from
    ({"nbatch_logical": 7, "checkpoint": "x"}, ValueError),
])
def test_fit_bad_input(kw, exc, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # a relative checkpoint may never land in the source tree
    model = mlp()
    w = model[0].weight.data.copy()
    ds = dataset()
    with pytest.raises(exc):
        go.fit(model, ds, LT.CROSS_ENTROPY, silent=True, **kw)
    np.testing.assert_array_equal(model[0].weight.data, w)
    np.testing.assert_array_equal(ds.permutation, np.arange(ds.nshards))
    assert list(tmp_path.iterdir()) == []


def test_epoch_bad_input():
    ctx = go.OptContext(mlp(), batch_size=20, ne_datapoint=6, loss_type=LT.CROSS_ENTROPY)
    ds = dataset()
    with pytest.raises(ValueError, match="idata_split"):
        go.epoch(ctx, ds, go.Result(), go.Result(), 30)
    with pytest.raises(ValueError, match="idata_split"):
        go.epoch(ctx, ds, go.Result(), go.Result(), 140)
    with pytest.raises(ValueError, match="multiple"):
        go.epoch(ctx, dataset(ndata=130), None, None)
    with pytest.raises(ValueError, match="labels"):
        go.epoch(ctx, go.Dataset(6, 0, 40), None, None)
    with pytest.raises(ValueError, match="ne_datapoint"):
        go.epoch(ctx, go.Dataset(5, 3, 40), None, None)
    with pytest.raises(TypeError):
        go.epoch(ctx, ds, [], None)
    assert ctx.iter == 1 and not ctx.eval_ready


def test_nan_in_training_names_the_batch():
    ds = dataset()
    ds.data[37] = np.nan  # batch 1 of 20 datapoints, unshuffled
    ctx = go.OptContext(mlp(), batch_size=20, ne_datapoint=6, loss_type=LT.CROSS_ENTROPY)
    with pytest.raises(FloatingPointError, match="train batch 1 "):
        go.epoch(ctx, ds, go.Result(), None)
    assert ctx.iter == 2  # batch 0 trained, batch 1 did not


def test_schedule_sees_epochs():
    epochs = []

    def pars(ep):
        epochs.append(ep)
        return go.default_optimizer_params()

    go.fit(mlp(), dataset(), LT.CROSS_ENTROPY, pars, nepoch=3, nbatch_logical=40,
           silent=True)
    assert epochs == [1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_history_without_validation_has_nan_validation_fields():
    h = go.fit(mlp(), dataset(), LT.CROSS_ENTROPY, nepoch=1, nbatch_logical=40, silent=True)
    e = h[0]
    assert np.isfinite(e.train_loss)
    assert np.isnan(e.val_loss) and np.isnan(e.val_loss_unc) and np.isnan(e.val_accuracy)


class FailsOnBatch:
    """mlp() whose forward raises on its nth call (construction makes call 1)."""

    def __init__(self, n):
        self.net, self.n, self.calls = mlp(), n, 0

    def parameters(self):
        return self.net.parameters()

    def forward(self, x):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("forward failed")
        return self.net.forward(x)

    def backward(self, g):
        self.net.backward(g)


@pytest.mark.parametrize("idata_split", [-1, 0])  # fails while training / validating
def test_epoch_failure_leaves_the_context_usable(idata_split):
    model = FailsOnBatch(3)
    ctx = go.OptContext(model, batch_size=20, ne_datapoint=6, loss_type=LT.CROSS_ENTROPY)
    with pytest.raises(RuntimeError, match="forward failed"):
        go.epoch(ctx, dataset(), go.Result(), go.Result(), idata_split)
    # the failed batch's alloc is undone: no eval pending, the context goes on
    assert not ctx.eval_ready
    assert ctx.iter == (2 if idata_split < 0 else 1) and ctx.opt_i == 0
    ctx.state_dict()
    go.epoch(ctx, dataset(), go.Result(), go.Result())
    assert ctx.iter == (8 if idata_split < 0 else 7)


@pytest.mark.parametrize("loss_type,exc", [(9, ValueError), ("meen", ValueError), (1.5, TypeError),
                                         (True, TypeError)])
def test_fit_bad_loss_type_names_it(loss_type, exc):
    with pytest.raises(exc, match="loss_type"):
        go.fit(mlp(), dataset(), loss_type, nbatch_logical=20, silent=True)


def test_fit_dataset_not_matching_the_model_leaves_the_model_alone():
    model = mlp()
    w, g = model[2].weight.data, model[2].weight.grad
    g[...] = 1.0
    x = np.ones((40, 6), np.float32)
    with pytest.raises(ValueError, match="labels"):  # 4 label columns, the model has 3 outputs
        go.fit(model, go.Dataset.from_arrays(x, np.ones((40, 4), np.float32)),
               LT.CROSS_ENTROPY, nbatch_logical=20, silent=True)
    assert model[2].weight.data is w and model[2].weight.grad is g
    assert (g == 1.0).all()
