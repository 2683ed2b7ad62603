"""Labels given as class indices, through the engine: Dataset.from_arrays stores
integer labels as int32 (ne_label 1), OptContext and fit take the class-index
loss path with the results of the one-hot path; other real dtypes are converted
once; Datasets pickle."""
import pickle

import numpy as np
import pytest

import ggmlopt as go

LT = go.LossType
F32 = np.float32


def mlp(nout=3, seed=0):
    return go.nn.Sequential(go.nn.Linear(6, 8, rng=seed), go.nn.ReLU(),
                            go.nn.Linear(8, nout, rng=seed + 1))


def problem(ndata=120, nclasses=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ndata, 6))  # float64: converted once by from_arrays
    cls = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)
    cls[cls >= nclasses] = nclasses - 1
    return x, cls, np.eye(nclasses, dtype=F32)[cls]


def params(model):
    return [p.data.copy() for p in model.parameters()]


# ---- Dataset.from_arrays -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.int16, np.uint64])
@pytest.mark.parametrize("shape", ["n", "n1"])
def test_integer_labels_are_stored_as_int32_class_indices(dtype, shape):
    x, cls, _ = problem(12)
    lab = cls.astype(dtype)
    ds = go.Dataset.from_arrays(x, lab if shape == "n" else lab.reshape(-1, 1))
    assert ds.ne_label == 1 and ds.label_dtype == np.int32 and ds.class_labels
    assert ds.labels.shape == (12, 1)
    np.testing.assert_array_equal(ds.labels[:, 0], cls)
    assert ds.labels.nbytes == 12 * 4  # one int32 a datapoint


def test_one_hot_labels_are_not_class_indices():
    x, _, onehot = problem(12)
    ds = go.Dataset.from_arrays(x, onehot.astype(np.float64))
    assert ds.label_dtype == np.float32 and not ds.class_labels and ds.ne_label == 3
    ds = go.Dataset.from_arrays(x, onehot.astype(np.int32))  # integer one-hot: int32 (n, 3)
    assert ds.label_dtype == np.int32 and not ds.class_labels
    assert not go.Dataset(3, 0, 4).class_labels


@pytest.mark.parametrize("dtype,stored", [
    (np.float64, np.float32), (np.int64, np.float32), (np.bool_, np.float32),
    (np.int8, np.float32), (np.uint16, np.float32), (">f8", np.float32),
    (np.float32, np.float32), (np.float16, np.float16), (np.uint8, np.uint8),
    (np.int32, np.int32),
])
def test_every_real_data_dtype_is_accepted(dtype, stored):
    data = (np.arange(24).reshape(4, 6) % 3).astype(dtype)
    ds = go.Dataset.from_arrays(data, np.arange(4) % 2)
    assert ds.data_dtype == stored
    np.testing.assert_array_equal(ds.data, data.astype(np.float64))


def test_float_targets_of_any_real_dtype_become_float32():
    x, _, _ = problem(5)
    y = np.linspace(-1, 1, 10).reshape(5, 2)
    for dtype in (np.float64, np.float16, np.bool_):
        ds = go.Dataset.from_arrays(x, y.astype(dtype))
        assert ds.label_dtype == np.float32
        np.testing.assert_array_equal(ds.labels, y.astype(dtype).astype(F32))
    ds = go.Dataset.from_arrays(x, np.linspace(0, 1, 5))  # 1-D float: one target each
    assert ds.labels.shape == (5, 1) and ds.label_dtype == np.float32


# ---- pickling ----------------------------------------------------------------------------

@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
@pytest.mark.parametrize("kind", ["classes", "u8-scaled", "f16-no-labels", "float"])
def test_dataset_pickles_round_trip(protocol, kind):
    rng = np.random.default_rng(3)
    if kind == "classes":
        ds = go.Dataset.from_arrays(rng.standard_normal((12, 5)), rng.integers(0, 7, 12),
                                    ndata_shard=3)
    elif kind == "u8-scaled":
        ds = go.Dataset.from_arrays(rng.integers(0, 256, (12, 2, 2), dtype=np.uint8),
                                    np.eye(4, dtype=F32)[rng.integers(0, 4, 12)],
                                    ndata_shard=2, data_scale=1 / 255)
    elif kind == "f16-no-labels":
        ds = go.Dataset.from_arrays(rng.standard_normal((12, 3)).astype(np.float16),
                                    data_scale=-2.0)
    else:
        ds = go.Dataset.from_arrays(rng.standard_normal((12, 3)).astype(F32),
                                    rng.standard_normal((12, 2)).astype(F32), ndata_shard=4)
    ds.shuffle(5)
    back = pickle.loads(pickle.dumps(ds, protocol=protocol))
    assert type(back) is go.Dataset and repr(back) == repr(ds)
    for name in ("ndata", "ndata_shard", "nshards", "ne_datapoint", "ne_label", "data_dtype",
                 "label_dtype", "data_scale", "class_labels"):
        assert getattr(back, name) == getattr(ds, name), name
    np.testing.assert_array_equal(back.data, ds.data)
    np.testing.assert_array_equal(back.permutation, ds.permutation)
    if ds.labels is None:
        assert back.labels is None
    else:
        np.testing.assert_array_equal(back.labels, ds.labels)
    # batches agree, and the copy has its own memory
    k = ds.ndata_shard
    out1 = np.empty((k, ds.ne_datapoint), F32)
    out2 = np.empty_like(out1)
    lab1 = None if ds.labels is None else np.empty((k, ds.ne_label), ds.label_dtype)
    lab2 = None if lab1 is None else np.empty_like(lab1)
    ds.get_batch(out1, lab1, ds.nshards - 1)
    back.get_batch(out2, lab2, ds.nshards - 1)
    np.testing.assert_array_equal(out1, out2)
    if lab1 is not None:
        np.testing.assert_array_equal(lab1, lab2)
    back.data[0] = 1
    assert not np.shares_memory(back.data, ds.data)


# ---- OptContext --------------------------------------------------------------------------

def _contexts(class_labels_kind, batch=8, opt_period=1):
    kw = {"loss_type": LT.CROSS_ENTROPY, "opt_period": opt_period}
    if class_labels_kind == "static":
        return (go.OptContext(mlp(), batch, 6, class_labels=True, **kw),
                go.OptContext(mlp(), batch, 6, **kw))
    return go.OptContext(mlp(), **kw), go.OptContext(mlp(), **kw)


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_context_class_path_equals_one_hot_path(simd_path, mode):
    a, b = _contexts(mode)
    x, cls, onehot = problem(8 * 6)
    x = x.astype(F32)
    ra, rb = go.Result(), go.Result()
    for i in range(6):
        sl = slice(8 * i, 8 * i + 8)
        labels = cls[sl].reshape(-1, 1) if i % 2 else cls[sl]
        for ctx, lab, r in ((a, labels, ra), (b, onehot[sl], rb)):
            ctx.alloc(True)
            ctx.eval(r, inputs=x[sl], labels=lab)
        assert a.loss == pytest.approx(b.loss, rel=1e-6)
        np.testing.assert_array_equal(a.pred, b.pred)
        assert a.ncorrect == b.ncorrect
        for pa, pb in zip(a.parameters(), b.parameters()):
            np.testing.assert_allclose(pa.grad, pb.grad, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(pa.data, pb.data, rtol=1e-5, atol=1e-6)
    assert ra.loss()[0] == pytest.approx(rb.loss()[0], rel=1e-6)
    assert ra.accuracy() == rb.accuracy()
    if mode == "static":
        assert a.labels.dtype == np.int32 and a.labels.shape == (8,) and a.class_labels
        assert b.labels.dtype == F32 and not b.class_labels


def test_context_class_labels_argument_checks():
    with pytest.raises(ValueError, match="class_labels:.*MEAN_SQUARED_ERROR needs float "
                                         "targets.*one-hot"):
        go.OptContext(mlp(), 4, 6, loss_type=LT.MEAN_SQUARED_ERROR, class_labels=True)
    with pytest.raises(ValueError, match="class_labels:.*SUM needs no labels"):
        go.OptContext(mlp(), 4, 6, loss_type=LT.SUM, class_labels=True)
    with pytest.raises(TypeError, match="class_labels: expected a bool"):
        go.OptContext(mlp(), 4, 6, loss_type=LT.CROSS_ENTROPY, class_labels=1)


def test_static_class_context_refuses_float_labels_and_bad_classes():
    ctx = go.OptContext(mlp(), 4, 6, loss_type=LT.CROSS_ENTROPY, class_labels=True)
    x = np.zeros((4, 6), F32)
    ctx.alloc(True)
    with pytest.raises(TypeError, match="labels: this context takes class indices"):
        ctx.eval(inputs=x, labels=np.eye(3, dtype=F32)[[0, 1, 2, 0]])
    ctx._undo_alloc(go.BuildType.OPT)
    before = params(ctx.model)
    ctx.alloc(True)
    with pytest.raises(IndexError, match="labels: class 3 at row 1"):
        ctx.eval(inputs=x, labels=np.array([0, 3, 1, 2]))
    for p, q in zip(params(ctx.model), before):
        np.testing.assert_array_equal(p, q)


def test_dynamic_mse_refuses_class_indices():
    ctx = go.OptContext(mlp(), loss_type=LT.MEAN_SQUARED_ERROR)
    ctx.alloc(True)
    with pytest.raises(ValueError, match="labels: integers of shape \\(4,\\) look like class "
                                         "indices.*MEAN_SQUARED_ERROR needs float targets"):
        ctx.eval(inputs=np.zeros((4, 6), F32), labels=np.array([0, 1, 2, 0]))


def test_checkpoint_round_trips_a_class_label_context(tmp_path):
    ctx = go.OptContext(mlp(), 4, 6, loss_type=LT.CROSS_ENTROPY, class_labels=True)
    x, cls, _ = problem(4)
    ctx.alloc(True)
    ctx.eval(inputs=x, labels=cls)
    path = tmp_path / "c.npz"
    ctx.save(path)
    back = go.OptContext.load(path, mlp(seed=5))
    assert back.class_labels and back.labels.dtype == np.int32 and back.labels.shape == (4,)
    for p, q in zip(back.parameters(), ctx.parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    # a state without the entry (older files) is a one-hot context's
    sd = ctx.state_dict()
    assert sd["class_labels"] == 1
    del sd["class_labels"]
    other = go.OptContext(mlp(), 4, 6, loss_type=LT.CROSS_ENTROPY)
    other.load_state_dict(sd)
    sd["class_labels"] = 2
    with pytest.raises(ValueError, match="class_labels.*0 or 1"):
        other.load_state_dict(sd)


# ---- fit ---------------------------------------------------------------------------------

def _fit(labels, x, **kw):
    model = mlp()
    ds = go.Dataset.from_arrays(x, labels, ndata_shard=2)
    hist = go.fit(model, ds, LT.CROSS_ENTROPY, nepoch=3, nbatch_logical=20, nbatch_physical=10,
                  val_split=0.25, silent=True, seed=4, **kw)
    return hist, params(model)


def test_fit_with_class_indices_equals_fit_with_one_hot(simd_path):
    x, cls, onehot = problem()
    h_hot, p_hot = _fit(onehot, x)
    for labels in (cls, cls.reshape(-1, 1), cls.astype(np.int32)):
        h, p = _fit(labels, x)
        np.testing.assert_allclose(h.train_loss, h_hot.train_loss, rtol=1e-6)
        np.testing.assert_allclose(h.val_loss, h_hot.val_loss, rtol=1e-6)
        assert h.train_accuracy == h_hot.train_accuracy
        assert h.val_accuracy == h_hot.val_accuracy
        for a, b in zip(p, p_hot):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert h.train_loss[-1] < h.train_loss[0]  # it trains


def test_fit_resumes_with_class_indices(tmp_path):
    x, cls, _ = problem()
    _, straight = _fit(cls, x)
    path = tmp_path / "fit.npz"
    model = mlp()
    ds = go.Dataset.from_arrays(x, cls, ndata_shard=2)
    args = {"nbatch_logical": 20, "nbatch_physical": 10, "val_split": 0.25, "silent": True, "seed": 4,
                "checkpoint": path}
    go.fit(model, ds, LT.CROSS_ENTROPY, nepoch=2, **args)
    go.fit(model, ds, LT.CROSS_ENTROPY, nepoch=3, resume=True, **args)
    for a, b in zip(params(model), straight):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("labels,loss,pattern", [
    (np.array([0, 1, 2, 3] * 30), LT.CROSS_ENTROPY,
     r"dataset: class indices from 0 to 3 do not fit the model's 3 outputs"),
    (np.arange(120) % 3, LT.MEAN_SQUARED_ERROR,
     (r"class indices, which only CROSS_ENTROPY takes; MEAN_SQUARED_ERROR needs float "
     r"targets.*one-hot encode")),
    (np.eye(3, dtype=np.int32)[np.arange(120) % 3], LT.CROSS_ENTROPY,
     (r"labels of int32 \(3 per datapoint\) cannot be trained on; pass class indices "
     r"\(integers of shape \(ndata,\)\) or float one-hot labels \(ndata, 3\)")),
    (np.ones((120, 1), F32), LT.CROSS_ENTROPY,
     (r"labels of 1 elements do not match the model's 3 outputs; for class indices pass "
     r"integers of shape \(ndata,\)")),
])
def test_fit_says_what_to_pass(labels, loss, pattern):
    x, _, _ = problem()
    ds = go.Dataset.from_arrays(x, labels, ndata_shard=2)
    model = mlp()
    before = params(model)
    with pytest.raises(ValueError, match=pattern):
        go.fit(model, ds, loss, nepoch=1, nbatch_logical=20, silent=True)
    for a, b in zip(params(model), before):
        np.testing.assert_array_equal(a, b)


def test_epoch_checks_the_context_label_form():
    x, cls, onehot = problem()
    hot_ctx = go.OptContext(mlp(), 10, 6, loss_type=LT.CROSS_ENTROPY)
    with pytest.raises(ValueError, match="build it with class_labels=True"):
        go.epoch(hot_ctx, go.Dataset.from_arrays(x, cls))
    cls_ctx = go.OptContext(mlp(), 10, 6, loss_type=LT.CROSS_ENTROPY, class_labels=True)
    with pytest.raises(ValueError, match="built for class indices"):
        go.epoch(cls_ctx, go.Dataset.from_arrays(x, onehot))
    r = go.Result()
    go.epoch(cls_ctx, go.Dataset.from_arrays(x, cls), None, r, 0)
    assert r.ndata == 120
