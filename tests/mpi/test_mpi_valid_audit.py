"""Audit of fit(..., shuffle="train") and ``finetune --valid`` over MPI: two ranks
equal one process (bit for bit with one physical batch a rank a step, as
test_mpi_finetune_audit.py claims for shuffle=True), the validation part stays
the data's last datapoints on every rank, checkpoints resume across ranks and
refuse another shuffle mode, and ``finetune --mpi --valid`` writes the adapter
of one process with --micro-batch batch/P.

This file is also the worker: ``mpiexec -n P python -m mpi4py THIS SCENARIO OUT
ARGS...`` runs one scenario on MPI.COMM_WORLD and each rank saves OUT/rank<r>.npz.
"""
import json
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from mpi_run import MPIEXEC, ROOT, TESTS, requires_mpi, run_ranks
from test_mpi_finetune_audit import (
    _chats,
    adapted,
    dataset,
    frozen_state,
    history_rows,
    outcome,
    trained,
    write_base,
)

N_CTX = 112
LOGICAL, PHYSICAL = 4, 2   # one physical batch a rank a step on two ranks


def sft(comm, path, shuffle="train", packing=True, nepoch=2, eval_every=1, checkpoint=None,
        resume=False, checkpoint_every=None, max_steps=None, nchats=22, nvalid=2, masked=0):
    """LoRA over a kept Q8_0 base on the chats, the last nvalid logical batches held
    out (shuffle="train"), the labels of the last `masked` rows masked: what the
    ranks report, with the dataset's order."""
    import ggmlopt as go
    from ggmlopt import schedules
    model = adapted(path, True, False)
    before = frozen_state(model)
    ds = masked_tail(dataset(packing, LOGICAL, nchats), masked)
    nb = ds.ndata // LOGICAL
    from ggmlopt.finetune import _valid_split
    split = _valid_split(nb - nvalid, nvalid)
    base = go.OptimizerParams(go.AdamWParams(alpha=2e-2, wd=0.01))
    sched = schedules.WarmupCosine(2, (nb - nvalid) * 2, base=base, unit="step")
    kw = {} if comm is None else {"comm": comm}
    hist = go.fit(model, ds, "cross_entropy", sched, nepoch=nepoch, nbatch_logical=LOGICAL,
                  nbatch_physical=PHYSICAL, val_split=split, silent=True, seed=5,
                  eval_every=eval_every, checkpoint=checkpoint, resume=resume,
                  checkpoint_every=checkpoint_every, max_steps=max_steps, shuffle=shuffle,
                  **kw)
    rows, evals = history_rows(hist)
    return {"params": trained(model), "history": rows, "evals": evals,
            "unchanged": np.array(all(np.array_equal(a, b)
                                      for a, b in zip(before, frozen_state(model)))),
            "ndata": np.array([hist.ndata_train, hist.ndata_val]),
            "permutation": np.asarray(ds.permutation)}


def masked_tail(ds, masked):
    import ggmlopt as go
    y = np.asarray(ds.labels).copy()
    y[len(y) - masked:] = -1
    return go.Dataset.from_arrays(np.asarray(ds.data), y)


# ---- the tests (this process), the worker below -----------------------------------------

WORKER = os.path.abspath(__file__)


def mpirun(tmp_path, **kw):
    """sft(**kw) on two ranks: rank 0's report, after checking every rank holds the
    same adapters and the same order of the data."""
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    ranks = run_ranks(WORKER, 2, out, ["sft", str(out), json.dumps(kw)], timeout=300)
    if "params" in ranks[0]:
        for got in ranks:
            assert np.array_equal(got["params"], ranks[0]["params"])
            assert np.array_equal(got["permutation"], ranks[0]["permutation"])
            assert bool(got["unchanged"])
    return ranks


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
    assert "error" not in got, got.get("error")
    for key in ("params", "history", "evals", "ndata", "permutation"):
        np.testing.assert_array_equal(got[key], ref[key], err_msg=key)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    return write_base(str(tmp_path_factory.mktemp("bases")), "llama", "q8_0")


def test_shuffle_train_two_ranks_equal_one_process_bit_for_bit(base, tmp_path):
    ref = one(path=base)
    got = mpirun(tmp_path, path=base)[0]
    assert_same(got, ref)
    # the last two logical batches validate, never shuffled in; the training part was
    n, nval = len(ref["permutation"]), 2 * LOGICAL
    np.testing.assert_array_equal(ref["permutation"][n - nval:], np.arange(n - nval, n))
    assert not np.array_equal(ref["permutation"][:n - nval], np.arange(n - nval))
    assert ref["ndata"].tolist() == [n - nval, nval]
    # shuffle=True on the same data validates on other datapoints: another History
    other = one(path=base, shuffle=True)
    assert not np.array_equal(other["permutation"][n - nval:], np.arange(n - nval, n))


@pytest.mark.parametrize("masked", [0, 3])
def test_shuffle_train_validation_loss_is_the_last_datapoints(base, tmp_path, masked):
    """The History's last validation loss is the trained adapters' loss on the
    dataset's last datapoints, in the physical batches fit validates in; with the
    last 3 rows masked (a --valid file's padding) one rank's share of the last
    validation step has no label, and is left out on two ranks as in one process."""
    import ggmlopt as go
    from ggmlopt.result import Result
    ref = one(path=base, nepoch=1, eval_every=None, masked=masked)
    got = mpirun(tmp_path, path=base, nepoch=1, eval_every=None, masked=masked)[0]
    assert_same(got, ref)
    ds = masked_tail(dataset(True, LOGICAL, 22), masked)
    labels = np.asarray(ds.labels)
    assert (labels[-4] >= 0).any() or not masked   # the last step's first batch has labels
    model = adapted(base, True, False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p, v in zip(trainable, np.split(got["params"], np.cumsum(
            [p.data.size for p in trainable])[:-1])):
        p.data[...] = v.reshape(p.data.shape)
    # the validation physical batches one by one (a batch's mean loss, as fit's)
    tail = go.Dataset.from_arrays(np.asarray(ds.data)[-2 * LOGICAL:], labels[-2 * LOGICAL:])
    ctx = go.OptContext(model, batch_size=PHYSICAL, ne_datapoint=N_CTX,
                        loss_type="cross_entropy", build_type=go.BuildType.FORWARD,
                        inputs_dtype=np.int32, class_labels=True)
    result = Result()
    go.epoch(ctx, tail, None, result, 0)
    np.testing.assert_array_equal(got["history"][-1, 4], result.loss()[0])
    assert not np.isnan(result.loss()[0])


def test_shuffle_train_checkpoints_resume_across_ranks(base, tmp_path):
    whole = one(path=base)
    # two ranks stopped after 3 steps (mid-epoch), resumed on two and on one
    ckpt = str(tmp_path / "c.npz")
    mpirun(tmp_path, path=base, nepoch=None, max_steps=3, checkpoint=ckpt, checkpoint_every=1)
    from ggmlopt.checkpoint import load_state
    assert int(load_state(ckpt)["fit.shuffle"]) == 2
    assert_same(mpirun(tmp_path, path=base, checkpoint=ckpt, resume=True)[0], whole)
    assert_same(one(path=base, checkpoint=ckpt, resume=True), whole)
    # another shuffle mode is another run: refused on every rank
    for other in (True, False):
        for got in mpirun(tmp_path, path=base, shuffle=other, checkpoint=ckpt, resume=True):
            assert "fit.shuffle: the checkpoint was made with shuffle=2" in str(got["error"])


# ---- the command ---------------------------------------------------------------------------

@pytest.fixture
def command_files(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    from finetune_files import write_files

    from ggmlopt.io import load_gguf, save_gguf
    write_files(tmp_path)
    model, tok = load_gguf(str(tmp_path / "base.gguf"))
    save_gguf(model, str(tmp_path / "q8.gguf"), tokenizer=tok, dtype="q8_0")
    chats = _chats(30)
    for name, rows in (("sft.jsonl", chats[:21]), ("valid.jsonl", chats[21:])):
        with open(tmp_path / name, "w") as f:
            f.writelines(json.dumps(c) + "\n" for c in rows)
    return tmp_path


def _finetune(nranks, files, out, *extra):
    import subprocess
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS,
                                                       os.environ.get("PYTHONPATH", "")]),
               OPENBLAS_NUM_THREADS="1", GGMLOPT_NUM_THREADS="1")
    cmd = ([MPIEXEC, "-n", str(nranks)] if nranks else []) + [
        sys.executable, "-m", "ggmlopt.finetune", "-m", str(files / "base.gguf"),
        "--data", str(files / "sft.jsonl"), "--valid", str(files / "valid.jsonl"),
        "--lora-rank", "4", "-c", str(N_CTX), "--batch", "4", "--lr", "1e-2",
        "--out", str(files / out), "--silent", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return (files / out).read_bytes()


@pytest.mark.parametrize("extra", [
    ("--epochs", "2", "--eval-every", "2"),
    ("--packing", "--keep-types", "--max-steps", "5", "--eval-every", "1",
     "--gradient-checkpointing"),
])
def test_finetune_mpi_valid_is_one_process_with_micro_batch(command_files, extra):
    files = command_files
    if "--keep-types" in extra:
        extra = ["-m", str(files / "q8.gguf"), *extra]
    two = _finetune(2, files, "two.gguf", "--mpi", *extra)
    assert _finetune(0, files, "one.gguf", "--micro-batch", "2", *extra) == two


def _history(path):
    """A checkpoint's History without the wall times and threads, and its evaluations."""
    from ggmlopt.checkpoint import load_state
    sd = load_state(path)
    return sd["fit.history"][:, :9], sd["fit.evals"]


def test_finetune_mpi_valid_of_one_example(command_files):
    """One validation example in a batch of 4: three masked rows, one rank's share
    of the validation batch has no label; the History is one process's."""
    files = command_files
    with open(files / "valid.jsonl", "w") as f:
        f.write(json.dumps(_chats(1)[0]) + "\n")
    two = _finetune(2, files, "two.gguf", "--mpi", "--epochs", "2", "--eval-every", "1",
                    "--checkpoint", str(files / "two.npz"))
    one = _finetune(0, files, "one.gguf", "--micro-batch", "2", "--epochs", "2",
                    "--eval-every", "1", "--checkpoint", str(files / "one.npz"))
    assert one == two
    for a, b in zip(_history(files / "one.npz"), _history(files / "two.npz")):
        np.testing.assert_array_equal(a, b)
    hist, evals = _history(files / "one.npz")
    assert not np.isnan(hist[:, 5]).any() and len(evals) == 2 * 6


def test_finetune_mpi_valid_checkpoint_resumes_on_one_process(command_files):
    files = command_files
    ck = str(files / "c.npz")
    _finetune(2, files, "first.gguf", "--mpi", "--epochs", "1", "--checkpoint", ck,
              "--checkpoint-every", "2")
    from ggmlopt.checkpoint import load_state
    assert int(load_state(ck)["fit.shuffle"]) == 2
    resumed = _finetune(0, files, "resumed.gguf", "--epochs", "2", "--micro-batch", "2",
                        "--checkpoint", ck, "--resume")
    assert resumed == _finetune(0, files, "straight.gguf", "--epochs", "2", "--micro-batch",
                                "2")


def main(scenario, out, *args):
    from mpi4py import MPI

    from ggmlopt import distributed
    comm = MPI.COMM_WORLD
    distributed.set_rank_threads(1)
    if scenario == "sft":   # args: sft's keywords as JSON
        got = outcome(lambda: sft(comm, **json.loads(args[0])))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    np.savez(os.path.join(out, f"rank{comm.Get_rank()}.npz"), **got)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main(*sys.argv[1:])
else:
    pytestmark = requires_mpi
