"""One epoch of ggml's mnist-fc setup (784-500-10, ReLU, cross-entropy, AdamW
defaults, nbatch_logical 1000, nbatch_physical 500) on 60,000 synthetic
datapoints: ggmlopt against a hand-written NumPy loop doing the same arithmetic
and against PyTorch (2 threads, fused AdamW).

Run: python -m pytest -q -s bench/test_bench_training.py
Figures are printed (and recorded by hand in bench/README.md); the
targets are asserted only with GGMLOPT_BENCH_STRICT=1, since a shared 2-core
machine moves timings by tens of percent.
"""
import os
import time

import numpy as np
import pytest

import ggmlopt as go

NDATA = 60_000
NE_IN, NE_HIDDEN, NE_OUT = 784, 500, 10
NBATCH_LOGICAL, NBATCH_PHYSICAL = 1000, 500
REPEATS = int(os.environ.get("GGMLOPT_BENCH_REPEATS", "3"))
STRICT = os.environ.get("GGMLOPT_BENCH_STRICT") == "1"


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.random((NDATA, NE_IN), dtype=np.float32)
    y = np.zeros((NDATA, NE_OUT), np.float32)
    y[np.arange(NDATA), rng.integers(0, NE_OUT, NDATA)] = 1
    return x, y


def _best(f, repeats=REPEATS):
    """Best wall time of repeats runs (after one warm-up run)."""
    f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def _model(seed=1):
    return go.nn.Sequential(go.nn.Linear(NE_IN, NE_HIDDEN, rng=seed), go.nn.ReLU(),
                            go.nn.Linear(NE_HIDDEN, NE_OUT, rng=seed + 1))


def ggmlopt_epoch(x, y, precision="f32"):
    ds = go.Dataset.from_arrays(x, y, ndata_shard=10)
    model = _model()
    ctx = go.OptContext(model, batch_size=NBATCH_PHYSICAL, ne_datapoint=NE_IN,
                        loss_type=go.LossType.CROSS_ENTROPY,
                        opt_period=NBATCH_LOGICAL // NBATCH_PHYSICAL, precision=precision)
    result = go.Result()

    def run():
        result.reset()
        go.epoch(ctx, ds, result, None)

    return run


def numpy_epoch(x, y):
    """The same arithmetic by hand: forward, softmax cross-entropy, backward,
    gradient accumulation over two physical batches, AdamW, in NumPy."""
    rng = np.random.default_rng(1)
    b1 = 1 / np.sqrt(NE_IN)
    b2 = 1 / np.sqrt(NE_HIDDEN)
    params = [rng.uniform(-b1, b1, (NE_IN, NE_HIDDEN)).astype(np.float32),
              rng.uniform(-b1, b1, NE_HIDDEN).astype(np.float32),
              rng.uniform(-b2, b2, (NE_HIDDEN, NE_OUT)).astype(np.float32),
              rng.uniform(-b2, b2, NE_OUT).astype(np.float32)]
    grads = [np.zeros_like(p) for p in params]
    accs = [np.zeros_like(p) for p in params]
    ms = [np.zeros_like(p) for p in params]
    vs = [np.zeros_like(p) for p in params]
    B = NBATCH_PHYSICAL
    xb = np.empty((B, NE_IN), np.float32)
    yb = np.empty((B, NE_OUT), np.float32)
    h = np.empty((B, NE_HIDDEN), np.float32)
    mask = np.empty((B, NE_HIDDEN), bool)
    ones = np.ones(B, np.float32)
    gh = np.empty((B, NE_HIDDEN), np.float32)
    out = np.empty((B, NE_OUT), np.float32)
    tmp = [np.empty_like(p) for p in params]
    perm = np.arange(NDATA)
    state = {"t": 1}
    alpha, beta1, beta2, eps = 1e-3, 0.9, 0.999, 1e-8

    def run():
        period = NBATCH_LOGICAL // B
        for ib in range(NDATA // B):
            idx = perm[ib * B:(ib + 1) * B]
            np.take(x, idx, axis=0, out=xb)
            np.take(y, idx, axis=0, out=yb)
            w1, c1, w2, c2 = params
            np.matmul(xb, w1, out=h)
            np.add(h, c1, out=h)
            np.maximum(h, 0, out=h)
            np.greater(h, 0, out=mask)
            np.matmul(h, w2, out=out)
            np.add(out, c2, out=out)
            np.subtract(out, out.max(axis=1, keepdims=True), out=out)
            np.exp(out, out=out)
            np.divide(out, out.sum(axis=1, keepdims=True), out=out)
            np.subtract(out, yb, out=out)
            np.multiply(out, 1.0 / (B * period), out=out)  # d loss / d logits
            np.matmul(h.T, out, out=grads[2])
            np.matmul(ones, out, out=grads[3])
            np.matmul(out, w2.T, out=gh)
            np.multiply(gh, mask, out=gh)
            np.matmul(xb.T, gh, out=grads[0])
            np.matmul(ones, gh, out=grads[1])
            for a, g in zip(accs, grads):
                a += g
            if (ib + 1) % period == 0:
                t = state["t"]
                b1h = 1 / (1 - beta1 ** t)
                b2h = 1 / (1 - beta2 ** t)
                for p, a, m, v, s in zip(params, accs, ms, vs, tmp):
                    m *= beta1
                    m += (1 - beta1) * a
                    v *= beta2
                    np.multiply(a, a, out=s)
                    s *= 1 - beta2
                    v += s
                    np.multiply(v, b2h, out=s)
                    np.sqrt(s, out=s)
                    s += eps
                    np.divide(m, s, out=s)
                    s *= alpha * b1h
                    p -= s
                    a[...] = 0
                state["t"] = t + 1

    return run


def torch_epoch(x, y):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(2)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(NE_IN, NE_HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(NE_HIDDEN, NE_OUT))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0, fused=True)
    xt = torch.from_numpy(x)
    yt = torch.from_numpy(y)
    loss_fn = torch.nn.CrossEntropyLoss()
    B = NBATCH_PHYSICAL
    period = NBATCH_LOGICAL // B

    def run():
        opt.zero_grad(set_to_none=True)
        for ib in range(NDATA // B):
            loss = loss_fn(model(xt[ib * B:(ib + 1) * B]), yt[ib * B:(ib + 1) * B]) / period
            loss.backward()
            if (ib + 1) % period == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)

    return run


def overhead_per_batch():
    """Time per physical batch of a model with one-element layers and batch 1:
    what the Python orchestration (alloc, eval, loss, result, get_batch, the
    layer calls) costs when BLAS and the kernels have nothing to do."""
    n = 2000
    rng = np.random.default_rng(0)
    x = rng.random((n, 1), dtype=np.float32)
    y = np.zeros((n, 2), np.float32)
    y[:, 0] = 1
    ds = go.Dataset.from_arrays(x, y)
    model = go.nn.Sequential(go.nn.Linear(1, 1, rng=0), go.nn.ReLU(), go.nn.Linear(1, 2, rng=1))
    ctx = go.OptContext(model, batch_size=1, ne_datapoint=1,
                        loss_type=go.LossType.CROSS_ENTROPY, opt_period=2)
    result = go.Result()

    def run():
        result.reset()
        go.epoch(ctx, ds, result, None)

    return _best(run) / n


# the pause before each timed run: OpenBLAS's threads spin for about 0.1 s after
# their last product and take a core from whichever side runs next
SETTLE_S = 0.25


def _interleaved(runners, repeats=REPEATS):
    """Best time of each runner over rounds that run them one after the other, so
    a change in machine load hits all of them alike, each after SETTLE_S of quiet."""
    for run in runners.values():
        run()  # warm-up
    best = dict.fromkeys(runners, float("inf"))
    for _ in range(repeats):
        for name, run in runners.items():
            time.sleep(SETTLE_S)
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def test_bench_mnist_fc_epoch(data):
    x, y = data
    runners = {"ggmlopt": ggmlopt_epoch(x, y), "numpy": numpy_epoch(x, y)}
    if go.gemm.bf16_support()[0]:   # precision="bf16" beside, where the CPU has bf16 products
        runners["ggmlopt bf16"] = ggmlopt_epoch(x, y, "bf16")
    try:
        runners["torch"] = torch_epoch(x, y)
    except pytest.skip.Exception:
        pass
    best = _interleaved(runners)
    t_go, t_np, t_torch = best["ggmlopt"], best["numpy"], best.get("torch")
    nbatches = NDATA // NBATCH_PHYSICAL
    lines = [f"ggmlopt epoch: {t_go:.3f} s ({t_go / nbatches * 1e3:.2f} ms per physical batch)",
             f"numpy loop:    {t_np:.3f} s  ggmlopt/numpy = {t_go / t_np:.2f}"]
    if t_torch is not None:
        lines.append(f"torch (2 threads, fused AdamW): {t_torch:.3f} s  "
                     f"ggmlopt/torch = {t_go / t_torch:.2f}")
    else:
        lines.append("torch: not installed")
    if "ggmlopt bf16" in best:
        t16 = best["ggmlopt bf16"]
        lines.append(f"ggmlopt bf16:  {t16:.3f} s  bf16/f32 = {t16 / t_go:.2f}"
                     + (f"  bf16/torch = {t16 / t_torch:.2f}" if t_torch else ""))
    ovh = overhead_per_batch()
    lines.append(f"orchestration overhead: {ovh * 1e6:.1f} us per physical batch")
    print("\n" + "\n".join(lines))
    if STRICT:
        assert t_go <= 1.15 * t_np
        if t_torch is not None:
            assert t_go <= 0.85 * t_torch
        assert ovh < 50e-6
