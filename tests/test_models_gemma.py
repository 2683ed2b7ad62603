"""Gemma (1): Llama's block with Gemma's norms (1 + weight), GeGLU, embeddings scaled
by sqrt(hidden), an explicit head width and optional biases on the attention's four
projections.  Logits and every gradient equal transformers' GemmaForCausalLM;
checkpoints go both ways (the published configs' legacy keys read as transformers
reads them); greedy generation is transformers'; what is not implemented is refused;
llama.cpp's gemma runs save_gguf's file and save_gguf_lora's adapters (over a float
base and over a Q8_0 base kept in its types and fine-tuned) to the same logits."""
import json
import os
import sys
import warnings

import numpy as np
import pytest
from hf_oracle import assert_cache_equals_recompute, assert_equals_transformers, randomised

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import Gemma, GemmaConfig, Llama, LlamaConfig
from ggmlopt.models.gemma3 import GeGLU, GemmaRMSNorm
from ggmlopt.nn import RopeScaling

HERE = os.path.dirname(os.path.abspath(__file__))
V = 67


def _import_from_llamacpp_tests():
    """tests/llamacpp's helper modules made importable."""
    where = os.path.join(HERE, "llamacpp")
    if where not in sys.path:
        sys.path.insert(0, where)

CONFIGS = {
    # gemma-2b's shape in small: grouped heads (4 over 2) of 12 over a hidden size of 32
    # (32 / 4 = 8), a tied head
    "gqa-tied": GemmaConfig(vocab_size=V, dim=32, n_layers=3, n_heads=4, n_kv_heads=2,
                            head_dim=12, ffn_dim=48, max_seq_len=256),
    # every other field away from its default: one key/value head, heads wider than
    # 48 / 4, an untied head, biases on q, k, v and o, linear scaling, base and eps
    "untied-biased-linear": GemmaConfig(vocab_size=V, dim=48, n_layers=2, n_heads=4,
                                        n_kv_heads=1, head_dim=16, ffn_dim=64,
                                        max_seq_len=256, norm_eps=1e-5, rope_base=500.0,
                                        tie_embeddings=False, attention_bias=True,
                                        rope_scaling=RopeScaling("linear", 4.0)),
    # rope_parameters' YaRN, as transformers' Gemma computes it
    "yarn": GemmaConfig(vocab_size=V, dim=32, n_layers=2, n_heads=2, n_kv_heads=1,
                        head_dim=24, ffn_dim=40, max_seq_len=256,
                        rope_scaling=RopeScaling("yarn", 4.0,
                                                 original_max_position_embeddings=64)),
}


def test_gemma_parts():
    model = Gemma(CONFIGS["gqa-tied"], seed=0)
    params = dict(model.named_parameters())
    for name in ("layers.0.input_layernorm", "layers.0.post_attention_layernorm", "norm"):
        assert not params[f"{name}.weight"].data.any()   # Gemma's norm: a scale of 1 + 0
    assert "lm_head.weight" not in params and isinstance(model, Llama)
    assert "layers.0.pre_feedforward_layernorm.weight" not in params   # Gemma 3's, not here
    assert "layers.0.self_attn.q_norm.weight" not in params
    layer = model.layers[0]
    assert isinstance(layer.input_layernorm, GemmaRMSNorm) and isinstance(layer.mlp, GeGLU)
    assert layer.self_attn.head_dim == 12 and params["layers.0.self_attn.q_proj.weight"].shape \
        == (32, 48)
    biased = Gemma(CONFIGS["untied-biased-linear"], seed=0)
    names = dict(biased.named_parameters())
    assert {f"layers.0.self_attn.{p}_proj.bias" for p in "qkvo"} <= names.keys()
    assert "lm_head.weight" in names
    with pytest.raises(ValueError, match="qkv_bias: a Gemma's biases are attention_bias"):
        GemmaConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2, head_dim=4, qkv_bias=True)
    with pytest.raises(TypeError, match="attention_bias: expected a bool"):
        GemmaConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2, head_dim=4, attention_bias=1)
    with pytest.raises(TypeError, match="config: expected a GemmaConfig"):
        Gemma(LlamaConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2))


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 7, 64, 129])
def test_logits_and_gradients_equal_transformers(tmp_path, kind, T):
    from ggmlopt.io import load_hf
    model = randomised(Gemma(CONFIGS[kind], seed=1), T)
    # assert_equals_transformers: the other families' bound, 1e-4 of the logits' and of
    # each gradient's scale (float32 sums in other orders, amplified through the blocks)
    assert_equals_transformers(model, "GemmaForCausalLM", tmp_path, T, eager=True)
    back = load_hf(tmp_path)
    assert type(back) is Gemma and back.config == model.config
    tokens = np.random.default_rng(T).integers(0, V, (2, T))
    np.testing.assert_array_equal(back.forward(tokens), model.forward(tokens))


def _transformers_checkpoint(tmp_path, **kw):
    """A random GemmaForCausalLM written by transformers' own save_pretrained, its
    norms moved off zero and its matrices 8 times wider than their initialisation's
    (activations that reach the GELU's curved part, as a trained model's)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    hc = transformers.GemmaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=256,
        **kw)
    torch.manual_seed(0)
    hf = transformers.GemmaForCausalLM(hc).eval()
    with torch.no_grad():
        for _, p in hf.named_parameters():
            if p.ndim == 1:
                p.uniform_(-0.5, 0.5)
            else:
                p.mul_(8.0)
    hf.save_pretrained(tmp_path)
    return hf


def _hf_logits(hf, tokens):
    import torch
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits.numpy()


def test_transformers_checkpoint_loads(tmp_path):
    from ggmlopt.io import load_hf
    # transformers 5's rope_parameters, with a base and a scaling of their own
    hf = _transformers_checkpoint(tmp_path, rms_norm_eps=1e-5, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0})
    model = load_hf(tmp_path)
    assert type(model) is Gemma and model.config.head_dim == 12
    assert model.config.tie_embeddings and model.config.norm_eps == 1e-5
    assert model.config.rope_base == 1000.0
    assert model.config.rope_scaling == RopeScaling("linear", 2.0)
    assert model.embed_tokens.padding_idx == 0   # GemmaConfig's pad_token_id
    tokens = np.random.default_rng(0).integers(0, V, (2, 40))
    want = _hf_logits(hf, tokens)
    # float32 sums in other orders: the other families' bound, 1e-4 of scale
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())


def test_published_legacy_keys_are_read_as_transformers_reads_them(tmp_path):
    """gemma-2b's config.json says hidden_act "gelu" (GemmaConfig computes the tanh
    GELU for it), gemma-1.1's adds hidden_activation "gelu_pytorch_tanh", and 4.x's
    give RoPE as rope_theta and rope_scaling with the old key 'type'."""
    transformers = pytest.importorskip("transformers")
    from transformers.activations import ACT2FN

    from ggmlopt.io import load_hf
    _transformers_checkpoint(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["rope_parameters"]
    cfg.update(hidden_act="gelu", hidden_activation="gelu_pytorch_tanh", rope_theta=500.0,
               rope_scaling={"type": "linear", "factor": 4.0})
    path.write_text(json.dumps(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.GemmaForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.hidden_act == "gelu_pytorch_tanh"
    model = load_hf(tmp_path)
    assert model.config.rope_base == 500.0
    assert model.config.rope_scaling == RopeScaling("linear", 4.0)
    tokens = np.random.default_rng(1).integers(0, V, (2, 50))
    want = _hf_logits(hf, tokens)
    scale = np.abs(want).max()
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0, atol=1e-4 * scale)
    # the MLP alone, on inputs that reach the GELU's curved part: transformers' within
    # float32 rounding (sums of 32 and 48 products, about 80 * 2^-24 of scale each, two in
    # a row: 1e-5), and the exact GELU (what "gelu" means elsewhere) farther than that
    import torch
    x = np.random.default_rng(2).normal(0, 4, (64, 32)).astype(np.float32)
    mlp = hf.model.layers[0].mlp
    with torch.no_grad():
        tanh = mlp(torch.tensor(x)).numpy()
        mlp.act_fn = ACT2FN["gelu"]
        exact = mlp(torch.tensor(x)).numpy()
    ours = model.layers[0].mlp.forward(x)
    bound = 1e-5 * np.abs(tanh).max()
    assert np.abs(ours - tanh).max() <= bound
    assert np.abs(ours - exact).max() > bound


@pytest.mark.parametrize("edit,match", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention: only causal"),
    ({"hidden_act": "silu"}, "hidden_act: only gelu_pytorch_tanh"),
    ({"hidden_activation": "gelu"}, "hidden_activation: only gelu_pytorch_tanh"),
    ({"head_dim": None}, "head_dim: expected an int"),
    ({"attention_bias": "yes"}, "attention_bias: expected true or false"),
    # not a Gemma's (transformers' Gemma never reads them): refused, not dropped
    ({"mlp_bias": True}, r"keys \['mlp_bias'\]"),
    ({"final_logit_softcapping": 30.0}, r"keys \['final_logit_softcapping'\]"),
    ({"sliding_window": 4096}, r"keys \['sliding_window'\]"),
    ({"some_new_key": 1}, r"keys \['some_new_key'\]"),
])
def test_what_is_not_implemented_is_refused(tmp_path, edit, match):
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    save_hf(Gemma(CONFIGS["gqa-tied"], seed=0), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ValueError, match=match):
        load_hf(tmp_path)


def test_dropout_is_warned_about(tmp_path):
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    save_hf(Gemma(CONFIGS["gqa-tied"], seed=0), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "attention_dropout": 0.1}))
    with pytest.warns(UserWarning, match="applies no dropout"):
        load_hf(tmp_path)


@pytest.mark.parametrize("kind", ["gqa-tied", "untied-biased-linear"])
def test_greedy_generation_is_transformers(tmp_path, kind):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from ggmlopt.io import save_hf
    model = randomised(Gemma(CONFIGS[kind], seed=2), 2)
    save_hf(model, tmp_path)
    hf = transformers.GemmaForCausalLM.from_pretrained(tmp_path,
                                                        attn_implementation="eager").eval()
    prompt = np.random.default_rng(5).integers(0, V, 20)
    x = torch.tensor(prompt[None])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12,
                           do_sample=False, pad_token_id=0, eos_token_id=None)
    ours = go.generate(model, prompt, 12, temperature=0, stop_ids=())
    np.testing.assert_array_equal(ours, want[0, prompt.size:].numpy())


@pytest.mark.parametrize("kind", ["gqa-tied", "untied-biased-linear"])
def test_cache_packing_and_checkpointing(kind):
    from test_packing import _alone, _documents, _loss_and_grads, _packed
    model = randomised(Gemma(CONFIGS[kind], seed=2), 3)
    assert_cache_equals_recompute(model, [3, 1, 4, 1, 5, 9, 2, 6], 12)
    inputs, labels = _documents(2)
    inputs = [np.minimum(a, V - 1) for a in inputs]
    labels = [np.minimum(b, V - 1) for b in labels]
    xp, yp = _packed(inputs, labels)
    xa, ya = _alone(inputs, labels)
    lp, gp, _ = _loss_and_grads(model, xp, yp)
    la, ga, _ = _loss_and_grads(model, xa, ya)
    # the loss is a float64 mean of the same float32 logits' log-softmax: packed and
    # alone differ by the logits' float32 rounding
    assert abs(lp - la) <= 1e-6 * abs(la)
    scale = max(np.abs(g).max() for g in ga.values())
    # packed and alone sum in other orders: 1e-6 of scale a block, as Gemma 3's test
    depth = model.config.n_layers
    for k in ga:
        np.testing.assert_allclose(gp[k], ga[k], rtol=0, atol=1e-6 * scale * depth, err_msg=k)
    model.train()
    model.gradient_checkpointing_enable()
    _, gc, _ = _loss_and_grads(model, xa, ya)
    for k in ga:   # recomputed activations: the same gradients, bit for bit
        np.testing.assert_array_equal(gc[k], ga[k], err_msg=k)


# ---- llama.cpp's gemma: save_gguf, load_gguf, save_gguf_lora ---------------------------

GGUF_CONFIGS = {
    # heads of 24 over 64 / 4 = 16 (gemma-7b's 256 over 3072 / 16), grouped 4 over 2
    "plain": {},
    # the keys beyond the defaults: linear scaling, a RoPE base, an eps
    "scaled": {"rope_scaling": RopeScaling("linear", 4.0), "rope_base": 500.0,
               "norm_eps": 1e-5},
}


def _gguf_gemma(seed=3, **kw):
    """A Gemma over ByteTokenizer's ids whose logits depend on its weights (matrices
    N(0, 0.08), norms U(-0.5, 0.5)) more than on rounding."""
    from ggmlopt.text import ByteTokenizer
    model = Gemma(GemmaConfig(vocab_size=ByteTokenizer().vocab_size, dim=64, n_layers=2,
                              n_heads=4, n_kv_heads=2, head_dim=24, ffn_dim=96, max_seq_len=64,
                              **kw), seed=seed)
    rng = np.random.default_rng(seed + 100)
    for _, p in model.named_parameters():
        if p.data.ndim == 2:
            p.data *= 4.0
        else:
            p.data[...] = rng.uniform(-0.5, 0.5, p.shape)
    return model


def _llamacpp():
    """tests/llamacpp's runner: llama.cpp with an f32 KV cache, every position's logits."""
    pytest.importorskip("llama_cpp")
    _import_from_llamacpp_tests()
    import llamacpp_run
    return llamacpp_run


TEXT = "Gemma's norms, its GELU and its scaled embedding, computed by llama.cpp: é ✓"
# ggml's GELU reads a float16 table: Gemma 3's and GPT-2's files agree with llama.cpp to
# 2^-11 of the logits' scale (tests/llamacpp/test_llamacpp_gguf.py's bound for them)
GELU_TOL = 2e-3


@pytest.mark.parametrize("kind", list(GGUF_CONFIGS))
def test_load_gguf_reads_save_ggufs_file_as_the_model(tmp_path, kind):
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    model = _gguf_gemma(**GGUF_CONFIGS[kind])
    path = tmp_path / "gemma.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer())
    back, tok = load_gguf(path)
    assert type(back) is Gemma and back.config == model.config
    assert isinstance(tok, ByteTokenizer)
    theirs = dict(back.named_parameters())
    one = np.float32(1.0)
    for name, p in model.named_parameters():
        if p.data.ndim == 1:
            # the file holds 1 + w (llama.cpp's gemma multiplies by it): that sum's bits,
            # which the norm computes again from the weight read back
            np.testing.assert_array_equal(one + theirs[name].data, one + p.data, err_msg=name)
        else:
            np.testing.assert_array_equal(theirs[name].data, p.data, err_msg=name)
    ids = np.array(ByteTokenizer().encode(TEXT)[:64])
    np.testing.assert_array_equal(back(ids[None]), model(ids[None]))


@pytest.mark.parametrize("kind", list(GGUF_CONFIGS))
def test_llama_cpp_computes_save_ggufs_file_to_our_logits(tmp_path, kind):
    pytest.importorskip("gguf")
    run = _llamacpp()
    from ggmlopt.io import save_gguf
    from ggmlopt.text import ByteTokenizer
    model = _gguf_gemma(**GGUF_CONFIGS[kind])
    path = tmp_path / "gemma.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer())
    ids = np.array(ByteTokenizer().encode(TEXT)[:64])
    theirs = run.logits_of(run.open_llama(path), ids)
    ours = model(ids[None])[0].astype(np.float64)
    assert run.relative(theirs, ours) <= GELU_TOL
    # the norms' 1 + w counts: with the file's offset ignored the logits are far off
    for _, p in model.named_parameters():
        if p.data.ndim == 1:
            p.data += 1.0
    assert run.relative(theirs, model(ids[None])[0]) > 10 * GELU_TOL


def test_what_llama_cpps_gemma_cannot_hold_is_refused(tmp_path):
    pytest.importorskip("gguf")
    from ggmlopt.io import save_gguf, save_gguf_lora
    from ggmlopt.text import ByteTokenizer
    for kw, match in [({"tie_embeddings": False}, "takes its head from the token embedding"),
                      ({"attention_bias": True}, "no bias on its attention's output")]:
        model = _gguf_gemma(**kw)
        with pytest.raises(ValueError, match=match):
            save_gguf(model, tmp_path / "g.gguf", tokenizer=ByteTokenizer())
        assert not (tmp_path / "g.gguf").exists()
        lora.apply(model, rank=4, alpha=8.0, targets="all-linear")
        with pytest.raises(ValueError, match=match):
            save_gguf_lora(model, tmp_path / "a.gguf")
        assert not (tmp_path / "a.gguf").exists()
    # a Llama 3 scaling is llama.cpp's rope_freqs tensor, which its gemma does not read
    llama3 = RopeScaling("llama3", 8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=16)
    with pytest.raises(ValueError, match="rope_freqs tensor, which its gemma"):
        save_gguf(_gguf_gemma(rope_scaling=llama3), tmp_path / "g.gguf",
                  tokenizer=ByteTokenizer())
    assert not (tmp_path / "g.gguf").exists()


def test_llama_cpp_applies_our_adapter_to_a_gemma(tmp_path):
    pytest.importorskip("gguf")
    run = _llamacpp()
    from ggmlopt.io import save_gguf, save_gguf_lora
    from ggmlopt.text import ByteTokenizer
    model = _gguf_gemma()
    base = tmp_path / "base.gguf"
    save_gguf(model, base, tokenizer=ByteTokenizer())
    lora.apply(model, rank=4, alpha=8.0, targets="all-linear", seed=1)
    rng = np.random.default_rng(5)
    for _, layer in lora.named_adapters(model):   # zeros would test nothing
        layer.lora_a.data[...] = rng.normal(0, 0.05, layer.lora_a.shape)
        layer.lora_b.data[...] = rng.normal(0, 0.05, layer.lora_b.shape)
    adapter = tmp_path / "adapter.gguf"
    save_gguf_lora(model, adapter)
    ids = np.array(ByteTokenizer().encode(TEXT)[:64])
    ours = model(ids[None])[0].astype(np.float64)
    theirs = run.logits_of(run.open_llama(base, adapter), ids)
    assert run.relative(theirs, ours) <= GELU_TOL
    # the adapter is applied: without it llama.cpp is farther than the bound
    assert run.relative(run.logits_of(run.open_llama(base), ids), ours) > 10 * GELU_TOL
    # and applied as merging it into the weights: both through llama.cpp's same GELU,
    # float32 rounding of the merged weights apart (the families' 1e-4 of scale)
    lora.merge(model)
    merged = tmp_path / "merged.gguf"
    save_gguf(model, merged, tokenizer=ByteTokenizer())
    assert run.relative(theirs, run.logits_of(run.open_llama(merged), ids)) <= 1e-4


def test_a_fine_tune_over_a_kept_q8_0_base_is_applied_by_llama_cpp(tmp_path):
    """gemma-2b-it's path: a quantized GGUF loaded with keep_types=True, LoRA applied,
    a few steps of fit, the adapter written and applied by llama.cpp to that file."""
    pytest.importorskip("gguf")
    run = _llamacpp()
    from ggmlopt.io import load_gguf, save_gguf, save_gguf_lora
    from ggmlopt.text import ByteTokenizer
    tok = ByteTokenizer()
    model = _gguf_gemma()
    path = tmp_path / "q8_0.gguf"
    save_gguf(model, path, tokenizer=tok, dtype="q8_0")
    kept, _ = load_gguf(path, keep_types=True)
    assert type(kept) is Gemma
    assert type(kept.layers[0].mlp.down_proj).__name__ == "QuantizedLinear"
    lora.apply(kept, rank=4, alpha=8.0, targets="all-linear", seed=0)
    ids = np.random.default_rng(0).integers(0, tok.vocab_size, 8 * 8 + 17)
    data = go.Dataset.from_tokens(ids, n_ctx=16)
    go.fit(kept, data, "cross_entropy",
           lambda epoch: go.OptimizerParams(go.AdamWParams(alpha=3e-2)), nepoch=3,
           nbatch_logical=4, silent=True, seed=0)
    assert any(np.abs(layer.lora_b.data).max() > 0 for _, layer in lora.named_adapters(kept))
    adapter = tmp_path / "adapter.gguf"
    save_gguf_lora(kept, adapter)
    text = np.array(tok.encode(TEXT)[:64])
    ours = kept(text[None])[0].astype(np.float64)
    theirs = run.logits_of(run.open_llama(path, adapter), text)
    # llama.cpp multiplies a Q8_0 base with 8-bit activations: the error of rounding
    # the weights to Q8_0 bounds that (twice, as tests/llamacpp's Q8_0 tests), plus GELU's
    bound = 2 * run.eight_bit_error(model, text) + GELU_TOL
    assert run.relative(theirs, ours) <= bound
    # the trained adapter moved llama.cpp's logits by more than that bound
    assert run.relative(theirs, run.logits_of(run.open_llama(path), text)) > bound


def test_load_gguf_reads_llama_cpps_conversion_bit_for_bit(tmp_path):
    """llama.cpp's own convert_hf_to_gguf (GemmaModel) of save_hf's checkpoint:
    load_gguf gives back the config and every parameter's bits."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    if not os.environ.get("GGMLOPT_LLAMA_CPP_SRC"):
        pytest.skip("GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source, for convert_hf_to_gguf.py) "
                    "is not set")
    _import_from_llamacpp_tests()
    from test_llamacpp_convert import _convert

    from ggmlopt.io import load_gguf, save_hf
    from ggmlopt.text import ByteTokenizer
    model = _gguf_gemma()
    save_hf(model, tmp_path / "hf")
    out = tmp_path / "converted.gguf"
    _convert(tmp_path / "hf", out, tmp_path)
    back, tok = load_gguf(out)
    assert isinstance(tok, ByteTokenizer)
    assert type(back) is Gemma and back.config == model.config
    theirs = dict(back.named_parameters())
    one = np.float32(1.0)
    for name, p in model.named_parameters():
        if p.data.ndim == 1:   # the converter adds 1 in float32, as save_gguf does
            np.testing.assert_array_equal(one + theirs[name].data, one + p.data, err_msg=name)
        else:
            np.testing.assert_array_equal(theirs[name].data, p.data, err_msg=name)
