"""The gradient exchange in buckets during the backward pass under real MPI
(``mpiexec -n 2`` and ``-n 3``): tests/mpi/buckets_worker.py trains with buckets
and with the single exchange after the backward pass; the parameters and the
History must be the same bits, on every rank.  Skips without mpi4py or mpiexec."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")
WORKER = os.path.join(TESTS, "mpi", "buckets_worker.py")
MPIEXEC = shutil.which("mpiexec")
try:
    import mpi4py
except ImportError:
    mpi4py = None
pytestmark = pytest.mark.skipif(
    MPIEXEC is None or mpi4py is None,
    reason="MPI tests need mpi4py and mpiexec: pip install -e '.[mpi]'")


def mpirun(nranks, tmp_path, *args):
    out = tmp_path / f"out{nranks}-{'-'.join(args)}"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, TESTS, os.environ.get("PYTHONPATH", "")]), OPENBLAS_NUM_THREADS="1",
        GGMLOPT_NUM_THREADS="1")
    cmd = [MPIEXEC, "-n", str(nranks), sys.executable, "-m", "mpi4py", WORKER, str(out), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env,
                              check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} hangs (no answer in 240 s): {e.stderr}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    ranks = []
    for r in range(nranks):
        with np.load(out / f"rank{r}.npz") as f:
            ranks.append({k: f[k] for k in f.files})
    return ranks


@pytest.mark.parametrize(("cap_floats", "shard", "per_rank"), [
    ("1", "full", "1"), ("40", "full", "2"), ("7", "shard", "1"), ("40", "shard", "2")])
@pytest.mark.parametrize("nranks", [2, 3])
def test_buckets_equal_the_single_exchange(tmp_path, nranks, cap_floats, shard, per_rank):
    ranks = mpirun(nranks, tmp_path, cap_floats, shard, per_rank)
    for r, got in enumerate(ranks):
        assert np.array_equal(got["bucketed"], got["single"]), f"rank {r}: parameters differ"
        assert np.array_equal(got["bucketed_history"], got["single_history"], equal_nan=True)
        assert np.array_equal(got["bucketed"], ranks[0]["bucketed"]), f"rank {r} != rank 0"


@pytest.mark.parametrize("nranks", [2, 3])
def test_a_rank_failing_in_its_backward_pass_stops_every_rank(tmp_path, nranks):
    ranks = mpirun(nranks, tmp_path, "fail-backward")
    assert str(ranks[1]["kind"]) == "ValueError"
    for r in [0, *range(2, nranks)]:
        assert str(ranks[r]["kind"]) == "RankFailed"
        assert f"rank 1 of {nranks} failed (ValueError" in str(ranks[r]["msg"])
