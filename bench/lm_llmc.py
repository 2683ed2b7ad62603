"""A GPT-2 training step: ggmlopt's ``fit`` against llm.c's CPU trainer
(karpathy/llm.c's train_gpt2.c, OpenMP), same shape, same weights, same B and T.

    python bench/lm_llmc.py LLM_C_DIR [--rounds 5] [--steps 4] [--shape 124M|small]

LLM_C_DIR is a checkout of llm.c (outside this project; nothing of it is copied
here).  Without it the script says so and exits 0.  It:

- compiles ``bench/llmc_step.c`` (llm.c's train_gpt2.c with its own step, see
  that file) with llm.c's Makefile flags: ``-Ofast -march=native -fopenmp -DOMP``;
- makes a ``ggmlopt.models.GPT2`` (seed 0) and writes it as an llm.c checkpoint
  (256 int32 header: magic 20240326, version 3, maxT, V, L, NH, C, Vp; then the
  float32 parameters in llm.c's order, Linear weights (out, in), the vocabulary
  padded to a multiple of 128 with zero rows);
- writes tokens in llm.c's .bin format (256 int32 header: magic 20240520,
  version 1, count; uint16 tokens): ggmlopt's offline corpus (ggmlopt.corpora)
  (``python_docstrings``) as bytes, so ids < 256;
- checks that both sides give the same loss on the first batch (same model);
- alternates rounds: llm.c (``OMP_NUM_THREADS=2``, ``--steps`` steps in a fresh
  process, its first step dropped: llm.c allocates its activations and AdamW
  state there) and ggmlopt (``go.fit`` over ``--steps`` logical batches of B
  windows of T tokens, AdamW with llm.c's settings, 2 threads, timed after a
  warm-up fit), and prints the medians of the per-step times and their ratio.

Shapes: ``124M`` is GPT-2 small (vocab 50257, 1024 positions, 12 layers, 12
heads, dim 768) at llm.c's own CPU batch B=4, T=64; ``small`` is the
stories15M size (vocab 32000, 256 positions, 6 layers, 6 heads, dim 288) at
B=8, T=256.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import ggmlopt as go
from ggmlopt.corpora import python_docstrings
from ggmlopt.models import GPT2, GPT2Config

SHAPES = {
    "124M": ({"vocab_size": 50257, "dim": 768, "n_layers": 12, "n_heads": 12,
              "max_seq_len": 1024}, 4, 64),
    "small": ({"vocab_size": 32000, "dim": 288, "n_layers": 6, "n_heads": 6,
               "max_seq_len": 256}, 8, 256),
}
LR, BETA1, BETA2, EPS, WD = 1e-4, 0.9, 0.999, 1e-8, 0.0   # llm.c's train_gpt2.c


def llmc_checkpoint(model, path):
    """Write the ggmlopt GPT2 as llm.c's float32 checkpoint (gpt2_build_from_checkpoint)."""
    cfg = model.config
    c, nl = cfg.dim, cfg.n_layers
    vp = (cfg.vocab_size + 127) // 128 * 128
    header = np.zeros(256, np.int32)
    header[:8] = [20240326, 3, cfg.max_seq_len, cfg.vocab_size, nl, cfg.n_heads, c, vp]
    p = {name: np.asarray(t.data, np.float32) for name, t in model.named_parameters()}

    def stack(fmt, transpose=False):
        return np.stack([p[fmt.format(i)].T if transpose else p[fmt.format(i)]
                         for i in range(nl)])

    wte = np.zeros((vp, c), np.float32)
    wte[:cfg.vocab_size] = p["wte.weight"]
    tensors = [wte, p["wpe.weight"],
               stack("h.{}.ln_1.weight"), stack("h.{}.ln_1.bias"),
               stack("h.{}.attn.c_attn.weight", True), stack("h.{}.attn.c_attn.bias"),
               stack("h.{}.attn.c_proj.weight", True), stack("h.{}.attn.c_proj.bias"),
               stack("h.{}.ln_2.weight"), stack("h.{}.ln_2.bias"),
               stack("h.{}.mlp.c_fc.weight", True), stack("h.{}.mlp.c_fc.bias"),
               stack("h.{}.mlp.c_proj.weight", True), stack("h.{}.mlp.c_proj.bias"),
               p["ln_f.weight"], p["ln_f.bias"]]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.writelines(np.ascontiguousarray(t, np.float32).tobytes() for t in tensors)


def llmc_tokens(tokens, path):
    """Write token ids in llm.c's .bin format (header of 256 int32, uint16 ids)."""
    header = np.zeros(256, np.int32)
    header[:3] = [20240520, 1, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, np.uint16).tobytes())


def build_driver(llmc_dir, out):
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llmc_step.c")
    cmd = ["gcc", "-Ofast", "-march=native", "-fopenmp", "-DOMP", "-Wno-unused-result",
           "-I", llmc_dir, src, "-lm", "-o", out]
    subprocess.run(cmd, check=True)
    return cmd


def run_llmc(exe, model_bin, tokens_bin, b, t, steps):
    """llm.c's per-step (ms list, losses) from a fresh process on 2 OpenMP threads."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run([exe, model_bin, tokens_bin, str(b), str(t), str(steps)], env=env,
                         check=True, capture_output=True, text=True).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith("step ")]
    return [float(r[5]) for r in rows], [float(r[3]) for r in rows]


def first_batch_loss(model, tokens, b, t):
    """ggmlopt's mean next-token cross-entropy on llm.c's first batch (file order)."""
    x = tokens[:b * t].reshape(b, t).astype(np.int32)
    y = tokens[1:b * t + 1].reshape(b, t).astype(np.int32)
    logits = np.asarray(model(x), np.float64).reshape(b * t, -1)
    m = logits.max(axis=1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(logits - m).sum(axis=1)))
    return float(np.mean(lse - logits[np.arange(b * t), y.reshape(-1)]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("llmc_dir", nargs="?", default=os.environ.get("LLMC_DIR"))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="124M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="steps per round and side")
    args = ap.parse_args()
    if not args.llmc_dir or not os.path.isfile(os.path.join(args.llmc_dir, "train_gpt2.c")):
        print("skipped: give the path of an llm.c checkout (with train_gpt2.c)")
        return
    shape, b, t = SHAPES[args.shape]
    cfg = GPT2Config(**shape)
    go.set_num_threads(2)
    tmp = tempfile.mkdtemp(prefix="lm_llmc_")
    try:
        exe = os.path.join(tmp, "llmc_step")
        cmd = build_driver(os.path.abspath(args.llmc_dir), exe)
        model = GPT2(cfg, seed=0)
        text = python_docstrings(min_bytes=(args.steps + 1) * b * t + 1)
        tokens = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        n_tok = (args.steps + 1) * b * t + 1
        tokens = tokens[:n_tok]
        model_bin, tokens_bin = os.path.join(tmp, "model.bin"), os.path.join(tmp, "tok.bin")
        llmc_checkpoint(model, model_bin)
        llmc_tokens(tokens, tokens_bin)

        # same model: the loss of the first batch on both sides
        ours0 = first_batch_loss(model, tokens, b, t)
        _, losses = run_llmc(exe, model_bin, tokens_bin, b, t, 1)
        print(f"first-batch loss: ggmlopt {ours0:.6f}, llm.c {losses[0]:.6f}")

        ds = go.Dataset.from_tokens(tokens[:args.steps * b * t + t + 1], t, stride=t)
        pars = go.OptimizerParams(go.AdamWParams(alpha=LR, beta1=BETA1, beta2=BETA2, eps=EPS,
                                                 wd=WD))

        def ours():
            t0 = time.perf_counter()
            go.fit(model, ds, go.LossType.CROSS_ENTROPY, lambda e: pars, nepoch=1,
                   nbatch_logical=b, silent=True, seed=0)
            return (time.perf_counter() - t0) / (ds.ndata // b) * 1e3

        ours()  # warm-up: builds the context and the AdamW state
        go_ms, c_ms = [], []
        for r in range(args.rounds):
            ms, _ = run_llmc(exe, model_bin, tokens_bin, b, t, args.steps + 1)
            c_ms.append(float(np.median(ms[1:])))
            go_ms.append(ours())
            print(f"round {r}: llm.c {c_ms[-1]:.1f} ms/step, ggmlopt fit {go_ms[-1]:.1f} ms/step "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
        g, c = float(np.median(go_ms)), float(np.median(c_ms))
        print(f"\nGPT-2 {args.shape} ({sum(p.data.size for _, p in model.named_parameters()):,} "
              f"parameters), B={b}, T={t}, 2 threads, medians of {args.rounds} rounds of "
              f"{args.steps} steps\nllm.c: {c:.1f} ms/step ({b * t / c * 1e3:,.0f} tokens/s)   "
              f"ggmlopt fit: {g:.1f} ms/step ({b * t / g * 1e3:,.0f} tokens/s)   "
              f"ggmlopt/llm.c = {g / c:.2f} (aim <= 0.5)\nllm.c build: {' '.join(cmd)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
