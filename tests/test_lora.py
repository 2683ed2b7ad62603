"""ggmlopt.lora: LoRALinear against float64 and torch references, apply / merge on
any module tree, decoding with adapters, and training only the adapters."""
import math
import warnings

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import GPT2, GPT2Config, Llama, LlamaConfig
from ggmlopt.nn import Linear, ReLU, Sequential
from ggmlopt.testing import check_gradients

CFG = LlamaConfig(vocab_size=37, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24,
                  max_seq_len=16)
ALL_LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _randomise_b(model, seed=1, scale=0.3):
    """Give every adapter a nonzero B (a fresh adapter has B = 0)."""
    rng = np.random.default_rng(seed)
    for _, layer in lora.named_adapters(model):
        layer.lora_b.data[...] = rng.normal(0, scale, layer.lora_b.shape)


def _wrapped(n_in=7, n_out=9, rank=3, alpha=5.0, bias=True, seed=0):
    base = Linear(n_in, n_out, bias, rng=seed)
    layer = lora.LoRALinear(base, rank, alpha, rng=seed)
    layer.lora_b.data[...] = np.random.default_rng(seed + 1).normal(0, 1, (rank, n_out))
    return layer


# ---- the layer ---------------------------------------------------------------------------

@pytest.mark.parametrize("n_in,n_out,rank", [(1, 1, 1), (7, 9, 3), (17, 33, 8), (33, 7, 16)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(5,), (2, 3), (1,)])
def test_lora_linear_forward_and_backward_equal_float64(n_in, n_out, rank, bias, lead):
    layer = _wrapped(n_in, n_out, rank, alpha=2.5, bias=bias)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(*lead, n_in)).astype(np.float32)
    g = rng.normal(size=(*lead, n_out)).astype(np.float32)
    w, a, b = (p.data.astype(np.float64) for p in (layer.weight, layer.lora_a, layer.lora_b))
    s = 2.5 / rank
    x64, g64 = x.astype(np.float64).reshape(-1, n_in), g.astype(np.float64).reshape(-1, n_out)
    want = x64 @ w + s * (x64 @ a) @ b + (layer.bias.data if bias else 0)
    y = layer.forward(x)
    assert y.shape == (*lead, n_out)
    np.testing.assert_allclose(y.reshape(-1, n_out), want, rtol=1e-5, atol=1e-5)
    dx = layer.backward(g)
    np.testing.assert_allclose(dx.reshape(-1, n_in), g64 @ w.T + s * g64 @ b.T @ a.T,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.lora_a.grad, s * x64.T @ (g64 @ b.T), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.lora_b.grad, s * (x64 @ a).T @ g64, rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is None and not layer.weight.requires_grad
    if bias:
        assert layer.bias.grad is None and not layer.bias.requires_grad
    # a second backward adds into the gradients
    grad_a = layer.lora_a.grad.copy()
    layer.backward(g)
    np.testing.assert_allclose(layer.lora_a.grad, 2 * grad_a, rtol=1e-6, atol=1e-6)


def test_lora_linear_single_row_and_no_input_gradient():
    layer = _wrapped()
    x = np.arange(7, dtype=np.float32) / 7
    np.testing.assert_allclose(layer(x), layer(x[None])[0], rtol=1e-6)
    layer.needs_input_grad = False
    layer.forward(x[None])
    assert layer.backward(np.ones((1, 9), np.float32)) is None
    assert np.any(layer.lora_a.grad != 0)


def test_lora_linear_gradients_by_finite_differences():
    layer = _wrapped(5, 6, 2)
    x = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    errors = check_gradients(layer, x)
    assert set(errors) == {"lora_a", "lora_b", "input"}


def test_lora_linear_equals_torch():
    torch = pytest.importorskip("torch")
    layer = _wrapped(9, 17, 4, alpha=8.0)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 5, 9)).astype(np.float32)
    g = rng.normal(size=(3, 5, 17)).astype(np.float32)
    # torch's layout: W (out, in), A (rank, in), B (out, rank), as PEFT holds them
    tw = torch.tensor(layer.weight.data.T.copy())
    tb = torch.tensor(layer.bias.data)
    ta = torch.tensor(layer.lora_a.data.T.copy(), requires_grad=True)
    tbb = torch.tensor(layer.lora_b.data.T.copy(), requires_grad=True)
    tx = torch.tensor(x, requires_grad=True)
    ty = torch.nn.functional.linear(tx, tw, tb) + 2.0 * (tx @ ta.T @ tbb.T)
    ty.backward(torch.tensor(g))
    np.testing.assert_allclose(layer.forward(x), ty.detach().numpy(), rtol=1e-5, atol=1e-5)
    dx = layer.backward(g)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.lora_a.grad, ta.grad.numpy().T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.lora_b.grad, tbb.grad.numpy().T, rtol=1e-5, atol=1e-5)


def test_a_is_kaiming_uniform_and_b_zero():
    layer = lora.LoRALinear(Linear(400, 3), 64, 16.0, rng=0)
    bound = 1.0 / math.sqrt(400)   # kaiming_uniform_(a=sqrt(5)) with fan_in = in
    a = layer.lora_a.data
    assert a.shape == (400, 64) and np.all(np.abs(a) <= bound)
    assert np.abs(a).max() > 0.95 * bound
    assert a.std() == pytest.approx(bound / math.sqrt(3), rel=0.02)
    assert layer.lora_b.shape == (64, 3) and not np.any(layer.lora_b.data)
    assert layer.scaling == 0.25


def test_dropout_on_the_adapter_path_follows_the_rng():
    layer = _wrapped(8, 5, 2)
    layer.lora_dropout.p = 0.5
    x = np.random.default_rng(0).normal(size=(6, 8)).astype(np.float32)
    g = np.random.default_rng(1).normal(size=(6, 5)).astype(np.float32)
    w, a, b = (p.data.astype(np.float64) for p in (layer.weight, layer.lora_a, layer.lora_b))
    s = layer.scaling
    layer.lora_dropout.set_rng(np.random.default_rng(9))
    layer.train(True)
    y = layer.forward(x).astype(np.float64)
    mask = (np.random.default_rng(9).random(x.shape, dtype=np.float32) >= 0.5) * 2.0
    xd = x * mask
    np.testing.assert_allclose(y, x @ w + s * xd @ a @ b + layer.bias.data, rtol=1e-5, atol=1e-5)
    dx = layer.backward(g)
    np.testing.assert_allclose(dx, g @ w.T + mask * (s * g @ b.T @ a.T), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.lora_a.grad, s * xd.T @ (g @ b.T), rtol=1e-5, atol=1e-5)
    layer.train(False)   # not training: no mask
    np.testing.assert_allclose(layer.forward(x), x @ w + s * x @ a @ b + layer.bias.data,
                               rtol=1e-5, atol=1e-5)


# ---- apply and merge ---------------------------------------------------------------------

def test_apply_wraps_the_targets_keeps_names_and_output():
    model = Llama(CFG, seed=1)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 9))
    before = model(tokens)
    adapters = lora.apply(model, rank=4, alpha=8.0)
    assert [n for n, _ in adapters] == [f"layers.{i}.self_attn.{p}"
                                        for i in range(2) for p in ("q_proj", "k_proj",
                                                                    "v_proj", "o_proj")]
    names = dict(model.named_parameters())
    assert names["layers.0.self_attn.q_proj.lora_a"].shape == (16, 4)
    assert names["layers.0.self_attn.k_proj.lora_b"].shape == (4, 8)
    assert not names["layers.0.self_attn.q_proj.weight"].requires_grad
    # PEFT's get_peft_model: everything but the adapters is frozen
    assert not names["layers.1.mlp.up_proj.weight"].requires_grad
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 8 and all(".lora_" in n for n in trainable)
    np.testing.assert_array_equal(model(tokens), before)   # B = 0: the base model


def test_apply_on_the_mlp_and_only_adapters_train():
    model = Llama(CFG)
    for p in model.parameters():
        p.requires_grad = False
    lora.apply(model, rank=2, targets=ALL_LLAMA, seed=3)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 2 * 7 and all(".lora_" in n for n in trainable)


def test_apply_is_seeded():
    one, two = Llama(CFG), Llama(CFG)
    lora.apply(one, seed=4)
    lora.apply(two, seed=4)
    for (n, p), (_, q) in zip(one.named_parameters(), two.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=n)


@pytest.mark.parametrize("targets", [("c_attn",), ("attn.c_proj", "c_fc")])
def test_apply_on_gpt2(targets):
    model = GPT2(GPT2Config(vocab_size=29, dim=16, n_layers=2, n_heads=2, max_seq_len=12))
    tokens = np.random.default_rng(0).integers(0, 29, (2, 7))
    for p in model.parameters():
        p.requires_grad = False
    adapters = lora.apply(model, rank=2, targets=targets)
    assert all(n.split(".")[-1] in ("c_attn", "c_proj", "c_fc") for n, _ in adapters)
    if targets == ("attn.c_proj", "c_fc"):
        assert not any(n.endswith("mlp.c_proj") for n, _ in adapters)
    _randomise_b(model, scale=0.1)
    errors = check_gradients(model, tokens[:1, :4], seed=2)
    assert errors and all(".lora_" in n for n in errors)


def test_apply_on_a_sequential_by_index():
    model = Sequential(Linear(5, 7, rng=0), ReLU(), Linear(7, 3, rng=1))
    lora.apply(model, rank=2, targets=("2",))
    assert isinstance(model.layers[2], lora.LoRALinear)
    assert [n for n, p in go.nn.named_parameters(model) if p.requires_grad] == \
        ["2.lora_a", "2.lora_b"]


def test_apply_errors_leave_the_model_unchanged():
    model = Llama(CFG)
    snapshot = [(n, p.requires_grad) for n, p in model.named_parameters()]
    with pytest.raises(ValueError, match=r"no Linear layer.*its 15 Linear layers are named "
                                         r"q_proj, k_proj, v_proj, o_proj, gate_proj, "
                                         r"up_proj, down_proj, lm_head \(e\.g\. "
                                         r"layers\.0\.self_attn\.q_proj\)"):
        lora.apply(model, targets=("c_attn",))
    with pytest.raises(ValueError, match="rank: expected >= 1, got 0"):
        lora.apply(model, rank=0)
    with pytest.raises(TypeError, match="rank"):
        lora.apply(model, rank=2.0)
    with pytest.raises(ValueError, match="alpha"):
        lora.apply(model, alpha=float("nan"))
    with pytest.raises(ValueError, match="dropout"):
        lora.apply(model, dropout=1.0)
    with pytest.raises(TypeError, match="targets"):
        lora.apply(model, targets=(1,))
    with pytest.raises(ValueError, match="no LoRA adapters to merge"):
        lora.merge(model)
    assert [(n, p.requires_grad) for n, p in model.named_parameters()] == snapshot
    lora.apply(model)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        lora.apply(model, targets=("up_proj",))


def test_merge_folds_the_adapters_and_unwraps():
    model = Llama(CFG, seed=2)
    model.layers[0].self_attn.v_proj.weight.requires_grad = False   # frozen before apply
    lora.apply(model, rank=3, alpha=6.0, targets=ALL_LLAMA)
    _randomise_b(model)
    tokens = np.random.default_rng(5).integers(0, CFG.vocab_size, (2, 11))
    adapted = model(tokens)
    w = model.layers[1].mlp.down_proj.weight
    want = w.data + 2.0 * (model.layers[1].mlp.down_proj.lora_a.data.astype(np.float64)
                           @ model.layers[1].mlp.down_proj.lora_b.data)
    assert lora.merge(model) is model
    assert type(model.layers[1].mlp.down_proj) is Linear
    assert model.layers[1].mlp.down_proj.weight is w
    np.testing.assert_allclose(w.data, want, rtol=1e-6, atol=1e-7)
    assert not any(".lora_" in n for n, _ in model.named_parameters())
    assert w.requires_grad and not model.layers[0].self_attn.v_proj.weight.requires_grad
    np.testing.assert_allclose(model(tokens), adapted, rtol=1e-5, atol=1e-5)
    lora.apply(model)   # a merged model takes new adapters


def test_decoding_with_a_kv_cache_uses_the_adapters():
    model = Llama(CFG, seed=3)
    lora.apply(model, rank=2, targets=ALL_LLAMA)
    _randomise_b(model)
    tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 10)).astype(np.int32)
    full = model(tokens)
    cache = model.make_cache(2)
    steps = [model.decode(tokens[:, :4], cache)]
    steps += [model.decode(tokens[:, i:i + 1], cache) for i in range(4, 10)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-5)
    base = Llama(CFG, seed=3)
    assert not np.allclose(base(tokens), full, atol=1e-3)   # the adapters change the logits
    out = go.generate(model, tokens[0, :3], max_new_tokens=4, temperature=0)
    lora.merge(model)
    np.testing.assert_array_equal(go.generate(model, tokens[0, :3], max_new_tokens=4,
                                              temperature=0), out)


# ---- gradients of an adapted model -------------------------------------------------------

def test_llama_adapter_gradients_by_finite_differences():
    cfg = LlamaConfig(vocab_size=11, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=12,
                      max_seq_len=8)
    model = Llama(cfg, seed=1)
    for p in model.parameters():
        p.requires_grad = False
    lora.apply(model, rank=2, alpha=2.0, targets=ALL_LLAMA)
    _randomise_b(model, scale=0.1)
    tokens = np.array([[1, 5, 3, 9, 2]])
    errors = check_gradients(model, tokens)
    assert set(errors) == {
        f"layers.0.{p}.lora_{m}" for p in ("self_attn.q_proj", "self_attn.k_proj",
                                           "self_attn.v_proj", "self_attn.o_proj",
                                           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        for m in "ab"}


def test_llama_adapter_gradients_equal_torch():
    torch = pytest.importorskip("torch")
    from test_models_torch import torch_llama

    model = Llama(CFG, seed=4)
    # the embedding trains too: the input gradient of both paths
    adapters = lora.apply(model, rank=3, alpha=4.0, targets=ALL_LLAMA,
                          trainable=("embed_tokens",))
    _randomise_b(model)
    tokens = np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 7))
    g = np.random.default_rng(3).normal(size=(2, 7, CFG.vocab_size)).astype(np.float32)
    w = {n: torch.tensor(p.data.astype(np.float64), requires_grad=n == "embed_tokens.weight")
         for n, p in model.named_parameters()}
    embed = w["embed_tokens.weight"]
    ab = {}
    for name, layer in adapters:
        a = torch.tensor(layer.lora_a.data.astype(np.float64), requires_grad=True)
        b = torch.tensor(layer.lora_b.data.astype(np.float64), requires_grad=True)
        ab[name] = (a, b)
        w[name + ".weight"] = w[name + ".weight"] + layer.scaling * (a @ b)
    logits = torch_llama(w, CFG, torch.tensor(tokens))
    logits.backward(torch.tensor(g, dtype=torch.float64))
    np.testing.assert_allclose(model.forward(tokens), logits.detach().numpy(), rtol=1e-4,
                               atol=1e-4)
    model.zero_grad()
    model.backward(g)
    for name, layer in adapters:
        for p, t in zip((layer.lora_a, layer.lora_b), ab[name]):
            ref = t.grad.numpy()
            np.testing.assert_allclose(p.grad, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(),
                                       err_msg=name)
    ref = embed.grad.numpy()
    np.testing.assert_allclose(model.embed_tokens.weight.grad, ref, rtol=1e-4,
                               atol=1e-4 * np.abs(ref).max())


# ---- training only the adapters ----------------------------------------------------------

def _tokens(n=32, t=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, CFG.vocab_size, (n, t)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    y[:, -1] = -1
    return x, y


def _adapted(seed=5):
    model = Llama(CFG, seed=seed)
    for p in model.parameters():
        p.requires_grad = False
    lora.apply(model, rank=4, targets=ALL_LLAMA, dropout=0.1)
    return model


def test_the_arena_and_the_optimizer_hold_only_the_adapters():
    model = _adapted()
    adapter_size = sum(p.size for n, p in model.named_parameters() if ".lora_" in n)
    ctx = go.OptContext(model, loss_type=go.LossType.CROSS_ENTROPY, class_labels=True)
    assert ctx.arena.size == adapter_size < sum(p.size for p in model.parameters()) // 3
    assert ctx.arena.nbytes == 4 * ctx.arena.section * 4  # weights, grads, AdamW m, v
    assert ctx.arena.section < adapter_size + 64
    assert [id(p) for p in ctx.parameters()] == \
        [id(p) for n, p in model.named_parameters() if ".lora_" in n]


def test_fit_trains_the_adapters_and_never_the_base(tmp_path):
    x, y = _tokens()
    model = _adapted()
    base = {n: p.data.copy() for n, p in model.named_parameters() if ".lora_" not in n}
    pars = go.OptimizerParams(go.AdamWParams(alpha=1e-2))
    hist = go.fit(model, go.Dataset.from_arrays(x, y), go.LossType.CROSS_ENTROPY,
                  lambda ep: pars, nepoch=4, nbatch_logical=8, silent=True, seed=1,
                  checkpoint=str(tmp_path / "c.npz"))
    assert hist[-1].train_loss < hist[0].train_loss
    for n, p in model.named_parameters():
        if ".lora_" in n:
            assert np.any(p.data != 0), n
        else:
            np.testing.assert_array_equal(p.data, base[n], err_msg=n)
    with np.load(tmp_path / "c.npz") as sd:
        params = sorted(k for k in sd.files if k.startswith("param."))
        assert len(params) == sd["nparams"] == 2 * 2 * 7
        stored = sum(sd[k].size for k in params)
        assert stored == sum(p.size for n, p in model.named_parameters() if ".lora_" in n)
        assert sum(sd["trainable"]) == 28 and len(sd["trainable"]) == len(model.parameters())


def test_a_resumed_lora_fit_is_bit_exact(tmp_path):
    x, y = _tokens(n=48)
    pars = go.OptimizerParams(go.AdamWParams(alpha=1e-2))

    def run(nepoch, ckpt, resume=False):
        model = _adapted(seed=2)
        go.fit(model, go.Dataset.from_arrays(x, y), go.LossType.CROSS_ENTROPY,
               lambda ep: pars, nepoch=nepoch, nbatch_logical=16, nbatch_physical=8,
               val_split=0.25, silent=True, seed=3, checkpoint=str(ckpt), resume=resume)
        return model

    straight = run(3, tmp_path / "a.npz")
    run(1, tmp_path / "b.npz")
    resumed = run(3, tmp_path / "b.npz", resume=True)
    for (n, p), (_, q) in zip(straight.named_parameters(), resumed.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=n)


@pytest.mark.parametrize("change, match", [
    ({"alpha": 4.0}, (r"self_attn\.\w_proj: LoRA rank=4 alpha=8.0 dropout=0.0 over float32, "
                      r"this model has LoRA rank=4 alpha=4.0")),
    ({"dropout": 0.1}, "dropout=0.1 over float32; resume the same model"),
])
def test_a_resume_into_other_adapters_of_the_same_shapes_is_refused(tmp_path, change, match):
    # alpha and dropout leave the adapters' names and shapes as they are: the
    # checkpoint says what they were, and another value is another run
    x, y = _tokens(n=16)
    pars = go.OptimizerParams(go.AdamWParams(alpha=1e-2))

    def adapted(**options):
        model = Llama(CFG, seed=2)
        lora.apply(model, **{"rank": 4, "alpha": 8.0, "seed": 0, **options})
        return model

    def run(model, nepoch):
        go.fit(model, go.Dataset.from_arrays(x, y), go.LossType.CROSS_ENTROPY,
               lambda ep: pars, nepoch=nepoch, nbatch_logical=8, silent=True, seed=3,
               checkpoint=str(tmp_path / "c.npz"), resume=nepoch > 1)

    run(adapted(), 1)
    other = adapted(**change)
    before = [p.data.copy() for p in other.parameters()]
    with pytest.raises(ValueError, match=match):
        run(other, 2)
    assert all(np.array_equal(p.data, b) for p, b in zip(other.parameters(), before))
    run(adapted(), 2)   # the same adapters resume


def test_safetensors_of_an_adapted_model_are_in_torch_layout(tmp_path):
    safetensors = pytest.importorskip("safetensors.numpy")
    model = Llama(CFG, seed=6)
    lora.apply(model, rank=3)
    _randomise_b(model)
    go.io.save_safetensors(model, tmp_path / "m.safetensors")
    stored = safetensors.load_file(str(tmp_path / "m.safetensors"))
    layer = model.layers[0].self_attn.k_proj
    np.testing.assert_array_equal(stored["layers.0.self_attn.k_proj.lora_a"], layer.lora_a.data.T)
    np.testing.assert_array_equal(stored["layers.0.self_attn.k_proj.lora_b"], layer.lora_b.data.T)
    other = Llama(CFG, seed=0)
    lora.apply(other, rank=3, seed=9)
    go.io.load_safetensors(tmp_path / "m.safetensors", other)
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=n)


def test_apply_on_a_module_that_is_not_a_module_subclass():
    class TwoTowers:   # the engine's model protocol, attributes as sub-modules
        def __init__(self):
            self.left, self.right = Linear(4, 3, rng=0), Linear(4, 3, rng=1)

        def parameters(self):
            return [*self.left.parameters(), *self.right.parameters()]

        def forward(self, x):
            return self.left.forward(x) + self.right.forward(x)

    model = TwoTowers()
    (name, layer), = lora.apply(model, rank=2, targets=("right",))
    assert name == "right" and model.right is layer and isinstance(layer, lora.LoRALinear)
    lora.merge(model)
    assert type(model.right) is Linear


def test_gpt2_decoding_with_adapters_equals_its_forward():
    model = GPT2(GPT2Config(vocab_size=29, dim=16, n_layers=2, n_heads=2, max_seq_len=12))
    lora.apply(model, rank=2, targets=("c_attn", "c_proj", "c_fc"))
    _randomise_b(model)
    tokens = np.random.default_rng(4).integers(0, 29, (1, 9)).astype(np.int32)
    cache = model.make_cache(1)
    steps = [model.decode(tokens[:, :5], cache)]
    steps += [model.decode(tokens[:, i:i + 1], cache) for i in range(5, 9)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), model(tokens), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("saver", ["save_gguf", "save_hf"])
def test_model_files_refuse_an_adapted_model_until_merged(tmp_path, saver):
    pytest.importorskip("gguf" if saver == "save_gguf" else "safetensors")
    from ggmlopt.text import ByteTokenizer
    model = Llama(LlamaConfig(vocab_size=257, dim=16, n_layers=1, n_heads=2, ffn_dim=24,
                              max_seq_len=8))
    lora.apply(model, rank=2)
    path = tmp_path / "model"
    save = getattr(go.io, saver)
    kwargs = {"tokenizer": ByteTokenizer()} if saver == "save_gguf" else {}
    with pytest.raises(ValueError, match="lora.merge"):
        save(model, path, **kwargs)
    assert not path.exists()
    lora.merge(model)
    save(model, path, **kwargs)
    assert path.exists()


# ---- PEFT's semantics: only adapters train, unless named -----------------------------

def test_apply_freezes_all_but_the_adapters_and_the_named_trainable():
    model = Llama(CFG, seed=1)
    # PEFT's modules_to_save=["norm"] would train every *norm module: said, not silent
    with pytest.warns(UserWarning, match=r"'norm'.*modules_to_save.*would also train "
                                         r"layers\.0\.input_layernorm, layers\.0\."
                                         r"post_attention_layernorm"):
        lora.apply(model, rank=2, trainable=("lm_head", "norm"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ([f"layers.{i}.self_attn.{p}.lora_{ab}" for i in range(2)
                          for p in ("q_proj", "k_proj", "v_proj", "o_proj") for ab in "ab"]
                         + ["norm.weight", "lm_head.weight"])
    # "norm" is the final norm's module name, not a suffix of input_layernorm
    assert not dict(model.named_parameters())["layers.0.input_layernorm.weight"].requires_grad
    for name, p in model.named_parameters():
        assert (p.grad is None) == (not p.requires_grad), name   # no gradient when frozen
    with pytest.raises(ValueError, match="trainable: 'nope' names no module"):
        lora.apply(Llama(CFG), trainable=("nope",))
    with pytest.raises(TypeError, match="trainable"):
        lora.apply(Llama(CFG), trainable=(3,))


def test_trainable_names_a_module_and_everything_under_it():
    # PEFT's modules_to_save=["mlp"]: every weight under each block's mlp trains
    model = Llama(CFG, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the same modules as PEFT's: no warning
        lora.apply(model, rank=2, trainable=("mlp",))
    kept = [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n]
    assert kept == [f"layers.{i}.mlp.{p}.weight" for i in range(2)
                    for p in ("gate_proj", "up_proj", "down_proj")]
    model = Llama(CFG, seed=1)
    lora.apply(model, rank=2, trainable=("layers.1.post_attention_layernorm",))
    kept = [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n]
    assert kept == ["layers.1.post_attention_layernorm.weight"]


@pytest.mark.parametrize("targets, trainable", [(("q_proj",), ("q_proj",)),
                                                (("q_proj",), ("self_attn",)),
                                                ("all-linear", ("layers.0",))])
def test_trainable_covering_an_adapted_layer_is_refused(targets, trainable):
    # the adapter would freeze the weight trainable asked to train: refused, as PEFT
    # refuses a module in both target_modules and modules_to_save
    model = Llama(CFG, seed=1)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=f"trainable: '{trainable[0]}' covers layers.0"):
        lora.apply(model, rank=2, targets=targets, trainable=trainable)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert not lora.named_adapters(model)


def test_all_linear_in_any_case():
    upper, lower = Llama(CFG, seed=1), Llama(CFG, seed=1)
    lora.apply(upper, rank=2, targets="ALL-LINEAR")
    lora.apply(lower, rank=2, targets="all-linear")
    assert [n for n, _ in lora.named_adapters(upper)] == \
        [n for n, _ in lora.named_adapters(lower)]
    assert len(lora.named_adapters(upper)) == 2 * 7


def test_merge_gives_back_what_apply_froze():
    model = Llama(CFG, seed=1)
    model.norm.weight.requires_grad = False     # frozen by the user before apply
    lora.apply(model, rank=2)
    lora.merge(model)
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["norm.weight"]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_merge_of_a_copy_gives_back_what_apply_froze(how):
    # the record of what apply froze travels with the model: a copy's parameters
    # are other objects, and merging the copy must unfreeze its own
    import copy
    import pickle
    model = Llama(CFG, seed=1)
    model.norm.weight.requires_grad = False     # frozen by the user before apply
    lora.apply(model, rank=2, targets="all-linear")
    twin = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    lora.merge(twin)
    assert [n for n, p in twin.named_parameters() if not p.requires_grad] == ["norm.weight"]
    # the original is untouched by the copy's merge, and merges the same way
    assert sum(p.requires_grad for p in model.parameters()) == \
        2 * sum(p.requires_grad for _, layer in lora.named_adapters(model) for p in (layer.lora_a,))
    lora.merge(model)
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["norm.weight"]


def test_all_linear_adapts_every_linear_but_the_head():
    model = Llama(CFG, seed=1)
    names = [n for n, _ in lora.apply(model, rank=2, targets="all-linear")]
    assert names == [f"layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def test_trainable_parameters_counts_as_peft_does(capsys):
    model = Llama(CFG, seed=1)
    total = sum(p.data.size for p in model.parameters())
    assert lora.trainable_parameters(model) == (total, total)
    lora.apply(model, rank=4)
    d, kv = CFG.dim, CFG.n_kv_heads * CFG.head_dim
    adapters = 2 * 4 * ((d + d) + (d + kv) + (d + kv) + (d + d))
    assert lora.trainable_parameters(model) == (adapters, total + adapters)
    lora.print_trainable_parameters(model)
    share = 100 * adapters / (total + adapters)
    assert capsys.readouterr().out == (f"trainable params: {adapters:,d} || all params: "
                                       f"{total + adapters:,d} || trainable%: {share:.4f}\n")
    tied = Llama(LlamaConfig(vocab_size=29, dim=16, n_layers=1, n_heads=2,
                             tie_embeddings=True))
    assert lora.trainable_parameters(tied)[1] == sum(p.data.size for _, p in
                                                     tied.named_parameters())


# ---- an adapter on the token embedding (PEFT's lora.Embedding) ------------------------

def test_lora_embedding_forward_and_backward_equal_float64():
    from ggmlopt.nn import Embedding
    rng = np.random.default_rng(0)
    base = Embedding(13, 5, rng=1)
    layer = lora.LoRAEmbedding(base, rank=3, alpha=6.0, rng=2)
    assert not layer.weight.requires_grad and np.all(layer.lora_a.data == 0)  # PEFT's init
    layer.lora_a.data[...] = rng.normal(size=layer.lora_a.shape)
    ids = np.array([[3, 7, 3, 12], [0, 3, 5, 5]])
    w, a, b = (p.data.astype(np.float64) for p in (layer.weight, layer.lora_a, layer.lora_b))
    want = w[ids] + 2.0 * a[ids] @ b
    np.testing.assert_allclose(layer(ids), want, rtol=1e-6, atol=1e-6)
    g = rng.normal(size=want.shape)
    layer.forward(ids)
    layer.backward(g.astype(np.float32))
    db = 2.0 * a[ids].reshape(-1, 3).T @ g.reshape(-1, 5)
    da = np.zeros_like(a)
    np.add.at(da, ids.reshape(-1), 2.0 * g.reshape(-1, 5) @ b.T)
    np.testing.assert_allclose(layer.lora_b.grad, db, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.lora_a.grad, da, rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is None


@pytest.mark.parametrize("tie", [False, True])
def test_apply_on_the_embedding_keeps_the_model_and_merges(tie):
    cfg = LlamaConfig(vocab_size=37, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=24,
                      max_seq_len=16, tie_embeddings=tie)
    model = Llama(cfg, seed=1)
    tokens = np.random.default_rng(0).integers(0, 37, (2, 9))
    before = model(tokens)
    names = [n for n, _ in lora.apply(model, rank=2, targets=("embed_tokens", "q_proj"))]
    assert names == ["embed_tokens", "layers.0.self_attn.q_proj"]
    np.testing.assert_array_equal(model(tokens), before)   # A = 0
    assert not model.embed_tokens.weight.requires_grad
    model.embed_tokens.lora_a.data[...] = 0.1
    changed = model(tokens)
    assert np.abs(changed - before).max() > 1e-3
    if tie:   # the tied head reads the merged weight: said, not hidden
        with pytest.warns(UserWarning, match="tied to the token embedding"):
            lora.merge(model)
    else:
        lora.merge(model)
        np.testing.assert_allclose(model(tokens), changed, rtol=1e-4, atol=1e-5)
    assert model.embed_tokens.weight.requires_grad and type(model.embed_tokens).__name__ == \
        "Embedding"
    # "all-linear" leaves embeddings alone, as PEFT's shortcut does
    fresh = Llama(cfg, seed=1)
    assert "embed_tokens" not in [n for n, _ in lora.apply(fresh, targets="all-linear")]


@pytest.mark.parametrize("target, head_changes", [("wte", True), ("wpe", False)])
def test_merging_gpt2_s_embeddings_warns_where_the_tied_head_changes(target, head_changes):
    # GPT-2's head is always its token embedding (its config names no tie flag)
    model = GPT2(GPT2Config(vocab_size=37, dim=16, n_layers=1, n_heads=4, max_seq_len=16),
                 seed=1)
    tokens = np.random.default_rng(0).integers(0, 37, (2, 9))
    lora.apply(model, rank=2, targets=(target,))
    adapter = dict(lora.named_adapters(model))[target]
    adapter.lora_a.data[...] = 0.1
    adapter.lora_b.data[...] = np.random.default_rng(2).normal(size=adapter.lora_b.shape)
    adapted = model(tokens)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lora.merge(model)
    warned = [w for w in caught if "tied to the token embedding" in str(w.message)]
    assert bool(warned) == head_changes
    differs = np.abs(model(tokens) - adapted).max() > 1e-3 * np.abs(adapted).max()
    assert differs == head_changes


def test_a_model_s_own_parameter_order_decides_the_draws():
    """A model object with its own named_parameters: A is drawn in that order
    (here b's layer before a's), not in the attributes' order."""
    from ggmlopt.nn import Linear

    class Two:
        def __init__(self):
            self.a, self.b = Linear(8, 8, rng=0), Linear(8, 8, rng=1)

        def named_parameters(self):
            return [("b.weight", self.b.weight), ("b.bias", self.b.bias),
                    ("a.weight", self.a.weight), ("a.bias", self.a.bias)]

        def parameters(self):
            return [p for _, p in self.named_parameters()]

    model = Two()
    lora.apply(model, rank=2, targets=("a", "b"), seed=3)
    first = np.random.default_rng(3)
    b_first = lora.LoRALinear(Linear(8, 8, rng=1), 2, 4, rng=first)
    np.testing.assert_array_equal(model.b.lora_a.data, b_first.lora_a.data)


def test_apply_keeps_no_reference_to_a_deleted_model_s_base():
    """What apply records for merge (the parameters it froze) is their names, on
    the model itself: a deleted model's frozen base is freed."""
    import gc
    import weakref

    from ggmlopt.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=50, dim=16, n_layers=1, n_heads=2), seed=0)
    lora.apply(model, rank=2, seed=0)
    assert "norm.weight" in model._lora_frozen_names
    assert all(isinstance(n, str) for n in model._lora_frozen_names)
    norm = weakref.ref(model.norm.weight.data)   # a frozen array of the base
    del model
    gc.collect()
    assert norm() is None


def test_targets_and_trainable_take_peft_s_full_names():
    # PEFT matches on transformers' module names: save_peft writes those into
    # target_modules, and a PEFT config written with them means the same layers here
    short, full = Llama(CFG, seed=1), Llama(CFG, seed=1)
    lora.apply(short, rank=2, targets=("layers.0.self_attn.q_proj", "v_proj"),
               trainable=("norm",))
    lora.apply(full, rank=2, targets=("model.layers.0.self_attn.q_proj", "v_proj"),
               trainable=("model.norm",))
    assert [n for n, _ in lora.named_adapters(full)] == \
        [n for n, _ in lora.named_adapters(short)] == \
        ["layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj", "layers.1.self_attn.v_proj"]
    assert lora.other_trainable(full) == lora.other_trainable(short) == ["norm.weight"]
    gpt2 = GPT2(GPT2Config(vocab_size=37, dim=16, n_layers=2, n_heads=4, max_seq_len=16))
    lora.apply(gpt2, rank=2, targets=("transformer.h.1.attn.c_attn",),
               trainable=("transformer.ln_f",))
    assert [n for n, _ in lora.named_adapters(gpt2)] == ["h.1.attn.c_attn"]
    assert lora.other_trainable(gpt2) == ["ln_f.weight", "ln_f.bias"]


def test_a_regular_expression_matching_ggmlopt_s_names_only_warns():
    # PEFT fullmatches target_modules against transformers' names alone: layer 1's
    # projections match "layers\.1\..*" here by ggmlopt's names, not in PEFT
    model = Llama(CFG, seed=1)
    with pytest.warns(UserWarning, match=r"matches 6 layer\(s\) only by ggmlopt's name.*"
                                         r"'layers\.1\.self_attn\.k_proj' \(not "
                                         r"'model\.layers\.1\.self_attn\.k_proj'\).*"
                                         r"and 4 more; PEFT would not adapt them"):
        lora.apply(model, rank=2, targets=r"layers\.1\..*|.*q_proj")
    assert len(lora.named_adapters(model)) == 8   # still what the expression says
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the transformers names: PEFT's choice, no warning
        lora.apply(Llama(CFG, seed=1), rank=2, targets=r"model\.layers\.1\..*|.*q_proj")


def test_a_tied_head_named_in_targets_is_refused():
    # PEFT adapts a tied lm_head apart from the embedding; a tied model here has no
    # head layer to wrap: refused, where it was silently left out
    tied = Llama(LlamaConfig(vocab_size=37, dim=16, n_layers=1, n_heads=4, max_seq_len=16,
                             tie_embeddings=True), seed=1)
    with pytest.raises(ValueError, match="'lm_head' names the output head.*tied"):
        lora.apply(tied, rank=2, targets=("q_proj", "lm_head"))
    assert not lora.named_adapters(tied)
    gpt2 = GPT2(GPT2Config(vocab_size=37, dim=16, n_layers=1, n_heads=4, max_seq_len=16))
    with pytest.raises(ValueError, match="names the output head"):
        lora.apply(gpt2, rank=2, targets=("c_attn", "lm_head"))
    untied = Llama(CFG, seed=1)
    names = [n for n, _ in lora.apply(untied, rank=2, targets=("q_proj", "lm_head"))]
    assert names[-1] == "lm_head"


def test_a_parameter_inside_an_adapted_layer_is_refused_as_trainable():
    # the adapter freezes its base layer: its bias named in trainable would stay frozen
    from ggmlopt.models import Qwen2, Qwen2Config
    model = Qwen2(Qwen2Config(vocab_size=37, dim=16, n_layers=1, n_heads=4, n_kv_heads=2,
                              ffn_dim=24, max_seq_len=16), seed=1)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="trainable: 'q_proj.bias' covers "
                                         "layers.0.self_attn.q_proj.bias"):
        lora.apply(model, rank=2, targets=("q_proj",), trainable=("q_proj.bias",))
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    lora.apply(model, rank=2, targets=("v_proj",), trainable=("q_proj.bias",))
    assert lora.other_trainable(model) == ["layers.0.self_attn.q_proj.bias"]


def test_by_default_every_family_s_attention_projections_are_adapted():
    # Phi-3 fuses q, k and v into qkv_proj, GPT-2 names them c_attn and attn.c_proj:
    # apply(model) adapts the attention there too, not o_proj alone or nothing
    from ggmlopt.models import Phi3, Phi3Config
    phi3 = Phi3(Phi3Config(vocab_size=67, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           ffn_dim=48, max_seq_len=64), seed=0)
    gpt2 = GPT2(GPT2Config(vocab_size=29, dim=16, n_layers=2, n_heads=2, max_seq_len=12))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = {type(m).__name__: [n for n, _ in lora.apply(m)] for m in (phi3, gpt2, Llama(CFG))}
    assert got["Phi3"] == [f"layers.{i}.self_attn.{p}" for i in range(2)
                           for p in ("qkv_proj", "o_proj")]
    assert got["GPT2"] == [f"h.{i}.attn.{p}" for i in range(2) for p in ("c_attn", "c_proj")]
    assert got["Llama"] == [f"layers.{i}.self_attn.{p}" for i in range(2)
                            for p in lora.DEFAULT_TARGETS]


def test_a_target_that_matches_nothing_beside_others_warns():
    model = Llama(CFG)
    with pytest.warns(UserWarning, match=r"targets: 'qproj' matches no layer of the model; "
                                         r"the other names adapt 2 layer\(s\)"):
        lora.apply(model, rank=2, targets=("qproj", "v_proj"))
    assert [n for n, _ in lora.named_adapters(model)] == \
        ["layers.0.self_attn.v_proj", "layers.1.self_attn.v_proj"]


def test_a_regular_expression_matching_nothing_says_how_it_is_read():
    model = Llama(CFG)
    with pytest.raises(ValueError, match=r"regular expression, which must match a layer's "
                                         r"whole dotted name.*its embeddings embed_tokens"):
        lora.apply(model, targets="q_proj|v_proj")
    assert not lora.named_adapters(model)


def test_trainable_names_train_even_when_frozen_before():
    # PEFT's modules_to_save trains what it names whatever it was before
    model = Llama(CFG)
    model.norm.weight.requires_grad = False
    lora.apply(model, rank=2, targets=("q_proj",), trainable=("model.norm",))
    assert model.norm.weight.requires_grad
    assert lora.other_trainable(model) == ["norm.weight"]


def test_rslora_scales_by_the_square_root_of_the_rank():
    model, plain = Llama(CFG, seed=2), Llama(CFG, seed=2)
    lora.apply(model, rank=4, alpha=8.0, targets=("q_proj",), use_rslora=True, seed=1)
    lora.apply(plain, rank=4, alpha=16.0, targets=("q_proj",), seed=1)   # 8 * sqrt(4)
    a, b = lora.named_adapters(model)[0][1], lora.named_adapters(plain)[0][1]
    assert a.alpha == b.alpha == 16.0 and a.rank == 4
    with pytest.raises(TypeError, match="use_rslora"):
        lora.apply(Llama(CFG), use_rslora="yes")


def test_trainable_lm_head_of_a_tied_model_is_refused_naming_the_embedding():
    model = Llama(LlamaConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, max_seq_len=32,
                              tie_embeddings=True), seed=0)
    before = [p.requires_grad for p in model.parameters()]
    with pytest.raises(ValueError, match=r"trainable: 'lm_head' .*token embedding, tied: "
                                         r"name that, 'embed_tokens'"):
        lora.apply(model, rank=2, trainable=("lm_head",))
    assert [p.requires_grad for p in model.parameters()] == before


def test_adapters_go_into_tuples_and_namedtuples_of_layers():
    # named_children names a tuple's layers attr.i: the tuple is rebuilt with the
    # adapter in, a namedtuple as its own type (its constructor takes the items
    # one by one; the list given whole used to raise half way through apply)
    import collections

    from ggmlopt.nn.module import Module

    Pair = collections.namedtuple("Pair", "q k")

    class Model(Module):
        def __init__(self):
            self.first = Linear(4, 4)
            self.pair = Pair(Linear(4, 4), Linear(4, 4))
            self.plain = (Linear(4, 4),)

    model = Model()
    lora.apply(model, rank=2, targets=("first", "pair.0", "plain.0"))
    assert [name for name, _ in lora.named_adapters(model)] == ["first", "pair.0", "plain.0"]
    assert type(model.pair) is Pair and type(model.plain) is tuple
    assert isinstance(model.pair.q, lora.LoRALinear) and type(model.pair.k) is Linear
    lora.merge(model)
    assert type(model.pair) is Pair and type(model.pair.q) is Linear


def test_apply_and_merge_reach_the_layers_inside_a_checkpoint_wrapper():
    # Checkpoint lists its module's children as its own: apply put the adapters on
    # the wrapper as stray attributes, left the inner Linears plain and frozen, and
    # merge left their adapters in place, all without a word
    from ggmlopt.nn import Checkpoint
    from ggmlopt.nn.lora_layers import LoRALinear

    def model(wrapped):
        block = Sequential(Linear(8, 16, rng=1), ReLU(), Linear(16, 8, rng=2))
        return Sequential(Checkpoint(block) if wrapped else block, Linear(8, 4, rng=3)), block

    plain, _ = model(False)
    wrapped, block = model(True)
    for m in (plain, wrapped):
        lora.apply(m, rank=2, targets="all-linear", seed=0)
    assert [n for n, _ in lora.named_adapters(wrapped)] == ["0.0", "0.2", "1"]
    assert isinstance(block.layers[0], LoRALinear) and isinstance(block.layers[2], LoRALinear)
    assert not [k for k in vars(wrapped.layers[0]) if k.isdigit()]
    assert [n for n, p in wrapped.named_parameters() if p.requires_grad] == \
        [n for n, p in plain.named_parameters() if p.requires_grad]
    for m in (plain, wrapped):
        for _, layer in lora.named_adapters(m):
            layer.lora_b.data[...] = np.random.default_rng(4).normal(0, 0.3, layer.lora_b.shape)
    x = np.random.default_rng(5).normal(size=(3, 8)).astype(np.float32)
    want = plain(x)
    np.testing.assert_array_equal(wrapped(x), want)
    lora.merge(wrapped)
    assert lora.named_adapters(wrapped) == [] and type(block.layers[0]) is Linear
    np.testing.assert_allclose(wrapped(x), want, rtol=1e-5, atol=1e-6)
    # an explicit target inside the wrapper is found as well
    again, inner = model(True)
    assert [n for n, _ in lora.apply(again, rank=2, targets=("0.0",))] == ["0.0"]
    assert isinstance(inner.layers[0], LoRALinear)


def test_a_checkpoint_wrapping_a_linear_itself():
    # Checkpoint(Linear): the wrapper adds no level to the names, so the Linear's
    # weight is "0.weight" (named_parameters lost it), and apply adapts the Linear
    # inside the wrapper (all-linear skipped it) and merge puts it back
    from ggmlopt.nn import Checkpoint
    from ggmlopt.nn.lora_layers import LoRALinear

    def model():
        return Sequential(Checkpoint(Linear(8, 16, rng=1)), ReLU(), Linear(16, 8, rng=2))

    plain = Sequential(Linear(8, 16, rng=1), ReLU(), Linear(16, 8, rng=2))
    wrapped = model()
    assert [n for n, _ in wrapped.named_parameters()] == \
        ["0.weight", "0.bias", "2.weight", "2.bias"]
    for m in (plain, wrapped):
        lora.apply(m, rank=2, targets="all-linear", seed=0)
    assert isinstance(wrapped.layers[0], Checkpoint)
    assert isinstance(wrapped.layers[0].module, LoRALinear)
    assert [n for n, p in wrapped.named_parameters() if p.requires_grad] == \
        ["0.lora_a", "0.lora_b", "2.lora_a", "2.lora_b"]
    for m in (plain, wrapped):
        for _, layer in lora.named_adapters(m):
            layer.lora_b.data[...] = np.random.default_rng(4).normal(0, 0.3, layer.lora_b.shape)
    x = np.random.default_rng(5).normal(size=(3, 8)).astype(np.float32)
    np.testing.assert_array_equal(wrapped(x), plain(x))
    lora.merge(wrapped)
    assert type(wrapped.layers[0].module) is Linear and lora.named_adapters(wrapped) == []
    np.testing.assert_allclose(wrapped(x), plain(x), rtol=1e-5, atol=1e-6)
    assert [n for n, _ in lora.apply(model(), rank=2, targets=("0",))] == ["0"]
