"""fit's checks before anything runs: the split, the schedule's length, the
checkpoint's directory and identity; the warnings for a rounded split and an
overwritten checkpoint."""
import warnings

import numpy as np
import pytest

import ggmlopt as go

LT = go.LossType


def problem(ndata=120, ndata_shard=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ndata, 6)).astype(np.float32)
    y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, ndata)]
    ds = go.Dataset.from_arrays(x, y, ndata_shard=ndata_shard)
    model = go.nn.Sequential(go.nn.Linear(6, 5, rng=1), go.nn.ReLU(), go.nn.Linear(5, 3, rng=2))
    return model, ds


def untouched(model, ds, weights):
    for p, w in zip(model.parameters(), weights):
        np.testing.assert_array_equal(p.data, w)
    np.testing.assert_array_equal(ds.permutation, np.arange(ds.nshards))


@pytest.mark.parametrize("nbatch_logical,val_split", [(120, 0.1), (60, 0.6), (40, 0.9),
                                                      (120, 0.5)])
def test_split_without_a_training_batch_raises_before_anything(nbatch_logical, val_split):
    model, ds = problem()
    w = [p.data.copy() for p in model.parameters()]
    nbatches = 120 // nbatch_logical
    with pytest.raises(ValueError, match=rf"val_split: {val_split} of {nbatches} logical batch.*"
                                         rf"ndata=120, nbatch_logical={nbatch_logical}.*"
                                         "leaves no logical batch to train"):
        go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=nbatch_logical,
               val_split=val_split, silent=True)
    untouched(model, ds, w)


def test_rounded_split_warns_when_off_by_more_than_half_a_batch():
    model, ds = problem()
    # 0.1 of 4 logical batches of 30: floor(0.9 * 4) = 3 train, 30 validate instead of 12
    with pytest.warns(UserWarning, match=r"val_split: 0.1 of ndata=120 asks for 12 validation "
                                         r"datapoints; .* of 30 it is 30"):
        hist = go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=30, val_split=0.1,
                      silent=True)
    assert (hist.val_split, hist.ndata_train, hist.ndata_val) == (0.1, 90, 30)


@pytest.mark.parametrize("nbatch_logical,val_split,ntrain", [(30, 0.25, 90), (20, 0.1, 100),
                                                             (20, 0.0, 120), (10, 0.13, 100)])
def test_split_close_to_the_request_is_silent(nbatch_logical, val_split, ntrain):
    model, ds = problem()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hist = go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=nbatch_logical,
                      val_split=val_split, silent=True)
    assert (hist.ndata_train, hist.ndata_val) == (ntrain, 120 - ntrain)
    assert abs(hist.ndata_val - val_split * 120) <= nbatch_logical / 2


@pytest.mark.parametrize("sched,match", [
    (go.schedules.Cosine(total=2), r"fails at epoch 3 \(nepoch=3\).*past total=2"),
    (go.schedules.Linear(total=2, end_factor=0.0), r"fails at epoch 3"),
    (go.schedules.Cosine(total=10, unit="step"),
     r"fails at step 12 \(nepoch=3 x 4 optimizer steps\).*past total=10"),
])
def test_schedule_shorter_than_the_fit_raises_before_the_first_epoch(sched, match):
    model, ds = problem()
    w = [p.data.copy() for p in model.parameters()]
    with pytest.raises(ValueError, match="get_opt_pars: the schedule .*" + match):
        go.fit(model, ds, LT.CROSS_ENTROPY, get_opt_pars=sched, nepoch=3, nbatch_logical=30,
               silent=True)
    untouched(model, ds, w)


@pytest.mark.parametrize("sched", [go.schedules.Cosine(total=3),
                                   go.schedules.Cosine(total=12, unit="step"),
                                   go.schedules.Cosine(total=1, min_factor=0.5)])
def test_schedule_long_enough_runs(sched):
    model, ds = problem()
    hist = go.fit(model, ds, LT.CROSS_ENTROPY, get_opt_pars=sched, nepoch=3, nbatch_logical=30,
                  silent=True)
    assert len(hist) == 3


def test_checkpoint_in_a_missing_directory_raises_up_front(tmp_path):
    model, ds = problem()
    w = [p.data.copy() for p in model.parameters()]
    path = tmp_path / "no" / "such" / "run.npz"
    with pytest.raises(ValueError, match=r"checkpoint: the directory .*no/such.* does not exist"):
        go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=30, silent=True, checkpoint=path)
    untouched(model, ds, w)
    assert not (tmp_path / "no").exists()


def test_relative_checkpoint_lands_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, ds = problem()
    go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=30, silent=True, checkpoint="x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_existing_checkpoint_without_resume_warns(tmp_path):
    path = tmp_path / "run.npz"
    model, ds = problem()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a new file: no warning
        go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=30, silent=True, checkpoint=path)
    model, ds = problem()
    with pytest.warns(UserWarning, match="run.npz' exists and will be overwritten.*resume=True"):
        go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=30, silent=True, checkpoint=path)
    model, ds = problem()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # resume=True: no warning
        go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=30, nepoch=2, silent=True,
               checkpoint=path, resume=True)


@pytest.mark.parametrize("change,match", [
    ({"seed": 4}, r"fit.seed: the checkpoint was made with seed=3, this fit has seed=4"),
    ({"seed": None}, r"seed=3, this fit has seed=None"),
    ({"seed": np.random.default_rng(3)}, r"this fit has seed=a numpy Generator"),
    ({"ndata_shard": 5}, r"fit.ndata_shard: the checkpoint was made with ndata_shard=2"),
    # same sizes, other values: told apart by the data's CRC-32
    ({"data_seed": 9}, r"fit.data: the checkpoint was made with other data of the same sizes"),
    ({}, None),   # the same data in a new Dataset: resumes
])
def test_resume_refuses_another_run(tmp_path, change, match):
    path = tmp_path / "run.npz"
    model, ds = problem()
    go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=30, silent=True, checkpoint=path,
           seed=3)
    before = path.read_bytes()
    model, ds = problem(ndata_shard=change.get("ndata_shard", 2), seed=change.get("data_seed", 0))
    w = [p.data.copy() for p in model.parameters()]
    seed = change.get("seed", 3)
    if match is None:
        hist = go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=30, nepoch=2, silent=True,
                      checkpoint=path, resume=True, seed=seed)
        assert len(hist) == 2
        return
    # one "checkpoint: 'path': " prefix, then the entry that differs
    full = r"^checkpoint: '[^']*': (?!.*checkpoint: ).*" + match + ".*resume only the same run"
    with pytest.raises(ValueError, match=full):
        go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=30, nepoch=2, silent=True,
               checkpoint=path, resume=True, seed=seed)
    untouched(model, ds, w)
    assert path.read_bytes() == before


def test_resume_refuses_another_ndata(tmp_path):
    path = tmp_path / "run.npz"
    model, ds = problem()
    go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=30, silent=True, checkpoint=path)
    model, ds = problem(ndata=90)
    with pytest.raises(ValueError, match="fit.ndata: the checkpoint was made with ndata=120"):
        go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=30, nepoch=2, silent=True,
               checkpoint=path, resume=True)


def test_checkpoint_without_the_run_entries_still_resumes(tmp_path):
    """Files written before fit stored ne_datapoint, ne_label, ndata_shard and seed."""
    path = tmp_path / "run.npz"
    model, ds = problem()
    go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=30, silent=True, checkpoint=path, seed=1)
    sd = go.checkpoint.load_state(path)
    for key in ("fit.ne_datapoint", "fit.ne_label", "fit.ndata_shard", "fit.seed"):
        assert key in sd
        del sd[key]
    go.checkpoint.save_state(path, sd)
    model, ds = problem()
    hist = go.fit(model, ds, LT.CROSS_ENTROPY, nbatch_logical=30, nepoch=2, silent=True,
                  checkpoint=path, resume=True, seed=2)
    assert len(hist) == 2


# ---- token datasets with nothing to learn -------------------------------------------

def _token_problem(labels):
    from ggmlopt.models import Llama, LlamaConfig
    rng = np.random.default_rng(0)
    x = rng.integers(0, 11, (8, 6)).astype(np.int32)
    ds = go.Dataset.from_arrays(x, labels)
    model = Llama(LlamaConfig(vocab_size=11, dim=8, n_layers=1, n_heads=2, max_seq_len=6),
                  seed=0)
    return model, ds


def test_a_token_dataset_without_a_labelled_position_is_refused_before_training():
    model, ds = _token_problem(np.full((8, 6), -1, np.int32))
    weights = [p.data.copy() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"dataset: every one of its 48 labels is -1"):
        go.fit(model, ds, "cross_entropy", nbatch_logical=4, silent=True)
    untouched(model, ds, weights)
    # evaluating such a dataset is no error: nothing trains
    ctx = go.OptContext(model, batch_size=4, ne_datapoint=6, loss_type=LT.CROSS_ENTROPY,
                        build_type=go.BuildType.FORWARD, class_labels=True)
    go.epoch(ctx, ds, None, go.Result(), 0)


def test_a_physical_batch_without_a_labelled_position_warns():
    labels = np.random.default_rng(1).integers(0, 11, (8, 6)).astype(np.int32)
    labels[:4] = -1  # the first physical batch of 4 has nothing labelled
    model, ds = _token_problem(labels)
    with pytest.warns(UserWarning, match="no labelled position"):
        go.fit(model, ds, "cross_entropy", nbatch_logical=8, nbatch_physical=4, silent=True)
    labels[:4] = 0
    model, ds = _token_problem(labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        go.fit(model, ds, "cross_entropy", nbatch_logical=8, nbatch_physical=4, silent=True)


@pytest.mark.parametrize("bad", [11, -12])
def test_a_token_id_outside_the_vocabulary_is_refused_before_training(bad):
    # found before the first step, not when its batch comes after steps changed the model
    labels = np.random.default_rng(1).integers(0, 11, (8, 6)).astype(np.int32)
    model, ds = _token_problem(labels)
    ds.data[7, 4] = bad   # the last window; -12 marks a document starting with id 11
    weights = [p.data.copy() for p in model.parameters()]
    with pytest.raises(IndexError, match=rf"dataset: token id {bad} at \(7, 4\) is outside "
                                         r"the vocabulary \[0, 11\)"):
        go.fit(model, ds, "cross_entropy", nbatch_logical=4, silent=True)
    untouched(model, ds, weights)
    ds.data[7, 4] = -11   # a packed document's first token, id 10: read
    go.fit(model, ds, "cross_entropy", nbatch_logical=4, silent=True)


def test_a_refused_get_opt_pars_leaves_the_dataset_in_its_order():
    # a plain function is first called at the first optimizer step, after fit's
    # shuffle: its refusal names it, and the model and the order stay as they were
    model, ds = problem()
    weights = [p.data.copy() for p in model.parameters()]

    def bad(epoch):
        return go.OptimizerParams(adamw=go.AdamWParams(alpha=-1.0))

    with pytest.raises(ValueError, match=r"get_opt_pars: .*step 1.*adamw.alpha: expected > 0"):
        go.fit(model, ds, go.LossType.CROSS_ENTROPY, bad, nbatch_logical=20, silent=True)
    untouched(model, ds, weights)
