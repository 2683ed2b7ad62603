"""python -m ggmlopt.finetune: the made-up-fact story through the command on a small
model with a chat template in its GGUF, LoRA adapters llama.cpp's loader reads back,
llama-finetune's flag names, and every bad argument refused before training."""
import json
import os
import re
import warnings
from contextlib import nullcontext

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import finetune
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.text import ByteTokenizer

pytest.importorskip("gguf")
pytest.importorskip("jinja2")

from finetune_files import CHATML, QUESTIONS, write_files


@pytest.fixture
def files(tmp_path):
    return write_files(tmp_path)


def test_the_made_up_fact_through_the_command(files, capsys):
    from ggmlopt.io import load_gguf
    assert finetune.main(["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"),
                          "--full", "-c", "96", "--batch", "8", "-lr", "3e-3", "--epochs", "60",
                          "--merge-out", str(files / "tuned.gguf"), "--out-type", "f32",
                          "--silent"]) == 0
    tuned, tok = load_gguf(files / "tuned.gguf")
    assert tok.chat_template == CHATML   # the template goes back with the model
    reply = go.chat(tuned, tok, [{"role": "user", "content": QUESTIONS[0]}], 20,
                    temperature=0)
    assert reply == "Quimby."


def test_the_optimizer_in_the_backward_pass_gives_the_same_model(files):
    from ggmlopt.io import load_gguf
    outs = []
    for extra in ([], ["--optimizer-in-backward"]):
        out = files / f"tuned{len(extra)}.gguf"
        assert finetune.main(["-m", str(files / "base.gguf"), "--data",
                              str(files / "train.jsonl"), "--full", "-c", "96", "--batch", "4",
                              "-lr", "3e-3", "--epochs", "2", "--merge-out", str(out),
                              "--out-type", "f32", "--silent"] + extra) == 0
        outs.append([p.data for p in load_gguf(out)[0].parameters()])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    base = [p.data for p in load_gguf(files / "base.gguf")[0].parameters()]
    assert any(not np.array_equal(a, b) for a, b in zip(base, outs[1]))   # it trained


def test_a_lora_run_writes_an_adapter_over_the_unchanged_base(files, capsys):
    from ggmlopt import lora
    from ggmlopt.io import load_gguf, load_gguf_lora
    assert finetune.main(["--model", str(files / "base.gguf"), "--data",
                          str(files / "train.jsonl"), "--lora-rank", "4", "--ctx", "96",
                          "--batch", "4", "--micro-batch", "2", "--epochs", "2",
                          "--lr", "1e-2", "--lr-schedule", "cosine", "--warmup", "2",
                          "--out", str(files / "adapter.gguf")]) == 0
    printed = capsys.readouterr().out
    assert "15 examples" in printed and "+1 masked rows" in printed
    assert "trainable params:" in printed
    base, _ = load_gguf(files / "base.gguf")
    before = base(np.arange(20).reshape(1, 20))
    load_gguf_lora(files / "adapter.gguf", base)
    assert len(lora.named_adapters(base)) == 8
    assert np.abs(base(np.arange(20).reshape(1, 20)) - before).max() > 0   # it learned


def test_the_adapter_goes_to_peft_as_well(files):
    # --peft-out: the directory PEFT's PeftModel.from_pretrained reads
    from ggmlopt import lora
    from ggmlopt.io import load_gguf, load_gguf_lora, load_peft
    assert finetune.main(["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"),
                          "--lora-rank", "4", "-c", "96", "--batch", "5", "--epochs", "1",
                          "-lr", "1e-2", "--out", str(files / "a.gguf"),
                          "--peft-out", str(files / "peft"), "--silent"]) == 0
    assert (files / "peft" / "adapter_config.json").is_file()
    ids = np.arange(20).reshape(1, 20)
    from_peft, _ = load_gguf(files / "base.gguf")
    load_peft(files / "peft", from_peft)
    from_gguf, _ = load_gguf(files / "base.gguf")
    load_gguf_lora(files / "a.gguf", from_gguf)
    assert len(lora.named_adapters(from_peft)) == 8
    np.testing.assert_array_equal(from_peft(ids), from_gguf(ids))   # the same adapter


def test_keep_types_trains_adapters_over_the_quantized_base(files, capsys):
    """--keep-types: QLoRA over a Q8_0 file; the adapter applies to that file, and
    --merge-out writes the adapted layers merged, the others in their type."""
    from ggmlopt.io import load_gguf, load_gguf_lora, save_gguf
    from ggmlopt.io.gguf_reader import GgufFile
    base, tok = load_gguf(files / "base.gguf")
    save_gguf(base, files / "q8.gguf", tokenizer=tok, dtype="q8_0")
    assert finetune.main(["-m", str(files / "q8.gguf"), "--data", str(files / "train.jsonl"),
                          "--keep-types", "--gradient-checkpointing", "--lora-rank", "4",
                          "-c", "96", "--batch", "5",
                          "--epochs", "2", "-lr", "1e-2", "--out", str(files / "qa.gguf"),
                          "--merge-out", str(files / "merged.gguf"), "--out-type", "q8_0",
                          "--silent"]) == 0
    kept, _ = load_gguf(files / "q8.gguf", keep_types=True)
    ids = np.arange(20).reshape(1, 20)
    before = kept(ids)
    load_gguf_lora(files / "qa.gguf", kept)
    adapted = kept(ids)
    assert np.abs(adapted - before).max() > 0
    merged = GgufFile(str(files / "merged.gguf"))
    assert merged.tensors["blk.0.ffn_up.weight"].type_name == "Q8_0"
    assert merged.tensors["blk.0.attn_q.weight"].type_name == "Q8_0"
    back, _ = load_gguf(files / "merged.gguf", keep_types=True)
    # the merged q/k/v/o were quantized again to Q8_0: within its resolution
    assert np.abs(back(ids) - adapted).max() < 0.05 * np.abs(adapted).max()


def test_text_rows_train_each_row_whole(files):
    # {"text"} rows as TRL and MLX-LM train them: a document each (they were one
    # stream cut into overlapping windows, which attend across rows and leave the
    # stream's tail, whole rows of it, untrained)
    rows = [f"row {i}: " + "word " * (3 + i % 5) for i in range(12)]
    (files / "text.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    tok = ByteTokenizer()
    for packing in ([], ["--packing"]):
        args = finetune.parser().parse_args(["-m", "m.gguf", "--data", str(files / "text.jsonl"),
                                             "-c", "64", "--batch", "1"] + packing)
        ds, what = finetune._dataset(args, tok)
        y = np.asarray(ds.labels)
        # every token of every row is a target once, and the eos after it
        assert int((y >= 0).sum()) == sum(len(r) for r in rows)
        if not packing:
            assert what.startswith("12 examples") and ds.ndata == 12
            assert sorted(tok.decode(y[r][y[r] >= 0]) for r in range(12)) == \
                sorted(r[1:] + "<|endoftext|>" for r in rows)
        else:
            assert what.startswith(f"12 examples from {files / 'text.jsonl'} packed into")


def test_packed_summary_counts_the_examples_kept(files):
    # rows dropped as too long are not in the windows: the summary counted rows read
    rows = ["short " * 2] * 5 + ["long " * 40] * 3
    (files / "mixed.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    args = finetune.parser().parse_args(["-m", "m.gguf", "--data", str(files / "mixed.jsonl"),
                                         "-c", "64", "--batch", "1", "--packing",
                                         "--too-long", "drop"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, what = finetune._dataset(args, ByteTokenizer())
    assert what.startswith("5 examples from") and "packed into" in what


def test_a_raw_text_file_trains_as_llama_finetune_does(files):
    (files / "text.txt").write_text("the cat sat on the mat. " * 40)
    assert finetune.main(["-m", str(files / "base.gguf"), "-f", str(files / "text.txt"),
                          "-c", "32", "--batch", "4", "--micro-batch", "2", "-lr", "1e-3",
                          "-wd", "0.01",
                          "-opt", "sgd", "-val-split", "0.25", "--epochs", "1",
                          "--out", str(files / "a.gguf"), "--silent"]) == 0
    assert (files / "a.gguf").stat().st_size > 0


def test_a_resume_with_another_schedule_is_refused(files, capsys):
    # --max-steps is the run's length (the schedule spans it): stopping a cosine run
    # there and resuming it as a longer one would change every later learning rate
    ck = files / "run.npz"
    common = ["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"),
              "-c", "96", "--batch", "2", "--lr-schedule", "cosine", "--warmup", "1",
              "--checkpoint", str(ck), "--out", str(files / "a.gguf"), "--silent"]
    assert finetune.main(common + ["--max-steps", "3"]) == 0
    with pytest.raises(SystemExit) as info:
        finetune.main(common + ["--epochs", "2", "--resume"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--resume:" in err and "its last step (step 3) ran with adamw.alpha" in err
    # the same options go on
    assert finetune.main(common + ["--max-steps", "3", "--resume"]) == 0


def test_checkpoints_inside_an_epoch_and_a_first_resume(files, capsys, monkeypatch):
    from ggmlopt.checkpoint import FitCheckpoint
    saved = []
    original = FitCheckpoint.save
    monkeypatch.setattr(FitCheckpoint, "save",
                        lambda self, *a, **k: saved.append(1) or original(self, *a, **k))
    ck = files / "new.npz"
    assert finetune.main(["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"),
                          "-c", "96", "--batch", "5", "--checkpoint", str(ck),
                          "--checkpoint-every", "1", "--resume", "--out",
                          str(files / "a.gguf"), "--silent"]) == 0
    assert len(saved) >= 3   # 15 examples, 3 steps: one each, and the epoch's end
    assert f"no checkpoint at {ck} yet: training from the start" in capsys.readouterr().err


@pytest.mark.parametrize("extra, match", [
    (["-c", "0"], "--ctx: expected >= 1"),
    (["--batch", "6", "--micro-batch", "4"], "--micro-batch: expected a divisor of --batch 6"),
    (["-lr", "0"], "--lr: expected > 0"),
    (["-lr", "inf"], "--lr: expected > 0 and finite, got inf"),
    (["--seed", "-1"], "--seed: expected >= 0, got -1"),
    # llama-finetune's -b/-ub count tokens: fewer than a window's would step within it
    (["-c", "32", "-b", "16"], "-b: 16 tokens a step, fewer than a window's -c 32"),
    (["-c", "32", "-b", "64", "-ub", "24"], "-ub dividing min(-b, -c) = 32"),
    (["-c", "32", "-b", "64", "--batch", "2"], "give it or --batch/--micro-batch"),
    (["--batch", "4", "--micro-batch", "2", "--optimizer-in-backward"],
     "--optimizer-in-backward: steps once per physical batch"),
    (["--resume"], "--resume: needs --checkpoint"),
    (["--checkpoint-every", "2"], "--checkpoint-every: needs --checkpoint FILE"),
    (["--full"], "--out: writes a LoRA adapter"),
    (["--full", "--peft-out", "x"], "--peft-out: writes a LoRA adapter"),
    (["--full", "--keep-types"], "--keep-types: a kept (quantized) base trains through LoRA"),
    (["--lora-targets", "nope"], "--lora-targets: targets: no Linear layer"),
    # a misspelt name beside good ones (the library warns: PEFT ignores it too)
    (["--lora-targets", "q_proj,qproj"], "--lora-targets: 'qproj' matches no layer"),
    (["--lora-targets", "all-linear,q_proj"], "--lora-targets: all-linear stands alone"),
    (["--lora-targets", " , "], "--lora-targets: expected comma-separated layer names"),
    (["-c", "4096"], "--ctx: 4096 is more than the model's max_seq_len 128"),
    (["--out", "/no/such/dir/a.gguf"], "--out: no directory"),
    (["--eval-every", "1"], "--eval-every: evaluates the validation split; give -val-split"),
    (["--warmup", "-1"], "--warmup: expected >= 0, got -1"),
    (["--lora-alpha", "0"], "--lora-alpha: alpha: expected a finite nonzero number"),
    (["--lora-dropout", "1.5"], "--lora-dropout: dropout: expected a drop probability"),
    (["--epochs", "1", "--max-steps", "50"], "max_steps"),
    (["--out", "."], "--out: '.' is a directory"),
    (["--merge-out", "merged/"], "--merge-out: 'merged/' is a directory; give a file name"),
    # options that would change nothing in the mode given
    (["--full", "--lora-rank", "4"], "--lora-rank: LoRA options; --full trains every weight"),
    (["--out-type", "q4_0"], "--out-type: the type of --merge-out's weights; give --merge-out"),
    (["--max-grad-norm", "0"], "--max-grad-norm: expected a finite norm > 0"),
    (["--max-grad-norm", "1", "--optimizer-in-backward"],
     "--max-grad-norm: the norm needs every gradient"),
])
def test_bad_arguments_are_refused_before_training(files, capsys, extra, match):
    argv = ["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"),
            "--out", str(files / "a.gguf"), "-c", "96"] + extra
    with pytest.raises(SystemExit) as info:
        finetune.main(argv)
    assert info.value.code == 2
    assert match in capsys.readouterr().err
    assert not (files / "a.gguf").exists()


def test_two_results_into_one_file_are_refused(files, capsys):
    out = str(files / "a.gguf")
    with pytest.raises(SystemExit) as info:
        finetune.main(["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"),
                       "--out", out, "--merge-out", out])
    assert info.value.code == 2
    assert "--merge-out: " in capsys.readouterr().err.split("error: ")[-1]
    assert not (files / "a.gguf").exists()


def test_an_output_over_an_input_is_refused(files, capsys):
    model = files / "base.gguf"
    before = model.read_bytes()
    for argv, match in [(["--checkpoint", str(model)], "--checkpoint: "),
                        (["--plot", str(files / "train.jsonl")], "--plot: ")]:
        with pytest.raises(SystemExit) as info:
            finetune.main(["-m", str(model), "--data", str(files / "train.jsonl"),
                           "--out", str(files / "a.gguf")] + argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert match in err and ("is also --model's file" in err or "is also --data's" in err)
    assert model.read_bytes() == before and not (files / "a.gguf").exists()


def test_a_peft_out_that_cannot_be_written_is_refused_before_training(files, capsys):
    # a clash with another result, a directory under a file, a folder that takes
    # no files: said before training, not after it (when the run is lost)
    out = str(files / "a.gguf")
    cases = [(out, "--peft-out: .* is also --out's file"),
             (str(files / "train.jsonl" / "adapter"), "is a file; no directory"),
             (out + "/peft", "--peft-out: .* is under --out's file"),
             (str(files), None)]
    proc = os.path.isdir("/proc")   # (Linux: no file can be made there, even by root)
    if proc:
        cases.append(("/proc/ggmlopt-adapter", "--peft-out: cannot write into '/proc'"))
    for peft_out, match in cases:
        # (files itself: --out is then the adapter's own safetensors file)
        given = str(files / "adapter_model.safetensors") if match is None else out
        match = match or "--out: .* is one of the files --peft-out writes"
        with pytest.raises(SystemExit) as info:
            finetune.main(["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"),
                           "--out", given, "--peft-out", peft_out])
        assert info.value.code == 2
        assert re.search(match, capsys.readouterr().err), peft_out
        assert not (files / "a.gguf").exists()
    if proc:
        with pytest.raises(SystemExit) as info:
            finetune.main(["-m", str(files / "base.gguf"), "--data",
                           str(files / "train.jsonl"), "--out", "/proc/a.gguf"])
        assert info.value.code == 2
        assert "--out: cannot write into '/proc'" in capsys.readouterr().err


def test_a_text_file_that_is_not_utf8_is_named(files, capsys):
    (files / "bad.txt").write_bytes(b"fine text\nthen \xff there")
    with pytest.raises(SystemExit) as info:
        finetune.main(["-m", str(files / "base.gguf"), "-f", str(files / "bad.txt"),
                       "--out", str(files / "a.gguf"), "-c", "8"])
    assert info.value.code == 2
    assert "bad.txt:2: not UTF-8 text" in capsys.readouterr().err


def test_options_of_another_kind_of_data_are_refused(files, capsys):
    (files / "text.txt").write_text("the cat sat on the mat. " * 40)
    (files / "pairs.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    for data, match in [(["-f", str(files / "text.txt")], "--train-on: chooses the turns"),
                        (["--data", str(files / "pairs.jsonl")],
                         "--train-on: chooses the turns of chat data"),
                        (["-f", str(files / "text.txt"), "--too-long", "truncate"],
                         "--too-long: cuts chat and completion examples")]:
        with pytest.raises(SystemExit) as info:
            finetune.main(["-m", str(files / "base.gguf"), "--out", str(files / "a.gguf"),
                           "-c", "32"] + (["--train-on", "last"] if "--too-long" not in data
                                          else []) + data)
        assert info.value.code == 2 and match in capsys.readouterr().err
    assert not (files / "a.gguf").exists()


def test_an_adapter_llama_cpp_could_not_apply_is_refused_before_training(tmp_path, capsys,
                                                                         monkeypatch):
    # an adapter on an embedding tied to the head: --out would fail after training
    from ggmlopt.io import save_gguf
    model = Llama(LlamaConfig(vocab_size=257, dim=32, n_layers=1, n_heads=2, max_seq_len=128,
                              tie_embeddings=True), seed=0)
    save_gguf(model, tmp_path / "tied.gguf", tokenizer=ByteTokenizer(chat_template=CHATML))
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": "Quimby."}]}) + "\n"
        for q in QUESTIONS))
    monkeypatch.setattr(go, "fit", lambda *a, **k: pytest.fail("trained"))
    with pytest.raises(SystemExit) as info:
        finetune.main(["-m", str(tmp_path / "tied.gguf"), "--data", str(tmp_path / "t.jsonl"),
                       "--lora-targets", "embed_tokens,v_proj", "--out", str(tmp_path / "a.gguf"),
                       "--peft-out", str(tmp_path / "peft"), "-c", "96"])
    assert info.value.code == 2
    assert "--out: model: an adapter on a token embedding tied" in capsys.readouterr().err
    assert not (tmp_path / "a.gguf").exists() and not (tmp_path / "peft").exists()


def test_the_schedule_lasts_the_steps_fit_takes(files, monkeypatch):
    """The command sizes its schedule with fit's own split (ggml's float32
    arithmetic): -val-split 0.9 of 20 batches trains 2 steps an epoch in fit, where
    float64 arithmetic gave 1 and the schedule ran out at the third step."""
    seen = {}
    real_fit = go.fit

    def fit(model, dataset, loss, schedule, **kw):
        seen["total"] = schedule.total
        return real_fit(model, dataset, loss, schedule, **kw)

    monkeypatch.setattr(go, "fit", fit)
    with open(files / "twenty.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                             {"role": "assistant", "content": "a"}]}) + "\n"
                     for i in range(20))
    for split, per_epoch in [("0.9", 2), ("0.6", 7)]:
        assert finetune.main(["-m", str(files / "base.gguf"), "--data",
                              str(files / "twenty.jsonl"), "-c", "64", "--batch", "1",
                              "-val-split", split, "--lr-schedule", "linear", "--epochs", "2",
                              "--silent", "--out", str(files / "a.gguf")]) == 0
        assert seen["total"] == 2 * per_epoch


def test_bad_files_and_data_lines_are_named(files, capsys):
    (files / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}]}\n'
                                     '{"oops"\n')
    for argv, match in [(["--data", str(files / "missing.jsonl")], "--data: no such file"),
                        (["--data", str(files / "bad.jsonl")], "bad.jsonl:2: not valid JSON"),
                        (["-m", str(files / "nope.gguf"), "--data", "x"], "--model: no such")]:
        base = ["-m", str(files / "base.gguf"), "--out", str(files / "a.gguf")]
        with pytest.raises(SystemExit):
            finetune.main(base + argv)
        assert match in capsys.readouterr().err


def test_llama_finetunes_batch_flags_count_tokens(files, monkeypatch):
    # -b 512 -ub 128 with -c 32: llama.cpp takes min(-b, -c) tokens a step, one
    # window, in passes whose gradients make the window's: one window a step here
    import ggmlopt as go
    seen = {}
    real_fit = go.fit

    def fit(*args, **kwargs):
        seen.update(kwargs)
        return real_fit(*args, **kwargs)

    monkeypatch.setattr(go, "fit", fit)
    (files / "text.txt").write_text("the cat sat on the mat. " * 20)
    assert finetune.main(["-m", str(files / "base.gguf"), "-f", str(files / "text.txt"),
                          "-c", "32", "-b", "512", "-ub", "128", "--epochs", "1",
                          "--out", str(files / "a.gguf"), "--silent"]) == 0
    assert seen["nbatch_logical"] == 1 and seen["nbatch_physical"] is None


def test_a_warmup_as_long_as_the_run_is_refused(files, capsys):
    with pytest.raises(SystemExit):
        finetune.main(["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"),
                       "-c", "96", "--batch", "4", "--max-steps", "3", "--lr-schedule",
                       "cosine", "--warmup", "3", "--out", str(files / "a.gguf"), "--silent"])
    assert "--warmup: 3 steps of warmup, but the run takes 3 optimizer steps" in \
        capsys.readouterr().err


def _bos_vocabulary(path):
    """A byte-level BPE vocabulary with <s> (its BOS, added) and </s> (its EOS), 259
    ids, written with a model of its size to the GGUF path; returns the tokenizer."""
    pytest.importorskip("tokenizers")
    from ggmlopt.io import save_gguf
    from ggmlopt.io._gguf_tokenizer import BYTE_MERGES, byte_vocabulary
    from ggmlopt.text import BPETokenizer
    tok = BPETokenizer(byte_vocabulary() + ["<s>", "</s>"], list(BYTE_MERGES),
                       token_types=[1] * 256 + [3, 3, 3], bos_id=257, eos_id=258,
                       add_bos=True)
    model = Llama(LlamaConfig(vocab_size=259, dim=32, n_layers=1, n_heads=2, max_seq_len=64))
    save_gguf(model, path, tokenizer=tok)
    return tok


def test_a_text_file_is_read_and_ordered_as_llama_finetune_does(files, monkeypatch, tmp_path):
    # llama.cpp's -f drops one trailing line break, common_tokenize reads special
    # tokens written in the text as text, and llama_opt_epoch trains the windows in
    # order with the last ones validating
    import ggmlopt as go
    tok = _bos_vocabulary(tmp_path / "bpe.gguf")
    from ggmlopt import instruct
    seen = {}
    real_document_ids, real_fit = instruct.document_ids, go.fit

    def document_ids(*args, **kwargs):
        ids = real_document_ids(*args, **kwargs)
        seen["ids"] = np.asarray(ids).tolist()
        return ids

    def fit(model, dataset, *args, **kwargs):
        seen.update(kwargs)
        history = real_fit(model, dataset, *args, **kwargs)
        seen["permutation"] = np.asarray(dataset.permutation).copy()
        return history

    monkeypatch.setattr(instruct, "document_ids", document_ids)
    monkeypatch.setattr(go, "fit", fit)
    text = "the cat sat </s> on the mat. " * 12
    (files / "text.txt").write_text(text + "\n")
    assert finetune.main(["-m", str(tmp_path / "bpe.gguf"), "-f", str(files / "text.txt"),
                          "-c", "32", "--batch", "2", "-val-split", "0.25", "--epochs", "2",
                          "--out", str(files / "a.gguf"), "--silent"]) == 0
    # BOS, the text with its "</s>" as five bytes, no line break at the end
    back = tok.encode(text, parse_special=False).tolist()
    assert seen["ids"] == [257] + back
    assert 258 not in seen["ids"] and seen["ids"][-1] != ord("\n")
    assert seen["shuffle"] is False
    np.testing.assert_array_equal(seen["permutation"], np.arange(len(seen["permutation"])))


def test_a_resume_of_another_run_is_refused_naming_what_differs(files, capsys):
    ck = files / "run.npz"
    common = ["-m", str(files / "base.gguf"), "-c", "96", "--batch", "5",
              "--checkpoint", str(ck), "--out", str(files / "a.gguf"), "--silent"]
    data = ["--data", str(files / "train.jsonl")]
    assert finetune.main(common + data + ["--max-steps", "1"]) == 0
    other = files / "other.jsonl"
    rows = [json.loads(line) for line in (files / "train.jsonl").read_text().splitlines()]
    rows[0]["messages"][1]["content"] = "Quimbo."   # as many rows, one answer changed
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for extra, match in [(["--lora-alpha", "64"], "--lora-alpha=16.0, this fit has --lora"),
                         (["-lr", "3e-4"], "-lr=0.0001, this fit has -lr=0.0003"),
                         (["-wd", "0.1"], "-wd=0.0, this fit has -wd=0.1"),
                         (["--data", str(other)], "--data="),
                         (["--train-on", "all"], "--data=")]:
        argv = common + (extra if extra[0] == "--data" else data + extra)
        with pytest.raises(SystemExit) as info:
            finetune.main(argv + ["--max-steps", "2", "--resume"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "fit.run_info: the checkpoint was made with " in err and match in err, err
    # another model file of the same shapes
    from ggmlopt.io import save_gguf
    twin = Llama(LlamaConfig(vocab_size=257, dim=32, n_layers=2, n_heads=2, max_seq_len=128),
                 seed=1)
    save_gguf(twin, files / "twin.gguf", tokenizer=ByteTokenizer(chat_template=CHATML))
    with pytest.raises(SystemExit):
        finetune.main(["-m", str(files / "twin.gguf")] + common[2:] + data
                      + ["--max-steps", "2", "--resume"])
    assert "--model=" in capsys.readouterr().err
    # the same run goes on
    assert finetune.main(common + data + ["--max-steps", "2", "--resume"]) == 0


def test_what_would_fail_after_training_is_refused_before(files, capsys, tmp_path):
    argv = ["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"), "-c", "96",
            "--out", str(files / "a.gguf")]
    with pytest.raises(SystemExit):
        finetune.main(argv + ["--plot", str(files / "curves.txt")])
    assert "--plot: " in capsys.readouterr().err and not (files / "a.gguf").exists()
    # a tokenizer of another model: its ids (here its BOS) are not the model's
    _bos_vocabulary(tmp_path / "vocab.gguf")   # 259 ids, the base model has 257
    (files / "text.txt").write_text("the cat sat on the mat. " * 12)
    with pytest.raises(SystemExit) as info:
        finetune.main(["-m", str(files / "base.gguf"), "-f", str(files / "text.txt"),
                       "--tokenizer", str(tmp_path / "vocab.gguf"), "-c", "32",
                       "--out", str(files / "a.gguf"), "--silent"])
    assert info.value.code == 2
    assert "--tokenizer: the data holds token id 257, but the model's vocabulary has 257" in \
        capsys.readouterr().err
    # a merged GGUF needs a tokenizer llama.cpp reads: said before training
    hf = files / "hf"
    go.io.save_hf(Llama(LlamaConfig(vocab_size=257, dim=32, n_layers=1, n_heads=2,
                                    max_seq_len=128), seed=0), hf, tokenizer=ByteTokenizer())
    with pytest.raises(SystemExit) as info:
        finetune.main(["-m", str(hf), "-f", str(files / "text.txt"), "-c", "32",
                       "--merge-out", str(files / "m.gguf"), "--silent"])
    assert info.value.code == 2
    assert "--merge-out: the GGUF needs a tokenizer llama.cpp reads" in capsys.readouterr().err
    assert not (files / "m.gguf").exists()


def test_by_default_a_phi3_gets_adapters_on_its_fused_attention(tmp_path, capsys):
    # the command's default targets are lora.apply's: each family's attention
    # projections (Phi-3's qkv_proj and o_proj, not o_proj alone)
    from ggmlopt.io import load_gguf_lora, save_gguf
    from ggmlopt.models import Phi3, Phi3Config
    model = Phi3(Phi3Config(vocab_size=257, dim=32, n_layers=2, n_heads=2, max_seq_len=128),
                 seed=0)
    save_gguf(model, tmp_path / "phi3.gguf", tokenizer=ByteTokenizer(chat_template=CHATML))
    with open(tmp_path / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": "Quimby."}]})
                     + "\n" for q in QUESTIONS)
    assert finetune.main(["-m", str(tmp_path / "phi3.gguf"), "--data",
                          str(tmp_path / "train.jsonl"), "-c", "96", "--batch", "5",
                          "--epochs", "1", "--out", str(tmp_path / "a.gguf"),
                          "--silent"]) == 0
    fresh = Phi3(Phi3Config(vocab_size=257, dim=32, n_layers=2, n_heads=2, max_seq_len=128),
                 seed=0)
    names = [n for n, _ in load_gguf_lora(tmp_path / "a.gguf", fresh)]
    assert names == [f"layers.{i}.self_attn.{p}" for i in range(2)
                     for p in ("qkv_proj", "o_proj")]


def test_out_warns_once_that_llamacpp_ignores_a_phi3_window(tmp_path):
    # said before the training (so a user can stop it), not again when the
    # adapter is written
    import warnings

    from ggmlopt.io import save_gguf
    from ggmlopt.models import Phi3, Phi3Config
    config = Phi3Config(vocab_size=257, dim=32, n_layers=2, n_heads=2, max_seq_len=128,
                        sliding_window=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_gguf(Phi3(config, seed=0), tmp_path / "phi3.gguf",
                  tokenizer=ByteTokenizer(chat_template=CHATML))
    with open(tmp_path / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": "Quimby."}]})
                     + "\n" for q in QUESTIONS)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert finetune.main(["-m", str(tmp_path / "phi3.gguf"), "--data",
                              str(tmp_path / "train.jsonl"), "-c", "96", "--batch", "5",
                              "--epochs", "1", "--out", str(tmp_path / "a.gguf"),
                              "--silent"]) == 0
    ignored = [w for w in said if "phi3 ignores the sliding window" in str(w.message)]
    assert len(ignored) == 1
    assert (tmp_path / "a.gguf").exists()


def test_the_package_command_forwards_finetune_and_refuses_other_arguments():
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "ggmlopt", "finetune", "--help"],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0 and "--lora-targets" in run.stdout
    run = subprocess.run([sys.executable, "-m", "ggmlopt", "--model", "x.gguf"],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 2 and "takes no arguments" in run.stderr
    assert "python -m ggmlopt finetune" in run.stderr and not run.stdout


def test_an_interrupted_run_says_how_to_go_on(files, monkeypatch, capsys):
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(kwargs["checkpoint"])
        with open(kwargs["checkpoint"], "wb") as f:   # as a checkpoint_every save would
            f.write(b"x")
        raise KeyboardInterrupt

    monkeypatch.setattr(go, "fit", interrupted)
    ckpt = files / "run.npz"
    assert finetune.main(["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"),
                          "-c", "96", "--batch", "4", "--checkpoint", str(ckpt),
                          "--out", str(files / "a.gguf"), "--silent"]) == 130
    assert calls == [str(ckpt)]
    err = capsys.readouterr().err
    assert "interrupted" in err and f"{ckpt} holds the last state saved" in err
    assert "--resume" in err


def test_a_resume_over_other_data_says_what_changes_it(files, capsys):
    args = ["-m", str(files / "base.gguf"), "-c", "96", "--batch", "5", "--epochs", "1",
            "--checkpoint", str(files / "run.npz"), "--out", str(files / "a.gguf"), "--silent"]
    assert finetune.main(args + ["--data", str(files / "train.jsonl")]) == 0
    with open(files / "other.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": "Grobnik."}]})
                     + "\n" for q in QUESTIONS * 3)
    with pytest.raises(SystemExit):
        finetune.main(args + ["--data", str(files / "other.jsonl"), "--resume"])
    err = capsys.readouterr().err
    assert "--data=" in err and "writes the day's date" in err


def test_a_tool_call_without_content_is_a_message(tmp_path):
    from ggmlopt.datasets import read_jsonl
    path = tmp_path / "tools.jsonl"
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "weather", "arguments": {"city": "Paris"}}}]}
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Weather?"}, call,
                                             {"role": "tool", "content": "sunny"},
                                             {"role": "assistant", "content": "Sunny."}]})
                    + "\n")
    rows = read_jsonl(path)
    assert rows[0]["messages"][1] == call
    path.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(ValueError, match=r"'content' \(or 'tool_calls'\)"):
        read_jsonl(path)


def test_max_grad_norm_clips_as_fit_does(files, monkeypatch):
    # --max-grad-norm is fit's clip_grad_norm (Trainer's max_grad_norm); none by default
    seen = []
    fit = go.fit
    monkeypatch.setattr(go, "fit", lambda *a, **kw: seen.append(kw["clip_grad_norm"])
                        or fit(*a, **kw))
    base = ["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"), "-c", "96",
            "--batch", "5", "--epochs", "1", "--out", str(files / "a.gguf"), "--silent"]
    assert finetune.main(base) == 0
    assert finetune.main(base + ["--max-grad-norm", "0.5"]) == 0
    assert seen == [None, 0.5]


@pytest.mark.parametrize("var", ["PMI_SIZE", "OMPI_COMM_WORLD_SIZE"])
def test_a_rank_of_mpiexec_without_mpi_is_refused(files, capsys, monkeypatch, var):
    # each rank would run the whole fine-tune on every core and write the same files
    monkeypatch.setenv(var, "3")
    with pytest.raises(SystemExit) as e:
        finetune.main(["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"),
                       "--out", str(files / "a.gguf"), "--silent"])
    assert e.value.code == 2
    assert "one of 3 MPI ranks (mpiexec): give --mpi" in capsys.readouterr().err
    assert not (files / "a.gguf").exists()


def test_keep_types_trains_adapters_over_a_hugging_face_checkpoint(files, capsys):
    """--keep-types on a checkpoint directory: load_hf(keep_types=True) keeps its
    weights in their types, read in place (QLoRA); the PEFT adapter it writes
    puts the same model on the float32 base.  A family load_hf cannot keep
    (GPT-2's Conv1D weights) is refused before training, naming the option."""
    from ggmlopt.io import load_hf, load_peft
    from ggmlopt.models import GPT2, GPT2Config
    from ggmlopt.nn.quantized import quantized_layers
    hf = files / "hf"
    # (the tokenizer from the GGUF: a checkpoint's tokenizer.json needs the tokenizers extra)
    go.io.save_hf(Llama(LlamaConfig(vocab_size=257, dim=32, n_layers=2, n_heads=2,
                                    max_seq_len=128), seed=0), hf)
    assert finetune.main(["-m", str(hf), "--tokenizer", str(files / "base.gguf"),
                          "--data", str(files / "train.jsonl"), "--keep-types",
                          "--lora-rank", "4", "-c", "96", "--batch", "5", "--epochs", "2",
                          "-lr", "1e-2", "--peft-out", str(files / "peft"), "--silent"]) == 0
    ids = np.arange(20).reshape(1, 20)
    kept = load_hf(hf, keep_types=True)
    assert quantized_layers(kept)
    before = kept(ids)
    load_peft(files / "peft", kept)
    plain = load_hf(hf)
    load_peft(files / "peft", plain)
    adapted = kept(ids)
    assert np.abs(adapted - before).max() > 1e-3 * np.abs(before).max()   # it learned
    # F32 kept weights are float32's values: the same model to float32 rounding
    np.testing.assert_allclose(plain(ids), adapted, rtol=0,
                               atol=1e-5 * np.abs(adapted).max())
    gpt2 = files / "gpt2"
    go.io.save_hf(GPT2(GPT2Config(vocab_size=257, dim=32, n_layers=1, n_heads=2,
                                  max_seq_len=128)), gpt2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        finetune.main(["-m", str(gpt2), "--tokenizer", str(files / "base.gguf"),
                       "--data", str(files / "train.jsonl"), "--keep-types",
                       "-c", "96", "--peft-out", str(files / "peft2"), "--silent"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--keep-types: reads" in err and "drop --keep-types" in err
    assert not (files / "peft2").exists()


def test_precision_is_fits_and_a_peft_base_is_named_from_anywhere(files, monkeypatch):
    # --precision reaches fit; the PEFT adapter names its checkpoint base by an
    # absolute path (a relative one is lost once the adapter is loaded elsewhere)
    seen = []
    fit = go.fit
    monkeypatch.setattr(go, "fit", lambda *a, **kw: seen.append(kw["precision"])
                        or fit(*a, **kw))
    go.io.save_hf(Llama(LlamaConfig(vocab_size=257, dim=32, n_layers=2, n_heads=2,
                                    max_seq_len=128), seed=0), files / "hf")
    monkeypatch.chdir(files)
    base = ["-m", "hf", "--tokenizer", "base.gguf", "--data", "train.jsonl", "-c", "96",
            "--batch", "5", "--epochs", "1", "--silent"]
    assert finetune.main(base + ["--peft-out", "peft"]) == 0
    with pytest.warns(UserWarning) if not go.gemm.bf16_support()[0] else nullcontext():
        assert finetune.main(base + ["--out", "a.gguf", "--precision", "bf16"]) == 0
    assert seen == ["f32", "bf16"]
    with open(files / "peft" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == str(files / "hf")


def test_template_variables_render_every_conversation(files, capsys, monkeypatch):
    # a Qwen3 trained without thinking needs enable_thinking=False in every row's
    # rendering: --chat-template-kwargs gives it once (a row's own still wins)
    from ggmlopt import instruct
    seen = []
    real = instruct.chat_windows

    def chat_windows(conversations, tok, n_ctx, **kw):
        seen.append(kw)
        return real(conversations, tok, n_ctx, **kw)

    monkeypatch.setattr(instruct, "chat_windows", chat_windows)
    assert finetune.main(["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"),
                          "-c", "96", "--max-steps", "1", "--silent",
                          "--chat-template-kwargs", '{"enable_thinking": false, "n": 2}',
                          "--out", str(files / "a.gguf")]) == 0
    assert seen[-1]["enable_thinking"] is False and seen[-1]["n"] == 2
    (files / "text.txt").write_text("the cat sat on the mat. " * 40)
    (files / "pairs.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    for extra, match in [
            (["--data", str(files / "train.jsonl"), "--chat-template-kwargs", "[1]"],
             "--chat-template-kwargs: expected a JSON object"),
            (["--data", str(files / "train.jsonl"), "--chat-template-kwargs", "{x"],
             "--chat-template-kwargs: not valid JSON"),
            (["-f", str(files / "text.txt"), "--chat-template-kwargs", "{}"],
             "--chat-template-kwargs: renders chat data"),
            (["--data", str(files / "pairs.jsonl"), "--chat-template-kwargs", "{}"],
             "--chat-template-kwargs: renders the conversations of chat data")]:
        with pytest.raises(SystemExit) as info:
            finetune.main(["-m", str(files / "base.gguf"), "--out", str(files / "b.gguf"),
                           "-c", "32"] + extra)
        assert info.value.code == 2 and match in capsys.readouterr().err
    assert not (files / "b.gguf").exists()


def test_lora_target_names_are_read_without_the_spaces_around_them(files, capsys):
    argv = ["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"), "-c", "96",
            "--max-steps", "1", "--out", str(files / "a.gguf")]
    finetune.main(argv + ["--lora-targets", "q_proj,v_proj"])
    plain = capsys.readouterr().out
    finetune.main(argv + ["--lora-targets", "q_proj, v_proj"])
    spaced = capsys.readouterr().out
    def counts(out):
        return [line for line in out.splitlines() if "trainable params" in line]

    assert counts(plain) and counts(spaced) == counts(plain)


def test_an_output_over_an_input_through_a_link_or_a_directory_is_refused(files, capsys,
                                                                           tmp_path):
    # a link to the model is the model; a file in a checkpoint directory given as
    # --model is the model's
    link = tmp_path / "link.gguf"
    link.symlink_to(files / "base.gguf")
    before = (files / "base.gguf").read_bytes()
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    for argv, match in [
            (["-m", str(link), "--merge-out", str(files / "base.gguf")],
             "is also --model's file"),
            (["-m", str(folder), "--merge-out", str(folder / "model.safetensors")],
             "is inside --model's directory")]:
        with pytest.raises(SystemExit) as info:
            finetune.main(argv + ["--data", str(files / "train.jsonl"), "-c", "96"])
        assert info.value.code == 2
        assert match in capsys.readouterr().err
    assert (files / "base.gguf").read_bytes() == before
    assert not (folder / "model.safetensors").exists()
    # a new file beside the checkpoint's own changes nothing it is read from
    args = finetune.parser().parse_args(["-m", str(folder), "--data",
                                         str(files / "train.jsonl"), "--out",
                                         str(folder / "adapter.gguf"), "--plot",
                                         str(folder / "loss.png")])
    assert not [p for p in finetune._problems(args) if "inside" in p]
