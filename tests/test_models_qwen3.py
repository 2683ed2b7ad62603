"""Qwen3: a Llama whose attention normalises each head of q and k (q_norm,
k_norm) before RoPE, with an explicit head_dim and no biases.  Logits and every
gradient equal transformers' Qwen3ForCausalLM on random small configs (GQA,
tied, a query width other than the hidden size), the checkpoints go both ways,
generation with the cache equals a full recompute, and what ggmlopt does not
implement is refused."""
import copy
import json

import numpy as np
import pytest
from hf_oracle import assert_cache_equals_recompute, assert_equals_transformers, randomised

from ggmlopt.models import Llama, LlamaConfig, Qwen3, Qwen3Config

CONFIGS = {
    # 4 heads of 12: a query width of 48 over a hidden size of 32 (as Qwen3-0.6B's
    # 16 x 128 over 1024)
    "gqa-wide-heads": Qwen3Config(vocab_size=67, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                  head_dim=12, ffn_dim=48, max_seq_len=256),
    "tied": Qwen3Config(vocab_size=67, dim=32, n_layers=1, n_heads=2, ffn_dim=40,
                        max_seq_len=256, tie_embeddings=True),
}



def test_qwen3_is_llama_with_head_norms():
    model = Qwen3(CONFIGS["gqa-wide-heads"], seed=0)
    params = dict(model.named_parameters())
    assert params["layers.0.self_attn.q_norm.weight"].shape == (12,)
    assert params["layers.0.self_attn.k_norm.weight"].shape == (12,)
    assert params["layers.0.self_attn.q_proj.weight"].shape == (32, 48)
    assert params["layers.0.self_attn.k_proj.weight"].shape == (32, 24)
    assert params["layers.0.self_attn.o_proj.weight"].shape == (48, 32)
    assert not any(n.endswith(".bias") for n in params)
    assert isinstance(model, Llama) and model.config.qk_norm
    assert not LlamaConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2).qk_norm
    assert Qwen3Config(vocab_size=8, dim=8, n_layers=1, n_heads=2).head_dim == 4
    with pytest.raises(ValueError, match="qkv_bias"):
        Qwen3Config(vocab_size=8, dim=8, n_layers=1, n_heads=2, qkv_bias=True)
    with pytest.raises(ValueError, match="head_dim"):
        Qwen3Config(vocab_size=8, dim=8, n_layers=1, n_heads=2, head_dim=5)
    with pytest.raises(TypeError, match="head_dim"):
        Qwen3Config(vocab_size=8, dim=8, n_layers=1, n_heads=2, head_dim=4.0)
    with pytest.raises(TypeError, match="Qwen3Config"):
        Qwen3(LlamaConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2))


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 7, 64, 129])
def test_logits_and_gradients_equal_transformers(tmp_path, kind, T):
    from ggmlopt.io import load_hf
    model = randomised(Qwen3(CONFIGS[kind], seed=1), T)
    assert_equals_transformers(model, "Qwen3ForCausalLM", tmp_path, T)
    back = load_hf(tmp_path)
    assert type(back) is Qwen3 and back.config == model.config
    tokens = np.random.default_rng(T).integers(0, 67, (2, T))
    np.testing.assert_array_equal(back.forward(tokens), model.forward(tokens))


def test_load_hf_reads_what_save_pretrained_writes(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from ggmlopt.io import load_hf
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=67, hidden_size=32, intermediate_size=40,
                                   num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                                   num_key_value_heads=1, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    hf = transformers.Qwen3ForCausalLM(cfg)
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(p, 0.5, 1.5)
    hf.eval()
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert isinstance(model, Qwen3) and model.config.tie_embeddings
    assert model.config.head_dim == 16 and model.config.n_kv_heads == 1
    tokens = np.random.default_rng(0).integers(0, 67, (2, 23))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(model(tokens), want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_what_is_not_implemented_is_refused(tmp_path):
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    save_hf(Qwen3(Qwen3Config(vocab_size=257, dim=16, n_layers=1, n_heads=2), seed=0), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for edit, match in [({"use_sliding_window": True, "sliding_window": 8,
                          "max_window_layers": 0}, "use_sliding_window"),
                        ({"layer_types": ["sliding_attention"]}, "layer_types"),
                        ({"attention_bias": True}, "attention_bias"),
                        ({"pretraining_tp": 1}, r"keys \['pretraining_tp'\]")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises(ValueError, match=match):
            load_hf(tmp_path)


def test_generation_with_the_cache_equals_a_full_recompute():
    model = randomised(Qwen3(CONFIGS["gqa-wide-heads"], seed=2), 2)
    assert_cache_equals_recompute(model, [3, 14, 15, 9, 2], 6)


def test_training_steps_move_the_head_norms_and_checkpointing_keeps_the_bits():
    import ggmlopt as go
    plain = randomised(Qwen3(CONFIGS["gqa-wide-heads"], seed=3), 3)
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable()
    trained = []
    for model in (plain, checkpointed):
        ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32, seed=1)
        rng = np.random.default_rng(0)
        for _ in range(3):
            tokens = rng.integers(0, 67, (2, 9)).astype(np.int32)
            ctx.alloc(True)
            ctx.eval(None, inputs=tokens[:, :-1].copy(), labels=tokens[:, 1:].copy())
        trained.append({n: p.data.copy() for n, p in model.named_parameters()})
    start = dict(randomised(Qwen3(CONFIGS["gqa-wide-heads"], seed=3), 3).named_parameters())
    assert not np.array_equal(trained[0]["layers.1.self_attn.k_norm.weight"],
                              start["layers.1.self_attn.k_norm.weight"].data)
    for n in trained[0]:
        np.testing.assert_array_equal(trained[0][n], trained[1][n], err_msg=n)


def test_gguf_holds_llama_cpp_s_qwen3_layout_and_comes_back_bit_for_bit(tmp_path):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    model = randomised(Qwen3(Qwen3Config(vocab_size=257, dim=32, n_layers=2, n_heads=4,
                                         n_kv_heads=2, head_dim=12, ffn_dim=48,
                                         max_seq_len=64), seed=4), 4)
    save_gguf(model, tmp_path / "q.gguf", tokenizer=ByteTokenizer())
    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    assert reader.fields["general.architecture"].contents() == "qwen3"
    assert reader.fields["qwen3.attention.key_length"].contents() == 12
    names = {t.name: t for t in reader.tensors}
    assert "blk.1.attn_q_norm.weight" in names and "blk.1.attn_k_norm.weight" in names
    # rows kept as Hugging Face's (llama.cpp runs qwen3 with NeoX's rotation)
    q = np.array(names["blk.0.attn_q.weight"].data)
    np.testing.assert_array_equal(q, model.layers[0].self_attn.q_proj.weight.data.T)
    back, _ = load_gguf(tmp_path / "q.gguf")
    assert type(back) is Qwen3 and back.config == model.config
    for (n, p), (m, r) in zip(model.named_parameters(), back.named_parameters()):
        assert n == m
        np.testing.assert_array_equal(p.data, r.data)
    # the float32 matrices kept as the file stores them: the same model, its products
    # taken by panels (other float32 rounding, far below 1e-5 of the logits' scale)
    kept, _ = load_gguf(tmp_path / "q.gguf", keep_types=True)
    assert type(kept) is Qwen3 and kept.config == model.config
    tokens = np.arange(20).reshape(1, 20)
    want = model(tokens)
    np.testing.assert_allclose(kept(tokens), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_lora_adapters_of_a_qwen3_go_both_ways(tmp_path):
    pytest.importorskip("gguf")
    from ggmlopt import lora
    from ggmlopt.io import load_gguf_lora, save_gguf_lora
    cfg = Qwen3Config(vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12,
                      ffn_dim=48, max_seq_len=64)
    model = randomised(Qwen3(cfg, seed=5), 5)
    lora.apply(model, rank=2, targets=("q_proj", "k_proj", "o_proj"))
    rng = np.random.default_rng(1)
    for _, layer in lora.named_adapters(model):
        layer.lora_b.data[...] = rng.normal(0, 0.1, layer.lora_b.shape)
    save_gguf_lora(model, tmp_path / "a.gguf")
    base = randomised(Qwen3(cfg, seed=5), 5)
    load_gguf_lora(tmp_path / "a.gguf", base)
    tokens = np.arange(20).reshape(1, 20)
    np.testing.assert_array_equal(base(tokens), model(tokens))
