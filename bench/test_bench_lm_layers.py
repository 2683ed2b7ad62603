"""Language-model layers, forward + backward at (8, 256, dim) for dim 288 and
768 (llama2.c's stories15M width and its MLP's hidden width), on 2 threads,
against torch's modules and autograd on 2 threads.

One step = the layer's forward, then its backward (input and parameter
gradients).  ggmlopt runs the ggmlopt.nn layers (their buffers reused from
step to step); torch runs torch.nn.RMSNorm / LayerNorm / Embedding and, for
the SwiGLU product, F.silu(g) * u, with .grad reset to None each step.
Target (issue 17): each <= 0.5x torch's time.  The SwiGLU product is timed on
its own (gate and up (8, 256, dim)): the three projections around it are BLAS
matrix products on both sides.  Embedding: vocabulary 32000, ids (8, 256).
The whole MLP blocks (SwiGLU(288, 768) and GPT2MLP(288), x (8, 256, 288)) are
timed too, for scale, without a target: BLAS does most of their work.
"""
import numpy as np
import pytest
from conftest import measure

import ggmlopt.nn as gnn
from ggmlopt import kernels_glu

SHAPES = [(8, 256, 288), (8, 256, 768)]
VOCAB = 32000
TARGET = 0.5
LAYERS = ["rmsnorm", "layernorm", "swiglu", "embedding"]


def case_name(layer, shape):
    return f"{layer} fwd+bwd {shape}, 2 threads"


def make_inputs(layer, shape):
    rng = np.random.default_rng(17)
    if layer == "embedding":
        return (rng.integers(0, VOCAB, shape[:2]).astype(np.int32),
                rng.standard_normal(shape).astype(np.float32))
    n = 2 if layer == "swiglu" else 1
    xs = [(rng.standard_normal(shape) * 2).astype(np.float32) for _ in range(n)]
    return xs + [rng.standard_normal(shape).astype(np.float32)]


def ggmlopt_step(layer, shape):
    dim = shape[-1]
    if layer == "swiglu":
        g, u, dh = make_inputs(layer, shape)
        h, dg, du = np.empty_like(g), np.empty_like(g), np.empty_like(g)

        def run():
            kernels_glu.swiglu(g, u, out=h)
            kernels_glu.swiglu_backward(g, u, dh, grad_gate=dg, grad_up=du)
        return run
    if layer == "embedding":
        ids, dy = make_inputs(layer, shape)
        m = gnn.Embedding(VOCAB, dim, rng=0)
        x = ids
    else:
        x, dy = make_inputs(layer, shape)
        m = gnn.RMSNorm(dim) if layer == "rmsnorm" else gnn.LayerNorm(dim)

    def run():
        m.forward(x)
        m.backward(dy)
    return run


def torch_step(torch, layer, shape):
    dim = shape[-1]
    if layer == "swiglu":
        g, u, dh = (torch.from_numpy(a) for a in make_inputs(layer, shape))
        g.requires_grad_(True)
        u.requires_grad_(True)

        def run():
            g.grad = u.grad = None
            (torch.nn.functional.silu(g) * u).backward(dh)
        return run
    if layer == "embedding":
        ids, dy = make_inputs(layer, shape)
        m = torch.nn.Embedding(VOCAB, dim)
        x, dy = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(dy)
    else:
        x, dy = (torch.from_numpy(a) for a in make_inputs(layer, shape))
        x.requires_grad_(True)
        m = torch.nn.RMSNorm(dim, eps=1e-6) if layer == "rmsnorm" else torch.nn.LayerNorm(dim)

    def run():
        for p in m.parameters():
            p.grad = None
        if x.is_floating_point():
            x.grad = None
        m(x).backward(dy)
    return run


# every ggmlopt timing first: torch's OpenMP threads spin for a while after its calls

@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layer", LAYERS)
def test_ggmlopt(benchmark, threads, layer, shape):
    threads(2)
    measure(benchmark, ggmlopt_step(layer, shape), case=case_name(layer, shape),
            role="ggmlopt", label=f"ggmlopt {layer} forward + backward",
            items=int(np.prod(shape)))


MLPS = ["SwiGLU(288, 768)", "GPT2MLP(288)"]


def mlp_inputs():
    rng = np.random.default_rng(5)
    return (rng.standard_normal((8, 256, 288)).astype(np.float32),
            rng.standard_normal((8, 256, 288)).astype(np.float32))


@pytest.mark.parametrize("block", MLPS)
def test_ggmlopt_mlp(benchmark, threads, block):
    threads(2)
    x, dy = mlp_inputs()
    m = gnn.SwiGLU(288, 768, rng=0) if block.startswith("SwiGLU") else gnn.GPT2MLP(288, rng=0)

    def run():
        m.forward(x)
        m.backward(dy)
    measure(benchmark, run, case=f"{block} fwd+bwd (8, 256, 288), 2 threads", role="ggmlopt",
            label=f"ggmlopt {block} forward + backward", items=x.size)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layer", LAYERS)
def test_torch(benchmark, threads, layer, shape):
    torch = pytest.importorskip("torch")
    threads(2)
    measure(benchmark, torch_step(torch, layer, shape), case=case_name(layer, shape),
            role="baseline", label=f"torch {layer} forward + backward", target=TARGET,
            items=int(np.prod(shape)))


@pytest.mark.parametrize("block", MLPS)
def test_torch_mlp(benchmark, threads, block):
    torch = pytest.importorskip("torch")
    threads(2)
    F = torch.nn.functional
    x, dy = (torch.from_numpy(a) for a in mlp_inputs())
    x.requires_grad_(True)
    if block.startswith("SwiGLU"):
        lins = [torch.nn.Linear(288, 768, bias=False), torch.nn.Linear(288, 768, bias=False),
                torch.nn.Linear(768, 288, bias=False)]

        def fwd(v):
            return lins[2](F.silu(lins[0](v)) * lins[1](v))
    else:
        lins = [torch.nn.Linear(288, 1152), torch.nn.Linear(1152, 288)]

        def fwd(v):
            return lins[1](F.gelu(lins[0](v), approximate="tanh"))

    def run():
        x.grad = None
        for lin in lins:
            for p in lin.parameters():
                p.grad = None
        fwd(x).backward(dy)
    measure(benchmark, run, case=f"{block} fwd+bwd (8, 256, 288), 2 threads", role="baseline",
            label=f"torch {block} forward + backward", items=x.numel())
