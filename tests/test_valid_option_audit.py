"""Audit of ``finetune --valid`` and fit(..., shuffle="train") under bad input: a
--valid file that is missing, empty, too long, of another form than --data,
smaller than a batch, under --out, and with --packing, --eval-every,
--max-steps and --keep-types; drop_last with shuffle="train".  (Two ranks:
tests/mpi/test_mpi_valid_audit.py.)"""
import json
import warnings

import numpy as np
import pytest

import ggmlopt as go


@pytest.fixture
def files(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    from finetune_files import write_files
    write_files(tmp_path)
    chats = [json.loads(line) for line in
             (tmp_path / "train.jsonl").read_text().splitlines()]

    def write(name, rows):
        with open(tmp_path / name, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    long_chat = {"messages": [{"role": "user", "content": "x" * 300},
                              {"role": "assistant", "content": "Quimby."}]}
    write("one.jsonl", chats[:1])
    write("three.jsonl", chats[:3])
    # the same lengths, other bytes: as many windows (packed too), other tokens
    write("swapped.jsonl", [{"messages": [{**m, "content": m["content"].swapcase()}
                                          for m in c["messages"]]} for c in chats[:3]])
    write("long.jsonl", [long_chat, long_chat])
    write("some_long.jsonl", chats[:2] + [long_chat])
    write("completions.jsonl", [{"prompt": "Capital of Zorblax?", "completion": " Quimby."}] * 3)
    (tmp_path / "empty.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    return tmp_path


BASE = ["-m", "base.gguf", "--data", "train.jsonl", "-c", "96", "--batch", "4",
        "--lora-rank", "4", "--silent"]


def refused(capsys, *args):
    """The command's error message for args (exit status 2, before training)."""
    from ggmlopt.finetune import main
    with pytest.raises(SystemExit) as e:
        main([*BASE, "--out", "a.gguf", *args])
    assert e.value.code == 2
    return capsys.readouterr().err


def test_a_missing_valid_file_is_refused_naming_it(files, capsys):
    # it was a FileNotFoundError traceback (exit status 1) after the model loaded
    err = refused(capsys, "--valid", "nowhere.jsonl")
    assert "--valid: no such file 'nowhere.jsonl'" in err, err
    assert not (files / "a.gguf").exists()


def test_out_over_the_valid_file_is_refused(files, capsys):
    # the adapter was written over the validation file after the training
    before = (files / "one.jsonl").read_bytes()
    err = refused(capsys, "--valid", "one.jsonl", "--out", "one.jsonl")
    assert "--out: 'one.jsonl' is also --valid's file" in err, err
    assert (files / "one.jsonl").read_bytes() == before


@pytest.mark.parametrize("name,extra,words", [
    ("long.jsonl", (), "conversations[0]: 349 tokens"),
    ("some_long.jsonl", (), "(1 of 3 examples are too long); raise --ctx, or pass --too-long"),
    ("long.jsonl", ("--too-long", "drop"), "no example left"),
    ("empty.jsonl", (), "holds no example"),
])
def test_a_bad_valid_file_is_refused_naming_valid(files, capsys, name, extra, words):
    # the library's message said neither --valid nor the file (was it --data's?)
    err = refused(capsys, "--valid", name, *extra)
    assert f"error: --valid: {name}" in err or f"error: --valid: path: '{name}'" in err, err
    assert words in err, err


def _arrays(*argv):
    from ggmlopt.finetune import _dataset, _load, _problems, parser
    args = parser().parse_args([*BASE, "--out", "a.gguf", *argv])
    assert not _problems(args)
    _, tok = _load(args)
    ds, _ = _dataset(args, tok)
    return args, tok, np.asarray(ds.data), np.asarray(ds.labels)


def _held_out(args, ndata):
    from ggmlopt._fit_plan import training_batches
    return ndata - training_batches(ndata // args.batch, args.val_split) * args.batch


def test_a_valid_file_of_another_form_validates_its_own_windows(files):
    """Completions validating chats (docs: --valid in --data's forms): the held-out
    part is exactly the completions' windows and masked rows to a whole batch."""
    args, tok, x, y = _arrays("--valid", "completions.jsonl")
    from ggmlopt.instruct import read_jsonl
    pairs = read_jsonl("completions.jsonl")
    want = go.Dataset.from_completions(pairs, tok, 96)
    assert _held_out(args, len(x)) == 4 and len(x) == 16 + 4
    np.testing.assert_array_equal(x[16:19], np.asarray(want.data))
    np.testing.assert_array_equal(y[16:19], np.asarray(want.labels))
    assert (y[19] == -1).all()


def test_a_valid_file_smaller_than_a_batch(files):
    from ggmlopt.checkpoint import load_state
    from ggmlopt.finetune import main
    args, _, x, y = _arrays("--valid", "one.jsonl")
    assert _held_out(args, len(x)) == 4 and (y[-3:] == -1).all() and (y[-4] >= 0).any()
    assert main([*BASE, "--valid", "one.jsonl", "--out", "a.gguf", "--micro-batch", "1",
                 "--eval-every", "2", "--checkpoint", "c.npz", "--epochs", "2"]) == 0
    sd = load_state("c.npz")
    hist, evals = sd["fit.history"], sd["fit.evals"]
    # the masked rows' micro-batches have no loss: the one example's, finite
    assert np.isfinite(hist[:, 5]).all() and np.isnan(hist[:, 6]).all()
    assert evals[:, 0].tolist() == [2, 4, 6, 8] and int(sd["fit.shuffle"]) == 2


def test_valid_with_packing_eval_every_max_steps_keep_types_holds_it_out(files):
    """The validation windows never train: another --valid file of as many windows
    gives the same adapter, byte for byte (and another --valid content is another
    run for --resume, said naming --valid)."""
    from ggmlopt.checkpoint import load_state
    from ggmlopt.finetune import main
    from ggmlopt.io import load_gguf, save_gguf
    model, tok = load_gguf("base.gguf")
    save_gguf(model, "q8.gguf", tokenizer=tok, dtype="q8_0")
    run = [*BASE[:1], "q8.gguf", *BASE[2:], "--packing", "--keep-types", "--eval-every", "1",
           "--max-steps", "5", "--micro-batch", "2"]
    a = _arrays("--valid", "three.jsonl", "--packing")
    b = _arrays("--valid", "swapped.jsonl", "--packing")
    assert a[2].shape == b[2].shape and not np.array_equal(a[2], b[2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*run, "--valid", "three.jsonl", "--out", "a.gguf", "--checkpoint",
                     "c.npz"]) == 0
        assert main([*run, "--valid", "swapped.jsonl", "--out", "b.gguf"]) == 0
    assert (files / "a.gguf").read_bytes() == (files / "b.gguf").read_bytes()
    sd = load_state("c.npz")
    assert sd["fit.evals"][:, 0].tolist() == [1, 2, 3, 4, 5]
    assert np.isfinite(sd["fit.evals"][:, 3]).all()


# ---- fit ------------------------------------------------------------------------------------

def _problem(ndata):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ndata, 3)).astype(np.float32)
    y = np.eye(2, dtype=np.float32)[(x[:, 0] > 0).astype(int)]
    model = go.nn.Sequential(go.nn.Linear(3, 2, rng=np.random.default_rng(1)))
    return model, go.Dataset.from_arrays(x, y)


def test_shuffle_train_refuses_drop_last_that_cuts_the_validation_part():
    """16 training + 6 held-out datapoints in logical batches of 4, drop_last: the
    2 left out were the held-out set's last, and training datapoints 12..13
    validated in their place, silently (val_split 8/22 rounds to 8 within half a
    batch: no warning either)."""
    model, ds = _problem(22)
    before = [p.data.copy() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"drop_last: shuffle='train' validates on the "
                                         r"dataset's last datapoints.*datapoints 12\.\.19"):
        go.fit(model, ds, "cross_entropy", nbatch_logical=4, val_split=8 / 22,
               drop_last=True, shuffle="train", silent=True, seed=0)
    np.testing.assert_array_equal(ds.permutation, np.arange(22))
    assert all(np.array_equal(a, p.data) for a, p in zip(before, model.parameters()))
    # nothing held out, or nothing left out: as before
    hist = go.fit(model, ds, "cross_entropy", nbatch_logical=4, drop_last=True,
                  shuffle="train", silent=True, seed=0)
    assert hist.ndata_train == 20
    model, ds = _problem(24)
    hist = go.fit(model, ds, "cross_entropy", nbatch_logical=4, val_split=0.3,
                  drop_last=True, shuffle="train", silent=True, seed=0)
    assert (hist.ndata_train, hist.ndata_val) == (16, 8)
    np.testing.assert_array_equal(ds.permutation[16:], np.arange(16, 24))
