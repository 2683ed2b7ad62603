"""Where one mnist-fc epoch spends its time, in ggmlopt and in PyTorch, phase by phase.

ggml's mnist-fc configuration (784-500-10, ReLU, cross-entropy, AdamW, logical
batch 1000 in physical batches of 500) on 60,000 synthetic datapoints, 2 threads
each.  ggmlopt's phases are timed by wrapping each layer's forward and backward,
the loss, the AdamW step, the gradient zeroing and the dataset gather in a copy
of epoch's own loop; the shuffle, the statistics and the Python orchestration
are the remainder.
torch's phases come from torch.profiler, grouped by operator.

    python bench/profile_epoch.py            # this CPU as it is
    python bench/profile_epoch.py --avx2     # as on an AVX2-only CPU (see below)

--avx2 re-runs itself with every library held to AVX2: GGMLOPT_SIMD=avx2,
OPENBLAS_CORETYPE=Haswell (NumPy's OpenBLAS), ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2 (torch): the same
caches and clock, the instruction set of an AVX2-only machine.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np

NDATA = 60_000
NE_IN, NE_HIDDEN, NE_OUT = 784, 500, 10
NBATCH_LOGICAL, NBATCH_PHYSICAL = 1000, 500
THREADS = 2

AVX2_ENV = {"GGMLOPT_SIMD": "avx2", "OPENBLAS_CORETYPE": "Haswell",
            "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "DNNL_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def synthetic_data():
    rng = np.random.default_rng(0)
    x = rng.random((NDATA, NE_IN), dtype=np.float32)
    y = rng.integers(0, NE_OUT, NDATA)
    return x, y


def _timed(times, key, fn):
    """fn wrapped so that each call's wall time is appended to times[key]."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[key].append(time.perf_counter() - t0)
    return wrapper


class _ArenaTimer:
    """The context's parameter arena, with its optimizer steps and gradient zeroing timed."""

    def __init__(self, arena, times):
        self._arena = arena
        self.adamw_step = _timed(times, "AdamW step", arena.adamw_step)
        self.zero_grads = _timed(times, "gradient zeroing", arena.zero_grads)

    def __getattr__(self, name):
        return getattr(self._arena, name)


def profile_ggmlopt(x, y, epochs):
    """{phase: seconds per epoch} and the epoch's wall time, both means over epochs."""
    import ggmlopt as go

    go.set_num_threads(THREADS)
    ds = go.Dataset.from_arrays(x, np.eye(NE_OUT, dtype=np.float32)[y], ndata_shard=10)
    model = go.nn.Sequential(go.nn.Linear(NE_IN, NE_HIDDEN, rng=1), go.nn.ReLU(),
                             go.nn.Linear(NE_HIDDEN, NE_OUT, rng=2))
    ctx = go.OptContext(model, batch_size=NBATCH_PHYSICAL, ne_datapoint=NE_IN,
                        loss_type=go.LossType.CROSS_ENTROPY,
                        opt_period=NBATCH_LOGICAL // NBATCH_PHYSICAL)
    times = defaultdict(list)
    names = {0: "linear 784x500 forward (product + bias)", 1: "relu forward",
             2: "linear 500x10 forward"}
    for i, layer in enumerate(model):
        layer.forward = _timed(times, names[i], layer.forward)
        back = names[i].replace("forward (product + bias)", "backward (weight/bias products)")
        layer.backward = _timed(times, back.replace(" forward", " backward"), layer.backward)
    ctx._loss = _timed(times, "cross-entropy loss + gradient", ctx._loss)
    ctx.arena = _ArenaTimer(ctx.arena, times)
    result = go.Result()
    nbatches = NDATA // NBATCH_PHYSICAL

    def one_epoch():
        # epoch's own loop (training.epoch without a validation split)
        result.reset()
        ds.shuffle(ctx, -1)
        for ib in range(nbatches):
            ctx.alloc(True)
            t0 = time.perf_counter()
            ds.get_batch(ctx.inputs, ctx.labels, ib)
            times["dataset get_batch"].append(time.perf_counter() - t0)
            ctx.eval(result)

    one_epoch()  # warm-up: buffers, BLAS threads
    for key in list(times):
        times[key].clear()
    walls = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        one_epoch()
        walls.append(time.perf_counter() - t0)
    wall = float(np.mean(walls))
    phases = {k: sum(v) / epochs for k, v in times.items()}
    phases["shuffle, statistics, Python orchestration"] = wall - sum(phases.values())
    return phases, wall


def profile_torch(x, y, epochs):
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(THREADS)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(NE_IN, NE_HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(NE_HIDDEN, NE_OUT))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    period = NBATCH_LOGICAL // NBATCH_PHYSICAL

    def one_epoch():
        perm = torch.randperm(NDATA)
        for i in range(0, NDATA, NBATCH_LOGICAL):
            opt.zero_grad(set_to_none=True)
            for j in range(i, i + NBATCH_LOGICAL, NBATCH_PHYSICAL):
                idx = perm[j:j + NBATCH_PHYSICAL]
                loss = torch.nn.functional.cross_entropy(model(xt[idx]), yt[idx]) / period
                loss.backward()
            opt.step()

    one_epoch()
    walls = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        one_epoch()
        walls.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        one_epoch()
        profiled_wall = time.perf_counter() - t0
    groups = {"aten::addmm": "linear forward (addmm)",
              "aten::mm": "linear backward products (mm)",
              "aten::relu": "relu forward", "aten::clamp_min": "relu forward",
              "aten::threshold_backward": "relu backward",
              "aten::_log_softmax": "cross-entropy", "aten::nll_loss_forward": "cross-entropy",
              "aten::_log_softmax_backward_data": "cross-entropy",
              "aten::nll_loss_backward": "cross-entropy",
              "aten::_fused_adamw_": "AdamW step (fused)",
              "Optimizer.step#AdamW.step": "AdamW step (fused)",
              "aten::index": "gather batch (index)", "aten::sum": "bias gradient (sum)"}
    phases = defaultdict(float)
    for ev in prof.key_averages():
        if ev.key in groups:
            phases[groups[ev.key]] += ev.self_cpu_time_total / 1e6
    # the profiler slows the operators down: the phases are scaled to the
    # unprofiled epoch, in the profiled epoch's proportions
    wall = float(np.mean(walls))
    phases["autograd, other operators, Python"] = profiled_wall - sum(phases.values())
    return {k: v * wall / profiled_wall for k, v in phases.items()}, wall


def _table(title, phases, wall):
    lines = [f"{title}: {wall:.3f} s per epoch (mean)"]
    for k, v in sorted(phases.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {k:44s} {v * 1e3:8.1f} ms  {100 * v / wall:5.1f} %")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--avx2", action="store_true", help="hold every library to AVX2")
    ap.add_argument("--epochs", type=int, default=5)
    args = ap.parse_args()
    if args.avx2 and os.environ.get("GGMLOPT_SIMD") != "avx2":
        env = dict(os.environ, **AVX2_ENV)
        sys.exit(subprocess.call([sys.executable, __file__, "--avx2", "--epochs",
                                  str(args.epochs)], env=env))
    x, y = synthetic_data()
    import ggmlopt as go
    print(f"ggmlopt kernels: {go.simd_info()['active']}")
    try:
        import threadpoolctl
        for lib in threadpoolctl.threadpool_info():
            print(f"BLAS: {lib.get('internal_api')} {lib.get('version')} "
                  f"({lib.get('architecture')}), {lib.get('num_threads')} threads")
    except ImportError:
        pass
    ours, ours_wall = profile_ggmlopt(x, y, args.epochs)
    print(_table("ggmlopt", ours, ours_wall))
    try:
        import torch
    except ImportError:
        print("torch: not installed")
        return
    print(f"torch {torch.__version__}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    theirs, theirs_wall = profile_torch(x, y, args.epochs)
    print(_table("torch", theirs, theirs_wall))
    print(f"ggmlopt / torch = {ours_wall / theirs_wall:.2f}")


if __name__ == "__main__":
    main()
