"""LoRA over a frozen token embedding: the first block's input gradient, which
only the input layers would use, is not computed (torch's autograd skips it
too), and nothing else changes: the adapters' gradients are the same bits as
when the embedding trains."""
import numpy as np
import pytest

from ggmlopt import lora, models

SHAPE = {"vocab_size": 53, "dim": 16, "n_layers": 2, "n_heads": 4, "max_seq_len": 16}
GQA = {**SHAPE, "n_kv_heads": 2, "ffn_dim": 24}
FAMILIES = {
    # (model factory, the input embedding's name, the first block's attention prefix)
    "llama": (lambda: models.Llama(models.LlamaConfig(**GQA), seed=3),
              "embed_tokens", "layers.0.self_attn."),
    "gpt2": (lambda: models.GPT2(models.GPT2Config(**SHAPE), seed=3), "wte", "h.0.attn."),
    "gemma3": (lambda: models.Gemma3(models.Gemma3Config(**GQA, head_dim=4, sliding_window=3,
                                                         query_pre_attn_scalar=4.0), seed=3),
               "embed_tokens", "layers.0.self_attn."),
    "phi3": (lambda: models.Phi3(models.Phi3Config(**GQA), seed=3),
             "embed_tokens", "layers.0.self_attn."),
}
# the attention's projections of the block's input (o_proj's input gradient feeds
# the attention itself: always made)
INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn")


def backward_pass(model, checkpointing=False):
    """One forward and backward with a fixed gradient on the logits: each trainable
    parameter's gradient, and which adapters returned an input gradient."""
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train(True)
    rng = np.random.default_rng(7)
    for _, layer in lora.named_adapters(model):   # B != 0: the adapters' paths count
        layer.lora_b.data[...] = rng.normal(0, 0.3, layer.lora_b.shape)
    tokens = rng.integers(0, SHAPE["vocab_size"], (2, 9)).astype(np.int32)
    g = rng.normal(size=(2, 9, SHAPE["vocab_size"])).astype(np.float32)
    returned = {}
    for name, layer in lora.named_adapters(model):
        backward = layer.backward

        def spy(grad_out, _name=name, _backward=backward):
            out = _backward(grad_out)
            returned[_name] = out is not None
            return out

        layer.backward = spy
    model.forward(tokens)
    model.backward(g)
    grads = {n: p.grad.copy() for n, p in model.named_parameters() if p.requires_grad}
    return grads, returned


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_first_block_input_gradient_skipped_over_a_frozen_embedding(family, checkpointing):
    make, embedding, first_attn = FAMILIES[family]
    frozen, trained = make(), make()
    lora.apply(frozen, rank=2, targets="all-linear")
    lora.apply(trained, rank=2, targets="all-linear", trainable=(embedding,))
    grads, returned = backward_pass(frozen, checkpointing)
    grads_trained, returned_trained = backward_pass(trained, checkpointing)

    inputs = [n for n in returned if n.endswith(INPUT_PROJECTIONS)]
    first = [n for n in inputs if n.startswith(first_attn)]
    assert first and len(first) < len(inputs), sorted(returned)
    # frozen input layers: the first block's input projections give no input
    # gradient; with the embedding training they do, as every later block's do
    assert not any(returned[n] for n in first)
    assert all(returned_trained[n] for n in first)
    assert all(returned[n] for n in inputs if n not in first)
    # nothing else moves: every adapter's gradient is the same bits either way
    assert set(grads) < set(grads_trained)
    for name, g in grads.items():
        np.testing.assert_array_equal(g, grads_trained[name], err_msg=name)
    # and the flags of the first block and of its attention and input norm are
    # what they were (the skip is per backward pass)
    modules = dict(frozen.named_modules())
    block = first_attn.rsplit(".", 2)[0]
    touched = [block, first_attn[:-1]] + [f"{block}.{n}" for n in ("input_layernorm", "ln_1")
                                          if f"{block}.{n}" in modules]
    assert len(touched) == 3
    assert all(modules[n].needs_input_grad for n in touched)


def test_lora_embedding_adapter_keeps_the_input_gradient():
    # an adapter on the embedding trains from the first block's input gradient
    make, _, first_attn = FAMILIES["llama"]
    model = make()
    lora.apply(model, rank=2, targets=("embed_tokens", "q_proj"))
    grads, returned = backward_pass(model)
    assert returned[first_attn + "q_proj"]
    assert np.abs(grads["embed_tokens.lora_a"]).max() > 0
