"""What the model-family tests share: norms moved off ones, the logits and every
gradient against a transformers class on the checkpoint save_hf writes, and
generation with the KV cache against full forward passes."""
import numpy as np
import pytest

import ggmlopt as go


def randomised(model, seed):
    """model with its 1-D weights (the norms) drawn from U(0.5, 1.5), so they count."""
    rng = np.random.default_rng(seed)
    for _, p in model.named_parameters():
        if p.data.ndim == 1:
            p.data[...] = rng.uniform(0.5, 1.5, p.shape)
    return model


def assert_equals_transformers(model, hf_class, tmp_path, T, *, eager=False, vocab=67,
                               noise_floor=1e-3):
    """save_hf(model), loaded by transformers' hf_class with no missing or
    unexpected keys: logits of 2 x T random tokens within 1e-4 of their scale and
    every parameter gradient within 1e-4 of its own (or of noise_floor times the
    largest gradient, where a gradient is rounding noise).  Returns the HF model."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from ggmlopt.io import save_hf
    save_hf(model, tmp_path)
    kw = {"attn_implementation": "eager"} if eager else {}
    hf, info = getattr(transformers, hf_class).from_pretrained(
        tmp_path, output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    rng = np.random.default_rng(T)
    tokens = rng.integers(0, vocab, (2, T))
    logits = hf(torch.tensor(tokens)).logits
    want = logits.detach().numpy()
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())
    g = rng.normal(size=want.shape).astype(np.float32)
    (logits * torch.tensor(g)).sum().backward()
    model.zero_grad()
    model.backward(g)
    ours = dict(model.named_parameters())
    overall = max(float(np.abs(p.grad.numpy()).max()) for _, p in hf.named_parameters())
    seen = 0
    for name, p in hf.named_parameters():
        mine = ours.get(name.removeprefix("model."))
        if mine is None:
            continue
        seen += 1
        theirs = p.grad.numpy()
        grad = mine.grad.T if mine.grad.ndim == 2 and "embed" not in name else mine.grad
        # q and k get no gradient at T = 1 (one score per softmax): only float32
        # rounding noise, far below the model's gradients, shows there
        scale = max(np.abs(theirs).max(), noise_floor * overall)
        np.testing.assert_allclose(grad, theirs, rtol=0, atol=1e-4 * scale, err_msg=name)
    assert seen == len(ours)
    return hf


def assert_cache_equals_recompute(model, prompt, new_tokens):
    """Greedy generate (the KV cache) against argmax of full forward passes."""
    prompt = np.asarray(prompt)
    out = go.generate(model, prompt, max_new_tokens=new_tokens, temperature=0.0, stop_ids=())
    seq = prompt[None, :]
    for _ in range(new_tokens):
        nxt = int(np.argmax(model(seq)[0, -1]))
        seq = np.concatenate([seq, [[nxt]]], axis=1)
    np.testing.assert_array_equal(out, seq[0, prompt.size:])
