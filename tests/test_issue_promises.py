"""Promises of the LoRA issue (26) read as PEFT's users read them: apply's
signature shows its defaults as the values they are (``trainable=()``), and an
adapter layer gives its wrapped layer back as PEFT's ``base_layer``, a Linear or
a QuantizedLinear alike."""
import inspect

import numpy as np
import pytest

from ggmlopt import lora
from ggmlopt.io import load_gguf, save_gguf
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.nn import Embedding, Linear, QuantizedEmbedding, QuantizedLinear
from ggmlopt.text import ByteTokenizer

CFG = LlamaConfig(vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                  max_seq_len=32)


def test_apply_signature_defaults_equal_their_values():
    params = inspect.signature(lora.apply).parameters
    assert list(params)[:7] == ["model", "rank", "alpha", "targets", "dropout", "seed",
                                "trainable"]
    assert params["trainable"].default == ()
    assert params["rank"].default == 8
    assert params["alpha"].default == 16.0
    assert params["dropout"].default == 0.0
    assert params["targets"].default == None   # the sentinel compares equal to None
    assert params["rank"].default != 4
    assert repr(params["trainable"].default) == "()"


def test_defaults_given_as_values_still_clash_with_a_config():
    pytest.importorskip("peft")
    from peft import LoraConfig
    model = Llama(CFG, seed=0)
    with pytest.raises(TypeError, match="trainable"):
        lora.apply(model, trainable=(), config=LoraConfig(r=4, target_modules=["q_proj"]))
    lora.apply(model, config=LoraConfig(r=4, target_modules=["q_proj"]))   # defaults: no clash


def test_base_layer_is_the_wrapped_linear():
    model = Llama(CFG, seed=0)
    base = model.layers[0].self_attn.q_proj
    lora.apply(model, rank=4, targets=("q_proj", "embed_tokens"))
    layer = model.layers[0].self_attn.q_proj
    assert isinstance(layer, lora.LoRALinear)
    assert layer.base_layer is base and layer.get_base_layer() is base
    assert isinstance(layer.base_layer, Linear)
    assert layer.base_layer.weight is layer.weight   # one Parameter, the adapter's name
    assert isinstance(model.embed_tokens.base_layer, Embedding)
    # not a sub-module: the names stay PEFT-free (q_proj.weight, not base_layer.weight)
    names = [n for n, _ in model.named_parameters()]
    assert "layers.0.self_attn.q_proj.weight" in names
    assert not any("base_layer" in n for n in names)
    with pytest.raises(AttributeError):
        layer.base_layer = Linear(64, 64)


def test_base_layer_over_a_kept_quantized_base(tmp_path):
    path = tmp_path / "m.gguf"
    save_gguf(Llama(CFG, seed=0), path, tokenizer=ByteTokenizer(), dtype="q8_0")
    kept, _ = load_gguf(path, keep_types=True)
    lora.apply(kept, rank=4, targets=("q_proj", "embed_tokens"))
    layer = kept.layers[0].self_attn.q_proj
    assert isinstance(layer.base_layer, QuantizedLinear)
    assert layer.weight is None and layer.base_layer.qtype == "Q8_0"
    w = layer.base_layer.dequantize()
    assert w.dtype == np.float32 and w.shape == (64, 64)
    assert isinstance(kept.embed_tokens.base_layer, QuantizedEmbedding)
