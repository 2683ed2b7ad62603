"""Gemma 3 (text): Gemma's norms (1 + weight), four a block, GeGLU, embeddings
scaled by sqrt(hidden), per-head q/k norms, local (windowed, their own RoPE
base) and global layers, the scores scaled by query_pre_attn_scalar.  Logits and
every gradient equal transformers' Gemma3ForCausalLM; checkpoints go both ways;
the cache equals a full recompute; packing and checkpointing hold; what is not
implemented is refused."""
import json

import numpy as np
import pytest
from hf_oracle import assert_cache_equals_recompute, assert_equals_transformers, randomised

import ggmlopt as go
from ggmlopt.models import Gemma3, Gemma3Config, Llama
from ggmlopt.models.gemma3 import GemmaRMSNorm
from ggmlopt.nn import RopeScaling

CONFIGS = {
    # 7 layers: the default pattern makes layer 5 global, the others local with a
    # window of 5; 4 heads of 12 over a hidden size of 32; a scalar other than head_dim
    "default-pattern": Gemma3Config(vocab_size=67, dim=32, n_layers=7, n_heads=4, n_kv_heads=2,
                                    head_dim=12, ffn_dim=48, max_seq_len=256,
                                    query_pre_attn_scalar=20.0, sliding_window=5),
    # global layers with linear rope scaling (Gemma 3 4B's factor 8), a given pattern
    "scaled-global": Gemma3Config(vocab_size=67, dim=32, n_layers=3, n_heads=2, ffn_dim=40,
                                  head_dim=16, max_seq_len=256, sliding_window=9,
                                  rope_scaling=RopeScaling("linear", 8.0),
                                  sliding_layers=(True, False, True)),
}


def test_gemma3_parts():
    model = Gemma3(CONFIGS["default-pattern"], seed=0)
    params = dict(model.named_parameters())
    for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
        p = params[f"layers.0.{name}.weight"]
        assert not p.data.any()   # Gemma's norm starts at a scale of 1 + 0
    assert "lm_head.weight" not in params and isinstance(model, Llama)
    cfg = model.config
    assert [cfg.is_sliding(i) for i in range(7)] == [True] * 5 + [False, True]
    assert model.layers[5].self_attn.sliding_window is None
    assert model.layers[0].self_attn.rotary.base == 10000.0
    assert model.layers[5].self_attn.rotary.base == 1000000.0
    norm = GemmaRMSNorm(4)
    norm.weight.data[...] = [0.0, 1.0, -0.5, 2.0]
    x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    want = x / np.sqrt((x * x).mean() + 1e-6) * (1 + norm.weight.data)
    np.testing.assert_allclose(norm(x), want, rtol=1e-6)
    with pytest.raises(ValueError, match="sliding_layers"):
        Gemma3Config(vocab_size=8, dim=8, n_layers=2, n_heads=2, head_dim=4,
                     sliding_layers=(True,))
    with pytest.raises(ValueError, match="tie_embeddings"):
        Gemma3Config(vocab_size=8, dim=8, n_layers=1, n_heads=2, head_dim=4,
                     tie_embeddings=False)
    with pytest.raises(TypeError, match="Gemma3Config"):
        Gemma3(go.models.LlamaConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2))


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 7, 64])
def test_logits_and_gradients_equal_transformers(tmp_path, kind, T):
    from ggmlopt.io import load_hf
    model = randomised(Gemma3(CONFIGS[kind], seed=1), T)
    # at T = 1 q and k get no gradient (one score a softmax): float32 noise stands for it,
    # which Gemma's q/k norms (a scale of 1 + w, up to 2.5 here) and query scale amplify
    assert_equals_transformers(model, "Gemma3ForCausalLM", tmp_path, T, eager=True,
                               noise_floor=1e-2)
    back = load_hf(tmp_path)
    assert type(back) is Gemma3 and back.config == model.config
    tokens = np.random.default_rng(T).integers(0, 67, (2, T))
    np.testing.assert_array_equal(back.forward(tokens), model.forward(tokens))


def test_transformers_checkpoint_loads(tmp_path):
    """A config and weights written by transformers' own save_pretrained."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from ggmlopt.io import load_hf
    hc = transformers.Gemma3TextConfig(
        vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=256,
        query_pre_attn_scalar=20, sliding_window=5, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(hc).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    tokens = np.random.default_rng(0).integers(0, 67, (2, 40))
    want = hf(torch.tensor(tokens)).logits.detach().numpy()
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())


def test_cache_packing_and_checkpointing():
    from test_packing import _alone, _documents, _loss_and_grads, _packed
    model = randomised(Gemma3(CONFIGS["default-pattern"], seed=2), 3)
    assert_cache_equals_recompute(model, [3, 1, 4, 1, 5, 9, 2, 6], 12)
    # packed documents: the loss and gradients they have alone
    inputs, labels = _documents(2)
    inputs = [np.minimum(a, 66) for a in inputs]
    labels = [np.minimum(b, 66) for b in labels]
    xp, yp = _packed(inputs, labels)
    xa, ya = _alone(inputs, labels)
    lp, gp, _ = _loss_and_grads(model, xp, yp)
    la, ga, _ = _loss_and_grads(model, xa, ya)
    assert abs(lp - la) <= 1e-6 * abs(la)
    scale = max(np.abs(g).max() for g in ga.values())
    # packed and alone sum in other orders; the rounding compounds block by block (seven
    # here, and the embedding's gradient is scaled by sqrt(dim)): 1e-6 of scale a block
    depth = model.config.n_layers
    for k in ga:
        np.testing.assert_allclose(gp[k], ga[k], rtol=0, atol=1e-6 * scale * depth, err_msg=k)
    # activation checkpointing: the same gradients, bit for bit
    model.train()
    model.gradient_checkpointing_enable()
    _, gc, _ = _loss_and_grads(model, xa, ya)
    for k in ga:
        np.testing.assert_array_equal(gc[k], ga[k], err_msg=k)


def test_what_is_not_implemented_is_refused(tmp_path):
    pytest.importorskip("safetensors")
    pytest.importorskip("gguf")
    from ggmlopt.io import load_hf, save_gguf, save_hf
    from ggmlopt.text import ByteTokenizer
    # llama.cpp's gemma3 scales the scores by head_dim ** -0.5: another scalar is refused
    with pytest.raises(ValueError, match="query_pre_attn_scalar"):
        save_gguf(Gemma3(Gemma3Config(vocab_size=257, dim=16, n_layers=1, n_heads=2,
                                      head_dim=8, query_pre_attn_scalar=20.0), seed=0),
                  tmp_path / "g.gguf", tokenizer=ByteTokenizer())
    assert not (tmp_path / "g.gguf").exists()
    # transformers' config takes an int: 24.5 has no Hugging Face form (it was cut to 24)
    with pytest.raises(ValueError, match="query_pre_attn_scalar=24.5 has no Hugging Face form"):
        save_hf(Gemma3(Gemma3Config(vocab_size=97, dim=16, n_layers=1, n_heads=2, head_dim=8,
                                    query_pre_attn_scalar=24.5), seed=0), tmp_path / "h")
    assert not (tmp_path / "h" / "config.json").exists()
    save_hf(Gemma3(CONFIGS["scaled-global"], seed=0), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for edit, match in [({"final_logit_softcapping": 30.0}, "soft-capping"),
                        ({"attn_logit_softcapping": 50.0}, "soft-capping"),
                        ({"use_bidirectional_attention": True}, "causal"),
                        ({"hidden_activation": "gelu"}, "gelu_pytorch_tanh"),
                        ({"some_new_key": 1}, r"keys \['some_new_key'\]"),
                        # RoPE keys beside the per-layer-type dicts: transformers ignores them
                        ({"rope_parameters": {**cfg["rope_parameters"], "rope_type": "linear",
                                              "factor": 8.0}},
                         r"got \['factor', 'rope_type'\] beside them"),
                        # the old 'type' key: applied by transformers 4, ignored by 5
                        ({"rope_parameters": None, "rope_theta": 10000.0,
                          "rope_scaling": {"type": "linear", "factor": 8.0}},
                         "by the old key 'type'")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises(ValueError, match=match):
            load_hf(tmp_path)


def test_the_layer_pattern_of_a_config_without_layer_types_is_transformers(tmp_path):
    # transformers reads sliding_window_pattern (default 6) and ignores its own
    # _sliding_window_pattern copy
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    save_hf(Gemma3(CONFIGS["scaled-global"], seed=0), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["layer_types"]
    n = cfg["num_hidden_layers"]
    for edit, local in [({"_sliding_window_pattern": 2}, [(i + 1) % 6 != 0 for i in range(n)]),
                        ({"sliding_window_pattern": 2}, [(i + 1) % 2 != 0 for i in range(n)])]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
        assert list(load_hf(tmp_path).config.sliding_layers) == local


def test_yarn_untruncated_is_computed_as_transformers_computes_it(tmp_path):
    # transformers reads rope truncate at the top of rope_parameters only, which a
    # Gemma 3 nests by layer type: it computes YaRN truncated whatever the config says
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from ggmlopt.io import load_hf
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
            "rope_theta": 10000.0, "truncate": False}
    hc = transformers.Gemma3TextConfig(
        vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
        sliding_window=5, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": yarn,
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(hc).eval()
    hf.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="truncate=False has no effect on a Gemma 3"):
        model = load_hf(tmp_path)
    assert model.config.rope_scaling.truncate is True
    tokens = np.random.default_rng(0).integers(0, 67, (1, 60))
    want = hf(torch.tensor(tokens)).logits.detach().numpy()
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="truncate=False is computed by neither"):
        Gemma3Config(vocab_size=67, dim=32, n_layers=1, n_heads=2, head_dim=16,
                     rope_scaling=RopeScaling("yarn", 8.0, original_max_position_embeddings=32,
                                              truncate=False))


def test_a_window_with_no_local_layer_is_written_as_none(tmp_path):
    """llama.cpp's gemma3 with a window needs a local layer (a context over a file
    without one stops the process on an assertion); a Gemma 3 whose layers are
    all global computes the same without the window, so save_gguf leaves it out,
    and the file computes the model's logits in ggmlopt and in llama.cpp."""
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.io.gguf_reader import GgufFile
    from ggmlopt.text import ByteTokenizer
    model = Gemma3(Gemma3Config(vocab_size=257, dim=32, n_layers=2, n_heads=2, head_dim=16,
                                query_pre_attn_scalar=16.0, ffn_dim=64, max_seq_len=64,
                                sliding_window=8, sliding_layers=(False, False)), seed=1)
    path = tmp_path / "g.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer())
    assert "gemma3.attention.sliding_window" not in GgufFile(path).fields
    ids = np.arange(1, 30, dtype=np.int32)[None]
    back, _ = load_gguf(path)
    assert back.config.sliding_window is None and not any(back.config.sliding_layers)
    np.testing.assert_array_equal(back(ids), model(ids))
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False,
                          type_k=0, type_v=0)
    llm.eval(ids[0].tolist())
    theirs = np.asarray(llm.scores[:ids.shape[1]], np.float64)
    ours = model(ids)[0].astype(np.float64)
    # ggml's GELU reads a float16 table: the family's 2e-3 of scale (docs/model-families)
    assert np.abs(ours - theirs).max() <= 2e-3 * np.abs(theirs).max()
