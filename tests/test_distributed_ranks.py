"""Data-parallel training, per rank (ggmlopt.rank_rng, ggmlopt._global_pred): each
rank's own Dropout stream, checkpoints that keep it, every rank's predictions in the
dataset's order, language models over the ranks, the threads a rank picks.  On a
communicator of threads; tests/mpi/ runs the same under mpiexec."""
import json
import os
import sys

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import distributed, rank_rng

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
import lm_dist_problem as lm
from dist_problem import make_problem, run
from thread_comm import ThreadComm, ThreadGroup, results, run_ranks


def _masks_of_one_step(comm, seed=0):
    """Each rank's Dropout mask of the first training batch, gathered to every rank."""
    model, ds = make_problem(0, dropout=0.5)
    ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                        loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm,
                        seed=seed)
    ctx.alloc(True)
    ds.get_batch(ctx.inputs, ctx.labels, comm.Get_rank())
    ctx.eval()
    mine = np.ascontiguousarray(model[2]._mask, np.float32)
    every = np.empty((comm.Get_size(),) + mine.shape, np.float32)
    comm.Allgather(mine, every)
    return every, ctx.rng.bit_generator.state


@pytest.mark.parametrize("nranks", [2, 3])
def test_each_rank_draws_its_own_masks(nranks):
    outs = results(nranks, _masks_of_one_step)
    every, shared = outs[0]
    for r in range(nranks):
        for q in range(r):
            assert not np.array_equal(every[r], every[q]), f"ranks {q} and {r} share a mask"
    for other, state in outs[1:]:  # the same gather everywhere, one shared generator
        assert np.array_equal(other, every)
        assert state == shared
    # the same seed and rank count: the same masks; another seed: others
    assert np.array_equal(results(nranks, _masks_of_one_step)[0][0], every)
    assert not np.array_equal(results(nranks, lambda c: _masks_of_one_step(c, 1))[0][0], every)


def test_rank_streams_are_derived_from_the_shared_state_and_the_rank():
    shared = np.random.default_rng(7)
    before = shared.bit_generator.state
    a, b = rank_rng.rank_generator(shared, 0), rank_rng.rank_generator(shared, 1)
    assert shared.bit_generator.state == before  # the shuffles' stream draws nothing
    assert type(a.bit_generator) is type(shared.bit_generator)
    x, y = a.random(8), b.random(8)
    assert not np.array_equal(x, y)
    np.testing.assert_array_equal(rank_rng.rank_generator(np.random.default_rng(7), 0).random(8),
                                  x)
    assert not np.array_equal(shared.random(8), x)


def test_one_process_draws_from_the_shared_generator():
    model, _ = make_problem(0, dropout=0.5)
    ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                        loss_type=go.LossType.CROSS_ENTROPY)
    assert ctx.model_rng is ctx.rng
    assert "rank_rng_states" not in ctx.state_dict()


def test_a_dropout_run_repeats_and_the_shuffles_stay_shared():
    def on_rank(comm):
        flat, hist, _ = run(comm, "ADAMW", nepoch=2, dropout=0.3)
        return flat, [e.train_loss for e in hist]

    first, second = results(2, on_rank), results(2, on_rank)
    for a, b in zip(first, second):
        assert np.array_equal(a[0], b[0]) and a[1] == b[1]
    assert np.array_equal(first[0][0], first[1][0])  # ranks bit-identical
    # the per-rank masks make it another run than one process's single stream
    single, _, _ = run(None, "ADAMW", nepoch=2, dropout=0.3)
    assert not np.allclose(single, first[0][0], rtol=1e-5, atol=1e-6)


def test_state_dict_holds_every_rank_stream():
    def on_rank(comm):
        model, ds = make_problem(0, dropout=0.5)
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                            loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm)
        go.epoch(ctx, ds, None, None, 240)
        sd = ctx.state_dict()
        return sd, ctx.model_rng.bit_generator.state

    outs = results(3, on_rank)
    states = json.loads(outs[0][0]["rank_rng_states"])
    assert len(states) == 3
    for r, (sd, mine) in enumerate(outs):
        assert sd["rank_rng_states"] == outs[0][0]["rank_rng_states"]
        assert states[r]["state"] == mine["state"]


def test_a_dropout_resume_is_bit_exact(tmp_path):
    ckpt = str(tmp_path / "drop.npz")
    straight = results(2, lambda c: run(c, "ADAMW", nepoch=4, dropout=0.3))
    results(2, lambda c: run(c, "ADAMW", nepoch=2, dropout=0.3, checkpoint=ckpt))
    resumed = results(2, lambda c: run(c, "ADAMW", nepoch=4, dropout=0.3, checkpoint=ckpt,
                                       resume=True))
    for a, b in zip(straight, resumed):
        assert np.array_equal(a[0], b[0])
    # sharded moments and the streams gathered together
    ckpt2 = str(tmp_path / "drop2.npz")
    results(2, lambda c: run(c, "ADAMW", nepoch=2, dropout=0.3, checkpoint=ckpt2,
                             shard_optimizer=True))
    resumed = results(2, lambda c: run(c, "ADAMW", nepoch=4, dropout=0.3, checkpoint=ckpt2,
                                       resume=True, shard_optimizer=True))
    np.testing.assert_allclose(resumed[0][0], straight[0][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("before,after", [(2, 3), (3, 1)])
def test_a_dropout_resume_on_another_rank_count_is_reproducible(tmp_path, before, after):
    # the saved streams cannot be shared out anew: each rank derives a fresh one
    # from the checkpoint's shared state and its rank, the same every time
    ckpt = str(tmp_path / "drop.npz")
    results(before, lambda c: run(c, "ADAMW", nepoch=2, dropout=0.3, checkpoint=ckpt))
    saved = go.checkpoint.load_state(ckpt)
    assert len(json.loads(str(saved["rank_rng_states"]))) == before

    def second(comm, path):
        return run(comm, "ADAMW", nepoch=4, dropout=0.3, checkpoint=path, resume=True)[0]

    outs = []
    for attempt in range(2):  # each resume from its own copy of the checkpoint
        path = str(tmp_path / f"copy{attempt}.npz")
        go.checkpoint.save_state(path, saved)
        outs.append([second(None, path)] if after == 1 else
                    results(after, lambda c, p=path: second(c, p)))
    assert np.array_equal(outs[0][0], outs[1][0])
    for o in outs[0]:
        assert np.array_equal(o, outs[0][0])


def test_a_bad_rank_stream_in_a_state_is_refused():
    def on_rank(comm):
        model, _ = make_problem(0)
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                            loss_type=go.LossType.CROSS_ENTROPY, opt_period=2, comm=comm)
        sd = ctx.state_dict()
        sd["rank_rng_states"] = "[1, 2]"
        before = ctx.model_rng.bit_generator.state
        with pytest.raises(ValueError, match="rng_state"):
            ctx.load_state_dict(sd)
        assert ctx.model_rng.bit_generator.state == before

    results(2, on_rank)


# ---- predictions of every rank, in the dataset's order ----------------------------------

def _epoch_preds(comm, part=False, nranks=1):
    model, ds = make_problem(0)
    if part:
        n = 360 // nranks
        rows = slice(comm.Get_rank() * n, (comm.Get_rank() + 1) * n)
        ds = go.Dataset.from_arrays(ds.data[rows], ds.labels[rows], ndata_shard=2)
    ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                        loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm)
    if part:
        ctx._dist.parts = True
    rt, rv = go.Result(), go.Result()
    go.epoch(ctx, ds, rt, rv, 240 // nranks if part else 240)
    return rt.pred(), rv.pred(), rt.accuracy(), rv.accuracy()


@pytest.mark.parametrize("nranks", [2, 3])
def test_pred_holds_every_datapoint_in_dataset_order(nranks):
    ref_t, ref_v, acc_t, acc_v = _epoch_preds(None)
    for pt, pv, at, av in results(nranks, _epoch_preds):
        np.testing.assert_array_equal(pt, ref_t)
        np.testing.assert_array_equal(pv, ref_v)
        assert (pt.size, pv.size) == (240, 120)
        assert at[0] == pytest.approx(acc_t[0], abs=1e-12) and av == acc_v


@pytest.mark.parametrize("nranks", [2, 3])
def test_pred_with_parts_is_the_parts_in_rank_order(nranks):
    # each part's batches in its own order: training, part r's share of each logical
    # batch after part r-1's; validation, part 0's batches, then part 1's ...
    def local(comm):
        model, ds = make_problem(0)
        n = 360 // nranks
        rows = slice(comm.Get_rank() * n, (comm.Get_rank() + 1) * n)
        ds = go.Dataset.from_arrays(ds.data[rows], ds.labels[rows], ndata_shard=2)
        ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                            loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm)
        ctx._dist.parts = True
        return ctx, ds

    def on_rank(comm):
        ctx, ds = local(comm)
        rt, rv = go.Result(), go.Result()
        rt_own = []
        go.epoch(ctx, ds, rt, rv, 240 // nranks,
                 lambda *a: rt_own.append(np.array(ctx.pred, copy=True)))
        return rt.pred(), rv.pred()

    outs = results(nranks, on_rank)
    pt, pv = outs[0]
    for t, v in outs[1:]:
        np.testing.assert_array_equal(t, pt)
        np.testing.assert_array_equal(v, pv)
    assert (pt.size, pv.size) == (240, 120)
    # against one process over the parts laid out in that order (no shuffle: same batches)
    model, ds = make_problem(0)
    n, per = 360 // nranks, 60 // nranks
    order = [r * n + j * per + k for j in range(240 // 60) for r in range(nranks)
             for k in range(per)]
    order += [r * n + 240 // nranks + k for r in range(nranks) for k in range(120 // nranks)]
    single = go.Dataset.from_arrays(ds.data[order], ds.labels[order], ndata_shard=2)
    ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                        loss_type=go.LossType.CROSS_ENTROPY, opt_period=6)
    rt, rv = go.Result(), go.Result()
    go.epoch(ctx, single, rt, rv, 240)
    np.testing.assert_array_equal(pt, rt.pred())
    np.testing.assert_array_equal(pv, rv.pred())


def test_pred_of_an_evaluation_context_over_ranks():
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
        return res.pred()

    for pred in results(3, on_rank):  # 36 batches round robin over 3 ranks... and 4 ranks
        np.testing.assert_array_equal(pred, ref.pred())
    for pred in results(4, on_rank):  # 36 batches: ranks hold 9 each
        np.testing.assert_array_equal(pred, ref.pred())
    for pred in results(5, on_rank):  # 36 batches: 8, 7, 7, 7, 7
        np.testing.assert_array_equal(pred, ref.pred())


def test_evaluate_holds_every_prediction_on_each_rank():
    # evaluate runs every datapoint on the calling process: no ranks to gather
    model, ds = make_problem(0)
    res = go.evaluate(model, ds, "cross_entropy", batch_size=7)
    assert res.pred().size == 360


# ---- language models over the ranks ----------------------------------------------------

@pytest.mark.parametrize("kind", list(lm.CONFIGS))
@pytest.mark.parametrize("nranks", [2, 3])
def test_lm_equals_one_process(kind, nranks):
    logical = lm.logical_batch(nranks)
    ref, ref_hist = lm.fit_lm(None, kind, nbatch_logical=logical)
    outs = results(nranks, lambda c: lm.fit_lm(c, kind, nbatch_logical=logical))
    for flat, hist in outs:
        assert np.array_equal(flat, outs[0][0])
        for a, b in zip(hist, ref_hist):
            assert a.train_loss == pytest.approx(b.train_loss, rel=1e-6)
            assert a.val_loss == pytest.approx(b.val_loss, rel=1e-6)
            assert a.val_accuracy == b.val_accuracy
    trained, key_bias = lm.max_difference(kind, outs[0][0], ref)
    assert trained <= lm.rounding_bound(lm.nsteps_of(1, logical), logical)
    assert key_bias <= 1e-5
    assert np.abs(ref - lm.params(lm.make_model(kind))).max() > 1e-4  # it trained


def test_lm_loss_is_the_mean_over_labelled_positions_of_every_rank():
    x, y = lm.token_windows()
    y[:48, :6] = -1  # the first half of the data holds far fewer labelled positions
    ds = go.Dataset.from_arrays(x, y)

    def evaluate(comm):
        model = lm.make_model()
        ctx = go.OptContext(model, batch_size=lm.NBATCH_PHYSICAL, ne_datapoint=lm.N_CTX,
                            loss_type=go.LossType.CROSS_ENTROPY, build_type=go.BuildType.FORWARD,
                            class_labels=True, comm=comm)
        res = go.Result()
        go.epoch(ctx, ds, None, res, 0)
        return res.loss(), res.accuracy(), res.nlabelled, res.pred()

    ref = evaluate(None)
    assert ref[2] == int(np.count_nonzero(y >= 0))
    for loss, acc, nlabelled, pred in results(2, evaluate):
        assert nlabelled == ref[2]
        assert loss[0] == pytest.approx(ref[0][0], rel=1e-6)
        assert acc == ref[1]
        np.testing.assert_array_equal(pred, ref[3])
        assert pred.size == lm.NDATA * lm.N_CTX


@pytest.mark.parametrize("nranks", [2, 3])
def test_lm_with_a_token_file_per_rank(tmp_path, nranks):
    lm.write_part_files(tmp_path, nranks)
    total = 12 * nranks
    ref, ref_hist = lm.fit_lm(None, dataset=lm.whole_dataset(tmp_path, nranks), nepoch=2,
                              val_split=0.0, nbatch_logical=total)
    outs = results(nranks, lambda c: lm.fit_lm(
        c, dataset=lm.part_dataset(tmp_path, c.Get_rank()), nepoch=2, val_split=0.0,
        nbatch_logical=total, part=True))
    for flat, hist in outs:
        assert np.array_equal(flat, outs[0][0])
        assert [e.train_loss for e in hist] == pytest.approx(
            [e.train_loss for e in ref_hist], rel=1e-6)
    assert lm.max_difference("llama", outs[0][0], ref)[0] <= lm.rounding_bound(
        lm.nsteps_of(2, total, ndata=total, val_split=0.0), total)


# ---- threads ---------------------------------------------------------------------------

def test_set_rank_threads_shares_the_cores_of_a_machine(monkeypatch):
    before = go.get_num_threads()
    monkeypatch.setattr(distributed, "_cores", lambda: 8)
    try:
        for env, expect in (({}, 4), ({"MPI_LOCALNRANKS": "8"}, 1),
                            ({"MPI_LOCALNRANKS": "3"}, 2), ({"MPI_LOCALNRANKS": "16"}, 1)):
            for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                        "SLURM_NTASKS_PER_NODE"):
                monkeypatch.delenv(var, raising=False)
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            comm = ThreadComm(ThreadGroup(2), 0)
            assert distributed.set_rank_threads(comm=comm) == expect == go.get_num_threads()
    finally:
        go.set_num_threads(before)


@pytest.fixture
def fresh_threads(monkeypatch):
    """A process that has not chosen its threads; restores them afterwards."""
    before = go.get_num_threads()
    monkeypatch.setattr(distributed, "_threads_chosen", False)
    for var in ("GGMLOPT_NUM_THREADS", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                "SLURM_NTASKS_PER_NODE") + distributed._BLAS_THREAD_ENV:
        monkeypatch.delenv(var, raising=False)
    go.set_num_threads(min(os.cpu_count(), 64))  # the pool's default
    yield
    go.set_num_threads(before)
    if distributed._blas_limits is not None:
        distributed._blas_limits.restore_original_limits()
        distributed._blas_limits = None


def _blas_threads():
    from ggmlopt._blas_threads import current_blas_threads
    return current_blas_threads()


@pytest.mark.parametrize("cores,nranks,expect", [(2, 2, 1), (8, 2, 4), (8, 3, 2), (2, 4, 1)])
def test_auto_rank_threads_share_the_cores(fresh_threads, monkeypatch, cores, nranks, expect):
    monkeypatch.setattr(distributed, "_cores", lambda: cores)
    comm = ThreadComm(ThreadGroup(nranks), 0)
    kernel, blas = distributed.auto_rank_threads(comm)
    assert kernel == expect == go.get_num_threads()
    assert blas == expect
    if _blas_threads() is not None:
        assert _blas_threads() == expect


def test_auto_rank_threads_obey_what_the_process_chose(fresh_threads, monkeypatch):
    monkeypatch.setattr(distributed, "_cores", lambda: 8)
    comm = ThreadComm(ThreadGroup(2), 0)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")   # BLAS told: left alone
    assert distributed.auto_rank_threads(comm) == (4, None)
    go.set_num_threads(min(os.cpu_count(), 64))
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    monkeypatch.setenv("GGMLOPT_NUM_THREADS", "2")  # the kernels told: left alone
    assert distributed.auto_rank_threads(comm)[0] == min(os.cpu_count(), 64)
    monkeypatch.delenv("GGMLOPT_NUM_THREADS")
    distributed.set_rank_threads(1)                 # chosen by hand: nothing changes
    assert distributed.auto_rank_threads(comm) == (1, None)


def test_a_context_over_a_thread_comm_keeps_the_threads(fresh_threads):
    # only an mpi4py communicator's ranks are processes that share the cores
    before = go.get_num_threads()
    results(2, lambda c: go.OptContext(make_problem(0)[0], batch_size=10, ne_datapoint=13,
                                       opt_period=2, comm=c))
    assert go.get_num_threads() == before


# ---- fit's memory check over the ranks ---------------------------------------------------

_LOCAL_ENV = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def _room(monkeypatch, free):
    """A machine with free bytes left and nothing of the step's held yet."""
    from ggmlopt import memory_estimate
    monkeypatch.setattr(memory_estimate, "available_memory", lambda: free)
    monkeypatch.setattr(memory_estimate, "resident_memory", lambda: 0)


def test_fit_checks_the_memory_of_the_ranks_sharing_a_machine(monkeypatch):
    # room for one training, not for two: two ranks on this machine each hold a model,
    # its gradients, state and activations (each rank checked the whole machine's room
    # for itself alone, so both started, to be killed for memory later)
    for var in _LOCAL_ENV:
        monkeypatch.delenv(var, raising=False)
    report = go.memory_report(lm.make_model(), lm.NBATCH_PHYSICAL, lm.N_CTX)
    _room(monkeypatch, report.total * 3 // 2)
    lm.fit_lm(None)   # one process fits
    for _, error in run_ranks(2, lambda c: lm.fit_lm(c)):
        assert isinstance(error, MemoryError), error
        assert "2 ranks on this machine" in str(error)
    monkeypatch.setenv("MPI_LOCALNRANKS", "1")   # the launcher says: one rank a machine
    results(2, lambda c: lm.fit_lm(c))


def test_fit_counts_a_sharded_optimizer_state_per_rank(monkeypatch):
    # a rank keeps 1/P of AdamW's moments (and a shard of the summed gradient):
    # refusing it for the whole state asked for memory the run never takes
    monkeypatch.setenv("MPI_LOCALNRANKS", "1")
    report = go.memory_report(lm.make_model(), lm.NBATCH_PHYSICAL, lm.N_CTX)
    # the state is two gradients' worth: a rank of two saves half a gradient
    _room(monkeypatch, report.total - report.gradients // 4)
    for _, error in run_ranks(2, lambda c: lm.fit_lm(c)):
        assert isinstance(error, MemoryError), error
    results(2, lambda c: go.fit(lm.make_model(), go.Dataset.from_arrays(*lm.token_windows()),
                                "cross_entropy", lambda ep: lm.PARS, nbatch_logical=24,
                                nbatch_physical=6, silent=True, comm=c,
                                shard_optimizer=True))
