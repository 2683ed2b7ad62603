"""SmolLM3: a Llama some of whose layers apply no rotary embedding (NoPE).
Logits and every gradient equal transformers' SmolLM3ForCausalLM on random
small configs (the default pattern, an explicit one, GQA and untied), the
checkpoints go both ways, generation with the cache equals a full recompute,
and what ggmlopt (or llama.cpp's smollm3) cannot hold is refused."""
import json

import numpy as np
import pytest
from hf_oracle import assert_cache_equals_recompute, assert_equals_transformers, randomised

from ggmlopt.models import Llama, LlamaConfig, SmolLM3, SmolLM3Config

CONFIGS = {
    # 5 layers: the default pattern leaves RoPE out of layer 3
    "default-pattern": SmolLM3Config(vocab_size=67, dim=32, n_layers=5, n_heads=4, n_kv_heads=2,
                                     ffn_dim=48, max_seq_len=256),
    "explicit-untied": SmolLM3Config(vocab_size=67, dim=32, n_layers=3, n_heads=4, ffn_dim=40,
                                     max_seq_len=256, tie_embeddings=False,
                                     no_rope_layers=(0, 1, 0)),
}



def test_smollm3_is_a_llama_without_rope_on_some_layers():
    cfg = CONFIGS["default-pattern"]
    assert cfg.no_rope_layers == (1, 1, 1, 0, 1) and cfg.tie_embeddings
    model = SmolLM3(cfg, seed=0)
    assert [layer.self_attn.rotary is None for layer in model.layers] == \
        [False, False, False, True, False]
    assert isinstance(model, Llama)
    plain = dict(Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=5, n_heads=4, n_kv_heads=2,
                                   ffn_dim=48, tie_embeddings=True)).named_parameters())
    assert list(dict(model.named_parameters())) == list(plain)
    assert SmolLM3Config(vocab_size=8, dim=8, n_layers=4, n_heads=2,
                         no_rope_layer_interval=2).no_rope_layers == (1, 0, 1, 0)
    for bad, match in [({"no_rope_layers": (1, 1)}, "one entry per layer"),
                       ({"no_rope_layers": (1, 2, 1)}, "0 or 1"),
                       ({"no_rope_layer_interval": 0}, "no_rope_layer_interval"),
                       ({"qkv_bias": True}, "qkv_bias")]:
        with pytest.raises(ValueError, match=match):
            SmolLM3Config(vocab_size=8, dim=8, n_layers=3, n_heads=2, **bad)
    with pytest.raises(TypeError, match="SmolLM3Config"):
        SmolLM3(LlamaConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2))


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 7, 64, 129])
def test_logits_and_gradients_equal_transformers(tmp_path, kind, T):
    from ggmlopt.io import load_hf
    model = randomised(SmolLM3(CONFIGS[kind], seed=1), T)
    hf = assert_equals_transformers(model, "SmolLM3ForCausalLM", tmp_path, T)
    assert list(hf.config.no_rope_layers) == list(model.config.no_rope_layers)
    back = load_hf(tmp_path)
    assert type(back) is SmolLM3 and back.config == model.config


def test_load_hf_reads_what_save_pretrained_writes(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from ggmlopt.io import load_hf
    torch.manual_seed(0)
    cfg = transformers.SmolLM3Config(vocab_size=67, hidden_size=32, intermediate_size=40,
                                     num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=1, max_position_embeddings=64,
                                     no_rope_layer_interval=2, pad_token_id=None)
    hf = transformers.SmolLM3ForCausalLM(cfg)
    hf.eval()
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert isinstance(model, SmolLM3) and model.config.no_rope_layers == (1, 0, 1, 0)
    tokens = np.random.default_rng(0).integers(0, 67, (2, 23))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(model(tokens), want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_what_is_not_implemented_is_refused(tmp_path):
    pytest.importorskip("safetensors")
    pytest.importorskip("gguf")
    from ggmlopt.io import load_hf, save_gguf, save_hf
    from ggmlopt.text import ByteTokenizer
    save_hf(SmolLM3(SmolLM3Config(vocab_size=257, dim=16, n_layers=2, n_heads=2)), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for edit, match in [({"use_sliding_window": True, "sliding_window": 8,
                          "no_rope_layers": [1, 0]}, "use_sliding_window"),
                        ({"attention_bias": True}, "attention_bias")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises(ValueError, match=match):
            load_hf(tmp_path)
    # llama.cpp's smollm3 knows only the every-fourth-layer pattern
    odd = SmolLM3(SmolLM3Config(vocab_size=257, dim=16, n_layers=3, n_heads=2,
                                no_rope_layers=(0, 1, 1)))
    with pytest.raises(ValueError, match="every fourth layer"):
        save_gguf(odd, tmp_path / "odd.gguf", tokenizer=ByteTokenizer())
    assert not (tmp_path / "odd.gguf").exists()


def test_gguf_comes_back_bit_for_bit(tmp_path):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    model = randomised(SmolLM3(SmolLM3Config(vocab_size=257, dim=32, n_layers=5, n_heads=4,
                                             n_kv_heads=2, ffn_dim=48, max_seq_len=64),
                               seed=4), 4)
    save_gguf(model, tmp_path / "s.gguf", tokenizer=ByteTokenizer())
    reader = gguf.GGUFReader(tmp_path / "s.gguf")
    assert reader.fields["general.architecture"].contents() == "smollm3"
    back, _ = load_gguf(tmp_path / "s.gguf")
    assert type(back) is SmolLM3 and back.config == model.config
    for (n, p), (m, r) in zip(model.named_parameters(), back.named_parameters()):
        assert n == m
        np.testing.assert_array_equal(p.data, r.data)


def test_generation_with_the_cache_equals_a_full_recompute():
    model = randomised(SmolLM3(CONFIGS["default-pattern"], seed=2), 2)
    assert_cache_equals_recompute(model, [3, 14, 15, 9, 2], 6)