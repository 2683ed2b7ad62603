"""Llama and GPT2 as modules: Hugging Face's parameter names and shapes, the
token checks before any work, owned outputs, zero_grad, frozen parameters,
training through the engine with its int32 inputs."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.models import GPT2, GPT2Config, Llama, LlamaConfig

LCFG = LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                   max_seq_len=16)
GCFG = GPT2Config(vocab_size=50, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def test_llama_names_and_shapes_are_hugging_faces():
    shapes = {n: p.shape for n, p in Llama(LCFG).named_parameters()}
    want = {"embed_tokens.weight": (50, 32), "norm.weight": (32,), "lm_head.weight": (32, 50)}
    for i in range(2):
        p = f"layers.{i}."
        want.update({p + "input_layernorm.weight": (32,),
                     p + "self_attn.q_proj.weight": (32, 32),
                     p + "self_attn.k_proj.weight": (32, 16),
                     p + "self_attn.v_proj.weight": (32, 16),
                     p + "self_attn.o_proj.weight": (32, 32),
                     p + "post_attention_layernorm.weight": (32,),
                     p + "mlp.gate_proj.weight": (32, 48), p + "mlp.up_proj.weight": (32, 48),
                     p + "mlp.down_proj.weight": (48, 32)})
    assert shapes == want
    tied = Llama(LlamaConfig(**{**LCFG.__dict__, "tie_embeddings": True}))
    assert "lm_head.weight" not in dict(tied.named_parameters())


def test_gpt2_names_and_shapes_are_hugging_faces():
    shapes = {n: p.shape for n, p in GPT2(GCFG).named_parameters()}
    want = {"wte.weight": (50, 32), "wpe.weight": (16, 32), "ln_f.weight": (32,),
            "ln_f.bias": (32,)}
    for i in range(2):
        p = f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            want.update({p + ln + ".weight": (32,), p + ln + ".bias": (32,)})
        want.update({p + "attn.c_attn.weight": (32, 96), p + "attn.c_attn.bias": (96,),
                     p + "attn.c_proj.weight": (32, 32), p + "attn.c_proj.bias": (32,),
                     p + "mlp.c_fc.weight": (32, 128), p + "mlp.c_fc.bias": (128,),
                     p + "mlp.c_proj.weight": (128, 32), p + "mlp.c_proj.bias": (32,)})
    assert shapes == want


@pytest.mark.parametrize("make", [lambda: Llama(LCFG, seed=4), lambda: GPT2(GCFG, seed=4)])
def test_init_is_seeded_and_hf_like(make):
    a, b = make(), make()
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data)
        if name.endswith(("norm.weight", ".ln_1.weight", "ln_f.weight")):
            assert (p.data == 1).all()
        elif name.endswith("embed_tokens.weight") or name == "wte.weight":
            assert abs(p.data.std() - 0.02) < 0.004


@pytest.mark.parametrize("make", [lambda: Llama(LCFG), lambda: GPT2(GCFG)])
def test_bad_tokens_are_refused_before_any_work(make):
    model = make()
    ok = model(np.zeros((1, 4), np.int32))
    with pytest.raises(ValueError, match="T=17 positions, more than the model's max_seq_len=16"):
        model.forward(np.zeros((1, 17), np.int32))
    with pytest.raises(IndexError, match=r"id 50 at position \(0, 2\) is outside"):
        model.forward(np.array([[1, 2, 50]]))
    with pytest.raises(TypeError, match="integer token ids"):
        model.forward(np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match=r"expected shape \(batch >= 1, T >= 1\)"):
        model.forward(np.zeros(4, np.int32))
    np.testing.assert_array_equal(model(np.zeros((1, 4), np.int32)), ok)


def test_call_returns_an_owned_copy_and_zero_grad_zeroes():
    model = Llama(LCFG, seed=1)
    a = model(np.array([[1, 2, 3]]))
    b = model(np.array([[4, 5, 6]]))
    assert not np.shares_memory(a, b) and not np.array_equal(a, b)
    model.forward(np.array([[1, 2, 3]]))
    model.backward(np.ones((1, 3, 50), np.float32))
    assert any(np.abs(p.grad).sum() > 0 for p in model.parameters())
    model.zero_grad()
    assert all((p.grad == 0).all() for p in model.parameters())


def test_a_frozen_base_trains_only_the_rest():
    model = Llama(LCFG, seed=2)
    frozen = {n: p.data.copy() for n, p in model.named_parameters() if "mlp" not in n}
    for n, p in model.named_parameters():
        if "mlp" not in n:
            p.requires_grad = False
    tokens = np.random.default_rng(0).integers(0, 50, 329).astype(np.int32)
    ds = go.Dataset.from_tokens(tokens, 8, 8)    # (329 - 9) // 8 = 40 windows
    go.fit(model, ds, go.LossType.CROSS_ENTROPY, nepoch=1, nbatch_logical=4, silent=True)
    for n, p in model.named_parameters():
        if n in frozen:
            np.testing.assert_array_equal(p.data, frozen[n])


@pytest.mark.parametrize("make", [lambda: Llama(LCFG, seed=3), lambda: GPT2(GCFG, seed=3)])
def test_fit_on_token_windows_lowers_the_loss(make):
    model = make()
    period = np.array([3, 14, 15, 9, 26, 5, 35, 8, 44, 7, 2, 32])   # each id once
    ds = go.Dataset.from_tokens(np.tile(period, 62)[:733], 12, 6)   # 120 windows
    pars = go.OptimizerParams(go.AdamWParams(alpha=1e-2))
    history = go.fit(model, ds, go.LossType.CROSS_ENTROPY, lambda epoch: pars, nepoch=3,
                     nbatch_logical=24, nbatch_physical=12, silent=True, seed=0)
    assert history[-1].train_loss < 0.5 * history[0].train_loss
    ids = go.generate(model, period[:4], 8, temperature=0)
    np.testing.assert_array_equal(ids, np.tile(period, 2)[4:12])
