"""Run under mpiexec by tests/mpi/test_mpi_buckets.py: the data-parallel fit of
tests/dist_problem.py with the gradients exchanged in buckets during the backward
pass and with the single exchange after it (bucket_cap_mb=None); every rank writes
both results to OUT/rank<r>.npz.

    mpiexec -n P python -m mpi4py tests/mpi/buckets_worker.py OUT CAP_FLOATS SHARD PER_RANK
"""
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist_problem import NBATCH_PHYSICAL, history_array, run

from ggmlopt import distributed


def main(out, cap_floats, shard, per_rank):
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
