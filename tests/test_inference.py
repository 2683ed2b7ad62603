"""evaluate and predict: any number of datapoints, any real dtype, the model unchanged."""
import numpy as np
import pytest

import ggmlopt as go

F32 = np.float32


def make_model(n_in=5, n_hidden=7, n_out=3):
    return go.nn.Sequential(go.nn.Linear(n_in, n_hidden, rng=0), go.nn.ReLU(),
                            go.nn.Linear(n_hidden, n_out, rng=1))


def reference_outputs(model, x):
    """float64 forward pass of make_model's Sequential."""
    lin1, _, lin2 = model.layers
    h = np.maximum(x.astype(np.float64) @ lin1.weight.data.astype(np.float64)
                   + lin1.bias.data, 0.0)
    return h @ lin2.weight.data.astype(np.float64) + lin2.bias.data


def data(n, n_in=5, n_out=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, n_in))
    y = np.eye(n_out, dtype=F32)[rng.integers(0, n_out, n)]
    return x, y


def cross_entropy64(out, y):
    z = out - out.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(np.mean(-(y * logp).sum(axis=1)))


@pytest.mark.parametrize("n,batch", [(1, 256), (37, 10), (40, 10), (9, 1), (5, 8)])
def test_evaluate_cross_entropy_matches_float64(n, batch):
    x, y = data(n)
    model = make_model()
    r = go.evaluate(model, (x, y), go.LossType.CROSS_ENTROPY, batch_size=batch)
    out64 = reference_outputs(model, x)
    assert r.ndata == n and r.nbatches == -(-n // batch)
    loss, _ = r.loss()
    assert loss == pytest.approx(cross_entropy64(out64, y), rel=1e-5, abs=1e-6)
    pred = out64.argmax(axis=1)
    np.testing.assert_array_equal(r.pred(), pred)
    acc, _ = r.accuracy()
    assert acc == pytest.approx(np.mean(pred == y.argmax(axis=1)))


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32, np.uint8, np.int64])
def test_evaluate_mse_any_real_dtype(dtype):
    rng = np.random.default_rng(3)
    x = (rng.integers(0, 4, size=(23, 5))).astype(dtype)
    y = rng.normal(size=(23, 3)).astype(np.float64)
    model = make_model()
    r = go.evaluate(model, (x, y), "MEAN_SQUARED_ERROR", batch_size=7)
    out64 = reference_outputs(model, x)
    assert r.loss()[0] == pytest.approx(np.mean((out64 - y) ** 2), rel=1e-5)


def test_evaluate_sum_and_mean_without_labels():
    x, _ = data(13)
    model = make_model()
    out64 = reference_outputs(model, x)
    r_sum = go.evaluate(model, x, "sum", batch_size=4)
    assert r_sum.loss()[0] == pytest.approx(out64.sum(), rel=1e-5)
    r_mean = go.evaluate(model, (x, None), go.LossType.MEAN, batch_size=4)
    assert r_mean.loss()[0] == pytest.approx(out64.mean(), rel=1e-5)
    assert np.isnan(r_mean.accuracy()[0])


def test_evaluate_dataset_scaled_uint8_in_storage_order():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, size=(30, 5), dtype=np.uint8)
    y = np.eye(3, dtype=F32)[rng.integers(0, 3, 30)]
    ds = go.Dataset.from_arrays(x, y, ndata_shard=2, data_scale=1 / 255)
    ds.shuffle(0)   # a shuffled dataset is still evaluated in storage order
    model = make_model()
    r = go.evaluate(model, ds, "Cross_Entropy", batch_size=8)
    xs = x.astype(F32) * F32(1 / 255)
    out64 = reference_outputs(model, xs)
    assert r.loss()[0] == pytest.approx(cross_entropy64(out64, y), rel=1e-5)
    np.testing.assert_array_equal(r.pred(), out64.argmax(axis=1))
    p = go.predict(model, ds, batch_size=7)
    np.testing.assert_allclose(p, out64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,batch", [(1, 256), (37, 10), (64, 16), (3, 2)])
def test_predict_matches_float64_and_is_a_new_array(n, batch):
    x, _ = data(n)
    model = make_model()
    p = go.predict(model, x, batch_size=batch)
    assert p.dtype == np.float32 and p.shape == (n, 3)
    np.testing.assert_allclose(p, reference_outputs(model, x), rtol=1e-5, atol=1e-5)
    q = go.predict(model, x[::-1].copy(), batch_size=batch)
    np.testing.assert_allclose(p, reference_outputs(model, x), rtol=1e-5, atol=1e-5)
    assert not np.shares_memory(p, q)
    for prm in model.parameters():
        assert not np.shares_memory(p, prm.data)


def test_parameters_unchanged_objects_and_values():
    x, y = data(20)
    model = make_model()
    params = model.parameters()
    before = [(p.data, p.grad, p.data.copy(), p.grad_is_zero) for p in params]
    model.layers[0].weight.grad_is_zero = False
    go.evaluate(model, (x, y), "cross_entropy", batch_size=6)
    go.predict(model, x, batch_size=6)
    for p, (data_obj, grad_obj, values, _) in zip(params, before):
        assert p.data is data_obj and p.grad is grad_obj
        np.testing.assert_array_equal(p.data, values)
    assert model.layers[0].weight.grad_is_zero is False


@pytest.mark.parametrize("opt_period", [1, 2])
def test_model_inside_another_context_keeps_training_bit_for_bit(opt_period):
    x, y = data(40)
    xb = x.astype(F32)

    def run(interrupt):
        model = make_model()
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=5,
                            loss_type=go.LossType.CROSS_ENTROPY, opt_period=opt_period)
        for i in range(4):
            ctx.alloc(True)
            ctx.eval(go.Result(), inputs=xb[10 * i:10 * i + 10], labels=y[10 * i:10 * i + 10])
            if interrupt:   # mid logical batch when opt_period is 2 and i is even
                views = [p.data for p in model.parameters()]
                values = [v.copy() for v in views]
                go.evaluate(model, (x, y), "cross_entropy", batch_size=7)
                go.predict(model, x, batch_size=9)
                for p, v, w in zip(model.parameters(), views, values):
                    assert p.data is v and np.shares_memory(p.data, ctx.arena.view("weights", 0, (ctx.arena.size,)))
                    np.testing.assert_array_equal(p.data, w)
        return [p.data.copy() for p in model.parameters()]

    for a, b in zip(run(False), run(True)):
        np.testing.assert_array_equal(a, b)


def test_training_flags_restored():
    model = make_model()
    model.train()
    go.predict(model, np.zeros((3, 5)))
    assert model.training is True and all(m.training for m in model.layers)
    model.eval()
    go.evaluate(model, np.zeros((3, 5)), "mean")
    assert model.training is False


class _NamesItsOwnChildren:
    """A model that is no Module and names its sub-module through its own
    named_children (the protocol ggmlopt.nn.module documents)."""

    def __init__(self):
        self._body = go.nn.Linear(4, 3, rng=0)

    def named_children(self):
        yield "body", self._body

    def parameters(self):
        return self._body.parameters()

    def forward(self, x):
        return self._body.forward(x)

    def backward(self, g):
        return self._body.backward(g)


@pytest.mark.parametrize("how", ["predict", "evaluate"])
def test_training_flags_restored_below_a_model_that_names_its_children(how):
    net = _NamesItsOwnChildren()
    go.nn.module.set_training(net, True)
    x = np.ones((2, 4), np.float32)
    if how == "predict":
        go.predict(net, x)
    else:
        go.evaluate(net, (x, None), "sum")
    assert net.training is True and net._body.training is True


def test_evaluate_bad_input():
    x, y = data(6)
    model = make_model()
    with pytest.raises(ValueError, match="loss_type: expected one of"):
        go.evaluate(model, (x, y), "cross-entropy")
    with pytest.raises(TypeError, match="loss_type"):
        go.evaluate(model, (x, y), 1.5)
    with pytest.raises(ValueError, match="y: None; CROSS_ENTROPY needs labels"):
        go.evaluate(model, x, "cross_entropy")
    with pytest.raises(ValueError, match="takes none"):
        go.evaluate(model, (x, y), "mean")
    with pytest.raises(ValueError, match="y: expected 6 rows"):
        go.evaluate(model, (x, y[:5]), "cross_entropy")
    with pytest.raises(ValueError, match="x: no datapoints"):
        go.evaluate(model, (x[:0], y[:0]), "cross_entropy")
    with pytest.raises(ValueError, match=r"x: expected shape \(n, ne_datapoint\)"):
        go.predict(model, x[0])
    with pytest.raises(TypeError, match="x: expected real numbers"):
        go.predict(model, np.array([["a"]]))
    with pytest.raises(ValueError, match="batch_size"):
        go.predict(model, x, batch_size=0)
    with pytest.raises(ValueError, match="expected shape"):
        go.predict(model, x[:, :4])
    # a failed call leaves the model as it was
    np.testing.assert_allclose(go.predict(model, x), reference_outputs(model, x), rtol=1e-5,
                               atol=1e-5)
    ds = go.Dataset.from_arrays(x.astype(F32))
    with pytest.raises(ValueError, match="data: the dataset has no labels"):
        go.evaluate(model, ds, "cross_entropy")


def test_non_finite_outputs_raise_naming_the_datapoints():
    model = make_model()
    x, y = data(10)
    x[7, 0] = np.inf
    with np.errstate(invalid="ignore"):   # inf * 0 in the matmul
        with pytest.raises(FloatingPointError, match="predict: .* datapoints 4:8 are not "
                                                     r"finite \(datapoint 7 holds inf in its "
                                                     r"inputs\)"):
            go.predict(model, x, batch_size=4)
        with pytest.raises(FloatingPointError, match="evaluate: the CROSS_ENTROPY loss of "
                                                     r"datapoints 4:8 is not finite \(datapoint "
                                                     r"7 holds inf in its inputs\)"):
            go.evaluate(model, (x, y), "cross_entropy", batch_size=4)
    x[7, 0] = 0.0   # the model was given back: it works on
    np.testing.assert_allclose(go.predict(model, x), reference_outputs(model, x), rtol=1e-5,
                               atol=1e-5)


def test_a_dropout_layer_keeps_its_generator():
    # evaluate's context hands the layers that draw its own generator; the model's
    # own comes back, so a training forward afterwards draws what it would have
    x = np.ones((2, 4), np.float32)

    def make():
        m = go.nn.Sequential(go.nn.Linear(4, 4, rng=1), go.nn.Dropout(0.5, rng=7),
                             go.nn.Linear(4, 2, rng=2))
        m.train(True)
        return m

    plain, used = make(), make()
    generator = used[1].rng
    go.evaluate(used, (x, np.array([0, 1])), "cross_entropy")
    go.predict(used, x)
    assert used[1].rng is generator
    np.testing.assert_array_equal(used(x), plain(x))


@pytest.mark.parametrize("batch", [2, 4, 5, 9])
def test_a_sum_s_uncertainty_reads_a_smaller_last_batch_as_a_full_one(batch):
    # every datapoint adds exactly 2: the total has no spread, whatever the batching
    model = go.nn.Sequential(go.nn.Linear(3, 2))
    model.parameters()[0].data[:] = 0
    model.parameters()[1].data[:] = 1
    x = np.random.default_rng(0).standard_normal((10, 3)).astype(np.float32)
    assert go.evaluate(model, x, go.LossType.SUM, batch_size=batch).loss() == (20.0, 0.0)
    # random outputs: ggml's sqrt(var * n / (n - 1)) over the batch sums, the last one
    # scaled to a full batch
    model = go.nn.Sequential(go.nn.Linear(3, 2, rng=1))
    x = np.random.default_rng(1).standard_normal((10, 3)).astype(np.float32)
    out = model(x).astype(np.float64).sum(axis=1)
    sums = np.array([out[i:i + batch].sum() for i in range(0, 10, batch)])
    sums[-1] *= batch / (10 - batch * (len(sums) - 1))
    want = np.sqrt(sums.var() * len(sums) / (len(sums) - 1))
    value, unc = go.evaluate(model, x, go.LossType.SUM, batch_size=batch).loss()
    np.testing.assert_allclose(value, out.sum(), rtol=1e-5)
    np.testing.assert_allclose(unc, want, rtol=1e-4, atol=1e-5 * np.abs(sums).max())


def test_a_list_of_x_and_y_is_refused_by_name():
    model = go.nn.Sequential(go.nn.Linear(4, 3))
    x, y = np.zeros((10, 4), np.float32), np.zeros(10, int)
    with pytest.raises(ValueError, match=r"^data: .*pass x and y as a tuple"):
        go.evaluate(model, [x, y], "cross_entropy")
