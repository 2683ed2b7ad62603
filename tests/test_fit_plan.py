"""fit's plan (ggmlopt._fit_plan.FitPlan) and what it adds to fit: max_steps,
evaluation every N optimizer steps, checkpoints inside an epoch with a bit-exact
resume, and checkpoints of before still loading."""
import math
import os
import sys
from dataclasses import astuple, fields

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt._fit_plan import FitPlan
from ggmlopt.checkpoint import HISTORY_COLUMNS, load_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_problem import make_problem

# make_problem: 96 datapoints in shards of 2; logical batches of 8 in physical
# batches of 4 (opt_period 2); val_split 0.25 keeps 9 logical batches to train
NB_LOGICAL, NB_PHYSICAL, VAL_SPLIT, STEPS_PER_EPOCH = 8, 4, 0.25, 9


def plan(**kw):
    _, ds, _ = make_problem("epoch")
    args = {"nepoch": 3, "nbatch_logical": NB_LOGICAL, "nbatch_physical": NB_PHYSICAL,
            "val_split": VAL_SPLIT}
    args.update(kw)
    return FitPlan.from_args(ds, args.pop("nepoch"), args.pop("nbatch_logical"),
                             args.pop("nbatch_physical"), args.pop("val_split"), **args)


def test_plan_arithmetic():
    p = plan()
    assert (p.ndata, p.opt_period, p.nbatches, p.ibatch_split) == (96, 2, 24, 18)
    assert (p.steps_per_epoch, p.nepoch, p.total_steps, p.idata_split) == (9, 3, 27, 72)
    assert p.shuffle_all and p.shuffle_train and p.validates and not p.segmented
    assert [p.pauses(ep, 0) for ep in (1, 2, 3)] == [[9], [9], [9]]

    p = plan(eval_every=4, checkpoint_every=6, checkpoint="c.npz")
    assert p.segmented
    # steps 4, 6, 8, 9 | 12, 16, 18 | 20, 24, 27 (each epoch ends at a multiple of 9)
    assert p.pauses(1, 0) == [4, 6, 8, 9]
    assert p.pauses(2, 0) == [3, 7, 9]
    assert p.pauses(3, 0) == [2, 6, 9]
    assert p.pauses(1, 6) == [8, 9]          # resumed after step 6 of epoch 1
    assert [s for s in range(1, 28) if p.evaluates_at(s)] == [4, 8, 12, 16, 20, 24]
    assert [s for s in range(1, 28) if p.checkpoints_at(s)] == [6, 12, 18, 24]

    p = plan(max_steps=13)                   # the fit stops at step 4 of epoch 2
    assert (p.nepoch, p.total_steps) == (2, 13)
    assert [p.epoch_steps(ep) for ep in (1, 2)] == [9, 4]
    assert p.pauses(2, 0) == [4] and p.segmented
    p = plan(nepoch=None, max_steps=20)      # as many epochs as max_steps needs
    assert (p.nepoch, p.total_steps, p.epoch_steps(3)) == (3, 20, 2)
    p = plan(max_steps=27)
    assert not p.segmented and p.nepoch == 3
    # one logical batch per step without accumulation, no split: an epoch is 12 steps
    p = plan(nbatch_physical=None, val_split=0.0, nepoch=2)
    assert (p.opt_period, p.steps_per_epoch, p.ibatch_split, p.validates) == (1, 12, 12, False)


@pytest.mark.parametrize("kw,error,match", [
    ({"max_steps": 0}, ValueError, "max_steps"),
    ({"max_steps": 2.0}, TypeError, "max_steps"),
    ({"max_steps": 28}, ValueError, "max_steps: 28 optimizer steps need 4 epochs"),
    ({"nepoch": None}, ValueError, "nepoch: None .* needs max_steps"),
    ({"eval_every": 0}, ValueError, "eval_every"),
    ({"eval_every": "3"}, TypeError, "eval_every"),
    ({"eval_every": True}, TypeError, "eval_every"),
    ({"eval_every": 3, "val_split": 0.0}, ValueError, "eval_every: .*val_split"),
    ({"checkpoint_every": 3}, ValueError, "checkpoint_every: needs checkpoint"),
    ({"checkpoint_every": -1, "checkpoint": "c.npz"}, ValueError, "checkpoint_every"),
    ({"nepoch": -1}, ValueError, "nepoch"),
])
def test_bad_arguments_raise_before_training(kw, error, match):
    model, ds, pars = make_problem("epoch")
    before = [p.data.copy() for p in model.parameters()]
    perm = ds.permutation.copy()
    args = {"nepoch": 3, "nbatch_logical": NB_LOGICAL, "nbatch_physical": NB_PHYSICAL,
            "val_split": VAL_SPLIT, "silent": True, "seed": 5, **kw}
    with pytest.raises(error, match=match):
        go.fit(model, ds, go.LossType.CROSS_ENTROPY, pars, **args)
    for p, b in zip(model.parameters(), before):
        assert np.array_equal(p.data, b)
    assert np.array_equal(ds.permutation, perm)


def test_a_step_schedule_too_short_for_max_steps_fails_before_training():
    model, ds, _ = make_problem("epoch")
    sched = go.schedules.Linear(total=10, unit="step")   # its rate is 0 after step 10
    with pytest.raises(ValueError, match="step 13 .*max_steps=13"):
        go.fit(model, ds, go.LossType.CROSS_ENTROPY, sched, nepoch=2, nbatch_logical=8,
               nbatch_physical=4, val_split=0.25, silent=True, max_steps=13)
    go.fit(model, ds, go.LossType.CROSS_ENTROPY, sched, nepoch=2, nbatch_logical=8,
           nbatch_physical=4, val_split=0.25, silent=True, max_steps=10)


def fit(schedule="step", model=None, **kw):
    m, ds, pars = make_problem(schedule)
    model = model or m
    args = {"nepoch": 3, "nbatch_logical": NB_LOGICAL, "nbatch_physical": NB_PHYSICAL,
            "val_split": VAL_SPLIT, "silent": True, "seed": 5, "clip_grad_norm": 5.0, **kw}
    if "checkpoint" in args:
        args["checkpoint"] = str(args["checkpoint"])
    hist = go.fit(model, ds, go.LossType.CROSS_ENTROPY, pars, **args)
    return model, ds, hist


def params(model):
    return [p.data.copy() for p in model.parameters()]


def held_out(ds, plan_):
    """The held-out datapoints in the order fit validates them (shards of 2)."""
    shards = ds.permutation[plan_.idata_split // ds.ndata_shard:]
    rows = (shards[:, None] * ds.ndata_shard + np.arange(ds.ndata_shard)).reshape(-1)
    return ds.data[rows], ds.labels[rows]


def test_max_steps_stops_inside_an_epoch_and_records_it(tmp_path):
    _model, _, hist = fit(max_steps=13, checkpoint=tmp_path / "c.npz")
    _, _, hist_b = fit(nepoch=2)
    assert [e.epoch for e in hist] == [1, 2]
    assert astuple(hist[0])[:9] == astuple(hist_b[0])[:9]
    # the cut epoch trained 4 of its 9 steps: 8 physical batches of 4 datapoints
    assert math.isfinite(hist[1].train_loss) and math.isfinite(hist[1].val_loss)
    assert hist[1].train_loss != hist_b[1].train_loss
    sd = load_state(tmp_path / "c.npz")
    assert sd["iter"] == 14 and sd["fit.train_totals"][:2].tolist() == [32, 8]
    assert sd["fit.history"].shape == (1, HISTORY_COLUMNS)   # the cut epoch is not done yet


def test_eval_every_records_equal_evaluate_and_leave_training_unchanged():
    p = plan(eval_every=4)
    model, _ds, hist = fit(eval_every=4)
    assert [(e.step, e.epoch) for e in hist.evaluations] == \
        [(4, 1), (8, 1), (12, 2), (16, 2), (20, 3), (24, 3)]
    # evaluating changed nothing in the training
    plain, _, plain_hist = fit()
    for a, b in zip(params(model), params(plain)):
        assert a.tobytes() == b.tobytes()
    assert [astuple(e)[:9] for e in hist] == [astuple(e)[:9] for e in plain_hist]
    # each record is evaluate() on the held-out part after that many steps
    for rec in hist.evaluations:
        at, ds_at, hist_at = fit(max_steps=rec.step)
        x, y = held_out(ds_at, p)
        res = go.evaluate(at, (x, y), go.LossType.CROSS_ENTROPY, batch_size=NB_PHYSICAL)
        assert rec.val_loss == pytest.approx(res.loss()[0], rel=1e-6), rec
        assert rec.val_loss_unc == pytest.approx(res.loss()[1], rel=1e-5), rec
        assert rec.val_accuracy == res.accuracy()[0], rec
        assert rec.train_loss == hist_at[-1].train_loss, rec
        assert rec.val_loss == hist_at[-1].val_loss, rec   # the cut epoch's validation


def test_an_evaluation_at_an_epochs_end_is_its_validation():
    _, _, hist = fit(eval_every=9)
    assert [e.step for e in hist.evaluations] == [9, 18, 27]
    for rec, ep in zip(hist.evaluations, hist):
        assert (rec.val_loss, rec.val_accuracy, rec.train_loss) == \
            (ep.val_loss, ep.val_accuracy, ep.train_loss)


# what the machine decides, not the training: times, and the BLAS threads that
# GGMLOPT_BLAS_THREADS=auto picks from the cores idle at the epoch's start
_MACHINE_FIELDS = ("seconds", "blas_threads", "exchange_wait_s")


def same_history(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for f in fields(x):
            if f.name not in _MACHINE_FIELDS:
                assert getattr(x, f.name) == getattr(y, f.name), f.name
    np.testing.assert_array_equal([astuple(e) for e in a.evaluations],  # NaN == NaN here
                                  [astuple(e) for e in b.evaluations])


def same_checkpoint(path_a, path_b):
    a, b = load_state(path_a), load_state(path_b)
    assert set(a) == set(b)
    for key in a:
        va, vb = a[key], b[key]
        if key == "fit.history":
            machine = [9, 10, 11]  # _MACHINE_FIELDS' columns
            va, vb = np.delete(va, machine, axis=1), np.delete(vb, machine, axis=1)
        if isinstance(va, np.ndarray):
            assert va.dtype == vb.dtype and va.tobytes() == vb.tobytes(), key
        else:
            assert va == vb, key


class Interrupt(Exception):
    pass


class InterruptAt:
    """A step schedule that raises when the optimizer reaches step `at`."""

    unit = "step"

    def __init__(self, sched, at):
        self.sched, self.at = sched, at

    def __call__(self, ctx):
        if ctx.iter == self.at:
            raise Interrupt
        return self.sched(ctx if self.sched.unit == "step" else ctx.get_opt_pars_ud)


def dropout_model():
    return go.nn.Sequential(go.nn.Linear(7, 9, rng=1), go.nn.ReLU(), go.nn.Dropout(0.3),
                            go.nn.Linear(9, 3, rng=2))


@pytest.mark.parametrize("case", ["step-schedule", "epoch-schedule", "dropout", "sgd"])
def test_resume_inside_an_epoch_is_bit_exact(tmp_path, case):
    kw = {"eval_every": 2, "checkpoint_every": 4}
    schedule = "epoch" if case == "epoch-schedule" else "step"
    if case == "sgd":
        kw["optimizer"] = go.OptimizerType.SGD
    make = dropout_model if case == "dropout" else (lambda: None)
    straight, ds_a, hist_a = fit(schedule, make(), checkpoint=tmp_path / "a.npz", **kw)

    # stopped by max_steps at step 13 (step 4 of epoch 2): the checkpoint is inside it
    fit(schedule, make(), checkpoint=tmp_path / "b.npz", max_steps=13, **kw)
    sd = load_state(tmp_path / "b.npz")
    assert (sd["fit.epoch"], sd["fit.step"], sd["iter"], sd["opt_i"]) == (1, 4, 14, 0)
    assert sd["fit.evals"].shape == (6, 7)   # steps 2 .. 12
    resumed, ds_b, hist_b = fit(schedule, make(), checkpoint=tmp_path / "b.npz", resume=True,
                                **kw)
    for a, b in zip(params(straight), params(resumed)):
        assert a.tobytes() == b.tobytes()
    assert np.array_equal(ds_a.permutation, ds_b.permutation)
    same_history(hist_a, hist_b)
    same_checkpoint(tmp_path / "a.npz", tmp_path / "b.npz")

    # interrupted by an exception at step 15: resumed from the checkpoint of step 12
    m, ds, pars = make_problem(schedule)
    model = make() or m
    with pytest.raises(Interrupt):
        go.fit(model, ds, go.LossType.CROSS_ENTROPY, InterruptAt(pars, 15), nepoch=3,
               nbatch_logical=8, nbatch_physical=4, val_split=0.25, silent=True, seed=5,
               clip_grad_norm=5.0, checkpoint=str(tmp_path / "c.npz"), **kw)
    sd = load_state(tmp_path / "c.npz")
    assert (sd["fit.epoch"], sd["fit.step"], sd["iter"]) == (1, 3, 13)
    resumed, _, hist_c = fit(schedule, make(), checkpoint=tmp_path / "c.npz", resume=True,
                             **kw)
    for a, b in zip(params(straight), params(resumed)):
        assert a.tobytes() == b.tobytes()
    same_history(hist_a, hist_c)
    same_checkpoint(tmp_path / "a.npz", tmp_path / "c.npz")
    # the run trained: the test can fail
    fresh = make() or make_problem(schedule)[0]
    assert not np.array_equal(params(fresh)[0], params(straight)[0])


def test_resuming_with_another_max_steps(tmp_path):
    # 13 steps, then up to 20, then to the end: the 27-step run
    fit(checkpoint=tmp_path / "b.npz", max_steps=13)
    _, _, hist = fit(checkpoint=tmp_path / "b.npz", resume=True, max_steps=20)
    assert [e.epoch for e in hist] == [1, 2, 3]
    sd = load_state(tmp_path / "b.npz")
    assert (sd["fit.epoch"], sd["fit.step"], sd["iter"]) == (2, 2, 21)
    model, _, hist = fit(checkpoint=tmp_path / "b.npz", resume=True)
    straight, _, hist_a = fit()
    for a, b in zip(params(straight), params(model)):
        assert a.tobytes() == b.tobytes()
    same_history(hist_a, hist)
    with pytest.raises(ValueError, match="max_steps: the checkpoint .* 27 optimizer steps"):
        fit(checkpoint=tmp_path / "b.npz", resume=True, max_steps=20)
    fit(checkpoint=tmp_path / "d.npz", max_steps=13)
    with pytest.raises(ValueError, match="already trained 1 epochs and 4 steps of epoch 2"):
        fit(checkpoint=tmp_path / "d.npz", resume=True, nepoch=1)


def test_checkpoints_of_before_still_load(tmp_path):
    # a fit without the new arguments writes the entries it always wrote
    path = tmp_path / "old.npz"
    fit(nepoch=1, checkpoint=path)
    sd = load_state(path)
    assert not {"fit.step", "fit.train_totals", "fit.evals"} & set(sd)
    # ... and such a file resumes into a fit that evaluates and checkpoints by steps
    model, _, hist = fit(checkpoint=path, resume=True, eval_every=4, checkpoint_every=5)
    assert [e.step for e in hist.evaluations] == [12, 16, 20, 24]
    straight, _, _ = fit()
    for a, b in zip(params(straight), params(model)):
        assert a.tobytes() == b.tobytes()
    # a file from before EpochStats.blas_threads (10 history columns) too
    sd = load_state(path)
    sd["fit.history"] = sd["fit.history"][:, :10]
    for key in ("fit.evals",):
        sd.pop(key, None)
    sd["fit.epoch"] = 3
    go.checkpoint.save_state(path, sd)
    _, _, hist = fit(checkpoint=path, resume=True)
    assert len(hist) == 3 and hist[0].blas_threads is None


def test_a_bad_mid_epoch_entry_is_refused(tmp_path):
    path = tmp_path / "b.npz"
    fit(checkpoint=path, max_steps=13)
    sd = load_state(path)
    sd["fit.step"] = 9
    go.checkpoint.save_state(path, sd)
    with pytest.raises(ValueError, match="fit.step"):
        fit(checkpoint=path, resume=True)
    sd["fit.step"] = 4
    del sd["fit.train_totals"]
    go.checkpoint.save_state(path, sd)
    with pytest.raises(ValueError, match="fit.train_totals"):
        fit(checkpoint=path, resume=True)


def test_a_mid_epoch_checkpoint_of_six_totals_resumes_as_before(tmp_path):
    """Files written before the batches without a labelled position were counted
    hold six training totals: they resume as if that count were 0."""
    path = tmp_path / "six.npz"
    fit(checkpoint=path, max_steps=13)
    sd = load_state(path)
    assert sd["fit.train_totals"].shape == (7,) and sd["fit.train_totals"][6] == 0
    _, _, want = fit(checkpoint=path, resume=True, nepoch=3)
    fit(checkpoint=path, max_steps=13)
    sd = load_state(path)
    sd["fit.train_totals"] = sd["fit.train_totals"][:6]
    go.checkpoint.save_state(path, sd)
    _, _, got = fit(checkpoint=path, resume=True, nepoch=3)
    assert [astuple(e)[:9] for e in got] == [astuple(e)[:9] for e in want]
    sd["fit.train_totals"] = sd["fit.train_totals"][:5]
    go.checkpoint.save_state(path, sd)
    with pytest.raises(ValueError, match=r"fit.train_totals: expected shape \(7,\)"):
        fit(checkpoint=path, resume=True, nepoch=3)


def test_progress_output_names_the_evaluations(capsys):
    fit(eval_every=4, silent=False, nepoch=1)
    err = capsys.readouterr().err
    assert "fit: step 000004: val loss=" in err and "fit: step 000008: val loss=" in err
    assert err.count("fit: epoch 0001/0001:") == 1


# ---- many processes (a communicator of threads, as tests/test_distributed.py) ----------

def dist_fit(comm, checkpoint=None, part=False, **kw):
    """dist_problem's fit (4 optimizer steps an epoch, 6 physical batches each)."""
    from dist_problem import make_problem as dist_problem

    model, ds = dist_problem(0)
    extra = {} if comm is None else {"comm": comm}
    if part:
        n = ds.ndata // comm.Get_size()
        rows = slice(comm.Get_rank() * n, (comm.Get_rank() + 1) * n)
        ds = go.Dataset.from_arrays(ds.data[rows], ds.labels[rows], ndata_shard=2)
        extra["dataset_is_part"] = True
    pars = go.OptimizerParams(adamw=go.AdamWParams(alpha=0.01))
    hist = go.fit(model, ds, go.LossType.CROSS_ENTROPY, lambda epoch: pars, nepoch=3,
                  nbatch_logical=60, nbatch_physical=10, val_split=0.2, silent=True, seed=0,
                  clip_grad_norm=0.3, checkpoint=None if checkpoint is None else str(checkpoint),
                  **extra, **kw)
    return np.concatenate([p.data.ravel() for p in model.parameters()]), hist


def eval_array(hist):
    return np.array([astuple(e) for e in hist.evaluations])


@pytest.mark.filterwarnings("ignore:val_split")
@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_eval_every_and_max_steps_over_ranks_equal_one_process(nranks):
    from thread_comm import results

    ref, ref_hist = dist_fit(None, eval_every=3, max_steps=10)
    assert [e.step for e in ref_hist.evaluations] == [3, 6, 9]
    outs = results(nranks, lambda c: dist_fit(c, eval_every=3, max_steps=10))
    for flat, hist in outs:
        assert flat.tobytes() == outs[0][0].tobytes()
        np.testing.assert_allclose(flat, ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(eval_array(hist), eval_array(ref_hist), rtol=1e-5,
                                   atol=1e-7)
        assert [e.epoch for e in hist] == [1, 2, 3]


@pytest.mark.filterwarnings("ignore:val_split")
@pytest.mark.parametrize("part", [False, True])
def test_resume_inside_an_epoch_over_ranks_is_bit_exact(tmp_path, part):
    from thread_comm import results

    kw = {"eval_every": 2, "checkpoint_every": 3, "part": part}
    straight = results(2, lambda c: dist_fit(c, tmp_path / "a.npz", **kw))
    results(2, lambda c: dist_fit(c, tmp_path / "b.npz", max_steps=7, **kw))
    sd = load_state(tmp_path / "b.npz")
    assert (sd["fit.epoch"], sd["fit.step"]) == (1, 3)
    resumed = results(2, lambda c: dist_fit(c, tmp_path / "b.npz", resume=True, **kw))
    for (a, ha), (b, hb) in zip(straight, resumed):
        assert a.tobytes() == b.tobytes()
        same_history(ha, hb)
    same_checkpoint(tmp_path / "a.npz", tmp_path / "b.npz")


def test_resuming_a_run_that_max_steps_finished_trains_nothing(tmp_path):
    model, _, hist = fit(checkpoint=tmp_path / "b.npz", max_steps=12, eval_every=4)
    again, _, hist_again = fit(checkpoint=tmp_path / "b.npz", max_steps=12, eval_every=4,
                               resume=True)
    for a, b in zip(params(model), params(again)):
        assert a.tobytes() == b.tobytes()
    same_history(hist, hist_again)
    assert [e.step for e in hist_again.evaluations] == [4, 8, 12]
