"""One epoch of mnist-fc (784-500-10, ReLU, cross-entropy, AdamW, logical batch 1000
in physical batches of 500) on 60,000 synthetic uint8 datapoints, on the ranks of
MPI.COMM_WORLD (--mpi) or in one process; rank 0 prints one JSON line.

    mpiexec -n 2 python bench/mpi_epoch.py --mpi --threads 1 [--shard]
    python bench/mpi_epoch.py --threads 2

Run by bench/test_bench_mpi.py, which interleaves the configurations.
"""
import argparse
import json
import time

import numpy as np

import ggmlopt as go
from ggmlopt import distributed

NDATA, NE_IN, NE_HIDDEN, NE_OUT = 60_000, 784, 500, 10
NBATCH_LOGICAL, NBATCH_PHYSICAL = 1000, 500


def fc_context(**kw):
    """(dataset, OptContext) of mnist-fc on the synthetic data; kw go to the
    OptContext (comm=, shard_optimizer=, bucket_cap_mb=)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (NDATA, NE_IN), dtype=np.uint8)
    y = np.eye(NE_OUT, dtype=np.float32)[rng.integers(0, NE_OUT, NDATA)]
    ds = go.Dataset.from_arrays(x, y, ndata_shard=10, data_scale=1 / 255)
    model = go.nn.Sequential(go.nn.Linear(NE_IN, NE_HIDDEN, rng=1), go.nn.ReLU(),
                             go.nn.Linear(NE_HIDDEN, NE_OUT, rng=2))
    ctx = go.OptContext(model, batch_size=NBATCH_PHYSICAL, ne_datapoint=NE_IN,
                        loss_type=go.LossType.CROSS_ENTROPY,
                        opt_period=NBATCH_LOGICAL // NBATCH_PHYSICAL, **kw)
    return ds, ctx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mpi", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shard", action="store_true")
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs after one warm-up")
    args = ap.parse_args()
    comm = None
    if args.mpi:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    nthreads = distributed.set_rank_threads(args.threads, comm)

    kw = {} if comm is None else {"comm": comm, "shard_optimizer": args.shard}
    ds, ctx = fc_context(**kw)
    result = go.Result()
    go.epoch(ctx, ds, result)  # warm-up
    dist = ctx._dist
    times, exchange = [], []
    for _ in range(args.epochs):
        if dist is not None:
            dist.exchange_times.clear()
        result.reset()
        t0 = time.perf_counter()
        go.epoch(ctx, ds, result)
        times.append(time.perf_counter() - t0)
        if dist is not None:
            exchange.append(float(np.median(dist.exchange_times)))
    floor = 0.0
    if comm is not None:  # the bare Allreduce of the gradient section, ranks in step
        from mpi4py import MPI
        g = ctx.arena.flat("grads").copy()
        ts = []
        for _ in range(40):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
            ts.append(time.perf_counter() - t0)
        floor = float(np.median(ts))
    rank = 0 if comm is None else comm.Get_rank()
    if rank == 0:
        nsteps = NDATA // NBATCH_LOGICAL
        print(json.dumps({
            "ranks": 1 if comm is None else comm.Get_size(), "threads": nthreads,
            "shard": args.shard, "epoch_s": min(times),
            "step_ms": 1e3 * min(times) / nsteps,
            "exchange_ms": 1e3 * min(exchange) if exchange else 0.0,
            "allreduce_ms": 1e3 * floor,
            "optimizer_bytes": distributed.optimizer_state_nbytes(ctx),
            "parameters": ctx.arena.size, "loss": result.loss()[0],
        }))


if __name__ == "__main__":
    main()
