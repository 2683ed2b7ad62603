"""Run under mpiexec by tests/mpi/test_mpi_buckets.py: the data-parallel fit of
tests/dist_problem.py with the gradients exchanged in buckets during the backward
pass and with the single exchange after it (bucket_cap_mb=None); every rank writes
both results to OUT/rank<r>.npz.

    mpiexec -n P python -m mpi4py tests/mpi/buckets_worker.py OUT CAP_FLOATS SHARD PER_RANK
    mpiexec -n P python -m mpi4py tests/mpi/buckets_worker.py OUT fail-backward

fail-backward: rank 1's backward pass raises after its first buckets started; every
rank writes the exception it got (kind, msg).
"""
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist_problem import NBATCH_PHYSICAL, history_array, run

import ggmlopt as go
from ggmlopt import distributed


class FailingOnRank1:
    """A layer without parameters whose backward raises on rank 1."""

    def parameters(self):
        return []

    def forward(self, x):
        return x

    def backward(self, g):
        if MPI.COMM_WORLD.Get_rank() == 1:
            raise ValueError("a bad gradient on rank 1")
        return g


def fail_backward(out):
    comm = MPI.COMM_WORLD
    model = go.nn.Sequential(go.nn.Linear(6, 5, rng=1), FailingOnRank1(),
                             go.nn.Linear(5, 3, rng=2))
    kind, msg = "", ""
    try:
        ctx = go.OptContext(model, loss_type="CROSS_ENTROPY", comm=comm,
                            opt_period=comm.Get_size(), bucket_cap_mb=4 / 2**20)
        ctx.alloc(True)
        try:
            ctx.eval(inputs=np.ones((4, 6), np.float32), labels=np.zeros(4, np.int64))
        except BaseException as e:
            ctx._dist.report(e, "training")  # what fit and epoch do
            raise
    except Exception as e:  # noqa: BLE001 - the test reads it
        kind, msg = type(e).__name__, str(e)
    np.savez(os.path.join(out, f"rank{comm.Get_rank()}.npz"), kind=kind, msg=msg)


def main(out, cap_floats, shard=None, per_rank=None):
    if cap_floats == "fail-backward":
        fail_backward(out)
        return
    comm = MPI.COMM_WORLD
    distributed.set_rank_threads(1, comm)
    nranks = comm.Get_size()
    kw = {"shard_optimizer": shard == "shard", "nepoch": 2,
          "nbatch_logical": nranks * int(per_rank) * NBATCH_PHYSICAL,
          "ndata": 360 if nranks == 3 else 240, "val_split": 0.25, "frozen": ("2.bias",)}
    single, single_hist, _ = run(comm, bucket_cap_mb=None, **kw)
    cap = int(cap_floats) * 4 / 2**20
    bucketed, bucketed_hist, _ = run(comm, bucket_cap_mb=cap, **kw)
    np.savez(os.path.join(out, f"rank{comm.Get_rank()}.npz"), single=single,
             single_history=history_array(single_hist), bucketed=bucketed,
             bucketed_history=history_array(bucketed_hist))


if __name__ == "__main__":
    main(*sys.argv[1:])
