"""The pad token's embedding row trains as transformers trains it: its lookups add
no gradient (transformers builds every Llama-layout family's embedding as
nn.Embedding(padding_idx=pad_token_id)), a tied head's gradient still reaches it,
and PEFT's embedding adapter leaves that row of A untrained.  load_hf sets the
embedding's padding_idx from config.json's pad_token_id (each family's
transformers default where it is missing) and save_hf writes it back."""
import json

import numpy as np
import pytest

from ggmlopt import lora
from ggmlopt.models import (
    Gemma3,
    Gemma3Config,
    Llama,
    LlamaConfig,
    Phi3,
    Phi3Config,
    Qwen2,
    Qwen2Config,
)
from ggmlopt.nn import Embedding

PAD = 3


def test_the_padding_row_gets_no_gradient_from_lookups():
    emb = Embedding(7, 4, rng=0, padding_idx=PAD)
    assert not emb.weight.data[PAD].any()   # torch's init zeroes it too
    ids = np.array([[1, PAD, 5, PAD], [PAD, 1, 0, 6]])
    g = np.random.default_rng(0).normal(size=(2, 4, 4)).astype(np.float32)
    before = g.copy()
    emb.forward(ids)
    emb.backward(g)
    np.testing.assert_array_equal(g, before)   # the caller's gradient is left as it was
    want = np.zeros((7, 4))
    np.add.at(want, ids[ids != PAD], g[ids != PAD])
    np.testing.assert_allclose(emb.weight.grad, want, rtol=1e-6, atol=1e-6)
    assert Embedding(7, 4, padding_idx=-1).padding_idx == 6   # torch counts from the end
    with pytest.raises(ValueError, match=r"padding_idx: 7 is outside the vocabulary"):
        Embedding(7, 4, padding_idx=7)


FAMILIES = {
    "llama-tied": (Llama, LlamaConfig, "LlamaForCausalLM", {"tie_embeddings": True}),
    "qwen2": (Qwen2, Qwen2Config, "Qwen2ForCausalLM", {}),
    "gemma3": (Gemma3, Gemma3Config, "Gemma3ForCausalLM", {"head_dim": 8}),
    "phi3": (Phi3, Phi3Config, "Phi3ForCausalLM", {}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_embedding_gradients_equal_transformers_with_pad_tokens(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    cls, config_cls, hf_class, extra = FAMILIES[family]
    model = cls(config_cls(vocab_size=29, dim=16, n_layers=1, n_heads=2, ffn_dim=24,
                           max_seq_len=32, **extra), seed=0)
    model.embed_tokens.padding_idx = PAD
    save_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["pad_token_id"] == PAD
    model = load_hf(tmp_path)
    assert model.embed_tokens.padding_idx == PAD
    hf = getattr(transformers, hf_class).from_pretrained(tmp_path).eval()
    assert hf.get_input_embeddings().padding_idx == PAD
    tokens = np.random.default_rng(1).integers(0, 29, (2, 12))
    tokens[:, ::3] = PAD   # padding among the tokens, as a padded batch has it
    logits = hf(torch.tensor(tokens)).logits
    g = np.random.default_rng(2).normal(size=logits.shape).astype(np.float32)
    (logits * torch.tensor(g)).sum().backward()
    model.zero_grad()
    model.forward(tokens)
    model.backward(g)
    theirs = hf.get_input_embeddings().weight.grad.numpy()
    ours = dict(model.named_parameters())["embed_tokens.weight"].grad
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * np.abs(theirs).max())
    if not getattr(model.config, "tie_embeddings", False) or family == "gemma3":
        assert family == "gemma3" or not ours[PAD].any()


def test_missing_pad_token_id_is_each_familys_transformers_default(tmp_path):
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    for cls, config_cls, extra, default in [(Llama, LlamaConfig, {}, None),
                                            (Gemma3, Gemma3Config, {"head_dim": 8}, 0)]:
        save_hf(cls(config_cls(vocab_size=29, dim=16, n_layers=1, n_heads=2, ffn_dim=24,
                               max_seq_len=32, **extra), seed=0), tmp_path)
        cfg = json.loads((tmp_path / "config.json").read_text())
        assert cfg["pad_token_id"] is None
        del cfg["pad_token_id"]
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert load_hf(tmp_path).embed_tokens.padding_idx == default
    # a pad outside the vocabulary is refused, as torch's embedding refuses it
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "pad_token_id": 29}))
    with pytest.raises(ValueError, match=r"pad_token_id: 29 is outside the vocabulary"):
        load_hf(tmp_path)


def test_the_embedding_adapter_leaves_the_padding_row_of_a_untrained():
    # PEFT gathers lora_embedding_A with the base's padding_idx
    model = Llama(LlamaConfig(vocab_size=29, dim=16, n_layers=1, n_heads=2, ffn_dim=24,
                              max_seq_len=32), seed=0)
    model.embed_tokens.padding_idx = PAD
    lora.apply(model, rank=4, targets=("embed_tokens",), seed=0)
    adapter = model.embed_tokens
    adapter.lora_a.data[...] = np.random.default_rng(3).normal(size=adapter.lora_a.data.shape)
    tokens = np.random.default_rng(1).integers(0, 29, (2, 12))
    tokens[:, ::3] = PAD
    out = model.forward(tokens)
    model.zero_grad()
    model.backward(np.ones_like(out))
    grad_a = adapter.lora_a.grad
    assert not grad_a[PAD].any()
    assert np.abs(grad_a[np.unique(tokens[tokens != PAD])]).min(axis=1).max() > 0
    assert lora.merge(model).embed_tokens.padding_idx == PAD   # the merged layer keeps it


def test_peft_embedding_adapter_gradients_equal_ours(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    pytest.importorskip("safetensors")
    from ggmlopt.io import save_hf
    model = Llama(LlamaConfig(vocab_size=29, dim=16, n_layers=1, n_heads=2, ffn_dim=24,
                              max_seq_len=32), seed=0)
    model.embed_tokens.padding_idx = PAD
    save_hf(model, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    hf = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8,
                                                 target_modules=["embed_tokens"]))
    lora.apply(model, rank=4, alpha=8, targets=("embed_tokens",), seed=0)
    adapter = model.embed_tokens
    rng = np.random.default_rng(3)
    adapter.lora_a.data[...] = rng.normal(size=adapter.lora_a.data.shape)
    adapter.lora_b.data[...] = rng.normal(size=adapter.lora_b.data.shape)
    emb = hf.base_model.model.model.embed_tokens
    with torch.no_grad():
        emb.lora_embedding_A["default"].copy_(torch.tensor(adapter.lora_a.data.T))
        emb.lora_embedding_B["default"].copy_(torch.tensor(adapter.lora_b.data.T))
    tokens = np.random.default_rng(1).integers(0, 29, (2, 12))
    tokens[:, ::3] = PAD
    logits = hf(input_ids=torch.tensor(tokens)).logits
    g = np.random.default_rng(2).normal(size=logits.shape).astype(np.float32)
    (logits * torch.tensor(g)).sum().backward()
    model.zero_grad()
    np.testing.assert_allclose(model.forward(tokens), logits.detach().numpy(), rtol=0,
                               atol=1e-4 * float(logits.detach().abs().max()))
    model.backward(g)
    for ours, theirs in [(adapter.lora_a.grad, emb.lora_embedding_A["default"].grad.numpy().T),
                         (adapter.lora_b.grad, emb.lora_embedding_B["default"].grad.numpy().T)]:
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * np.abs(theirs).max())
    assert not adapter.lora_a.grad[PAD].any()


def test_a_gguf_carries_no_padding_row(tmp_path):
    # llama.cpp's files say nothing of it (llama-finetune trains every row)
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    model = Llama(LlamaConfig(vocab_size=257, dim=16, n_layers=1, n_heads=2), seed=0)
    model.embed_tokens.padding_idx = PAD
    save_gguf(model, tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    assert load_gguf(tmp_path / "m.gguf")[0].embed_tokens.padding_idx is None
    load_gguf(tmp_path / "m.gguf", model)   # into a model with one: the same logits
    assert model.embed_tokens.padding_idx == PAD
