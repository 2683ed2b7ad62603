"""LoRA adapters from ggmlopt.io.save_gguf_lora, applied by llama.cpp itself
(through llama-cpp-python, an optional package: these tests skip without it).

llama.cpp runs with an f32 KV cache (type_k=0, type_v=0): its default f16 cache
alone moves the logits by about 2e-4 of their scale."""
import numpy as np
import pytest
from llamacpp_run import logits_of, open_llama

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.io import save_gguf, save_gguf_lora
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.text import ByteTokenizer

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

TOK = ByteTokenizer()
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
N_CTX = 32


def _config(**kw):
    args = {"vocab_size": TOK.vocab_size, "dim": 64, "n_layers": 2, "n_heads": 4,
            "n_kv_heads": 2, "ffn_dim": 96, "max_seq_len": 64}
    return LlamaConfig(**{**args, **kw})


def _perplexity_ofopen_llama(llm, ids, n_ctx):
    """llama-perplexity's protocol on llama.cpp's logits: chunks of n_ctx ids (no
    BOS: a byte vocabulary has none), positions n_ctx/2 .. n_ctx-2 scored."""
    nll = []
    for c in range(len(ids) // n_ctx):
        chunk = ids[c * n_ctx:(c + 1) * n_ctx]
        logits = logits_of(llm, chunk)
        first = n_ctx // 2
        for j in range(first, n_ctx - 1):
            row = logits[j]
            top = row.max()
            nll.append(top + np.log(np.exp(row - top).sum()) - row[chunk[j + 1]])
    return float(np.exp(np.mean(nll)))


@pytest.mark.parametrize("targets,tied", [(("q_proj", "k_proj", "v_proj", "o_proj"), False),
                                          (ALL + ("lm_head",), False), (ALL, True)])
def test_llama_cpp_with_our_adapter_gives_ourlogits_of(tmp_path, targets, tied):
    model = Llama(_config(tie_embeddings=tied), seed=3)
    base = tmp_path / "base.gguf"
    save_gguf(model, base, tokenizer=TOK)
    lora.apply(model, rank=4, alpha=8.0, targets=targets, seed=1)
    rng = np.random.default_rng(2)
    for _, layer in lora.named_adapters(model):   # B = 0 would test nothing
        layer.lora_b.data[...] = rng.normal(0, 0.05, layer.lora_b.shape)
    adapter = tmp_path / "adapter.gguf"
    save_gguf_lora(model, adapter)
    ids = TOK.encode("LoRA adapters, written by ggmlopt and applied by llama.cpp: é ✓")[:64]
    ours = model(ids[None])[0].astype(np.float64)
    theirs = logits_of(open_llama(base, adapter), ids)
    without = logits_of(open_llama(base), ids)
    scale = np.abs(ours).max()
    assert np.abs(theirs - ours).max() <= 1e-4 * scale
    assert np.abs(without - ours).max() > 1e-2 * scale   # the adapter is applied


def test_llama_cpp_with_adapters_of_several_ranks_and_alphas(tmp_path):
    # rsLoRA over a rank_pattern and an alpha_pattern: one alpha in the file, the
    # others folded into their B, which llama.cpp computes as the model does
    model = Llama(_config(), seed=3)
    base = tmp_path / "base.gguf"
    save_gguf(model, base, tokenizer=TOK)
    lora.apply(model, config={"r": 4, "lora_alpha": 8, "use_rslora": True,
                              "target_modules": list(ALL),
                              "rank_pattern": {"layers.1.mlp.down_proj": 2, "o_proj": 6},
                              "alpha_pattern": {"layers.0.self_attn.v_proj": 3}}, seed=1)
    rng = np.random.default_rng(2)
    for _, layer in lora.named_adapters(model):
        layer.lora_b.data[...] = rng.normal(0, 0.05, layer.lora_b.shape)
    assert len({layer.alpha for _, layer in lora.named_adapters(model)}) > 2
    adapter = tmp_path / "adapter.gguf"
    save_gguf_lora(model, adapter)
    ids = TOK.encode("rank and alpha patterns, applied by llama.cpp")[:64]
    ours = model(ids[None])[0].astype(np.float64)
    theirs = logits_of(open_llama(base, adapter), ids)
    assert np.abs(theirs - ours).max() <= 1e-4 * np.abs(ours).max()


def test_a_lora_fine_tune_lowers_llama_cpp_perplexity(tmp_path):
    text = go.corpora.python_docstrings(min_bytes=8000)
    ids = TOK.encode(text)[:192 * N_CTX + N_CTX + 1]     # 192 windows: 12 batches of 16
    model = Llama(_config(max_seq_len=N_CTX), seed=0)
    base = tmp_path / "base.gguf"
    save_gguf(model, base, tokenizer=TOK)
    for p in model.parameters():
        p.requires_grad = False
    lora.apply(model, rank=8, alpha=16.0, targets=ALL + ("lm_head",))
    frozen = {n: p.data.copy() for n, p in model.named_parameters() if ".lora_" not in n}
    data = go.Dataset.from_tokens(ids, n_ctx=N_CTX, stride=N_CTX)
    pars = go.OptimizerParams(go.AdamWParams(alpha=1e-2))
    go.fit(model, data, "cross_entropy", lambda ep: pars, nepoch=4, nbatch_logical=16,
           silent=True, seed=0)
    for n, p in model.named_parameters():
        if ".lora_" not in n:
            np.testing.assert_array_equal(p.data, frozen[n], err_msg=n)
    adapter = tmp_path / "adapter.gguf"
    save_gguf_lora(model, adapter)

    scored = ids[:4 * N_CTX * 8]
    before = _perplexity_ofopen_llama(open_llama(base, n_ctx=N_CTX), scored, N_CTX)
    after = _perplexity_ofopen_llama(open_llama(base, adapter, n_ctx=N_CTX), scored, N_CTX)
    ours = go.lm.perplexity(model, scored, N_CTX).ppl
    print(f"llama.cpp's perplexity of the text: {before:.2f} base, {after:.2f} with the "
          f"adapter (ggmlopt: {ours:.2f})")
    assert after == pytest.approx(ours, rel=1e-4)
    assert after < 0.5 * before


def _adapted_throughopen_llama(tmp_path, model, targets, text, rng):
    """model saved as the base, adapted on targets with random A and B, the adapter
    written; asserts llama.cpp (base + adapter) gives model's logits within 1e-4 of
    scale, and that the adapter changes them."""
    base = tmp_path / "base.gguf"
    save_gguf(model, base, tokenizer=TOK)
    lora.apply(model, rank=4, alpha=8.0, targets=targets, seed=1)
    for _, layer in lora.named_adapters(model):   # zeros would test nothing
        layer.lora_a.data[...] = rng.normal(0, 0.05, layer.lora_a.shape)
        layer.lora_b.data[...] = rng.normal(0, 0.05, layer.lora_b.shape)
    adapter = tmp_path / "adapter.gguf"
    save_gguf_lora(model, adapter)
    ids = TOK.encode(text)[:64]
    ours = model(ids[None])[0].astype(np.float64)
    theirs = logits_of(open_llama(base, adapter), ids)
    without = logits_of(open_llama(base), ids)
    scale = np.abs(ours).max()
    assert np.abs(theirs - ours).max() <= 1e-4 * scale
    assert np.abs(without - ours).max() > 1e-2 * scale


def test_llama_cpp_applies_our_adapter_to_a_qwen2(tmp_path):
    from ggmlopt.models import Qwen2, Qwen2Config
    model = Qwen2(Qwen2Config(vocab_size=TOK.vocab_size, dim=64, n_layers=2, n_heads=4,
                              n_kv_heads=2, ffn_dim=96, max_seq_len=64, tie_embeddings=True),
                  seed=3)
    rng = np.random.default_rng(5)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.data[...] = rng.normal(0, 0.5, p.shape)
    _adapted_throughopen_llama(tmp_path, model, ALL, "Qwen2 with an adapter, applied by "
                               "llama.cpp: é ✓", rng)


def test_llama_cpp_applies_our_adapter_to_a_qwen3(tmp_path):
    # qwen3's q/k rows are not permuted: an adapter written for llama's order would
    # rotate the wrong pairs
    from ggmlopt.models import Qwen3, Qwen3Config
    model = Qwen3(Qwen3Config(vocab_size=TOK.vocab_size, dim=64, n_layers=2, n_heads=4,
                              n_kv_heads=2, head_dim=24, ffn_dim=96, max_seq_len=64),
                  seed=3)
    rng = np.random.default_rng(6)
    for _, p in model.named_parameters():
        if p.data.ndim == 1:
            p.data[...] = rng.uniform(0.5, 1.5, p.shape)
    _adapted_throughopen_llama(tmp_path, model, ALL, "Qwen3 with an adapter, applied by "
                               "llama.cpp: é ✓", rng)


def test_llama_cpp_applies_our_adapter_to_a_smollm3(tmp_path):
    from ggmlopt.models import SmolLM3, SmolLM3Config
    model = SmolLM3(SmolLM3Config(vocab_size=TOK.vocab_size, dim=64, n_layers=4, n_heads=4,
                                  n_kv_heads=2, ffn_dim=96, max_seq_len=64), seed=3)
    _adapted_throughopen_llama(tmp_path, model, ALL, "SmolLM3 with an adapter, applied by "
                               "llama.cpp: é ✓", np.random.default_rng(7))


def test_llama_cpp_applies_our_embedding_adapter(tmp_path):
    _adapted_throughopen_llama(tmp_path, Llama(_config(), seed=3), ("embed_tokens", "q_proj"),
                               "an adapter on the token embedding: é ✓",
                               np.random.default_rng(2))
