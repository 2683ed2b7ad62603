"""The finetune command under mpiexec: with --mpi the ranks share each batch and
the adapter equals one process's with the same micro-batches; without it the
command refuses to run the whole fine-tune once a rank."""
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi_run import MPIEXEC, ROOT, TESTS, requires_mpi

pytestmark = requires_mpi
pytest.importorskip("gguf")
pytest.importorskip("jinja2")

sys.path.insert(0, TESTS)
from finetune_files import write_files


@pytest.fixture
def files(tmp_path):
    return write_files(tmp_path)


def _command(files, out, *extra, silent=True):
    return ["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"),
            "--lora-rank", "4", "-c", "96", "--batch", "4", "--epochs", "2", "--lr", "1e-2",
            "--out", str(out), *(["--silent"] if silent else []), *extra]


def _mpiexec(nranks, args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS,
                                                       os.environ.get("PYTHONPATH", "")]),
               OPENBLAS_NUM_THREADS="1", GGMLOPT_NUM_THREADS="1")
    cmd = [MPIEXEC, "-n", str(nranks), sys.executable, "-m", "ggmlopt.finetune", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env,
                              check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} hangs: {e.stderr}")


def _adapter(path):
    from ggmlopt.io.gguf_reader import GgufFile
    read = GgufFile(str(path))
    return {name: read.float32(name) for name in read.tensors}


def test_the_ranks_share_each_batch_as_micro_batches_of_one_process(files):
    from ggmlopt import finetune
    assert finetune.main(_command(files, files / "one.gguf", "--micro-batch", "2")) == 0
    proc = _mpiexec(2, _command(files, files / "two.gguf", "--mpi", silent=False))
    assert proc.returncode == 0, proc.stderr
    # fit ran over the two ranks (its memory check is a rank's), rank 0 alone printed
    assert "fit (per rank, 2 on this machine)" in proc.stderr
    assert proc.stdout.count("finetune: train loss") == 1
    assert proc.stdout.count("trainable params:") == 1
    one, two = _adapter(files / "one.gguf"), _adapter(files / "two.gguf")
    assert one.keys() == two.keys() and len(one) == 2 * 2 * 4   # a, b of q/k/v/o, 2 blocks
    base = _adapter(files / "base.gguf")
    assert not base.keys() & one.keys()
    moved = 0
    for name in one:
        # the sums of the ranks' gradients in another order: float32 rounding apart
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)
        moved += name.endswith("lora_b") and np.abs(one[name]).max() > 1e-4
    assert moved   # B started at zero: it trained


def test_mpiexec_without_mpi_is_refused(files):
    proc = _mpiexec(2, _command(files, files / "x.gguf"))
    assert proc.returncode == 2
    assert "give --mpi to train data-parallel" in proc.stderr
    assert not (files / "x.gguf").exists()


def test_a_batch_the_ranks_cannot_share_is_refused(files):
    proc = _mpiexec(2, _command(files, files / "x.gguf", "--mpi", "--batch", "3"))
    assert proc.returncode == 2 and "--batch: with --mpi over 2 ranks" in proc.stderr


def _two_ranks_with_rank1_failing(script, args):
    """mpiexec -n 2 of tests/mpi/script (finetune with rank 1 failing its way), which
    must end within a minute: rank 0 must not wait for ever for rank 1."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS,
                                                       os.environ.get("PYTHONPATH", "")]),
               OPENBLAS_NUM_THREADS="1", GGMLOPT_NUM_THREADS="1")
    cmd = [MPIEXEC, "-n", "2", sys.executable, os.path.join(TESTS, "mpi", script), *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env,
                              check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"rank 0 waits for ever for rank 1 ({script}): {e.stderr}")


def test_an_interrupted_rank_takes_the_others_down(files):
    """Ctrl-C reaches each rank at another point: one leaving fit while the others
    wait for it in a collective must end the run, not leave them waiting."""
    proc = _two_ranks_with_rank1_failing(
        "interrupt_rank1.py",
        _command(files, files / "x.gguf", "--mpi", "--checkpoint", str(files / "c.npz")))
    assert proc.returncode != 0
    assert "finetune: interrupted" in proc.stderr
    assert not (files / "x.gguf").exists()


def test_a_rank_refusing_its_input_takes_the_others_down(files):
    """A rank whose --data is missing (on its host) refuses it before training
    while the others wait in fit's first collective: the run ends, it does not
    hang, and nothing is written."""
    proc = _two_ranks_with_rank1_failing("missing_data_rank1.py",
                                         _command(files, files / "x.gguf", "--mpi"))
    assert proc.returncode != 0
    assert "--data" in proc.stderr
    assert not (files / "x.gguf").exists()

