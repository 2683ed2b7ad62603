"""Peak resident memory of building, loading and using a language model, each case
in a fresh process (VmHWM), as a multiple of the model's float32 weights.

    python bench/memory_peaks.py            # SmolLM2-135M's shape (513 MiB of weights)
    python bench/memory_peaks.py --small    # a quick run on a stories15M-sized model

Cases: ``build`` (Llama(config)), ``generate`` (build, then 16 greedy tokens),
``load_gguf`` (a float32 GGUF written beforehand, read back), ``evaluate``;
training (three AdamW steps, the peak beside ``memory_report``'s estimate and
the median time of the steps after the first): ``train-256`` (full
fine-tune, 1 x 256), ``train-256-inbwd`` (the same with the optimizer step in
the backward pass, ``optimizer_in_backward=True``), ``train-256-inbwd-ckpt``
(and activation checkpointing), ``train-2048-ckpt`` (1 x 2048 with
checkpointing), and with ``--large`` ``lora-1b-ckpt`` (LoRA q/k/v/o rank 8 over
a Llama-3.2-1B-shaped float32 model, 1 x 1024, checkpointing).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

SMOLLM2_135M = {"vocab_size": 49152, "dim": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3,
                "ffn_dim": 1536, "max_seq_len": 2048, "tie_embeddings": True}
LLAMA_3_2_1B = {"vocab_size": 128256, "dim": 2048, "n_layers": 16, "n_heads": 32,
                "n_kv_heads": 8, "ffn_dim": 8192, "max_seq_len": 2048, "tie_embeddings": True,
                "rope_base": 500000.0}
# name: (tokens, checkpointing, LoRA adapters, optimizer in the backward pass)
TRAIN = {"train-256": (256, False, False, False), "train-256-inbwd": (256, False, False, True),
         "train-256-inbwd-ckpt": (256, True, False, True),
         "train-2048-ckpt": (2048, True, False, False), "lora-1b-ckpt": (1024, True, True, False)}
SMALL = {"vocab_size": 32000, "dim": 288, "n_layers": 6, "n_heads": 6, "ffn_dim": 768,
         "max_seq_len": 256, "tie_embeddings": True}


def _peak_bytes() -> int:
    """This process's peak RSS: VmHWM (ru_maxrss would start at the size of the
    parent it was forked from), ru_maxrss where /proc is not there."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _case(name: str, cfg: dict, path: str) -> dict:
    import numpy as np

    import ggmlopt as go
    from ggmlopt.models import Llama, LlamaConfig
    if name in TRAIN:
        return _train_case(name, cfg)
    if name == "load_gguf":
        from ggmlopt.io import load_gguf
        model, _ = load_gguf(path)
    else:
        model = Llama(LlamaConfig(**cfg), seed=0)
    if name == "generate":
        go.generate(model, [1, 2, 3], 16, temperature=0)
    if name == "evaluate":
        tokens = np.random.default_rng(0).integers(0, cfg["vocab_size"], (2, 65)).astype(np.int32)
        go.evaluate(model, (tokens[:, :-1], tokens[:, 1:]), "cross_entropy", batch_size=1)
    weights = sum(p.data.nbytes for p in model.parameters())
    peak = _peak_bytes()
    return {"case": name, "weights_mib": weights / 2**20, "peak_mib": peak / 2**20,
            "ratio": peak / weights}


def _train_case(name: str, cfg: dict) -> dict:
    import statistics
    import time

    import numpy as np

    import ggmlopt as go
    from ggmlopt import lora
    from ggmlopt.models import Llama, LlamaConfig
    t, checkpointing, adapters, in_backward = TRAIN[name]
    if adapters:
        cfg = LLAMA_3_2_1B
    model = Llama(LlamaConfig(**{**cfg, "max_seq_len": max(t, cfg["max_seq_len"])}), seed=0)
    if adapters:
        lora.apply(model, rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    if checkpointing:
        model.gradient_checkpointing_enable()
    report = go.memory_report(model, 1, t, optimizer_in_backward=in_backward)
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32,
                        optimizer_in_backward=in_backward)
    tokens = np.random.default_rng(0).integers(0, cfg["vocab_size"], (1, t + 1))
    tokens = tokens.astype(np.int32)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        ctx.alloc(True)
        ctx.eval(None, inputs=tokens[:, :-1], labels=tokens[:, 1:])
        times.append(time.perf_counter() - start)
    weights = sum(p.data.nbytes for p in model.parameters())
    peak = _peak_bytes()
    return {"case": name, "weights_mib": weights / 2**20, "peak_mib": peak / 2**20,
            "ratio": peak / weights, "estimate_mib": report.total / 2**20,
            "step_s": statistics.median(times[1:])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--large", action="store_true",
                    help="also the LoRA case over a Llama-3.2-1B shape (about 6 GiB)")
    ap.add_argument("--cases", help="comma-separated cases to run (default: all)")
    ap.add_argument("--case")
    ap.add_argument("--cfg")
    ap.add_argument("--path")
    args = ap.parse_args()
    if args.case:   # one case, in this fresh process
        print(json.dumps(_case(args.case, json.loads(args.cfg), args.path)))
        return
    cfg = SMALL if args.small else SMOLLM2_135M
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.gguf")
        # the GGUF is written in its own process, so its memory counts nowhere
        subprocess.run([sys.executable, "-c", (
            "import json, sys; from ggmlopt.models import Llama, LlamaConfig; "
            "from ggmlopt.io import save_gguf; from ggmlopt.text import ByteTokenizer; "
            "cfg = json.loads(sys.argv[1]); cfg['vocab_size'] = 257; "
            "save_gguf(Llama(LlamaConfig(**cfg)), sys.argv[2], tokenizer=ByteTokenizer())"),
            json.dumps(cfg), path], check=True)
        cases = ["build", "generate", "evaluate", "load_gguf", "train-256", "train-256-inbwd",
                 "train-256-inbwd-ckpt", "train-2048-ckpt"]
        if args.cases:
            cases = args.cases.split(",")
        for case in cases + (["lora-1b-ckpt"] if args.large else []):
            out = subprocess.run([sys.executable, __file__, "--case", case, "--cfg",
                                  json.dumps(cfg), "--path", path], check=True,
                                 capture_output=True, text=True).stdout
            r = json.loads(out)
            estimate = (f"  memory_report {r['estimate_mib']:7.1f} MiB "
                        f"({r['estimate_mib'] / r['peak_mib'] - 1:+.1%})"
                        if "estimate_mib" in r else "")
            step = f"  step {r['step_s']:.2f} s" if "step_s" in r else ""
            print(f"{r['case']:20s} weights {r['weights_mib']:7.1f} MiB  peak "
                  f"{r['peak_mib']:7.1f} MiB  {r['ratio']:.2f}x{estimate}{step}")


if __name__ == "__main__":
    main()
