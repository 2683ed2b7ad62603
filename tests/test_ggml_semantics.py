"""ggml's tests/test-opt.cpp, ported: a model out = x + w with one parameter w,
whose gradients, losses and weights are known in closed form."""
import math

import numpy as np
import pytest

import ggmlopt as go

NDATA = 6


class AddWeight:
    """out = x + w, one float parameter w (ggml's test model, outputs = scale(x + w, 1))."""

    def __init__(self, w0=NDATA / 2):
        self.w = go.nn.Parameter(np.array([w0], dtype=np.float32))

    def parameters(self):
        return [self.w]

    def forward(self, x):
        return x + self.w.data[0]

    def backward(self, grad_out):
        self.w.grad[0] += grad_out.sum(dtype=np.float32)


def opt_pars_for_tests(userdata=None):
    """helper_get_opt_pars_for_tests: alpha 1, betas 0, eps 0, so each AdamW step moves w
    by exactly -sign(grad)."""
    p = go.default_optimizer_params(userdata)
    p.adamw.alpha, p.adamw.beta1, p.adamw.beta2, p.adamw.eps, p.adamw.wd = 1.0, 0.0, 0.0, 0.0, 0.0
    p.sgd.alpha, p.sgd.wd = 1.0, 0.0
    return p


def make(nbatch_logical=1, nbatch_physical=1, loss_type=go.LossType.SUM, test_pars=True,
         optimizer=go.OptimizerType.ADAMW, seed=None):
    """helper_get_ctx_data: inputs are one row of nbatch_physical floats, as ggml's
    1-D inputs tensor (so a Result counts one datapoint per eval, like ggml)."""
    model = AddWeight()
    ctx = go.OptContext(model, batch_size=1, ne_datapoint=nbatch_physical, loss_type=loss_type,
                        opt_period=nbatch_logical // nbatch_physical, optimizer=optimizer,
                        get_opt_pars=opt_pars_for_tests if test_pars else go.default_optimizer_params,
                        seed=seed)
    return model, ctx


def unsupervised_dataset():
    ds = go.Dataset(1, 0, NDATA, 1)
    ds.data[:, 0] = np.arange(NDATA)
    return ds


def supervised_dataset(ndata_shard):
    ds = go.Dataset(2, 1, NDATA, ndata_shard)
    for i in range(NDATA):
        ds.data[i] = [16 * i, 16 * i + 1]
        ds.labels[i] = 16 * (16 * i)
    return ds


@pytest.mark.parametrize("shuffle", [False, True])
def test_dataset(shuffle):
    _, ctx = make()
    for ndata_shard in range(1, NDATA + 1):
        if NDATA % ndata_shard:
            continue  # ggml drops the tail shard silently; ggmlopt refuses such datasets
        ds = supervised_dataset(ndata_shard)
        if shuffle:
            ds.shuffle(ctx, -1)
        for ndata_batch in range(1, NDATA + 1):
            if ndata_batch % ndata_shard:
                continue
            data = np.empty(ndata_batch * 2, np.float32)
            labels = np.empty(ndata_batch, np.float32)
            found = []
            for ibatch in range(NDATA // ndata_batch):
                ds.get_batch(data, labels, ibatch)
                for j in range(ndata_batch):
                    idata = ibatch * ndata_batch + j
                    idata_found = int(data[2 * j] // 16)
                    assert shuffle or idata_found == idata
                    found.append(idata_found)
                    assert data[2 * j + 1] == 16 * idata_found + 1
                    assert labels[j] == 16 * (16 * idata_found)
            if not shuffle or NDATA % ndata_batch == 0:
                nmax = (NDATA // ndata_batch) * ndata_batch
                assert all(found.count(i) == 1 for i in range(nmax))


def test_grad():
    """opt_period 999999: every eval is GRAD, the accumulator counts up by 1."""
    model, ctx = make(nbatch_logical=999999)
    result = go.Result()
    history = []
    for idata in range(NDATA):
        ctx.alloc(True)
        ctx.inputs[0, 0] = idata
        ctx.eval(result)
        history.append(float(ctx.grad_acc(model.w)[0]))
    assert history == [1, 2, 3, 4, 5, 6]
    assert model.w.data[0] == NDATA / 2


@pytest.mark.parametrize("optimizer", list(go.OptimizerType))
@pytest.mark.parametrize("high_level,shuffle", [(False, False), (True, False), (True, True)])
def test_forward_backward(high_level, shuffle, optimizer):
    model, ctx = make(optimizer=optimizer)
    result = go.Result()
    assert result.ndata == 0
    loss, unc = result.loss()
    acc, acc_unc = result.accuracy()
    assert loss == 0.0 and math.isnan(unc) and math.isnan(acc) and math.isnan(acc_unc)

    ds = unsupervised_dataset()
    loss_history = []
    if high_level:
        if shuffle:
            ds.shuffle(ctx, -1)
        go.epoch(ctx, ds, None, result, 0)
    else:
        for idata in range(NDATA):
            ctx.alloc(False)
            ctx.inputs[0, 0] = idata
            ctx.eval(result)
            loss_history.append(float(ctx.loss))
    assert model.w.data[0] == NDATA / 2  # weights_after_forward
    assert result.ndata == 6
    loss, unc = result.loss()
    assert abs(loss - 33.0) < 1e-10 and abs(unc - math.sqrt(3.5)) < 1e-10
    acc, acc_unc = result.accuracy()
    assert math.isnan(acc) and math.isnan(acc_unc)
    if not high_level:
        assert loss_history == [3, 4, 5, 6, 7, 8]

    w0 = float(model.w.data[0])
    for _ in range(10):
        ctx.alloc(True)
        ctx.eval(result)
    model.w.data[0] = w0
    ctx.reset(False)
    result.reset()

    if high_level:
        if shuffle:
            ds.shuffle(ctx, -1)
        go.epoch(ctx, ds, result, None, NDATA)
    else:
        for idata in range(NDATA):
            ctx.alloc(True)
            ctx.inputs[0, 0] = idata
            ctx.eval(result)
    # AdamW with betas 0 and SGD with alpha 1 both move w by -1 per step (grad = 1)
    assert model.w.data[0] == -NDATA * 0.5  # weights_after_forward_backward
    assert result.ndata == 6
    loss, unc = result.loss()
    assert abs(loss - 18.0) < 1e-10 and (shuffle or unc == 0.0)
    acc, acc_unc = result.accuracy()
    assert math.isnan(acc) and math.isnan(acc_unc)


@pytest.mark.parametrize("optimizer", list(go.OptimizerType))
def test_epoch_vs_fit(optimizer):
    model, ctx = make(test_pars=False, optimizer=optimizer, seed=7)
    ds = unsupervised_dataset()
    ds.shuffle(ctx, -1)
    go.epoch(ctx, ds, go.Result(), None, NDATA)
    weights_epoch = model.w.data[0]

    model2 = AddWeight()
    go.fit(model2, unsupervised_dataset(), go.LossType.SUM, go.default_optimizer_params,
           nepoch=1, nbatch_logical=1, val_split=0.0, silent=True, optimizer=optimizer, seed=7)
    assert model2.w.data[0] == weights_epoch
    assert weights_epoch != NDATA / 2


@pytest.mark.parametrize("high_level", [False, True])
def test_idata_split(high_level):
    model, ctx = make()
    result, result2 = go.Result(), go.Result()
    idata_split = NDATA * 2 // 3
    ds = unsupervised_dataset()
    for ep in range(1, 5):
        if high_level:
            go.epoch(ctx, ds, result, result2, idata_split)
        else:
            for idata in range(NDATA):
                ctx.alloc(idata < idata_split)
                ctx.inputs[0, 0] = idata
                ctx.eval(result if idata < idata_split else result2)
        assert model.w.data[0] == NDATA / 2 - ep * idata_split
        assert result.ndata == idata_split
        loss, unc = result.loss()
        assert abs(loss - (28.0 - ep * 16.0)) < 1e-10 and abs(unc) < 1e-10
        assert all(math.isnan(a) for a in result.accuracy())
        assert result2.ndata == NDATA - idata_split
        loss, unc = result2.loss()
        assert abs(loss - (15.0 - ep * 8)) < 1e-10 and abs(unc - math.sqrt(0.5)) < 1e-10
        assert all(math.isnan(a) for a in result2.accuracy())
        result.reset()
        result2.reset()


@pytest.mark.parametrize("loss_type", [go.LossType.SUM, go.LossType.MEAN])
@pytest.mark.parametrize("nbatch_physical", [2, 1])
def test_gradient_accumulation(nbatch_physical, loss_type):
    model, ctx = make(nbatch_logical=6, nbatch_physical=nbatch_physical, loss_type=loss_type)
    result = go.Result()
    div = 1.0 if loss_type == go.LossType.SUM else NDATA
    for ep in range(1, 5):
        grad_history = [math.nan] * NDATA
        for idata in range(0, NDATA, nbatch_physical):
            ctx.alloc(True)
            ctx.inputs[0] = np.arange(idata, idata + nbatch_physical)
            ctx.eval(result)
            if nbatch_physical == 2:
                grad_history[idata] = 0.0
            grad_history[idata + nbatch_physical - 1] = float(ctx.grad_acc(model.w)[0])
        if nbatch_physical == 1:
            expected = [1, 2, 3, 4, 5, 6]
        else:
            expected = [0, 2, 0, 4, 0, 6]
        assert np.allclose(grad_history, np.array(expected) / div, atol=1e-6, rtol=0)
        assert abs(model.w.data[0] - (NDATA / 2 - ep)) < 1e-6
        assert result.ndata == NDATA // nbatch_physical
        loss, _ = result.loss()
        assert abs(loss - (39.0 - ep * 6.0) / div) < 1e-6
        assert all(math.isnan(a) for a in result.accuracy())
        result.reset()


class AffineModel:
    """f = a*x + b (ggml's test_regression)."""

    def __init__(self, a0=1.0, b0=3.0):
        self.a = go.nn.Parameter(np.array([a0], np.float32))
        self.b = go.nn.Parameter(np.array([b0], np.float32))

    def parameters(self):
        return [self.a, self.b]

    def forward(self, x):
        self.x = x
        return x * self.a.data[0] + self.b.data[0]

    def backward(self, g):
        self.a.grad[0] += np.float32((g * self.x).sum())
        self.b.grad[0] += g.sum(dtype=np.float32)


def test_regression():
    ndata = 201
    rng = np.random.default_rng(12345)
    x = np.float32(-100.0) + np.float32(200.0) * np.arange(ndata, dtype=np.float32) / (ndata - 1)
    y = np.float32(1.2) * x + np.float32(3.4) + rng.normal(0, 0.1, ndata).astype(np.float32)
    ds = go.Dataset.from_arrays(x[:, None], y[:, None], ndata_shard=ndata)
    model = AffineModel()

    def pars(epoch):
        p = go.default_optimizer_params()
        p.adamw.alpha = 0.1
        return p

    go.fit(model, ds, go.LossType.MEAN_SQUARED_ERROR, pars, nepoch=100, nbatch_logical=ndata,
           silent=True)
    assert abs(model.a.data[0] - 1.2) < 1e-2
    assert abs(model.b.data[0] - 3.4) < 1e-2
