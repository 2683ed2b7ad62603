"""The stories15M-shaped llama (bench/lm_models.py, random weights, seed 0) in
ggmlopt, in llama.cpp (the same weights exported to GGUF by llama.cpp's own
converter) and in Hugging Face transformers: generation tokens/s and the
perplexity pass, and the perplexity estimate of both programs on the same ids.

    python bench/lm_llamacpp.py LLAMA_CPP_DIR [--rounds 3] [--threads 2,1]

LLAMA_CPP_DIR is a llama.cpp source tree (outside this project) built with
``cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF &&
cmake --build build --target llama-bench llama-perplexity llama-tokenize``.
Without it (or without its binaries, or without the ``sentencepiece`` package its
converter needs for the vocabulary) the script says so and exits 0.  It:

- saves the model with ``ggmlopt.io.save_hf`` and gives it a vocabulary: a
  sentencepiece BPE model (byte fallback, 4000 pieces) trained on ggmlopt's
  offline corpus (``ggmlopt.corpora.python_docstrings``) as ``tokenizer.model``;
  llama.cpp's ``convert_hf_to_gguf.py`` pads it to the model's 32000 ids with
  unused ``[PAD]`` tokens (its own rule for a tokenizer smaller than the
  embedding), and writes float32 weights (``--outtype f32``: the same numbers);
- the evaluation text is the corpus after the part the tokenizer was trained on;
  llama.cpp's ``llama-tokenize`` gives its ids (BOS first, as
  ``llama-perplexity`` tokenizes), which ``ggmlopt.lm.perplexity`` scores with
  ``add_bos=True, bos_id=1``, so both programs score the same token ids;
- generation: ``llama-bench -p 0 -n 128`` (128 tokens decoded one at a time from
  an empty context; one repetition per round) against ``ggmlopt.generate`` and
  ``LlamaForCausalLM.generate`` (greedy, cache on) writing 128 tokens after a
  one-token prompt, per thread count, rounds alternating, medians;
- perplexity: ``llama-perplexity -c 256 -b 1024`` (4 chunks per pass) against
  ``ggmlopt.lm.perplexity(..., 256, batch_size=4)``; llama.cpp's time is its
  time stamps from the start of the pass to its final estimate (model loading
  excluded), ggmlopt's the call's.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import ggmlopt as go
from ggmlopt.corpora import python_docstrings
from ggmlopt.lm import perplexity

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm_models

N_CTX, PPL_BATCH, NEW, SPM_VOCAB = 256, 4, 128, 4000
TRAIN_BYTES, EVAL_BYTES = 200_000, 12_000
GGUF_NAME = "stories15M-shape-f32.gguf"


def binaries(root):
    """The llama.cpp programs this script runs, or None when one is missing."""
    out = {}
    for name in ("llama-bench", "llama-perplexity", "llama-tokenize"):
        path = os.path.join(root, "build", "bin", name)
        if not os.access(path, os.X_OK):
            return None
        out[name] = path
    return out


def make_gguf(model, root, tmp, text):
    """save_hf + a sentencepiece vocabulary + llama.cpp's converter -> GGUF path."""
    import sentencepiece as spm

    hf = os.path.join(tmp, "hf")
    go.io.save_hf(model, hf)
    corpus = os.path.join(tmp, "spm_train.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write(text)
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=os.path.join(hf, "tokenizer"), vocab_size=SPM_VOCAB,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, num_threads=2,
        max_sentence_length=100_000, minloglevel=2)
    os.remove(os.path.join(hf, "tokenizer.vocab"))
    with open(os.path.join(hf, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(bos_token_id=1, eos_token_id=2)   # sentencepiece's <s>, </s>
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    gguf = os.path.join(tmp, GGUF_NAME)
    subprocess.run([sys.executable, os.path.join(root, "convert_hf_to_gguf.py"), hf,
                    "--outfile", gguf, "--outtype", "f32"], check=True, capture_output=True)
    return hf, gguf


def llama_ids(bins, gguf, text_file):
    """The token ids llama.cpp gives the text (BOS first), as llama-perplexity does."""
    out = subprocess.run([bins["llama-tokenize"], "-m", gguf, "-f", text_file, "--ids",
                          "--log-disable"], check=True, capture_output=True, text=True).stdout
    line = [s for s in out.splitlines() if s.startswith("[")][-1]
    return np.array(json.loads(line), np.int32)


def llama_bench_tg(bins, gguf, threads):
    """llama-bench's generation tokens/s (-p 0 -n 128, one repetition)."""
    out = subprocess.run([bins["llama-bench"], "-m", gguf, "-p", "0", "-n", str(NEW), "-t",
                          str(threads), "-r", "1", "-o", "json"], check=True,
                         capture_output=True, text=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def llama_perplexity(bins, gguf, text_file, threads):
    """(seconds of prompt eval, ppl, unc, chunks) from llama-perplexity."""
    res = subprocess.run([bins["llama-perplexity"], "-m", gguf, "-f", text_file, "-c",
                          str(N_CTX), "-b", str(N_CTX * PPL_BATCH), "-t", str(threads)],
                         check=True, capture_output=True, text=True)
    log = res.stdout + res.stderr
    # its log lines carry timestamps (minutes.seconds.ms.us): the pass runs from the
    # "calculating perplexity" line to the final estimate (model loading excluded)
    stamp = r"(\d+)\.(\d+)\.(\d+)\.(\d+) I "
    start = re.search(stamp + r"perplexity: calculating perplexity over (\d+) chunks", log)
    final = re.search(stamp + r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    if not (start and final):
        raise RuntimeError("llama-perplexity printed no final estimate:\n" + log[-3000:])

    def secs(m):
        mi, se, ms, us = (int(g) for g in m.groups()[:4])
        return mi * 60 + se + ms / 1e3 + us / 1e6

    return (secs(final) - secs(start), float(final.group(5)), float(final.group(6)),
            int(start.group(5)))


def set_threads(n, torch):
    go.set_num_threads(n)
    if torch is not None:
        torch.set_num_threads(n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("llama_cpp_dir", nargs="?", default=os.environ.get("LLAMA_CPP_DIR"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--workdir", help="keep the checkpoint, GGUF and text here (reused when "
                    "the GGUF is there; default: a temporary folder, removed)")
    ap.add_argument("--no-generation", action="store_true", help="the perplexity part only")
    ap.add_argument("--convert-only", action="store_true",
                    help="stop after writing the GGUF (needs only convert_hf_to_gguf.py)")
    args = ap.parse_args()
    bins = binaries(args.llama_cpp_dir) if args.llama_cpp_dir else None
    if bins is None and not (args.convert_only and args.llama_cpp_dir):
        print("skipped: give a llama.cpp tree with build/bin/llama-bench, llama-perplexity, "
              "llama-tokenize")
        return
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        print("skipped: llama.cpp's converter needs the sentencepiece package here")
        return
    try:
        import torch
        import transformers
    except ImportError:
        torch = transformers = None
    threads = [int(t) for t in args.threads.split(",")]
    model = lm_models.ggmlopt_model()
    text = python_docstrings(min_bytes=TRAIN_BYTES + EVAL_BYTES)
    raw = text.encode("utf-8")
    train_text = raw[:TRAIN_BYTES].decode("utf-8", "ignore")
    eval_text = raw[TRAIN_BYTES:TRAIN_BYTES + EVAL_BYTES].decode("utf-8", "ignore")
    tmp = args.workdir or tempfile.mkdtemp(prefix="lm_llamacpp_")
    os.makedirs(tmp, exist_ok=True)
    try:
        hf_dir, gguf = os.path.join(tmp, "hf"), os.path.join(tmp, GGUF_NAME)
        if not os.path.isfile(gguf):
            hf_dir, gguf = make_gguf(model, args.llama_cpp_dir, tmp, train_text)
        if args.convert_only:
            print(f"wrote {gguf}")
            return
        text_file = os.path.join(tmp, "eval.txt")
        with open(text_file, "w", encoding="utf-8") as f:
            f.write(eval_text)
        ids = llama_ids(bins, gguf, text_file)
        hf = None
        if transformers is not None:
            hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
        print(f"eval text: {len(eval_text.encode()):,} bytes -> {ids.size:,} llama.cpp ids "
              f"({ids.size // N_CTX} chunks of {N_CTX}); first ids {ids[:8].tolist()}")

        prompt = ids[:1]
        prompt_t = None if torch is None else torch.tensor(prompt[None], dtype=torch.long)

        def ours_gen():
            t0 = time.perf_counter()
            go.generate(model, prompt, NEW, temperature=0)
            return NEW / (time.perf_counter() - t0)

        def hf_gen():
            t0 = time.perf_counter()
            with torch.inference_mode():
                hf.generate(prompt_t, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                            use_cache=True, pad_token_id=0)
            return NEW / (time.perf_counter() - t0)

        def ours_ppl():
            t0 = time.perf_counter()
            r = perplexity(model, ids, N_CTX, add_bos=True, bos_id=1, batch_size=PPL_BATCH)
            return time.perf_counter() - t0, r

        summary = []
        for n in threads if not args.no_generation else ():
            set_threads(n, torch)
            ours_gen()
            if hf is not None:
                hf_gen()
            tps = {"llama.cpp": [], "ggmlopt": [], "HF": []}
            for r in range(args.rounds):
                tps["llama.cpp"].append(llama_bench_tg(bins, gguf, n))
                tps["ggmlopt"].append(ours_gen())
                if hf is not None:
                    tps["HF"].append(hf_gen())
                print(f"generation, {n} thread(s), round {r}: " + ", ".join(
                    f"{k} {v[-1]:.1f}" for k, v in tps.items() if v) + " tokens/s "
                    f"(load {os.getloadavg()[0]:.1f})", flush=True)
            med = {k: float(np.median(v)) for k, v in tps.items() if v}
            summary.append(f"generation tokens/s, {n} thread(s), 128 new tokens, medians of "
                           f"{args.rounds}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
                           + f"; ggmlopt/llama.cpp = {med['ggmlopt'] / med['llama.cpp']:.2f}"
                           + (f", ggmlopt/HF = {med['ggmlopt'] / med['HF']:.2f}"
                              if "HF" in med else ""))

        set_threads(threads[0], torch)
        ours_ppl()
        secs = {"llama.cpp": [], "ggmlopt": []}
        for r in range(args.rounds):
            s, lppl, lunc, chunks = llama_perplexity(bins, gguf, text_file, threads[0])
            secs["llama.cpp"].append(s)
            s, ours = ours_ppl()
            secs["ggmlopt"].append(s)
            print(f"perplexity pass, round {r}: llama.cpp {secs['llama.cpp'][-1]:.2f} s, "
                  f"ggmlopt {s:.2f} s (load {os.getloadavg()[0]:.1f})", flush=True)
        med = {k: float(np.median(v)) for k, v in secs.items()}
        ntok = chunks * N_CTX
        summary.append(
            f"perplexity pass, {chunks} chunks of {N_CTX} ({ntok} tokens, {PPL_BATCH} chunks "
            f"a pass), {threads[0]} thread(s), medians of {args.rounds}: llama.cpp "
            f"{med['llama.cpp']:.2f} s ({ntok / med['llama.cpp']:,.0f} tokens/s), ggmlopt "
            f"{med['ggmlopt']:.2f} s ({ntok / med['ggmlopt']:,.0f} tokens/s); "
            f"llama.cpp/ggmlopt time = {med['llama.cpp'] / med['ggmlopt']:.2f}")
        summary.append(f"perplexity estimate on the same {ids.size} ids, n_ctx {N_CTX}: "
                       f"llama-perplexity PPL = {lppl:.4f} +/- {lunc:.5f}; ggmlopt.lm.perplexity "
                       f"PPL = {ours.ppl:.4f} +/- {ours.unc:.5f} (relative difference "
                       f"{abs(ours.ppl - lppl) / lppl:.1e})")
        print("\n" + "\n".join(summary))
    finally:
        if not args.workdir:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
