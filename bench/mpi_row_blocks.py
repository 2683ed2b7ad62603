"""Would announcing a Linear's weight gradient in row blocks hide mnist-fc's exchange?
An experiment on the ranks of MPI.COMM_WORLD, outside ggmlopt's step: each rank
computes the first Linear's weight gradient (x^T g, x 500 x 784, g 500 x 500, one
BLAS thread) and exchanges it (1.6 MB, float32 SUM) either

- ``full``: one product, then one blocking Allreduce (today's step), or
- ``rows N``: products of N rows at a time, last rows first (the buckets' order),
  each block's non-blocking Iallreduce started right after its product, Testall
  after every product (MPI moves a collective on only inside its calls), Waitall
  at the end.

Prints, on rank 0, per variant the medians over the repetitions of the exposed
time (the time inside the exchange's calls) and of the wall time of product plus
exchange.

    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python bench/mpi_row_blocks.py [--reps 60]
"""
import argparse
import json
import time

import numpy as np
from mpi4py import MPI

BATCH, NE_IN, NE_HIDDEN = 500, 784, 500


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    buckets = comm.Dup()
    rng = np.random.default_rng(comm.Get_rank())
    x = rng.standard_normal((BATCH, NE_IN), dtype=np.float32)
    g = rng.standard_normal((BATCH, NE_HIDDEN), dtype=np.float32)
    grad = np.empty((NE_IN, NE_HIDDEN), np.float32)

    def full():
        np.matmul(x.T, g, out=grad)
        t0 = time.perf_counter()
        buckets.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)
        return time.perf_counter() - t0

    def in_rows(n):
        cuts = list(range(0, NE_IN, n)) + [NE_IN]
        blocks = list(zip(cuts[:-1], cuts[1:]))[::-1]

        def run():
            requests, exposed = [], 0.0
            for lo, hi in blocks:
                np.matmul(x[:, lo:hi].T, g, out=grad[lo:hi])
                t0 = time.perf_counter()
                requests.append(buckets.Iallreduce(MPI.IN_PLACE, grad[lo:hi], op=MPI.SUM))
                MPI.Request.Testall(requests)
                exposed += time.perf_counter() - t0
            t0 = time.perf_counter()
            MPI.Request.Waitall(requests)
            return exposed + time.perf_counter() - t0
        return run

    variants = {"full": full, **{f"rows {n}": in_rows(n) for n in (256, 128, 98, 64, 32)}}
    out = {}
    for name, run in variants.items():
        exposed, wall = [], []
        for _ in range(args.reps):
            comm.Barrier()
            t0 = time.perf_counter()
            exposed.append(run())
            wall.append(time.perf_counter() - t0)
        out[name] = {"exposed_ms": 1e3 * float(np.median(exposed)),
                     "wall_ms": 1e3 * float(np.median(wall))}
    if comm.Get_rank() == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
