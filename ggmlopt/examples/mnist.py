"""Train ggml's mnist-fc model and print the test loss and accuracy.

    python -m ggmlopt.examples.mnist                 # offline, no download
    python -m ggmlopt.examples.mnist --data DIR      # MNIST IDX files in DIR
    mpiexec -n 2 python -m ggmlopt.examples.mnist --mpi   # data-parallel on 2 processes

The model and settings are those of ggml's examples/mnist (mnist-fc): 784-500-10
with ReLU, cross-entropy, AdamW with ggml's defaults, 30 epochs, logical
batches of 1000 in physical batches of 500, shards of 10 datapoints, 5% of the
training data for validation.

Offline it trains on scikit-learn's bundled 8x8 handwritten digits (the
``examples`` extra: ``pip install ggmlopt[examples]``), each digit upsampled
3x to 24x24 and centred in 28x28 like MNIST, with the batch sizes scaled down
to fit 1500 training images; without scikit-learn it falls back to a synthetic
10-class dataset and says so.

With ``--mpi`` (the ``mpi`` extra: ``pip install ggmlopt[mpi]``) every process
started by mpiexec or srun trains its part of each logical batch
(ggmlopt.distributed); each uses cores / processes-per-machine threads unless
``--threads`` says otherwise, and only rank 0 prints.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

import ggmlopt as go

NE_IN, NE_HIDDEN, NCLASSES = 28 * 28, 500, 10


def mnist_fc(seed=None):
    """ggml's mnist-fc: 784-500-10 with ReLU."""
    rng = np.random.default_rng(seed)
    return go.nn.Sequential(go.nn.Linear(NE_IN, NE_HIDDEN, rng=rng), go.nn.ReLU(),
                            go.nn.Linear(NE_HIDDEN, NCLASSES, rng=rng))


def _onehot(labels):
    y = np.zeros((labels.size, NCLASSES), np.float32)
    y[np.arange(labels.size), labels] = 1.0
    return y


def digits_as_mnist(seed):
    """scikit-learn's 1797 8x8 digits as 28x28 uint8 images (values 0..16, scale
    1/16), shuffled with seed: 1500 for training, 297 for testing."""
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


def synthetic(seed):
    """10 classes of noisy random 784-pixel prototypes: 2000 training, 500 test."""
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
                        loss_type=go.LossType.CROSS_ENTROPY, build_type=go.BuildType.FORWARD)
    result = go.Result()
    go.epoch(ctx, dataset, None, result, 0)
    return result


def _physical_batch(nbatch_logical, nbatch_physical, nranks, shard):
    """nbatch_physical, or the largest batch below it (a multiple of the shard size)
    that splits a logical batch evenly over nranks; fit explains when none does."""
    if nbatch_logical % (nranks * nbatch_physical) == 0 or nbatch_logical % nranks != 0:
        return nbatch_physical
    per_rank = nbatch_logical // nranks
    fits = [b for b in range(shard, nbatch_physical + 1, shard) if per_rank % b == 0]
    return max(fits) if fits else nbatch_physical


def _mpi(threads):
    """(comm, rank, nranks, threads) for --mpi; an uncaught error on one rank aborts all."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise SystemExit("mnist: --mpi needs mpi4py and an MPI: pip install ggmlopt[mpi]") \
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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ggmlopt.examples.mnist",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", metavar="DIR",
                        help="directory with the MNIST IDX files (train-images-idx3-ubyte, "
                             "...; .gz accepted); default: offline digits")
    parser.add_argument("--epochs", type=int, default=30, help="epochs (ggml: 30)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and shuffles")
    parser.add_argument("--silent", action="store_true", help="no progress bars")
    parser.add_argument("--mpi", action="store_true",
                        help="data-parallel over the processes of mpiexec/srun (mpi extra)")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="with --mpi: each process keeps 1/P of AdamW's moments")
    parser.add_argument("--threads", type=int, default=None,
                        help="kernel and BLAS threads per process (default with --mpi: "
                             "cores / processes on the machine)")
    args = parser.parse_args(argv)
    comm, rank, nranks = None, 0, 1
    if args.mpi:
        comm, rank, nranks, nthreads = _mpi(args.threads)
    elif args.threads is not None:
        go.distributed.set_rank_threads(args.threads)
    say = print if rank == 0 else (lambda *a, **k: None)

    if args.data:
        from ggmlopt.datasets import load_mnist

        train, test = load_mnist(args.data, ndata_shard=10)
        name, nbatch_logical, nbatch_physical = f"MNIST from {args.data}", 1000, 500
    else:
        try:
            train, test = digits_as_mnist(args.seed)
            name = "scikit-learn's 8x8 digits upsampled to 28x28 (offline)"
        except ImportError:
            train, test = synthetic(args.seed)
            name = ("SYNTHETIC data (noisy random prototypes; scikit-learn is not installed: "
                    "pip install ggmlopt[examples] for real digits)")
        # ggml's 1000/500 scaled to the small training set
        nbatch_logical, nbatch_physical = 100, 50
    nbatch_physical = _physical_batch(nbatch_logical, nbatch_physical, nranks,
                                      train.ndata_shard)
    if comm is not None:
        say(f"mnist: {nranks} processes x {nthreads} threads, each evaluating "
            f"{nbatch_logical // nranks} datapoints per step; gradients exchanged once per "
            f"step{' (optimizer state sharded)' if args.shard_optimizer else ''}")
    say(f"mnist: dataset: {name}: {train.ndata} training, {test.ndata} test images")
    say(f"mnist: model: mnist-fc {NE_IN}-{NE_HIDDEN}-{NCLASSES}, AdamW, "
          f"nbatch_logical={nbatch_logical}, nbatch_physical={nbatch_physical}, "
          f"{args.epochs} epochs, val_split=0.05")
    sys.stdout.flush()

    model = mnist_fc(args.seed)
    mpi = {} if comm is None else {"comm": comm, "shard_optimizer": args.shard_optimizer}
    go.fit(model, train, go.LossType.CROSS_ENTROPY, go.default_optimizer_params,
           nepoch=args.epochs, nbatch_logical=nbatch_logical, nbatch_physical=nbatch_physical,
           val_split=0.05, silent=args.silent, seed=args.seed, **mpi)

    result = evaluate(model, test, nbatch_physical)
    loss, loss_unc = result.loss()
    acc, acc_unc = result.accuracy()
    say(f"mnist: test_loss={loss:.6f}+-{loss_unc:.6f}")  # every rank has the same model
    say(f"mnist: test_acc={100 * acc:.2f}+-{100 * acc_unc:.2f}%")
    return loss, acc


if __name__ == "__main__":
    main()
