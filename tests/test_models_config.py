"""LlamaConfig and GPT2Config: defaults as llama2.c / Hugging Face compute them,
every bad field refused by name."""
import dataclasses

import pytest

import ggmlopt as go
from ggmlopt.models import GPT2Config, LlamaConfig, llama_ffn_dim


def test_llama_defaults_and_stories_shapes():
    c = LlamaConfig(32000, 288, 6, 6)
    assert (c.n_kv_heads, c.ffn_dim, c.max_seq_len, c.norm_eps, c.rope_base,
            c.tie_embeddings) == (6, 768, 2048, 1e-5, 10000.0, False)
    assert c.head_dim == 48
    # llama2.c's stories models: dim -> hidden_dim of their checkpoints
    assert [llama_ffn_dim(d) for d in (288, 512, 768)] == [768, 1376, 2048]
    assert LlamaConfig(100, 64, 2, 8, n_kv_heads=2, ffn_dim=100).ffn_dim == 100
    assert LlamaConfig(100, 64, 2, 8, n_kv_heads=2).n_kv_heads == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.dim = 3
    assert dataclasses.fields(LlamaConfig)[4].name == "n_kv_heads"
    assert [f.name for f in dataclasses.fields(LlamaConfig)] == [
        "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len",
        "norm_eps", "rope_base", "tie_embeddings", "rope_scaling", "qkv_bias"]
    assert go.models.LlamaConfig is LlamaConfig


def test_gpt2_defaults():
    c = GPT2Config(50257, 768, 12, 12)
    assert (c.max_seq_len, c.norm_eps, c.head_dim, c.ffn_dim) == (1024, 1e-5, 64, 3072)
    assert [f.name for f in dataclasses.fields(GPT2Config)] == [
        "vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "norm_eps"]


@pytest.mark.parametrize("kwargs,match", [
    ({"dim": 290}, "dim: expected a multiple of n_heads=6"),
    ({"n_kv_heads": 4}, "n_kv_heads: expected a divisor of n_heads=6"),
    ({"n_kv_heads": 0}, "n_kv_heads: expected >= 1"),
    ({"vocab_size": 0}, "vocab_size: expected >= 1"),
    ({"n_layers": -1}, "n_layers"),
    ({"ffn_dim": 0}, "ffn_dim"),
    ({"max_seq_len": 0}, "max_seq_len"),
    ({"norm_eps": 0.0}, "norm_eps"),
    ({"norm_eps": float("nan")}, "norm_eps"),
    ({"rope_base": -1.0}, "rope_base"),
    ({"dim": 18, "n_heads": 6}, "must be even"),
])
def test_llama_refuses_bad_values(kwargs, match):
    args = {"vocab_size": 100, "dim": 288, "n_layers": 2, "n_heads": 6} | kwargs
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**args)


@pytest.mark.parametrize("kwargs,match", [
    ({"dim": 288.0}, "dim: expected an int"),
    ({"n_heads": True}, "n_heads"),
    ({"tie_embeddings": 1}, "tie_embeddings"),
    ({"norm_eps": "1e-5"}, "norm_eps"),
])
def test_llama_refuses_bad_types(kwargs, match):
    args = {"vocab_size": 100, "dim": 288, "n_layers": 2, "n_heads": 6} | kwargs
    with pytest.raises(TypeError, match=match):
        LlamaConfig(**args)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"dim": 100}, ValueError, "dim: expected a multiple of n_heads=12"),
    ({"n_heads": 0}, ValueError, "n_heads"),
    ({"max_seq_len": 0}, ValueError, "max_seq_len"),
    ({"norm_eps": -1e-5}, ValueError, "norm_eps"),
    ({"vocab_size": 1.5}, TypeError, "vocab_size"),
])
def test_gpt2_refuses_bad_fields(kwargs, exc, match):
    args = {"vocab_size": 100, "dim": 96, "n_layers": 2, "n_heads": 12} | kwargs
    with pytest.raises(exc, match=match):
        GPT2Config(**args)
