"""Peak resident memory of building, loading and using a language model, each case
in a fresh process (ru_maxrss), as a multiple of the model's float32 weights.

    python bench/memory_peaks.py            # SmolLM2-135M's shape (513 MiB of weights)
    python bench/memory_peaks.py --small    # a quick run on a stories15M-sized model

Cases: ``build`` (Llama(config)), ``generate`` (build, then 16 greedy tokens),
``load_gguf`` (a float32 GGUF written beforehand, read back), ``evaluate``.
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
SMALL = {"vocab_size": 32000, "dim": 288, "n_layers": 6, "n_heads": 6, "ffn_dim": 768,
         "max_seq_len": 256, "tie_embeddings": True}


def _case(name: str, cfg: dict, path: str) -> dict:
    import numpy as np

    import ggmlopt as go
    from ggmlopt.models import Llama, LlamaConfig
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
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"case": name, "weights_mib": weights / 2**20, "peak_mib": peak / 2**20,
            "ratio": peak / weights}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
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
        for case in ("build", "generate", "evaluate", "load_gguf"):
            out = subprocess.run([sys.executable, __file__, "--case", case, "--cfg",
                                  json.dumps(cfg), "--path", path], check=True,
                                 capture_output=True, text=True).stdout
            r = json.loads(out)
            print(f"{r['case']:10s} weights {r['weights_mib']:7.1f} MiB  peak "
                  f"{r['peak_mib']:7.1f} MiB  {r['ratio']:.2f}x")


if __name__ == "__main__":
    main()
