"""Float32 products at a language model's training shapes on each GEMM engine
(numpy: NumPy's OpenBLAS; native: ggmlopt's own kernels; mkl where installed),
and bf16 products on each bf16 engine where the CPU has bf16 products
(bf16-native: ggmlopt's own kernels; bf16-mkl where installed; operands rounded
beforehand), GFLOP/s, medians of repeats over 8 different weights a shape (so
the weights come from memory, as in a step, not from cache).

    python bench/gemm_engines.py [threads]

Each engine runs in a process of its own: an idle OpenBLAS's workers spin for
a while after each product and would take the cores from the others; native's
process sets OPENBLAS_NUM_THREADS=1 for the same reason, as training does.
Shapes (rows, inner, columns, which operand is a transposed view): the
SmolLM2-135M-shaped LoRA step (1 x 256 tokens: projections forward and input
gradient, the tied head's 128-row chunks) and the stories15M full step (8 x 256:
weight gradients x^T dy too).
"""
import os
import subprocess
import sys
import time

SHAPES = [(256, 576, 1536, "-"), (256, 1536, 576, "b"), (256, 1536, 576, "-"),
          (256, 576, 576, "-"), (256, 576, 576, "b"), (256, 576, 192, "-"),
          (256, 192, 576, "b"), (128, 576, 49152, "b"), (128, 49152, 576, "-"),
          (2048, 288, 768, "-"), (2048, 768, 288, "b"), (288, 2048, 768, "a")]


def child(engine, threads):
    import numpy as np

    import ggmlopt as go
    from ggmlopt import gemm

    bf16 = engine.startswith("bf16-")
    if bf16:
        gemm.use_bf16_engine(engine[5:])
    else:
        gemm.use_engine(engine)
    go.set_num_threads(threads)
    rng = np.random.default_rng(0)
    for m, k, n, trans in SHAPES:
        a = rng.standard_normal((k, m) if trans == "a" else (m, k), dtype=np.float32)
        a = a.T if trans == "a" else a
        ws = [rng.standard_normal((n, k), dtype=np.float32).T if trans == "b"
              else rng.standard_normal((k, n), dtype=np.float32) for _ in range(8)]
        if bf16:
            a = go.kernels.to_bfloat16(np.ascontiguousarray(a.T)).T if trans == "a" \
                else go.kernels.to_bfloat16(a)
            ws = [go.kernels.to_bfloat16(np.ascontiguousarray(w.T)).T if trans == "b"
                  else go.kernels.to_bfloat16(w) for w in ws]
        product = gemm.matmul_bf16 if bf16 else gemm.matmul
        out = np.empty((m, n), np.float32)
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            for w in ws:
                product(a, w, out)
            times.append((time.perf_counter() - t0) / len(ws))
        t = sorted(times)[len(times) // 2]
        print(f"{m}x{k}x{n}{'' if trans == '-' else ' ' + trans + '^T'} {2 * m * k * n / t / 1e9:.0f}")


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    from ggmlopt import gemm
    mkl = gemm.mkl_library() is not None
    engines = ["numpy", "native"] + (["mkl"] if mkl else [])
    if gemm.bf16_support()[0]:
        engines += ["bf16-native"] + (["bf16-mkl"] if mkl else [])
    columns = {}
    for engine in engines:
        env = dict(os.environ, MKL_NUM_THREADS=str(threads),
                   OPENBLAS_NUM_THREADS="1" if "native" in engine else str(threads))
        out = subprocess.run([sys.executable, __file__, "--child", engine, str(threads)],
                             env=env, capture_output=True, text=True, check=True).stdout
        columns[engine] = dict(line.rsplit(" ", 1) for line in out.splitlines())
    print(f"GFLOP/s, {threads} threads: " + " | ".join(engines))
    for shape in columns["numpy"]:
        print(f"{shape:22s} " + " | ".join(f"{columns[e][shape]:>6s}" for e in engines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
    else:
        main()
