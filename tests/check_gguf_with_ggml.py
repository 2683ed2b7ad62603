"""Check ggmlopt's GGUF files against ggml's own mnist-eval (not part of the test
suite: it needs a ggml build).

    cmake -S ggml -B build -DGGML_BUILD_EXAMPLES=ON && cmake --build build -t mnist-eval
    python tests/check_gguf_with_ggml.py --mnist-eval build/bin/mnist-eval --workdir /tmp/chk \\
        [--ggml-file model.gguf ...]       # e.g. files written by ggml's mnist-train

It writes MNIST-format IDX files made from scikit-learn's 8x8 digits (upsampled
3x into 28x28, pixels 0..255; 10000 test images, as mnist-eval reads exactly
that many), trains mnist-fc and mnist-cnn briefly with ggmlopt, saves them with
save_gguf (mnist-fc also in float16), and evaluates every file with mnist-eval
and with ggmlopt (load_gguf, ggml's pixel scale 1/255).  The test accuracies
must agree exactly and the losses to 1e-3 relative; --ggml-file adds files
written elsewhere (their architecture picks the model).  Exit status 1 on any
disagreement.
"""
from __future__ import annotations

import argparse
import os
import re
import struct
import subprocess
import sys

import numpy as np

import ggmlopt as go
from ggmlopt.datasets import load_idx
from ggmlopt.io import load_gguf, save_gguf

NTEST, NTRAIN = 10000, 1500


def write_idx(workdir):
    from sklearn.datasets import load_digits

    digits = load_digits()
    img = (digits.images * 255 / 16).round().astype(np.uint8)
    big = np.zeros((img.shape[0], 28, 28), np.uint8)
    big[:, 2:26, 2:26] = img.repeat(3, 1).repeat(3, 2)
    order = np.random.default_rng(0).permutation(len(big))
    big, labels = big[order], digits.target[order].astype(np.uint8)
    test = np.arange(NTEST) % (len(big) - NTRAIN) + NTRAIN  # the held-out digits, tiled
    for name, magic, array in (("t10k-images-idx3-ubyte", 0x803, big[test]),
                               ("t10k-labels-idx1-ubyte", 0x801, labels[test])):
        with open(os.path.join(workdir, name), "wb") as f:
            f.write(struct.pack(">II", magic, len(array)))
            if array.ndim == 3:
                f.write(struct.pack(">II", 28, 28))
            f.write(array.tobytes())
    return big[:NTRAIN].reshape(NTRAIN, 784), labels[:NTRAIN]


def models():
    from ggmlopt.examples import mnist

    cnn = getattr(mnist, "mnist_cnn", None)
    if cnn is None:  # before the example has its cnn: the tests' builder
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from mnist_models import mnist_cnn as cnn
    return {"mnist-fc": mnist.mnist_fc, "mnist-cnn": cnn}


def onehot(labels):
    return np.eye(10, dtype=np.float32)[labels]


def ggmlopt_eval(path, arch, workdir):
    model = models()[arch](0)
    load_gguf(path, model, arch=arch)
    x = load_idx(os.path.join(workdir, "t10k-images-idx3-ubyte")).reshape(NTEST, 784)
    y = load_idx(os.path.join(workdir, "t10k-labels-idx1-ubyte"))
    ds = go.Dataset.from_arrays(x, onehot(y), data_scale=1 / 255)
    ctx = go.OptContext(model, batch_size=500, ne_datapoint=784,
                        loss_type=go.LossType.CROSS_ENTROPY, build_type=go.BuildType.FORWARD)
    result = go.Result()
    go.epoch(ctx, ds, None, result, 0)
    return result.loss()[0], result.accuracy()[0]


def ggml_eval(mnist_eval, path, workdir):
    out = subprocess.run([mnist_eval, path, os.path.join(workdir, "t10k-images-idx3-ubyte"),
                          os.path.join(workdir, "t10k-labels-idx1-ubyte")],
                         capture_output=True, text=True, errors="replace", check=False)
    loss = re.search(r"test_loss=([0-9.]+)", out.stdout)
    acc = re.search(r"test_acc=([0-9.]+)", out.stdout)
    if out.returncode != 0 or not loss or not acc:
        raise RuntimeError(f"mnist-eval failed on {path}:\n{out.stderr[-2000:]}")
    return float(loss.group(1)), float(acc.group(1)) / 100


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mnist-eval", required=True, help="ggml's mnist-eval executable")
    parser.add_argument("--workdir", required=True, help="directory for IDX and GGUF files")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ggml-file", action="append", default=[],
                        help="a GGUF written elsewhere (mnist-fc or mnist-cnn)")
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    x, y = write_idx(args.workdir)
    train = go.Dataset.from_arrays(x, onehot(y), ndata_shard=10, data_scale=1 / 255)

    files = []
    for arch, make in models().items():
        model = make(1)
        go.fit(model, train, go.LossType.CROSS_ENTROPY, nepoch=args.epochs, nbatch_logical=100,
               nbatch_physical=50, val_split=0.05, silent=True, seed=1)
        path = os.path.join(args.workdir, f"ggmlopt-{arch}-f32.gguf")
        save_gguf(model, path, arch=arch)
        files.append((path, arch))
        if arch == "mnist-fc":
            path16 = os.path.join(args.workdir, f"ggmlopt-{arch}-f16.gguf")
            save_gguf(model, path16, arch=arch, dtype=np.float16)
            files.append((path16, arch))
    for path in args.ggml_file:
        import gguf

        files.append((path, gguf.GGUFReader(path).fields["general.architecture"].contents()))

    ok = True
    print(f"{'file':44s} {'mnist-eval loss/acc':>24s} {'ggmlopt loss/acc':>24s}")
    for path, arch in files:
        gl, ga = ggml_eval(args.mnist_eval, path, args.workdir)
        ol, oa = ggmlopt_eval(path, arch, args.workdir)
        same = round(100 * ga, 2) == round(100 * oa, 2) and abs(gl - ol) <= 1e-3 * max(gl, 1e-3)
        ok &= same
        print(f"{os.path.basename(path):44s} {gl:12.6f} {100 * ga:9.2f}% {ol:12.6f} "
              f"{100 * oa:9.2f}%  {'ok' if same else 'DIFFERENT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
