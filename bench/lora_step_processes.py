"""The LoRA step of bench/test_bench_lora_step.py with each side alone in a
process of its own, as a user runs one model: the processes alternate side by
side over the rounds, so a change of machine load hits every side.

    python bench/lora_step_processes.py [threads] [rounds] [steps] [sides...]

Sides: ggmlopt-numpy, ggmlopt-native (float32 on that GEMM engine),
ggmlopt-bf16, peft-f32, peft-bf16 (torch.autocast); default: the two float32
ggmlopt sides and peft-f32.  Each process times `steps` steps after two
warm-up steps and prints their median; the table gives the median over the
rounds of those medians and each side's ratio to peft-f32's.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SIDES = ("ggmlopt-numpy", "ggmlopt-native", "ggmlopt-bf16", "peft-f32", "peft-bf16")


def run_side(side, directory, steps, threads):
    """Build side's model (ggmlopt's from its seed, PEFT's from directory) and
    print the median of `steps` timed steps (seconds) as JSON."""
    import time

    sys.path.insert(0, HERE)
    from test_bench_lora_step import SHAPE, ggmlopt_lora_step, peft_step

    from ggmlopt import gemm, kernels
    from ggmlopt.models import Llama, LlamaConfig

    kernels.set_num_threads(threads)
    if side.startswith("peft"):
        import torch

        torch.set_num_threads(threads)
        step = peft_step(directory, side == "peft-bf16")
    else:
        gemm.use_engine("native" if side == "ggmlopt-native" else "numpy")
        step = ggmlopt_lora_step(Llama(LlamaConfig(**SHAPE), seed=0),
                                 "bf16" if side == "ggmlopt-bf16" else "f32")
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"side": side, "median": float(np.median(times))}))


def main(threads=2, rounds=5, steps=5, sides=("ggmlopt-numpy", "ggmlopt-native", "peft-f32")):
    for side in sides:
        if side not in SIDES:
            raise SystemExit(f"sides: expected some of {', '.join(SIDES)}, got {side!r}")
    sys.path.insert(0, HERE)
    from test_bench_lora_step import SHAPE

    from ggmlopt.io import save_hf
    from ggmlopt.models import Llama, LlamaConfig

    medians = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        directory = os.path.join(tmp, "hf")
        save_hf(Llama(LlamaConfig(**SHAPE), seed=0), directory)
        for _ in range(rounds):
            for side in sides:
                # fewer threads than cores: every library's as many as the side's own
                # (NumPy's OpenBLAS and MKL read these when they load); on all the
                # cores, the environment a user has
                env = dict(os.environ)
                if threads != os.cpu_count():
                    env.update({k: str(threads) for k in (
                        "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
                out = subprocess.run([sys.executable, __file__, "--side", side, directory,
                                      str(steps), str(threads)],
                                     capture_output=True, text=True, check=True, env=env)
                medians[side].append(json.loads(out.stdout.strip().splitlines()[-1])["median"])
    peft = float(np.median(medians["peft-f32"])) if "peft-f32" in medians else None
    print(f"LoRA q/k/v/o r8, SmolLM2-135M shape, 1 x 256, {threads} threads; a process a side, "
          f"{rounds} rounds of {steps} steps, median of the process medians")
    for side, ts in medians.items():
        med = float(np.median(ts))
        ratio = f"  / peft-f32 = {med / peft:.2f}" if peft else ""
        print(f"{side:15s} {med:.3f} s/step{ratio}  (rounds: "
              f"{', '.join(f'{t:.3f}' for t in ts)})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--side"]:
        run_side(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        args = sys.argv[1:]
        given = [int(a) for a in args[:3] if a.isdigit()]
        numbers = given + [2, 5, 5][len(given):]
        main(*numbers, tuple(args[len(given):]) or ("ggmlopt-numpy", "ggmlopt-native",
                                                    "peft-f32"))
