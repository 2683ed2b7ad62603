"""A training step against torch's with each side alone in a process of its
own, as a user runs one model: the processes alternate side by side over the
rounds, so a change of machine load hits every side.

    python bench/step_processes.py WORKLOAD [threads] [rounds] [steps] [sides...]

WORKLOAD: ``lora``, the LoRA step of bench/test_bench_lora_step.py (torch's
side: transformers + PEFT), or ``stories15m``, the full step of
bench/test_bench_lm_step.py.  Sides: ggmlopt-numpy, ggmlopt-native (float32 on
that GEMM engine), ggmlopt-bf16, torch-f32, torch-bf16 (torch.autocast);
default: the two float32 ggmlopt sides and torch-f32.  Each process times
`steps` steps after two warm-up steps and prints their median; the table gives
the median over the rounds of those medians and each side's ratio to
torch-f32's.  With fewer threads than cores every library gets as many as the
side (OMP_, OPENBLAS_ and MKL_NUM_THREADS); on all the cores the environment
stays as a user has it.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = ("lora", "stories15m")
SIDES = ("ggmlopt-numpy", "ggmlopt-native", "ggmlopt-bf16", "torch-f32", "torch-bf16")


def _step(workload, side, directory):
    """The step of side: ggmlopt's model from its seed; torch's from directory
    (the LoRA base saved by save_hf) or from ggmlopt's weights (stories15m)."""
    sys.path.insert(0, HERE)
    from ggmlopt import gemm

    bf16 = side.endswith("bf16")
    if not side.startswith("torch"):
        gemm.use_engine("native" if side == "ggmlopt-native" else "numpy")
    if workload == "lora":
        from test_bench_lora_step import SHAPE, ggmlopt_lora_step, peft_step

        from ggmlopt.models import Llama, LlamaConfig

        if side.startswith("torch"):
            return peft_step(directory, bf16)
        return ggmlopt_lora_step(Llama(LlamaConfig(**SHAPE), seed=0), "bf16" if bf16 else "f32")
    import lm_models

    if side.startswith("torch"):
        return lm_models.torch_step(lm_models.ggmlopt_model(), autocast_bf16=bf16)[0]
    return lm_models.ggmlopt_step(lm_models.ggmlopt_model(), "bf16" if bf16 else "f32")[0]


def run_side(workload, side, directory, steps, threads):
    """Print the median of `steps` timed steps of side (seconds) as JSON."""
    import time

    from ggmlopt import kernels

    kernels.set_num_threads(threads)
    if side.startswith("torch"):
        import torch

        torch.set_num_threads(threads)
    step = _step(workload, side, directory)
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"side": side, "median": float(np.median(times))}))


def main(workload, threads=2, rounds=5, steps=5,
         sides=("ggmlopt-numpy", "ggmlopt-native", "torch-f32")):
    if workload not in WORKLOADS:
        raise SystemExit(f"WORKLOAD: expected one of {', '.join(WORKLOADS)}, got {workload!r}")
    for side in sides:
        if side not in SIDES:
            raise SystemExit(f"sides: expected some of {', '.join(SIDES)}, got {side!r}")
    env = dict(os.environ)
    if threads != os.cpu_count():
        env.update({k: str(threads) for k in (
            "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
    medians = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        directory = os.path.join(tmp, "hf")
        if workload == "lora":
            sys.path.insert(0, HERE)
            from test_bench_lora_step import SHAPE

            from ggmlopt.io import save_hf
            from ggmlopt.models import Llama, LlamaConfig

            save_hf(Llama(LlamaConfig(**SHAPE), seed=0), directory)
        for _ in range(rounds):
            for side in sides:
                out = subprocess.run([sys.executable, __file__, "--side", workload, side,
                                      directory, str(steps), str(threads)],
                                     capture_output=True, text=True, check=True, env=env)
                medians[side].append(json.loads(out.stdout.strip().splitlines()[-1])["median"])
    base = float(np.median(medians["torch-f32"])) if "torch-f32" in medians else None
    print(f"{workload} step, {threads} threads; a process a side, {rounds} rounds of {steps} "
          "steps, median of the process medians")
    for side, ts in medians.items():
        med = float(np.median(ts))
        ratio = f"  / torch-f32 = {med / base:.2f}" if base else ""
        print(f"{side:15s} {med:.3f} s/step{ratio}  (rounds: "
              f"{', '.join(f'{t:.3f}' for t in ts)})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--side"]:
        run_side(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    elif len(sys.argv) < 2:
        raise SystemExit(__doc__)
    else:
        args = sys.argv[2:]
        given = [int(a) for a in args[:3] if a.isdigit()]
        numbers = given + [2, 5, 5][len(given):]
        main(sys.argv[1], *numbers, tuple(args[len(given):]) or (
            "ggmlopt-numpy", "ggmlopt-native", "torch-f32"))
