"""The gradient exchange in buckets during the backward pass under real MPI
(``mpiexec -n 2`` and ``-n 3``): tests/mpi/buckets_worker.py trains with buckets
and with the single exchange after the backward pass; the parameters and the
History must be the same bits, on every rank.  Skips without mpi4py or mpiexec."""
import os

import numpy as np
import pytest
from mpi_run import TESTS, requires_mpi, run_ranks

WORKER = os.path.join(TESTS, "mpi", "buckets_worker.py")
pytestmark = requires_mpi


def mpirun(nranks, tmp_path, *args):
    out = tmp_path / f"out{nranks}-{'-'.join(args)}"
    out.mkdir()
    return run_ranks(WORKER, nranks, out, [str(out), *args], timeout=240)


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
