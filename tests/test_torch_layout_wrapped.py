"""torch's layout through a Checkpoint: the layer it wraps is stored as itself
(a Checkpoint(Linear)'s weight was written untransposed, which a square layer's
torch module loaded without a word, off by 1.0), a kept layer inside one is
refused as outside, and an embedding adapter is written in PEFT's layout."""
import numpy as np
import pytest

from ggmlopt import lora, nn
from ggmlopt.io.torch_layout import torch_tensors

pytest.importorskip("safetensors")
from ggmlopt.io import load_safetensors, save_safetensors


def test_a_checkpointed_linear_is_transposed_as_a_linear(tmp_path):
    plain = nn.Sequential(nn.Linear(6, 4, rng=0), nn.ReLU(), nn.Linear(4, 4, rng=1))
    wrapped = nn.Sequential(nn.Checkpoint(nn.Linear(6, 4, rng=0)), nn.ReLU(),
                            nn.Checkpoint(nn.Linear(4, 4, rng=1)))
    for a, b in zip(torch_tensors(plain), torch_tensors(wrapped)):
        assert (a.name, a.shape, a.transposed) == (b.name, b.shape, b.transposed)
    save_safetensors(plain, tmp_path / "m.safetensors")
    other = nn.Sequential(nn.Checkpoint(nn.Linear(6, 4, rng=5)), nn.ReLU(),
                          nn.Checkpoint(nn.Linear(4, 4, rng=6)))
    load_safetensors(tmp_path / "m.safetensors", other)
    x = np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32)
    np.testing.assert_array_equal(other(x), plain(x))


def test_a_kept_layer_inside_a_checkpoint_is_refused_as_outside(tmp_path):
    w = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float16)
    model = nn.Sequential(nn.Checkpoint(nn.QuantizedLinear(w, "F16", 5, 4)))
    with pytest.raises(ValueError, match="keep their weights in the file's types"):
        save_safetensors(model, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


def test_an_embedding_adapter_is_written_in_peft_s_layout():
    from ggmlopt.models import Llama, LlamaConfig
    model = Llama(LlamaConfig(vocab_size=61, dim=16, n_layers=1, n_heads=2,
                              tie_embeddings=False), seed=0)
    lora.apply(model, rank=3, targets=("embed_tokens",))
    shapes = {t.name: t.shape for t in torch_tensors(model)}
    assert shapes["embed_tokens.lora_a"] == (3, 61)   # PEFT's lora_embedding_A (r, vocab)
    assert shapes["embed_tokens.lora_b"] == (16, 3)   # lora_embedding_B (dim, r)
