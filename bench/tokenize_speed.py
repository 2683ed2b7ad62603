"""Encoding speed of ggmlopt's tokenizers against llama.cpp's own, in MB of text a
second, on llama.cpp's vocabularies (GGMLOPT_LLAMA_CPP_SRC: llama.cpp's source,
as llama-cpp-python's sdist holds it).

    GGMLOPT_LLAMA_CPP_SRC=... python bench/tokenize_speed.py [--mb 4] [vocab ...]

The text: every Markdown file of llama.cpp's source tree, concatenated without
repeats (prose, code, tables, several languages), cut to --mb megabytes.  Each
side encodes the whole text once to warm up, then the median of three
timings; ggmlopt's first encode of a fresh tokenizer (every word new to its
cache of words) is shown beside.  llama.cpp's side is llama-cpp-python's ``Llama(vocab_only=True)
.tokenize`` (its C++ tokenizer, parse_special on, no BOS); ggmlopt's is
``encode(text)`` (parse_special on).  Target (issue 28): >= 5 MB/s.
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import time
import warnings

VOCABS = ["llama-bpe", "qwen2", "gpt-2", "llama-spm", "phi-3", "gemma-4", "bert-bge"]


def corpus(src: str, megabytes: float) -> str:
    parts = []
    for path in sorted(glob.glob(os.path.join(src, "**", "*.md"), recursive=True)):
        with open(path, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
    text = "\n".join(parts)
    limit = int(megabytes * 1e6)
    return text.encode("utf-8")[:limit].decode("utf-8", "ignore")


def timed(fn) -> float:
    fn()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0)
    parser.add_argument("vocabs", nargs="*", default=VOCABS,
                        help=f"vocabularies (default: {' '.join(VOCABS)})")
    args = parser.parse_args()
    src = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
    if not src:
        raise SystemExit("set GGMLOPT_LLAMA_CPP_SRC to llama.cpp's source tree")
    from ggmlopt.io import load_gguf_tokenizer
    text = corpus(src, args.mb)
    size = len(text.encode("utf-8")) / 1e6
    print(f"{size:.2f} MB of llama.cpp's Markdown files")
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    for name in args.vocabs:
        path = os.path.join(src, "models", f"ggml-vocab-{name}.gguf")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = load_gguf_tokenizer(path)
        tok.encode("")     # what a tokenizer builds once (SentencePiece: the library's merges)
        start = time.perf_counter()
        tok.encode(text)   # the first text: every word new to the tokenizer's cache
        first = time.perf_counter() - start
        ours = timed(lambda tok=tok: tok.encode(text))
        line = f"{name:10s} ggmlopt {size / ours:6.2f} MB/s (first text {size / first:5.2f})"
        if llama_cpp is not None:
            llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
            data = text.encode("utf-8")
            theirs = timed(lambda llm=llm, data=data: llm.tokenize(data, add_bos=False,
                                                                   special=True))
            line += f"   llama.cpp {size / theirs:6.2f} MB/s   ratio {ours / theirs:.2f}"
        print(line)


if __name__ == "__main__":
    main()
