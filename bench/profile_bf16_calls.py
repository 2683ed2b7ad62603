"""Where a bf16 training step of the stories15M-shaped llama goes by product:
every gemm.matmul_bf16 call (the head's, with a dimension of the 32000-token
vocabulary, and the layers') and every rounding to bf16, wrapped and timed;
the rest of the step is what the two leave (attention core, loss, norms,
SwiGLU, AdamW, Python).  Medians over steps after two warm-ups.

    python bench/profile_bf16_calls.py [steps]
"""
import collections
import os
import sys
import time

import numpy as np

import ggmlopt as go
from ggmlopt import gemm, kernels

sys.path.insert(0, os.path.dirname(__file__))
import lm_models

seconds = collections.defaultdict(float)
calls = collections.Counter()
amount = collections.defaultdict(float)   # FLOP of the products, values of the roundings


def wrap_products():
    product = gemm.matmul_bf16

    def timed(a, b, out, accumulate=False):
        t0 = time.perf_counter()
        try:
            return product(a, b, out, accumulate=accumulate)
        finally:
            part = "head products" if max(a.shape + b.shape) >= 32000 else "layer products"
            seconds[part] += time.perf_counter() - t0
            calls[part] += 1
            amount[part] += 2.0 * a.shape[0] * a.shape[1] * b.shape[1]

    gemm.matmul_bf16 = timed


def wrap_rounding():
    rounding = kernels.to_bfloat16

    def timed(a, out=None):
        t0 = time.perf_counter()
        try:
            return rounding(a, out=out)
        finally:
            seconds["rounding to bf16"] += time.perf_counter() - t0
            calls["rounding to bf16"] += 1
            amount["rounding to bf16"] += a.size

    kernels.to_bfloat16 = timed


def main(steps=5):
    wrap_products()
    wrap_rounding()
    go.kernels.set_num_threads(2)
    model = lm_models.ggmlopt_model()
    step, _ = lm_models.ggmlopt_step(model, "bf16")
    step()
    step()
    rows = collections.defaultdict(list)
    for _ in range(steps):
        seconds.clear()
        calls.clear()
        amount.clear()
        t0 = time.perf_counter()
        step()
        total = time.perf_counter() - t0
        rows["step"].append(total)
        rows["rest"].append(total - sum(seconds.values()))
        for part, s in seconds.items():
            rows[part].append(s)
    print(f"stories15M bf16 step, B={lm_models.BATCH}, T={lm_models.T}, 2 threads, "
          f"medians of {steps}")
    for part, values in rows.items():
        s = float(np.median(values))
        extra = ""
        if part.endswith("products"):
            extra = f"  {calls[part]} calls, {amount[part] / s / 1e9:.0f} GFLOP/s"
        elif part.startswith("rounding"):
            extra = f"  {calls[part]} calls, {amount[part] / 1e6:.1f} M values"
        print(f"  {part:18s} {s * 1e3:8.1f} ms{extra}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
