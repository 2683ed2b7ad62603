"""Train ggml's mnist-fc or mnist-cnn model and print the test loss and accuracy.

    python -m ggmlopt.examples.mnist                 # mnist-fc, offline, no download
    python -m ggmlopt.examples.mnist --model cnn     # mnist-cnn
    python -m ggmlopt.examples.mnist --data DIR      # MNIST IDX files in DIR
    python -m ggmlopt.examples.mnist --save model.gguf --plot curves.png
    python -m ggmlopt.examples.mnist --load model.gguf   # evaluate, no training
    python -m ggmlopt.examples.mnist --save model.safetensors  # torch's layout
    mpiexec -n 2 python -m ggmlopt.examples.mnist --mpi   # data-parallel on 2 processes

The models and settings are those of ggml's examples/mnist: cross-entropy,
AdamW with ggml's defaults, 30 epochs, logical batches of 1000 in physical
batches of 500, shards of 10 datapoints, 5% of the training data for validation.
mnist-fc: 784-500-10 with ReLU.  mnist-cnn: the flat datapoints reshaped to
(1, 28, 28) images; conv 3x3, 8 channels, padding 1, ReLU, max-pool 2x2; conv
3x3, 16 channels, padding 1, ReLU, max-pool 2x2; dense 7*7*16 = 784 -> 10.  Both
draw every weight and bias from N(0, 0.01), as ggml's mnist_model_init_random does.

Offline it trains on scikit-learn's bundled 8x8 handwritten digits (the
``examples`` extra: ``pip install ggmlopt[examples]``), each digit upsampled
3x to 24x24 and centred in 28x28 like MNIST, so both of ggml's 28x28 models run
unchanged; only the batch sizes are scaled down to fit 1500 training images
(mnist-fc: 100 in physical batches of 50; mnist-cnn, which needs more optimizer
steps to pass 95% within ggml's 30 epochs: 50 in physical batches of 10, 28
steps an epoch).  Without scikit-learn it falls back to a synthetic 10-class
dataset and says so.  --nbatch-logical / --nbatch-physical override the batch
sizes.

With ``--mpi`` (the ``mpi`` extra: ``pip install ggmlopt[mpi]``) every process
started by mpiexec or srun trains its part of each logical batch
(ggmlopt.distributed); each uses cores / processes-per-machine threads unless
``--threads`` says otherwise, and only rank 0 prints.  The default batch sizes
follow the number of processes: the logical batch nearest to one process's
that gives every process whole physical batches of whole shards (the example
says when it changed them); a --nbatch-logical that does not split so is
refused before any work, with the values that do.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import numpy as np

import ggmlopt as go
from ggmlopt._optional import install_hint

NE_IN, NE_HIDDEN, NCLASSES = 28 * 28, 500, 10
HW, CNN_NCB = 28, 8   # image side; ggml's MNIST_CNN_NCB: channels of the first conv


def ggml_normal_init(weight, bias, rng):
    """ggml's mnist_model_init_random: every weight and bias ~ N(0, 1e-2)."""
    go.nn.init.normal_(weight, 0.0, 1e-2, rng=rng)
    if bias is not None:
        go.nn.init.normal_(bias, 0.0, 1e-2, rng=rng)


def mnist_fc(seed=None):
    """ggml's mnist-fc: 784-500-10 with ReLU, initialised from N(0, 0.01) as ggml."""
    rng = np.random.default_rng(seed)
    return go.nn.Sequential(
        go.nn.Linear(NE_IN, NE_HIDDEN, init=ggml_normal_init, rng=rng), go.nn.ReLU(),
        go.nn.Linear(NE_HIDDEN, NCLASSES, init=ggml_normal_init, rng=rng))


def mnist_cnn(seed=None, hw=HW):
    """ggml's mnist-cnn on flat (batch, 784) datapoints: reshape to (1, 28, 28);
    conv 3x3 8 ch pad 1, ReLU, max-pool 2; conv 3x3 16 ch pad 1, ReLU, max-pool 2;
    flatten; dense 784 -> 10.  Initialised from N(0, 0.01) as ggml.  (ggml
    flattens height, width, channel; Flatten here channel, height, width: the
    same model up to a permutation of the dense weight's rows.)"""
    nn = go.nn
    rng = np.random.default_rng(seed)
    return nn.Sequential(
        nn.Reshape((1, hw, hw)),
        nn.Conv2d(1, CNN_NCB, 3, padding=1, init=ggml_normal_init, rng=rng), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(CNN_NCB, 2 * CNN_NCB, 3, padding=1, init=ggml_normal_init, rng=rng),
        nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear((hw // 4) * (hw // 4) * 2 * CNN_NCB, NCLASSES, init=ggml_normal_init,
                  rng=rng))


# (nbatch_logical, nbatch_physical) offline: ggml's 1000/500 scaled to 1500 images
OFFLINE_BATCHES = {"fc": (100, 50), "cnn": (50, 10)}
# the offline data and its train/test split, whatever --seed is (as MNIST's own split is fixed)
SPLIT_SEED = 0

MODELS = {
    "fc": (mnist_fc, f"mnist-fc {NE_IN}-{NE_HIDDEN}-{NCLASSES}"),
    "cnn": (mnist_cnn, "mnist-cnn conv3x3x8-pool2-conv3x3x16-pool2-dense784x10"),
}


def _onehot(labels):
    y = np.zeros((labels.size, NCLASSES), np.float32)
    y[np.arange(labels.size), labels] = 1.0
    return y


def digits_as_mnist(seed=SPLIT_SEED):
    """scikit-learn's 1797 8x8 digits as 28x28 uint8 images (values 0..16, scale
    1/16), shuffled with seed: 1500 for training, 297 for testing (main passes
    SPLIT_SEED whatever --seed is: a model trained with one seed and loaded with
    another is tested on the same images, none of which it trained on)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.uint8)  # (1797, 8, 8), values 0..16
    big = np.zeros((images.shape[0], 28, 28), np.uint8)
    big[:, 2:26, 2:26] = images.repeat(3, axis=1).repeat(3, axis=2)
    order = np.random.default_rng(seed).permutation(images.shape[0])
    x = big.reshape(-1, NE_IN)[order]
    y = _onehot(digits.target[order])
    ntrain = 1500
    train = go.Dataset.from_arrays(x[:ntrain], y[:ntrain], ndata_shard=10, data_scale=1 / 16)
    test = go.Dataset.from_arrays(x[ntrain:], y[ntrain:], data_scale=1 / 16)
    return train, test


def synthetic(seed=SPLIT_SEED):
    """10 classes of noisy random 784-pixel prototypes: 2000 training, 500 test
    (main passes SPLIT_SEED: the same task and test set whatever --seed is)."""
    rng = np.random.default_rng(seed)
    prototypes = rng.random((NCLASSES, NE_IN), dtype=np.float32)

    def make(n):
        labels = rng.integers(0, NCLASSES, n)
        x = prototypes[labels] + 0.8 * rng.standard_normal((n, NE_IN), dtype=np.float32)
        return x.astype(np.float32), _onehot(labels)

    (xtr, ytr), (xte, yte) = make(2000), make(500)
    return (go.Dataset.from_arrays(xtr, ytr, ndata_shard=10),
            go.Dataset.from_arrays(xte, yte))


def evaluate(model, dataset, nbatch_physical):
    """Forward passes over the whole dataset (ggml's mnist_model_eval); the batch
    is the largest divisor of ndata not above nbatch_physical."""
    ndata = dataset.ndata
    batch = max(b for b in range(1, min(nbatch_physical, ndata) + 1)
                if ndata % b == 0 and b % dataset.ndata_shard == 0)
    ctx = go.OptContext(model, batch_size=batch, ne_datapoint=NE_IN,
                        loss_type=go.LossType.CROSS_ENTROPY, build_type=go.BuildType.FORWARD,
                        class_labels=dataset.class_labels)
    result = go.Result()
    go.epoch(ctx, dataset, None, result, 0)
    return result


GGML_ARCHS = {"fc": "mnist-fc", "cnn": "mnist-cnn"}  # --model -> ggml's architecture string


# --save / --load file suffix -> (package it needs, the extra that installs it)
SAVE_FORMATS = {".gguf": ("gguf", "interop"), ".safetensors": ("safetensors", "interop")}


def _suffix(path):
    return os.path.splitext(path)[1].lower()


def _missing(package, extra, what):
    """A sentence for parser.error when package is not installed, else None."""
    if importlib.util.find_spec(package) is not None:
        return None
    return f"{what} needs the '{package}' package: {install_hint(extra, package)}"


def _output_problem(path, option):
    """Why path cannot be written (a sentence), else None: checked before training."""
    if os.path.isdir(path):
        return f"{option}: {path} is a directory; expected a file name"
    # the folder the file lands in (through a symbolic link), named as given
    directory = os.path.dirname(os.path.abspath(path))
    real = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(real):
        return f"{option}: the folder {directory} does not exist"
    if not os.access(real, os.W_OK | os.X_OK):
        return f"{option}: the folder {directory} is not writable"
    return None


def check_outputs(args):
    """Every reason --save or --plot would fail after training, found before it
    starts: the file's format (by suffix), the package it needs, the folder."""
    problems = []
    if args.save:
        fmt = SAVE_FORMATS.get(_suffix(args.save))
        if fmt is None:
            problems.append(f"--save: expected a FILE.gguf (ggml's GGUF) or "
                            f"FILE.safetensors, got {args.save}")
        else:
            problems.append(_missing(*fmt, f"--save {args.save}"))
            if args.save_f16 and _suffix(args.save) != ".gguf":
                problems.append("--save-f16 goes with a .gguf file (safetensors are float32)")
        problems.append(_output_problem(args.save, "--save"))
    if args.plot:
        missing = _missing("matplotlib", "plot", "--plot")
        problems.append(missing)
        if not _suffix(args.plot):
            problems.append(f"--plot: give the image format by the file's suffix "
                            f"({args.plot}.png, .pdf, .svg), got {args.plot!r}")
        elif missing is None:
            from matplotlib.figure import Figure

            formats = Figure().canvas.get_supported_filetypes()
            if _suffix(args.plot)[1:] not in formats:
                problems.append(f"--plot: matplotlib does not write {_suffix(args.plot)} "
                                f"files (it writes {', '.join(sorted(formats))})")
        problems.append(_output_problem(args.plot, "--plot"))
    return [p for p in problems if p is not None]


def model_in_file(path):
    """("fc" or "cnn", or None, and what the file says) for the model file at path:
    a GGUF's general.architecture (mnist-fc / mnist-cnn), else the names and
    shapes of its tensors (a GGUF or safetensors file of either model)."""
    shapes = {}
    if _suffix(path) == ".gguf":
        import gguf

        reader = gguf.GGUFReader(path)
        field = reader.fields.get("general.architecture")
        arch = field.contents() if field is not None else None
        for name, arch_name in GGML_ARCHS.items():
            if arch == arch_name:
                return name, f"general.architecture={arch}"
        shapes = {t.name: tuple(int(n) for n in t.shape[::-1]) for t in reader.tensors}
        said = f"general.architecture={arch}, tensors {sorted(shapes)}"
    else:
        from safetensors import safe_open

        with safe_open(path, framework="np") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape())
                      for name in f.keys()}  # noqa: SIM118 - safe_open is not iterable
        said = f"tensors {sorted(shapes)}"
    from ggmlopt.io.torch_layout import torch_tensors

    for name, (make_model, _) in MODELS.items():
        wanted = {t.name: tuple(t.shape) for t in torch_tensors(make_model(0))}
        if shapes == wanted:
            return name, said
    return None, said


def resolve_load(args, parser):
    """--load: the file exists, its format is known, and --model is the file's
    model (taken from the file when not given)."""
    path = args.load
    if not os.path.isfile(path):
        parser.error(f"--load: no such file {path}")
    fmt = SAVE_FORMATS.get(_suffix(path))
    if fmt is None:
        parser.error(f"--load: expected a FILE.gguf or FILE.safetensors, got {path}")
    missing = _missing(*fmt, f"--load {path}")
    if missing:
        parser.error(missing)
    try:
        found, said = model_in_file(path)
    except Exception as e:  # noqa: BLE001 - any reader's complaint about a bad file
        parser.error(f"--load: cannot read {path}: {e}")
    if found is None:
        model = args.model or "fc"
        if args.model is None:
            parser.error(f"--load: {path} holds neither ggml's mnist-fc nor mnist-cnn "
                         f"({said}); pass --model fc or --model cnn to say which it is")
    elif args.model is not None and args.model != found:
        parser.error(f"--load: {path} holds {GGML_ARCHS[found]} ({said}), not "
                     f"{GGML_ARCHS[args.model]}: pass --model {found} or leave --model out")
    else:
        model = found
    args.model = model


def load_model(model, path, model_name):
    """Load the GGUF (ggml's mnist-fc / mnist-cnn layout, or save_gguf's) or the
    safetensors file (torch's layout) at path into model."""
    from ggmlopt.io import load_gguf, load_safetensors

    if _suffix(path) == ".gguf":
        load_gguf(path, model)
    else:
        load_safetensors(path, model)
    print(f"mnist: loaded {GGML_ARCHS[model_name]} weights from {path}; not training")


def save_outputs(model, history, args):
    """--save: the trained model as ggml's GGUF or as safetensors (torch's
    layout); --plot: the learning curves."""
    if args.save:
        from ggmlopt.io import save_gguf, save_safetensors

        arch = GGML_ARCHS[args.model]
        if _suffix(args.save) == ".gguf":
            save_gguf(model, args.save, arch=arch,
                      dtype=np.float16 if args.save_f16 else np.float32)
        else:
            save_safetensors(model, args.save)
        print(f"mnist: saved the model to {args.save} ({arch}, "
              f"{'float16' if args.save_f16 else 'float32'} weights)")
    if args.plot:
        history.plot(args.plot)
        print(f"mnist: wrote the training curves to {args.plot}")
VAL_SPLIT = 0.05  # ggml's: the last 5% of the training data validates


def _trains(ndata, nbatch_logical):
    """Whether the validation split leaves a logical batch to train (as fit rounds)."""
    nbatches = ndata // nbatch_logical
    return int(np.float32(np.float32(1) - np.float32(VAL_SPLIT)) * np.float32(nbatches)) >= 1


def _fits(ndata, shard, nranks, logical, physical):
    """Whether fit takes these batch sizes on nranks ranks: whole logical batches,
    whole physical batches of whole shards, the same number on every rank."""
    return (logical % (nranks * physical) == 0 and physical % shard == 0
            and ndata % logical == 0 and _trains(ndata, logical))


def _largest_physical(ndata, shard, nranks, logical, at_most):
    """The largest physical batch <= at_most that fits logical, else None."""
    fits = [p for p in range(shard, min(at_most, logical) + 1, shard)
            if _fits(ndata, shard, nranks, logical, p)]
    return max(fits) if fits else None


def valid_logical_batches(ndata, shard, nranks, physical=None):
    """Every nbatch_logical fit takes on nranks ranks (with this nbatch_physical,
    or with some physical batch when None), ascending."""
    step = nranks * (physical or shard)
    return [n for n in range(step, ndata + 1, step)
            if _fits(ndata, shard, nranks, n, physical or shard)]


def _listed(values, near):
    """At most 12 of values, those nearest to near, as text."""
    shown = sorted(sorted(values, key=lambda v: abs(np.log(v / near)))[:12])
    more = ", ..." if len(shown) < len(values) else ""
    return ", ".join(map(str, shown)) + more


def _other_ranks(ndata, shard, physical):
    ok = [n for n in range(1, 65) if valid_logical_batches(ndata, shard, n, physical)]
    return f"run on {_listed(ok, 1)} processes instead" if ok else "change the batch sizes"


def choose_batches(ndata, shard, nranks, default, logical=None, physical=None):
    """(nbatch_logical, nbatch_physical, a note or "") for fit on nranks ranks.

    default: the (logical, physical) batch sizes of one process; logical and
    physical: what --nbatch-logical / --nbatch-physical asked for (None: free).
    A free logical batch is the one nearest to the default that splits into
    whole shards on every rank; a free physical one the largest up to the
    default that divides each rank's part.  ValueError, saying which
    --nbatch-logical values work, when none does."""
    ranks = f"{nranks} rank{'s' if nranks > 1 else ''}"
    if physical is not None and physical % shard != 0:
        raise ValueError(f"--nbatch-physical {physical} is not a whole number of shards of "
                         f"{shard} datapoints")
    what = (f"ndata={ndata} in shards of {shard} on {ranks} (each rank takes whole "
            f"physical batches of whole shards; {VAL_SPLIT} of the data validates)")
    free_logical = logical is None
    if logical is None:
        choices = valid_logical_batches(ndata, shard, nranks, physical)
        if not choices:
            raise ValueError(f"no --nbatch-logical fits {what}"
                             f"{'' if physical is None else f' with --nbatch-physical {physical}'}"
                             f"; {_other_ranks(ndata, shard, physical)}")
        logical = min(choices, key=lambda v: (abs(np.log(v / default[0])), -v))
    at_most = physical or min(default[1], logical)
    chosen = _largest_physical(ndata, shard, nranks, logical, at_most)
    if chosen is None or (physical is not None and chosen != physical):
        valid = valid_logical_batches(ndata, shard, nranks, physical)
        fix = (f"valid --nbatch-logical values: {_listed(valid, logical)}" if valid else
               f"no --nbatch-logical does; {_other_ranks(ndata, shard, physical)}")
        raise ValueError(f"--nbatch-logical {logical}"
                         f"{'' if physical is None else f' --nbatch-physical {physical}'} "
                         f"does not fit {what}; {fix}")
    note = ""
    if (free_logical and logical != default[0]) or chosen != at_most:
        was = f" (one process: {default[0]}/{default[1]})" if free_logical else ""
        note = (f"nbatch_logical={logical}, nbatch_physical={chosen}{was} so that each of "
                f"the {ranks} takes whole physical batches of whole shards")
    return logical, chosen, note


def _mpi(threads):
    """(comm, rank, nranks, threads) for --mpi; an uncaught error on one rank aborts all."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise SystemExit(f"mnist: --mpi needs mpi4py and an MPI: {install_hint('mpi')}") \
            from None
    comm = MPI.COMM_WORLD
    hook = sys.excepthook

    def abort_all(*exc_info):  # without this the other ranks would wait forever
        hook(*exc_info)
        sys.stderr.flush()
        comm.Abort(1)

    sys.excepthook = abort_all
    nthreads = go.distributed.set_rank_threads(threads, comm)
    return comm, comm.Get_rank(), comm.Get_size(), nthreads


def _at_least(minimum):
    """An argparse type: an int >= minimum (argparse's message and status 2)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    return parse


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ggmlopt.examples.mnist",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", metavar="DIR",
                        help="directory with the MNIST IDX files (train-images-idx3-ubyte, "
                             "...; .gz accepted); default: offline digits")
    parser.add_argument("--model", choices=sorted(MODELS), default=None,
                        help="ggml's mnist-fc (default) or mnist-cnn (with --load: the "
                             "file's model)")
    parser.add_argument("--epochs", type=_at_least(1), default=30, help="epochs (ggml: 30)")
    parser.add_argument("--nbatch-logical", type=_at_least(1), metavar="N",
                        help="datapoints per optimizer step (ggml: 1000; offline: scaled)")
    parser.add_argument("--nbatch-physical", type=_at_least(1), metavar="N",
                        help="datapoints per forward/backward pass (ggml: 500)")
    parser.add_argument("--seed", type=_at_least(0), default=0,
                        help="initialisation and shuffles (the test images stay the same)")
    parser.add_argument("--silent", action="store_true", help="no progress bars")
    # -- models that leave: GGUF for ggml's programs, learning curves --
    interop = parser.add_argument_group("saving, loading and plotting")
    interop.add_argument("--save", metavar="FILE.gguf",
                         help="write the trained model as GGUF, as ggml's mnist-train does "
                              "(ggml's mnist-eval loads it), or as FILE.safetensors (torch's "
                              "layout); needs ggmlopt[interop]")
    interop.add_argument("--save-f16", action="store_true",
                         help="with --save: float16 weight matrices (mnist-fc only)")
    interop.add_argument("--load", metavar="FILE.gguf",
                         help="evaluate a GGUF model (e.g. written by ggml's mnist-train) or "
                              "a .safetensors one on the test data instead of training")
    interop.add_argument("--plot", metavar="FILE.png",
                         help="write the training and validation curves; needs ggmlopt[plot]")
    parser.add_argument("--mpi", action="store_true",
                        help="data-parallel over the processes of mpiexec/srun (mpi extra)")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="with --mpi: each process keeps 1/P of AdamW's moments")
    parser.add_argument("--threads", type=_at_least(1), default=None,
                        help="kernel and BLAS threads per process (default with --mpi: "
                             "cores / processes on the machine)")
    args = parser.parse_args(argv)
    if args.shard_optimizer and not args.mpi:
        parser.error("--shard-optimizer shards over the processes of --mpi: give --mpi")
    if args.load and (args.save or args.plot):
        parser.error("--load evaluates a saved model: it trains nothing to --save or --plot")
    if args.load:
        resolve_load(args, parser)
    args.model = args.model or "fc"
    if args.save_f16 and (not args.save or args.model != "fc"):
        parser.error("--save-f16 goes with --save of mnist-fc (ggml's mnist-cnn is float32)")
    # before any rank starts work, not after 30 epochs of training
    problems = check_outputs(args)
    if problems:
        parser.error("; ".join(problems))
    comm, rank, nranks = None, 0, 1
    if args.mpi:
        comm, rank, nranks, nthreads = _mpi(args.threads)
    elif args.threads is not None:
        go.distributed.set_rank_threads(args.threads)
    say = print if rank == 0 else (lambda *a, **k: None)

    if args.data:
        from ggmlopt.datasets import load_mnist

        try:
            train, test = load_mnist(args.data, ndata_shard=10)
        except (OSError, ValueError, TypeError) as e:
            parser.error(f"--data: {e}")
        if train.data.shape[1] != NE_IN:
            parser.error(f"--data: its images have {train.data.shape[1]} pixels; ggml's "
                         f"MNIST models read 28x28 ({NE_IN})")
        name, nbatch_logical, nbatch_physical = f"MNIST from {args.data}", 1000, 500
    else:
        try:
            train, test = digits_as_mnist(SPLIT_SEED)
            name = "scikit-learn's 8x8 digits upsampled to 28x28 (offline)"
        except ImportError:
            train, test = synthetic(SPLIT_SEED)
            name = ("SYNTHETIC data (noisy random prototypes; scikit-learn is not installed: "
                    f"{install_hint('examples')} for real digits)")
        nbatch_logical, nbatch_physical = OFFLINE_BATCHES[args.model]
    # every rank computes the same answer: all go on, or all stop before any work
    try:
        if args.load:  # nothing trains: the physical batch only bounds evaluate's
            nbatch_logical = args.nbatch_logical or nbatch_logical
            nbatch_physical = args.nbatch_physical or nbatch_physical
            note = ""
        else:
            nbatch_logical, nbatch_physical, note = choose_batches(
                train.ndata, train.ndata_shard, nranks, (nbatch_logical, nbatch_physical),
                args.nbatch_logical, args.nbatch_physical)
    except ValueError as e:
        if rank == 0:
            parser.error(str(e))
        raise SystemExit(2) from None
    if note:
        say(f"mnist: {note}")
    if comm is not None:
        say(f"mnist: {nranks} processes x {nthreads} threads, each evaluating "
            f"{nbatch_logical // nranks} datapoints per step; gradients exchanged once per "
            f"step{' (optimizer state sharded)' if args.shard_optimizer else ''}")
    say(f"mnist: dataset: {name}: {train.ndata} training, {test.ndata} test images")
    make_model, description = MODELS[args.model]
    say(f"mnist: model: {description}, AdamW, "
          f"nbatch_logical={nbatch_logical}, nbatch_physical={nbatch_physical}, "
          f"{args.epochs} epochs, val_split={VAL_SPLIT}")
    sys.stdout.flush()

    model = make_model(args.seed)
    if args.load:
        load_model(model, args.load, args.model)
    else:
        mpi = {} if comm is None else {"comm": comm, "shard_optimizer": args.shard_optimizer}
        try:
            history = go.fit(model, train, go.LossType.CROSS_ENTROPY,
                             go.default_optimizer_params, nepoch=args.epochs,
                             nbatch_logical=nbatch_logical, nbatch_physical=nbatch_physical,
                             val_split=VAL_SPLIT, silent=args.silent, seed=args.seed, **mpi)
        except KeyboardInterrupt:
            print("mnist: interrupted", file=sys.stderr)
            if comm is not None and nranks > 1:
                sys.stderr.flush()
                comm.Abort(130)   # the others wait for this rank in a collective
            raise SystemExit(130) from None
        if rank == 0:
            save_outputs(model, history, args)

    result = evaluate(model, test, nbatch_physical)
    loss, loss_unc = result.loss()
    acc, acc_unc = result.accuracy()
    say(f"mnist: test_loss={loss:.6f}+-{loss_unc:.6f}")  # every rank has the same model
    say(f"mnist: test_acc={100 * acc:.2f}+-{100 * acc_unc:.2f}%")
    return loss, acc


if __name__ == "__main__":
    main()
