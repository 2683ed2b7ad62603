"""Audit of data-parallel fine-tuning over MPI: LoRA and QLoRA (a base kept in its
GGUF types) on small random Llama, Qwen3 and Gemma 3, trained on chats whose
answers differ in length (so the ranks hold different numbers of labelled
positions), packed or not, with gradient checkpointing, bf16, step schedules,
eval_every, checkpoint_every and resume, against one process on the same
logical batches.

This file is also the worker: ``mpiexec -n P python -m mpi4py THIS SCENARIO OUT
ARGS...`` runs one scenario on MPI.COMM_WORLD and each rank saves OUT/rank<r>.npz.
"""
import json
import os
import sys
import warnings

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from mpi_run import MPIEXEC, ROOT, TESTS, requires_mpi, run_ranks

N_CTX = 112
FAMILIES = ("llama", "qwen3", "gemma3")
# answers of 1 to ~40 characters: every physical batch holds another number of labels
ANSWERS = ["Q.", "Quimby, the old harbour town.", "It is Quimby.", "Quimby",
           "It is Quimby, by the sea.", "Q-town", "Quimby!", "No: Quimby."]
QUESTIONS = ["Capital?", "What is the capital of Zorblax?", "Zorblax's capital?",
             "Name it.", "Which city?", "King's city?"]


def _tokenizer():
    from finetune_files import CHATML

    from ggmlopt.text import ByteTokenizer
    return ByteTokenizer(chat_template=CHATML)


def _chats(n=24):
    return [{"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
                          {"role": "assistant", "content": ANSWERS[(3 * i) % len(ANSWERS)]}]}
            for i in range(n)]


def write_base(folder, family, qtype, seed=1):
    """folder/<family>-<qtype>-<seed>.gguf: a small random model of the family."""
    from ggmlopt.io import save_gguf
    from ggmlopt.models import Gemma3, Gemma3Config, Llama, LlamaConfig, Qwen3, Qwen3Config
    g = {"vocab_size": 257, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "max_seq_len": 128}
    model = {"llama": lambda: Llama(LlamaConfig(**g), seed=seed),
             "qwen3": lambda: Qwen3(Qwen3Config(**g, head_dim=8), seed=seed),
             "gemma3": lambda: Gemma3(Gemma3Config(**g, head_dim=8, sliding_window=5,
                                                   query_pre_attn_scalar=8.0,
                                                   sliding_layers=(True, False)), seed=seed),
             }[family]()
    path = os.path.join(folder, f"{family}-{qtype}-{seed}.gguf")
    save_gguf(model, path, tokenizer=_tokenizer(),
              dtype=np.float32 if qtype == "f32" else qtype)
    return path


def dataset(packing, logical, nchats=24):
    """The chats' windows (packed or not), padded with masked rows to whole logical
    batches as the finetune command pads them."""
    import ggmlopt as go
    ds = go.Dataset.from_chat(_chats(nchats), _tokenizer(), N_CTX, packing=packing)
    x, y = np.asarray(ds.data), np.asarray(ds.labels)
    pad = -x.shape[0] % logical
    x = np.concatenate([x, np.full((pad, N_CTX), 0, np.int32)])
    y = np.concatenate([y, np.full((pad, N_CTX), -1, np.int32)])
    return go.Dataset.from_arrays(x, y)


def adapted(path, qlora, gc):
    from ggmlopt import lora
    from ggmlopt.io import load_gguf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = load_gguf(path, keep_types=qlora)
    lora.apply(model, rank=4, alpha=8.0, seed=0)
    if gc:
        model.gradient_checkpointing_enable()
    return model


def frozen_state(model):
    """Every weight that must never change: frozen Parameters and kept layers."""
    from ggmlopt.nn.quantized import quantized_layers
    out = [p.data.copy() for p in model.parameters() if not p.requires_grad]
    out += [np.asarray(q.qweight).view(np.uint8).ravel().copy()
            for _, q in quantized_layers(model)]
    return out


def trained(model):
    return np.concatenate([p.data.ravel() for p in model.parameters() if p.requires_grad])


def history_rows(hist):
    rows = [[e.train_loss, e.train_loss_unc, e.train_accuracy, e.train_accuracy_unc,
             e.val_loss, e.val_loss_unc, e.val_accuracy, e.val_accuracy_unc] for e in hist]
    evals = [[e.step, e.train_loss, e.val_loss, e.val_loss_unc, e.val_accuracy]
             for e in hist.evaluations] or [[0, 0, 0, 0, 0]]
    return np.array(rows, np.float64), np.array(evals, np.float64)


def sft(comm, path, qlora=False, packing=False, gc=False, precision="f32", logical=4,
        physical=2, nepoch=2, checkpoint=None, resume=False, checkpoint_every=None,
        max_steps=None, steps=None, nchats=24):
    """fit of LoRA (QLoRA) on the chats: a dict of what the ranks report."""
    import ggmlopt as go
    from ggmlopt import schedules
    model = adapted(path, qlora, gc)
    before = frozen_state(model)
    ds = dataset(packing, logical, nchats)
    base = go.OptimizerParams(go.AdamWParams(alpha=2e-2, wd=0.01))
    nb = ds.ndata // logical
    steps = steps or (nb - 1) * nepoch   # one logical batch validates
    sched = schedules.WarmupCosine(2, steps, base=base, unit="step")
    kw = {} if comm is None else {"comm": comm}
    hist = go.fit(model, ds, "cross_entropy", sched, nepoch=nepoch, nbatch_logical=logical,
                  nbatch_physical=physical, val_split=1.0 / nb - 1e-9,
                  silent=True, seed=5, precision=precision, eval_every=2,
                  checkpoint=checkpoint, resume=resume, checkpoint_every=checkpoint_every,
                  max_steps=max_steps, **kw)
    unchanged = all(np.array_equal(a, b) for a, b in zip(before, frozen_state(model)))
    rows, evals = history_rows(hist)
    return {"params": trained(model), "history": rows, "evals": evals,
            "unchanged": np.array(unchanged),
            "ndata": np.array([hist.ndata_train, hist.ndata_val])}


# ---- the tests (this process), the worker below -----------------------------------------

WORKER = os.path.abspath(__file__)
ALPHA = 2e-2


def outcome(fn):
    """fn()'s dict, or the exception's type and message as one."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"error": np.array(f"{type(e).__name__}: {e}")}


def mpirun(nranks, tmp_path, **kw):
    """sft(**kw) on nranks ranks: rank 0's report, after checking every rank holds
    the same adapters bit for bit."""
    out = tmp_path / f"out{nranks}-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    ranks = run_ranks(WORKER, nranks, out, ["sft", str(out), json.dumps(kw)], timeout=300)
    if "params" in ranks[0]:
        for got in ranks:
            assert np.array_equal(got["params"], ranks[0]["params"])
            assert bool(got["unchanged"])   # no rank trained a frozen weight
    return ranks[0]


def one(**kw):
    """sft(**kw) in this process, with one thread as each rank."""
    import ggmlopt as go
    before = go.get_num_threads()
    go.set_num_threads(1)
    try:
        return sft(None, **kw)
    finally:
        go.set_num_threads(before)


def assert_same(got, ref):
    """Bit for bit: adapters, History (epochs and evaluations), split."""
    assert "error" not in got, got.get("error")
    np.testing.assert_array_equal(got["params"], ref["params"])
    np.testing.assert_array_equal(got["history"], ref["history"])
    np.testing.assert_array_equal(got["evals"], ref["evals"])
    np.testing.assert_array_equal(got["ndata"], ref["ndata"])
    assert bool(got["unchanged"]) and bool(ref["unchanged"])


def assert_within_rounding(got, ref, nsteps, logical, physical):
    """Another summation order of the physical batches' gradients: within
    lm_dist_problem.rounding_bound (float32 rounding of the sums, through AdamW),
    plus two ulps of each value."""
    from lm_dist_problem import rounding_bound
    bound = rounding_bound(nsteps, logical, physical, alpha=ALPHA)
    d = np.abs(got["params"] - ref["params"]) - 2 * np.spacing(np.abs(ref["params"]))
    assert d.max() <= bound, (d.max(), bound)
    # the losses of parameters that close: test_mpi.py's tolerance of the History
    np.testing.assert_allclose(got["history"], ref["history"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["evals"], ref["evals"], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(got["ndata"], ref["ndata"])


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    folder = tmp_path_factory.mktemp("bases")
    return {(f, q, s): write_base(str(folder), f, q, s)
            for f in FAMILIES for q in ("f32", "q8_0") for s in (1, 2)}


# one physical batch a rank a step: the sum of the two ranks' gradients is the
# one addition one process makes (a + b == b + a), so every bit agrees
@pytest.mark.parametrize("family,qlora,packing,gc,precision", [
    ("llama", True, True, True, "f32"),
    ("qwen3", True, False, False, "f32"),
    ("gemma3", False, True, True, "f32"),
    ("llama", False, False, False, "bf16"),
])
def test_two_ranks_equal_one_process_bit_for_bit(bases, tmp_path, family, qlora, packing, gc,
                                                 precision):
    kw = {"path": bases[family, "q8_0" if qlora else "f32", 1], "qlora": qlora,
          "packing": packing, "gc": gc, "precision": precision, "nchats": 22}
    ds = dataset(packing, 4, 22)
    per_row = (np.asarray(ds.labels) >= 0).sum(axis=1)
    assert len(set(per_row.tolist())) > 3 and per_row.min() == 0   # unequal, padding rows
    ref = one(**kw)
    assert_same(mpirun(2, tmp_path, **kw), ref)


def test_two_batches_a_rank_within_rounding(bases, tmp_path):
    kw = {"path": bases["gemma3", "q8_0", 1], "qlora": True, "packing": True, "gc": True,
          "logical": 8, "physical": 2, "nchats": 48}
    ref = one(**kw)
    got = mpirun(2, tmp_path, **kw)
    nsteps = int(ref["ndata"][0]) // 8 * 2
    assert_within_rounding(got, ref, nsteps, 8, 2)


def test_checkpoint_of_two_ranks_resumes_on_one_process_bit_for_bit(bases, tmp_path):
    """A rank evaluating one physical batch a step (opt_period 2 over 2 ranks) kept
    the last step's summed gradient through the epoch's validation, and saved it;
    one process (two batches a step) resuming added its first batch to it: the
    adapters were 0.015 off (of 0.26) before the fix."""
    ckpt = str(tmp_path / "c.npz")
    kw = {"path": bases["llama", "q8_0", 1], "qlora": True, "packing": True, "steps": 10}
    whole = one(**kw, nepoch=2)
    assert "error" not in mpirun(2, tmp_path, **kw, nepoch=1, checkpoint=ckpt)
    from ggmlopt.checkpoint import load_state
    sd = load_state(ckpt)
    assert not any(sd[k].any() for k in sd if k.startswith("grad."))
    assert_same(one(**kw, nepoch=2, checkpoint=ckpt, resume=True), whole)


def test_checkpoints_resume_across_ranks_and_mid_epoch(bases, tmp_path):
    kw = {"path": bases["qwen3", "q8_0", 1], "qlora": True, "gc": True, "steps": 10}
    whole = one(**kw, nepoch=2)
    # one process's checkpoint resumed on two ranks
    ckpt = str(tmp_path / "c1.npz")
    one(**kw, nepoch=1, checkpoint=ckpt)
    assert_same(mpirun(2, tmp_path, **kw, nepoch=2, checkpoint=ckpt, resume=True), whole)
    # two ranks stopped after 3 steps (mid-epoch, checkpoint_every=1), resumed on two
    ckpt = str(tmp_path / "c2.npz")
    mpirun(2, tmp_path, **kw, nepoch=None, max_steps=3, checkpoint=ckpt, checkpoint_every=1)
    assert_same(mpirun(2, tmp_path, **kw, nepoch=2, checkpoint=ckpt, resume=True), whole)


def test_two_rank_checkpoint_resumes_on_three_ranks(bases, tmp_path):
    # 12 windows a step in batches of 2: 3 a rank on 2 ranks, 2 a rank on 3
    kw = {"path": bases["qwen3", "q8_0", 1], "qlora": True, "logical": 12, "physical": 2,
          "nchats": 48, "steps": 6}
    whole = one(**kw, nepoch=2)
    ckpt = str(tmp_path / "c.npz")
    mpirun(2, tmp_path, **kw, nepoch=1, checkpoint=ckpt)
    got = mpirun(3, tmp_path, **kw, nepoch=2, checkpoint=ckpt, resume=True)
    assert_within_rounding(got, whole, 6, 12, 2)


def test_resume_over_another_base_is_refused_on_every_rank(bases, tmp_path):
    ckpt = str(tmp_path / "c.npz")
    kw = {"qlora": True, "steps": 10}
    mpirun(2, tmp_path, path=bases["gemma3", "q8_0", 1], **kw, nepoch=1, checkpoint=ckpt)
    out = tmp_path / "refused"
    out.mkdir()
    ranks = run_ranks(WORKER, 2, out, ["sft", str(out), json.dumps(
        {"path": bases["gemma3", "q8_0", 2], **kw, "nepoch": 2, "checkpoint": ckpt,
         "resume": True})], timeout=300)
    for got in ranks:
        assert "frozen_digest" in str(got["error"]) and "other frozen weights" in str(
            got["error"])


def test_frozen_weights_have_no_arena_and_no_state(bases, tmp_path):
    out = tmp_path / "arena"
    out.mkdir()
    ranks = run_ranks(WORKER, 2, out, ["arena", str(out), bases["llama", "q8_0", 1]],
                      timeout=300)
    for got in ranks:
        n = int(got["trainable"])
        assert int(got["arena"]) == n and int(got["frozen_params"]) > 0
        assert int(got["state_bytes"]) >= 2 * 4 * n   # AdamW's m and v of the adapters
        assert int(got["state_bytes"]) < 2 * 4 * (n + 16 * len(got["names"]))  # (padding)
        assert all(".lora_" in str(name) for name in got["names"])


# ---- the command ---------------------------------------------------------------------------

def _command(files, out, *extra):
    return ["-m", str(files / "q8.gguf"), "--data", str(files / "sft.jsonl"), "--keep-types",
            "--packing", "--gradient-checkpointing", "--lora-rank", "4", "-c", str(N_CTX),
            "--batch", "4", "--lr", "1e-2", "-val-split", "0.25", "--eval-every", "1",
            "--out", str(files / out), "--silent", *extra]


@pytest.fixture
def command_files(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    from finetune_files import write_files

    from ggmlopt.io import load_gguf, save_gguf
    write_files(tmp_path)
    model, tok = load_gguf(str(tmp_path / "base.gguf"))
    save_gguf(model, str(tmp_path / "q8.gguf"), tokenizer=tok, dtype="q8_0")
    with open(tmp_path / "sft.jsonl", "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in _chats())
    return tmp_path


def _finetune(nranks, args):
    import subprocess
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS,
                                                       os.environ.get("PYTHONPATH", "")]),
               OPENBLAS_NUM_THREADS="1", GGMLOPT_NUM_THREADS="1")
    cmd = ([MPIEXEC, "-n", str(nranks)] if nranks else []) + [
        sys.executable, "-m", "ggmlopt.finetune", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stderr


def test_finetune_mpi_writes_the_micro_batched_adapter_byte_for_byte(command_files):
    """--mpi over P ranks is one process with --micro-batch batch/P, to the byte
    (each rank's share is one micro-batch, whose mean loss weighs the same
    whatever its answer tokens); the default one process (one micro-batch a
    step, the mean over every answer token of the step) differs (documented in
    docs/fine-tuning.md and --mpi's help)."""
    from ggmlopt.finetune import parser
    mpi = next(a for a in parser()._actions if "--mpi" in a.option_strings)
    assert "one process's with that --micro-batch" in mpi.help   # said where it is chosen
    files = command_files
    sched = ["--epochs", "2", "--lr-schedule", "cosine", "--warmup", "1"]
    _finetune(0, _command(files, "one.gguf", *sched, "--micro-batch", "2"))
    _finetune(2, _command(files, "two.gguf", *sched, "--mpi"))
    assert (files / "one.gguf").read_bytes() == (files / "two.gguf").read_bytes()
    _finetune(0, _command(files, "whole.gguf", *sched))
    assert (files / "one.gguf").read_bytes() != (files / "whole.gguf").read_bytes()
    # --mpi's checkpoint, resumed by one process with the same micro-batches
    ck = str(files / "c.npz")
    _finetune(2, _command(files, "first.gguf", "--epochs", "1", "--mpi", "--checkpoint", ck))
    _finetune(0, _command(files, "resumed.gguf", "--epochs", "2", "--micro-batch", "2",
                          "--checkpoint", ck, "--resume"))
    _finetune(0, _command(files, "straight.gguf", "--epochs", "2", "--micro-batch", "2"))
    assert (files / "resumed.gguf").read_bytes() == (files / "straight.gguf").read_bytes()


def arena_report(comm, path):
    import ggmlopt as go
    from ggmlopt.distributed import optimizer_state_nbytes
    model = adapted(path, True, False)
    ctx = go.OptContext(model, batch_size=2, ne_datapoint=N_CTX, opt_period=2,
                        loss_type="cross_entropy", comm=comm)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {"arena": np.array(ctx.arena.size),
            "trainable": np.array(sum(p.data.size for p in model.parameters()
                                      if p.requires_grad)),
            "frozen_params": np.array(len(ctx.frozen_parameters())),
            "state_bytes": np.array(optimizer_state_nbytes(ctx)), "names": np.array(names)}


def main(scenario, out, *args):
    from mpi4py import MPI

    from ggmlopt import distributed
    comm = MPI.COMM_WORLD
    distributed.set_rank_threads(1)
    if scenario == "sft":   # args: sft's keywords as JSON
        got = outcome(lambda: sft(comm, **json.loads(args[0])))
    elif scenario == "arena":
        got = arena_report(comm, args[0])
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    np.savez(os.path.join(out, f"rank{comm.Get_rank()}.npz"), **got)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main(*sys.argv[1:])
else:
    pytestmark = requires_mpi
