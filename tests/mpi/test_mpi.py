"""Data-parallel training under real MPI: tests/mpi/worker.py runs under
``mpiexec -n 2`` and ``-n 3`` (a subprocess with a timeout, so a hang fails instead
of blocking), every rank reports, and this process compares with one process.
Skips with a message when mpi4py or mpiexec is missing (``pip install -e '.[mpi]'``).
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi_run import MPIEXEC, ROOT, TESTS, requires_mpi, run_ranks

WORKER = os.path.join(TESTS, "mpi", "worker.py")
sys.path.insert(0, TESTS)
from dist_problem import history_array, make_problem, run

pytestmark = requires_mpi

RTOL, ATOL = 1e-5, 1e-6


def mpirun(nranks, tmp_path, *args):
    """The worker on nranks ranks; returns each rank's saved arrays."""
    out = tmp_path / f"out{nranks}-{'-'.join(a.replace('/', '_')[-12:] for a in args)}"
    out.mkdir()
    return run_ranks(WORKER, nranks, out, [args[0], str(out), *args[1:]], timeout=180)


@pytest.mark.parametrize("shard", ["full", "shard"])
@pytest.mark.parametrize("optimizer", ["ADAMW", "SGD"])
@pytest.mark.parametrize("nranks", [2, 3])
def test_equals_one_process(tmp_path, nranks, optimizer, shard):
    ref, ref_hist, _ = run(None, optimizer)
    ranks = mpirun(nranks, tmp_path, "equivalence", optimizer, shard)
    for r, got in enumerate(ranks):  # bit for bit across ranks
        assert np.array_equal(got["params"], ranks[0]["params"]), f"rank {r} differs"
        np.testing.assert_allclose(got["history"], history_array(ref_hist), rtol=RTOL,
                                   atol=1e-7)
    np.testing.assert_allclose(ranks[0]["params"], ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("shard", ["full", "shard"])
def test_frozen_parameters_equal_one_process(tmp_path, shard):
    ref, ref_hist, model = run(None, "ADAMW", frozen=("0.weight",))
    assert not model[0].weight.requires_grad
    initial = make_problem(0)[0][0].weight.data.ravel()
    first = initial.size  # the frozen weight leads the flat parameters
    np.testing.assert_array_equal(ref[:first], initial)
    ranks = mpirun(2, tmp_path, "frozen", shard)
    for got in ranks:
        assert np.array_equal(got["params"], ranks[0]["params"])
        np.testing.assert_allclose(got["history"], history_array(ref_hist), rtol=RTOL,
                                   atol=1e-7)
    np.testing.assert_array_equal(ranks[0]["params"][:first], ref[:first])  # never changed
    np.testing.assert_allclose(ranks[0]["params"], ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("nranks", [2, 3])
def test_each_rank_holding_its_part(tmp_path, nranks):
    # one logical batch of all 60 datapoints (nothing shuffled): rank r's block is its share
    ref, ref_hist, _ = run(None, "ADAMW", ndata=60, val_split=0.0)
    ranks = mpirun(nranks, tmp_path, "part")
    for got in ranks:
        assert np.array_equal(got["params"], ranks[0]["params"])
        # the History counts the whole data, not the rank's part
        assert got["ndata"].tolist() == [ref_hist.ndata_train, ref_hist.ndata_val] == [60, 0]
    np.testing.assert_allclose(ranks[0]["params"], ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("nranks", [2, 3])
def test_drop_last_leaves_out_what_one_process_leaves_out(tmp_path, nranks):
    # 366 datapoints in logical batches of 60: the last 6 are not even a physical batch
    ref, ref_hist, _ = run(None, "ADAMW", ndata=366, drop_last=True)
    ranks = mpirun(nranks, tmp_path, "drop-last")
    for got in ranks:
        assert np.array_equal(got["params"], ranks[0]["params"])
        assert got["ndata"].tolist() == [ref_hist.ndata_train, ref_hist.ndata_val]
        np.testing.assert_allclose(got["history"], history_array(ref_hist), rtol=RTOL,
                                   atol=1e-7)
    np.testing.assert_allclose(ranks[0]["params"], ref, rtol=RTOL, atol=ATOL)


def test_resume_on_another_number_of_ranks(tmp_path):
    ckpt = str(tmp_path / "run.npz")
    ref, ref_hist, _ = run(None, "ADAMW", nepoch=4)
    mpirun(2, tmp_path, "resume", ckpt, "2", "fresh", "shard")
    ranks = mpirun(3, tmp_path, "resume", ckpt, "4", "resume", "full")
    for got in ranks:
        assert np.array_equal(got["params"], ranks[0]["params"])
    np.testing.assert_allclose(ranks[0]["params"], ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ranks[0]["history"], history_array(ref_hist), rtol=RTOL,
                               atol=1e-7)


@pytest.mark.parametrize("scenario,error", [("fail-setup", "ValueError"),
                                            ("fail-argument", "ValueError"),
                                            ("fail-training", "FloatingPointError")])
def test_a_failing_rank_stops_every_rank(tmp_path, scenario, error):
    ranks = mpirun(3, tmp_path, scenario)
    assert str(ranks[1]["kind"]) == error
    for r in (0, 2):
        assert str(ranks[r]["kind"]) == "RankFailed"
        assert f"rank 1 of 3 failed ({error}" in str(ranks[r]["msg"])


def test_the_memory_check_counts_every_rank_on_the_machine(tmp_path):
    # each rank has room for its own training, the machine not for both: fit
    # refuses on every rank before anything is allocated (it checked each rank alone)
    for got in mpirun(2, tmp_path, "memory"):
        assert str(got["kind"]) == "MemoryError", got["msg"]
        assert "2 ranks on this machine" in str(got["msg"])


def test_uneven_logical_batch_on_three_ranks(tmp_path):
    # 2 physical batches per logical batch cannot split over 3 ranks
    for got in mpirun(3, tmp_path, "uneven"):
        assert str(got["kind"]) == "ValueError"
        assert "multiple of 3 x nbatch_physical = 30" in str(got["msg"])


# ---- the mnist example's defaults on any number of ranks -------------------------------

def mpirun_example(nranks, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               OPENBLAS_NUM_THREADS="1")
    cmd = [MPIEXEC, "-n", str(nranks), sys.executable, "-m", "ggmlopt.examples.mnist", "--mpi",
           "--silent", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                              check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} hangs (no answer in 300 s): {e.stderr}")


@pytest.mark.parametrize(("nranks", "model", "batches"), [
    (2, "cnn", "nbatch_logical=60, nbatch_physical=10"),    # one process: 50/10
    (3, "fc", "nbatch_logical=150, nbatch_physical=50"),    # one process: 100/50
    (2, "fc", "nbatch_logical=100, nbatch_physical=50"),
])
def test_mnist_example_defaults_fit_the_rank_count(nranks, model, batches):
    pytest.importorskip("sklearn")  # the offline digits: 1500 training images
    proc = mpirun_example(nranks, "--model", model, "--epochs", "1")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.count("mnist: test_acc=") == 1  # rank 0 alone prints
    assert f"model: mnist-{model}" in proc.stdout and batches in proc.stdout


def test_mnist_example_refuses_batches_that_do_not_split_before_any_work():
    pytest.importorskip("sklearn")
    proc = mpirun_example(3, "--nbatch-logical", "100", "--epochs", "1")
    assert proc.returncode != 0
    assert proc.stderr.count("valid --nbatch-logical values: 30, 60, 150, 300, 750") == 1
    assert "Traceback" not in proc.stderr and "MPI_Abort" not in proc.stderr
    assert "test_acc" not in proc.stdout and "model:" not in proc.stdout


# ---- per rank: masks, predictions, language models, threads, more ranks than cores ----

@pytest.mark.parametrize("nranks", [2, 3])
def test_each_rank_draws_its_own_masks(tmp_path, nranks):
    ranks = mpirun(nranks, tmp_path, "masks")
    masks = ranks[0]["masks"]
    assert masks.shape[0] == nranks
    for r in range(nranks):
        for q in range(r):
            assert not np.array_equal(masks[r], masks[q]), f"ranks {q} and {r} share a mask"
    for got in ranks:  # one shared generator (the shuffles), the same parameters
        assert np.array_equal(got["masks"], masks)
        assert np.array_equal(got["shared"], ranks[0]["shared"])
        assert np.array_equal(got["params"], ranks[0]["params"])
    (tmp_path / "again").mkdir()
    again = mpirun(nranks, tmp_path / "again", "masks")  # the same seed and rank count
    assert np.array_equal(again[0]["masks"], masks)
    assert np.array_equal(again[0]["params"], ranks[0]["params"])


def _single_preds():
    model, ds = make_problem(0)
    import ggmlopt as go
    ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                        loss_type=go.LossType.CROSS_ENTROPY, opt_period=6)
    rt, rv = go.Result(), go.Result()
    go.epoch(ctx, ds, rt, rv, 240)
    return rt.pred(), rv.pred()


@pytest.mark.parametrize("nranks", [2, 3])
def test_pred_holds_every_datapoint_in_dataset_order(tmp_path, nranks):
    train, val = _single_preds()
    for got in mpirun(nranks, tmp_path, "preds"):
        np.testing.assert_array_equal(got["train"], train)
        np.testing.assert_array_equal(got["val"], val)


@pytest.mark.parametrize(("nranks", "kind"), [(2, "llama"), (3, "llama"), (2, "gpt2"),
                                              (4, "llama"), (2, "qwen2"), (3, "gemma3")])
def test_lm_equals_one_process(tmp_path, nranks, kind):
    import lm_dist_problem as lm
    ref, ref_hist = lm.fit_lm(None, kind, nbatch_logical=lm.logical_batch(nranks))
    ranks = mpirun(nranks, tmp_path, "lm", kind)
    for got in ranks:
        assert np.array_equal(got["params"], ranks[0]["params"])
        got_hist, want = got["history"], history_array(ref_hist)
        # losses and accuracies within 1e-6 (the losses' rounding shows at 1e-7)
        values = [0, 2, 3, 4, 6, 7, 8]
        np.testing.assert_allclose(got_hist[:, values], want[:, values], rtol=1e-6, atol=1e-6)
        # a loss's uncertainty is the standard error of its n datapoints' losses, which
        # the ranks' float32 rounding moves one by one: differences of d each leave the
        # mean within d / sqrt(n), so a mean within 1e-6 of the loss admits d = 1e-6
        # sqrt(n) loss, and the standard error (1 / sqrt(n - 1) Lipschitz in the
        # largest d) moves by at most 1e-6 loss sqrt(n / (n - 1)) >= 1e-6 loss
        for unc, loss in ((1, 0), (5, 4)):
            assert np.all(np.abs(got_hist[:, unc] - want[:, unc]) <= 1e-6 * want[:, loss]), \
                (unc, got_hist[:, unc], want[:, unc])
    trained, key_bias = lm.max_difference(kind, ranks[0]["params"], ref)
    logical = lm.logical_batch(nranks)
    assert trained <= lm.rounding_bound(lm.nsteps_of(1, logical), logical)
    assert key_bias <= 1e-5


@pytest.mark.parametrize("nranks", [2, 3])
def test_lm_with_a_token_file_per_rank(tmp_path, nranks):
    import lm_dist_problem as lm
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lm.write_part_files(corpus, nranks)
    ref, ref_hist = lm.fit_lm(None, dataset=lm.whole_dataset(corpus, nranks), nepoch=2,
                              val_split=0.0, nbatch_logical=12 * nranks)
    ranks = mpirun(nranks, tmp_path, "lm-parts", str(corpus))
    for got in ranks:
        assert np.array_equal(got["params"], ranks[0]["params"])
        np.testing.assert_allclose(got["history"][:, 0], history_array(ref_hist)[:, 0],
                                   rtol=1e-6)
    total = 12 * nranks
    assert lm.max_difference("llama", ranks[0]["params"], ref)[0] <= lm.rounding_bound(
        lm.nsteps_of(2, total, ndata=total, val_split=0.0), total)


def test_a_rank_whose_part_is_padding_alone_trains_as_one_process(tmp_path):
    """dataset_is_part: a rank's part may hold no labelled position (padding rows);
    the whole data has labels, and the run equals one process on it."""
    import lm_dist_problem as lm

    import ggmlopt as go
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lm.write_part_files(corpus, 2)
    whole = lm.whole_dataset(corpus, 2)
    labels = np.asarray(whole.labels).copy()
    labels[labels.shape[0] // 2:] = -1   # part 1's rows
    ref, ref_hist = lm.fit_lm(None, dataset=go.Dataset.from_arrays(np.asarray(whole.data),
                                                                   labels),
                              nepoch=2, val_split=0.0, nbatch_logical=24)
    ranks = mpirun(2, tmp_path, "lm-masked-part", str(corpus))
    for got in ranks:
        assert np.array_equal(got["params"], ranks[0]["params"])
        np.testing.assert_allclose(got["history"][:, 0], history_array(ref_hist)[:, 0],
                                   rtol=1e-6)
    assert lm.max_difference("llama", ranks[0]["params"], ref)[0] <= lm.rounding_bound(
        lm.nsteps_of(2, 24, ndata=24, val_split=0.0), 24)


@pytest.mark.parametrize("what", ["optimizer", "clip", "nepoch", "bucket", "lr", "data",
                                  "frozen-past-48", "part-width", "part-rows", "clip-later"])
def test_ranks_that_disagree_stop_with_a_clear_error(tmp_path, what):
    """A rank with another optimizer, clipping, exchange, number of epochs or
    learning rate than the others, rows of its own (as many: each rank trained
    half of its rows, silently) or another parameter frozen past the 48th
    (the mask compared stopped there), or with dataset_is_part a part of other
    windows or of fewer rows: ValueError on every rank before any rank's
    parameters change (it hung, aborted MPI, or trained apart; parts of other
    windows trained on, each rank gathering predictions of its own size)."""
    ranks = mpirun(2, tmp_path, "disagree", what)
    for got in ranks:
        assert str(got["kind"]) == "ValueError", got["msg"]
        assert "the ranks disagree" in str(got["msg"])
        if what.startswith("part-"):
            assert "every rank's part must hold as many datapoints" in str(got["msg"])
        assert not bool(got["changed"])


def test_a_kept_base_that_differs_between_ranks_is_refused(tmp_path):
    """Weights kept in a file's types are not Parameters: the ranks compare them
    too (a base of another seed on one rank trained adapters on mixed gradients)."""
    pytest.importorskip("gguf")
    from ggmlopt.io import save_gguf
    from ggmlopt.models import Llama, LlamaConfig
    from ggmlopt.text import ByteTokenizer
    files = []
    for seed in (1, 2):   # widths of whole Q8_0 blocks
        files.append(str(tmp_path / f"base{seed}.gguf"))
        model = Llama(LlamaConfig(vocab_size=257, dim=32, n_layers=1, n_heads=2,
                                  max_seq_len=16), seed=seed)
        save_gguf(model, files[-1], tokenizer=ByteTokenizer(), dtype="q8_0")
    ranks = mpirun(2, tmp_path, "kept-base", *files)
    for got in ranks:
        assert str(got["kind"]) == "ValueError" and "kept" in str(got["msg"])


def test_four_ranks_oversubscribed_equal_one_process(tmp_path):
    # 4 ranks on this machine's cores (more ranks than cores): the same exactness
    ref, ref_hist, _ = run(None, "ADAMW", nbatch_logical=120)
    ranks = mpirun(4, tmp_path, "equivalence", "ADAMW", "full", "120")
    for got in ranks:
        assert np.array_equal(got["params"], ranks[0]["params"])
        np.testing.assert_allclose(got["history"], history_array(ref_hist), rtol=RTOL,
                                   atol=1e-7)
    np.testing.assert_allclose(ranks[0]["params"], ref, rtol=RTOL, atol=ATOL)


def test_ranks_share_the_cores_without_being_told(tmp_path):
    # no set_rank_threads, no thread variables: cores / ranks on this machine
    out = tmp_path / "threads"
    out.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("GGMLOPT_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                        "MKL_NUM_THREADS", "BLIS_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")])
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", WORKER, "threads", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    cores = len(os.sched_getaffinity(0))
    for r in range(2):
        with np.load(out / f"rank{r}.npz") as f:
            assert int(f["local"]) == 2
            assert int(f["before"]) == min(os.cpu_count(), 64)
            assert int(f["kernel"]) == max(1, cores // 2)
            assert int(f["blas"]) in (-1, max(1, cores // 2))
