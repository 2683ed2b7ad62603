"""A decode step of a Llama-layout block in one C call (kernels_decode.LlamaBlockStep,
taken by LlamaDecoderLayer.decode over a base kept in its file's types or float32
Linear weights): over kept types the same bits as the layers called one by one,
for every family with that block (Llama, Qwen2's biases, Qwen3's q/k norms,
Mistral's window, SmolLM3's layers without RoPE, Phi-3's fused projections), both
activation settings, one and several sequences, every SIMD path; within float32
rounding of a float64 block over kept and over Linear weights, LoRA adapters
included; the layer-by-layer path wherever the parts are others (an adapter
dropping out, a bf16 pass, a weight without contiguous rows); the products of one
input by several weights (kernels_quant.matmul_many) the same bits as one by one;
two threads decoding at once, a model each, with their own numbers."""
import copy
import pickle

import numpy as np
import pytest

from ggmlopt import gemm, kernels, lora, models
from ggmlopt import kernels_quant as kq
from ggmlopt.kernels_decode import LlamaBlockStep
from ggmlopt.models import _decode_step
from ggmlopt.nn import Linear, QuantizedLinear
from ggmlopt.nn.quantized import set_activations

gguf = pytest.importorskip("gguf")
U = 2.0 ** -24
# a Q4_K_M file's mix over one block: K types, 32-value types, one without integer products
MIX = {"q_proj": "Q4_K", "k_proj": "Q8_0", "v_proj": "Q6_K", "o_proj": "Q4_0",
       "gate_proj": "Q4_K", "up_proj": "F16", "down_proj": "Q6_K",
       "qkv_proj": "Q8_0", "gate_up_proj": "Q4_K"}   # Phi-3's fused ones

SHAPE = {"vocab_size": 97, "dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "ffn_dim": 512, "max_seq_len": 64}
FAMILIES = {
    "llama": lambda: models.Llama(models.LlamaConfig(**SHAPE), seed=1),
    "qwen2-biases": lambda: models.Qwen2(models.Qwen2Config(**SHAPE), seed=2),
    "qwen3-qk-norms": lambda: models.Qwen3(models.Qwen3Config(**SHAPE), seed=3),
    "mistral-window-3": lambda: models.Mistral(models.MistralConfig(**SHAPE, sliding_window=3),
                                               seed=4),
    "smollm3-nope": lambda: models.SmolLM3(models.SmolLM3Config(**dict(SHAPE, n_layers=4)),
                                           seed=5),
    "phi3-fused": lambda: models.Phi3(models.Phi3Config(**SHAPE, sliding_window=5), seed=6),
}


def quantized(lin, qtype, rng):
    """lin's weight (in, out) stored as qtype rows (out, in), its bias kept."""
    rows = np.ascontiguousarray(lin.weight.data.T)
    if qtype == "F16":
        raw = rows.astype(np.float16)
    elif qtype.endswith("_K"):
        raw = kq.quantize(rows, qtype)
    else:
        raw = gguf.quants.quantize(rows, gguf.GGMLQuantizationType[qtype])
    bias = None
    if lin.bias is not None:   # a bias that is not zero, so adding it shows
        bias = rng.uniform(-0.2, 0.2, lin.out_features).astype(np.float32)
    return QuantizedLinear(raw, qtype, lin.in_features, lin.out_features, bias=bias)


def keep_types(model, kept=True):
    """model with every block's projections kept in MIX's types (as
    load_gguf(keep_types=True) gives them; with kept False left float32 Linear
    layers) and norm weights that are not ones."""
    rng = np.random.default_rng(0)
    for layer in model.layers:
        for part in (layer.self_attn, layer.mlp):
            for name, qtype in MIX.items():
                if hasattr(part, name) and kept:
                    setattr(part, name, quantized(getattr(part, name), qtype, rng))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm,
                     getattr(layer.self_attn, "q_norm", None),
                     getattr(layer.self_attn, "k_norm", None)):
            if norm is not None:
                norm.weight.data[...] = rng.uniform(0.5, 1.5, norm.weight.data.shape)
    return model


def decode_tokens(model, batch, steps, layer_by_layer, monkeypatch):
    """(logits of each step, the final caches): a prompt of 4 tokens, then one
    token a step; with layer_by_layer, LlamaDecoderLayer.decode never takes the
    one-call path."""
    with monkeypatch.context() as m:
        if layer_by_layer:
            m.setattr("ggmlopt.models.llama.decode_in_one_call", lambda *a: None)
        rng = np.random.default_rng(7)
        cache = model.make_cache(batch, 16)
        out = [model.decode(rng.integers(0, 97, (batch, 4)), cache).copy()]
        for _ in range(steps):
            out.append(model.decode(rng.integers(0, 97, (batch, 1)), cache).copy())
    return out, cache


def taken(model):
    """How many of model's blocks have a one-call step now."""
    return sum(1 for layer in model.layers if layer in _decode_step._steps)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("activations", ["f32", "q8_0"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_step_gives_the_bits_of_the_layers_one_by_one(simd_path, family, activations, batch,
                                                        monkeypatch):
    model = keep_types(FAMILIES[family]())
    set_activations(model, activations)
    fast, cache_fast = decode_tokens(model, batch, 6, False, monkeypatch)
    assert taken(model) == len(model.layers)
    slow, cache_slow = decode_tokens(model, batch, 6, True, monkeypatch)
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(cache_fast.k + cache_fast.v, cache_slow.k + cache_slow.v):
        np.testing.assert_array_equal(a, b)
        assert (a[:, 10:] == 0).all()   # positions past the last token never written


def effective_weight(layer):
    """A projection's float64 (in, out) weight, its adapter's s A B added."""
    if isinstance(layer, QuantizedLinear):
        return layer.dequantize().astype(np.float64)
    if type(layer) is Linear:
        return layer.weight.data.astype(np.float64)
    return effective_weight(layer._base) + layer.scaling * (
        layer.lora_a.data.astype(np.float64) @ layer.lora_b.data.astype(np.float64))


def reference_block(layer, x, cache_k, cache_v, pos):
    """float64 LlamaDecoderLayer step over the dequantized weights (a fresh
    cache row at pos), and a bound on a float32 step's error: each product's
    gamma_n times its magnitudes (|a| |W|), the norms', RoPE's and the
    softmax's few roundings relative to their values, carried to the output
    through the later products' magnitudes; 16 covers those few roundings per
    value and their amplification by the norms' rescaling (rstd <= 1/sqrt(eps)
    is far from reached: the rows' mean squares are O(1))."""
    attn = layer.self_attn
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    w = {n: effective_weight(p)[:, first:first + count]
         for n, (p, first, count) in zip(names, layer.step_projections())}
    x = x.astype(np.float64)

    def norm(v, weight, eps):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * weight

    eps = layer.input_layernorm.eps
    n1 = norm(x, layer.input_layernorm.weight.data, eps)
    q, k, v = n1 @ w["q_proj"], n1 @ w["k_proj"], n1 @ w["v_proj"]
    hd, nh, nkv = attn.head_dim, attn.n_heads, attn.n_kv_heads
    q, k, v = q.reshape(nh, hd), k.reshape(nkv, hd), v.reshape(nkv, hd)
    cos, sin = (a[pos].astype(np.float64) for a in attn.rotary.tables(pos + 1))
    rot = lambda t: np.concatenate([t[:, :hd // 2] * cos - t[:, hd // 2:] * sin,
                                    t[:, hd // 2:] * cos + t[:, :hd // 2] * sin], axis=1)
    q, k = rot(q), rot(k)
    keys = np.concatenate([cache_k[:pos].astype(np.float64), k[None]], axis=0)
    values = np.concatenate([cache_v[:pos].astype(np.float64), v[None]], axis=0)
    o = np.empty((nh, hd))
    for h in range(nh):
        s = keys[:, h // (nh // nkv)] @ q[h] / np.sqrt(hd)
        p = np.exp(s - s.max())
        o[h] = (p / p.sum()) @ values[:, h // (nh // nkv)]
    a = o.reshape(-1) @ w["o_proj"]
    h = x + a
    n2 = norm(h, layer.post_attention_layernorm.weight.data, eps)
    g, u = n2 @ w["gate_proj"], n2 @ w["up_proj"]
    act = g / (1 + np.exp(-g)) * u
    y = h + act @ w["down_proj"]
    n = SHAPE["dim"] + SHAPE["ffn_dim"] + pos + 1
    mag = (np.abs(x) + np.abs(o.reshape(-1)) @ np.abs(w["o_proj"]) +
           np.abs(act) @ np.abs(w["down_proj"]))
    return y, 16 * n * U * mag.max()


@pytest.mark.parametrize("family", ["llama", "phi3-fused"])
@pytest.mark.parametrize("adapters", [False, True])
@pytest.mark.parametrize("kept", [True, False], ids=["kept", "linear"])
def test_a_step_within_float32_of_a_float64_block(simd_path, family, adapters, kept):
    """Over the kept weights or float32 Linear ones, and with LoRA adapters on
    every projection (for Phi-3 its fused q|k|v and gate|up: B's columns cut as
    the weight's rows, and a Linear weight's columns likewise)."""
    model = keep_types(FAMILIES[family](), kept)
    if adapters:
        lora.apply(model, rank=5, targets="all-linear", seed=0)
        rng = np.random.default_rng(1)
        for _, a in lora.named_adapters(model):   # an adapter that changes the block
            a.lora_b.data[...] = rng.uniform(-0.05, 0.05, a.lora_b.data.shape)
    layer = model.layers[0]
    rng = np.random.default_rng(3)
    cache = model.make_cache(1, 16)
    pos = 4   # inside Phi-3's window of 5
    for c in (cache.k[0], cache.v[0]):
        c[:, :pos] = rng.standard_normal(c[:, :pos].shape)
    x = rng.standard_normal((1, 1, 256)).astype(np.float32)
    want, bound = reference_block(layer, x[0, 0], cache.k[0][0], cache.v[0][0], pos)
    got = layer.decode(x, cache.k[0], cache.v[0], pos)
    assert layer in _decode_step._steps and _decode_step.block_step(layer) is not None
    assert np.abs(got[0, 0] - want).max() <= bound


@pytest.mark.parametrize("batch", [1, 3])
def test_linear_weights_take_the_step(monkeypatch, batch):
    """float32 Linear weights decode in one call too: logits within float32
    rounding of the layers one by one (both within it of the exact products:
    the bound of test_a_step_within_float32_of_a_float64_block per block, here
    a loose multiple of the logits' magnitudes for two blocks and the head)."""
    model = keep_types(FAMILIES["qwen2-biases"](), kept=False)
    fast, _ = decode_tokens(model, batch, 4, False, monkeypatch)
    assert taken(model) == len(model.layers)
    slow, _ = decode_tokens(model, batch, 4, True, monkeypatch)
    for a, b in zip(fast, slow):
        scale = np.abs(b).max()
        assert np.abs(a - b).max() <= 64 * (256 + 512) * U * scale


def test_other_parts_decode_layer_by_layer(monkeypatch):
    bf16 = FAMILIES["llama"]()   # float32 Linear weights inside a bf16 pass: bf16 products
    with gemm.products_in("bf16"):
        assert all(_decode_step.block_step(layer) is None for layer in bf16.layers)
    assert all(_decode_step.block_step(layer) is not None for layer in bf16.layers)
    dropping = keep_types(FAMILIES["llama"]())
    lora.apply(dropping, rank=4, dropout=0.1, seed=0)
    assert all(_decode_step.block_step(layer) is not None for layer in dropping.layers)
    dropping.train()   # an adapter dropping out: the layers' own way
    assert all(_decode_step.block_step(layer) is None for layer in dropping.layers)
    mixed = keep_types(FAMILIES["llama"]())
    mixed.layers[1].mlp.gate_proj.activations = "q8_0"   # one projection unlike the others
    assert _decode_step.block_step(mixed.layers[1]) is None
    assert _decode_step.block_step(mixed.layers[0]) is not None


def test_the_step_follows_what_it_read(monkeypatch):
    """A step is made again when a part it read changes: activations, a norm's
    weight array, a projection replaced."""
    model = keep_types(FAMILIES["qwen3-qk-norms"]())
    layer = model.layers[0]
    first = _decode_step.block_step(layer)
    assert _decode_step.block_step(layer) is first   # nothing changed: kept
    set_activations(model, "q8_0")
    second = _decode_step.block_step(layer)
    assert second is not first
    layer.self_attn.q_norm.weight.data = layer.self_attn.q_norm.weight.data * 2
    third = _decode_step.block_step(layer)
    assert third is not second
    fast, _ = decode_tokens(model, 2, 3, False, monkeypatch)
    slow, _ = decode_tokens(model, 2, 3, True, monkeypatch)
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a, b)


def test_a_model_copies_and_pickles_after_decoding(monkeypatch):
    model = keep_types(FAMILIES["llama"]())
    before, _ = decode_tokens(model, 1, 2, False, monkeypatch)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        after, _ = decode_tokens(other, 1, 2, False, monkeypatch)
        assert taken(other) == 2
        for a, b in zip(before, after):
            np.testing.assert_array_equal(a, b)


def block_step_args(model):
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    projections = {n: (p.qtype, p.qweight, None) for n, p in zip(
        ("q", "k", "v", "o", "gate", "up", "down"),
        (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
         mlp.down_proj))}
    norms = layer.input_layernorm, layer.post_attention_layernorm
    return projections, norms[0].weight.data, norms[1].weight.data


def test_bad_input_is_refused_and_changes_nothing():
    model = keep_types(FAMILIES["llama"]())
    proj, n1, n2 = block_step_args(model)
    step = LlamaBlockStep(proj, n1, n2, n_heads=4, n_kv_heads=2, eps=1e-5)
    assert (step.dim, step.head_dim, step.ffn_dim) == (256, 64, 512)
    with pytest.raises(ValueError, match="missing down"):
        LlamaBlockStep({k: v for k, v in proj.items() if k != "down"}, n1, n2, n_heads=4,
                       n_kv_heads=2, eps=1e-5)
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaBlockStep(proj, n1, n2, n_heads=4, n_kv_heads=3, eps=1e-5)
    with pytest.raises(ValueError, match="heads of one width"):
        LlamaBlockStep(dict(proj, k=proj["q"]), n1, n2, n_heads=4, n_kv_heads=2, eps=1e-5)
    with pytest.raises(ValueError, match=r"projections\['o'\]"):
        LlamaBlockStep(dict(proj, o=proj["gate"]), n1, n2, n_heads=4, n_kv_heads=2, eps=1e-5)
    with pytest.raises(ValueError, match="ffn_norm"):
        LlamaBlockStep(proj, n1, n2[:5], n_heads=4, n_kv_heads=2, eps=1e-5)
    with pytest.raises(ValueError, match="q_norm, k_norm"):
        LlamaBlockStep(proj, n1, n2, n_heads=4, n_kv_heads=2, eps=1e-5, q_norm=np.ones(64))
    with pytest.raises(ValueError, match="activations"):
        LlamaBlockStep(proj, n1, n2, n_heads=4, n_kv_heads=2, eps=1e-5, activations="q4_0")
    # eps named (a negative one was "the weights do not make one block"); 1e39 and inf
    # were taken as the norms' eps, inf as a float32
    for eps in (-1e-5, 0.0, float("nan"), float("inf"), 1e39):
        with pytest.raises(ValueError, match="eps"):
            LlamaBlockStep(proj, n1, n2, n_heads=4, n_kv_heads=2, eps=eps)
    # and the rows' bytes as another dtype kind are refused by name
    with pytest.raises(TypeError, match=r"projections\['q'\]"):
        LlamaBlockStep(dict(proj, q=(proj["q"][0], proj["q"][1].astype(object), None)), n1, n2,
                       n_heads=4, n_kv_heads=2, eps=1e-5)
    cache_k = np.zeros((1, 8, 2, 64), np.float32)
    cache_v = np.zeros((1, 8, 2, 64), np.float32)
    x = np.ones((1, 256), np.float32)
    cos, sin = model.layers[0].self_attn.rotary.tables(8)
    for args, kind, match in [
            ((np.ones((1, 255), np.float32), cache_k, cache_v, 0), ValueError, "x: expected"),
            ((x, cache_k[:, :, :1], cache_v, 0), ValueError, "cache_k"),
            ((x, cache_k, cache_v[:, :4], 0), ValueError, "cache_v"),
            ((x, cache_k, cache_v, 8), ValueError, "pos"),
            ((x, cache_k, cache_v, 1.0), TypeError, "pos"),
            ((x, cache_k, cache_k, 0), ValueError, "overlap"),
            ((x, cache_k, cache_v, 0, cos[:, :3].copy(), sin), ValueError, "cos, sin"),
            ((x, cache_k, cache_v, 0, cos[:, :3], sin), ValueError, "cos: expected a C-cont"),
            ((x, cache_k, cache_v, 0, cos), ValueError, "cos, sin"),
            ((x.astype(np.float64), cache_k, cache_v, 0), TypeError, "x")]:
        with pytest.raises(kind, match=match):
            step.step(*args)
    read_only = x.copy()
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        step.step(read_only, cache_k, cache_v, 0)
    assert (x == 1).all() and not cache_k.any() and not cache_v.any()
    assert step.step(x, cache_k, cache_v, 0, cos, sin) is x
    assert cache_k[:, 0].any() and not cache_k[:, 1:].any()


@pytest.mark.parametrize("nx", [1, 3, 6])
@pytest.mark.parametrize("activations", ["f32", "q8_0"])
def test_matmul_many_is_each_product_alone(simd_path, nx, activations):
    rng = np.random.default_rng(nx)
    weights = [(qtype, quantized(Linear(512, nout, bias=False, rng=i), qtype, rng).qweight)
               for i, (qtype, nout) in enumerate([("Q4_K", 96), ("Q8_0", 33), ("F16", 20),
                                                  ("Q6_K", 64), ("Q4_1", 17)])]
    x = rng.standard_normal((nx, 512)).astype(np.float32)
    outs = kq.matmul_many(x, weights, activations=activations)
    for (qtype, raw), got in zip(weights, outs):
        np.testing.assert_array_equal(got, kq.matmul(x, qtype, raw, activations=activations))


def test_matmul_many_errors():
    raw = gguf.quants.quantize(np.ones((4, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    x = np.ones((1, 64), np.float32)
    with pytest.raises(ValueError, match="weights: expected 1 to 8"):
        kq.matmul_many(x, [])
    with pytest.raises(ValueError, match="weights: expected 1 to 8"):
        kq.matmul_many(x, [("Q8_0", raw)] * 9)
    with pytest.raises(TypeError, match=r"weights\[1\]"):
        kq.matmul_many(x, [("Q8_0", raw), raw])
    with pytest.raises(ValueError, match=r"Q4_K blocks"):
        kq.matmul_many(x, [("Q8_0", raw), ("Q4_K", raw)])
    with pytest.raises(ValueError, match="activations"):
        kq.matmul_many(x, [("Q8_0", raw)], activations="q4")


def test_a_step_reads_the_adapters_in_place(monkeypatch):
    """An optimizer steps the adapters' arrays in place: a step made before
    reads the new values (the same bits as one made after)."""
    model = keep_types(FAMILIES["qwen2-biases"]())
    lora.apply(model, rank=4, targets="all-linear", seed=0)
    before, _ = decode_tokens(model, 2, 2, False, monkeypatch)
    steps = [_decode_step.block_step(layer) for layer in model.layers]
    assert all(s is not None for s in steps)
    rng = np.random.default_rng(5)
    for _, a in lora.named_adapters(model):
        a.lora_b.data[...] = rng.uniform(-0.05, 0.05, a.lora_b.data.shape)
    after, _ = decode_tokens(model, 2, 2, False, monkeypatch)
    assert [_decode_step.block_step(layer) for layer in model.layers] == steps
    fresh, _ = decode_tokens(copy.deepcopy(model), 2, 2, False, monkeypatch)
    assert not np.array_equal(before[-1], after[-1])
    for a, b in zip(after, fresh):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "linear"])
def test_threads_decoding_at_once_each_get_their_own_numbers(kept):
    """The steps of a thread share one work area of that thread: two threads
    decoding at once (each its own copy of a model: a layer's forward buffers
    are its own, so a prompt's layer-by-layer pass is one thread's at a time)
    give what each gives alone."""
    import threading

    first = keep_types(FAMILIES["llama"](), kept)
    models_ = [first, copy.deepcopy(first)]
    prompts = [np.random.default_rng(s).integers(0, 97, (1, 6)) for s in (1, 2)]

    def run(model, prompt, out):
        cache = model.make_cache(1, 40)
        logits = [model.decode(prompt, cache).copy()]
        for t in range(30):
            logits.append(model.decode(np.array([[t % 97]]), cache).copy())
        out.extend(logits)

    alone = [[], []]
    for m, p, o in zip(models_, prompts, alone):
        run(m, p, o)
    together = [[], []]
    threads = [threading.Thread(target=run, args=(m, p, o))
               for m, p, o in zip(models_, prompts, together)]
    before = kernels.set_pool_linger(0.0125)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # each thread's decode held the pool's linger; the last to leave put it back
        assert kernels.set_pool_linger(before) == 0.0125
    finally:
        kernels.set_pool_linger(before)
    for a, b in zip(alone, together):
        assert len(a) == len(b) == 31
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_a_kept_step_is_read_again_after_any_change_to_its_parts(monkeypatch):
    """Between changes a block's step is not read again (nn._parts_version);
    each kind of change a step reads makes it read again, and decoding then
    gives the layers' numbers: a Linear weight's array replaced, an adapter's
    scale, a bias, a storage move (an OptContext's arena), a norm's eps, the
    layers' mode, a bf16 pass."""
    model = keep_types(FAMILIES["qwen2-biases"](), kept=False)
    lora.apply(model, rank=4, targets=("q_proj", "down_proj"), seed=0)
    for _, a in lora.named_adapters(model):
        a.lora_b.data[...] = 0.01
    layer = model.layers[0]
    step = _decode_step.block_step(layer)
    assert step is not None and _decode_step.block_step(layer) is step
    rng = np.random.default_rng(5)
    attn, mlp = layer.self_attn, layer.mlp

    def changes():
        k = attn.k_proj.weight
        yield lambda: setattr(k, "data", rng.standard_normal(k.data.shape).astype(np.float32))
        yield lambda: setattr(attn.q_proj, "scaling", attn.q_proj.scaling * 3)
        yield lambda: setattr(attn.v_proj.bias, "data", np.full(attn.v_proj.bias.shape, 0.5,
                                                                  np.float32))
        w = mlp.up_proj.weight
        yield lambda: w._set_storage(w.data * 2, None)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):   # one eps
            yield lambda norm=norm: setattr(norm, "eps", 0.5)

    for i, change in enumerate(changes()):
        before = _decode_step.block_step(layer)
        change()
        after = _decode_step.block_step(layer)
        if i == 4:   # the first norm's eps alone: norms unlike each other, no step
            assert after is None
            continue
        assert after is not None and after is not before
        fast, _ = decode_tokens(model, 1, 2, False, monkeypatch)
        slow, _ = decode_tokens(model, 1, 2, True, monkeypatch)
        for a, b in zip(fast, slow):
            assert np.abs(a - b).max() <= 64 * (256 + 512) * U * np.abs(b).max()
    model.layers[1].mlp.down_proj.lora_dropout.p = 0.5
    model.train()   # an adapter dropping out: the layers' own way, read at once
    assert _decode_step.block_step(model.layers[1]) is None
    model.eval()
    assert _decode_step.block_step(model.layers[1]) is not None
    with gemm.products_in("bf16"):
        assert _decode_step.block_step(layer) is None


def test_a_step_over_adapted_kept_weights_follows_their_bases(monkeypatch):
    """An adapter's base layer is held outside the sub-modules: its settings
    count too (set_activations on every projection under an adapter; a base's
    setting deleted); and a block part replaced by a new object holding the
    same layers is watched from then on."""
    model = keep_types(FAMILIES["llama"]())
    lora.apply(model, rank=4, targets="all-linear", seed=0)
    for _, a in lora.named_adapters(model):
        a.lora_b.data[...] = 0.01
    layer = model.layers[0]
    first = _decode_step.block_step(layer)
    set_activations(model, "q8_0")
    second = _decode_step.block_step(layer)
    assert second is not first
    fast, _ = decode_tokens(model, 1, 3, False, monkeypatch)
    slow, _ = decode_tokens(model, 1, 3, True, monkeypatch)
    for a, b in zip(fast, slow):   # the adapters' sums are the step's own: not bits
        assert np.abs(a - b).max() <= 64 * (256 + 512) * U * np.abs(b).max()
    for p, _, _ in layer.step_projections():
        del p._base.activations   # back to the class's setting, "f32"
    assert _decode_step.block_step(layer) is not second
    # the same layers in a new container: the same step, and the container watched
    old = layer.mlp
    new = type(old).__new__(type(old))   # a new SwiGLU holding the same layers
    vars(new).update({k: v for k, v in vars(old).items() if k != "_parts_watched"})
    layer.mlp = new
    third = _decode_step.block_step(layer)
    new.down_proj = Linear(512, 256, bias=False, rng=0)   # float32 weights now
    fourth = _decode_step.block_step(layer)
    assert third is not None and fourth is not None and fourth is not third
