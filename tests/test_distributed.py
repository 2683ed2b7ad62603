"""Data-parallel training (ggmlopt.distributed) on a communicator of threads: P = 1,
2, 3 ranks against one process, sharded optimizer state, resume across rank
counts, failures on one rank, the API's checks.  tests/mpi/ runs the same under
mpiexec."""
import gc
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import distributed

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
from dist_problem import NBATCH_PHYSICAL, history_array, make_problem, run
from thread_comm import ThreadComm, ThreadGroup, results, run_ranks

RTOL, ATOL = 1e-5, 1e-6


def _assert_ranks_identical(outs):
    for r, out in enumerate(outs[1:], 1):
        assert np.array_equal(out[0], outs[0][0]), f"rank {r}'s parameters differ from rank 0's"


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("optimizer", ["ADAMW", "SGD"])
@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_equals_one_process(nranks, optimizer, shard):
    # accumulation (6 physical batches per step), a validation split and clipping
    ref, ref_hist, _ = run(None, optimizer)
    outs = results(nranks, lambda c: run(c, optimizer, shard_optimizer=shard))
    _assert_ranks_identical(outs)
    np.testing.assert_allclose(outs[0][0], ref, rtol=RTOL, atol=ATOL)
    for _, hist, _ in outs:
        np.testing.assert_allclose(history_array(hist), history_array(ref_hist), rtol=RTOL, atol=1e-7)
    if nranks == 1:  # nothing is summed: the very same bits
        assert np.array_equal(outs[0][0], ref)


def test_clipping_is_active_and_global():
    # the problem's clip changes the result, so the equivalence above covers it
    clipped, _, _ = run(None, "ADAMW")
    free, _, _ = run(None, "ADAMW", clip=None)
    assert np.abs(clipped - free).max() > 100 * ATOL
    outs = results(2, lambda c: run(c, "ADAMW", clip=None))
    np.testing.assert_allclose(outs[0][0], free, rtol=RTOL, atol=ATOL)


def test_every_rank_starts_from_rank0_parameters():
    # each rank initialises its model differently: rank 0's values are broadcast
    def on_rank(comm):
        model, ds = make_problem(0)
        if comm.Get_rank() != 0:
            for p in model.parameters():
                p.data[...] = comm.Get_rank()
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=ds.data.shape[1],
                            loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm)
        return np.concatenate([p.data.ravel() for p in ctx.parameters()])

    outs = results(3, on_rank)
    expect = np.concatenate([p.data.ravel() for p in make_problem(0)[0].parameters()])
    for out in outs:
        assert np.array_equal(out, expect)


def test_uneven_logical_batch_is_a_clear_error_on_every_rank():
    # 6 physical batches per logical batch do not split over 4 ranks
    out = run_ranks(4, lambda c: run(c, "ADAMW"))
    for _, e in out:
        assert isinstance(e, ValueError)
        assert "nbatch_logical must be a multiple of 4 x nbatch_physical = 40" in str(e)


def test_optcontext_opt_period_must_split_over_ranks():
    def on_rank(comm):
        model, _ = make_problem(0)
        go.OptContext(model, batch_size=10, ne_datapoint=13, opt_period=3, comm=comm)

    for _, e in run_ranks(2, on_rank):
        assert isinstance(e, ValueError) and "opt_period must be a multiple of 2" in str(e)


def test_low_level_loop_matches_one_process():
    # ctx.alloc / get_batch / eval by hand: each rank takes its batches of the step
    def train(comm):
        model, ds = make_problem(0)
        nranks = 1 if comm is None else comm.Get_size()
        rank = 0 if comm is None else comm.Get_rank()
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                            loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm)
        per = 6 // nranks
        for step in range(4):
            for k in range(per):
                ctx.alloc(True)
                ds.get_batch(ctx.inputs, ctx.labels, step * 6 + rank * per + k)
                ctx.eval()
        assert ctx.iter == 5
        return np.concatenate([p.data.ravel() for p in ctx.parameters()])

    ref = train(None)
    outs = results(3, train)
    for out in outs:
        np.testing.assert_array_equal(out, outs[0])
    np.testing.assert_allclose(outs[0], ref, rtol=RTOL, atol=ATOL)


def test_sharded_optimizer_memory_falls_by_ranks():
    def nbytes(comm, shard):
        model, _ = make_problem(0)
        model = go.nn.Sequential(go.nn.Linear(100, 300), go.nn.Linear(300, 7))
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=100, opt_period=2, comm=comm,
                            shard_optimizer=shard)
        return distributed.optimizer_state_nbytes(ctx), ctx.arena.size

    full, size = results(2, lambda c: nbytes(c, False))[0]
    sharded = [n for n, _ in results(2, lambda c: nbytes(c, True))]
    assert full == 2 * 4 * ((size + 15) // 16 * 16)
    for n in sharded:  # half, up to one 64-byte line of rounding per moment
        assert full / 2 <= n <= full / 2 + 2 * 64


def test_result_and_progress_callback_see_the_whole_dataset():
    calls = []

    def on_rank(comm):
        model, ds = make_problem(0)
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                            loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm)
        rt, rv = go.Result(), go.Result()

        def cb(train, ctx_, ds_, result, ibatch, ibatch_max, t0):
            if comm.Get_rank() == 0:
                calls.append((train, result.ndata, result.nbatches, ibatch, ibatch_max))

        go.epoch(ctx, ds, rt, rv, 240, cb, cb)
        return rt.ndata, rv.ndata, rt.loss(), rv.accuracy()

    model, ds = make_problem(0)
    ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                        loss_type=go.LossType.CROSS_ENTROPY, opt_period=6)
    rt, rv = go.Result(), go.Result()
    go.epoch(ctx, ds, rt, rv, 240)
    outs = results(3, on_rank)
    for ndata_t, ndata_v, loss, acc in outs:
        assert (ndata_t, ndata_v) == (240, 120)
        np.testing.assert_allclose(loss, rt.loss(), rtol=1e-6)
        np.testing.assert_allclose(acc, rv.accuracy(), rtol=1e-12)
    # one call per optimizer step (4), then one for the validation
    assert [c[3] for c in calls] == [6, 12, 18, 24, 12]
    assert calls[3] == (True, 240, 24, 24, 24) and calls[4] == (False, 120, 12, 12, 12)


@pytest.mark.parametrize("before,after", [(2, 3), (3, 1), (1, 2)])
def test_resume_on_another_number_of_ranks(tmp_path, before, after):
    ckpt = str(tmp_path / "run.npz")
    ref, ref_hist, _ = run(None, "ADAMW", nepoch=4)

    def first(comm):
        return run(comm, "ADAMW", nepoch=2, checkpoint=ckpt, shard_optimizer=before == 3)

    if before == 1:
        first(None)
    else:
        results(before, first)
    assert go.checkpoint.load_state(ckpt)["fit.epoch"] == 2

    def second(comm):
        return run(comm, "ADAMW", nepoch=4, checkpoint=ckpt, resume=True)

    outs = [second(None)] if after == 1 else results(after, second)
    _assert_ranks_identical(outs)
    np.testing.assert_allclose(outs[0][0], ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(history_array(outs[0][1]), history_array(ref_hist), rtol=RTOL, atol=1e-7)


def test_only_rank0_writes_the_checkpoint(tmp_path, monkeypatch):
    writes = []
    real = go.checkpoint.save_state
    monkeypatch.setattr(go.checkpoint, "save_state",
                        lambda path, sd: (writes.append(path), real(path, sd)))
    ckpt = str(tmp_path / "run.npz")
    results(3, lambda c: run(c, "ADAMW", nepoch=2, checkpoint=ckpt))
    assert writes == [ckpt, ckpt]  # one per epoch, not one per rank


def test_sharded_state_dict_gathers_the_moments(tmp_path):
    def on_rank(comm, shard):
        model, ds = make_problem(0)
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                            loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm,
                            shard_optimizer=shard)
        go.epoch(ctx, ds, None, None, 240)
        sd = ctx.state_dict()
        if shard:  # load it back into a fresh sharded context: the same state
            model2, _ = make_problem(5)
            ctx2 = go.OptContext(model2, batch_size=10, ne_datapoint=13,
                                 loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm,
                                 shard_optimizer=True)
            ctx2.load_state_dict(sd)
            sd2 = ctx2.state_dict()
            for k in sd:
                if isinstance(sd[k], np.ndarray):
                    np.testing.assert_array_equal(sd2[k], sd[k], err_msg=k)
        return sd

    full = results(2, lambda c: on_rank(c, False))[0]
    sharded = results(2, lambda c: on_rank(c, True))
    assert sharded[0].keys() == full.keys()
    for k in full:
        if k.startswith(("adamw_m", "adamw_v", "param")):
            np.testing.assert_array_equal(sharded[1][k], sharded[0][k])
            np.testing.assert_allclose(sharded[0][k], full[k], rtol=RTOL, atol=ATOL)
            assert np.any(full[k] != 0)


def test_a_failing_rank_stops_every_rank_at_setup():
    # rank 1's dataset has other datapoints: it raises, the others do not hang
    def on_rank(comm):
        ds = None
        if comm.Get_rank() == 1:
            x = np.zeros((360, 4), np.float32)
            ds = go.Dataset.from_arrays(x, np.eye(5, dtype=np.float32)[np.zeros(360, int)])
        return run(comm, "ADAMW", dataset=ds)

    out = run_ranks(3, on_rank)
    assert isinstance(out[1][1], ValueError)
    for r in (0, 2):
        e = out[r][1]
        assert isinstance(e, distributed.RankFailed), repr(e)
        assert "rank 1 of 3 failed (ValueError: " in str(e)


@pytest.mark.parametrize(("bad", "error"), [
    ({"precision": "fp8"}, ValueError), ({"shard_optimizer": 1}, TypeError),
    ({"bucket_cap_mb": -1.0}, ValueError), ({"optimizer_in_backward": "yes"}, TypeError)])
def test_a_bad_context_argument_on_one_rank_stops_every_rank(bad, error):
    # checked before the construction's agreement: rank 1 raised alone and the
    # others waited for it in that agreement for ever
    def on_rank(comm):
        model, _ = make_problem(0)
        return go.OptContext(model, batch_size=10, ne_datapoint=13, opt_period=6, comm=comm,
                             **(bad if comm.Get_rank() == 1 else {}))

    out = run_ranks(2, on_rank)
    assert isinstance(out[1][1], error), repr(out[1][1])
    assert isinstance(out[0][1], distributed.RankFailed), repr(out[0][1])
    assert f"rank 1 of 2 failed ({error.__name__}: " in str(out[0][1])


def test_a_bad_fit_argument_on_one_rank_stops_every_rank():
    out = run_ranks(2, lambda c: run(c, "ADAMW", shard_optimizer=1 if c.Get_rank() else False))
    assert isinstance(out[1][1], TypeError), repr(out[1][1])
    assert isinstance(out[0][1], distributed.RankFailed), repr(out[0][1])


def test_ranks_that_multiply_in_other_precisions_are_refused(monkeypatch):
    # bf16 asked for everywhere, but one rank's CPU has no bf16 products: it trains
    # in float32 (a warning there) and the summed gradients would mix the two
    import threading

    from ggmlopt import context
    native = threading.local()
    monkeypatch.setattr(context, "_checked_precision",
                        lambda p: p if getattr(native, "bf16", True) else "f32")

    def on_rank(comm):
        native.bf16 = comm.Get_rank() == 0
        model, _ = make_problem(0)
        return go.OptContext(model, batch_size=10, ne_datapoint=13, opt_period=6, comm=comm,
                             precision="bf16")

    for _, e in run_ranks(2, on_rank):
        assert isinstance(e, ValueError) and "ranks disagree" in str(e), repr(e)
        assert "bf16->bf16" in str(e) and "bf16->f32" in str(e)


def test_a_nan_on_one_rank_stops_every_rank_in_training():
    # each rank its own part of the data (dataset_is_part), rank 1's all NaN (set
    # after from_arrays, which refuses it)
    def on_rank(comm):
        _model, ds = make_problem(0)
        n = ds.ndata // comm.Get_size()
        rows = slice(comm.Get_rank() * n, (comm.Get_rank() + 1) * n)
        part = go.Dataset.from_arrays(ds.data[rows], ds.labels[rows], ndata_shard=2)
        if comm.Get_rank() == 1:
            part.data[...] = np.nan
        return run(comm, "ADAMW", dataset=part, dataset_is_part=True)

    out = run_ranks(2, on_rank)
    assert isinstance(out[1][1], FloatingPointError)
    assert isinstance(out[0][1], distributed.RankFailed)
    assert "FloatingPointError" in str(out[0][1])


def test_a_whole_dataset_of_other_bytes_on_one_rank_is_refused_before_training():
    # every rank holds the whole dataset: one whose rows differ (here NaN) is
    # another dataset, which the ranks' agreement refuses before any step
    def on_rank(comm):
        _model, ds = make_problem(0)
        if comm.Get_rank() == 1:
            ds.data[...] = np.nan
        return run(comm, "ADAMW", dataset=ds)

    for _, e in run_ranks(2, on_rank):
        assert isinstance(e, ValueError) and "ranks disagree" in str(e), repr(e)
        assert "every rank must hold the same dataset" in str(e)


def test_a_dataset_refilled_in_place_on_one_rank_is_refused_at_the_next_epoch():
    # a loader that reuses one Dataset's buffer for the next chunk: the ranks read
    # its bytes again when they changed, not only the first time they see it
    def on_rank(comm):
        model, ds = make_problem(0)
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=ds.data.shape[1],
                            loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm)
        go.epoch(ctx, ds)
        if comm.Get_rank() == 1:
            ds.data[...] = np.random.default_rng(9).standard_normal(ds.data.shape)
        before = np.concatenate([p.data.ravel() for p in ctx.parameters()])
        try:
            go.epoch(ctx, ds)
        except ValueError:
            after = np.concatenate([p.data.ravel() for p in ctx.parameters()])
            assert np.array_equal(before, after)   # refused before any step
            raise

    for _, e in run_ranks(2, on_rank):
        assert isinstance(e, ValueError) and "ranks disagree" in str(e), repr(e)


def test_the_ranks_keep_no_dataset_alive():
    def on_rank(comm):
        model, ds = make_problem(0)
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=ds.data.shape[1],
                            loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm)
        refs = []
        for _ in range(3):
            chunk = go.Dataset.from_arrays(ds.data.copy(), ds.labels.copy(), ndata_shard=2)
            go.epoch(ctx, chunk)
            refs.append(weakref.ref(chunk))
            del chunk
        gc.collect()
        return [r() is None for r in refs], len(ctx.distributed._data_digests)

    for out, e in run_ranks(2, on_rank):
        assert e is None, repr(e)
        assert out == ([True, True, True], 0)


def test_a_frozen_parameter_with_no_elements_over_ranks():
    # the ranks hash their frozen parameters: one of shape (0, 4) has no bytes
    class WithEmpty(go.nn.Module):
        def __init__(self):
            self.inner = go.nn.Linear(13, 3, rng=0)
            self.empty = go.nn.Parameter(np.zeros((0, 4), np.float32))
            self.empty.requires_grad = False

        def forward(self, x):
            return self.inner.forward(x)

        def backward(self, g):
            return self.inner.backward(g)

    def on_rank(comm):
        model = WithEmpty()
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                            loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm)
        return distributed._frozen_token(ctx, model)

    tokens = run_ranks(2, on_rank)
    assert [e for _, e in tokens] == [None, None]
    assert tokens[0][0] == tokens[1][0] and tokens[0][0].startswith("frozen ")


def test_a_failing_callback_on_rank0_stops_every_rank():
    def on_rank(comm):
        model, ds = make_problem(0)
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                            loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm)

        def cb(*args):
            if comm.Get_rank() == 0 and args[4] == args[5]:  # the phase's last call
                raise OSError("stderr is gone")

        for _ in range(2):
            go.epoch(ctx, ds, None, None, 240, cb, None)

    out = run_ranks(2, on_rank)
    assert isinstance(out[0][1], OSError)
    assert isinstance(out[1][1], distributed.RankFailed)


def test_different_seeds_are_caught():
    out = run_ranks(2, lambda c: _with_seed(c, c.Get_rank()))
    for _, e in out:
        assert isinstance(e, ValueError) and "ranks disagree" in str(e), repr(e)


def _with_seed(comm, seed):
    model, ds = make_problem(0)
    return go.fit(model, ds, go.LossType.CROSS_ENTROPY, nepoch=1, nbatch_logical=60,
                  nbatch_physical=NBATCH_PHYSICAL, silent=True, seed=seed, comm=comm)


def test_bad_arguments():
    model, _ = make_problem(0)
    with pytest.raises(TypeError, match="comm: expected an mpi4py communicator"):
        go.OptContext(model, batch_size=10, ne_datapoint=13, comm=object())
    with pytest.raises(ValueError, match="shard_optimizer: needs comm="):
        go.OptContext(model, batch_size=10, ne_datapoint=13, shard_optimizer=True)
    comm = ThreadComm(ThreadGroup(1), 0)
    with pytest.raises(TypeError, match="shard_optimizer: expected a bool"):
        go.OptContext(model, batch_size=10, ne_datapoint=13, comm=comm, shard_optimizer=1)
    # the failed constructions did not take the model's parameters
    assert all(p.data.base is None for p in model.parameters())
    with pytest.raises(TypeError):
        go.fit(model, make_problem(0)[1], go.LossType.CROSS_ENTROPY, 1, 1, 60, 10, 0.0, True,
               go.OptimizerType.ADAMW, 0, None, False, None, comm)  # comm is keyword-only


def test_set_rank_threads():
    before = go.get_num_threads()
    try:
        assert distributed.set_rank_threads(1) == 1
        assert go.get_num_threads() == 1
        comm = ThreadComm(ThreadGroup(2), 0)
        n = distributed.set_rank_threads(comm=comm)
        assert n == max(1, len(os.sched_getaffinity(0)) // 2) == go.get_num_threads()
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="nthreads"):
                distributed.set_rank_threads(bad)
        # the pool runs at most 64: the count returned is the one set (it said 1000)
        assert distributed.set_rank_threads(1000) == 64 == go.get_num_threads()
    finally:
        go.set_num_threads(before)
        distributed.set_rank_threads(before)


def test_without_comm_mpi4py_is_never_imported():
    code = (f"import sys; sys.path.insert(0, {TESTS!r})\n"
            "from dist_problem import run\nrun(None, 'ADAMW', nepoch=1)\n"
            "assert 'mpi4py' not in sys.modules, 'mpi4py was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


# ---- each rank holding only its part of the data (fit(dataset_is_part=True)) ----------

@pytest.mark.parametrize("nranks", [2, 3])
def test_parts_equal_one_process_when_nothing_is_shuffled(nranks):
    # one logical batch holds all 60 datapoints: no shuffle, rank r's block is its share
    ref, _, _ = run(None, "ADAMW", ndata=60, val_split=0.0)
    outs = results(nranks, lambda c: run(c, "ADAMW", ndata=60, val_split=0.0, part=True))
    _assert_ranks_identical(outs)
    np.testing.assert_allclose(outs[0][0], ref, rtol=RTOL, atol=ATOL)


def test_parts_count_the_whole_data(capsys):
    # 3 parts of 120: 4 logical batches of 60 train (240 datapoints), 120 validate
    outs = results(3, lambda c: run(c, "SGD", nepoch=2, part=True, silent=False))
    _assert_ranks_identical(outs)
    err = capsys.readouterr().err
    assert err.count("train: [") == 2 and err.count("data=0000240/0000240") == 2
    assert err.count("val:   [") == 2 and err.count("data=0000120/0000120") == 2
    assert err.count("fit: epoch 0001/0002") == 1  # rank 0 alone prints


def test_parts_resume_bit_for_bit(tmp_path):
    ckpt = str(tmp_path / "parts.npz")
    straight = results(2, lambda c: run(c, "ADAMW", nepoch=4, part=True))
    results(2, lambda c: run(c, "ADAMW", nepoch=2, part=True, checkpoint=ckpt))
    resumed = results(2, lambda c: run(c, "ADAMW", nepoch=4, part=True, checkpoint=ckpt,
                                       resume=True))
    for a, b in zip(straight, resumed):
        assert np.array_equal(a[0], b[0])


def test_parts_bad_arguments():
    model, ds = make_problem(0)
    with pytest.raises(ValueError, match="dataset_is_part: needs comm="):
        go.fit(model, ds, go.LossType.CROSS_ENTROPY, nbatch_logical=60, dataset_is_part=True)
    out = run_ranks(2, lambda c: go.fit(model, ds, go.LossType.CROSS_ENTROPY, comm=c,
                                        nbatch_logical=60, dataset_is_part=1))
    assert all(isinstance(e, TypeError) and "dataset_is_part" in str(e) for _, e in out)


def test_optcontext_load_on_other_ranks(tmp_path):
    path = str(tmp_path / "ctx.npz")

    def train_and_save(comm):
        model, ds = make_problem(0)
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                            loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm,
                            shard_optimizer=True)
        go.epoch(ctx, ds, None, None, 240)
        ctx.save(path)
        return ctx.state_dict()

    saved = results(2, train_and_save)[0]

    def load(comm):
        model, _ = make_problem(7)
        return go.OptContext.load(path, model, comm=comm).state_dict()

    for sd in results(3, load):
        for k in ("param.0", "adamw_m.2", "adamw_v.3"):
            np.testing.assert_array_equal(sd[k], saved[k])
        assert sd["iter"] == saved["iter"] == 5

    # a rank that cannot read the checkpoint stops the others
    def load_bad(comm):
        model, _ = make_problem(7)
        where = path if comm.Get_rank() == 0 else str(tmp_path / "missing.npz")
        return go.OptContext.load(where, model, comm=comm)

    out = run_ranks(2, load_bad)
    assert isinstance(out[1][1], FileNotFoundError)
    assert isinstance(out[0][1], distributed.RankFailed)


def test_forward_context_evaluates_over_the_ranks():
    # an evaluation context (FORWARD, opt_period 1) splits the batches over 3 ranks
    model, ds = make_problem(0)
    ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                        loss_type=go.LossType.CROSS_ENTROPY, build_type=go.BuildType.FORWARD)
    ref = go.Result()
    go.epoch(ctx, ds, None, ref, 0)

    def on_rank(comm):
        model, ds = make_problem(0)
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                            loss_type=go.LossType.CROSS_ENTROPY,
                            build_type=go.BuildType.FORWARD, comm=comm)
        res = go.Result()
        go.epoch(ctx, ds, None, res, 0)
        with pytest.raises(RuntimeError, match="training needs a context built for OPT"):
            go.epoch(ctx, ds, None, None, 10)
        return res.ndata, res.loss(), res.accuracy()

    for ndata, loss, acc in results(3, on_rank):
        assert ndata == 360
        np.testing.assert_allclose(loss, ref.loss(), rtol=1e-6)
        assert acc == ref.accuracy()


def test_a_state_inside_a_logical_batch_does_not_load_on_several_ranks():
    model, ds = make_problem(0)
    ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                        loss_type=go.LossType.CROSS_ENTROPY, opt_period=6)
    ctx.alloc(True)
    ds.get_batch(ctx.inputs, ctx.labels, 0)
    ctx.eval()
    sd = ctx.state_dict()
    assert sd["opt_i"] == 1

    def on_rank(comm):
        model, _ = make_problem(0)
        c = go.OptContext(model, batch_size=10, ne_datapoint=13,
                          loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm)
        before = c.state_dict()
        with pytest.raises(ValueError, match="saved between logical batches"):
            c.load_state_dict(sd)
        assert c.opt_i == 0 and np.array_equal(c.state_dict()["param.0"], before["param.0"])

    results(2, on_rank)
