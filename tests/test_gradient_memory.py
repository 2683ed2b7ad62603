"""Gradients exist only where training needs them: none when a model is built or
loaded, none while it generates or is evaluated; a backward pass or a training
context makes them, frozen parameters never get one."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.models import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=41, dim=16, n_layers=2, n_heads=2, max_seq_len=32)


def _made(model):
    return [name for name, p in model.named_parameters() if p._grad is not None]


def test_building_generating_and_evaluating_make_no_gradient():
    model = Llama(CFG, seed=0)
    assert _made(model) == []
    go.generate(model, [1, 2, 3], 5, temperature=0)
    tokens = np.random.default_rng(0).integers(0, 41, (4, 9)).astype(np.int32)
    go.predict(model, tokens, batch_size=2)
    go.evaluate(model, (tokens[:, :-1], tokens[:, 1:]), "cross_entropy", batch_size=2)
    go.lm.perplexity(model, tokens.ravel(), n_ctx=8)
    assert _made(model) == []


def test_a_backward_pass_makes_zero_gradients_where_they_are_read():
    model = Llama(CFG, seed=0)
    model.norm.weight.requires_grad = False
    p = model.layers[0].mlp.up_proj.weight
    assert p._grad is None
    np.testing.assert_array_equal(p.grad, np.zeros(p.shape, np.float32))  # made on first use
    tokens = np.random.default_rng(0).integers(0, 41, (2, 7))
    out = model.forward(tokens)
    model.backward(np.ones_like(out))
    assert model.norm.weight.grad is None and model.norm.weight._grad is None
    assert np.abs(model.layers[1].mlp.down_proj.weight.grad).max() > 0


@pytest.mark.parametrize("freeze", [False, True])
def test_a_training_context_holds_the_gradients_in_its_arena(freeze):
    model = Llama(CFG, seed=0)
    if freeze:
        from ggmlopt import lora
        lora.apply(model, rank=2)
    ctx = go.OptContext(model, batch_size=2, ne_datapoint=8, loss_type="cross_entropy",
                        class_labels=True, inputs_dtype=np.int32)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert _made(model) == trained   # the arena's views, nothing else
    grads = ctx.arena.flat("grads")
    for _, p in model.named_parameters():
        if p.requires_grad:
            assert np.shares_memory(p.grad, grads)
