"""fit(checkpoint=..., resume=True): training 4 epochs straight, or 2 epochs in one
process and 2 more in another, gives bit-for-bit the same parameters."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ggmlopt as go

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
from checkpoint_problem import make_problem, run


def _in_subprocess(code):
    prelude = f"import sys; sys.path.insert(0, {TESTS!r})\nfrom checkpoint_problem import *\n"
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("optimizer,schedule", [("ADAMW", "epoch"), ("SGD", "step")])
def test_resume_in_another_process_is_bit_exact(tmp_path, optimizer, schedule):
    ckpt = tmp_path / "run.npz"
    out = tmp_path / "resumed.npz"
    # process 1: two epochs, then it exits
    _in_subprocess(f"run({optimizer!r}, {schedule!r}, 2, checkpoint={str(ckpt)!r})")
    after2 = go.checkpoint.load_state(ckpt)
    assert after2["fit.epoch"] == 2 and after2["fit.history"].shape == (2, 12)
    # process 2: the same call asking for 4 epochs resumes after epoch 2
    _in_subprocess(f"""
        model, ds, hist = run({optimizer!r}, {schedule!r}, 4, checkpoint={str(ckpt)!r},
                              resume=True)
        np.savez({str(out)!r}, *[p.data for p in model.parameters()],
                 perm=ds.permutation, loss=np.array(hist.train_loss),
                 val=np.array(hist.val_loss), epochs=np.array([e.epoch for e in hist]))
    """)
    model, ds, hist = run(optimizer, schedule, 4)
    with np.load(out) as got:
        for i, p in enumerate(model.parameters()):
            assert got[f"arr_{i}"].tobytes() == p.data.tobytes(), f"parameter {i}"
        assert np.array_equal(got["perm"], ds.permutation)
        # the resumed History covers all four epochs, with the straight run's numbers
        assert list(got["epochs"]) == [1, 2, 3, 4]
        assert got["loss"].tobytes() == np.array(hist.train_loss).tobytes()
        assert got["val"].tobytes() == np.array(hist.val_loss).tobytes()
    final = go.checkpoint.load_state(ckpt)
    assert final["fit.epoch"] == 4
    assert final["iter"] == 1 + 4 * 9  # 72 training datapoints / 8 per step, 4 epochs
    # the straight run really moved the parameters (the test can fail)
    fresh, _, _ = make_problem(schedule)
    assert not np.array_equal(fresh.parameters()[0].data, model.parameters()[0].data)


def test_resume_in_process_matches_and_checkpoint_is_every_epoch(tmp_path):
    ckpt = tmp_path / "c.npz"
    run("ADAMW", "epoch", 1, checkpoint=ckpt)
    assert go.checkpoint.load_state(ckpt)["fit.epoch"] == 1
    _, _, _ = run("ADAMW", "epoch", 3, checkpoint=ckpt, resume=True)
    model_b, _, hist_b = run("ADAMW", "epoch", 3)
    sd = go.checkpoint.load_state(ckpt)
    assert sd["fit.epoch"] == 3
    for i, p in enumerate(model_b.parameters()):
        assert np.array_equal(sd[f"param.{i}"], p.data)
    # resuming a finished run trains nothing and returns the saved History
    model_c, _, hist_c = run("ADAMW", "epoch", 3, checkpoint=ckpt, resume=True)
    assert [e.train_loss for e in hist_c] == hist_b.train_loss
    for p, q in zip(model_c.parameters(), model_b.parameters()):
        assert np.array_equal(p.data, q.data)


def test_resume_without_file_starts_fresh_and_without_resume_overwrites(tmp_path):
    ckpt = tmp_path / "new.npz"
    model_a, _, _ = run("SGD", "epoch", 2, checkpoint=ckpt, resume=True)
    model_b, _, _ = run("SGD", "epoch", 2)
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert np.array_equal(p.data, q.data)
    with pytest.warns(UserWarning, match="exists and will be overwritten"):
        run("SGD", "epoch", 1, checkpoint=ckpt)  # resume=False: starts over and overwrites
    assert go.checkpoint.load_state(ckpt)["fit.epoch"] == 1


def test_fit_checkpoint_errors(tmp_path):
    ckpt = tmp_path / "c.npz"
    run("ADAMW", "epoch", 2, checkpoint=ckpt)
    with pytest.raises(ValueError, match="resume: needs checkpoint"):
        run("ADAMW", "epoch", 2, resume=True)
    model, ds, pars = make_problem("epoch")
    with pytest.raises(TypeError, match="resume"):
        go.fit(model, ds, go.LossType.CROSS_ENTROPY, nbatch_logical=8, silent=True,
               checkpoint=ckpt, resume=1)
    with pytest.raises(ValueError, match="nepoch.*already trained 2"):
        run("ADAMW", "epoch", 1, checkpoint=ckpt, resume=True)
    # another batch configuration, another optimizer, another loss: refused, file kept
    before = ckpt.read_bytes()
    model, ds, pars = make_problem("epoch")
    with pytest.raises(ValueError, match="nbatch_logical"):
        go.fit(model, ds, go.LossType.CROSS_ENTROPY, get_opt_pars=pars, nepoch=3,
               nbatch_logical=16, nbatch_physical=4, val_split=0.25, silent=True,
               checkpoint=ckpt, resume=True)
    with pytest.raises(ValueError, match="optimizer"):
        run("SGD", "epoch", 3, checkpoint=ckpt, resume=True)
    model, ds, pars = make_problem("epoch")
    with pytest.raises(ValueError, match="loss_type"):
        go.fit(model, ds, go.LossType.MEAN_SQUARED_ERROR, get_opt_pars=pars, nepoch=3,
               nbatch_logical=8, nbatch_physical=4, val_split=0.25, silent=True,
               checkpoint=ckpt, resume=True)
    assert ckpt.read_bytes() == before
    with pytest.raises(ValueError, match="directory"):
        run("ADAMW", "epoch", 1, checkpoint=tmp_path)
    with pytest.raises(TypeError, match="checkpoint"):
        run("ADAMW", "epoch", 1, checkpoint=3.5)
    # a corrupted checkpoint is an error, not a silent fresh start
    ckpt.write_bytes(before[: len(before) // 2])
    with pytest.raises(ValueError, match="not a ggmlopt checkpoint"):
        run("ADAMW", "epoch", 3, checkpoint=ckpt, resume=True)
    # a context checkpoint (ctx.save) has no fit entries
    plain = tmp_path / "plain.npz"
    model, ds, pars = make_problem("epoch")
    go.OptContext(model, batch_size=4, ne_datapoint=7, loss_type=go.LossType.CROSS_ENTROPY,
                  opt_period=2).save(plain)
    with pytest.raises(ValueError, match="not written by fit"):
        run("ADAMW", "epoch", 3, checkpoint=plain, resume=True)


def test_a_fit_checkpoint_loads_as_a_context(tmp_path):
    ckpt = tmp_path / "c.npz"
    model, _, _ = run("ADAMW", "epoch", 2, checkpoint=ckpt)
    fresh, _, _ = make_problem("epoch")
    ctx = go.OptContext.load(ckpt, fresh)
    assert ctx.iter == 1 + 2 * 9 and ctx.batch_size == 4 and ctx.opt_period == 2
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert p.data.tobytes() == q.data.tobytes()


def test_a_resume_inside_the_warmup_with_another_length_says_so(tmp_path):
    """At a warmup's step t the rate is t / warmup whatever the run's length: the
    checkpoint's schedule tells a longer run from the one that wrote it."""
    import warnings

    def fit(total, max_steps, resume):
        model, ds, _ = make_problem("step")
        base = go.OptimizerParams(go.AdamWParams(alpha=0.01))
        return go.fit(model, ds, go.LossType.CROSS_ENTROPY,
                      get_opt_pars=go.schedules.WarmupCosine(4, total, base=base, unit="step"),
                      nepoch=None, max_steps=max_steps, nbatch_logical=8, nbatch_physical=4,
                      silent=True, seed=5, checkpoint=tmp_path / "w.npz", resume=resume)

    fit(12, 3, False)   # stopped inside the warmup
    with pytest.warns(UserWarning, match=r"resume: .*its schedule was WarmupCosine\(unit='step', "
                                         r"total=12, warmup=4, .*this fit's is WarmupCosine\("
                                         r"unit='step', total=30"):
        fit(30, 30, True)
    os.remove(tmp_path / "w.npz")
    fit(12, 3, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the same run goes on: nothing to say
        fit(12, 12, True)


@pytest.mark.parametrize("unit", ["step", "epoch"])
def test_a_resume_whose_schedule_moved_says_so(tmp_path, unit):
    """A schedule that gives the checkpoint's last step other parameters than it ran
    with (another learning rate, warmup or length) warns; the same one does not."""
    import warnings

    def fit(schedule, nepoch, resume):
        model, ds, _ = make_problem(unit)
        return go.fit(model, ds, go.LossType.CROSS_ENTROPY, get_opt_pars=schedule,
                      nepoch=nepoch, nbatch_logical=8, nbatch_physical=4, silent=True, seed=5,
                      checkpoint=tmp_path / f"{unit}.npz", resume=resume)

    def cosine(total, alpha=0.01):
        base = go.OptimizerParams(go.AdamWParams(alpha=alpha))
        return go.schedules.Cosine(total=total, min_factor=0.1, unit=unit, base=base)

    span = {"step": 24, "epoch": 2}   # two epochs: 96 datapoints, 8 a step
    fit(cosine(2 * span[unit]), 2, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the same schedule: nothing to say
        fit(cosine(2 * span[unit]), 3, True)
    last = {"step": "step 24", "epoch": "epoch 2"}[unit]
    for moved in (cosine(4 * span[unit]), cosine(2 * span[unit], alpha=0.02)):
        os.remove(tmp_path / f"{unit}.npz")
        fit(cosine(2 * span[unit]), 2, False)   # the first run again
        with pytest.warns(UserWarning, match=rf"resume: .*its last {unit} \({last}\) ran "
                                             r"with adamw\.alpha [0-9.e-]+, this fit's "
                                             r"schedule gives"):
            fit(moved, 3, True)


def _fit_with(tmp_path, get_opt_pars, nepoch, resume):
    model, ds, _ = make_problem("epoch")
    return go.fit(model, ds, go.LossType.CROSS_ENTROPY, get_opt_pars=get_opt_pars,
                  nepoch=nepoch, nbatch_logical=8, nbatch_physical=4, silent=True, seed=5,
                  checkpoint=tmp_path / "f.npz", resume=resume)


def _alpha(alpha):
    return lambda epoch: go.OptimizerParams(go.AdamWParams(alpha=alpha))


@pytest.mark.parametrize("first, then, said", [
    (_alpha(3e-3), go.default_optimizer_params,
     (r"its last epoch \(epoch 2\) ran with adamw\.alpha 0\.003, this fit's get_opt_pars "
      r"gives 0\.001")),
    (_alpha(3e-3), _alpha(1e-3), r"adamw\.alpha 0\.003, this fit's get_opt_pars gives 0\.001"),
    (go.schedules.Cosine(total=4, min_factor=0.5), go.default_optimizer_params,
     (r"its last epoch \(epoch 2\) ran with adamw\.alpha 0\.000926777, this fit's "
      r"get_opt_pars gives 0\.001")),
    (go.default_optimizer_params, go.schedules.Cosine(total=4, min_factor=0.5),
     (r"its last epoch \(epoch 2\) ran with adamw\.alpha 0\.001, this fit's schedule "
      r"gives 0\.000926777")),
])
def test_a_resume_with_other_optimizer_parameters_says_so(tmp_path, first, then, said):
    """Not only a ggmlopt.schedules schedule: a function (the defaults among them)
    that gives the last epoch other parameters than it ran with warns, as does a
    schedule resumed by a function or the other way round."""
    _fit_with(tmp_path, first, 2, False)
    with pytest.warns(UserWarning, match="resume: .*" + said):
        _fit_with(tmp_path, then, 3, True)


@pytest.mark.parametrize("get_opt_pars", [_alpha(3e-3), go.default_optimizer_params])
def test_a_resume_with_the_same_function_says_nothing(tmp_path, get_opt_pars):
    import warnings
    _fit_with(tmp_path, get_opt_pars, 2, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fit_with(tmp_path, get_opt_pars, 3, True)


@pytest.mark.parametrize("change", ["content", "order", "labels"])
def test_a_resume_on_other_data_of_the_same_sizes_is_refused(tmp_path, change):
    """The checkpoint's shard order and moments belong to its data: a dataset of
    the same sizes whose datapoints, labels or row order differ is another run,
    refused (naming fit.data) with the model and the dataset untouched; the same
    data in a new Dataset object resumes."""
    ckpt = tmp_path / "d.npz"
    run("ADAMW", "epoch", 2, checkpoint=ckpt)
    model, ds, pars = make_problem("epoch")
    x, y = np.array(ds.data), np.array(ds.labels)
    if change == "content":
        x[5, 3] += 1.0
    elif change == "order":
        x, y = x[::-1].copy(), y[::-1].copy()
    else:
        y[7] = np.roll(y[7], 1)
    other = go.Dataset.from_arrays(x, y, ndata_shard=2)
    before = [p.data.copy() for p in model.parameters()]
    order = other.permutation.copy()
    with pytest.raises(ValueError, match="fit.data: the checkpoint was made with other data"):
        go.fit(model, other, go.LossType.CROSS_ENTROPY, get_opt_pars=pars, nepoch=3,
               nbatch_logical=8, nbatch_physical=4, val_split=0.25, silent=True, seed=5,
               checkpoint=ckpt, resume=True, clip_grad_norm=5.0)
    assert all(np.array_equal(a, p.data) for a, p in zip(before, model.parameters()))
    assert np.array_equal(order, other.permutation)
    run("ADAMW", "epoch", 3, checkpoint=ckpt, resume=True)   # the same data, anew: resumes
