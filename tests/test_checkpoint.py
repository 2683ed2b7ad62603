"""OptContext.state_dict / load_state_dict / save / load: what a checkpoint holds, the
exact continuation it gives, and the clean refusal of everything that does not fit."""
import json
import math
import os
import re
import zipfile

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import checkpoint

NE_IN, NE_OUT = 5, 3


def make_model(seed=0, hidden=4):
    return go.nn.Sequential(go.nn.Linear(NE_IN, hidden, rng=seed), go.nn.ReLU(),
                            go.nn.Linear(hidden, NE_OUT, rng=seed + 100))


def batches(n, batch=3, seed=7):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(batch, NE_IN)).astype(np.float32)
        y = np.eye(NE_OUT, dtype=np.float32)[rng.integers(0, NE_OUT, batch)]
        out.append((x, y))
    return out


def make_ctx(model=None, optimizer=go.OptimizerType.ADAMW, opt_period=3, **kw):
    kw.setdefault("batch_size", 3)
    kw.setdefault("ne_datapoint", NE_IN)
    kw.setdefault("loss_type", go.LossType.CROSS_ENTROPY)
    kw.setdefault("seed", 4)
    return go.OptContext(make_model() if model is None else model, opt_period=opt_period,
                         optimizer=optimizer, **kw)


def train(ctx, data):
    for x, y in data:
        ctx.alloc(True)
        ctx.eval(None, inputs=x, labels=y)


def assert_same_state(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
        elif isinstance(a[k], float) and math.isnan(a[k]):
            assert math.isnan(b[k]), k
        else:
            assert a[k] == b[k], k


def snapshot(ctx):
    """Everything a failed load must leave alone."""
    return ctx.state_dict(), [p.data for p in ctx.parameters()], ctx.rng.bit_generator.state


def assert_unchanged(ctx, snap):
    sd, datas, rng_state = snap
    assert_same_state(ctx.state_dict(), sd)
    assert all(p.data is d for p, d in zip(ctx.parameters(), datas))
    assert ctx.rng.bit_generator.state == rng_state


# ---- what the state dict holds ------------------------------------------------------------

def test_state_dict_names_types_and_values():
    ctx = make_ctx()
    sd = ctx.state_dict()
    assert sd["format"] == checkpoint.FORMAT and sd["format_version"] == checkpoint.FORMAT_VERSION
    assert (sd["iter"], sd["opt_i"], sd["opt_period"], sd["nparams"]) == (1, 0, 3, 4)
    assert sd["loss_type"] == go.LossType.CROSS_ENTROPY and sd["optimizer"] == go.OptimizerType.ADAMW
    assert sd["batch_size"] == 3 and sd["ne_datapoint"] == NE_IN
    assert sd["grad_is_zero"].dtype == np.int8 and sd["grad_is_zero"].shape == (4,)
    assert math.isnan(sd["adamw.alpha"])  # no step taken yet
    shapes = [p.data.shape for p in ctx.parameters()]
    for prefix in ("param", "grad", "adamw_m", "adamw_v"):
        for i, shape in enumerate(shapes):
            assert sd[f"{prefix}.{i}"].shape == shape and sd[f"{prefix}.{i}"].dtype == np.float32
    for v in sd.values():
        assert isinstance(v, (int, float, str, np.ndarray)) and not isinstance(v, bool)
    # copies: changing the dict does not touch the context
    sd["param.0"][...] = 42
    assert not np.any(ctx.parameters()[0].data == 42)
    assert json.loads(sd["rng_state"])["bit_generator"] == "PCG64"


@pytest.mark.parametrize("optimizer", list(go.OptimizerType))
def test_optimizer_parameters_in_force(optimizer):
    sched = go.schedules.Linear(total=10, base=go.OptimizerParams(
        go.AdamWParams(alpha=0.1, beta1=0.8, wd=0.25), go.SGDParams(alpha=0.2, wd=0.5)),
        unit="step")
    ctx = make_ctx(optimizer=optimizer, opt_period=1, get_opt_pars=sched)
    train(ctx, batches(2))
    sd = ctx.state_dict()
    # the last step was step 2: factor 1 - 1/10
    if optimizer == go.OptimizerType.ADAMW:
        assert sd["adamw.alpha"] == float(np.float32(0.1 * 0.9))
        assert (sd["adamw.beta1"], sd["adamw.wd"]) == (float(np.float32(0.8)), 0.25)
        assert "sgd.alpha" not in sd
    else:
        assert (sd["sgd.alpha"], sd["sgd.wd"]) == (float(np.float32(0.2 * 0.9)), 0.5)
        assert "adamw.alpha" not in sd and "adamw_m.0" not in sd


@pytest.mark.parametrize("build_type,keys", [
    (go.BuildType.FORWARD, {"param", "grad"}),
    (go.BuildType.GRAD, {"param", "grad"}),
    (go.BuildType.OPT, {"param", "grad", "adamw_m", "adamw_v"}),
])
def test_sections_follow_the_build_type(build_type, keys):
    ctx = make_ctx(build_type=build_type, opt_period=1)
    sd = ctx.state_dict()
    assert {k.split(".")[0] for k in sd if k.endswith(".0")} == keys
    fresh = make_ctx(make_model(9), build_type=build_type, opt_period=1)
    fresh.load_state_dict(sd)
    assert_same_state(fresh.state_dict(), sd)


# ---- exact continuation ------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", list(go.OptimizerType))
def test_round_trip_mid_logical_batch_continues_bit_exactly(optimizer):
    data = batches(11)
    a = make_ctx(optimizer=optimizer, clip_grad_norm=0.5)
    train(a, data[:7])  # 2 steps and one physical batch of the third: opt_i = 1
    sd = a.state_dict()
    assert sd["opt_i"] == 1 and sd["iter"] == 3
    assert np.any(sd["grad.0"] != 0)

    b = make_ctx(make_model(seed=5), optimizer=optimizer, clip_grad_norm=0.5, seed=99)
    buffers = [p.data for p in b.parameters()]
    addr = b.arena.flat("weights").__array_interface__["data"][0]
    b.load_state_dict(sd)
    # the owned buffers are filled in place, nothing is reallocated
    assert all(p.data is d for p, d in zip(b.parameters(), buffers))
    assert b.arena.flat("weights").__array_interface__["data"][0] == addr
    assert_same_state(b.state_dict(), sd)
    assert b.rng.integers(0, 1 << 62) == a.rng.integers(0, 1 << 62)

    train(a, data[7:])
    train(b, data[7:])
    assert a.iter == b.iter == 4
    for p, q in zip(a.parameters(), b.parameters()):
        assert p.data.tobytes() == q.data.tobytes()
        assert a.grad_acc(p).tobytes() == b.grad_acc(q).tobytes()


def test_save_and_load_from_file(tmp_path):
    data = batches(5)
    a = make_ctx()
    train(a, data[:4])
    path = tmp_path / "ckpt.npz"
    a.save(path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.npz"]  # no temporary file left behind
    # plain NumPy reads it without pickle
    with np.load(path, allow_pickle=False) as f:
        assert all(not f[k].dtype.hasobject for k in f.files)
        assert set(f.files) == set(a.state_dict())
    sd = checkpoint.load_state(str(path))
    assert_same_state(sd, a.state_dict())
    assert isinstance(sd["iter"], int) and isinstance(sd["adamw.alpha"], float)
    assert isinstance(sd["rng_state"], str)

    model = make_model(seed=3)
    b = go.OptContext.load(path, model)
    assert b.model is model and b.static_graphs and b.batch_size == 3
    assert b.opt_period == 3 and b.loss_type == go.LossType.CROSS_ENTROPY
    assert_same_state(b.state_dict(), a.state_dict())
    train(a, data[4:])
    train(b, data[4:])
    for p, q in zip(a.parameters(), b.parameters()):
        assert p.data.tobytes() == q.data.tobytes()
    # saving again replaces the file
    a.save(path)
    assert checkpoint.load_state(path)["iter"] == a.iter


def test_dynamic_context_and_other_generators(tmp_path):
    a = go.OptContext(make_model(), loss_type=go.LossType.MEAN_SQUARED_ERROR,
                      optimizer=go.OptimizerType.SGD, seed=np.random.Generator(np.random.MT19937(3)))
    x, y = batches(1)[0]
    a.alloc(True)
    a.eval(None, inputs=x, labels=y)
    a.rng.random(5)
    a.save(tmp_path / "d.npz")
    b = go.OptContext.load(tmp_path / "d.npz", make_model(1))
    assert not b.static_graphs and isinstance(b.rng.bit_generator, np.random.MT19937)
    assert b.rng.random() == a.rng.random()
    assert_same_state(b.state_dict(), a.state_dict())
    # a PCG64 context refuses an MT19937 state
    c = go.OptContext(make_model(), loss_type=go.LossType.MEAN_SQUARED_ERROR,
                      optimizer=go.OptimizerType.SGD)
    snap = snapshot(c)
    with pytest.raises(ValueError, match="rng_state.*MT19937.*PCG64"):
        c.load_state_dict(a.state_dict())
    assert_unchanged(c, snap)


# ---- refusals: the state stays as it was ---------------------------------------------------

def _mutations():
    """(name, change the dict, exception, message)."""
    def drop(k):
        return lambda sd: sd.pop(k)

    def put(k, v):
        return lambda sd: sd.__setitem__(k, v)

    return [
        ("missing key", drop("adamw_v.3"), ValueError, r"missing \['adamw_v.3'\]"),
        ("extra key", put("param.4", np.zeros(2, np.float32)), ValueError, "unexpected.*param.4"),
        ("wrong shape", put("param.1", np.zeros(5, np.float32)), ValueError,
         r"param.1.*shape \(4,\).*\(5,\)"),
        ("wrong dtype", lambda sd: sd.__setitem__("adamw_m.2", sd["adamw_m.2"].astype(np.float64)),
         TypeError, "adamw_m.2.*float32.*float64"),
        ("list not array", lambda sd: sd.__setitem__("grad.0", sd["grad.0"].tolist()),
         TypeError, "grad.0.*ndarray"),
        ("format version", put("format_version", 2), ValueError, "format_version.*version 1, got 2"),
        ("format", put("format", "torch"), ValueError, "format.*torch"),
        ("no format", drop("format"), ValueError, "not a ggmlopt"),
        ("loss type", put("loss_type", int(go.LossType.MEAN)), ValueError,
         "loss_type.*MEAN.*CROSS_ENTROPY"),
        ("loss type unknown", put("loss_type", 17), ValueError, "loss_type.*17.*not a LossType"),
        ("optimizer", put("optimizer", int(go.OptimizerType.SGD)), ValueError, "optimizer.*SGD.*ADAMW"),
        ("opt_period", put("opt_period", 2), ValueError, "opt_period=2"),
        ("nparams", put("nparams", 3), ValueError, "nparams.*3"),
        ("iter type", put("iter", "3"), TypeError, "iter.*int.*str"),
        ("iter bool", put("iter", True), TypeError, "iter.*int"),
        ("iter range", put("iter", 0), ValueError, "iter.*>= 1"),
        ("opt_i range", put("opt_i", 3), ValueError, "opt_i.*opt_period=3"),
        ("build type last", put("build_type_last", 5), ValueError, "build_type_last"),
        ("alpha", put("adamw.alpha", -1.0), ValueError, "adamw.alpha"),
        ("alpha type", put("adamw.alpha", "x"), TypeError, "adamw.alpha.*float"),
        ("rng garbage", put("rng_state", "{not json"), ValueError, "rng_state"),
        ("rng wrong state", put("rng_state", json.dumps({"bit_generator": "PCG64", "state": 3})),
         ValueError, "rng_state.*PCG64"),
        ("rng type", put("rng_state", 5), TypeError, "rng_state.*str"),
        ("flags dtype", put("grad_is_zero", np.zeros(4, bool)), TypeError, "grad_is_zero.*int8"),
        ("flags values", put("grad_is_zero", np.full(4, 2, np.int8)), ValueError,
         "grad_is_zero.*0 and 1"),
        ("flags shape", put("grad_is_zero", np.zeros(3, np.int8)), ValueError, "grad_is_zero"),
    ]


@pytest.mark.parametrize("name,mutate,exc,match", _mutations(), ids=[m[0] for m in _mutations()])
def test_load_state_dict_refuses_and_changes_nothing(name, mutate, exc, match):
    src = make_ctx(make_model(seed=8))
    train(src, batches(4))
    sd = src.state_dict()
    mutate(sd)
    ctx = make_ctx()
    train(ctx, batches(2, seed=1))
    snap = snapshot(ctx)
    with pytest.raises(exc, match=match):
        ctx.load_state_dict(sd)
    assert_unchanged(ctx, snap)


def test_load_state_dict_bad_argument_and_call_order():
    ctx = make_ctx()
    with pytest.raises(TypeError, match="state_dict: expected a dict"):
        ctx.load_state_dict([("iter", 1)])
    sd = ctx.state_dict()
    x, y = batches(1)[0]
    ctx.alloc(True)
    with pytest.raises(RuntimeError, match="eval"):
        ctx.state_dict()
    with pytest.raises(RuntimeError, match="eval"):
        ctx.load_state_dict(sd)
    ctx.eval(None, inputs=x, labels=y)
    ctx.load_state_dict(sd)
    assert ctx.iter == 1


def test_load_into_a_model_of_another_shape_fails_cleanly(tmp_path):
    path = tmp_path / "c.npz"
    make_ctx().save(path)
    wide = make_model(hidden=6)
    saved = make_model().parameters()[0].shape
    shape_msg = re.escape(f"parameter 0.weight has shape {wide.parameters()[0].shape}, the "
                          f"checkpoint {str(path)!r} has shape {saved} for it (param.0)")
    for model, match in ((wide, shape_msg), (go.nn.Linear(NE_IN, NE_OUT), "2 parameters.*4")):
        params = model.parameters()
        before = [(p.data, p.data.copy()) for p in params]
        with pytest.raises(ValueError, match=match):
            go.OptContext.load(path, model)
        # the model was not touched: same arrays, same values
        for p, (d, v) in zip(params, before):
            assert p.data is d and np.array_equal(p.data, v)
    # and a context of another shape refuses the state dict
    other = make_ctx(make_model(hidden=6))
    snap = snapshot(other)
    with pytest.raises(ValueError, match="param.0"):
        other.load_state_dict(checkpoint.load_state(path))
    assert_unchanged(other, snap)


class _Named(go.nn.Module):
    """A user's module: its parameters are named after its attributes."""

    def __init__(self, hidden):
        self.encoder = go.nn.Linear(NE_IN, 4, rng=0)
        self.act = go.nn.ReLU()
        self.head = go.nn.Linear(4, hidden, rng=1)
        self.out = go.nn.Linear(hidden, NE_OUT, rng=2)
        self.layers = [self.encoder, self.act, self.head, self.out]

    def named_children(self):
        yield from (("encoder", self.encoder), ("head", self.head), ("out", self.out))

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, g):
        for layer in reversed(self.layers):
            g = layer.backward(g)
        return g


@pytest.mark.parametrize("how", ["load", "load_state_dict", "fit"])
def test_a_mismatch_names_the_parameter(tmp_path, how):
    """Which parameter does not fit, by its name (2.weight, head.bias), not param.2."""
    rng = np.random.default_rng(0)
    ds = go.Dataset.from_arrays(rng.normal(size=(12, NE_IN)).astype(np.float32),
                                rng.integers(0, NE_OUT, 12))
    for k, (make, name) in enumerate(((lambda h: make_model(hidden=h), "parameter 0.weight"),
                                      (_Named, "parameter head.weight"))):
        path = tmp_path / f"c{k}.npz"
        go.fit(make(6), ds, "cross_entropy", nepoch=1, nbatch_logical=3, silent=True,
               checkpoint=path)
        model = make(7)
        with pytest.raises(ValueError, match=re.escape(name) + r"( has shape|: )"):
            if how == "load":
                go.OptContext.load(path, model)
            elif how == "fit":
                go.fit(model, ds, "cross_entropy", nepoch=2, nbatch_logical=3, silent=True,
                       checkpoint=path, resume=True)
            else:
                ctx = go.OptContext(model, batch_size=3, ne_datapoint=NE_IN,
                                    loss_type="cross_entropy", class_labels=True)
                ctx.load_state_dict(checkpoint.split_fit_entries(
                    checkpoint.load_state(path))[0])


def test_a_mismatch_of_the_moments_names_the_parameter(tmp_path):
    ctx = make_ctx()
    sd = ctx.state_dict()
    sd["adamw_v.3"] = np.zeros(NE_OUT + 1, np.float32)
    with pytest.raises(ValueError, match=re.escape("the AdamW v of parameter 2.bias: ")):
        ctx.load_state_dict(sd)


# ---- files that are not checkpoints ----------------------------------------------------------

def test_files_that_are_not_checkpoints(tmp_path):
    good = tmp_path / "good.npz"
    ctx = make_ctx()
    train(ctx, batches(3))
    ctx.save(good)
    raw = good.read_bytes()
    model = make_model()

    with pytest.raises(FileNotFoundError):
        go.OptContext.load(tmp_path / "missing.npz", model)
    cases = {}
    cases["text.npz"] = b"hello, not a checkpoint\n"
    cases["empty.npz"] = b""
    cases["truncated.npz"] = raw[: len(raw) * 2 // 3]
    cases["truncated_tail.npz"] = raw[:-10]
    flipped = bytearray(raw)
    with zipfile.ZipFile(good) as zf:  # a byte inside parameter 0's data
        info = zf.getinfo("param.0.npy")
        flipped[info.header_offset + 200] ^= 0xFF
    cases["corrupted.npz"] = bytes(flipped)
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
    np.savez(tmp_path / "foreign.npz", weights=np.ones(3))
    np.savez(tmp_path / "pickled.npz", format=np.array([{"a": 1}], dtype=object),
             format_version=np.array(1))
    np.save(tmp_path / "array.npy", np.ones(3))
    future = dict(checkpoint.load_state(good))
    future["format_version"] = 99
    checkpoint.save_state(tmp_path / "future.npz", future)

    for name, match in [("text.npz", "not a ggmlopt checkpoint"),
                        ("empty.npz", "not a ggmlopt checkpoint"),
                        ("truncated.npz", "not a ggmlopt checkpoint"),
                        ("truncated_tail.npz", "not a ggmlopt checkpoint"),
                        ("corrupted.npz", "corrupted"),
                        ("foreign.npz", "not a ggmlopt checkpoint"),
                        ("pickled.npz", "not a readable ggmlopt checkpoint"),
                        ("array.npy", "not a ggmlopt checkpoint"),
                        ("future.npz", "format_version.*99")]:
        with pytest.raises(ValueError, match=match):
            go.OptContext.load(tmp_path / name, model)
        with pytest.raises(ValueError, match=match):
            checkpoint.load_state(tmp_path / name)
    assert isinstance(model.parameters()[0].data, np.ndarray)
    with pytest.raises(TypeError, match="path"):
        checkpoint.load_state(3.5)


def test_save_errors_leave_the_previous_file(tmp_path):
    path = tmp_path / "c.npz"
    ctx = make_ctx()
    ctx.save(path)
    before = path.read_bytes()
    with pytest.raises(TypeError, match="bad.*object"):
        checkpoint.save_state(path, {**ctx.state_dict(), "bad": np.array([None])})
    with pytest.raises(TypeError, match="bad.*number, str"):
        checkpoint.save_state(path, {**ctx.state_dict(), "bad": [1, 2]})
    with pytest.raises(ValueError, match="directory"):
        ctx.save(tmp_path)
    with pytest.raises(TypeError, match="path"):
        ctx.save(None)
    with pytest.raises(FileNotFoundError):
        ctx.save(tmp_path / "no" / "such" / "dir.npz")
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["c.npz"]


# ---- Dataset permutation accessor ---------------------------------------------------------

def test_dataset_set_permutation():
    ds = go.Dataset.from_arrays(np.arange(12, dtype=np.float32).reshape(6, 2), ndata_shard=2)
    ds.shuffle(3)
    perm = ds.permutation
    other = go.Dataset.from_arrays(np.arange(12, dtype=np.float32).reshape(6, 2), ndata_shard=2)
    other._set_permutation(perm)
    assert np.array_equal(other.permutation, perm)
    a, b = np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32)
    for i in range(3):
        ds.get_batch(a, None, i)
        other.get_batch(b, None, i)
        assert np.array_equal(a, b)
    before = other.permutation
    for bad, exc, match in [([0, 1, 2], TypeError, "ndarray"),
                            (np.array([0.0, 1, 2]), TypeError, "integer"),
                            (np.array([0, 1]), ValueError, r"shape \(3,\)"),
                            (np.array([0, 1, 1]), ValueError, "exactly once"),
                            (np.array([0, 1, 3]), ValueError, "exactly once"),
                            (np.array([-1, 0, 1]), ValueError, "exactly once")]:
        with pytest.raises(exc, match=match):
            other._set_permutation(bad)
        assert np.array_equal(other.permutation, before)


def test_fit_resume_from_another_models_checkpoint_leaves_the_model_alone(tmp_path):
    """The checkpoint is checked against the model before fit's context takes it."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(40, 6)).astype(np.float32)
    y = np.eye(2, dtype=np.float32)[rng.integers(0, 2, 40)]
    path = tmp_path / "run.npz"
    small = go.nn.Sequential(go.nn.Linear(6, 3, rng=1), go.nn.ReLU(), go.nn.Linear(3, 2, rng=2))
    go.fit(small, go.Dataset.from_arrays(x, y), go.LossType.CROSS_ENTROPY, nepoch=1,
           nbatch_logical=20, silent=True, checkpoint=path)
    other = go.nn.Sequential(go.nn.Linear(6, 4, rng=1), go.nn.ReLU(), go.nn.Linear(4, 2, rng=2))
    before = [(p, p.data, p.data.copy(), p.grad) for p in other.parameters()]
    ds = go.Dataset.from_arrays(x, y)
    perm = ds.permutation
    with pytest.raises(ValueError, match="do not match"):
        go.fit(other, ds, go.LossType.CROSS_ENTROPY, nepoch=2, nbatch_logical=20, silent=True,
               checkpoint=path, resume=True)
    for p, data, values, grad in before:
        assert p.data is data and p.grad is grad
        np.testing.assert_array_equal(p.data, values)
    np.testing.assert_array_equal(ds.permutation, perm)


@pytest.mark.parametrize("saved_with_adapters", [True, False])
def test_a_checkpoint_with_or_without_adapters_says_so(tmp_path, saved_with_adapters):
    """A LoRA run's checkpoint loaded into the base model (or the other way
    round): the counts differ, and the message says why and what to do."""
    import warnings

    from ggmlopt import lora
    from ggmlopt.models import Llama, LlamaConfig
    cfg = LlamaConfig(vocab_size=31, dim=16, n_layers=1, n_heads=2, max_seq_len=8)

    def model(adapted):
        m = Llama(cfg, seed=0)
        if adapted:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                lora.apply(m, rank=2)
        return m

    path = tmp_path / "c.npz"
    go.OptContext(model(saved_with_adapters), batch_size=1, ne_datapoint=8,
                  loss_type="cross_entropy", class_labels=True,
                  inputs_dtype=np.int32).save(path)
    said = "the state's trainable parameters are LoRA adapters and this model has none" \
        if saved_with_adapters else "this model holds LoRA adapters and the state none"
    with pytest.raises(ValueError, match=said):
        go.OptContext.load(path, model(not saved_with_adapters))
