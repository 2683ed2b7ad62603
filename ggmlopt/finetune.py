"""python -m ggmlopt.finetune: fine-tune a GGUF (or Hugging Face) model on chat,
completion or text data, LoRA by default, and write the adapter for llama.cpp.

    python -m ggmlopt.finetune --model SmolLM2-135M-Instruct.gguf --data train.jsonl \\
        --lora-rank 8 --epochs 3 --lr 1e-4 --out adapter.gguf
    llama-cli -m SmolLM2-135M-Instruct.gguf --lora adapter.gguf

It calls the public API only (load_gguf / load_hf, lora.apply, Dataset.from_chat /
from_completions / from_texts / from_tokens, read_jsonl, fit, save_gguf_lora, save_peft,
save_gguf), so everything it does can be written in Python.  llama.cpp's ``llama-finetune`` flag
names are accepted with their meaning (``-m``, ``-f`` for a raw text file, ``-c``,
``-b`` and ``-ub`` in tokens, ``-lr``, ``-wd``, ``-epochs``, ``-val-split``, ``-opt``, their
long forms such as ``--ctx-size`` and ``--learning-rate``, and type names in any case); a
text file (``-f``) is read as llama-finetune reads it (one trailing line break dropped,
special tokens written in it read as text, the windows trained in order and the last ones
validating).  The defaults are those of a LoRA fine-tune (``--help`` lists them), not
llama-finetune's full fine-tune (-lr 1e-5, 2 epochs, -val-split 0.05, -c the model's
context).  Every argument, file and data line is checked before training starts, and a
``--resume`` of another run (another model file, data, LoRA options or optimizer settings)
is refused, naming what differs.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import warnings

import numpy as np

__all__ = ["main", "parser"]

SCHEDULES = ("constant", "cosine", "linear")


def _precision(value: str) -> str:
    """--precision's value with fit's spellings (bfloat16, float32, any case) as f32/bf16."""
    from .gemm import PRECISIONS
    return PRECISIONS.get(value.lower(), value)


def parser() -> argparse.ArgumentParser:
    """The command's argument parser."""
    p = argparse.ArgumentParser(prog="python -m ggmlopt.finetune",
                                description="Fine-tune a language model (LoRA by default; "
                                            "the defaults are a LoRA fine-tune's, not "
                                            "llama-finetune's full one).")
    p.add_argument("-m", "--model", required=True,
                   help="a GGUF file, or a Hugging Face directory (config.json, safetensors)")
    p.add_argument("--tokenizer", help="a GGUF file holding the tokenizer (llama.cpp's "
                   "vocabulary files, or the model's own GGUF); a Hugging Face directory's "
                   "own tokenizer.json is the default there")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help="training data, JSON Lines: {'messages': [...]}, "
                      "{'prompt', 'completion'} or {'text'}")
    data.add_argument("-f", "--file", help="a raw text file (llama-finetune's -f)")
    p.add_argument("--valid", help="validation data, JSON Lines as --data (instead of "
                   "-val-split): evaluated after each epoch and every --eval-every steps")
    p.add_argument("-c", "--ctx", "--ctx-size", type=int, default=512,
                   help="tokens per window (n_ctx; default 512)")
    p.add_argument("--train-on", choices=("assistant", "last", "all"), default=None,
                   help="chat data: the turns the loss counts (default assistant)")
    p.add_argument("--chat-template-kwargs", type=_json_object, default=None,
                   metavar="JSON",
                   help="chat data (and prompts/completions of messages): template "
                        "variables for every conversation, a JSON "
                        "object ('{\"enable_thinking\": false}'); a row's own "
                        "chat_template_kwargs take precedence")
    p.add_argument("--too-long", choices=("error", "drop", "truncate"), default="error",
                   help="what to do with an example longer than the window (default "
                        "error)")
    p.add_argument("--packing", action="store_true",
                   help="chat, completion and text rows (--data): several a window, each "
                        "attending to itself only (the same loss, far less padding)")
    p.add_argument("--full", action="store_true", help="train every weight, not LoRA")
    p.add_argument("--keep-types", action="store_true",
                   help="keep the model's weights in their file's types (a GGUF's Q8_0, "
                        "Q4_K, ...; a checkpoint's F16, BF16), read in place, and train "
                        "LoRA adapters over them (QLoRA)")
    p.add_argument("--lora-rank", type=int, default=8, help="adapter rank (default 8)")
    p.add_argument("--lora-alpha", type=float, default=16.0,
                   help="adapter scale alpha: outputs scaled by alpha / rank (default 16)")
    p.add_argument("--lora-targets", default=None,
                   help="comma-separated Linear names, or all-linear (default: the "
                        "attention's projections by the family's names: "
                        "q_proj,k_proj,v_proj,o_proj; Phi-3's qkv_proj,o_proj; GPT-2's "
                        "c_attn,attn.c_proj)")
    p.add_argument("--lora-dropout", type=float, default=0.0,
                   help="dropout on the adapters' input while training (default 0)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each block in the backward pass: far less memory for "
                        "long windows, the same gradients")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="step each weight in the backward pass as soon as its gradient is "
                        "final: a full fine-tune holds one block's gradients, not all; the "
                        "same result (needs --micro-batch equal to --batch)")
    p.add_argument("-epochs", "--epochs", type=int, default=None,
                   help="passes over the data (default 1, or as many as --max-steps needs)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="optimizer steps of the run: it stops there, and the learning-rate "
                        "schedule spans them (a later --resume must give the same)")
    p.add_argument("-lr", "--lr", "--learning-rate", type=float, default=1e-4,
                   help="learning rate (AdamW or SGD alpha; default 1e-4, llama-finetune's "
                        "1e-5)")
    p.add_argument("--lr-schedule", choices=SCHEDULES, default="constant",
                   help="per optimizer step (default constant, as llama-finetune; Hugging "
                        "Face's Trainer defaults to linear): linear and cosine decay to 0 "
                        "after the run's last step, the rate of each step that of Hugging "
                        "Face's get_linear_schedule_with_warmup / "
                        "get_cosine_schedule_with_warmup without warmup")
    p.add_argument("--warmup", type=int, default=0,
                   help="warmup steps of the schedule (default 0): step t <= N "
                        "trains at --lr x t/N, so the first step is not at 0 and steps N "
                        "and N+1 are both at --lr (Hugging Face's warmup starts at 0 and "
                        "reaches --lr one step later); the linear or cosine decay after it "
                        "is Hugging Face's, and constant with warmup is its "
                        "constant_with_warmup so shifted")
    p.add_argument("-wd", "--weight-decay", type=float, default=0.0,
                   help="decoupled weight decay of every trainable tensor, norms and biases "
                        "included (Hugging Face's Trainer leaves those out; default 0)")
    p.add_argument("--max-grad-norm", type=float, default=None,
                   help="clip the gradients' global L2 norm to this (torch's "
                        "clip_grad_norm_; default: no clipping, as llama-finetune; "
                        "Hugging Face's Trainer clips to 1.0)")
    # any case, as llama-finetune's -opt and llama-quantize's type names take it
    p.add_argument("-opt", "--optimizer", type=str.lower, choices=("adamw", "sgd"),
                   default="adamw",
                   help="default adamw")
    p.add_argument("--batch", type=int, default=None,
                   help="windows per optimizer step (logical batch; default 8)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="windows per forward/backward pass (physical batch); below "
                        "--batch, each micro-batch's mean loss weighs the same (ggml's "
                        "accumulation), whatever its number of answer tokens (see "
                        "--accumulate)")
    p.add_argument("--accumulate", choices=("batches", "tokens"), default="batches",
                   help="how --micro-batch's micro-batches add up to a step: batches "
                        "(default, ggml's) weighs each micro-batch's mean loss the same; "
                        "tokens is Hugging Face Trainer's rule (num_items_in_batch): the "
                        "step's loss is the mean over all its answer tokens")
    p.add_argument("-b", "--batch-size", dest="tokens_batch", type=int, default=None,
                   help="llama-finetune's: tokens per optimizer step; at least -c (it "
                        "takes one window a step then), as ggmlopt steps on whole windows")
    p.add_argument("-ub", "--ubatch-size", dest="tokens_ubatch", type=int, default=None,
                   help="llama-finetune's: tokens per pass, dividing min(-b, -c); checked and "
                        "otherwise unused, as each window runs in one pass here (llama.cpp's "
                        "passes shorter than -c leave K and V without the later passes' "
                        "gradients)")
    p.add_argument("-val-split", "--val-split", type=float, default=0.0,
                   help="the part of the data that validates (default 0, llama-finetune's "
                        "0.05)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="also validate every N optimizer steps (needs -val-split or --valid)")
    p.add_argument("--checkpoint", help="an .npz checkpoint written after each epoch")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="also write --checkpoint every N optimizer steps inside an epoch")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint (the run that wrote it, with its options)")
    p.add_argument("--seed", type=int, default=0,
                   help="the adapters' initial values, shuffles and dropout (default 0)")
    p.add_argument("--out", help="the LoRA adapter as llama.cpp loads it (GGUF)")
    p.add_argument("--peft-out", help="the LoRA adapter as PEFT saves it (a directory: "
                                      "adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--merge-out", help="the merged model (GGUF) for llama.cpp")
    p.add_argument("--out-type", type=str.lower,
                   choices=("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q5_k_s", "q5_k",
                            "q5_1", "q5_0", "q4_k_m", "q4_k_s", "q4_k", "q4_1", "q4_0"),
                   default="f16",
                   help="the merged model's file type, as llama-quantize names them "
                        "(default f16); with --keep-types the weights kept in the base "
                        "file's types stay in them")
    p.add_argument("--plot", help="the loss curves as an image (matplotlib)")
    p.add_argument("--silent", action="store_true",
                   help="no progress bars and no summary lines (errors are still said)")
    p.add_argument("--precision", type=_precision, choices=("f32", "bf16"), default="f32",
                   help="bf16: multiply float32 weights and activations as bfloat16, "
                        "accumulating in float32 (fit's precision='bf16'; float32 with a "
                        "warning on a CPU without bf16 products); default f32")
    p.add_argument("--mpi", action="store_true",
                   help="train data-parallel over the MPI ranks this runs as (mpiexec -n P "
                        "python -m ggmlopt.finetune ... --mpi; needs mpi4py): each rank takes "
                        "its share of every batch, --batch / P windows as its micro-batch by "
                        "default, so the result is one process's with that --micro-batch "
                        "(each micro-batch's mean loss weighs the same); rank 0 prints and "
                        "writes the outputs")
    return p


# the ranks an MPI launcher started, by its environment (MPICH's hydra, Open MPI)
_LAUNCHER_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def _json_object(text: str) -> dict:
    """An option's JSON object (argparse reports the ArgumentTypeError by option)."""
    import json
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _launched_ranks() -> int:
    """How many ranks the MPI launcher that started this process runs (1 when
    none did)."""
    for var in _LAUNCHER_SIZE:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def _mpi_problems(args) -> list[str]:
    """--mpi without mpi4py, and mpiexec's ranks without --mpi (each would run
    the whole fine-tune, every core of its own, and write the same files)."""
    if args.mpi:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            return ["--mpi: needs mpi4py (pip install 'ggmlopt[mpi]')"]
        if args.optimizer_in_backward:   # (the ranks sum every gradient before a step)
            return ["--optimizer-in-backward: not with --mpi"]
        if args.accumulate == "tokens":   # (a rank sees its share of a step, not its count)
            return ["--accumulate tokens: not with --mpi"]
        return []
    ranks = _launched_ranks()
    if ranks > 1:
        why = (f"this runs as one of {ranks} MPI ranks (mpiexec): give --mpi to train "
               "data-parallel; without it every rank runs the whole fine-tune")
        return [why]
    return []


def _windows_from_tokens(args) -> list[str]:
    """llama-finetune's -b / -ub (tokens) as --batch / --micro-batch (windows):
    llama.cpp takes min(-b, -c) tokens a step, so -b of -c or more is one window
    a step; a -b below -c (several steps within a window) is refused.  -ub is
    checked as llama.cpp checks it and then unused: a window runs in one pass.
    Sets args.batch and args.micro_batch; the problems found."""
    bad = []
    if args.tokens_batch is not None or args.tokens_ubatch is not None:
        if args.batch is not None or args.micro_batch is not None:
            bad.append("-b/-ub: llama-finetune's batch in tokens; give it or --batch/"
                       "--micro-batch (windows), not both")
        # llama-finetune's defaults, capped as its opt_init caps them
        n_batch = args.tokens_batch if args.tokens_batch is not None else 2048
        n_ubatch = args.tokens_ubatch if args.tokens_ubatch is not None else 512
        capped = min(n_batch, args.ctx)
        if n_batch < 1 or n_ubatch < 1 or capped % min(n_ubatch, capped):
            bad.append(f"-b/-ub: expected tokens >= 1, -ub dividing min(-b, -c) = {capped} "
                       f"as llama-finetune needs, got -ub {n_ubatch}")
        elif n_batch < args.ctx:
            bad.append(f"-b: {n_batch} tokens a step, fewer than a window's -c {args.ctx}: "
                       f"llama-finetune then takes several optimizer steps within a window, "
                       f"which ggmlopt does not; give -b {args.ctx} or more (one window a "
                       f"step), or --batch N windows")
        args.batch, args.micro_batch = 1, None
    elif args.batch is None:
        args.batch = 8
    return bad


def _problems(args) -> list[str]:
    """What is wrong with the arguments, before any file is read."""
    bad = _windows_from_tokens(args) + _mpi_problems(args)
    for name in ("ctx", "epochs", "batch", "lora_rank"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            bad.append(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.micro_batch is not None and (args.micro_batch < 1 or args.batch % args.micro_batch):
        bad.append(f"--micro-batch: expected a divisor of --batch {args.batch}, got "
                   f"{args.micro_batch}")
    if args.optimizer_in_backward and args.micro_batch not in (None, args.batch):
        bad.append(f"--optimizer-in-backward: steps once per physical batch; expected "
                   f"--micro-batch {args.batch} (or none), got {args.micro_batch}")
    if not args.lr > 0:
        bad.append(f"--lr: expected > 0, got {args.lr}")
    elif not math.isfinite(args.lr):
        bad.append(f"--lr: expected > 0 and finite, got {args.lr}")
    if not 0 <= args.weight_decay <= 1:
        bad.append(f"--weight-decay: expected 0 <= wd <= 1, got {args.weight_decay}")
    if args.max_grad_norm is not None and not (args.max_grad_norm > 0
                                               and math.isfinite(args.max_grad_norm)):
        bad.append(f"--max-grad-norm: expected a finite norm > 0, got {args.max_grad_norm}")
    if args.max_grad_norm is not None and args.optimizer_in_backward:
        bad.append("--max-grad-norm: the norm needs every gradient before any step; not with "
                   "--optimizer-in-backward")
    if not 0 <= args.val_split < 1:
        bad.append(f"--val-split: expected 0 <= split < 1, got {args.val_split}")
    if args.max_steps is not None and args.max_steps < 1:
        bad.append(f"--max-steps: expected >= 1, got {args.max_steps}")
    if args.seed < 0:
        bad.append(f"--seed: expected >= 0, got {args.seed}")
    if args.warmup < 0:
        bad.append(f"--warmup: expected >= 0, got {args.warmup}")
    if args.eval_every is not None and args.eval_every < 1:
        bad.append(f"--eval-every: expected >= 1, got {args.eval_every}")
    elif args.eval_every is not None and args.val_split == 0 and not args.valid:
        bad.append("--eval-every: evaluates the validation split; give -val-split or "
                   "--valid too")
    if args.valid and args.file:
        bad.append("--valid: validation JSON Lines go with --data; a raw text file (-f) "
                   "validates its last windows with -val-split")
    elif args.valid and args.val_split:
        bad.append(f"--valid: the validation data is {args.valid}; -val-split "
                   f"{args.val_split} would hold out training data too: give one of them")
    if args.train_on is not None and args.file:
        bad.append("--train-on: chooses the turns of chat data (--data); a raw text file "
                   "trains on every token")
    if args.chat_template_kwargs is not None and args.file:
        bad.append("--chat-template-kwargs: renders chat data (--data); a raw text file has "
                   "no template")
    if args.packing and args.file:
        bad.append("--packing: packs chat and completion examples (--data); a raw text file "
                   "is cut into whole windows already")
    if args.plot:
        bad += _plot_problems(args.plot)
    if args.resume and not args.checkpoint:
        bad.append("--resume: needs --checkpoint FILE")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        bad.append(f"--checkpoint-every: expected >= 1, got {args.checkpoint_every}")
    elif args.checkpoint_every is not None and not args.checkpoint:
        bad.append("--checkpoint-every: needs --checkpoint FILE")
    if args.full and args.keep_types:
        bad.append("--keep-types: a kept (quantized) base trains through LoRA adapters; drop "
                   "--full, or drop --keep-types to fine-tune every weight in float32")
    if args.full and args.out:
        bad.append("--out: writes a LoRA adapter; with --full write the model (--merge-out)")
    if args.full and args.peft_out:
        bad.append("--peft-out: writes a LoRA adapter; with --full write the model "
                   "(--merge-out)")
    if not args.out and not args.merge_out and not args.peft_out:
        bad.append("--out, --peft-out or --merge-out: say where the result goes")
    if args.peft_out and os.path.isfile(args.peft_out):
        bad.append(f"--peft-out: {args.peft_out!r} is a file; give a directory")
    if not os.path.exists(args.model):
        bad.append(f"--model: no such file or directory {args.model!r}")
    elif (os.path.isdir(args.model) and not args.tokenizer
          and not os.path.isfile(os.path.join(args.model, "tokenizer.json"))):
        bad.append("--tokenizer: the Hugging Face directory has no tokenizer.json; give a GGUF "
                   "file holding its tokenizer (llama.cpp's vocabulary files, or the model's "
                   "own GGUF)")
    for name in ("data", "valid", "file", "tokenizer"):
        path = getattr(args, name)
        if path and not os.path.isfile(path):
            bad.append(f"--{name}: no such file {path!r}")
    # an output over an input (or over another output) would destroy it
    # (real paths: a link to the model is the model; a file in --model's checkpoint
    # directory is the model's too)
    written: dict[str, str] = {}
    input_folders: list[tuple[str, str]] = []
    for name, flag in (("model", "--model"), ("data", "--data"), ("valid", "--valid"),
                       ("file", "-f"), ("tokenizer", "--tokenizer")):
        if getattr(args, name):
            real = os.path.realpath(getattr(args, name))
            written.setdefault(real, flag)
            if os.path.isdir(real):
                input_folders.append((real, flag))
    for name in ("out", "merge_out", "checkpoint", "plot", "peft_out"):
        path = getattr(args, name)
        if path:
            flag = f"--{name.replace('_', '-')}"
            if name == "peft_out":   # a directory, made with its parents when missing
                folder = _existing_ancestor(os.path.abspath(path))
                if os.path.isfile(folder) and folder != os.path.abspath(path):
                    bad.append(f"{flag}: {folder!r} is a file; no directory can be made "
                               f"under it")
                    continue
            else:
                folder = os.path.dirname(os.path.realpath(path))
                if not os.path.isdir(folder):
                    bad.append(f"{flag}: no directory {folder!r} to write into")
                    continue
                if os.path.isdir(path) or path.endswith((os.sep, "/")):
                    bad.append(f"{flag}: {path!r} is a directory; give a file name")
            if os.path.isdir(folder) and (problem := _unwritable(folder)):
                bad.append(f"{flag}: cannot write into {folder!r} ({problem})")
            # two results into one file: the second would overwrite the first
            real = os.path.realpath(path)
            other = written.setdefault(real, flag)
            if other != flag:
                bad.append(f"{flag}: {path!r} is also {other}'s file")
            for folder_in, flag_in in input_folders:
                if real.startswith(folder_in + os.sep) and (
                        os.path.isfile(real) or _checkpoint_file(real)):
                    bad.append(f"{flag}: {path!r} is inside {flag_in}'s directory "
                               f"{folder_in!r}, one of whose files it would overwrite or "
                               f"change")
    if args.peft_out:
        bad += _nested_in_peft_out(args)
    return bad


def _checkpoint_file(path: str) -> bool:
    """Whether path names a file a Hugging Face checkpoint directory is read from
    (written there, it would change the model the directory holds)."""
    name = os.path.basename(path)
    return name in ("config.json", "generation_config.json", "tokenizer.json",
                    "tokenizer_config.json", "special_tokens_map.json", "model.safetensors",
                    "model.safetensors.index.json") or \
        (name.startswith("model-") and name.endswith(".safetensors"))


def _nested_in_peft_out(args) -> list[str]:
    """The other results that --peft-out's directory would overwrite (one of its
    two files) or that would stand where that directory is to be made."""
    from .io.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    folder = os.path.abspath(args.peft_out)
    inside = {os.path.join(folder, name) for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)}
    bad = []
    for name in ("out", "merge_out", "checkpoint", "plot"):
        path = getattr(args, name)
        if not path:
            continue
        flag, where = f"--{name.replace('_', '-')}", os.path.abspath(path)
        if where in inside:
            bad.append(f"{flag}: {path!r} is one of the files --peft-out writes")
        elif folder.startswith(where + os.sep):
            bad.append(f"--peft-out: {args.peft_out!r} is under {flag}'s file {path!r}")
    return bad


def _existing_ancestor(path: str) -> str:
    """path itself, or its nearest parent that exists."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _unwritable(folder: str) -> str | None:
    """Why a file cannot be made in folder (tried, as the results will be), or None."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as e:
        return e.strerror or str(e)


def _given(p, argv) -> set[str]:
    """The options argv gives itself (their dests), not left at their defaults."""
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def _without_effect(args, given: set[str]) -> list[str]:
    """Options given in a mode where they change nothing: said rather than dropped."""
    bad = []
    lora_options = [f"--{d.replace('_', '-')}" for d in
                    ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout") if d in given]
    if args.full and lora_options:
        bad.append(f"{', '.join(lora_options)}: LoRA options; --full trains every weight")
    if "out_type" in given and not args.merge_out:
        bad.append("--out-type: the type of --merge-out's weights; give --merge-out")
    if "too_long" in given and args.file:
        bad.append("--too-long: cuts chat and completion examples (--data); a raw text file is "
                   "cut into whole windows already")
    return bad


def _plot_problems(path: str) -> list[str]:
    """--plot checked before training: matplotlib is there and writes the file's type."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return ["--plot: needs matplotlib (the plot extra: pip install matplotlib)"]
    types = FigureCanvasBase.get_supported_filetypes()
    kind = os.path.splitext(path)[1].lower().lstrip(".")
    if kind not in types:
        known = ", ".join("." + t for t in sorted(types))
        return [f"--plot: {path!r}: expected a file type matplotlib writes ({known})"]
    return []


def _load(args):
    from .io import load_gguf, load_gguf_tokenizer, load_hf
    if os.path.isdir(args.model):
        model = load_hf(args.model, keep_types=args.keep_types)
        if args.tokenizer:
            return model, load_gguf_tokenizer(args.tokenizer)
        from .hf_tokenizer import load_hf_tokenizer
        return model, load_hf_tokenizer(args.model)
    model, tok = load_gguf(args.model, keep_types=args.keep_types)
    if args.tokenizer:
        tok = load_gguf_tokenizer(args.tokenizer)
    if tok is None:
        raise SystemExit(f"finetune: {args.model} holds no tokenizer ggmlopt reads; give "
                         "--tokenizer FILE.gguf")
    return model, tok


def _jsonl_arrays(args, tok, path):
    """(data, labels, what they hold) of a JSON Lines file of chats, completions or texts."""
    import ggmlopt as go

    from .instruct import read_jsonl
    examples = read_jsonl(path)
    first = examples[0]
    if "messages" in first:
        if not getattr(tok, "chat_template", None):
            raise SystemExit(f"finetune: {path} holds chats, but the tokenizer has no "
                             "chat template (tokenizer.chat_template)")
        ds = go.Dataset.from_chat(examples, tok, args.ctx,
                                  train_on=args.train_on or "assistant",
                                  too_long=args.too_long, packing=args.packing,
                                  **(args.chat_template_kwargs or {}))
    elif args.train_on is not None or (args.chat_template_kwargs is not None
                                       and not any(map(_conversational, examples))):
        option = "--train-on: chooses the turns" if args.train_on is not None else \
            "--chat-template-kwargs: renders the conversations"
        raise ValueError(f"{option} of chat data; {path} holds "
                         f"{'prompt/completion pairs' if 'prompt' in first else 'text'}")
    elif "prompt" in first:
        if any(map(_conversational, examples)) and not getattr(tok, "chat_template", None):
            raise SystemExit(f"finetune: {path} holds prompts and completions of messages, "
                             "but the tokenizer has no chat template "
                             "(tokenizer.chat_template)")
        if args.chat_template_kwargs is not None:
            # the command's template variables under each row's own (TRL's precedence)
            examples = [_with_template_kwargs(row, args.chat_template_kwargs)
                        if _conversational(row) else row for row in examples]
        ds = go.Dataset.from_completions(examples, tok, args.ctx, too_long=args.too_long,
                                         packing=args.packing)
    else:
        # one document a row, trained on whole (TRL's and MLX-LM's text rows), not
        # one stream cut into llama-finetune's overlapping windows: those attend
        # across rows and leave the stream's tail untrained
        ds = go.Dataset.from_texts(examples, tok, args.ctx, too_long=args.too_long,
                                   packing=args.packing)
    x, y = np.asarray(ds.data), np.asarray(ds.labels)
    what = (f"{_packed_documents(x, y)} examples from {path} packed into {x.shape[0]} windows"
            if args.packing else f"{x.shape[0]} examples from {path}")
    return x, y, what


def _packed_documents(x: np.ndarray, y: np.ndarray) -> int:
    """The examples packed windows hold: their documents with a trained token
    (not the padding's, nor the rows dropped as too long or untrained)."""
    from .nn.positions import document_ids

    rows, cols = np.nonzero(y >= 0)
    return int(np.unique(rows * x.shape[1] + document_ids(x)[rows, cols]).size)


def _conversational(row) -> bool:
    """Whether a prompt/completion row is TRL's conversational form (lists of messages)."""
    return isinstance(row.get("prompt"), list)


def _with_template_kwargs(row, variables):
    """row with variables under its own chat_template_kwargs (which win, as in TRL's
    datasets); a row whose chat_template_kwargs is not an object is left for
    from_completions to refuse, naming it."""
    own = row.get("chat_template_kwargs")
    if own is not None and not isinstance(own, dict):
        return row
    return {**row, "chat_template_kwargs": {**variables, **(own or {})}}


def _padded(x, y, batch, tok):
    """x, y with masked rows to whole logical batches of `batch`, and how many."""
    pad = -x.shape[0] % batch
    if pad:
        # rows with every label masked change no gradient within their physical batch
        # (its loss is the mean over its labelled positions); a physical batch of them
        # alone still counts in the logical batch's mean (ggml's loss), a smaller last step
        pad_id = tok.eos_id if tok.eos_id is not None else 0
        x = np.concatenate([x, np.full((pad, x.shape[1]), pad_id, np.int32)])
        y = np.concatenate([y, np.full((pad, y.shape[1]), -1, np.int32)])
    return x, y, pad


def _valid_split(ntrain: int, nvalid: int) -> float:
    """The val_split whose held-out part fit computes (in float32, as ggml) as exactly
    the last nvalid of ntrain + nvalid logical batches."""
    from ._fit_plan import training_batches
    total = ntrain + nvalid
    split = np.float32(nvalid / total)
    for _ in range(64):
        got = training_batches(total, float(split))
        if got == ntrain:
            return float(split)
        split = np.nextafter(split, np.float32(0 if got < ntrain else 1))
    raise AssertionError(f"no float32 split leaves {ntrain} of {total} batches to train")


def _dataset(args, tok):
    """(Dataset, what it holds) from --data or -f, padded with masked rows to whole
    logical batches."""
    import ggmlopt as go

    from .instruct import document_ids
    if args.file:
        with open(args.file, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            raise ValueError(f"-f: {args.file}:{line}: not UTF-8 text ({e.reason} at byte "
                             f"{e.start} of the file)") from None
        # as llama-finetune reads its -f file: one trailing line break dropped (llama.cpp's
        # -f), special tokens written in the text read as text (common_tokenize), BOS
        # first and EOS last where the vocabulary adds them
        text = text.removesuffix("\n")
        ids = document_ids(tok, text, parse_special=False)
        ds = go.Dataset.from_tokens(ids, args.ctx)
        x, y = np.asarray(ds.data), np.asarray(ds.labels)
        what = f"{x.shape[0]} windows of {args.ctx} tokens from {args.file}"
    else:
        x, y, what = _jsonl_arrays(args, tok, args.data)
    x, y, pad = _padded(x, y, args.batch, tok)
    if pad:
        what += f" (+{pad} masked rows to fill the last batch of {args.batch})"
    if args.valid:
        # the validation examples after the training ones, held out by the split that
        # covers exactly their logical batches (fit validates on the data's last part)
        try:
            vx, vy, what_valid = _jsonl_arrays(args, tok, args.valid)
        except ValueError as e:   # (the library's words do not say which file)
            raise ValueError(f"--valid: {e}" if args.valid in str(e)
                             else f"--valid: {args.valid}: {e}") from None
        vx, vy, vpad = _padded(vx, vy, args.batch, tok)
        args.val_split = _valid_split(x.shape[0] // args.batch, vx.shape[0] // args.batch)
        x, y = np.concatenate([x, vx]), np.concatenate([y, vy])
        what += f"; validating on {what_valid}" + (f" (+{vpad} masked rows)" if vpad else "")
    return go.Dataset.from_arrays(x, y), what


def _optimizer(args, steps_per_epoch):
    import ggmlopt as go

    from . import schedules
    base = go.OptimizerParams(go.AdamWParams(alpha=args.lr, wd=args.weight_decay),
                              go.SGDParams(alpha=args.lr, wd=args.weight_decay))
    total = args.max_steps or max(1, (args.epochs or 1) * steps_per_epoch)
    if args.lr_schedule == "cosine":
        if args.warmup:
            return schedules.WarmupCosine(args.warmup, total, base=base, unit="step")
        return schedules.Cosine(total, base=base, unit="step")
    if args.warmup:   # linear decays to 0 after it; constant stays at --lr
        end = 0.0 if args.lr_schedule == "linear" else 1.0
        return schedules.WarmupLinear(args.warmup, total, end_factor=end, base=base,
                                      unit="step")
    if args.lr_schedule == "linear":
        return schedules.Linear(total, base=base, unit="step")
    # a Schedule, so that a resume with another -lr or -wd is seen and refused
    return schedules.Constant(base=base, unit="step")


def _digest_file(path: str, h) -> None:
    """Feed h a file's size and up to 64 stretches of 64 KiB spread over it (the
    first and last among them): a model file of gigabytes is told from another
    in milliseconds.  A file that differs only between the stretches passes
    here; the weights that matter to a resume, the frozen ones, are compared
    byte for byte by the checkpoint's frozen_digest (the trainable ones and the
    tokenized data come from the checkpoint and --data's digest)."""
    size = os.path.getsize(path)
    h.update(f"{size};".encode())
    chunk, count = 1 << 16, 64
    with open(path, "rb") as f:
        for i in range(count):
            f.seek(max(0, size - chunk) * i // (count - 1))
            h.update(f.read(chunk))


def _run_info(args, train, model) -> dict:
    """What makes this run what it is beyond fit's own checks (the dataset's shape,
    the seed, the schedule): the model file, the data, the LoRA and optimizer
    options; a --resume that differs in one is refused naming it."""
    import hashlib
    model_digest = hashlib.blake2b(digest_size=8)
    files = [args.model] if os.path.isfile(args.model) else sorted(
        os.path.join(args.model, n) for n in os.listdir(args.model)
        if n.endswith(".safetensors") or n == "config.json")
    for path in files:
        _digest_file(path, model_digest)   # the bytes, whatever the file is called
    data = hashlib.blake2b(digest_size=8)
    data.update(np.ascontiguousarray(train.data).tobytes())
    data.update(np.ascontiguousarray(train.labels).tobytes())
    info = {"--model": model_digest.hexdigest(), "--data": data.hexdigest(),
            "--keep-types": bool(args.keep_types), "-lr": float(args.lr),
            "-wd": float(args.weight_decay), "-opt": args.optimizer,
            "--max-grad-norm": "none" if args.max_grad_norm is None
            else float(args.max_grad_norm),
            "--lr-schedule": args.lr_schedule, "--warmup": int(args.warmup)}
    if args.full:
        info["--full"] = True
    else:
        from .lora import _default_targets
        targets = ",".join(_target_names(args.lora_targets)) \
            if args.lora_targets else ",".join(_default_targets(model))
        info.update({"--lora-rank": int(args.lora_rank), "--lora-alpha": float(args.lora_alpha),
                     "--lora-targets": targets,
                     "--lora-dropout": float(args.lora_dropout)})
    return info


def _target_names(given: str) -> tuple[str, ...]:
    """The names of --lora-targets, each stripped of the spaces around it
    ("q_proj, v_proj"): spaces are no part of a layer's name."""
    return tuple(t.strip() for t in given.split(",") if t.strip())


def _lora_targets(p, given: str | None):
    """--lora-targets as lora.apply's targets: None (the family's default),
    "all-linear", or the names, each stripped of the spaces around it
    ("q_proj, v_proj")."""
    if given is None:
        return None
    names = _target_names(given)
    if not names:
        p.error(f"--lora-targets: expected comma-separated layer names or all-linear, "
                f"got {given!r}")
    if "all-linear" in names:
        if len(names) > 1:
            p.error(f"--lora-targets: all-linear stands alone (it adapts every Linear but "
                    f"the output head), got {given!r}")
        return "all-linear"
    return names


def _input_problem(train, model) -> str | None:
    """An input id outside the model's vocabulary (a --tokenizer of another model:
    its BOS, or any id, that no label shows), said before training."""
    x = np.asarray(train.data)
    ids = np.where(x < 0, -1 - x, x)   # a packed document's first token is -1 - id
    vocab = model.config.vocab_size
    if ids.size and int(ids.max()) >= vocab:
        return (f"--tokenizer: the data holds token id {int(ids.max())}, but the model's "
                f"vocabulary has {vocab} ids; give the model's own tokenizer")
    return None


# the library's words for what the command calls by its options
_OPTION_WORDS = (
    ("pass too_long='drop' or 'truncate'", "pass --too-long drop or --too-long truncate"),
    ("raise n_ctx,", "raise --ctx,"),
    ("train_on='all'", "--train-on all"),
    ("raise nepoch or pass nepoch=None", "give more --epochs, or --max-steps alone"),
    ("keep_types: reads", "--keep-types: reads"),
    ("load it with keep_types=False", "drop --keep-types"),
    ("or train it whole (trainable)",
     "(--lora-targets embed_tokens), or train the whole model (--full)"),
    ("pass accumulate='tokens'", "give --accumulate tokens"),
    ("pass accumulate='batches'", "give --accumulate batches"),
)


def _in_options(message: str) -> str:
    """message with the library's argument names said as the command's options,
    and a --data digest that differs explained."""
    for words, option in _OPTION_WORDS:
        message = message.replace(words, option)
    if "--data=" in message:
        message += (" (the data gives other tokens than the run that wrote the checkpoint: "
                    "another --data or --valid file or other --ctx, --train-on or --packing, "
                    "or a chat template that writes the day's date, as Llama 3's does, on "
                    "another day)")
    return message


def main(argv=None) -> int:
    """Run the command (argv: the arguments, default sys.argv[1:]); 0 on success.
    Bad arguments exit with status 2 and a message naming them."""
    p = parser()
    args = p.parse_args(argv)
    comm = _world(args)
    try:
        bad = _problems(args) + _without_effect(args, _given(p, argv))
        if bad:
            p.error("; ".join(bad))
        return _run(p, args, comm)
    except SystemExit as e:
        if comm is not None and comm.Get_size() > 1 and e.code not in (0, None):
            # a rank refused its input (its --data missing on its host, say) while the
            # others go on into fit's first collective, where they would wait for it
            # for ever: take every rank down, as an interrupt does
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            comm.Abort(e.code if isinstance(e.code, int) else 1)
        raise


def _world(args):
    """MPI's world communicator with --mpi (None without, or without mpi4py,
    which _problems then says)."""
    if not args.mpi:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD


def _run(p, args, comm) -> int:
    """main's work once the arguments parsed: load, build the data, train, write."""
    import ggmlopt as go

    from . import lora
    # every rank trains; rank 0 alone prints and writes (fit's checkpoint as well)
    writes = comm is None or comm.Get_rank() == 0
    try:
        model, tok = _load(args)
        train, what = _dataset(args, tok)
    except (ValueError, TypeError) as e:
        p.error(_in_options(str(e)))
    if args.ctx > model.config.max_seq_len:
        p.error(f"--ctx: {args.ctx} is more than the model's max_seq_len "
                f"{model.config.max_seq_len}")
    problem = _input_problem(train, model)
    if problem:
        p.error(problem)
    if args.merge_out:
        # the merged GGUF carries the tokenizer: one llama.cpp cannot read is said now,
        # not after the training
        from .io._gguf_tokenizer_keys import tokenizer_keys
        try:
            tokenizer_keys(tok, model.config.vocab_size)
        except (TypeError, ValueError) as e:
            p.error(f"--merge-out: the GGUF needs a tokenizer llama.cpp reads: {e}; give "
                    f"--tokenizer FILE.gguf (the model's vocabulary), or write the adapter "
                    f"(--peft-out, --out)")
    out_warned: list[str] = []   # what --out's early check warned about
    if not args.full:
        targets = _lora_targets(p, args.lora_targets)
        try:
            # a name that adapts nothing beside others that do (a misspelt one) is a
            # warning in the library, refused here as every bad argument is: before
            # the training
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                lora.apply(model, rank=args.lora_rank, alpha=args.lora_alpha,
                           targets=targets, dropout=args.lora_dropout, seed=args.seed)
        except (ValueError, TypeError) as e:
            option = {"rank": "--lora-rank", "alpha": "--lora-alpha", "seed": "--seed",
                      "dropout": "--lora-dropout"}.get(str(e).split(":")[0], "--lora-targets")
            p.error(_in_options(f"{option}: {e}"))
        for w in said:
            if str(w.message).startswith("targets:") and "no layer of the model" in \
                    str(w.message):
                p.error(f"--lora-targets: {str(w.message).removeprefix('targets: ')}")
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if args.out:   # what llama.cpp could not apply is said now, not after the training
            from .io.gguf_lora import check_writable
            try:
                with warnings.catch_warnings(record=True) as said:
                    warnings.simplefilter("always")
                    check_writable(model)
            except (ValueError, TypeError) as e:
                p.error(f"--out: {e}")
            for w in said:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            # said once, before the training: not again when the file is written
            out_warned = [str(w.message) for w in said]
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    out = sys.stdout
    if not args.silent and writes:
        print(f"finetune: {what}", file=out)
        if not args.full:
            lora.print_trainable_parameters(model)
    if comm is not None:
        # each rank's share of a batch, in micro-batches of its share by default
        ranks = comm.Get_size()
        share = args.micro_batch or args.batch // ranks
        if args.batch % (ranks * max(1, share)) or share < 1:
            p.error(f"--batch: with --mpi over {ranks} ranks each takes --batch / {ranks} "
                    f"windows a step in micro-batches: expected a multiple of {ranks} x "
                    f"--micro-batch ({ranks * max(1, share)}), got {args.batch}")
        args.micro_batch = share
    # the optimizer steps of an epoch as fit splits the data
    from ._fit_plan import training_batches
    steps_per_epoch = training_batches(train.ndata // args.batch, args.val_split)
    total = args.max_steps or max(1, (args.epochs or 1) * steps_per_epoch)
    if args.warmup >= total:
        p.error(f"--warmup: {args.warmup} steps of warmup, but the run takes {total} optimizer "
                f"steps; give fewer (the schedule's decay or constant rate follows it)")
    nepoch = args.epochs if args.epochs is not None else None if args.max_steps else 1
    if args.resume and not os.path.exists(args.checkpoint) and writes:
        print(f"finetune: no checkpoint at {args.checkpoint} yet: training from the start",
              file=sys.stderr)
    try:
        with warnings.catch_warnings():
            # a resume whose schedule is not the one of the run that wrote the checkpoint
            # (another --lr, --lr-schedule, --warmup, --epochs or --max-steps) is refused
            warnings.filterwarnings("error", message="resume: .*other parameters than",
                                    category=UserWarning)
            history = go.fit(model, train, "cross_entropy", _optimizer(args, steps_per_epoch),
                             nepoch=nepoch, nbatch_logical=args.batch,
                             nbatch_physical=args.micro_batch, val_split=args.val_split,
                             silent=args.silent, optimizer=args.optimizer, seed=args.seed,
                             precision=args.precision,
                             checkpoint=args.checkpoint, resume=args.resume,
                             max_steps=args.max_steps, eval_every=args.eval_every,
                             clip_grad_norm=args.max_grad_norm,
                             checkpoint_every=args.checkpoint_every,
                             optimizer_in_backward=args.optimizer_in_backward, comm=comm,
                             accumulate=args.accumulate,
                             # a text's windows in order, the last ones validating
                             # (llama-finetune); chats and completions shuffled, a
                             # --valid file kept last, the validation part
                             shuffle=False if args.file else "train" if args.valid else True,
                             run_info=_run_info(args, train, model))
    except UserWarning as e:
        p.error(f"--resume: {e}; give the options of the run that wrote it")
    except (ValueError, TypeError) as e:   # (a checkpoint of another run, a split too small)
        p.error(_in_options(str(e)))
    except KeyboardInterrupt:
        saved = f"; {args.checkpoint} holds the last state saved (run again with --resume " \
                "to go on)" if args.checkpoint and os.path.exists(args.checkpoint) else ""
        print(f"finetune: interrupted{saved}", file=sys.stderr)
        if comm is not None and comm.Get_size() > 1:
            # another rank may wait for this one in a collective it will never join
            # (Ctrl-C reaches each rank somewhere else): take them all down rather
            # than leave them waiting; the checkpoint is written atomically
            sys.stdout.flush()
            sys.stderr.flush()
            comm.Abort(130)
        return 130
    if not writes:
        return 0
    if not args.silent and len(history):
        print(f"finetune: train loss {history[-1].train_loss:.4f}", file=out)
    from .io import save_gguf, save_gguf_lora
    if args.out:
        with warnings.catch_warnings():
            for message in out_warned:
                warnings.filterwarnings("ignore", message=re.escape(message))
            save_gguf_lora(model, args.out)
    if args.peft_out:
        from .io import save_peft
        # PEFT loads its base by this name: a checkpoint's directory (absolute: found
        # from wherever the adapter is loaded), not a GGUF file
        save_peft(model, args.peft_out, base_model_name_or_path=os.path.abspath(args.model)
                  if os.path.isdir(args.model) else None)
    if args.merge_out:
        if not args.full:
            lora.merge(model)
        save_gguf(model, args.merge_out, tokenizer=tok, dtype=args.out_type)
    if args.plot:
        history.plot(args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
