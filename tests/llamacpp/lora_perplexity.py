"""A LoRA fine-tune measured by llama.cpp: python tests/llamacpp/lora_perplexity.py

1. a byte-level Llama is trained on the first part of the standard library's
   docstrings and written with save_gguf (the base model);
2. rank-8 adapters on every projection are fine-tuned with fit on a later part
   of the text the base never saw, the base frozen, and written with
   save_gguf_lora;
3. llama.cpp (llama-cpp-python, f32 KV cache) scores a held-out stretch of that
   later part with the base alone and with the adapter, by llama-perplexity's
   protocol on its logits; ggmlopt.lm.perplexity scores the same text.

Needs llama-cpp-python and gguf.  Prints the perplexities and the run's times.
"""
import argparse
import os
import tempfile
import time

import numpy as np

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.io import save_gguf, save_gguf_lora
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.text import ByteTokenizer

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_cpp_perplexity(path, adapter, ids, n_ctx):
    """llama-perplexity's protocol (no BOS: a byte vocabulary has none) on
    llama.cpp's logits: chunks of n_ctx, positions n_ctx/2 .. n_ctx-2 scored."""
    import llama_cpp

    kw = {"lora_path": adapter} if adapter else {}
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                          logits_all=True, type_k=0, type_v=0, n_threads=2, verbose=False, **kw)
    nll = []
    for c in range(len(ids) // n_ctx):
        chunk = [int(i) for i in ids[c * n_ctx:(c + 1) * n_ctx]]
        llm.reset()
        llm.eval(chunk)
        logits = np.array(llm.scores[:n_ctx], dtype=np.float64)
        for j in range(n_ctx // 2, n_ctx - 1):
            row = logits[j]
            top = row.max()
            nll.append(top + np.log(np.exp(row - top).sum()) - row[chunk[j + 1]])
    return float(np.exp(np.mean(nll)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-steps", type=int, default=200)
    ap.add_argument("--lora-epochs", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()
    tok, n_ctx = ByteTokenizer(), 64
    ids = tok.encode(go.corpora.python_docstrings(min_bytes=400_000))
    cfg = LlamaConfig(vocab_size=tok.vocab_size, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
                      max_seq_len=n_ctx)
    t0 = time.perf_counter()
    # 1. the base: full training on the first part
    n_base = args.base_steps * 16
    base_ids = ids[:n_base * n_ctx + n_ctx + 1]
    model = Llama(cfg, seed=0)
    pars = go.OptimizerParams(go.AdamWParams(alpha=2e-3, beta2=0.99))
    go.fit(model, go.Dataset.from_tokens(base_ids, n_ctx=n_ctx, stride=n_ctx), "cross_entropy",
           lambda ep: pars, nepoch=1, nbatch_logical=16, silent=True, seed=0)
    t_base = time.perf_counter() - t0
    # 2. adapters on a later part (192 windows), scored on the 64 windows after it
    start = len(base_ids) + 10_000
    tune = ids[start:start + 192 * n_ctx + n_ctx + 1]
    held = ids[start + 192 * n_ctx + n_ctx + 1:][:64 * n_ctx]
    with tempfile.TemporaryDirectory() as d:
        base_path, adapter_path = os.path.join(d, "base.gguf"), os.path.join(d, "adapter.gguf")
        save_gguf(model, base_path, tokenizer=tok)
        ppl_base_ours = go.lm.perplexity(model, held, n_ctx).ppl
        ppl_base_tune = go.lm.perplexity(model, tune[:64 * n_ctx], n_ctx).ppl
        for p in model.parameters():
            p.requires_grad = False
        lora.apply(model, rank=args.rank, alpha=2.0 * args.rank, targets=ALL)
        n_train = sum(p.size for p in model.parameters() if p.requires_grad)
        t1 = time.perf_counter()
        pars = go.OptimizerParams(go.AdamWParams(alpha=3e-3))
        go.fit(model, go.Dataset.from_tokens(tune, n_ctx=n_ctx, stride=n_ctx), "cross_entropy",
               lambda ep: pars, nepoch=args.lora_epochs, nbatch_logical=16, silent=True, seed=0)
        t_lora = time.perf_counter() - t1
        save_gguf_lora(model, adapter_path)
        ppl_lora_ours = go.lm.perplexity(model, held, n_ctx).ppl
        ppl_lora_tune = go.lm.perplexity(model, tune[:64 * n_ctx], n_ctx).ppl
        cpp = {(which, a): llama_cpp_perplexity(base_path, adapter_path if a else None, text,
                                                n_ctx)
               for which, text in (("held", held), ("tune", tune[:64 * n_ctx]))
               for a in (False, True)}
        size = os.path.getsize(adapter_path)
    total = sum(p.size for p in model.parameters())
    print(f"base: {cfg}, {args.base_steps} steps of 16 x {n_ctx} bytes ({t_base:.0f} s)")
    print(f"LoRA: rank {args.rank} on {', '.join(ALL)}: {n_train} of {total} numbers train, "
          f"{args.lora_epochs} epochs of 192 windows ({t_lora:.0f} s); adapter file "
          f"{size / 1024:.0f} KiB")
    print(f"{'perplexity (n_ctx 64)':34s} {'base':>8s} {'+ adapter':>10s}")
    print(f"{'llama.cpp, the fine-tuning text':34s} {cpp['tune', False]:8.3f} "
          f"{cpp['tune', True]:10.3f}")
    print(f"{'ggmlopt,   the fine-tuning text':34s} {ppl_base_tune:8.3f} {ppl_lora_tune:10.3f}")
    print(f"{'llama.cpp, the text after it':34s} {cpp['held', False]:8.3f} "
          f"{cpp['held', True]:10.3f}")
    print(f"{'ggmlopt,   the text after it':34s} {ppl_base_ours:8.3f} {ppl_lora_ours:10.3f}")


if __name__ == "__main__":
    main()
