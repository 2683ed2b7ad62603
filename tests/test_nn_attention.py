"""CausalSelfAttention, GPT2Attention and RotaryEmbedding against torch (the same
weights, F.scaled_dot_product_attention(is_causal=True) and Hugging Face's
rotate_half): outputs and every gradient within 1e-4 relative; plus the layer
protocol (reused buffers, gradients added, frozen parameters), 1 vs 2 threads
bit for bit, and bad input."""
import numpy as np
import pytest

from ggmlopt import kernels
from ggmlopt.nn import CausalSelfAttention, GPT2Attention, Parameter, RotaryEmbedding

RTOL = 1e-4
N_HEADS = 4


def rel_err(got, want, floor=1e-3):
    """max |got - want| over the largest |want| (the tensor's scale), that scale
    at least floor: a gradient that is 0 in exact arithmetic (q's and k's at
    T = 1, where the softmax is constant) is float rounding noise in both, to be
    measured against the scale of the gradients around it."""
    want = np.asarray(want, dtype=np.float64)
    scale = max(np.abs(want).max(), floor)
    return np.abs(np.asarray(got, dtype=np.float64) - want).max() / scale


def torch_rope(x, pos, base):
    """HF's LlamaRotaryEmbedding + apply_rotary_pos_emb for x (B, H, T, D)."""
    import torch
    d, t = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float) / d))
    positions = torch.arange(pos, pos + t, dtype=torch.int64).float()
    freqs = (inv_freq[None, :, None] @ positions[None, None, :]).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def torch_attention(layer, x, grad, pos=0):
    """The torch twin of a CausalSelfAttention: (y, dx, {param name: grad})."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    params = {n: torch.tensor(p.data, dtype=torch.float32, requires_grad=True)
              for n, p in layer.named_parameters()}
    xt = torch.tensor(x, requires_grad=True)
    b, t, dim = x.shape
    h, hkv, d = layer.n_heads, layer.n_kv_heads, layer.head_dim

    def proj(name, inp):
        out = inp @ params[f"{name}.weight"]
        bias = params.get(f"{name}.bias")
        return out + bias if bias is not None else out

    q = proj("q_proj", xt).view(b, t, h, d).transpose(1, 2)
    k = proj("k_proj", xt).view(b, t, hkv, d).transpose(1, 2)
    v = proj("v_proj", xt).view(b, t, hkv, d).transpose(1, 2)
    if layer.rotary is not None:
        q = torch_rope(q, pos, layer.rotary.base)
        k = torch_rope(k, pos, layer.rotary.base)
    k = k.repeat_interleave(h // hkv, dim=1)  # HF's repeat_kv
    v = v.repeat_interleave(h // hkv, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = proj("o_proj", o.transpose(1, 2).reshape(b, t, dim))
    y.backward(torch.tensor(grad))
    return (y.detach().numpy(), xt.grad.numpy(),
            {n: p.grad.numpy() for n, p in params.items()})


def make_layer(head_dim, n_kv_heads, seed, **kw):
    layer = CausalSelfAttention(N_HEADS * head_dim, N_HEADS, n_kv_heads, rng=seed, **kw)
    if layer.q_proj.bias is not None:  # non-zero biases, so their effect shows
        gen = np.random.default_rng(seed + 1)
        for m in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
            m.bias.data[...] = gen.uniform(-0.5, 0.5, m.bias.shape)
    return layer


def check_against_torch(layer, x, grad, pos=0):
    y = layer(x, pos=pos)
    dx = layer.backward(grad)
    ty, tdx, tgrads = torch_attention(layer, x, grad, pos)
    assert rel_err(y, ty) < RTOL, "output"
    assert rel_err(dx, tdx) < RTOL, "input gradient"
    floor = max(np.abs(g).max() for g in tgrads.values())
    for name, p in layer.named_parameters():
        assert rel_err(p.grad, tgrads[name], floor) < RTOL, name


@pytest.mark.parametrize("seq", [1, 7, 64, 129])
@pytest.mark.parametrize("head_dim", [8, 16, 64])
@pytest.mark.parametrize("n_kv_heads", [1, 2, N_HEADS])
def test_llama_attention_matches_torch(simd_path, seq, head_dim, n_kv_heads, rng):
    pytest.importorskip("torch")
    layer = make_layer(head_dim, n_kv_heads, seed=seq + head_dim)
    x = rng.standard_normal((2, seq, layer.dim)).astype(np.float32)
    grad = rng.standard_normal((2, seq, layer.dim)).astype(np.float32)
    check_against_torch(layer, x, grad)


@pytest.mark.parametrize("pos", [0, 5, 2048, 4000])
def test_position_offset_and_bias_match_torch(simd_path, pos, rng):
    pytest.importorskip("torch")
    layer = make_layer(16, 2, seed=3, bias=True, rope_base=500000.0)
    x = rng.standard_normal((2, 9, layer.dim)).astype(np.float32)
    grad = rng.standard_normal((2, 9, layer.dim)).astype(np.float32)
    check_against_torch(layer, x, grad, pos=pos)


def test_without_rope_matches_torch(rng):
    pytest.importorskip("torch")
    layer = make_layer(8, N_HEADS, seed=4, rope=False)
    assert layer.rotary is None
    x = rng.standard_normal((3, 17, layer.dim)).astype(np.float32)
    grad = rng.standard_normal((3, 17, layer.dim)).astype(np.float32)
    check_against_torch(layer, x, grad)


def torch_gpt2_attention(layer, x, grad):
    """HF GPT2Attention's arithmetic in torch: c_attn, split q|k|v, sdpa, c_proj."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    params = {n: torch.tensor(p.data, requires_grad=True) for n, p in layer.named_parameters()}
    xt = torch.tensor(x, requires_grad=True)
    b, t, dim = x.shape
    h, d = layer.n_heads, layer.head_dim
    qkv = xt @ params["c_attn.weight"] + params["c_attn.bias"]
    q, k, v = (a.view(b, t, h, d).transpose(1, 2) for a in qkv.split(dim, dim=2))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = o.transpose(1, 2).reshape(b, t, dim) @ params["c_proj.weight"] + params["c_proj.bias"]
    y.backward(torch.tensor(grad))
    return (y.detach().numpy(), xt.grad.numpy(),
            {n: p.grad.numpy() for n, p in params.items()})


@pytest.mark.parametrize("seq", [1, 7, 64, 129])
@pytest.mark.parametrize("head_dim", [8, 16, 64])
def test_gpt2_attention_matches_torch(simd_path, seq, head_dim, rng):
    pytest.importorskip("torch")
    layer = GPT2Attention(N_HEADS * head_dim, N_HEADS, rng=seq)
    gen = np.random.default_rng(seq)
    for m in (layer.c_attn, layer.c_proj):
        m.bias.data[...] = gen.uniform(-0.5, 0.5, m.bias.shape)
    x = rng.standard_normal((2, seq, layer.dim)).astype(np.float32)
    grad = rng.standard_normal((2, seq, layer.dim)).astype(np.float32)
    y = layer(x)
    dx = layer.backward(grad)
    ty, tdx, tgrads = torch_gpt2_attention(layer, x, grad)
    assert rel_err(y, ty) < RTOL
    assert rel_err(dx, tdx) < RTOL
    floor = max(np.abs(g).max() for g in tgrads.values())
    for name, p in layer.named_parameters():
        assert rel_err(p.grad, tgrads[name], floor) < RTOL, name


def test_parameter_names():
    layer = CausalSelfAttention(32, 4, 2)
    assert [n for n, _ in layer.named_parameters()] == [
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
    assert layer.k_proj.weight.shape == (32, 16)
    gpt2 = GPT2Attention(32, 4)
    assert [n for n, _ in gpt2.named_parameters()] == [
        "c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias"]
    assert gpt2.c_attn.weight.shape == (32, 96)


def run_step(layer, x, grad):
    for p in layer.parameters():
        p.grad[...] = 0
        p.grad_is_zero = True
    y = layer(x)
    dx = np.array(layer.backward(grad), copy=True)
    return y, dx, [p.grad.copy() for p in layer.parameters()]


@pytest.mark.parametrize("make", [lambda: CausalSelfAttention(64, 4, 2, rng=1),
                                  lambda: GPT2Attention(64, 4, rng=1)])
def test_one_and_two_threads_bit_identical(make, restore_threads, rng):
    layer = make()
    x = rng.standard_normal((3, 70, 64)).astype(np.float32)
    grad = rng.standard_normal((3, 70, 64)).astype(np.float32)
    kernels.set_num_threads(1)
    one = run_step(layer, x, grad)
    kernels.set_num_threads(2)
    two = run_step(layer, x, grad)
    for a, b in zip([one[0], one[1], *one[2]], [two[0], two[1], *two[2]]):
        assert np.array_equal(a, b)


def test_backward_adds_into_grad(rng):
    layer = CausalSelfAttention(32, 4, 1, rng=0)
    x = rng.standard_normal((2, 5, 32)).astype(np.float32)
    grad = rng.standard_normal((2, 5, 32)).astype(np.float32)
    _, _, first = run_step(layer, x, grad)
    layer.forward(x)
    layer.backward(grad)
    # the second pass adds its sums into the first's (a chain from g, not from
    # zero): each element within a few roundings of its terms' scale, which the
    # gradient's largest element bounds here (10 rows a sum)
    for p, g in zip(layer.parameters(), first):
        np.testing.assert_allclose(p.grad, 2 * g, rtol=1e-6, atol=1e-6 * np.abs(g).max())


def test_forward_buffer_and_call_copy(rng):
    layer = CausalSelfAttention(32, 4, rng=0)
    x1 = rng.standard_normal((1, 4, 32)).astype(np.float32)
    x2 = rng.standard_normal((1, 4, 32)).astype(np.float32)
    a = layer(x1)
    b = layer(x2)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, layer(x1))
    # a new array per pass (the caller reads it at once: no layer keeps a dead copy)
    first = layer.forward(x1)
    assert not np.shares_memory(first, layer.forward(x2))
    assert not np.shares_memory(first, layer.o_proj.forward(x1.reshape(4, 32)))


class _Frozen(Parameter):
    """A Parameter that can carry requires_grad whatever Parameter's slots are."""


def frozen(param):
    p = _Frozen(param.data, name=param.name)
    p.requires_grad = False
    return p


def test_frozen_parameters_get_no_gradient(rng):
    layer = CausalSelfAttention(32, 4, 2, rng=0)
    x = rng.standard_normal((2, 6, 32)).astype(np.float32)
    grad = rng.standard_normal((2, 6, 32)).astype(np.float32)
    _, dx_ref, _ = run_step(layer, x, grad)
    for m in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
        m.weight = frozen(m.weight)
    layer.forward(x)
    dx = layer.backward(grad)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-6)
    for p in layer.parameters():
        assert p.grad is None  # frozen: no gradient (torch's .grad of such a tensor)
    layer.needs_input_grad = False
    layer.forward(x)
    assert layer.backward(grad) is None


def test_needs_input_grad_false_still_fills_parameter_grads(rng):
    layer = CausalSelfAttention(32, 4, 2, rng=0)
    x = rng.standard_normal((2, 6, 32)).astype(np.float32)
    grad = rng.standard_normal((2, 6, 32)).astype(np.float32)
    _, _, grads_ref = run_step(layer, x, grad)
    layer.needs_input_grad = False
    for p in layer.parameters():
        p.grad[...] = 0
    layer.forward(x)
    assert layer.backward(grad) is None
    for p, g in zip(layer.parameters(), grads_ref):
        np.testing.assert_allclose(p.grad, g, rtol=1e-5, atol=1e-6)


def test_rotary_embedding_forward_backward(rng):
    rope = RotaryEmbedding(8)
    x = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
    y = rope(x, pos=3)
    # a rotation: norms of each pair kept; backward is the inverse rotation
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    np.testing.assert_allclose(rope.backward(y), x, rtol=1e-5, atol=1e-6)
    # positions start at pos: token 0 at pos 3 equals token 3 at pos 0
    x4 = np.repeat(x[:, :1], 4, axis=1)
    np.testing.assert_allclose(rope(x4, pos=0)[:, 3], y[:, 0], rtol=1e-6, atol=1e-7)


def test_bad_input_raises():
    layer = CausalSelfAttention(32, 4, 2)
    with pytest.raises(ValueError, match="x"):
        layer.forward(np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match="x"):
        layer.forward(np.zeros((1, 3, 31), np.float32))
    with pytest.raises(TypeError, match="x"):
        layer.forward(np.zeros((1, 3, 32), np.complex64))
    with pytest.raises(ValueError, match="pos"):
        layer.forward(np.zeros((1, 3, 32), np.float32), pos=-1)
    with pytest.raises(TypeError, match="pos"):
        layer.forward(np.zeros((1, 3, 32), np.float32), pos=1.5)
    with pytest.raises(RuntimeError, match="forward"):
        layer.backward(np.zeros((1, 3, 32), np.float32))
    layer.forward(np.zeros((1, 3, 32), np.float32))
    with pytest.raises(ValueError, match="grad_out"):
        layer.backward(np.zeros((1, 4, 32), np.float32))
    with pytest.raises(ValueError, match="n_heads"):
        CausalSelfAttention(30, 4)
    with pytest.raises(ValueError, match="n_kv_heads"):
        CausalSelfAttention(32, 4, 3)
    with pytest.raises(TypeError, match="n_heads"):
        CausalSelfAttention(32, 4.0)
    with pytest.raises(ValueError, match="head_dim"):
        CausalSelfAttention(2 * 260, 2)
    with pytest.raises(ValueError, match="head_dim"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="base"):
        RotaryEmbedding(8, base=0.5)
    assert isinstance(layer.q_proj.weight, Parameter)
