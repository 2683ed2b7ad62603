"""Data-parallel training steps with the gradient exchange in buckets hidden behind
the backward pass, on the ranks of MPI.COMM_WORLD (--mpi) or in one process; rank 0
prints one JSON line.

    mpiexec -n 2 python bench/mpi_overlap.py fc --mpi --threads 1 [--bucket-cap-mb 25 | --single]
    python bench/mpi_overlap.py fc --threads 2
    mpiexec -n 2 python bench/mpi_overlap.py llama --mpi --threads 1 --steps 2
    mpiexec -n 2 python bench/mpi_overlap.py allreduce      # the alpha-beta sweep

Models: ``fc`` is bench/mpi_epoch.py's mnist-fc (784-500-10, AdamW, logical batch
1000 in physical batches of 500, one epoch of 60 steps on 60,000 synthetic uint8
datapoints); ``llama`` the stories15M-shaped Llama of bench/lm_models.py (dim 288,
6 layers, 6 heads, ffn 768, vocab 32000, untied head: 24.4 M parameters), physical
batches of 8 x 256 random tokens, a logical batch of 16 sequences (one physical
batch per rank at P = 2, two in one process), --steps timed steps after one
warm-up.  The exposed exchange is what the step's timer records
(``Distributed.exchange_wait_times``: the time inside the exchange's calls during
the backward pass, then until every bucket arrived), summed over the timed steps
and divided by their wall time; nothing is obtained by subtraction.

``--split`` (with --mpi, ranks on one machine) splits each step's exposed time with
the clock every process of a machine shares (``time.perf_counter``, CLOCK_MONOTONIC
on Linux): the wait for the other ranks' backward passes to end, and the time from
the end of the last one until the rank's exchange is done.

``allreduce``: medians of ``Allreduce`` (IN_PLACE, SUM, float32) of 4 B to 64 MiB
right after a Barrier, and the alpha and beta of the ring model fitted to them.

Run by bench/test_bench_mpi_overlap.py, which interleaves the configurations.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

import ggmlopt as go
from ggmlopt import distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mpi_epoch  # bench/: the mnist-fc setup both benchmarks time

LM_PHYSICAL, LM_LOGICAL = 8, 16


def _fc(comm, kw, epochs):
    """One warm-up epoch, then the best of `epochs` timed epochs of mnist-fc."""
    ds, ctx = mpi_epoch.fc_context(**kw)
    result = go.Result()
    go.epoch(ctx, ds, result)  # warm-up
    best = None
    for _ in range(epochs):
        _clear(ctx)
        result.reset()
        t0 = time.perf_counter()
        go.epoch(ctx, ds, result)
        seconds = time.perf_counter() - t0
        if best is None or seconds < best[0]:
            best = (seconds, _waits(ctx))
    return ctx, best[0], mpi_epoch.NDATA // mpi_epoch.NBATCH_LOGICAL, best[1]


def _llama(comm, kw, steps):
    """One warm-up step, then `steps` timed steps of the stories15M-shaped Llama."""
    import lm_models

    model = lm_models.ggmlopt_model(seed=0)
    nranks = 1 if comm is None else comm.Get_size()
    rank = 0 if comm is None else comm.Get_rank()
    per_rank = LM_LOGICAL // LM_PHYSICAL // nranks
    ctx = go.OptContext(model, loss_type=go.LossType.CROSS_ENTROPY,
                        opt_period=LM_LOGICAL // LM_PHYSICAL, **kw)

    def step(i):
        for k in range(per_rank):
            x, y = lm_models.batch(seed=1000 * i + rank * per_rank + k)
            ctx.alloc(True)
            ctx.eval(inputs=x, labels=y)

    step(0)  # warm-up
    _clear(ctx)
    if comm is not None:
        comm.Barrier()
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        step(i)
    seconds = time.perf_counter() - t0
    return ctx, seconds, steps, _waits(ctx)


def _clear(ctx):
    dist = ctx._dist
    if dist is not None:
        dist.exchange_wait_times.clear()
        dist.exchange_sync_times.clear()


def _waits(ctx):
    """(exposed seconds per step, the part of them waiting for the slowest rank)."""
    dist = ctx._dist
    if dist is None:
        return [], []
    return list(dist.exchange_wait_times), list(dist.exchange_sync_times)


class _ClockSplit:
    """Per optimizer step, when this rank's backward pass ended and its exchange
    was done (Distributed.backward and .step wrapped, this process only)."""

    def __init__(self):
        self.rows = []
        self._ended = None
        backward, step = distributed.Distributed.backward, distributed.Distributed.step

        def timed_backward(dist, ctx, grad):
            backward(dist, ctx, grad)
            self._ended = time.perf_counter()

        def timed_step(dist, ctx, pars):
            stepped = step(dist, ctx, pars)
            self.rows.append((self._ended, time.perf_counter()))
            return stepped

        distributed.Distributed.backward = timed_backward
        distributed.Distributed.step = timed_step

    def summary(self, comm, nsteps):
        """Rank 0: per rank, medians and means (ms) of the wait for the slowest
        backward pass and of the exchange after it, over the last nsteps steps."""
        mine = np.array(self.rows[-nsteps:])
        every = comm.gather(mine, root=0)
        if comm.Get_rank() != 0:
            return None
        last_end = np.max([r[:, 0] for r in every], axis=0)
        out = []
        for r in every:
            wait, after = last_end - r[:, 0], r[:, 1] - last_end
            out.append({"peer_wait_ms": [1e3 * float(np.median(wait)), 1e3 * float(wait.mean())],
                        "after_all_ended_ms": [1e3 * float(np.median(after)),
                                               1e3 * float(after.mean())]})
        return out


def _allreduce_sweep(comm):
    """Median Allreduce times (s) by message size (bytes), and the ring model's
    alpha (s) and beta (bytes/s) fitted to them: t = 2(P-1) alpha + 2(P-1)/P n / beta."""
    from mpi4py import MPI
    p = comm.Get_size()
    sizes = [4 << (2 * i) for i in range(13)]  # 4 B .. 64 MiB
    rows = []
    for n in sizes:
        buf = np.ones(n // 4, np.float32)
        reps = 200 if n < (1 << 20) else 15
        ts = []
        for _ in range(reps):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            ts.append(time.perf_counter() - t0)
        rows.append((n, float(np.median(ts))))
    # alpha from the smallest messages, beta from the largest (where alpha is negligible)
    alpha = min(t for n, t in rows[:3]) / (2 * (p - 1))
    big = [(n, t) for n, t in rows if n >= (1 << 22)]
    beta = float(np.median([2 * (p - 1) / p * n / max(t - 2 * (p - 1) * alpha, 1e-12)
                            for n, t in big]))
    return {"ranks": p, "sizes": [n for n, _ in rows], "seconds": [t for _, t in rows],
            "alpha_s": alpha, "beta_bytes_per_s": beta}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=["fc", "llama", "allreduce"])
    ap.add_argument("--mpi", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--single", action="store_true",
                    help="one exchange after the backward pass (bucket_cap_mb=None)")
    ap.add_argument("--shard", action="store_true")
    ap.add_argument("--epochs", type=int, default=2, help="fc: timed epochs (best kept)")
    ap.add_argument("--steps", type=int, default=2, help="llama: timed steps")
    ap.add_argument("--split", action="store_true",
                    help="split the exposed time by the machine's shared clock (--mpi)")
    args = ap.parse_args()
    comm = None
    if args.mpi or args.model == "allreduce":
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    if args.model == "allreduce":
        got = _allreduce_sweep(comm)
        if comm.Get_rank() == 0:
            print(json.dumps(got))
        return
    nthreads = distributed.set_rank_threads(args.threads, comm)
    split = _ClockSplit() if args.split and comm is not None else None
    kw = {} if comm is None else {
        "comm": comm, "shard_optimizer": args.shard,
        "bucket_cap_mb": None if args.single else args.bucket_cap_mb}
    if args.model == "fc":
        ctx, seconds, nsteps, (waits, syncs) = _fc(comm, kw, args.epochs)
    else:
        ctx, seconds, nsteps, (waits, syncs) = _llama(comm, kw, args.steps)
    rank = 0 if comm is None else comm.Get_rank()
    # fc keeps its best epoch's waits: the split covers the last epoch's steps
    per_rank = split.summary(comm, nsteps) if split is not None else None
    if rank == 0:
        print(json.dumps({
            "model": args.model, "ranks": 1 if comm is None else comm.Get_size(),
            "threads": nthreads, "single": args.single, "shard": args.shard,
            "bucket_cap_mb": None if comm is None or args.single else args.bucket_cap_mb,
            "seconds": seconds, "steps": nsteps, "step_s": seconds / nsteps,
            "exposed_s": float(sum(waits)),
            "exposed_share": float(sum(waits)) / seconds if waits else 0.0,
            "exposed_median_ms": 1e3 * float(np.median(waits)) if waits else 0.0,
            # the part of exposed_s spent waiting for the slowest rank to end its backward
            "sync_s": float(sum(syncs)),
            "parameters": ctx.arena.size, "gradient_bytes": 4 * ctx.arena.size,
            # [median, mean] per rank, with --split
            "split": per_rank,
        }))


if __name__ == "__main__":
    main()
