"""Activation checkpointing: gradients and trajectories bit-identical to the run
without it (same kernels, same order, the same Dropout draws), on every
language model, with LoRA (and its dropout), and the Checkpoint wrapper on a
user's block."""
import copy

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import GPT2, GPT2Config, Llama, LlamaConfig, Qwen2, Qwen2Config
from ggmlopt.nn import Checkpoint, Dropout, Linear, ReLU, Sequential

MODELS = {
    "llama": lambda: Llama(LlamaConfig(vocab_size=61, dim=32, n_layers=3, n_heads=4,
                                       n_kv_heads=2, ffn_dim=48, max_seq_len=16), seed=1),
    "qwen2": lambda: Qwen2(Qwen2Config(vocab_size=61, dim=32, n_layers=3, n_heads=4,
                                       n_kv_heads=2, ffn_dim=48, max_seq_len=16,
                                       tie_embeddings=True), seed=1),
    "gpt2": lambda: GPT2(GPT2Config(vocab_size=61, dim=32, n_layers=3, n_heads=4,
                                    max_seq_len=16), seed=1),
}


def train(model, steps=3, seed=0):
    """steps of an OptContext (dynamic batches of 3 x 12 tokens): the losses and
    the trained parameters."""
    rng = np.random.default_rng(seed)
    ctx = go.OptContext(model, loss_type=go.LossType.CROSS_ENTROPY, inputs_dtype=np.int32,
                        seed=5)
    losses = []
    for _ in range(steps):
        tokens = rng.integers(0, 61, (3, 13)).astype(np.int32)
        ctx.alloc(True)
        ctx.eval(None, inputs=np.ascontiguousarray(tokens[:, :-1]),
                 labels=np.ascontiguousarray(tokens[:, 1:]))
        losses.append(float(ctx.loss))
    return losses, {n: p.data.copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("adapters", [False, True])
def test_checkpointing_trains_bit_for_bit_the_same(name, adapters):
    plain = MODELS[name]()
    if adapters:   # LoRA with dropout: the recomputation must replay its masks
        lora.apply(plain, rank=4, targets="all-linear", dropout=0.3, seed=2)
        for _, layer in lora.named_adapters(plain):
            layer.lora_b.data[...] = 0.01
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable()
    assert checkpointed.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    want_losses, want = train(plain)
    got_losses, got = train(checkpointed)
    assert got_losses == want_losses
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_checkpointing_keeps_only_the_block_inputs():
    model = MODELS["llama"]()
    model.gradient_checkpointing_enable()
    go.nn.set_training(model, True)
    tokens = np.arange(24).reshape(2, 12) % 61
    logits = model.forward(tokens)
    # between the passes no block holds its activations: only the saved inputs
    for layer in model.layers:
        assert layer.mlp.up_proj._x is None and layer.self_attn.q_proj._out is None
    assert len(model._saved_blocks) == 3
    assert model._saved_blocks[0].x.shape == (2, 12, 32)
    model.backward(np.ones_like(logits) * 1e-3)
    assert model._saved_blocks is None
    model.gradient_checkpointing_disable()
    model.forward(tokens)
    assert model.layers[0].mlp.up_proj._x is not None


def test_checkpointing_off_outside_training_and_decoding_unchanged():
    model = MODELS["llama"]()
    want = go.generate(model, [1, 2, 3], 6, temperature=0)
    model.gradient_checkpointing_enable()
    np.testing.assert_array_equal(go.generate(model, [1, 2, 3], 6, temperature=0), want)


def test_the_checkpoint_wrapper_on_a_users_block():
    def make():
        return Sequential(Linear(8, 16, rng=0), ReLU(), Dropout(0.25, rng=1),
                          Linear(16, 16, rng=2), ReLU(), Linear(16, 3, rng=3))

    plain = make()
    wrapped = make()
    wrapped.layers[1] = Checkpoint(Sequential(*wrapped.layers[1:5]))
    del wrapped.layers[2:5]
    # the wrapper adds no level to the names
    assert [n for n, _ in go.nn.named_parameters(wrapped)] == \
        ["0.weight", "0.bias", "1.2.weight", "1.2.bias", "2.weight", "2.bias"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 8)).astype(np.float32)
    y = rng.standard_normal((32, 3)).astype(np.float32)
    out = []
    for model in (plain, wrapped):
        data = go.Dataset.from_arrays(x, y)   # fit shuffles it: one each
        h = go.fit(model, data, "mean_squared_error", nepoch=3, nbatch_logical=8, silent=True,
                   seed=4)
        out.append(([e.train_loss for e in h.epochs],
                    [p.data.copy() for p in model.parameters()]))
    assert out[0][0] == out[1][0]
    for a, b in zip(out[0][1], out[1][1]):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="module"):
        Checkpoint(object())
