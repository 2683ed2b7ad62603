"""Where a training step of the stories15M-shaped llama goes (bench/lm_models.py:
B=8, T=256, 2 threads, a dynamic OptContext): each phase's wall time, summed over
the 6 layers, median of a few steps.

    python bench/profile_lm_step.py [steps] [f32|bf16]

(bf16: the context's precision="bf16", where the CPU multiplies bf16 natively.)

Phases: embedding, RMSNorms, attention's four projections (BLAS) and its core
(RoPE + the fused attention kernel), the SwiGLU's three projections (BLAS) and its
product kernel, the lm_head's products, the loss (cross-entropy kernel over
(B*T, 32000) logits), the rest of eval (argmax of the logits for the accuracy,
checks), the AdamW step and the gradient zeroing.  The step's own total is timed
without the wrappers.
"""
import collections
import os
import sys
import time

import numpy as np

import ggmlopt as go
from ggmlopt.models import _fused_head
from ggmlopt.nn.attention import CausalSelfAttention
from ggmlopt.nn.embedding import Embedding
from ggmlopt.nn.linear import Linear
from ggmlopt.nn.mlp import SwiGLU
from ggmlopt.nn.norm import RMSNorm

sys.path.insert(0, os.path.dirname(__file__))
import lm_models

acc = collections.defaultdict(float)


def timed(obj, method, label):
    original = getattr(obj, method)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            acc[label] += time.perf_counter() - t0

    setattr(obj, method, wrapper)


class TimedArena:
    """The context's arena (a Cython object: its methods cannot be replaced) with
    adamw_step timed."""

    def __init__(self, arena):
        self._arena = arena

    def adamw_step(self, *args):
        t0 = time.perf_counter()
        try:
            return self._arena.adamw_step(*args)
        finally:
            acc["AdamW step"] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._arena, name)


def instrument(model, ctx):
    for name, m in model.named_modules():
        if isinstance(m, Embedding):
            kind = "embedding"
        elif isinstance(m, RMSNorm):
            kind = "rmsnorm"
        elif isinstance(m, CausalSelfAttention):
            kind = "attention total"
        elif isinstance(m, SwiGLU):
            kind = "swiglu total"
        elif isinstance(m, Linear):
            kind = ("lm_head matmuls" if name == "lm_head" else
                    "attention projections" if ".self_attn." in name else "swiglu projections")
        else:
            continue
        timed(m, "forward", f"{kind} fwd")
        timed(m, "backward", f"{kind} bwd")
        if kind == "lm_head matmuls":
            # the fused head's backward in a bf16 pass takes the gradient's bf16 bits
            timed(m, "backward_bf16", f"{kind} bwd")
    timed(ctx, "_loss", "cross-entropy loss + gradient")
    # the fused head's loss kernel, chunk by chunk (the unfused path times _loss)
    timed(_fused_head.kernels, "cross_entropy", "cross-entropy loss + gradient")
    timed(ctx, "_zero_grads", "gradient zeroing")
    ctx.arena = TimedArena(ctx.arena)
    timed(ctx, "eval", "eval total")


def main(steps=3, precision="f32"):
    go.kernels.set_num_threads(2)
    model = lm_models.ggmlopt_model()
    step, ctx = lm_models.ggmlopt_step(model, precision)
    step()
    plain = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        plain.append(time.perf_counter() - t0)
    instrument(model, ctx)
    step()
    rows = collections.defaultdict(list)
    for _ in range(steps):
        acc.clear()
        t0 = time.perf_counter()
        step()
        acc["step"] = time.perf_counter() - t0
        for d in ("fwd", "bwd"):
            acc[f"attention core (RoPE + fused kernel) {d}"] = (
                acc[f"attention total {d}"] - acc[f"attention projections {d}"])
            acc[f"swiglu product kernel {d}"] = (acc[f"swiglu total {d}"]
                                                 - acc[f"swiglu projections {d}"])
        known = sum(v for k, v in acc.items() if "total" not in k and k != "step"
                    and "core" not in k and "kernel" not in k) + sum(
            acc[f"{p} {d}"] for p in ("attention core (RoPE + fused kernel)",
                                      "swiglu product kernel") for d in ("fwd", "bwd"))
        acc["rest (argmax for accuracy, residual adds, checks, the batch)"] = acc["step"] - known
        for k, v in acc.items():
            rows[k].append(v)
    med = {k: float(np.median(v)) for k, v in rows.items() if "total" not in k}
    step_med = med.pop("step")
    print(f"stories15M training step ({ctx.precision}), B={lm_models.BATCH}, "
          f"T={lm_models.T}, 2 threads: "
          f"{float(np.median(plain)):.3f} s unwrapped, {step_med:.3f} s wrapped "
          f"(medians of {steps})")
    for k, v in sorted(med.items(), key=lambda kv: -kv[1]):
        print(f"  {k:62s} {v * 1e3:9.1f} ms  {100 * v / step_med:5.1f} %")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, sys.argv[2] if len(sys.argv) > 2 else "f32")
