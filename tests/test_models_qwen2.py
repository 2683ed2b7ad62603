"""Qwen2 / Qwen2.5: a Llama with biases on q, k and v.  Logits and every gradient
equal transformers' Qwen2ForCausalLM on random small configs (GQA, tied), the
checkpoints go both ways, and what ggmlopt cannot write yet is refused."""
import json

import numpy as np
import pytest

from ggmlopt.models import Llama, Qwen2, Qwen2Config

CONFIGS = {
    "gqa": Qwen2Config(vocab_size=67, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                       max_seq_len=256),
    "tied": Qwen2Config(vocab_size=67, dim=32, n_layers=1, n_heads=2, ffn_dim=40,
                        max_seq_len=256, tie_embeddings=True),
}


def test_qwen2_is_llama_with_qkv_biases():
    model = Qwen2(CONFIGS["gqa"], seed=0)
    names = [n for n, _ in model.named_parameters()]
    assert "layers.0.self_attn.q_proj.bias" in names and "layers.0.self_attn.v_proj.bias" in names
    assert "layers.0.self_attn.o_proj.bias" not in names
    assert isinstance(model, Llama)
    with pytest.raises(ValueError, match="qkv_bias"):
        Qwen2Config(vocab_size=8, dim=8, n_layers=1, n_heads=2, qkv_bias=False)
    with pytest.raises(TypeError, match="Qwen2Config"):
        from ggmlopt.models import LlamaConfig
        Qwen2(LlamaConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2))


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 7, 64, 129])
def test_logits_and_gradients_equal_transformers(tmp_path, kind, T):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    model = Qwen2(CONFIGS[kind], seed=1)
    rng = np.random.default_rng(T)
    for name, p in model.named_parameters():   # biases are zero at init: make them count
        if name.endswith(".bias"):
            p.data[...] = rng.normal(0, 0.5, p.shape)
    save_hf(model, tmp_path)
    hf, info = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = rng.integers(0, 67, (2, T))
    logits = hf(torch.tensor(tokens)).logits
    want = logits.detach().numpy()
    got = model.forward(tokens)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    g = rng.normal(size=want.shape).astype(np.float32)
    (logits * torch.tensor(g)).sum().backward()
    model.zero_grad()
    model.backward(g)
    ours = dict(model.named_parameters())
    overall = max(float(np.abs(p.grad.numpy()).max()) for _, p in hf.named_parameters())
    for name, p in hf.named_parameters():
        mine = ours.get(name.removeprefix("model."))
        if mine is None:
            continue
        theirs = p.grad.numpy()
        grad = mine.grad.T if mine.grad.ndim == 2 and "embed" not in name else mine.grad
        # q and k get no gradient at T = 1 (one score per softmax): only float32
        # rounding noise, far below the model's gradients, may show there
        scale = max(np.abs(theirs).max(), 1e-3 * overall)
        np.testing.assert_allclose(grad, theirs, rtol=0, atol=1e-4 * scale, err_msg=name)
    back = load_hf(tmp_path)
    assert type(back) is Qwen2 and back.config == model.config


def test_load_hf_reads_what_save_pretrained_writes(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from ggmlopt.io import load_hf
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=67, hidden_size=32, intermediate_size=40,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=1, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    hf = transformers.Qwen2ForCausalLM(cfg)
    for name, p in hf.named_parameters():
        if name.endswith(".bias"):
            torch.nn.init.normal_(p, std=0.5)
    hf.eval()
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert isinstance(model, Qwen2) and model.config.tie_embeddings
    tokens = np.random.default_rng(0).integers(0, 67, (2, 23))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(model(tokens), want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_what_is_not_implemented_is_refused(tmp_path):
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    model = Qwen2(Qwen2Config(vocab_size=257, dim=16, n_layers=1, n_heads=2), seed=0)
    save_hf(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for edit, match in [({"use_sliding_window": True, "sliding_window": 8,
                          "max_window_layers": 0}, "use_sliding_window"),
                        ({"layer_types": ["sliding_attention"]}, "layer_types"),
                        # a key Qwen2Config does not have (attention_bias it has, unread)
                        ({"pretraining_tp": 1}, r"keys \['pretraining_tp'\]")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises(ValueError, match=match):
            load_hf(tmp_path)


def _structured(seed=0):
    model = Qwen2(Qwen2Config(vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=48, max_seq_len=64), seed=seed)
    rng = np.random.default_rng(seed)
    for _, p in model.named_parameters():
        p.data[...] = rng.normal(0, 0.2, p.shape) if p.data.ndim == 2 else \
            rng.uniform(0.5, 1.5, p.shape)
    return model


def test_gguf_holds_llama_cpp_s_qwen2_layout_and_comes_back_bit_for_bit(tmp_path):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    model = _structured()
    save_gguf(model, tmp_path / "q.gguf", tokenizer=ByteTokenizer())
    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    arch = reader.fields["general.architecture"].contents()
    assert arch == "qwen2" and "qwen2.embedding_length" in reader.fields
    names = {t.name: t for t in reader.tensors}
    assert "blk.0.attn_q.bias" in names and "blk.0.attn_output.bias" not in names
    # rows kept as Hugging Face's (llama.cpp runs qwen2 with NeoX's rotation)
    q = np.array(names["blk.0.attn_q.weight"].data)
    np.testing.assert_array_equal(q, model.layers[0].self_attn.q_proj.weight.data.T)
    back, _ = load_gguf(tmp_path / "q.gguf")
    assert type(back) is Qwen2 and back.config == model.config
    for (n, p), (m, r) in zip(model.named_parameters(), back.named_parameters()):
        assert n == m
        np.testing.assert_array_equal(p.data, r.data)


def test_lora_adapters_of_a_qwen2_go_both_ways(tmp_path):
    pytest.importorskip("gguf")
    from ggmlopt import lora
    from ggmlopt.io import load_gguf_lora, save_gguf_lora
    model = _structured()
    lora.apply(model, rank=2, targets=("q_proj", "v_proj"))
    rng = np.random.default_rng(1)
    for _, layer in lora.named_adapters(model):
        layer.lora_b.data[...] = rng.normal(0, 0.1, layer.lora_b.shape)
    save_gguf_lora(model, tmp_path / "a.gguf")
    base = _structured()
    load_gguf_lora(tmp_path / "a.gguf", base)
    tokens = np.arange(20).reshape(1, 20)
    np.testing.assert_array_equal(base(tokens), model(tokens))
    llama_file = tmp_path / "l.gguf"
    from ggmlopt.models import LlamaConfig
    other = Llama(LlamaConfig(vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=48, max_seq_len=64))
    lora.apply(other, rank=2, targets=("q_proj", "v_proj"))
    save_gguf_lora(other, llama_file)
    with pytest.raises(ValueError, match="not a qwen2 LoRA adapter"):
        load_gguf_lora(llama_file, _structured())
