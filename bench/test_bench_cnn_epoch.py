"""One epoch of ggml's mnist-cnn (conv 3x3 8 ch pad 1, ReLU, max-pool 2; conv 3x3
16 ch pad 1, ReLU, max-pool 2; dense 784 -> 10; cross-entropy; AdamW;
nbatch_logical 1000 in physical batches of 500) on 60,000 synthetic datapoints:
ggmlopt (ggmlopt.examples.mnist.mnist_cnn through fit) against PyTorch with the
same architecture and fused AdamW, both on 2 threads, in interleaved rounds.

Run: python -m pytest -q -s bench/test_bench_cnn_epoch.py
The medians and their ratio are printed (and recorded by hand in
bench/README.md); the issue's target (ggmlopt <= 0.8x torch) is asserted only
with GGMLOPT_BENCH_STRICT=1, since a shared 2-core machine moves timings by tens
of percent.  GGMLOPT_BENCH_REPEATS sets the rounds (default 3).
"""
import os
import time

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.examples.mnist import mnist_cnn

NDATA = 60_000
HW = 28
NCLASSES = 10
NBATCH_LOGICAL, NBATCH_PHYSICAL = 1000, 500
THREADS = 2
TARGET = 0.8
REPEATS = int(os.environ.get("GGMLOPT_BENCH_REPEATS", "3"))
STRICT = os.environ.get("GGMLOPT_BENCH_STRICT") == "1"


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (NDATA, HW * HW), dtype=np.uint8)
    labels = rng.integers(0, NCLASSES, NDATA)
    return x, labels


def ggmlopt_epoch(x, labels):
    go.set_num_threads(THREADS)
    ds = go.Dataset.from_arrays(x, labels, ndata_shard=10, data_scale=1 / 255)

    def run():
        model = mnist_cnn(0)
        go.fit(model, ds, go.LossType.CROSS_ENTROPY, nepoch=1, nbatch_logical=NBATCH_LOGICAL,
               nbatch_physical=NBATCH_PHYSICAL, silent=True, seed=0)

    return run


def torch_epoch(x, labels):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    nn = torch.nn

    def model():
        return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(16 * 7 * 7, NCLASSES))

    xt = torch.from_numpy(x.astype(np.float32) / 255).reshape(NDATA, 1, HW, HW)
    yt = torch.from_numpy(labels)
    period = NBATCH_LOGICAL // NBATCH_PHYSICAL

    def run():
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
        perm = torch.randperm(NDATA)
        opt.zero_grad(set_to_none=True)
        for ib in range(NDATA // NBATCH_PHYSICAL):
            idx = perm[ib * NBATCH_PHYSICAL:(ib + 1) * NBATCH_PHYSICAL]
            loss = nn.functional.cross_entropy(m(xt[idx]), yt[idx]) / period
            loss.backward()
            if (ib + 1) % period == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)

    return run


def _interleaved(runners, repeats=REPEATS):
    """Median time of each runner over rounds that run them one after the other,
    so a change in machine load hits all of them alike."""
    for run in runners.values():
        run()  # warm-up
    times = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def test_bench_mnist_cnn_epoch(data):
    x, labels = data
    runners = {"ggmlopt": ggmlopt_epoch(x, labels)}
    try:
        runners["torch"] = torch_epoch(x, labels)
    except pytest.skip.Exception:
        pass
    med = _interleaved(runners)
    t_go, t_torch = med["ggmlopt"], med.get("torch")
    nbatches = NDATA // NBATCH_PHYSICAL
    per_batch = t_go / nbatches * 1e3
    head = f"ggmlopt mnist-cnn epoch: {t_go:.3f} s ({per_batch:.2f} ms per physical batch)"
    lines = [head]
    if t_torch is not None:
        lines.append(f"torch ({THREADS} threads, fused AdamW): {t_torch:.3f} s  "
                     f"ggmlopt/torch = {t_go / t_torch:.2f} (target <= {TARGET})")
    else:
        lines.append("torch: not installed")
    print("\n" + "\n".join(lines))
    assert t_go > 0
    if STRICT and t_torch is not None:
        assert t_go <= TARGET * t_torch
