"""The quality run of the language-model wave: ggmlopt's fit against a plain torch
loop on the same byte-level Llama, corpus, data order, initial weights, AdamW
settings and learning-rate schedule; the final validation loss of each.

    python bench/lm_quality.py                       # nanoGPT's 2000 steps, seeds 0 1 2
    python bench/lm_quality.py --steps 500 --seeds 0 1 2
    python bench/lm_quality.py --bf16                # also fit with precision="bf16"

The configuration is nanoGPT's CPU run, as ggmlopt.examples.textlm trains it:
4 layers, 4 heads, dim 128, a context of 64 bytes, batches of 12 windows, AdamW
(lr 1e-3, beta2 0.99, weight decay 0.1, gradient norm clipped to 1), a linear
warmup over 5% of the steps (at most 100) then a cosine decay to 1e-4.  The
corpus is ggmlopt.corpora.python_docstrings() as bytes; its first 90% trains,
the last 10% is held out.  Each seed:

1. builds the model (ggmlopt's initialisation, that seed) and copies its weights
   into a torch module (bench/lm_models.torch_llama);
2. trains it with ``go.fit`` for one epoch of ``steps`` batches of windows spread
   over the training text (textlm's windows) plus 10% more windows validating;
3. trains the torch twin on the batches in the order fit drew them (the
   dataset's shard permutation after fit) with torch.optim.AdamW and the same
   per-step learning rate;
4. reports for both: the loss on fit's validation windows (the mean of the
   per-batch losses, as ggml's Result) and on the held-out text (non-overlapping
   windows of 64 bytes), and the wall time.

The done-criterion of issue 18 is |ggmlopt - torch| <= 0.03 nats on the held-out
text per seed.  With --bf16, each seed is also fit from the same initial weights
with precision="bf16" (issue 30: its held-out loss within 0.02 of ggmlopt's
float32 run).  Prints one line per run and a table; --json writes the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

import ggmlopt as go
from ggmlopt.corpora import python_docstrings
from ggmlopt.examples.textlm import (
    HELD_OUT,
    MIN_LR_FACTOR,
    VAL_BATCHES,
    make_model,
    training_windows,
)
from ggmlopt.text import ByteTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lm_models import torch_llama

N_LAYERS, N_HEADS, DIM, N_CTX, BATCH, LR = 4, 4, 128, 64, 12, 1e-3
BETAS, EPS, WD, CLIP = (0.9, 0.99), 1e-8, 0.1, 1.0


def corpus():
    """(training tokens, held-out tokens), int32, textlm's 90/10 split of the bytes."""
    tokens = ByteTokenizer().encode(python_docstrings())
    nheld = int(tokens.size * HELD_OUT)
    return tokens[:tokens.size - nheld], tokens[tokens.size - nheld:]


def schedule(steps):
    """textlm's schedule for a run of steps optimizer steps."""
    warmup = min(100, max(1, steps // 20))
    base = go.OptimizerParams(go.AdamWParams(alpha=LR, beta1=BETAS[0], beta2=BETAS[1],
                                             eps=EPS, wd=WD))
    return go.schedules.WarmupCosine(warmup, steps, MIN_LR_FACTOR, base=base, unit="step")


def run_ggmlopt(model, ds, steps, nval, sched, seed, precision="f32", shuffle=True):
    """fit for one epoch of steps batches, nval more validating; the History."""
    val_split = (nval - 0.25) / (steps + nval)   # rounds to exactly nval logical batches
    return go.fit(model, ds, go.LossType.CROSS_ENTROPY, sched, nepoch=1,
                  nbatch_logical=BATCH, val_split=val_split, silent=True, seed=seed,
                  clip_grad_norm=CLIP, precision=precision, shuffle=shuffle)


def torch_mean_batch_loss(torch, module, x, y):
    """The per-batch cross-entropy over batches of BATCH rows, averaged as ggmlopt's
    Result averages it: each batch weighed by its rows (a smaller last batch counts
    for what it holds; with full batches, the plain mean of the batch means)."""
    import torch.nn.functional as F

    losses, rows = [], []
    with torch.no_grad():
        for i in range(0, x.shape[0], BATCH):
            logits = module(torch.from_numpy(x[i:i + BATCH]).long())
            target = torch.from_numpy(y[i:i + BATCH]).long().reshape(-1)
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target,
                                          ignore_index=-1).item())
            rows.append(min(BATCH, x.shape[0] - i))
    return float(np.average(losses, weights=rows))


def run_torch(module, ds, perm, steps, sched):
    """The torch loop over the batches of perm, AdamW with sched's rate per step."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(module.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    data, labels = ds.data, ds.labels
    module.train()
    for step in range(steps):
        rows = perm[step * BATCH:(step + 1) * BATCH]
        for group in opt.param_groups:
            group["lr"] = sched.lr(step + 1)
        opt.zero_grad(set_to_none=True)
        logits = module(torch.from_numpy(data[rows]).long())
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                               torch.from_numpy(labels[rows]).long().reshape(-1),
                               ignore_index=-1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        opt.step()
    module.eval()


def held_out_windows(held_out):
    """Non-overlapping windows of N_CTX over the held-out bytes: (x, y) int32."""
    ds = go.Dataset.from_tokens(held_out, N_CTX, stride=N_CTX)
    return np.array(ds.data), np.array(ds.labels)


def environment():
    """CPU, BLAS, versions and load, for the figures."""
    import torch

    info = {"python": platform.python_version(), "numpy": np.__version__,
            "torch": torch.__version__, "ggmlopt_simd": go.simd_info()["active"],
            "torch_threads": torch.get_num_threads(), "ggmlopt_threads": go.get_num_threads()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f
                               if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor()
    try:
        from threadpoolctl import threadpool_info

        info["blas"] = [f"{p['internal_api']} {p.get('version')} {p.get('architecture')} "
                        f"({p['num_threads']} threads)" for p in threadpool_info()
                        if p["user_api"] == "blas"]
    except ImportError:
        info["blas"] = ["threadpoolctl not installed"]
    return info


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps (2000)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch's intra-op threads (1: on a busy machine torch's spinning "
                             "second thread costs more than it gives)")
    parser.add_argument("--bf16", action="store_true",
                        help='also fit each seed with precision="bf16"')
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.torch_threads)

    train_tokens, held_out = corpus()
    hx, hy = held_out_windows(held_out)
    nval = max(1, round(args.steps * VAL_BATCHES))
    env = environment()
    env["load_start"] = os.getloadavg()
    print(f"lm_quality: {args.steps} steps, seeds {args.seeds}, {train_tokens.size} training "
          f"bytes, {hx.shape[0]} held-out windows; {env}", flush=True)
    rows = []
    for seed in args.seeds:
        model = make_model("llama", N_LAYERS, N_HEADS, DIM, N_CTX, seed)
        twin = torch_llama(model)            # the same initial weights
        ds, shuffle = training_windows(train_tokens, N_CTX, args.steps * BATCH, nval * BATCH)
        sched = schedule(args.steps)
        t0 = time.perf_counter()
        history = run_ggmlopt(model, ds, args.steps, nval, sched, seed, shuffle=shuffle)
        t_ggmlopt = time.perf_counter() - t0
        perm = np.asarray(ds.permutation)    # ndata_shard 1: the rows in fit's order
        g_val = history[0].val_loss
        g_held = go.evaluate(model, (hx, hy), go.LossType.CROSS_ENTROPY, BATCH).loss()[0]
        val_x, val_y = ds.data[perm[args.steps * BATCH:]], ds.labels[perm[args.steps * BATCH:]]
        bf16 = {}
        if args.bf16:
            model16 = make_model("llama", N_LAYERS, N_HEADS, DIM, N_CTX, seed)
            ds16, _ = training_windows(train_tokens, N_CTX, args.steps * BATCH, nval * BATCH)
            t0 = time.perf_counter()
            run_ggmlopt(model16, ds16, args.steps, nval, schedule(args.steps), seed, "bf16",
                        shuffle)
            held16 = go.evaluate(model16, (hx, hy), go.LossType.CROSS_ENTROPY, BATCH).loss()[0]
            bf16 = {"bf16_held_out": held16, "diff_bf16_f32": held16 - g_held,
                    "bf16_seconds": time.perf_counter() - t0}
            print(f"lm_quality: seed {seed}: held-out loss bf16 {held16:.4f} float32 "
                  f"{g_held:.4f} (diff {held16 - g_held:+.4f}); {bf16['bf16_seconds']:.0f} s",
                  flush=True)

        t0 = time.perf_counter()
        run_torch(twin, ds, perm, args.steps, sched)
        t_torch = time.perf_counter() - t0
        t_val = torch_mean_batch_loss(torch, twin, val_x, val_y)
        t_held = torch_mean_batch_loss(torch, twin, hx, hy)
        row = {"seed": seed, "steps": args.steps, "ggmlopt_val": g_val, "torch_val": t_val,
               "ggmlopt_held_out": g_held, "torch_held_out": t_held,
               "diff_held_out": g_held - t_held, "diff_val": g_val - t_val,
               "ggmlopt_seconds": t_ggmlopt, "torch_seconds": t_torch,
               "load": os.getloadavg(), **bf16}
        rows.append(row)
        print(f"lm_quality: seed {seed}: held-out loss ggmlopt {g_held:.4f} torch {t_held:.4f} "
              f"(diff {g_held - t_held:+.4f}); fit's validation windows ggmlopt {g_val:.4f} "
              f"torch {t_val:.4f} (diff {g_val - t_val:+.4f}); {t_ggmlopt:.0f} s / "
              f"{t_torch:.0f} s; load {row['load']}", flush=True)
    env["load_end"] = os.getloadavg()
    print("| seed | steps | held-out loss ggmlopt | torch | diff | val loss ggmlopt | torch | "
          "diff | seconds ggmlopt / torch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['steps']} | {r['ggmlopt_held_out']:.4f} | "
              f"{r['torch_held_out']:.4f} | {r['diff_held_out']:+.4f} | {r['ggmlopt_val']:.4f} | "
              f"{r['torch_val']:.4f} | {r['diff_val']:+.4f} | {r['ggmlopt_seconds']:.0f} / "
              f"{r['torch_seconds']:.0f} |")
    ok = all(abs(r["diff_held_out"]) <= 0.03 for r in rows)
    print(f"lm_quality: |ggmlopt - torch| <= 0.03 on every seed: {'yes' if ok else 'NO'}; "
          f"load {env['load_start']} -> {env['load_end']}")
    if args.bf16:
        ok16 = all(abs(r["diff_bf16_f32"]) <= 0.02 for r in rows)
        print(f"lm_quality: |bf16 - float32| <= 0.02 on every seed: {'yes' if ok16 else 'NO'} ("
              + ", ".join(f"{r['diff_bf16_f32']:+.4f}" for r in rows) + ")")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "runs": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
