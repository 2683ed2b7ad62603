"""QLoRA against LoRA over float32: the step time and the peak memory of LoRA
(q, k, v, o, rank 8) over the same SmolLM2-135M-shaped model stored as float32,
Q8_0, Q4_0 and (when llama-cpp-python is installed: llama-quantize makes them)
Q4_K_M, each case in a fresh process.

    python bench/qlora_step.py            # SmolLM2-135M's shape, 1 x 256, 2 threads
    python bench/qlora_step.py --small    # a quick run on a stories15M-sized model
    python bench/qlora_step.py --decode [--rounds 5] [--quantize q4_k_m,q3_k_m,iq4_xs]
                                          # greedy decoding, tokens/s, beside llama.cpp
                                          # (float32 activations, rounded to Q8_0, and
                                          # with rank-8 LoRA adapters on q/k/v/o)
    python bench/qlora_step.py --llama-1b --tokens 512 [--checkpointing]
                                          # Llama-3.2-1B's shape and vocabulary, Q4_K_M
                                          # written by save_gguf: QLoRA's peak memory

Each case loads the GGUF (``keep_types=True`` for the quantized ones), applies
LoRA, and times one OptContext step (forward, backward, AdamW) over 1 x 256
tokens: the median of the steps after one warm-up.  Peak memory is VmHWM of
the case's process.  The same file's float32 LoRA is the baseline of every ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SMOLLM2_135M = {"vocab_size": 49152, "dim": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3,
                "ffn_dim": 1536, "max_seq_len": 2048, "tie_embeddings": True}
# Llama 3.2 1B's shape, its 128,256-token vocabulary included (tied head)
LLAMA_3_2_1B = {"vocab_size": 128256, "dim": 2048, "n_layers": 16, "n_heads": 32,
                "n_kv_heads": 8, "ffn_dim": 8192, "max_seq_len": 2048, "tie_embeddings": True,
                "rope_base": 500000.0}
SMALL = {"vocab_size": 32000, "dim": 288, "n_layers": 6, "n_heads": 6, "ffn_dim": 768,
         "max_seq_len": 256, "tie_embeddings": True}
T = 256


def _peak_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _case(path: str, keep: bool, steps: int, checkpointing: bool = False) -> dict:
    import numpy as np

    import ggmlopt as go
    from ggmlopt import lora
    from ggmlopt.io import load_gguf
    go.set_num_threads(2)
    model, _ = load_gguf(path, keep_types=keep)
    lora.apply(model, rank=8)
    if checkpointing:
        model.gradient_checkpointing_enable()
    ctx = go.OptContext(model, loss_type=go.LossType.CROSS_ENTROPY, inputs_dtype=np.int32)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.config.vocab_size, (1, T + 1)).astype(np.int32)
    x, y = np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        ctx.alloc(True)
        ctx.eval(None, inputs=x, labels=y)
        times.append(time.perf_counter() - t0)
    return {"step_s": float(np.median(times[1:])), "peak_mib": _peak_mib(),
            "loss": float(ctx.loss)}


def _decode(path: str, keep: bool, n: int = 64) -> dict:
    """Greedy decoding of n tokens after a 16-token prompt, batch 1, 2 threads:
    ggmlopt (keep_types) and, when installed, llama.cpp on the same file; each
    side's time from the prompt's step done to the n-th token after it."""

    import ggmlopt as go
    from ggmlopt.io import load_gguf
    from ggmlopt.lm import stream
    from ggmlopt.nn.quantized import set_activations
    go.set_num_threads(2)
    model, _ = load_gguf(path, keep_types=keep)
    prompt = list(range(1, 17))
    row = {}
    # the float32 activations (the default), then rounded to Q8_0 as llama.cpp
    # multiplies Q8_0 and Q4_0 weights (where the file has such layers)
    for activations in ("f32", "q8_0"):
        if set_activations(model, activations) == 0 and activations != "f32":
            continue
        go.generate(model, prompt, 4, temperature=0)   # warm-up
        # the n tokens after the prompt's step, as llama.cpp's side times them
        tokens = stream(model, prompt, n + 1, temperature=0)
        next(tokens)
        t0 = time.perf_counter()
        assert sum(1 for _ in tokens) == n
        row[f"ggmlopt_{activations}_tok_s"] = n / (time.perf_counter() - t0)
    if keep:   # after fine-tuning: rank-8 adapters on q, k, v, o over the kept base
        from ggmlopt import lora
        lora.apply(model, rank=8)
        for _, adapter in lora.named_adapters(model):
            adapter.lora_b.data[...] = 0.01
        set_activations(model, "q8_0")
        go.generate(model, prompt, 4, temperature=0)
        tokens = stream(model, prompt, n + 1, temperature=0)
        next(tokens)
        t0 = time.perf_counter()
        assert sum(1 for _ in tokens) == n
        row["ggmlopt_lora_tok_s"] = n / (time.perf_counter() - t0)
    row["peak_mib"] = _peak_mib()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return row
    # llama.cpp in a process of its own: its AMX matrix products crash on some
    # Sapphire Rapids machines (ggml-org/llama.cpp#20824, a SIGSEGV in
    # ggml_backend_amx_mul_mat); then it runs again without its extra buffer types
    # (AMX and the repacked layouts), and the row says so
    for extra in (True, False):
        done = subprocess.run([sys.executable, __file__, "--llama-cpp-case", path,
                               "1" if extra else "0", str(n)],
                              check=False, capture_output=True, text=True)
        if done.returncode == 0:
            row["llama_cpp_tok_s"] = float(done.stdout.strip().splitlines()[-1])
            row["llama_cpp_extra_bufts"] = extra
            break
    return row


def _llama_cpp_decode(path: str, extra_bufts: bool, n: int) -> float:
    """llama.cpp's greedy decoding of n tokens after _decode's prompt, tokens/s."""
    import llama_cpp
    import llama_cpp.llama
    import numpy as np
    if not extra_bufts:
        default = llama_cpp.llama_model_default_params

        def without_extra_bufts():
            params = default()
            params.use_extra_bufts = False
            return params
        llama_cpp.llama.llama_cpp.llama_model_default_params = without_extra_bufts
    llm = llama_cpp.Llama(model_path=path, n_ctx=128, n_threads=2, verbose=False)
    llm.reset()
    llm.eval(list(range(1, 17)))
    t0 = time.perf_counter()
    for _ in range(n):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([token])
    return n / (time.perf_counter() - t0)


def _padded_vocabulary(size: int):
    """A byte-level vocabulary of size tokens (the 257 of ByteTokenizer's GGUF
    form, then placeholders): a file of a real model's vocabulary size."""
    from ggmlopt.io._gguf_tokenizer import BYTE_MERGES, byte_vocabulary
    from ggmlopt.text import BPETokenizer
    tokens = byte_vocabulary()
    tokens += [f"<pad{i}>" for i in range(size - len(tokens))]
    return BPETokenizer(tokens, list(BYTE_MERGES), eos_id=256)


def _large_file(cfg: dict, folder: str) -> dict[str, str]:
    """The model of cfg with its own vocabulary size, written as Q4_K_M by
    save_gguf (llama-quantize's mix and bytes) without a float32 file."""
    import warnings

    from ggmlopt.io import save_gguf
    from ggmlopt.models import Llama, LlamaConfig
    model = Llama(LlamaConfig(**cfg), seed=0)
    path = os.path.join(folder, "q4_k_m.gguf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_gguf(model, path, tokenizer=_padded_vocabulary(cfg["vocab_size"]), dtype="q4_k_m")
    return {"q4_k_m": path}


def _files(cfg: dict, folder: str, quantize: tuple[str, ...] = ("q4_k_m",)) -> dict[str, str]:
    import warnings

    from ggmlopt.io import save_gguf
    from ggmlopt.models import Llama, LlamaConfig
    from ggmlopt.text import ByteTokenizer
    cfg = dict(cfg, vocab_size=257)   # a byte vocabulary: the head is not the point here
    model = Llama(LlamaConfig(**cfg), seed=0)
    files = {}
    for dtype in ("f32", "q8_0", "q4_0"):
        files[dtype] = os.path.join(folder, f"{dtype}.gguf")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save_gguf(model, files[dtype], tokenizer=ByteTokenizer(), dtype=dtype)
    try:
        import ctypes

        import llama_cpp
    except ImportError:
        return files
    for name in quantize:   # llama-quantize's own files of these mixes
        files[name] = os.path.join(folder, f"{name}.gguf")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name.upper()}")
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(files["f32"].encode(), files[name].encode(),
                                            ctypes.byref(params))
        if rc != 0:
            del files[name]
    return files


def _median_row(rounds: list[dict]) -> dict:
    """The median of each figure over rounds, and of each round's ratios to
    llama.cpp (a shared machine's speed drifts between rounds: the ratio of
    two runs side by side drifts less than either)."""
    import statistics
    row = dict(rounds[0])
    for key, value in rounds[0].items():
        if isinstance(value, float):
            row[key] = statistics.median(r[key] for r in rounds)
    if "llama_cpp_tok_s" in row:
        for key in ("ggmlopt_f32_tok_s", "ggmlopt_q8_0_tok_s"):
            if key in row:
                row[key.replace("_tok_s", "_ratio")] = statistics.median(
                    r[key] / r["llama_cpp_tok_s"] for r in rounds)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--checkpointing", action="store_true",
                    help="activation checkpointing on (model.gradient_checkpointing_enable)")
    ap.add_argument("--llama-1b", action="store_true",
                    help="Llama-3.2-1B's shape and vocabulary, Q4_K_M only (peak memory)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens of the batch of one")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --decode: rounds of each file, ggmlopt and llama.cpp side by "
                         "side in each; the medians of the rates and of the rounds' ratios")
    ap.add_argument("--quantize", default="q4_k_m",
                    help="llama-quantize's mixes to add, comma-separated (q4_k_m, q3_k_m, "
                         "q2_k, iq4_xs, iq4_nl, ...)")
    ap.add_argument("--config", default=None,
                    help="JSON of LlamaConfig fields over the shape's (e.g. '{\"dim\": 512}': "
                         "widths that are multiples of 256 keep the K and IQ4_XS types "
                         "llama-quantize otherwise falls back from)")
    ap.add_argument("--case", nargs=2, metavar=("PATH", "KEEP"))
    ap.add_argument("--llama-cpp-case", nargs=3, metavar=("PATH", "EXTRA_BUFTS", "N"))
    args = ap.parse_args()
    if args.llama_cpp_case:
        path, extra, n = args.llama_cpp_case
        print(_llama_cpp_decode(path, extra == "1", int(n)))
        return
    global T
    T = args.tokens
    if args.case:
        run = _decode(args.case[0], args.case[1] == "1") if args.decode else \
            _case(args.case[0], args.case[1] == "1", args.steps, args.checkpointing)
        print(json.dumps(run))
        return
    cfg = SMALL if args.small else LLAMA_3_2_1B if args.llama_1b else SMOLLM2_135M
    if args.config:
        cfg = {**cfg, **json.loads(args.config)}
    with tempfile.TemporaryDirectory() as folder:
        files = _large_file(cfg, folder) if args.llama_1b else \
            _files(cfg, folder, tuple(q for q in args.quantize.split(",") if q))
        rows = []
        for name, path in files.items():
            keep = name != "f32"
            rounds = []
            for _ in range(args.rounds if args.decode else 1):
                out = subprocess.run([sys.executable, __file__, "--steps", str(args.steps),
                                      "--tokens", str(T),
                                      *(["--decode"] if args.decode else []),
                                      *(["--checkpointing"] if args.checkpointing else []),
                                      "--case", path, "1" if keep else "0"],
                                     check=True, capture_output=True, text=True).stdout
                # llama.cpp's loader and quantizer print to stderr; only the JSON matters
                rounds.append(json.loads(out.strip().splitlines()[-1]))
            row = _median_row(rounds)
            row.update(case=name, file_mib=os.path.getsize(path) / 2**20)
            rows.append(row)
    if args.decode:
        print(f"{'base':8} {'ggmlopt tok/s':>14} {'(q8_0 act.)':>12} {'(+LoRA)':>8} "
              f"{'llama.cpp tok/s':>16} {'ratio':>6} {'(q8_0)':>7}")
        for r in rows:
            theirs = r.get("llama_cpp_tok_s", float("nan"))
            ours, q8 = r["ggmlopt_f32_tok_s"], r.get("ggmlopt_q8_0_tok_s", float("nan"))
            with_lora = r.get("ggmlopt_lora_tok_s", float("nan"))
            note = "" if r.get("llama_cpp_extra_bufts", True) else \
                "  (llama.cpp without AMX/repacked buffers: it crashed with them)"
            ratio = r.get("ggmlopt_f32_ratio", ours / theirs)
            ratio_q8 = r.get("ggmlopt_q8_0_ratio", q8 / theirs)
            print(f"{r['case']:8} {ours:14.1f} {q8:12.1f} {with_lora:8.1f} {theirs:16.1f} "
                  f"{ratio:6.2f} {ratio_q8:7.2f}{note}")
        return
    base = rows[0]["step_s"] if not args.llama_1b else float("nan")
    print(f"{'base':8} {'file MiB':>9} {'step s':>8} {'x f32 LoRA':>11} {'peak MiB':>9}")
    for r in rows:
        print(f"{r['case']:8} {r['file_mib']:9.0f} {r['step_s']:8.3f} "
              f"{r['step_s'] / base:11.2f} {r['peak_mib']:9.0f}")


if __name__ == "__main__":
    main()
