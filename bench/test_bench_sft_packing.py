"""Supervised fine-tuning throughput, packed against padded: one epoch over the
same 64 prompt/completion examples of a chat-like length mix (lognormal, median
110 tokens, clipped to 16 .. 512; the loss on the completions), in windows of
512 tokens on the stories15M-shaped llama (dim 288, 6 layers, vocabulary 32000),
one window a step, AdamW on every weight, 2 threads, the epochs interleaved.

Padded: one example a window (``Dataset.from_completions``); packed: several a
window (``packing=True``), each attending to itself only.  Both train on the same
labelled tokens; the packed epoch has far fewer windows.

Run: python -m pytest -q -s bench/test_bench_sft_packing.py
"""
import os
import sys

import numpy as np

import ggmlopt as go
from ggmlopt import gemm, kernels
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.text import ByteTokenizer

sys.path.insert(0, os.path.dirname(__file__))
import lm_models
from test_bench_lm_step import interleaved_medians

N_CTX = 512
N_EXAMPLES = 64


def examples(seed=0):
    """(prompt, completion) text pairs, one byte a token: lengths of a chat mix."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(110), 0.7, N_EXAMPLES), 16, N_CTX - 1).astype(int)
    pairs = []
    for n in lengths:
        prompt = int(n * rng.uniform(0.3, 0.7))
        text = "".join(chr(c) for c in rng.integers(97, 123, n - 1))   # eos makes n
        pairs.append((text[:prompt], text[prompt:]))
    return pairs


def epoch_runner(packing):
    ds = go.Dataset.from_completions(examples(), ByteTokenizer(), N_CTX, packing=packing)
    model = Llama(LlamaConfig(**{**lm_models.STORIES15M, "max_seq_len": N_CTX}), seed=0)
    pars = go.OptimizerParams(go.AdamWParams(alpha=1e-4))

    def run():
        go.fit(model, ds, "cross_entropy", lambda e: pars, nepoch=1, nbatch_logical=1,
               silent=True, seed=0)

    labelled = int((np.asarray(ds.labels) >= 0).sum())
    return run, ds.ndata, labelled


def test_bench_packed_against_padded_epochs(threads):
    threads(2)
    padded, n_padded, lab_padded = epoch_runner(False)
    packed, n_packed, lab_packed = epoch_runner(True)
    assert lab_packed == lab_padded   # the same trained tokens
    med, all_times = interleaved_medians({"padded": padded, "packed": packed}, repeats=3)
    tokens = sum(len(p) + len(c) + 1 for p, c in examples()) - N_EXAMPLES
    lines = [(f"SFT epoch, {N_EXAMPLES} examples ({tokens} tokens, {lab_padded} trained) in "
              f"windows of {N_CTX}, stories15M shape, 2 threads (ggmlopt "
              f"{kernels.simd_info()['active']}, GEMM {gemm.engine()})")]
    for name, n in (("padded", n_padded), ("packed", n_packed)):
        lines.append(f"{name:7s} {n:3d} windows ({tokens / (n * N_CTX):.0%} of positions are "
                     f"tokens) {med[name]:.2f} s/epoch, {lab_padded / med[name]:.0f} trained "
                     f"tokens/s (all: {', '.join(f'{t:.2f}' for t in all_times[name])})")
    lines.append(f"packed / padded time = {med['packed'] / med['padded']:.3f} "
                 f"({med['padded'] / med['packed']:.1f}x the throughput)")
    print("\n" + "\n".join(lines))
