"""Fused causal attention, forward + backward, against torch's
scaled_dot_product_attention (is_causal=True) forward + backward, 2 threads
each: B=8, H=8, head_dim=64 at T=256 (target: <= 0.8x torch) and T=1024, where
the peak memory of each side is measured too (in a fresh process, the growth
of the resident set over the inputs: ggmlopt's must stay O(T) per head, far
below one T x T matrix per head).

Both sides compute the same thing: q, k, v in ggmlopt's token-major layout
(batch, T, heads, head_dim), torch's as (batch, heads, T, head_dim) views of
the same memory (a transpose, no copy), gradients of out . dout.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import measure

from ggmlopt import kernels_attention as ka

B, H, D = 8, 8, 64
TARGET = 0.8
THREADS = 2


def inputs(t):
    rng = np.random.default_rng(t)
    return [rng.standard_normal((B, t, H, D), dtype=np.float32) for _ in range(4)]


def ggmlopt_step(t):
    q, k, v, dout = inputs(t)
    out, lse = np.empty_like(q), np.empty((B, H, t), np.float32)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)

    def run():
        ka.attention_forward(q, k, v, out, lse)
        ka.attention_backward(q, k, v, out, lse, dout, dq, dk, dv)
    return run, (out, dq, dk, dv)


def torch_step(t):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    q, k, v, dout = (torch.from_numpy(a).transpose(1, 2) for a in inputs(t))
    q, k, v = (a.requires_grad_() for a in (q, k, v))
    result = {}

    def run():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(dout)
        result["out"], result["grads"] = o.detach(), (q.grad, k.grad, v.grad)
        q.grad = k.grad = v.grad = None
    return run, result


def case_name(t):
    return f"causal attention fwd+bwd B={B} H={H} T={t} head_dim={D}, {THREADS} threads"


@pytest.mark.parametrize("t", [256, 1024])
def test_ggmlopt(benchmark, threads, t):
    threads(THREADS)
    run, (out, dq, dk, dv) = ggmlopt_step(t)
    # a guard against timing the wrong thing: the same numbers as torch
    trun, result = torch_step(t)
    run()
    trun()
    for got, want in zip((out, dq, dk, dv), (result["out"], *result["grads"])):
        want = want.transpose(1, 2).numpy()
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    info = {"peak_mib": peak_mib("ggmlopt", t)} if t == 1024 else {}
    benchmark.extra_info.update(info)
    measure(benchmark, run, case=case_name(t), role="ggmlopt",
            label="ggmlopt attention_forward + attention_backward"
            + (f" (peak +{info['peak_mib']:.0f} MiB)" if info else ""))


@pytest.mark.parametrize("t", [256, 1024])
def test_torch(benchmark, threads, t):
    threads(THREADS)
    import torch

    run, _ = torch_step(t)
    info = {"peak_mib": peak_mib("torch", t)} if t == 1024 else {}
    benchmark.extra_info.update(info)
    capability = torch.backends.cpu.get_cpu_capability()
    measure(benchmark, run, case=case_name(t), role="baseline",
            label=f"torch sdpa fwd+bwd ({capability})"
            + (f" (peak +{info['peak_mib']:.0f} MiB)" if info else ""),
            target=TARGET if t == 256 else None)


def test_memory_is_linear_in_t():
    """ggmlopt's peak growth at T=2048 is about twice that at T=1024 (inputs,
    outputs and lse are all O(T)); one T x T float matrix per head would be 256
    MiB at T=1024 and four times that at 2048."""
    small, large = peak_mib("ggmlopt", 1024), peak_mib("ggmlopt", 2048)
    tt_matrix = B * H * 1024 * 1024 * 4 / 2**20
    assert small < tt_matrix / 2, (small, tt_matrix)
    assert large < 2.5 * small, (small, large)


_PEAK_SCRIPT = r"""
import json, sys
import numpy as np
sys.path.insert(0, {bench!r})
import test_bench_attention as tb
side, t = sys.argv[1], int(sys.argv[2])
if side == "torch":
    import torch
    torch.set_num_threads(2)
    run, _ = tb.torch_step(t)
else:
    from ggmlopt import kernels
    kernels.set_num_threads(2)
    run = None
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
if side != "torch":
    q, k, v, dout = tb.inputs(t)
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) restarts from here
    f.write("5")
if side == "torch":
    run()
else:
    out, lse = tb.ka.attention_forward(q, k, v)
    tb.ka.attention_backward(q, k, v, out, lse, dout)
print(json.dumps((status("VmHWM") - before) / 2**20))
"""


def peak_mib(side, t):
    """The growth of the peak resident set (MiB) over one forward + backward at
    T, inputs already in memory, outputs and gradients included, in a fresh
    process: the peak (VmHWM) is reset just before (Linux's clear_refs)."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("measuring the peak memory needs Linux's /proc/self/clear_refs")
    script = _PEAK_SCRIPT.format(bench=os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script, side, str(t)], check=True,
                          capture_output=True, text=True, timeout=600)
    return json.loads(proc.stdout.strip().splitlines()[-1])
