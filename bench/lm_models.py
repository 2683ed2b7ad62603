"""The stories15M-shaped Llama (llama2.c's smallest model: dim 288, 6 layers,
6 heads, ffn 768, vocab 32000, max_seq_len 256) in ggmlopt and the same model,
with the same weights, as a plain torch module; shared by the language-model
benchmarks (test_bench_lm_step.py, test_bench_lm_generate.py).

Also a command line that runs one side alone in a fresh process and prints its
peak resident memory (VmHWM: tracemalloc does not see C allocations):

    python bench/lm_models.py step-memory ggmlopt|torch [steps]
"""
import os
import sys
import time

import numpy as np

import ggmlopt as go
from ggmlopt.models import Llama, LlamaConfig

STORIES15M = {"vocab_size": 32000, "dim": 288, "n_layers": 6, "n_heads": 6, "ffn_dim": 768,
                  "max_seq_len": 256, "norm_eps": 1e-5}
BATCH, T = 8, 256
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.0


def config():
    return LlamaConfig(**STORIES15M)


def ggmlopt_model(seed=0):
    return Llama(config(), seed=seed)


def batch(seed=0, batch_size=BATCH, t=T):
    """Random tokens (batch, t) int32 and their next-token labels (the last masked)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, STORIES15M["vocab_size"], (batch_size, t + 1)).astype(np.int32)
    return np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])


def torch_weights(model):
    """The ggmlopt model's parameters as torch tensors in torch's layout (Linear
    weights (out, in): the transpose of ggmlopt's)."""
    import torch

    out = {}
    for name, p in model.named_parameters():
        a = p.data
        if a.ndim == 2 and not name.startswith("embed_tokens"):
            a = a.T
        out[name] = torch.tensor(np.ascontiguousarray(a))
    return out


def torch_llama(model):
    """A plain torch Llama (F.scaled_dot_product_attention(is_causal=True), HF's
    RoPE and RMSNorm) holding the ggmlopt model's weights."""
    import torch
    import torch.nn.functional as F

    cfg = model.config

    class RMSNorm(torch.nn.Module):
        def __init__(self, dim, eps):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(dim))
            self.eps = eps

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def lin(i, o):
        return torch.nn.Linear(i, o, bias=False)

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            d, hd = cfg.dim, cfg.head_dim
            self.q_proj, self.k_proj = lin(d, cfg.n_heads * hd), lin(d, cfg.n_kv_heads * hd)
            self.v_proj, self.o_proj = lin(d, cfg.n_kv_heads * hd), lin(cfg.n_heads * hd, d)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            hd = cfg.head_dim
            q = self.q_proj(x).view(b, t, cfg.n_heads, hd).transpose(1, 2)
            k = self.k_proj(x).view(b, t, cfg.n_kv_heads, hd).transpose(1, 2)
            v = self.v_proj(x).view(b, t, cfg.n_kv_heads, hd).transpose(1, 2)

            def rope(z):
                z1, z2 = z[..., :hd // 2], z[..., hd // 2:]
                return z * cos + torch.cat((-z2, z1), dim=-1) * sin

            q, k = rope(q), rope(k)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               enable_gqa=cfg.n_kv_heads != cfg.n_heads)
            return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = lin(cfg.dim, cfg.ffn_dim), lin(cfg.dim, cfg.ffn_dim)
            self.down_proj = lin(cfg.ffn_dim, cfg.dim)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.self_attn = Attention()
            self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.mlp = MLP()

        def forward(self, x, cos, sin):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))

    class TorchLlama(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = torch.nn.ModuleList(Layer() for _ in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.lm_head = lin(cfg.dim, cfg.vocab_size)
            hd = cfg.head_dim
            inv = 1.0 / (cfg.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
            f = torch.arange(cfg.max_seq_len, dtype=torch.float64)[:, None] * inv[None, :]
            emb = torch.cat((f, f), dim=-1)
            self.register_buffer("cos", emb.cos().float(), persistent=False)
            self.register_buffer("sin", emb.sin().float(), persistent=False)

        def forward(self, tokens):
            t = tokens.shape[1]
            cos, sin = self.cos[:t], self.sin[:t]
            x = self.embed_tokens(tokens)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.lm_head(self.norm(x))

    m = TorchLlama()
    with torch.no_grad():
        params = dict(m.named_parameters())
        for name, w in torch_weights(model).items():
            params[name].copy_(w)
    return m


def torch_adamw(params):
    """torch.optim.AdamW, fused where this torch has the fused CPU kernel, else foreach."""
    import torch

    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                 fused=True), "fused"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                 foreach=True), "foreach"


def ggmlopt_step(model=None, precision="f32"):
    """One training step of the engine (dynamic OptContext, int32 tokens, sequence
    labels, class-index cross-entropy, AdamW) as a callable; also the context.
    precision="bf16": its products in bf16 (OptContext's mixed precision)."""
    model = ggmlopt_model() if model is None else model
    pars = go.OptimizerParams(go.AdamWParams(alpha=LR, beta1=BETAS[0], beta2=BETAS[1],
                                             eps=EPS, wd=WD))
    ctx = go.OptContext(model, loss_type=go.LossType.CROSS_ENTROPY,
                        get_opt_pars=lambda ud: pars, inputs_dtype=np.int32,
                        precision=precision)
    tokens, labels = batch()

    def step():
        ctx.alloc(True)
        ctx.eval(None, inputs=tokens, labels=labels)
        return ctx.loss

    return step, ctx


def torch_step(model=None, autocast_bf16=False):
    """The same step in torch: forward, F.cross_entropy, backward, AdamW; with
    autocast_bf16 the forward (and so the backward) under
    torch.autocast("cpu", torch.bfloat16), torch's own mixed precision."""
    import torch
    import torch.nn.functional as F

    m = torch_llama(ggmlopt_model() if model is None else model)
    opt, kind = torch_adamw(m.parameters())
    tokens, labels = (torch.from_numpy(a).long() for a in batch())
    vocab = STORIES15M["vocab_size"]

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
            logits = m(tokens).view(-1, vocab)
        loss = F.cross_entropy(logits.float(), labels.view(-1), ignore_index=-1)
        loss.backward()
        opt.step()
        return loss

    return step, kind


def peak_rss_mib():
    """This process's peak resident set (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _step_memory(side, steps):
    go.kernels.set_num_threads(2)
    if side == "torch":
        import torch

        torch.set_num_threads(2)
    base = peak_rss_mib()
    step = ggmlopt_step()[0] if side == "ggmlopt" else torch_step()[0]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(f"{side} peak_rss_mib={peak_rss_mib():.1f} before_model_mib={base:.1f} "
          f"median_step_s={float(np.median(times[1:] or times)):.4f}")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "step-memory":
        _step_memory(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3)
    else:
        sys.exit(__doc__)
    sys.stdout.flush()
    os._exit(0)
