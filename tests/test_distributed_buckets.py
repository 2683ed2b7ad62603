"""The gradient exchange in buckets overlapped with the backward pass
(ggmlopt.distributed, ggmlopt._buckets, the gradient-ready hook of ggmlopt.nn):
on a communicator of threads, bucketed runs against the single exchange after the
backward pass (bucket_cap_mb=None), bit for bit; the hook's order; the checks.
tests/mpi/ runs the same comparison under mpiexec."""
import math
import os
import sys
import threading

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt._buckets import GradientBuckets
from ggmlopt.distributed import RankFailed

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
from dist_problem import NBATCH_PHYSICAL, history_array, run
from thread_comm import ThreadComm, ThreadGroup, results, run_ranks

FLOAT_MB = 4 / 2**20  # one float32 in MiB: the smallest bucket
# one float, 3 floats, 40 floats (the 91-float first weight spans and ends buckets), 1 bucket
CAPS = [FLOAT_MB, 3 * FLOAT_MB, 40 * FLOAT_MB, 25.0]


def _same(a, b):
    """Two runs' (parameters, History) are the same bits."""
    assert np.array_equal(a[0], b[0]), "parameters differ"
    assert np.array_equal(history_array(a[1]), history_array(b[1]), equal_nan=True)


def _runs(nranks, **kwargs):
    return results(nranks, lambda c: run(c, **kwargs)[:2])


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("per_rank", [1, 2])  # physical batches per rank and logical batch
@pytest.mark.parametrize("nranks", [2, 3])
def test_buckets_equal_the_single_exchange(nranks, per_rank, shard, cap):
    kw = {"nbatch_logical": nranks * per_rank * NBATCH_PHYSICAL, "nepoch": 2,
          "shard_optimizer": shard, "ndata": 360 if nranks == 3 else 240, "val_split": 0.25}
    ref = _runs(nranks, bucket_cap_mb=None, **kw)
    got = _runs(nranks, bucket_cap_mb=cap, **kw)
    for r in range(nranks):
        _same(got[r], ref[r])
        _same(got[r], got[0])


@pytest.mark.parametrize("cap", [FLOAT_MB, 40 * FLOAT_MB])
@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("frozen", [("0.weight",), ("2.bias", "0.bias")])
def test_frozen_parameters_are_never_exchanged(frozen, shard, cap):
    kw = {"frozen": frozen, "shard_optimizer": shard, "nepoch": 2, "val_split": 0.25}
    ref = _runs(2, bucket_cap_mb=None, **kw)
    group = ThreadGroup(2)
    got = _results_in(group, lambda c: run(c, bucket_cap_mb=cap, **kw))
    for r in range(2):
        _same(got[r][:2], ref[r])
    # the buckets cover the trainable gradients only (138 floats minus the frozen ones)
    trainable = sum(p.data.size for p in got[0][2].parameters() if p.requires_grad)
    assert trainable < 138
    covered = 16 * 2 * -(-trainable // 32) if shard else trainable  # sharded: padded shards
    per_step = -(-covered // round(cap / FLOAT_MB))
    name = "Ireduce_scatter" if shard else "Iallreduce"
    n = sum(1 for rk, c in group.calls if rk == 0 and c == name)
    assert n > 0 and n % per_step == 0


def _results_in(group, fn):
    """fn(comm) on the ranks of group (threads); the results, or the first error."""
    out = [None] * group.size

    def rank(r):
        try:
            out[r] = (fn(ThreadComm(group, r)), None)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out[r] = (None, e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True)
               for r in range(group.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for res, e in out:
        if e is not None:
            raise e
    return [res for res, _ in out]


class _Probe(go.nn.Module):
    """A layer without parameters that logs when its backward runs."""

    def __init__(self, log, rank):
        self.log, self.rank = log, rank

    def forward(self, x):
        return x

    def backward(self, grad_out):
        self.log.append((self.rank, "probe backward"))
        return grad_out


def test_buckets_start_before_the_backward_pass_ends():
    group = ThreadGroup(2)

    def fn(comm):
        rng = np.random.default_rng(0)
        model = go.nn.Sequential(_Probe(group.log, comm.Get_rank()), go.nn.Linear(5, 4, rng=1),
                                 go.nn.ReLU(), go.nn.Linear(4, 3, rng=2))
        ctx = go.OptContext(model, loss_type="MEAN_SQUARED_ERROR", comm=comm, opt_period=2,
                            bucket_cap_mb=4 * FLOAT_MB)
        x = rng.standard_normal((6, 5)).astype(np.float32)
        ctx.alloc(True)
        ctx.eval(inputs=x, labels=np.zeros((6, 3), np.float32))
        return ctx

    _results_in(group, fn)
    mine = [event for r, event in group.log if r == 0]
    assert "probe backward" in mine
    assert "Iallreduce" in mine
    # the last layer's bucket started before the first layer's backward (the last) ran
    assert mine.index("Iallreduce") < mine.index("probe backward")
    # 20 + 4 + 12 + 3 = 39 floats in buckets of 4: 10 exchanges, one step
    assert mine.count("Iallreduce") == 10


class _NoHooks:
    """A user's container that announces nothing: its layers' gradients are
    exchanged after the backward pass."""

    def __init__(self, *layers):
        self.layers = list(layers)

    def parameters(self):
        return [p for layer in self.layers for p in layer.parameters()]

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, g):
        for layer in reversed(self.layers):
            g = layer.backward(g)
        return g


def _train_custom(comm, make_model, cap, steps=3):
    model = make_model()
    ctx = go.OptContext(model, loss_type="CROSS_ENTROPY", comm=comm, opt_period=2,
                        bucket_cap_mb=cap, clip_grad_norm=0.5)
    rng = np.random.default_rng(comm.Get_rank())
    for _ in range(steps):
        x = rng.standard_normal((5, 6)).astype(np.float32)
        y = rng.integers(0, 3, 5)
        ctx.alloc(True)
        ctx.eval(inputs=x, labels=y)
    return np.concatenate([p.data.ravel() for p in ctx.parameters()]), ctx


def _no_hooks():
    return _NoHooks(go.nn.Linear(6, 5, rng=1), go.nn.Tanh(), go.nn.Linear(5, 3, rng=2))


def _shared_layer():
    # one Linear at two places of the tree: final only after its second backward
    shared = go.nn.Linear(5, 5, rng=3)
    return go.nn.Sequential(go.nn.Linear(6, 5, rng=1), go.nn.Tanh(), shared, go.nn.Tanh(),
                            shared, go.nn.Tanh(), go.nn.Linear(5, 3, rng=2))


def _nested_residual():
    block = go.nn.Sequential(go.nn.Linear(5, 7, rng=4), go.nn.ReLU(), go.nn.Linear(7, 5, rng=5))
    return go.nn.Sequential(go.nn.Linear(6, 5, rng=1), go.nn.Residual(block), go.nn.Tanh(),
                            go.nn.Linear(5, 3, rng=2))


@pytest.mark.parametrize("make_model", [_no_hooks, _shared_layer, _nested_residual])
@pytest.mark.parametrize("cap", [FLOAT_MB, 7 * FLOAT_MB])
def test_models_the_hook_does_not_reach_fully_stay_exact(make_model, cap):
    ref = results(2, lambda c: _train_custom(c, make_model, None)[0])
    got = results(2, lambda c: _train_custom(c, make_model, cap)[0])
    for r in range(2):
        assert np.array_equal(got[r], ref[r])


def test_the_exposed_exchange_is_recorded_per_step():
    outs = results(2, lambda c: _train_custom(c, _nested_residual, 7 * FLOAT_MB, steps=4)[1])
    for ctx in outs:
        waits = list(ctx._dist.exchange_wait_times)
        assert len(waits) == 4  # opt_period 2 over 2 ranks: every eval steps
        assert all(w >= 0 and math.isfinite(w) for w in waits)


class _FailingOn:
    """A layer whose backward raises on one rank."""

    def __init__(self, rank):
        self.rank = rank

    def parameters(self):
        return []

    def forward(self, x):
        return x

    def backward(self, g):
        if self.rank == 1:
            raise ValueError("a bad gradient on rank 1")
        return g


def test_a_rank_failing_in_its_backward_pass_stops_every_rank():
    def fn(comm):
        model = go.nn.Sequential(go.nn.Linear(6, 5, rng=1), _FailingOn(comm.Get_rank()),
                                 go.nn.Linear(5, 3, rng=2))
        ctx = go.OptContext(model, loss_type="CROSS_ENTROPY", comm=comm, opt_period=2,
                            bucket_cap_mb=FLOAT_MB)
        x = np.ones((4, 6), np.float32)
        ctx.alloc(True)
        try:
            ctx.eval(inputs=x, labels=np.zeros(4, np.int64))
        except BaseException as e:
            ctx._dist.report(e, "training")  # what fit and epoch do
            raise

    out = run_ranks(2, fn)
    assert isinstance(out[1][1], ValueError)
    assert isinstance(out[0][1], RankFailed)
    assert "rank 1 of 2 failed (ValueError" in str(out[0][1])


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf])
def test_a_bad_bucket_size_is_a_value_error(bad):
    model = go.nn.Sequential(go.nn.Linear(3, 2, rng=1))
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        go.OptContext(model, bucket_cap_mb=bad)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        go.OptContext(model, comm=ThreadComm(ThreadGroup(1), 0), bucket_cap_mb=bad)
    assert model[0].weight.grad is None or not model[0].weight.grad.any()


@pytest.mark.parametrize("bad", ["25", True, [1]])
def test_a_bucket_size_of_another_type_is_a_type_error(bad):
    model = go.nn.Sequential(go.nn.Linear(3, 2, rng=1))
    with pytest.raises(TypeError, match="bucket_cap_mb"):
        go.OptContext(model, bucket_cap_mb=bad)


def test_fit_passes_the_bucket_size_on():
    for _, e in run_ranks(2, lambda c: run(c, bucket_cap_mb=0, val_split=0.25)):
        assert isinstance(e, ValueError) and "bucket_cap_mb" in str(e)


def test_buckets_are_cut_from_the_end():
    params = [go.nn.Parameter(np.zeros(n, np.float32)) for n in (5, 3, 4)]

    class Holder:
        def __init__(self):
            self.a, self.b, self.c = params

        def forward(self, x):
            return x

    b = GradientBuckets(Holder(), params, 12, 5)
    assert b.bounds == [(7, 12), (2, 7), (0, 2)]
    # the last parameter (elements 8..11) is inside bucket 0, which the middle one
    # (5..7) also touches
    assert list(b.announce([2])) == []
    assert list(b.announce([1])) == [0]
    assert list(b.announce([0])) == [1, 2]
    b.reset()
    assert list(b.announce([0])) == []  # bucket 0 waits: its start order holds
    assert list(b.rest()) == [0, 1, 2]


def test_history_records_the_exposed_exchange_per_epoch():
    outs = _runs(2, nepoch=2, val_split=0.25, bucket_cap_mb=40 * FLOAT_MB)
    for _, hist in outs:
        assert len(hist.exchange_wait_s) == 2
        assert all(math.isfinite(w) and w > 0 for w in hist.exchange_wait_s)
    _, hist = run(None, nepoch=1, val_split=0.25)[:2]
    assert hist.exchange_wait_s == [0.0]  # one process exchanges nothing


@pytest.mark.parametrize("ncols", [10, 11])
def test_checkpoints_without_the_column_still_resume(tmp_path, ncols):
    ckpt = str(tmp_path / "run.npz")
    run(None, nepoch=2, val_split=0.25, checkpoint=ckpt)
    sd = go.checkpoint.load_state(ckpt)
    assert sd["fit.history"].shape == (2, 12)
    sd["fit.history"] = sd["fit.history"][:, :ncols]  # as an older version wrote it
    go.checkpoint.save_state(ckpt, sd)
    _, hist, _ = run(None, nepoch=3, val_split=0.25, checkpoint=ckpt, resume=True)
    assert [e.epoch for e in hist] == [1, 2, 3]
    assert math.isnan(hist[0].exchange_wait_s) and hist[2].exchange_wait_s == 0.0
    straight = run(None, nepoch=3, val_split=0.25)[1]
    assert hist.train_loss == straight.train_loss


def _train_lm(comm, make, cap, steps=2):
    model = make()
    ctx = go.OptContext(model, loss_type="CROSS_ENTROPY", comm=comm, opt_period=2,
                        bucket_cap_mb=cap)
    rng = np.random.default_rng(10 + comm.Get_rank())
    for _ in range(steps):
        tokens = rng.integers(0, 37, (2, 9)).astype(np.int32)
        ctx.alloc(True)
        ctx.eval(inputs=tokens[:, :-1], labels=tokens[:, 1:])
    return np.concatenate([p.data.ravel() for p in ctx.parameters()])


def _llama():
    from ggmlopt.models import Llama, LlamaConfig
    return Llama(LlamaConfig(vocab_size=37, dim=16, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_dim=24, max_seq_len=16), seed=3)


def _gpt2_tied():
    from ggmlopt.models import GPT2, GPT2Config
    return GPT2(GPT2Config(vocab_size=37, dim=16, n_layers=2, n_heads=2, max_seq_len=16),
                seed=4)


@pytest.mark.parametrize("make", [_llama, _gpt2_tied])
@pytest.mark.parametrize("cap", [FLOAT_MB, 50 * FLOAT_MB, 1000 * FLOAT_MB])
def test_language_models_equal_the_single_exchange(make, cap):
    ref = results(2, lambda c: _train_lm(c, make, None))
    got = results(2, lambda c: _train_lm(c, make, cap))
    for r in range(2):
        assert np.array_equal(got[r], ref[r])
    assert np.array_equal(got[0], got[1])


def test_optcontext_load_takes_the_bucket_size(tmp_path):
    path = str(tmp_path / "ctx.npz")
    model = go.nn.Sequential(go.nn.Linear(3, 2, rng=1))
    go.OptContext(model, batch_size=2, ne_datapoint=3, opt_period=2).save(path)

    def load(comm, cap):
        ctx = go.OptContext.load(path, go.nn.Sequential(go.nn.Linear(3, 2, rng=2)), comm=comm,
                                 bucket_cap_mb=cap)
        return ctx._dist.bucket_cap_mb

    assert results(2, lambda c: load(c, None)) == [None, None]
    assert results(2, lambda c: load(c, 0.5)) == [0.5, 0.5]
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        go.OptContext.load(path, go.nn.Sequential(go.nn.Linear(3, 2, rng=2)), bucket_cap_mb=0)
