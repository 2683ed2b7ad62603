"""Train a byte-level language model on text, then print its perplexity and a sample.

    python -m ggmlopt.examples.textlm                     # Llama on the stdlib's docstrings
    python -m ggmlopt.examples.textlm --model gpt2        # GPT-2 instead
    python -m ggmlopt.examples.textlm --text FILE         # any UTF-8 text
    python -m ggmlopt.examples.textlm --steps 500         # a shorter run
    python -m ggmlopt.examples.textlm --checkpoint run.npz --checkpoint-every 100
    python -m ggmlopt.examples.textlm --checkpoint run.npz --resume   # after an interruption
    python -m ggmlopt.examples.textlm --save lm.npz --plot curves.png
    python -m ggmlopt.examples.textlm --load lm.npz --prompt "Return the"   # no training
    python -m ggmlopt.examples.textlm --quick             # a few seconds: a smoke test

The model and settings are nanoGPT's CPU configuration (its README's
shakespeare_char run on a laptop): 4 layers, 4 heads, dim 128, a context of 64
bytes, batches of 12 windows, AdamW (lr 1e-3, beta2 0.99, weight decay 0.1 on
every parameter, as ggml's AdamW decays them, where nanoGPT leaves norms and
biases undecayed; gradients clipped to norm 1) with a linear warmup over the first 5% of the steps
(at most 100) and a cosine decay to 1e-4; the tokens are the 256 bytes of UTF-8
plus ``<|endoftext|>`` (ggmlopt.text.ByteTokenizer).  nanoGPT's reference point
is 2000 steps, the default (about 3 CPU-minutes, a validation loss of 1.47
nats per byte and a held-out perplexity of 4.4); 1000 steps take under 2
CPU-minutes and already write word-like English.  As nanoGPT's
train_shakespeare_char, the validation windows are evaluated every 250 steps
(``--eval-every``, fit's eval_every; 0: only at the end of each epoch).

The text (default: ggmlopt.corpora.python_docstrings(), the docstrings of the
Python standard library, about 1.6 MB, no download) is split as nanoGPT splits
it: the first 90% trains, the last 10% is held out.  Each epoch trains on
``steps / epochs`` batches of windows spread evenly over the training text
(llama.cpp's windows, ggmlopt.Dataset.from_tokens) and validates on 10% more
windows from it that no training window overlaps (from the text's last part
where the windows would overlap: a short text, many steps an epoch).  Every
epoch sees the same windows, so fewer epochs cover more of the text: nanoGPT
draws new random windows at every step, and 2000 steps in 10 epochs here
overfit (validation loss 1.51 against 1.47 in 2 epochs, the default).  The held-out 10% is scored at
the end by ggmlopt.lm.perplexity (llama-perplexity's protocol: chunks of 64
tokens, the second half of each scored).  The sample continues --prompt; past
the 64 positions the model knows, a new window starts from the last 32 tokens
and fills up again (nanoGPT instead feeds the last 64 at every token: from the
64th position on the two samples differ).

--save writes a .npz holding every named parameter and the configuration as
JSON (``config.json``); --load reads one back and evaluates it instead of
training.  Both, and --plot (needs matplotlib), are checked before training.
--checkpoint FILE saves the whole training state (fit's checkpoint) after every
epoch and, with --checkpoint-every N, every N steps; --resume continues an
interrupted run from it, bit for bit as if it had not stopped (same arguments).
"""
from __future__ import annotations

import argparse
import codecs
import dataclasses
import json
import math
import os
import sys
import zipfile
from typing import NamedTuple

import numpy as np

import ggmlopt as go
from ggmlopt._blas_threads import blas_threads_for_training
from ggmlopt.io._files import atomic_output, input_path, output_path
from ggmlopt.models import GPT2, GPT2Config, Llama, LlamaConfig
from ggmlopt.text import ByteTokenizer

MODELS = {"llama": (Llama, LlamaConfig), "gpt2": (GPT2, GPT2Config)}
HELD_OUT = 0.1          # nanoGPT's train/val split of the text
VAL_BATCHES = 0.1       # validation windows per epoch, as a fraction of the training ones
MIN_LR_FACTOR = 0.1     # cosine decay from 1e-3 to 1e-4, nanoGPT's min_lr = lr / 10
EVAL_EVERY = 250        # nanoGPT's eval_interval (train_shakespeare_char)
QUICK = {"steps": 40, "epochs": 2, "corpus_bytes": 120_000, "eval_tokens": 4096,
         "max_new_tokens": 80, "eval_every": 10}


class Run(NamedTuple):
    """What main returns: the History (None with --load), the held-out
    perplexity (ggmlopt.lm.Perplexity) and the generated text."""

    history: go.History | None
    perplexity: go.lm.Perplexity
    sample: str


def make_model(kind: str, n_layers: int, n_heads: int, dim: int, n_ctx: int, seed: int):
    """A byte-level Llama or GPT2 (vocab 257) of max_seq_len n_ctx."""
    cls, config_cls = MODELS[kind]
    config = config_cls(vocab_size=ByteTokenizer.vocab_size, dim=dim, n_layers=n_layers,
                        n_heads=n_heads, max_seq_len=n_ctx)
    return cls(config, seed=seed)


def save_model(model, path: str) -> None:
    """model's named parameters and its configuration (JSON, key ``config.json``)
    in one .npz."""
    config = {"model": type(model).__name__.lower(), **dataclasses.asdict(model.config)}
    arrays = {name: p.data for name, p in model.named_parameters()}
    arrays["config.json"] = np.array(json.dumps(config))
    # atomically (a full disk or a Ctrl-C leaves the previous model whole); np.savez
    # would add .npz to a name without it
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)


def load_model(path: str):
    """The model save_model wrote to path (KeyError/ValueError naming what differs)."""
    if not zipfile.is_zipfile(path):
        raise ValueError(f"--load: {path!r} is not a .npz archive")
    with np.load(path, allow_pickle=False) as f:
        if "config.json" not in f.files:
            raise ValueError(f"--load: {path!r} holds no config.json: not a model saved by "
                             f"this example")
        config = json.loads(str(f["config.json"]))
        kind = config.pop("model")
        if kind not in MODELS:
            raise ValueError(f"--load: unknown model {kind!r} in {path!r}")
        cls, config_cls = MODELS[kind]
        model = cls(config_cls(**config))
        for name, p in model.named_parameters():
            if name not in f.files:
                raise KeyError(f"--load: {path!r} has no parameter {name!r}")
            value = f[name]
            if value.shape != p.data.shape:
                raise ValueError(f"--load: {name} is {value.shape} in {path!r}, the model "
                                 f"expects {p.data.shape}")
            p.data[...] = value
    return kind, model


def windows(tokens: np.ndarray, n_ctx: int, nwindows: int) -> go.Dataset:
    """A Dataset of nwindows next-token windows (int32 (nwindows, n_ctx) data and
    labels) spread evenly over tokens, integer ids (ntokens,), with the largest
    stride the text allows; ValueError when it is too short."""
    stride = (tokens.size - n_ctx - 1) // nwindows
    if stride < 1:
        raise ValueError(f"the text's {tokens.size} training tokens make fewer than the "
                         f"{nwindows} windows of {n_ctx} an epoch needs: lower --steps per "
                         f"epoch (raise --epochs) or give a longer --text")
    return go.Dataset.from_tokens(tokens[:nwindows * stride + n_ctx + 1], n_ctx, stride)


def training_windows(tokens: np.ndarray, n_ctx: int, ntrain: int, nval: int):
    """(Dataset, shuffle): ntrain + nval windows of tokens (as windows makes
    them), the last nval validating, and fit's shuffle for it.  No validation
    window shares a token with a training one: spread over the whole text with a
    stride past n_ctx the windows are apart, and fit's shuffle (True) may pick
    any as validating; with a shorter stride (a short text, many steps an epoch)
    the validation windows come from the text's own tail, past every training
    window, and stay last (shuffle "train"), unless the text is too short to
    hold them apart (then any may validate, as over a long text)."""
    stride = (tokens.size - n_ctx - 1) // (ntrain + nval)
    if stride > n_ctx or stride < 1:   # (windows refuses a text too short for them all)
        return windows(tokens, n_ctx, ntrain + nval), True
    # the tail holds the validation windows at a stride of at least 1
    cut = min(tokens.size * ntrain // (ntrain + nval), tokens.size - (n_ctx + nval + 1))
    if cut < n_ctx + ntrain + 1:
        # too short to hold the two apart: overlapping windows, as a text this short
        # always trained (the caller says so)
        return windows(tokens, n_ctx, ntrain + nval), True
    train, val = windows(tokens[:cut], n_ctx, ntrain), windows(tokens[cut:], n_ctx, nval)
    both = go.Dataset.from_arrays(np.concatenate([train.data, val.data]),
                                  np.concatenate([train.labels, val.labels]))
    return both, "train"


def sample(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float,
           seed: int, out=None) -> str:
    """max_new_tokens bytes written after prompt, printed to out as they come.
    Beyond the model's max_seq_len each new window starts from the last half of
    the previous one."""
    n_ctx = model.config.max_seq_len
    ids = list(tokenizer.encode(prompt)) or [tokenizer.eos_id]
    rng = np.random.default_rng(seed)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = []
    left = max_new_tokens
    while left > 0:
        context = ids[-(n_ctx // 2):] if len(ids) >= n_ctx else ids
        n = min(left, n_ctx - len(context))
        for token in go.lm.stream(model, np.array(context, np.int32), n,
                                  temperature=temperature, seed=rng):
            ids.append(token)
            text = (tokenizer.eos_text if token == tokenizer.eos_id
                    else decoder.decode(bytes([token])))
            pieces.append(text)
            if out is not None:
                out.write(text)
                out.flush()
        left -= n
    tail = decoder.decode(b"", final=True)
    pieces.append(tail)
    if out is not None:
        out.write(tail + "\n")
    return "".join(pieces)


def check_outputs(args, parser) -> None:
    """--save and --plot, checked before any training."""
    if args.save:
        if not args.save.endswith(".npz"):
            parser.error(f"--save: expected a file name ending in .npz, got {args.save!r}")
        try:
            path = output_path(args.save, "--save")
        except (OSError, ValueError) as e:
            parser.error(str(e))
        if not os.access(os.path.dirname(os.path.realpath(path)), os.W_OK):
            parser.error(f"--save: the folder of {args.save!r} is not writable")
    if args.plot:
        try:
            path = output_path(args.plot, "--plot")
            from ggmlopt._optional import import_optional

            import_optional("matplotlib", "plot", "--plot")
        except (OSError, ValueError, ImportError) as e:
            parser.error(str(e))
        from matplotlib.figure import Figure

        suffix = os.path.splitext(path)[1].lower().lstrip(".")
        formats = Figure().canvas.get_supported_filetypes()
        if suffix not in formats:
            parser.error(f"--plot: expected a file name ending in one of "
                         f"{', '.join('.' + f for f in sorted(formats))}, got {args.plot!r}")
        if not os.access(os.path.dirname(os.path.realpath(path)), os.W_OK):
            parser.error(f"--plot: the folder of {args.plot!r} is not writable")


def read_text(args, parser) -> tuple[str, str]:
    """(the text, a description of it)."""
    if args.text:
        try:
            with open(input_path(args.text, "--text"), encoding="utf-8") as f:
                return f.read(), args.text
        except (OSError, ValueError) as e:   # input_path's messages name --text
            parser.error(str(e) if str(e).startswith("--text") else f"--text: {e}")
    from ggmlopt.corpora import python_docstrings

    if args.quick:
        return (python_docstrings(min_bytes=QUICK["corpus_bytes"]),
                "the first docstrings of Python's standard library (--quick)")
    return python_docstrings(), "the docstrings of Python's standard library (offline)"


def ppl(loss: float) -> float:
    """exp(loss), inf instead of an overflow."""
    return math.exp(loss) if loss < 700 else math.inf


def main(argv=None) -> Run:
    parser = argparse.ArgumentParser(prog="python -m ggmlopt.examples.textlm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", metavar="FILE",
                        help="a UTF-8 text file to train on (default: the docstrings of "
                             "Python's standard library, offline)")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama",
                        help="llama (default: RMSNorm, RoPE, SwiGLU) or gpt2 (LayerNorm, "
                             "learned positions, GELU MLP, tied embedding)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps in all (default 2000, nanoGPT's reference)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs the steps are spread over (default 2; each epoch repeats the "
                             "same windows)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help=f"evaluate the validation windows every N steps (default "
                             f"{EVAL_EVERY}; 0: only at each epoch's end)")
    parser.add_argument("--n-layers", type=int, default=4, help="transformer blocks (4)")
    parser.add_argument("--n-heads", type=int, default=4, help="attention heads (4)")
    parser.add_argument("--dim", type=int, default=128, help="model width (128)")
    parser.add_argument("--n-ctx", type=int, default=64,
                        help="tokens (bytes) per window, the model's max_seq_len (64)")
    parser.add_argument("--batch", type=int, default=12, help="windows per step (12)")
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="peak learning rate (1e-3; the cosine ends at lr / 10)")
    parser.add_argument("--eval-tokens", type=int, default=None,
                        help="held-out tokens scored by the perplexity (default: all)")
    parser.add_argument("--prompt", default="Return the",
                        help="the text the sample continues ('Return the')")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="bytes to generate (default 300)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature; 0 is greedy (0.8)")
    parser.add_argument("--seed", type=int, default=0,
                        help="initialisation, shuffles and sampling")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test in seconds: 40 steps on 120 kB of text")
    parser.add_argument("--silent", action="store_true", help="no progress bars")
    files = parser.add_argument_group("saving, loading and plotting")
    files.add_argument("--save", metavar="FILE.npz",
                       help="write the trained model: its named parameters and config.json")
    files.add_argument("--load", metavar="FILE.npz",
                       help="evaluate and sample a model written by --save instead of training")
    files.add_argument("--plot", metavar="FILE.png",
                       help="write the training and validation curves; needs ggmlopt[plot]")
    files.add_argument("--checkpoint", metavar="FILE.npz",
                       help="save the training state after every epoch (and --checkpoint-every "
                            "N steps)")
    files.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                       help="with --checkpoint: also save it every N optimizer steps")
    files.add_argument("--resume", action="store_true",
                       help="continue from --checkpoint when it exists (the same arguments)")
    args = parser.parse_args(argv)
    eval_every_given = args.eval_every
    quick = QUICK if args.quick else {}
    steps = args.steps if args.steps is not None else quick.get("steps", 2000)
    epochs = args.epochs if args.epochs is not None else quick.get("epochs", 2)
    max_new = (args.max_new_tokens if args.max_new_tokens is not None
               else quick.get("max_new_tokens", 300))
    eval_tokens = args.eval_tokens if args.eval_tokens is not None else quick.get("eval_tokens")
    args.eval_every = (args.eval_every if args.eval_every is not None
                       else quick.get("eval_every", EVAL_EVERY))
    for name, value, low in (("--steps", steps, 1), ("--epochs", epochs, 1),
                             ("--eval-every", args.eval_every, 0),
                             ("--checkpoint-every", args.checkpoint_every, 1),
                             ("--n-ctx", args.n_ctx, 4), ("--batch", args.batch, 1),
                             ("--max-new-tokens", max_new, 0), ("--eval-tokens", eval_tokens, 1)):
        if value is not None and value < low:
            parser.error(f"{name}: expected at least {low}, got {value}")
    if args.seed < 0:
        parser.error(f"--seed: expected a non-negative integer, got {args.seed}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr: expected a finite value > 0, got {args.lr}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature: expected a finite value >= 0, got {args.temperature}")
    if args.load and (args.save or args.plot or args.checkpoint):
        parser.error("--load evaluates a saved model: it trains nothing to --save, --plot or "
                     "--checkpoint")
    if (args.checkpoint_every or args.resume) and not args.checkpoint:
        parser.error(f"{'--resume' if args.resume else '--checkpoint-every'}: needs "
                     f"--checkpoint FILE")
    if args.load:
        ignored = [name for name, value, default in (
            ("--model", args.model, "llama"), ("--n-layers", args.n_layers, 4),
            ("--n-heads", args.n_heads, 4), ("--dim", args.dim, 128),
            ("--n-ctx", args.n_ctx, 64), ("--batch", args.batch, 12), ("--lr", args.lr, 1e-3),
            ("--steps", args.steps, None), ("--epochs", args.epochs, None),
            ("--eval-every", eval_every_given, None), ("--quick", args.quick, False))
            if value != default]
        if ignored:
            parser.error(f"--load evaluates the saved model as it is: {', '.join(ignored)} "
                         f"would change nothing")
        try:
            args.load = input_path(args.load, "--load")
        except (OSError, ValueError) as e:
            parser.error(str(e))
    check_outputs(args, parser)
    say = print
    if args.load:   # before reading the text: a bad file fails at once
        try:
            kind, model = load_model(args.load)
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(str(e).strip("'\""))

    tokenizer = ByteTokenizer()
    text, description = read_text(args, parser)
    tokens = tokenizer.encode(text)
    nheld = int(tokens.size * HELD_OUT)
    train_tokens, held_out = tokens[:tokens.size - nheld], tokens[tokens.size - nheld:]
    if eval_tokens is not None:
        held_out = held_out[:eval_tokens]
    say(f"textlm: text: {description}: {tokens.size} bytes, {train_tokens.size} to train, "
        f"{nheld} held out")

    n_ctx = model.config.max_seq_len if args.load else args.n_ctx
    if held_out.size < 2 * n_ctx:   # said before any training
        parser.error(f"the held-out text has {held_out.size} tokens; the perplexity needs "
                     f"at least {2 * n_ctx}: give a longer --text (or more --eval-tokens)")
    if args.load:
        say(f"textlm: loaded a {kind} model from {args.load}; not training")
        history = None
    else:
        try:
            model = make_model(args.model, args.n_layers, args.n_heads, args.dim, args.n_ctx,
                               args.seed)
        except (TypeError, ValueError) as e:
            parser.error(str(e))
        try:
            history = train(model, train_tokens, steps, epochs, args, say)
        except KeyboardInterrupt:
            kept = f"; {args.checkpoint} holds the last state saved (run again with " \
                "--resume to go on)" if args.checkpoint and os.path.exists(args.checkpoint) \
                else ""
            print(f"textlm: interrupted{kept}", file=sys.stderr)
            raise SystemExit(130) from None
        if args.save:
            save_model(model, args.save)
            say(f"textlm: saved the model to {args.save}")
        if args.plot:
            history.plot(args.plot)
            say(f"textlm: wrote the training curves to {args.plot}")

    # BLAS threads capped to the idle cores as fit caps them for each epoch: lm.perplexity
    # and generation do not yet, and busy-waiting BLAS threads on a shared machine made
    # them ~10x slower
    with blas_threads_for_training(model):
        result = go.lm.perplexity(model, held_out, n_ctx, batch_size=64)
    say(f"textlm: held-out perplexity (llama-perplexity's protocol, n_ctx={n_ctx}, "
        f"{result.scored} tokens scored): PPL = {result.ppl:.4f} +/- {result.unc:.4f} "
        f"(nll {result.nll:.4f})")
    say(f"textlm: sample (temperature {args.temperature}, seed {args.seed}):")
    say(args.prompt, end="")
    with blas_threads_for_training(model):
        text = sample(model, tokenizer, args.prompt, max_new, args.temperature, args.seed,
                      out=sys.stdout)
    return Run(history, result, text)


def train(model, tokens, steps, epochs, args, say) -> go.History:
    """fit on windows of tokens: steps // epochs batches an epoch, 10% more
    validating; prints one line per epoch and returns the History."""
    per_epoch = max(1, steps // epochs)
    if per_epoch * epochs != steps:
        say(f"textlm: {steps} steps do not split into {epochs} epochs: "
            f"{per_epoch * epochs} steps ({per_epoch} an epoch)")
    nval = max(1, round(per_epoch * VAL_BATCHES))
    try:
        ds, shuffle = training_windows(tokens, args.n_ctx, per_epoch * args.batch,
                                       nval * args.batch)
    except ValueError as e:
        raise SystemExit(f"textlm: {e}") from None
    total = per_epoch * epochs
    warmup = min(100, max(1, total // 20))
    base = go.OptimizerParams(go.AdamWParams(alpha=args.lr, beta1=0.9, beta2=0.99, wd=0.1))
    schedule = go.schedules.WarmupCosine(warmup, total, MIN_LR_FACTOR, base=base, unit="step")
    nparams = sum(p.data.size for p in model.parameters())
    say(f"textlm: model: {model!r}, {nparams / 1e6:.2f}M parameters")
    stride = (tokens.size - args.n_ctx - 1) // ds.ndata
    covered = min(1.0, ds.ndata * args.n_ctx / tokens.size)
    apart = ", the validating ones from the text's last part" if shuffle == "train" else \
        ", the validating ones overlapping training ones: too short a text to hold them " \
        "apart" if stride <= args.n_ctx else ""
    say(f"textlm: {epochs} epochs x {per_epoch} steps of {args.batch} windows of {args.n_ctx} "
        f"bytes ({ds.ndata} windows, {nval * args.batch} of them validating, stride {stride}: "
        f"{100 * covered:.0f}% of the training text, the same windows every epoch{apart})")
    say(f"textlm: AdamW lr {args.lr:g} (warmup {warmup} steps, cosine to "
        f"{args.lr * MIN_LR_FACTOR:g}), beta2 0.99, weight decay 0.1, gradient norm clipped "
        f"to 1")
    sys.stdout.flush()
    # a validation split of nval - 1/4 logical batches rounds to exactly nval of them
    val_split = (nval - 0.25) / (per_epoch + nval)
    eval_every = args.eval_every if 0 < args.eval_every < per_epoch * epochs else None
    try:
        history = go.fit(model, ds, go.LossType.CROSS_ENTROPY, schedule, nepoch=epochs,
                         nbatch_logical=args.batch, val_split=val_split, silent=args.silent,
                         seed=args.seed, clip_grad_norm=1.0, eval_every=eval_every,
                         checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every,
                         resume=args.resume, shuffle=shuffle)
    except ValueError as e:   # a checkpoint of another run, a bad --checkpoint path
        if "checkpoint" not in str(e):
            raise
        raise SystemExit(f"textlm: {e}") from None
    for ev in history.evaluations:
        say(f"textlm: step {ev.step}/{total}: val loss {ev.val_loss:.4f} "
            f"(ppl {ppl(ev.val_loss):.3f}), train loss so far this epoch {ev.train_loss:.4f}")
    for i, stats in enumerate(history, 1):
        say(f"textlm: epoch {i}/{epochs}: train loss {stats.train_loss:.4f} "
            f"(ppl {ppl(stats.train_loss):.3f}), val loss {stats.val_loss:.4f} "
            f"(ppl {ppl(stats.val_loss):.3f}), next-byte accuracy {100 * stats.val_accuracy:.1f}%, "
            f"{stats.seconds:.1f} s")
    return history


if __name__ == "__main__":
    main()
