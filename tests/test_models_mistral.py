"""Mistral: a Llama whose attention may see only a sliding window of keys and
whose config may give the head width.  Logits and every gradient equal
transformers' MistralForCausalLM (its eager attention, which applies the
window) on random small configs with windows shorter and longer than the
sequence; the checkpoints go both ways; generation with the cache equals a
full recompute; what llama.cpp's GGUF cannot hold is refused."""
import dataclasses
import json

import numpy as np
import pytest
from hf_oracle import assert_cache_equals_recompute, assert_equals_transformers, randomised

from ggmlopt.models import Llama, LlamaConfig, Mistral, MistralConfig

CONFIGS = {
    "window-5-wide-heads": MistralConfig(vocab_size=67, dim=32, n_layers=2, n_heads=4,
                                         n_kv_heads=2, head_dim=12, ffn_dim=48, max_seq_len=256,
                                         sliding_window=5),
    "window-40": MistralConfig(vocab_size=67, dim=32, n_layers=2, n_heads=4, n_kv_heads=1,
                               ffn_dim=40, max_seq_len=256, sliding_window=40),
    "no-window": MistralConfig(vocab_size=67, dim=32, n_layers=1, n_heads=2, ffn_dim=40,
                               max_seq_len=256),
}



def test_mistral_is_a_llama_with_a_window():
    model = Mistral(CONFIGS["window-5-wide-heads"], seed=0)
    assert isinstance(model, Llama)
    assert all(layer.self_attn.sliding_window == 5 for layer in model.layers)
    assert dict(model.named_parameters())["layers.0.self_attn.o_proj.weight"].shape == (48, 32)
    assert Mistral(CONFIGS["no-window"]).layers[0].self_attn.sliding_window is None
    for bad, match in [({"sliding_window": 0}, "sliding_window"),
                       ({"head_dim": 7}, "head_dim"), ({"qkv_bias": True}, "qkv_bias")]:
        with pytest.raises(ValueError, match=match):
            MistralConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2, **bad)
    with pytest.raises(TypeError, match="MistralConfig"):
        Mistral(LlamaConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2))


def test_a_window_changes_what_a_long_sequence_computes():
    windowed = randomised(Mistral(CONFIGS["window-5-wide-heads"], seed=1), 1)
    full = Mistral(dataclasses.replace(CONFIGS["window-5-wide-heads"], sliding_window=None),
                   seed=1)
    for (_, p), (_, q) in zip(windowed.named_parameters(), full.named_parameters()):
        q.data[...] = p.data
    tokens = np.random.default_rng(0).integers(0, 67, (1, 12))
    a, b = windowed(tokens), full(tokens)
    np.testing.assert_array_equal(a[:, :5], b[:, :5])     # within the window: the same
    assert np.abs(a[:, 5:] - b[:, 5:]).max() > 1e-3 * np.abs(b).max()


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 7, 64, 129])
def test_logits_and_gradients_equal_transformers(tmp_path, kind, T):
    from ggmlopt.io import load_hf
    model = randomised(Mistral(CONFIGS[kind], seed=1), T)
    hf = assert_equals_transformers(model, "MistralForCausalLM", tmp_path, T, eager=True)
    assert hf.config.sliding_window == model.config.sliding_window
    back = load_hf(tmp_path)
    assert type(back) is Mistral and back.config == model.config


def test_load_hf_reads_what_save_pretrained_writes(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from ggmlopt.io import load_hf
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=67, hidden_size=32, intermediate_size=40,
                                     num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                                     num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=6)
    hf = transformers.MistralForCausalLM(cfg)
    hf.config._attn_implementation = "eager"
    hf.eval()
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert isinstance(model, Mistral) and model.config.sliding_window == 6
    assert model.config.head_dim == 16
    tokens = np.random.default_rng(0).integers(0, 67, (2, 23))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(model(tokens), want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_generation_with_the_cache_equals_a_full_recompute():
    model = randomised(Mistral(CONFIGS["window-5-wide-heads"], seed=2), 2)
    assert_cache_equals_recompute(model, [3, 14, 15, 9, 2, 6, 5], 8)


def test_what_llama_cpp_cannot_hold_is_refused(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_gguf, load_hf, save_gguf, save_hf
    from ggmlopt.text import ByteTokenizer
    tok = ByteTokenizer()
    windowed = Mistral(MistralConfig(vocab_size=257, dim=16, n_layers=1, n_heads=2,
                                     max_seq_len=64, sliding_window=8))
    with pytest.raises(ValueError, match="sliding window"):
        save_gguf(windowed, tmp_path / "w.gguf", tokenizer=tok)
    assert not list(tmp_path.glob("*.gguf"))
    # a head width of its own is llama.cpp's key_length (Mistral Nemo's files): written
    wide = randomised(Mistral(MistralConfig(vocab_size=257, dim=16, n_layers=1, n_heads=2,
                                            head_dim=12, max_seq_len=64)), 4)
    save_gguf(wide, tmp_path / "h.gguf", tokenizer=tok)
    back, _ = load_gguf(tmp_path / "h.gguf")
    assert back.config.head_dim == 12
    np.testing.assert_array_equal(back(np.arange(20)[None]), wide(np.arange(20)[None]))
    # without a window (or one over every position) it is llama.cpp's llama, as
    # convert_hf_to_gguf writes a Mistral
    plain = randomised(Mistral(MistralConfig(vocab_size=257, dim=16, n_layers=1, n_heads=2,
                                             max_seq_len=64, sliding_window=64)), 3)
    save_gguf(plain, tmp_path / "p.gguf", tokenizer=tok)
    back, _ = load_gguf(tmp_path / "p.gguf")
    tokens = np.arange(20)[None]
    np.testing.assert_array_equal(back(tokens), plain(tokens))
    save_hf(plain, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    # a key MistralConfig does not have (its attention_bias it never reads: accepted)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "pretraining_tp": 1}))
    with pytest.raises(ValueError, match="pretraining_tp"):
        load_hf(tmp_path / "hf")
