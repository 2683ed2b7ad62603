"""Where the LoRA step of bench/test_bench_lora_step.py goes: the base's matrix
products, the adapters' rank-sized ones and everything else, timed by wrapping
every ggmlopt.gemm.matmul call (medians of 3 steps after 5 plain ones).

    python bench/lora_step_parts.py [threads] [engine]

(engine: numpy, native or mkl; default native.)
"""
import collections
import sys
import time

import numpy as np

import ggmlopt as go
from ggmlopt import gemm, lora
from ggmlopt.models import Llama, LlamaConfig

SHAPE = {"vocab_size": 49152, "dim": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3,
         "ffn_dim": 1536, "max_seq_len": 2048, "tie_embeddings": True}
T = 256


def main(threads=2, engine="native"):
    go.kernels.set_num_threads(threads)
    gemm.use_engine(engine)
    model = Llama(LlamaConfig(**SHAPE), seed=0)
    lora.apply(model, rank=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"),
               seed=0)
    pars = go.OptimizerParams(go.AdamWParams(alpha=1e-4))
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32,
                        get_opt_pars=lambda ud: pars)
    ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (1, T + 1)).astype(np.int32)
    x, y = np.ascontiguousarray(ids[:, :-1]), np.ascontiguousarray(ids[:, 1:])

    def step():
        ctx.alloc(True)
        ctx.eval(None, inputs=x, labels=y)

    step()
    plain = []
    for _ in range(5):
        t0 = time.perf_counter()
        step()
        plain.append(time.perf_counter() - t0)
    spent, calls, flops = collections.Counter(), collections.Counter(), collections.Counter()
    matmul = gemm.matmul
    rank = max(a.rank for _, a in lora.named_adapters(model))

    def timed(a, b, out=None, **kwargs):
        t0 = time.perf_counter()
        result = matmul(a, b, out, **kwargs)
        m, k = a.shape
        part = "adapters (rank-sized)" if min(m, k, b.shape[1]) <= rank else "base"
        spent[part] += time.perf_counter() - t0
        calls[part] += 1
        flops[part] += 2 * m * k * b.shape[1]
        return result

    gemm.matmul = timed
    steps = []
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            step()
            steps.append(time.perf_counter() - t0)
    finally:
        gemm.matmul = matmul
    print(f"LoRA step, {threads} threads, engine {engine}: {np.median(plain):.3f} s plain, "
          f"{np.median(steps):.3f} s wrapped")
    for part in spent:
        print(f"  {part:24s} {spent[part] / 3 * 1e3:8.1f} ms  {calls[part] // 3:5d} calls  "
              f"{flops[part] / spent[part] / 1e9:6.1f} GFLOP/s")
    print(f"  {'everything else':24s} {(sum(steps) - sum(spent.values())) / 3 * 1e3:8.1f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2, sys.argv[2] if len(sys.argv) > 2 else "native")
