"""The textlm example trains a byte-level language model offline, and its numbers make sense."""
import math
import re
import subprocess
import sys

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.examples import textlm

TEXT = ("The function returns the sum of its arguments. A list holds the values in order. "
        "The module reads the file and returns its lines. ") * 120


@pytest.fixture(autouse=True)
def same_blas_threads(monkeypatch):
    """Runs compared number for number need the same BLAS threads: OpenBLAS's
    products round differently on 1 and 2 threads, and auto picks them from the
    cores idle at the time (a busy test run made two runs differ)."""
    monkeypatch.setenv("GGMLOPT_BLAS_THREADS", "1")


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT + "Unicode: naïve café, 東京.\n", encoding="utf-8")
    return path


def test_quick_default_corpus_learns_and_samples(capsys):
    run = textlm.main(["--quick", "--silent", "--seed", "1"])
    out = capsys.readouterr().out
    assert "standard library" in out and "textlm: epoch 2/2" in out
    history = run.history
    assert len(history) == 2
    # the loss falls from a uniform guess over 257 ids (5.55 nats) within 40 steps
    assert history[0].train_loss < math.log(257)
    assert history[1].train_loss < history[0].train_loss
    assert history[1].val_loss < 3.5 and history[1].val_loss < history[0].val_loss
    # the printed figures are the History's, perplexity = exp(loss)
    e = history[1]
    assert (f"train loss {e.train_loss:.4f} (ppl {math.exp(e.train_loss):.3f})" in out)
    assert f"val loss {e.val_loss:.4f} (ppl {math.exp(e.val_loss):.3f})" in out
    ppl = run.perplexity
    assert 1 < ppl.ppl < math.exp(3.5) and ppl.unc > 0 and ppl.scored > 1000
    assert f"PPL = {ppl.ppl:.4f} +/- {ppl.unc:.4f}" in out
    # the sample: the prompt, then 80 bytes decoded as text, printed as it came
    assert isinstance(run.sample, str) and len(run.sample.encode("utf-8")) >= 70
    assert "Return the" + run.sample in out


def test_text_file_save_load_round_trip(text_file, tmp_path, capsys):
    saved = tmp_path / "lm.npz"
    args = ["--text", str(text_file), "--steps", "20", "--epochs", "2", "--silent",
            "--n-layers", "1", "--dim", "32", "--n-heads", "2", "--max-new-tokens", "100",
            "--temperature", "0"]
    trained = textlm.main(args + ["--save", str(saved)])
    out = capsys.readouterr().out
    assert f"saved the model to {saved}" in out and "epoch 2/2" in out
    loaded = textlm.main(["--text", str(text_file), "--load", str(saved), "--max-new-tokens",
                          "100", "--temperature", "0"])
    out = capsys.readouterr().out
    assert "loaded a llama model" in out and "epoch" not in out and loaded.history is None
    assert loaded.perplexity == trained.perplexity      # the same weights, the same numbers
    # greedy and longer than the 64-position window: the same text from both
    assert loaded.sample == trained.sample


def test_gpt2_save_load_keeps_every_parameter(tmp_path):
    model = textlm.make_model("gpt2", 1, 2, 16, 8, seed=3)
    path = str(tmp_path / "g.npz")
    textlm.save_model(model, path)
    kind, back = textlm.load_model(path)
    assert kind == "gpt2" and back.config == model.config
    for (name, p), (name2, q) in zip(model.named_parameters(), back.named_parameters()):
        assert name == name2
        np.testing.assert_array_equal(p.data, q.data)


def test_windows_are_spread_and_exact():
    tokens = np.arange(1000, dtype=np.int32)
    ds = textlm.windows(tokens, 16, 24)
    assert ds.ndata == 24
    starts = ds.data[:, 0]
    assert (np.diff(starts) == (1000 - 17) // 24).all()        # evenly spread, disjoint
    np.testing.assert_array_equal(ds.labels[:, :-1], ds.data[:, 1:])
    with pytest.raises(ValueError, match="windows"):
        textlm.windows(tokens[:40], 16, 24)


@pytest.mark.parametrize("ntrain, nval", [(24, 4), (200, 20), (40, 8), (900, 60)])
def test_validation_windows_share_no_token_with_training_ones(ntrain, nval):
    # a short text (or many steps) makes windows overlap: the validating ones then
    # come from the text's tail and stay last, where fit's shuffle="train" keeps them
    positions = np.arange(1000, dtype=np.int32)
    where, shuffle = textlm.training_windows(positions, 16, ntrain, nval)
    assert where.ndata == ntrain + nval
    assert shuffle == (True if (1000 - 17) // (ntrain + nval) > 16 else "train")
    ds, _ = textlm.training_windows(positions % 256, 16, ntrain, nval)   # the same layout
    go.fit(textlm.make_model("llama", 1, 2, 16, 16, seed=0), ds, go.LossType.CROSS_ENTROPY,
           nepoch=1, nbatch_logical=4, val_split=(nval / 4 - 0.25) / ((ntrain + nval) / 4),
           silent=True, seed=1, shuffle=shuffle, max_steps=1)
    order = np.asarray(ds.permutation)   # fit's order: the last nval validate

    def read(rows):
        return set(np.concatenate([where.data[rows], where.labels[rows]], axis=1).ravel())

    assert not read(order[:ntrain]) & read(order[ntrain:])


def test_a_text_too_short_to_hold_validation_apart_trains_as_before():
    # the tail could not hold the validation windows: the overlapping windows any
    # text long enough for them all trained on, and fit's shuffle
    positions = np.arange(1000, dtype=np.int32)
    ds, shuffle = textlm.training_windows(positions, 16, 950, 30)
    assert shuffle is True
    np.testing.assert_array_equal(ds.data, textlm.windows(positions, 16, 980).data)


def test_sample_beyond_the_context_window():
    model = textlm.make_model("llama", 1, 2, 16, 8, seed=0)
    tok = go.text.ByteTokenizer()
    text = textlm.sample(model, tok, "ab", 30, 1.0, seed=5)
    assert text == textlm.sample(model, tok, "ab", 30, 1.0, seed=5)   # the seed decides
    # 30 new bytes (8 positions a window): decoded with U+FFFD for invalid UTF-8
    assert 0 < len(text) <= 30 + len(tok.eos_text) * 30


@pytest.mark.parametrize("flag, value, message", [
    ("--save", "model.gguf", "ending in .npz"),
    ("--save", "no-such-dir/model.npz", "does not exist"),
    ("--plot", "no-such-dir/curves.png", "does not exist"),
])
def test_outputs_checked_before_training(flag, value, message, text_file, tmp_path, capsys,
                                         monkeypatch):
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        textlm.main(["--text", str(text_file), flag, value])
    captured = capsys.readouterr()
    assert message in captured.err and "epoch" not in captured.out


def test_plot_suffix_checked(text_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit):
        textlm.main(["--text", str(text_file), "--plot", str(tmp_path / "curves.xyz")])
    assert "--plot: expected a file name ending in" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [("npz", "holds no config.json"),
                                              ("text", "--load")])
def test_load_refuses_other_files(content, message, tmp_path, text_file, capsys):
    path = tmp_path / "other.npz"
    if content == "npz":
        np.savez(path, x=np.zeros(3))
    else:
        path.write_text("not an archive")
    with pytest.raises(SystemExit):
        textlm.main(["--text", str(text_file), "--load", str(path)])
    assert message in capsys.readouterr().err


def test_module_runs_as_a_program():
    out = subprocess.run([sys.executable, "-m", "ggmlopt.examples.textlm", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert re.search(r"--steps", out) and "--quick" in out and "--temperature" in out


def test_text_errors_are_clear(tmp_path, capsys):
    with pytest.raises(SystemExit):
        textlm.main(["--text", str(tmp_path / "missing.txt")])
    assert "--text: no such file" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("hello world. " * 100, encoding="utf-8")
    with pytest.raises(SystemExit, match="fewer than the 13200 windows"):  # 2000 steps
        textlm.main(["--text", str(short)])


SMALL = ["--steps", "20", "--epochs", "2", "--silent", "--n-layers", "1", "--dim", "32",
         "--n-heads", "2", "--max-new-tokens", "20", "--temperature", "0"]


def test_eval_every_and_a_checkpoint_resumed_mid_epoch(text_file, tmp_path, capsys,
                                                        monkeypatch):
    args = ["--text", str(text_file), *SMALL, "--eval-every", "4"]
    straight = textlm.main(args)
    out = capsys.readouterr().out
    steps = [e.step for e in straight.history.evaluations]
    assert steps == [4, 8, 12, 16, 20]
    assert f"textlm: step 8/20: val loss {straight.history.evaluations[1].val_loss:.4f}" in out

    # the first run stops after 7 steps (as an interruption would), the second resumes
    ckpt = tmp_path / "run.npz"
    fit = go.fit
    monkeypatch.setattr(go, "fit", lambda *a, **kw: fit(*a, **kw, max_steps=7))
    textlm.main(args + ["--checkpoint", str(ckpt), "--checkpoint-every", "3"])
    sd = go.checkpoint.load_state(ckpt)
    assert (sd["fit.epoch"], sd["fit.step"], sd["iter"]) == (0, 7, 8)
    monkeypatch.setattr(go, "fit", fit)
    capsys.readouterr()
    resumed = textlm.main(args + ["--checkpoint", str(ckpt), "--resume"])
    assert [e[:9] for e in map(dataclass_tuple, resumed.history)] == \
        [e[:9] for e in map(dataclass_tuple, straight.history)]
    # (NaN uncertainties: one validation batch)
    np.testing.assert_array_equal([dataclass_tuple(e) for e in resumed.history.evaluations],
                                  [dataclass_tuple(e) for e in straight.history.evaluations])
    assert resumed.perplexity == straight.perplexity and resumed.sample == straight.sample


def dataclass_tuple(stats):
    from dataclasses import astuple

    return astuple(stats)


@pytest.mark.parametrize("extra,message", [
    (["--checkpoint-every", "5"], "--checkpoint-every: needs --checkpoint"),
    (["--resume"], "--resume: needs --checkpoint"),
    (["--eval-every", "-1"], "--eval-every: expected at least 0"),
    (["--checkpoint", "c.npz", "--checkpoint-every", "0"], "--checkpoint-every: expected"),
])
def test_step_options_checked(extra, message, text_file, capsys):
    with pytest.raises(SystemExit):
        textlm.main(["--text", str(text_file), *SMALL, *extra])
    assert message in capsys.readouterr().err


def test_load_refuses_the_options_it_would_ignore(text_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        textlm.main(["--text", str(text_file), "--load", str(tmp_path / "m.npz"),
                     "--dim", "64", "--model", "gpt2", "--eval-every", "5"])
    assert info.value.code == 2
    assert "--load evaluates the saved model as it is: --model, --dim, --eval-every" in \
        capsys.readouterr().err


def test_a_held_out_text_too_short_is_said_before_training(tmp_path, capsys, monkeypatch):
    """(it was said after the training, and after --save had written the model)"""
    short = tmp_path / "short.txt"
    short.write_text("abcdefghij" * 72, encoding="utf-8")   # 72 held-out bytes < 128
    monkeypatch.setattr(textlm, "train", lambda *a, **k: pytest.fail("trained first"))
    with pytest.raises(SystemExit) as info:
        textlm.main(["--text", str(short), "--save", str(tmp_path / "m.npz")])
    assert info.value.code == 2
    assert "the held-out text has 72 tokens" in capsys.readouterr().err
    assert not (tmp_path / "m.npz").exists()


def test_seed_must_not_be_negative(text_file, capsys):
    with pytest.raises(SystemExit) as info:
        textlm.main(["--text", str(text_file), "--seed", "-1"])
    assert info.value.code == 2 and "--seed: expected a non-negative integer" in \
        capsys.readouterr().err
