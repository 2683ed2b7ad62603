"""Where packing, sliding windows and the KV cache meet: packed documents
longer than the window, with activation checkpointing and the fused head, as
each document alone; greedy generation past the window, its prompt read across
generate's 256-token chunks, as transformers' generate; batched decoding in
chunks through the C decode step with LoRA adapters over float32 and kept
bases, as the full forward pass."""
import numpy as np
import pytest
from hf_oracle import randomised

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import (
    GPT2,
    Gemma3,
    Gemma3Config,
    GPT2Config,
    Mistral,
    MistralConfig,
    Phi3,
    Phi3Config,
    SmolLM3,
    SmolLM3Config,
    _decode_step,
)
from ggmlopt.nn.positions import mark_document_starts

V = 67
COMMON = {"vocab_size": V, "dim": 32, "n_heads": 4, "ffn_dim": 48, "max_seq_len": 300}
MODELS = {
    # local layers of 4 keys (RoPE base 10000) around a global one (base 1e6)
    "gemma3": (lambda: Gemma3(Gemma3Config(**COMMON, n_layers=3, n_kv_heads=2, head_dim=12,
                                           query_pre_attn_scalar=20.0, sliding_window=4,
                                           sliding_layers=(True, False, True)), seed=1),
               "Gemma3ForCausalLM"),
    "mistral": (lambda: Mistral(MistralConfig(**COMMON, n_layers=2, n_kv_heads=2, head_dim=12,
                                              sliding_window=3), seed=1), "MistralForCausalLM"),
    "phi3": (lambda: Phi3(Phi3Config(**COMMON, n_layers=2, n_kv_heads=2, sliding_window=5),
                          seed=1), "Phi3ForCausalLM"),
    "smollm3": (lambda: SmolLM3(SmolLM3Config(**COMMON, n_layers=4, n_kv_heads=2,
                                              no_rope_layers=(1, 0, 1, 0)), seed=1), None),
    "gpt2": (lambda: GPT2(GPT2Config(vocab_size=V, dim=32, n_layers=2, n_heads=4,
                                     max_seq_len=300), seed=1), None),
}
LENGTHS = (13, 2, 9)   # documents longer and shorter than the windows, then padding
T = 27


def _rows():
    """(packed (1, T), its labels, alone (3, T), their labels, each document's ids)."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, V, n).astype(np.int32) for n in LENGTHS]
    labels = [rng.integers(0, V, n).astype(np.int32) for n in LENGTHS]
    xp, yp = np.zeros((1, T), np.int32), np.full((1, T), -1, np.int32)
    starts = np.zeros((1, T), bool)
    xa, ya = np.zeros((3, T), np.int32), np.full((3, T), -1, np.int32)
    at = 0
    for r, (a, b) in enumerate(zip(docs, labels)):
        xp[0, at:at + a.size], yp[0, at:at + a.size] = a, b
        xa[r, :a.size], ya[r, :b.size] = a, b
        starts[0, at] = True
        at += a.size
    starts[0, at] = True
    return mark_document_starts(xp, starts), yp, xa, ya, docs


def _fused(model, x, y):
    model.zero_grad()
    loss = float(model.fused_cross_entropy(x, y, backward=True))
    model.backward(None)
    return loss, {k: p.grad.copy() for k, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_documents_past_the_window_train_as_alone_with_checkpointing(name):
    model = randomised(MODELS[name][0](), 2)
    model.train()
    xp, yp, xa, ya, docs = _rows()
    logits_p, logits_a = model(xp), model(xa)
    at = 0
    for r, a in enumerate(docs):
        np.testing.assert_allclose(logits_p[0, at:at + a.size], logits_a[r, :a.size], rtol=0,
                                   atol=1e-6 * np.abs(logits_a).max())
        at += a.size
    la, ga = _fused(model, xa, ya)
    lp, gp = _fused(model, xp, yp)
    model.gradient_checkpointing_enable()
    lc, gc = _fused(model, xp, yp)
    assert abs(lp - la) <= 1e-6 * la and lc == lp
    scale = max(np.abs(g).max() for g in ga.values())
    for k in ga:
        np.testing.assert_allclose(gp[k], ga[k], rtol=0, atol=2e-6 * scale, err_msg=k)
        np.testing.assert_array_equal(gc[k], gp[k], err_msg=k)


@pytest.mark.parametrize("name", ["gemma3", "mistral", "phi3"])
def test_greedy_generation_past_the_window_equals_transformers(tmp_path, name):
    """A 260-token prompt (generate reads 256, then 4: windows across the cut), 12
    tokens more: transformers' greedy generate and the full forward's argmax."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from ggmlopt.io import save_hf
    make, hf_class = MODELS[name]
    model = randomised(make(), 3)
    save_hf(model, tmp_path)
    hf = getattr(transformers, hf_class).from_pretrained(tmp_path,
                                                         attn_implementation="eager").eval()
    prompt = np.random.default_rng(1).integers(0, V, 260)
    ours = go.generate(model, prompt, max_new_tokens=12, temperature=0.0, stop_ids=())
    with torch.no_grad():
        # the mask given: without it transformers masks every id equal to pad_token_id
        out = hf.generate(torch.tensor(prompt[None]),
                          attention_mask=torch.ones(1, prompt.size, dtype=torch.long),
                          max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          pad_token_id=0)
    np.testing.assert_array_equal(ours, out[0, prompt.size:].numpy())
    seq = np.concatenate([prompt, ours])[None]
    np.testing.assert_array_equal(model(seq)[0, prompt.size - 1:-1].argmax(-1), ours)


def _adapted(model, kept, tmp_path):
    if kept:
        pytest.importorskip("safetensors")
        from ggmlopt.io import load_hf, save_hf
        save_hf(model, tmp_path)
        model = load_hf(tmp_path, keep_types=True)
    lora.apply(model, rank=3, seed=0, targets="all-linear")
    rng = np.random.default_rng(5)
    for n, p in model.named_parameters():
        if n.endswith("lora_b"):
            p.data[...] = rng.normal(0.0, 0.05, p.shape)
    return model.eval()


@pytest.mark.parametrize("kept", [False, True], ids=["linear", "kept"])
@pytest.mark.parametrize("name", ["gemma3", "mistral", "phi3"])
def test_batched_decoding_in_chunks_with_adapters_equals_the_forward(tmp_path, name, kept):
    model = _adapted(randomised(MODELS[name][0](), 3), kept, tmp_path)
    x = np.random.default_rng(1).integers(0, V, (3, 35)).astype(np.int32)
    full = model(x)
    for chunks in ([20] + [1] * 15, [7, 1, 12] + [1] * 15, [1] * 35):
        cache, at, out = model.make_cache(3, 35), 0, []
        for n in chunks:
            out.append(model.decode(x[:, at:at + n], cache))
            at += n
        np.testing.assert_allclose(np.concatenate(out, 1), full, rtol=0,
                                   atol=2e-5 * np.abs(full).max())
    # Mistral's and Phi-3's blocks took the C step (with its window); Gemma 3's cannot
    stepped = [_decode_step._steps.get(layer) is not None for layer in model.layers]
    assert all(stepped) == (name != "gemma3")
