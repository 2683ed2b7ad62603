"""Llama and GPT2 against the same models written in torch with the same weights
(F.scaled_dot_product_attention(is_causal=True), Hugging Face's rotate_half RoPE):
logits and every parameter gradient within 1e-4 of their scale, and a 10-step
AdamW trajectory through the engine within 1e-5 per step."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.models import GPT2, GPT2Config, Llama, LlamaConfig

torch = pytest.importorskip("torch")
F = torch.nn.functional

LLAMA_CONFIGS = {
    "mha-T7": (LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, max_seq_len=160), 7),
    "gqa2-T64": (LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_dim=40, max_seq_len=160), 64),
    "mqa-T129-hd16": (LlamaConfig(vocab_size=37, dim=48, n_layers=1, n_heads=3, n_kv_heads=1,
                                  max_seq_len=160, tie_embeddings=True), 129),
    "T1-hd8": (LlamaConfig(vocab_size=29, dim=16, n_layers=2, n_heads=2, max_seq_len=16,
                           tie_embeddings=True), 1),
    "hd64": (LlamaConfig(vocab_size=50, dim=128, n_layers=1, n_heads=2, n_kv_heads=1,
                         max_seq_len=64), 33),
}
GPT2_CONFIGS = {
    "T7": (GPT2Config(vocab_size=61, dim=32, n_layers=2, n_heads=4, max_seq_len=160), 7),
    "T129-hd16": (GPT2Config(vocab_size=37, dim=48, n_layers=1, n_heads=3, max_seq_len=160), 129),
    "T1-hd8": (GPT2Config(vocab_size=29, dim=16, n_layers=2, n_heads=2, max_seq_len=8), 1),
}


def tensors(model):
    return {name: torch.tensor(p.data.astype(np.float64), requires_grad=True)
            for name, p in model.named_parameters()}


def rope(x, base):
    """Hugging Face's apply_rotary_pos_emb on (B, H, T, hd)."""
    hd, t = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def torch_llama(w, cfg, tokens):
    b, t = tokens.shape
    hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * weight

    x = w["embed_tokens.weight"][tokens]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        xn = rms(x, w[p + "input_layernorm.weight"])
        q = (xn @ w[p + "self_attn.q_proj.weight"]).view(b, t, nh, hd).transpose(1, 2)
        k = (xn @ w[p + "self_attn.k_proj.weight"]).view(b, t, nkv, hd).transpose(1, 2)
        v = (xn @ w[p + "self_attn.v_proj.weight"]).view(b, t, nkv, hd).transpose(1, 2)
        q, k = rope(q, cfg.rope_base), rope(k, cfg.rope_base)
        k = k.repeat_interleave(nh // nkv, dim=1)     # HF's repeat_kv
        v = v.repeat_interleave(nh // nkv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + o.transpose(1, 2).reshape(b, t, nh * hd) @ w[p + "self_attn.o_proj.weight"]
        xn = rms(x, w[p + "post_attention_layernorm.weight"])
        h = F.silu(xn @ w[p + "mlp.gate_proj.weight"]) * (xn @ w[p + "mlp.up_proj.weight"])
        x = x + h @ w[p + "mlp.down_proj.weight"]
    x = rms(x, w["norm.weight"])
    return x @ (w["embed_tokens.weight"].T if cfg.tie_embeddings else w["lm_head.weight"])


def torch_gpt2(w, cfg, tokens):
    b, t = tokens.shape
    nh, hd, d = cfg.n_heads, cfg.head_dim, cfg.dim

    def ln(x, name):
        return F.layer_norm(x, (d,), w[name + ".weight"], w[name + ".bias"], cfg.norm_eps)

    x = w["wte.weight"][tokens] + w["wpe.weight"][:t]
    for i in range(cfg.n_layers):
        p = f"h.{i}."
        qkv = ln(x, p + "ln_1") @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (z.view(b, t, nh, hd).transpose(1, 2) for z in qkv.split(d, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + o @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = F.gelu(ln(x, p + "ln_2") @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"],
                   approximate="tanh")
        x = x + h @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ w["wte.weight"].T


def compare(model, reference, cfg, t, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (2, t))
    logits = model.forward(tokens)
    grad_logits = rng.standard_normal(logits.shape).astype(np.float32)
    for p in model.parameters():
        p.grad[...] = 0
    model.backward(grad_logits)
    w = tensors(model)
    ref = reference(w, cfg, torch.tensor(tokens))
    (ref * torch.tensor(grad_logits, dtype=torch.float64)).sum().backward()
    want = ref.detach().numpy()
    scale = np.abs(want).max()
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-4 * scale)
    for name, p in model.named_parameters():
        g = w[name].grad.numpy()
        np.testing.assert_allclose(p.grad, g, rtol=0, atol=1e-4 * np.abs(g).max() + 1e-7,
                                   err_msg=name)


@pytest.mark.parametrize("name", list(LLAMA_CONFIGS))
def test_llama_logits_and_gradients_equal_torch(name):
    cfg, t = LLAMA_CONFIGS[name]
    compare(Llama(cfg, seed=1), torch_llama, cfg, t)


@pytest.mark.parametrize("name", list(GPT2_CONFIGS))
def test_gpt2_logits_and_gradients_equal_torch(name):
    cfg, t = GPT2_CONFIGS[name]
    compare(GPT2(cfg, seed=1), torch_gpt2, cfg, t)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_ten_adamw_steps_equal_torch(arch):
    """llm.c's test_gpt2 check: the same model trained 10 steps by the engine and
    by torch.optim.AdamW on the same batches gives the same losses."""
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=53, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                          max_seq_len=32)
        model, reference = Llama(cfg, seed=3), torch_llama
    else:
        cfg = GPT2Config(vocab_size=53, dim=32, n_layers=2, n_heads=4, max_seq_len=32)
        model, reference = GPT2(cfg, seed=3), torch_gpt2
    w = {k: v.detach().to(torch.float32).requires_grad_() for k, v in tensors(model).items()}
    pars = go.OptimizerParams(go.AdamWParams(alpha=3e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                                             wd=0.1))
    ctx = go.OptContext(model, loss_type=go.LossType.CROSS_ENTROPY,
                        get_opt_pars=lambda ud: pars)
    opt = torch.optim.AdamW(list(w.values()), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)
    rng = np.random.default_rng(7)
    for step in range(10):
        tokens = rng.integers(0, cfg.vocab_size, (4, 16))
        labels = np.roll(tokens, -1, axis=1)
        labels[:, -1] = -1
        ctx.alloc(True)
        ctx.eval(None, inputs=tokens, labels=labels)
        opt.zero_grad()
        logits = reference(w, cfg, torch.tensor(tokens))
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size),
                               torch.tensor(labels.reshape(-1), dtype=torch.long),
                               ignore_index=-1)
        loss.backward()
        opt.step()
        assert float(ctx.loss) == pytest.approx(loss.item(), rel=1e-5, abs=1e-6), step
    # the parameters too; atol: the key biases have a zero gradient (softmax ignores a
    # constant added to every score), so both sides step on float noise there
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.data, w[name].detach().numpy(), rtol=1e-4, atol=1e-4,
                                   err_msg=name)
