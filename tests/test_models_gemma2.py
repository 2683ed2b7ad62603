"""Gemma 2: Gemma 3's block without q/k norms (Gemma's norms, four a block, GeGLU,
embeddings scaled by sqrt(hidden), the scores scaled by query_pre_attn_scalar), one
RoPE on every layer, local (windowed) and global layers, and soft caps on the scores
and on the final logits.  Logits and every gradient equal transformers'
Gemma2ForCausalLM; checkpoints go both ways (the published configs' keys read as
transformers reads them); greedy generation is transformers'; what is not
implemented is refused; llama.cpp's gemma2 runs save_gguf's file (and its 27B scale
rule) and save_gguf_lora's adapters (over a float base and over a Q8_0 base kept in its
types and fine-tuned) to the same logits, and load_gguf reads its converter's file."""
import json
import os
import sys
import warnings

import numpy as np
import pytest
from hf_oracle import assert_cache_equals_recompute, assert_equals_transformers, randomised

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import Gemma2, Gemma2Config, Llama, LlamaConfig
from ggmlopt.models.gemma2 import FAMILY
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
    # gemma-2's default pattern in small: layers 0 and 2 local with a window of 5, 1 and 3
    # global; 4 heads of 12 over a hidden size of 32 grouped over 2; a scalar other than
    # head_dim; caps small enough to bend the scores and the logits (see _spread)
    "default-pattern": Gemma2Config(vocab_size=V, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                                    head_dim=12, ffn_dim=48, max_seq_len=256,
                                    query_pre_attn_scalar=20.0, sliding_window=5,
                                    attn_logit_softcap=3.0, final_logit_softcap=5.0),
    # every other field away from its default: a given pattern (a global first layer), one
    # key/value head, an untied head, linear scaling on every layer, base and eps
    "untied-scaled": Gemma2Config(vocab_size=V, dim=32, n_layers=3, n_heads=2, n_kv_heads=1,
                                  head_dim=16, ffn_dim=40, max_seq_len=256, norm_eps=1e-5,
                                  rope_base=5000.0, rope_scaling=RopeScaling("linear", 4.0),
                                  sliding_layers=(False, True, True), sliding_window=9,
                                  tie_embeddings=False, query_pre_attn_scalar=16.0,
                                  attn_logit_softcap=2.0, final_logit_softcap=8.0),
    # rope_parameters' YaRN, which transformers' Gemma 2 applies to every layer
    "yarn": Gemma2Config(vocab_size=V, dim=32, n_layers=3, n_heads=2, n_kv_heads=1,
                         head_dim=24, ffn_dim=40, max_seq_len=256, sliding_window=6,
                         rope_scaling=RopeScaling("yarn", 4.0,
                                                  original_max_position_embeddings=64),
                         attn_logit_softcap=4.0, final_logit_softcap=3.0),
}


def _spread(model, seed):
    """model's norms drawn from U(0.5, 1.5) (hf_oracle.randomised) and its matrices 8
    times their initialisation's N(0, 0.02): scores and logits that reach the caps'
    curved part, as a trained model's do."""
    randomised(model, seed)
    for _, p in model.named_parameters():
        if p.data.ndim == 2:
            p.data *= 8.0
    return model


def _uncapped(model):
    """model without either soft cap (the caps are attributes the forward reads)."""
    model.final_logit_softcap = None
    for layer in model.layers:
        layer.self_attn.logit_softcap = None
    return model


def test_gemma2_parts():
    model = Gemma2(CONFIGS["default-pattern"], seed=0)
    params = dict(model.named_parameters())
    for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        assert not params[f"layers.0.{name}.weight"].data.any()   # Gemma's 1 + 0
    assert "layers.0.self_attn.q_norm.weight" not in params   # Gemma 3's, not here
    assert "lm_head.weight" not in params and isinstance(model, Llama)
    assert [n for n, _ in FAMILY.parameter_shapes(model.config)] == list(params)
    assert all(p.shape == s for (_, p), (_, s) in
               zip(model.named_parameters(), FAMILY.parameter_shapes(model.config)))
    layer = model.layers[0]
    assert isinstance(layer.input_layernorm, GemmaRMSNorm) and isinstance(layer.mlp, GeGLU)
    # transformers' default pattern: layer 0 local, then alternating; one RoPE base
    assert [la.self_attn.sliding_window for la in model.layers] == [5, None, 5, None]
    assert {la.self_attn.rotary.base for la in model.layers} == {10000.0}
    assert {la.self_attn.logit_softcap for la in model.layers} == {3.0}
    assert model.final_logit_softcap == 5.0
    default = Gemma2Config(vocab_size=8, dim=8, n_layers=3, n_heads=2, head_dim=4)
    assert default.sliding_layers == (True, False, True) and default.sliding_window == 4096
    assert (default.attn_logit_softcap, default.final_logit_softcap) == (50.0, 30.0)
    assert default.query_pre_attn_scalar == 256.0 and default.tie_embeddings
    untied = Gemma2(CONFIGS["untied-scaled"], seed=0)
    assert "lm_head.weight" in dict(untied.named_parameters())
    assert [la.self_attn.sliding_window for la in untied.layers] == [None, 9, 9]


@pytest.mark.parametrize("kw,error,match", [
    ({"sliding_layers": (True,)}, ValueError, "sliding_layers: expected 2 flags"),
    ({"sliding_window": None}, ValueError, "sliding_window: expected an int >= 1, got None"),
    ({"sliding_window": None, "sliding_layers": (False, False)}, ValueError,
     "transformers' Gemma 2 refuses too"),
    ({"sliding_window": 0}, ValueError, "sliding_window: expected an int >= 1, got 0"),
    ({"sliding_window": 4.0}, TypeError, "sliding_window: expected an int"),
    ({"qkv_bias": True}, ValueError, "qkv_bias: a Gemma 2 has no biases"),
    ({"attn_logit_softcap": 0.0}, ValueError, "attn_logit_softcap: expected None or a finite"),
    ({"final_logit_softcap": float("inf")}, ValueError, "final_logit_softcap: expected None"),
    ({"final_logit_softcap": "30"}, TypeError, "final_logit_softcap: expected None or a float"),
    ({"query_pre_attn_scalar": -1.0}, ValueError, "query_pre_attn_scalar: expected a finite"),
])
def test_bad_configs_are_refused_by_name(kw, error, match):
    with pytest.raises(error, match=match):
        Gemma2Config(**{"vocab_size": 8, "dim": 8, "n_layers": 2, "n_heads": 2,
                        "head_dim": 4, **kw})


def test_a_config_of_another_family_is_refused():
    with pytest.raises(TypeError, match="config: expected a Gemma2Config"):
        Gemma2(LlamaConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2))


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 7, 64])
def test_logits_and_gradients_equal_transformers(tmp_path, kind, T):
    from ggmlopt.io import load_hf
    model = _spread(Gemma2(CONFIGS[kind], seed=1), T)
    # assert_equals_transformers: the other families' bound, 1e-4 of the logits' and of
    # each gradient's scale (float32 sums in other orders, amplified through the blocks)
    assert_equals_transformers(model, "Gemma2ForCausalLM", tmp_path, T, eager=True)
    back = load_hf(tmp_path)
    assert type(back) is Gemma2 and back.config == model.config
    tokens = np.random.default_rng(T).integers(0, V, (2, T))
    np.testing.assert_array_equal(back.forward(tokens), model.forward(tokens))


def _hf_logits(hf, tokens):
    import torch
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("kind", ["default-pattern", "untied-scaled"])
def test_the_caps_and_the_window_count(tmp_path, kind):
    """What the oracle test holds is not met by chance: without either cap, or with
    every layer global, the logits are far from transformers' (10x the bound)."""
    transformers = pytest.importorskip("transformers")
    from ggmlopt.io import save_hf
    model = _spread(Gemma2(CONFIGS[kind], seed=1), 3)
    save_hf(model, tmp_path)
    hf = transformers.Gemma2ForCausalLM.from_pretrained(tmp_path,
                                                         attn_implementation="eager").eval()
    tokens = np.random.default_rng(3).integers(0, V, (2, 64))
    want = _hf_logits(hf, tokens)
    bound = 1e-4 * np.abs(want).max()
    assert np.abs(model(tokens) - want).max() <= bound
    assert np.abs(model(tokens)).max() < model.config.final_logit_softcap
    model.final_logit_softcap = None
    assert np.abs(model(tokens) - want).max() > 10 * bound
    model.final_logit_softcap = model.config.final_logit_softcap
    for layer in model.layers:
        layer.self_attn.logit_softcap = None
    assert np.abs(model(tokens) - want).max() > 10 * bound
    for layer in model.layers:
        layer.self_attn.logit_softcap = model.config.attn_logit_softcap
        layer.self_attn.sliding_window = None
    assert np.abs(model(tokens) - want).max() > 10 * bound


def _transformers_checkpoint(tmp_path, **kw):
    """A random Gemma2ForCausalLM written by transformers' own save_pretrained, its
    norms moved off zero and its matrices 8 times wider than their initialisation's
    (scores and logits that reach the caps' curved part, as a trained model's)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    base = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 12, "max_position_embeddings": 256, "sliding_window": 5,
            "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0}
    hc = transformers.Gemma2Config(**{**base, **kw})
    torch.manual_seed(0)
    hf = transformers.Gemma2ForCausalLM(hc).eval()
    with torch.no_grad():
        for _, p in hf.named_parameters():
            if p.ndim == 1:
                p.uniform_(-0.5, 0.5)
            else:
                p.mul_(8.0)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("kw", [
    # transformers' defaults but for the shapes, the window and the caps
    {},
    # every field of Gemma2Config away from its default: RoPE (rope_parameters), eps,
    # scalar, layer types, an untied head, no caps at all
    {"rms_norm_eps": 1e-5, "query_pre_attn_scalar": 30, "tie_word_embeddings": False,
     "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"], "attn_logit_softcapping": None,
     "final_logit_softcapping": None,
     "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}},
])
def test_transformers_checkpoint_loads(tmp_path, kw):
    from ggmlopt.io import load_hf
    hf = _transformers_checkpoint(tmp_path, **kw)
    model = load_hf(tmp_path)
    assert type(model) is Gemma2 and model.config.head_dim == 12
    assert model.embed_tokens.padding_idx == 0   # Gemma2Config's pad_token_id
    if kw:
        cfg = model.config
        assert (cfg.norm_eps, cfg.query_pre_attn_scalar, cfg.tie_embeddings) == (1e-5, 30.0,
                                                                                  False)
        assert cfg.sliding_layers == (False, True, True, False)
        assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None
        assert model.final_logit_softcap is None
        assert cfg.rope_base == 1000.0 and cfg.rope_scaling == RopeScaling("linear", 2.0)
    else:
        assert model.config.sliding_layers == (True, False, True, False)
    tokens = np.random.default_rng(0).integers(0, V, (2, 40))
    want = _hf_logits(hf, tokens)
    # float32 sums in other orders: the other families' bound, 1e-4 of scale
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())


def test_published_config_keys_are_read_as_transformers_reads_them(tmp_path):
    """gemma-2-9b's config.json in small: 4.x's rope_theta, hidden_act beside
    hidden_activation, sliding_window_size beside sliding_window, no layer_types,
    cache_implementation, an eos list."""
    transformers = pytest.importorskip("transformers")
    from ggmlopt.io import load_hf
    _transformers_checkpoint(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    for key in ("rope_parameters", "layer_types"):
        cfg.pop(key, None)
    cfg.update(rope_theta=500.0, hidden_act="gelu_pytorch_tanh",
               hidden_activation="gelu_pytorch_tanh", sliding_window_size=5,
               cache_implementation="hybrid", eos_token_id=[1, 3], torch_dtype="float32")
    path.write_text(json.dumps(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.Gemma2ForCausalLM.from_pretrained(
            tmp_path, attn_implementation="eager").eval()
    model = load_hf(tmp_path)
    assert model.config.rope_base == 500.0
    assert model.config.sliding_layers == (True, False, True, False)
    tokens = np.random.default_rng(1).integers(0, V, (2, 50))
    want = _hf_logits(hf, tokens)
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("edit,match", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention: only causal"),
    ({"attention_bias": True}, "attention_bias: a Gemma 2 with biases"),
    ({"hidden_activation": "gelu"}, "hidden_activation: only gelu_pytorch_tanh"),
    ({"hidden_act": "silu"}, "hidden_act: 'silu', where transformers' Gemma 2 computes"),
    ({"sliding_window_size": 2048}, "sliding_window_size: 2048, but sliding_window"),
    ({"sliding_window": None}, "sliding_window: expected an int >= 1, got None"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types: expected sliding_attention"),
    ({"layer_types": ["full_attention"]}, "sliding_layers: expected 4 flags"),
    ({"head_dim": None}, "head_dim: expected an int"),
    ({"final_logit_softcapping": "30"}, "final_logit_softcapping: expected a number or null"),
    ({"attn_logit_softcapping": 0}, "attn_logit_softcap: expected None or a finite value > 0"),
    ({"query_pre_attn_scalar": True}, "query_pre_attn_scalar: expected a number"),
    # per-layer-type RoPE (Gemma 3's form): transformers' Gemma 2 has one rotary embedding
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     r"keys \['full_attention', 'sliding_attention'\]"),
    # Gemma 3's keys and Llama's, which transformers' Gemma 2 never reads: refused
    ({"rope_local_base_freq": 10000.0}, r"keys \['rope_local_base_freq'\]"),
    ({"sliding_window_pattern": 2}, r"keys \['sliding_window_pattern'\]"),
    ({"mlp_bias": False}, r"keys \['mlp_bias'\]"),
    ({"some_new_key": 1}, r"keys \['some_new_key'\]"),
])
def test_what_is_not_implemented_is_refused(tmp_path, edit, match):
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    save_hf(Gemma2(CONFIGS["default-pattern"], seed=0), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ValueError, match=match):
        load_hf(tmp_path)


def test_a_scalar_without_a_hugging_face_form_is_refused(tmp_path):
    pytest.importorskip("safetensors")
    from ggmlopt.io import save_hf
    # transformers' config takes an int: 24.5 has no Hugging Face form
    model = Gemma2(Gemma2Config(vocab_size=V, dim=16, n_layers=2, n_heads=2, head_dim=8,
                                query_pre_attn_scalar=24.5), seed=0)
    with pytest.raises(ValueError, match="query_pre_attn_scalar=24.5 has no Hugging Face"):
        save_hf(model, tmp_path / "h")
    assert not (tmp_path / "h" / "config.json").exists()


def test_dropout_is_warned_about(tmp_path):
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    save_hf(Gemma2(CONFIGS["default-pattern"], seed=0), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "attention_dropout": 0.1}))
    with pytest.warns(UserWarning, match="applies no dropout"):
        load_hf(tmp_path)


@pytest.mark.parametrize("kind", ["default-pattern", "untied-scaled"])
def test_greedy_generation_is_transformers(tmp_path, kind):
    """28 tokens, more than the windows (5 and 9): the cache's local layers drop keys."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from ggmlopt.io import save_hf
    model = _spread(Gemma2(CONFIGS[kind], seed=2), 2)
    save_hf(model, tmp_path)
    hf = transformers.Gemma2ForCausalLM.from_pretrained(tmp_path,
                                                         attn_implementation="eager").eval()
    prompt = np.random.default_rng(5).integers(0, V, 8)
    x = torch.tensor(prompt[None])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20,
                           do_sample=False, pad_token_id=0, eos_token_id=None)
    ours = go.generate(model, prompt, 20, temperature=0, stop_ids=())
    np.testing.assert_array_equal(ours, want[0, prompt.size:].numpy())


@pytest.mark.parametrize("kind", ["default-pattern", "untied-scaled"])
def test_cache_packing_and_checkpointing(kind):
    from test_packing import _alone, _documents, _loss_and_grads, _packed
    model = _spread(Gemma2(CONFIGS[kind], seed=2), 3)
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


# ---- llama.cpp's gemma2: save_gguf, load_gguf, save_gguf_lora --------------------------

GGUF_CONFIGS = {
    # gemma-2-2b's layout in small: every other layer local (a window of 5 in a context
    # of 64), heads of 24 over 64 / 4 = 16, grouped 4 over 2, scores scaled by head_dim
    "default-pattern": {},
    # the keys beyond the defaults: a given pattern, a window, linear scaling on every
    # layer, a RoPE base, an eps
    "pattern-scaled": {"sliding_layers": (False, True, True, False), "sliding_window": 7,
                       "rope_scaling": RopeScaling("linear", 4.0), "rope_base": 500.0,
                       "norm_eps": 1e-5},
}


def _gguf_gemma2(seed=3, **kw):
    """A Gemma 2 over ByteTokenizer's ids whose logits depend on its weights (matrices
    N(0, 0.08), norms U(-0.5, 0.5)) more than on rounding; caps of 2 on the scores and
    3 on the logits, which such weights reach."""
    from ggmlopt.text import ByteTokenizer
    fields = {"vocab_size": ByteTokenizer().vocab_size, "dim": 64, "n_layers": 4,
              "n_heads": 4, "n_kv_heads": 2, "head_dim": 24, "ffn_dim": 96,
              "max_seq_len": 64, "query_pre_attn_scalar": 24.0, "sliding_window": 5,
              "attn_logit_softcap": 2.0, "final_logit_softcap": 3.0}
    model = Gemma2(Gemma2Config(**{**fields, **kw}), seed=seed)
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


TEXT = "Gemma 2's soft caps, its windows and its norms, computed by llama.cpp: é ✓ and more"
# ggml's GELU reads a float16 table: Gemma 3's and GPT-2's files agree with llama.cpp to
# 2^-11 of the logits' scale (tests/llamacpp/test_llamacpp_gguf.py's bound for them)
GELU_TOL = 2e-3


def _assert_same_weights(back, model):
    theirs = dict(back.named_parameters())
    assert theirs.keys() == dict(model.named_parameters()).keys()
    one = np.float32(1.0)
    for name, p in model.named_parameters():
        if p.data.ndim == 1:
            # the file holds 1 + w (llama.cpp's gemma2 multiplies by it): that sum's bits,
            # which the norm computes again from the weight read back
            np.testing.assert_array_equal(one + theirs[name].data, one + p.data, err_msg=name)
        else:
            np.testing.assert_array_equal(theirs[name].data, p.data, err_msg=name)


@pytest.mark.parametrize("kind", list(GGUF_CONFIGS))
def test_load_gguf_reads_save_ggufs_file_as_the_model(tmp_path, kind):
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    model = _gguf_gemma2(**GGUF_CONFIGS[kind])
    path = tmp_path / "gemma2.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer())
    back, tok = load_gguf(path)
    assert type(back) is Gemma2 and back.config == model.config
    assert back.final_logit_softcap == 3.0
    assert isinstance(tok, ByteTokenizer)
    _assert_same_weights(back, model)
    ids = np.array(ByteTokenizer().encode(TEXT)[:64])
    np.testing.assert_array_equal(back(ids[None]), model(ids[None]))
    # the same file, loaded over a model of the same config
    other = Gemma2(model.config, seed=9)
    load_gguf(path, other)
    np.testing.assert_array_equal(other(ids[None]), model(ids[None]))


def test_a_gemma2_without_local_layers_is_refused_by_save_gguf(tmp_path):
    """llama.cpp's gemma2 always has local layers: a context over a file with none
    aborts the process on an assertion, so save_gguf refuses it, pointing to save_hf."""
    pytest.importorskip("gguf")
    from ggmlopt.io import save_gguf
    from ggmlopt.text import ByteTokenizer
    model = _gguf_gemma2(sliding_layers=(False,) * 4)
    with pytest.raises(ValueError, match="every layer of this Gemma 2 is global.*save_hf"):
        save_gguf(model, tmp_path / "g.gguf", tokenizer=ByteTokenizer())
    assert not (tmp_path / "g.gguf").exists()


def test_llama_cpps_keys_are_read_with_its_defaults():
    """The gemma2 keys llama.cpp's converter leaves out read as llama.cpp reads them
    (a window of 4096, every other layer local from layer 0, caps 50 and 30); a local
    RoPE base of its own and a window of 0 are refused."""
    fields = {"gemma2.block_count": 5, "gemma2.embedding_length": 64,
              "gemma2.attention.head_count": 4}

    def read(extra):
        given = {**fields, **extra}

        def key(name, default=None, required=True):
            return given.get(f"gemma2.{name}", default)
        return FAMILY.gguf_fields(given, key, 24, "f.gguf")

    got = read({})
    assert got == {"sliding_window": 4096, "sliding_layers": (True, False, True, False, True),
                   "query_pre_attn_scalar": 24.0, "attn_logit_softcap": 50.0,
                   "final_logit_softcap": 30.0}
    # llama.cpp's set_swa_pattern(3): two local layers, then a global one
    assert read({"gemma2.attention.sliding_window_pattern": 3})["sliding_layers"] == \
        (True, True, False, True, True)
    with pytest.raises(ValueError, match="freq_base_swa = 500.0 differs"):
        read({"gemma2.rope.freq_base_swa": 500.0})
    with pytest.raises(ValueError, match="sliding_window is 0"):
        read({"gemma2.attention.sliding_window": 0})
    # without local layers a window of 0 is moot: llama.cpp's default stands for it
    assert read({"gemma2.attention.sliding_window": 0,
                 "gemma2.attention.sliding_window_pattern": [False] * 5}
                )["sliding_window"] == 4096
    with pytest.raises(ValueError, match="has 2 entries for 5 layers"):
        read({"gemma2.attention.sliding_window_pattern": [True, False]})
    # llama.cpp's 27B (46 layers) scales by dim / heads, not by head_dim
    assert read({"gemma2.block_count": 46})["query_pre_attn_scalar"] == 16.0


def test_the_27b_scale_rule_is_written_and_refused(tmp_path):
    """llama.cpp scales a 46-layer gemma2's scores by (dim / heads) ** -0.5 (gemma-2-27b's
    query_pre_attn_scalar, 144 = 4608 / 32) and every other one's by head_dim ** -0.5."""
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    small = {"dim": 32, "n_heads": 2, "n_kv_heads": 1, "head_dim": 8, "ffn_dim": 16,
             "n_layers": 46}
    model = _gguf_gemma2(**small, query_pre_attn_scalar=16.0)
    save_gguf(model, tmp_path / "27b.gguf", tokenizer=ByteTokenizer())
    back, _ = load_gguf(tmp_path / "27b.gguf")
    assert back.config == model.config
    with pytest.raises(ValueError, match=r"scales the scores by 16 \*\* -0.5"):
        save_gguf(_gguf_gemma2(**small, query_pre_attn_scalar=8.0), tmp_path / "x.gguf",
                  tokenizer=ByteTokenizer())
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("kw,match", [
    ({"query_pre_attn_scalar": 20.0}, r"scales the scores by 24 \*\* -0.5.*save_hf keeps it"),
    ({"attn_logit_softcap": None}, "always soft-caps.*attn_logit_softcap=None"),
    ({"final_logit_softcap": None}, "always soft-caps.*final_logit_softcap=None"),
    ({"tie_embeddings": False}, "takes its head from the token embedding"),
    # a Llama 3 scaling is llama.cpp's rope_freqs tensor, which its gemma2 does not read
    ({"rope_scaling": RopeScaling("llama3", 8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=16)},
     "rope_freqs tensor, which its gemma2"),
])
def test_what_llama_cpps_gemma2_cannot_hold_is_refused(tmp_path, kw, match):
    pytest.importorskip("gguf")
    from ggmlopt.io import save_gguf, save_gguf_lora
    from ggmlopt.text import ByteTokenizer
    model = _gguf_gemma2(**kw)
    with pytest.raises(ValueError, match=match):
        save_gguf(model, tmp_path / "g.gguf", tokenizer=ByteTokenizer())
    assert not (tmp_path / "g.gguf").exists()
    lora.apply(model, rank=4, alpha=8.0, targets="all-linear")
    with pytest.raises(ValueError, match=match):
        save_gguf_lora(model, tmp_path / "a.gguf")
    assert not (tmp_path / "a.gguf").exists()


@pytest.mark.parametrize("kind", list(GGUF_CONFIGS))
def test_llama_cpp_computes_save_ggufs_file_to_our_logits(tmp_path, kind):
    pytest.importorskip("gguf")
    run = _llamacpp()
    from ggmlopt.io import save_gguf
    from ggmlopt.text import ByteTokenizer
    model = _gguf_gemma2(**GGUF_CONFIGS[kind])
    path = tmp_path / "gemma2.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer())
    ids = np.array(ByteTokenizer().encode(TEXT)[:64])
    theirs = run.logits_of(run.open_llama(path), ids)
    ours = model(ids[None])[0].astype(np.float64)
    assert run.relative(theirs, ours) <= GELU_TOL
    # each part counts: without the final cap, the scores' cap or the windows, our
    # logits are far from llama.cpp's
    model.final_logit_softcap = None
    assert run.relative(theirs, model(ids[None])[0]) > 10 * GELU_TOL
    model.final_logit_softcap = 3.0
    for layer in model.layers:
        layer.self_attn.logit_softcap = None
    assert run.relative(theirs, model(ids[None])[0]) > 10 * GELU_TOL
    for layer in model.layers:
        layer.self_attn.logit_softcap = 2.0
        layer.self_attn.sliding_window = None
    assert run.relative(theirs, model(ids[None])[0]) > 10 * GELU_TOL


def test_llama_cpp_takes_the_27b_scale_rule(tmp_path):
    pytest.importorskip("gguf")
    run = _llamacpp()
    from ggmlopt.io import save_gguf
    from ggmlopt.text import ByteTokenizer
    # heads of 8 over 32 / 2 = 16: llama.cpp's 46-layer rule scales by 16 ** -0.5
    model = _gguf_gemma2(dim=32, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=16, n_layers=46,
                         query_pre_attn_scalar=16.0)
    path = tmp_path / "27b.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer())
    ids = np.array(ByteTokenizer().encode(TEXT)[:64])
    theirs = run.logits_of(run.open_llama(path), ids)
    # ggml's float16 GELU table errs by about 2^-11 of each layer's MLP output, and the
    # errors add up layer by layer (GELU_TOL is four layers' worth): 46 of them here
    bound = model.config.n_layers * 2.0 ** -11
    assert run.relative(theirs, model(ids[None])[0].astype(np.float64)) <= bound
    for layer in model.layers:   # scaled by head_dim as the other sizes are: far off
        layer.self_attn.query_scale = None
    assert run.relative(theirs, model(ids[None])[0]) > 10 * bound


def test_llama_cpp_applies_our_adapter_to_a_gemma2(tmp_path):
    pytest.importorskip("gguf")
    run = _llamacpp()
    from ggmlopt.io import save_gguf, save_gguf_lora
    from ggmlopt.text import ByteTokenizer
    model = _gguf_gemma2()
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
    # and applied as merging it into the weights: float32 rounding of the merged
    # weights apart, which can move a GELU input across a step of llama.cpp's float16
    # table (2^-11 of it): the GELU families' bound, not the others' 1e-4
    lora.merge(model)
    merged = tmp_path / "merged.gguf"
    save_gguf(model, merged, tokenizer=ByteTokenizer())
    assert run.relative(theirs, run.logits_of(run.open_llama(merged), ids)) <= GELU_TOL


def test_a_fine_tune_over_a_kept_q8_0_base_is_applied_by_llama_cpp(tmp_path):
    """gemma-2-2b-it's path: a quantized GGUF loaded with keep_types=True, LoRA applied,
    a few steps of fit (the capped head's fused loss), the adapter written and applied
    by llama.cpp to that file."""
    pytest.importorskip("gguf")
    run = _llamacpp()
    from ggmlopt.io import load_gguf, save_gguf, save_gguf_lora
    from ggmlopt.text import ByteTokenizer
    tok = ByteTokenizer()
    model = _gguf_gemma2()
    path = tmp_path / "q8_0.gguf"
    save_gguf(model, path, tokenizer=tok, dtype="q8_0")
    kept, _ = load_gguf(path, keep_types=True)
    assert type(kept) is Gemma2 and kept.final_logit_softcap == 3.0
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
    """llama.cpp's own convert_hf_to_gguf (Gemma2Model) of save_hf's checkpoint: it
    writes the window and the caps but no layer pattern and no RoPE base (llama.cpp's
    defaults, transformers' too); load_gguf gives back the config and every
    parameter's bits."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    if not os.environ.get("GGMLOPT_LLAMA_CPP_SRC"):
        pytest.skip("GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source, for convert_hf_to_gguf.py) "
                    "is not set")
    _import_from_llamacpp_tests()
    from test_llamacpp_convert import _convert

    from ggmlopt.io import load_gguf, save_hf
    from ggmlopt.text import ByteTokenizer
    model = _gguf_gemma2()
    save_hf(model, tmp_path / "hf")
    out = tmp_path / "converted.gguf"
    _convert(tmp_path / "hf", out, tmp_path)
    back, tok = load_gguf(out)
    assert isinstance(tok, ByteTokenizer)
    assert type(back) is Gemma2 and back.config == model.config
    _assert_same_weights(back, model)


def test_a_lora_fine_tune_is_peft_over_transformers(tmp_path):
    """lora.apply, a few steps of fit (the capped head's fused loss and its gradient
    through the caps), save_peft: PEFT's adapter over transformers' Gemma 2 computes
    ggmlopt's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from ggmlopt.io import save_hf, save_peft
    model = _spread(Gemma2(CONFIGS["default-pattern"], seed=4), 4)
    save_hf(model, tmp_path / "hf")
    lora.apply(model, rank=4, alpha=8.0, targets="all-linear", seed=0)
    ids = np.random.default_rng(0).integers(0, V, 8 * 8 + 17)
    go.fit(model, go.Dataset.from_tokens(ids, n_ctx=16), "cross_entropy",
           lambda epoch: go.OptimizerParams(go.AdamWParams(alpha=3e-2)), nepoch=2,
           nbatch_logical=4, silent=True, seed=0)
    assert any(np.abs(layer.lora_b.data).max() > 0 for _, layer in lora.named_adapters(model))
    save_peft(model, tmp_path / "peft")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.Gemma2ForCausalLM.from_pretrained(tmp_path / "hf",
                                                             attn_implementation="eager")
        tuned = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    tokens = np.random.default_rng(1).integers(0, V, (2, 40))
    with torch.no_grad():
        want = tuned(torch.tensor(tokens)).logits.numpy()
    # float32 sums in other orders: the other families' bound, 1e-4 of scale
    np.testing.assert_allclose(model(tokens), want, rtol=0, atol=1e-4 * np.abs(want).max())
    base = transformers.Gemma2ForCausalLM.from_pretrained(tmp_path / "hf",
                                                           attn_implementation="eager")
    assert np.abs(_hf_logits(base.eval(), tokens) - want).max() > 10 * 1e-4 * np.abs(want).max()
