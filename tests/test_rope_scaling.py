"""RoPE scaling (ggmlopt.nn.RopeScaling): Llama 3's, linear and YaRN frequencies as
transformers computes them, Llama 3 checkpoints that load_hf reads with transformers'
logits and gradients, and configs whose rope fields are refused rather than dropped."""
import json

import numpy as np
import pytest

from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.nn import RopeScaling, RotaryEmbedding
from ggmlopt.nn.rope_scaling import default_inv_freq, rope_inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": LLAMA3,
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0,
                    "truncate": False},
}
# torch's float32 pow and NumPy's differ in the last bits by CPU (each within about an
# ulp); the scalings' float32 steps (a product, a difference, a quotient) add a few
# more: 8 ulps relative covers them, far below a wrong formula (factor 4-8 apart)
ULPS = 8 * np.finfo(np.float32).eps


def _hf_inv_freq(transformers, params, head_dim=16, base=500000.0, max_pos=128):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = transformers.LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2,
                                   max_position_embeddings=max_pos,
                                   rope_parameters={**params, "rope_theta": base})
    inv, attention = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    return inv.numpy(), attention


@pytest.mark.parametrize("kind", list(SCALINGS))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_frequencies_equal_transformers(kind, head_dim):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    params = SCALINGS[kind]
    want, want_attention = _hf_inv_freq(transformers, params, head_dim)
    scaling = RopeScaling.from_hf(dict(params), 128)
    got, attention = rope_inv_freq(head_dim, 500000.0, scaling)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=ULPS, atol=0)
    assert attention == pytest.approx(want_attention, rel=1e-12)


def test_llama3_keeps_high_frequencies_and_divides_low_ones():
    scaling = RopeScaling.from_hf(dict(LLAMA3), 128)
    inv, _ = rope_inv_freq(64, 500000.0, scaling)
    base = default_inv_freq(64, 500000.0)
    wavelen = 2 * np.pi / base
    high, low = wavelen < 16 / 4.0, wavelen > 16 / 1.0
    np.testing.assert_array_equal(inv[high], base[high])
    np.testing.assert_allclose(inv[low], base[low] / 8, rtol=1e-7)
    mid = ~high & ~low
    assert np.all((inv[mid] < base[mid]) & (inv[mid] > base[mid] / 8))


def test_the_rotary_tables_carry_the_yarn_attention_factor():
    scaling = RopeScaling.from_hf(dict(SCALINGS["yarn"]), 128)
    inv, attention = rope_inv_freq(16, 10000.0, scaling)
    assert attention == pytest.approx(0.1 * np.log(4.0) + 1.0)
    rope = RotaryEmbedding(16, 10000.0, scaling)
    cos, sin = rope.tables(40)
    angles = np.arange(40, dtype=np.float32)[:, None] * inv[None, :]
    np.testing.assert_allclose(cos[:40], np.cos(angles.astype(np.float64)) * attention,
                               rtol=0, atol=4e-7)
    np.testing.assert_allclose(sin[:40], np.sin(angles.astype(np.float64)) * attention,
                               rtol=0, atol=4e-7)


@pytest.mark.parametrize("params, match", [
    ({"rope_type": "mrope", "factor": 2.0}, "rope_type 'mrope' is not supported"),
    ({"rope_type": "longrope", "short_factor": [1.0]}, r"needs \['long_factor'\]"),
    ({"rope_type": "llama3", "factor": 8.0}, "needs"),
    ({"rope_type": "linear", "factor": 2.0, "beta": 1}, r"keys \['beta'\]"),
    ({"rope_type": "linear", "factor": 0.5}, "factor must be >= 1.0"),
    ({"rope_type": "default", "factor": 2.0}, "with rope_type 'default' are not understood"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
])
def test_rope_fields_ggmlopt_does_not_compute_are_refused(params, match):
    with pytest.raises(ValueError, match=match):
        RopeScaling.from_hf(params, 128)
    assert RopeScaling.from_hf({"rope_type": "default", "rope_theta": 1e4}, 128) is None


# ---- checkpoints: Llama 3 as save_pretrained writes it --------------------------------

def _hf_llama(transformers, torch, tmp_path, rope, tie=False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=40,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   rope_parameters={**rope, "rope_theta": 500000.0},
                                   tie_word_embeddings=tie)
    hf = transformers.LlamaForCausalLM(cfg)
    hf.eval()
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("kind", list(SCALINGS))
@pytest.mark.parametrize("T", [7, 33, 129])
def test_a_scaled_llama_checkpoint_gives_transformers_logits_and_gradients(tmp_path, kind, T):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf
    hf = _hf_llama(transformers, torch, tmp_path, SCALINGS[kind], tie=kind == "llama3")
    model = load_hf(tmp_path)
    assert model.config.rope_scaling.rope_type == SCALINGS[kind]["rope_type"]
    assert model.config.rope_base == 500000.0
    tokens = np.random.default_rng(T).integers(0, 67, (2, T))
    logits = hf(torch.tensor(tokens)).logits
    want = logits.detach().numpy()
    got = model.forward(tokens)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)
    g = np.random.default_rng(1).normal(size=want.shape).astype(np.float32)
    (logits * torch.tensor(g)).sum().backward()
    model.zero_grad()
    model.backward(g)
    grads = dict(model.named_parameters())
    for name, p in hf.named_parameters():
        ours = name.removeprefix("model.")
        if ours not in grads:
            continue   # a tied head
        theirs = p.grad.numpy()
        mine = grads[ours].grad
        mine = mine.T if mine.ndim == 2 and ours != "embed_tokens.weight" else mine
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-4 * np.abs(theirs).max(),
                                   err_msg=name)


def test_save_hf_writes_the_scaling_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from ggmlopt.io import load_hf, save_hf
    scaling = RopeScaling.from_hf(dict(LLAMA3), 64)
    model = Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=1, n_heads=4, max_seq_len=64,
                              rope_base=500000.0, rope_scaling=scaling), seed=0)
    save_hf(model, tmp_path)
    assert load_hf(tmp_path).config == model.config
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    params = hf.config.rope_parameters
    assert params["rope_type"] == "llama3" and params["factor"] == 8.0
    assert params["rope_theta"] == 500000.0


@pytest.mark.parametrize("edit, match", [
    ({"rope_parameters": {"rope_type": "proportional", "factor": 2.0, "rope_theta": 1e4}},
     "'proportional' is not supported"),
    ({"sliding_window": 4096},
     r"keys \['sliding_window'\] of a 'llama' config are not implemented"),
    ({"attention_bias": True}, "attention_bias"),
    ({"quantization_config": {"quant_method": "gptq"}}, r"keys \['quantization_config'\]"),
    ({"head_dim": 16}, "head_dim"),
    # transformers refuses these too (factor is required): none is guessed
    ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 32}},
     "a 'yarn' scaling needs its factor"),
    ({"rope_scaling": {"rope_type": "linear"}}, "a 'linear' scaling needs its factor"),
])
def test_config_fields_ggmlopt_does_not_implement_are_refused(tmp_path, edit, match):
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    save_hf(Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=1, n_heads=4), seed=0), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ValueError, match=match):
        load_hf(tmp_path)


def test_rope_theta_inside_rope_parameters_is_read(tmp_path):
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    save_hf(Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=1, n_heads=4), seed=0), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["rope_theta"], cfg["rope_scaling"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 250000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_hf(tmp_path).config.rope_base == 250000.0


@pytest.mark.parametrize("top_level, refused", [(None, True), (500.0, False)])
def test_both_rope_dicts_are_read_as_transformers_reads_them_or_refused(tmp_path, top_level,
                                                                         refused):
    # with rope_scaling given, transformers takes it whole and rope_theta from the top
    # level (10000 when absent), never rope_parameters' own rope_theta
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    save_hf(Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=1, n_heads=4), seed=0), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["rope_theta"]
    if top_level is not None:
        cfg["rope_theta"] = top_level
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if refused:
        with pytest.raises(ValueError, match=r"top-level rope_theta \(10000.0, the default\), "
                                             r"not rope_parameters' rope_theta 500.0"):
            load_hf(tmp_path)
    else:
        config = load_hf(tmp_path).config
        assert config.rope_base == 500.0 and config.rope_scaling.factor == 4.0


FAMILIES = {   # a family's model and the rope_theta it defaults to (its global layers' for Gemma 3)
    "llama": (lambda m: m.Llama(m.LlamaConfig(vocab_size=67, dim=32, n_layers=1, n_heads=4)),
              10000.0),
    "qwen2": (lambda m: m.Qwen2(m.Qwen2Config(vocab_size=67, dim=32, n_layers=1, n_heads=4)),
              10000.0),
    "gemma3": (lambda m: m.Gemma3(m.Gemma3Config(vocab_size=67, dim=32, n_layers=2, n_heads=4,
                                                  head_dim=8, sliding_window=4)), 1e6),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("top_level", [None, 10000.0, 500.0])
def test_a_rope_theta_inside_rope_scaling_is_refused_unless_it_is_the_base_anyway(
        tmp_path, family, top_level):
    # transformers 5 reads a rope_theta inside rope_scaling over the top-level one,
    # transformers 4 ignored it: a file where the two differ means two models
    pytest.importorskip("safetensors")
    from ggmlopt import models
    from ggmlopt.io import load_hf, save_hf
    build, default = FAMILIES[family]
    save_hf(build(models), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_theta", "rope_parameters", "rope_scaling"):
        cfg.pop(key, None)
    if top_level is not None:
        cfg["rope_theta"] = top_level
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if top_level == 500.0:
        assert load_hf(tmp_path).config.rope_base == 500.0
        return
    want = top_level if top_level is not None else default
    with pytest.raises(ValueError, match=rf"rope_scaling: its rope_theta 500.0 differs from the "
                                         rf"model's rope_theta {want}"):
        load_hf(tmp_path)


# ---- GGUF: llama.cpp's forms of the scalings --------------------------------------------

@pytest.mark.parametrize("kind", ["linear", "llama3"])
def test_gguf_keeps_the_scaling_in_llama_cpp_s_form(tmp_path, kind):
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    scaling = RopeScaling.from_hf(dict(SCALINGS[kind]), 64)
    model = Llama(LlamaConfig(vocab_size=257, dim=64, n_layers=1, n_heads=2, max_seq_len=64,
                              rope_base=500000.0, rope_scaling=scaling), seed=0)
    save_gguf(model, tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    back, _ = load_gguf(tmp_path / "m.gguf")
    got = back.config.rope_scaling
    if kind == "linear":
        assert got == scaling
    else:   # llama.cpp's rope_freqs: theta_i = base^(-2i/d) / factor_i
        assert got.rope_type == "freq_factors"
        inv, _ = rope_inv_freq(32, 500000.0, scaling)
        back_inv, _ = rope_inv_freq(32, 500000.0, got)
        np.testing.assert_allclose(back_inv, inv, rtol=4 * np.finfo(np.float32).eps)
    tokens = np.random.default_rng(0).integers(0, 257, (1, 60))
    want = model(tokens)
    np.testing.assert_allclose(back(tokens), want, rtol=0, atol=1e-5 * np.abs(want).max())
    plain = Llama(LlamaConfig(vocab_size=257, dim=64, n_layers=1, n_heads=2, max_seq_len=64,
                              rope_base=500000.0), seed=0)
    assert np.abs(plain(tokens) - want).max() > 1e-3 * np.abs(want).max()  # it matters


def test_yarn_is_not_written_to_gguf(tmp_path):
    pytest.importorskip("gguf")
    from ggmlopt.io import save_gguf
    from ggmlopt.text import ByteTokenizer
    scaling = RopeScaling.from_hf(dict(SCALINGS["yarn"]), 64)
    model = Llama(LlamaConfig(vocab_size=257, dim=32, n_layers=1, n_heads=2, max_seq_len=64,
                              rope_scaling=scaling), seed=0)
    with pytest.raises(ValueError, match="'yarn' rope scaling is not written to GGUF"):
        save_gguf(model, tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    assert not (tmp_path / "m.gguf").exists()


# ---- dynamic NTK: the base raised by the pass's length past max_position_embeddings ----

DYNAMIC = {"rope_type": "dynamic", "factor": 3.0}


def _hf_dynamic(transformers, torch, tmp_path, max_pos):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=40,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=max_pos,
                                   rope_parameters={**DYNAMIC, "rope_theta": 10000.0})
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("length", [16, 17, 40, 100])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_dynamic_frequencies_equal_transformers_at_each_length(length, head_dim):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = transformers.LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2,
                                   max_position_embeddings=16,
                                   rope_parameters={**DYNAMIC, "rope_theta": 10000.0})
    # the pass's length as dynamic_rope_update gives it: a tensor
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=torch.tensor(length))
    scaling = RopeScaling.from_hf(DYNAMIC, 16)
    got, attention = rope_inv_freq(head_dim, 10000.0, scaling, n_positions=length)
    assert attention == 1.0
    np.testing.assert_allclose(got, want.numpy(), rtol=ULPS, atol=0)
    if length <= 16:   # within the original length: the plain frequencies
        np.testing.assert_array_equal(got, default_inv_freq(head_dim, 10000.0))
    else:
        assert not np.allclose(got, default_inv_freq(head_dim, 10000.0), rtol=1e-3)


@pytest.mark.parametrize("T", [9, 20, 45])
def test_a_dynamic_llama_gives_transformers_logits_and_gradients(tmp_path, T):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    hf = _hf_dynamic(transformers, torch, tmp_path, max_pos=16)
    model = load_hf(tmp_path)
    assert model.config.rope_scaling.rope_type == "dynamic"
    tokens = np.random.default_rng(T).integers(0, 67, (2, T))
    logits = hf(torch.tensor(tokens)).logits
    want = logits.detach().numpy()
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())
    g = np.random.default_rng(1).normal(size=want.shape).astype(np.float32)
    (logits * torch.tensor(g)).sum().backward()
    model.zero_grad()
    model.backward(g)
    grads = dict(model.named_parameters())
    theirs = hf.model.layers[0].self_attn.q_proj.weight.grad.numpy()
    np.testing.assert_allclose(grads["layers.0.self_attn.q_proj.weight"].grad.T, theirs, rtol=0,
                               atol=1e-4 * np.abs(theirs).max())
    # and back: transformers reads the scaling ggmlopt writes
    save_hf(model, tmp_path / "again")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "again").eval()
    np.testing.assert_allclose(back(torch.tensor(tokens)).logits.detach().numpy(), want,
                               rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_dynamic_llama_generates_as_transformers_past_its_length(tmp_path):
    # greedy decoding past max_position_embeddings: each step's new token rotated by
    # the frequencies of its pass's length, the cached keys keeping theirs
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    import ggmlopt as go
    from ggmlopt.io import load_hf
    hf = _hf_dynamic(transformers, torch, tmp_path, max_pos=16)
    with torch.no_grad():   # sharpen the random model so greedy choices are clear
        for p in hf.parameters():
            p.mul_(3.0)
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    prompt = np.random.default_rng(4).integers(0, 67, 10)
    want = hf.generate(torch.tensor(prompt[None]), attention_mask=torch.ones(1, 10, dtype=torch.long),
                       max_new_tokens=20, do_sample=False, pad_token_id=0)[0, 10:].numpy()
    got = go.generate(model, prompt, 20, temperature=0)
    np.testing.assert_array_equal(got, want)


def test_dynamic_scaling_reads_transformers_length_only():
    s = RopeScaling.from_hf(DYNAMIC, 128)
    assert s.original_max_position_embeddings == 128 and s.factor == 3.0
    assert s.to_hf() == DYNAMIC
    with pytest.raises(ValueError, match="max_position_embeddings"):
        RopeScaling.from_hf({**DYNAMIC, "original_max_position_embeddings": 64}, 128)
    with pytest.raises(ValueError, match="factor must be >= 1.0"):
        RopeScaling.from_hf({"rope_type": "dynamic", "factor": 0.5}, 128)


def test_a_packed_dynamic_document_is_rotated_as_it_alone_is():
    # a packed window: each document by its own length's frequencies (one past the
    # original length, one within it), the logits each document alone gives
    from ggmlopt.nn.positions import mark_document_starts
    cfg = LlamaConfig(vocab_size=67, dim=32, n_layers=2, n_heads=4, max_seq_len=48,
                      rope_scaling=RopeScaling("dynamic", 3.0,
                                               original_max_position_embeddings=16))
    model = Llama(cfg, seed=0)
    rng = np.random.default_rng(7)
    long, short = rng.integers(0, 67, 29), rng.integers(0, 67, 11)
    starts = np.zeros((1, 40), bool)
    starts[0, [0, 29]] = True
    packed = model.forward(mark_document_starts(np.concatenate([long, short])[None], starts))
    for part, alone in ((packed[0, :29], model.forward(long[None])[0]),
                        (packed[0, 29:], model.forward(short[None])[0])):
        np.testing.assert_allclose(part, alone, rtol=0, atol=1e-5 * np.abs(alone).max())
    # the long document's own frequencies, not the plain ones
    plain = Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=2, n_heads=4, max_seq_len=48),
                  seed=0).forward(long[None])[0]
    # (a random model moves little with its rotation: 6e-4 of the scale, float32 ~1e-6)
    assert np.abs(plain - packed[0, :29]).max() > 1e-4 * np.abs(plain).max()


# ---- dynamic NTK in the other families that read a config's rope scaling ---------------

_FAMILIES = {   # transformers' config and model classes, each family's own fields
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 2}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 5,
                "layer_types": ["sliding_attention", "full_attention"]}),
}


def _hf_dynamic_family(transformers, torch, tmp_path, family, spelling):
    """A tiny dynamic-NTK model of family saved to tmp_path (max_position_embeddings
    16, factor 3), its weights times 3 so greedy choices are clear; spelling
    "rope_parameters" (transformers 5's; a Gemma 3's global layers') or
    "rope_scaling" (4.x's {"type": "dynamic"}; a Gemma 3's rope_type, as 4.x read
    it and 5 still does).  The model as transformers reads the file back."""
    config_class, model_class, extra = _FAMILIES[family]
    rope = {**DYNAMIC, "rope_theta": 10000.0}
    if family == "gemma3":
        rope = {"full_attention": rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(
        vocab_size=67, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        pad_token_id=0, rope_parameters=rope, **extra)
    hf = getattr(transformers, model_class)(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(3.0)
    hf.save_pretrained(tmp_path)
    if spelling == "rope_scaling":
        cfg = json.loads((tmp_path / "config.json").read_text())
        del cfg["rope_parameters"]
        cfg["rope_theta"] = 10000.0
        if family == "gemma3":
            cfg["rope_local_base_freq"] = 10000.0
            cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 3.0}
        else:
            cfg["rope_scaling"] = {"type": "dynamic", "factor": 3.0}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    return getattr(transformers, model_class).from_pretrained(tmp_path).eval()


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("family", list(_FAMILIES))
def test_a_dynamic_checkpoint_of_each_family_runs_as_transformers_past_its_length(
        tmp_path, family, spelling):
    # a Gemma 3 scales its global layers only; its max_seq_len was left at
    # max_position_embeddings, so no pass could go past it
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    import ggmlopt as go
    from ggmlopt.io import load_hf, save_hf
    hf = _hf_dynamic_family(transformers, torch, tmp_path, family, spelling)
    model = load_hf(tmp_path)
    assert model.config.rope_scaling.rope_type == "dynamic"
    assert model.config.max_seq_len == 48   # max_position_embeddings x factor
    prompt = np.random.default_rng(4).integers(0, 67, 10)
    want = hf.generate(torch.tensor(prompt[None]), attention_mask=torch.ones(1, 10, dtype=torch.long),
                       max_new_tokens=20, do_sample=False, pad_token_id=0)[0, 10:].numpy()
    np.testing.assert_array_equal(go.generate(model, prompt, 20, temperature=0), want)
    tokens = np.random.default_rng(40).integers(0, 67, (2, 40))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())
    save_hf(model, tmp_path / "again")
    back = type(hf).from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        again = back(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(again, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert load_hf(tmp_path / "again").config == model.config


def test_rope_dicts_naming_their_kind_by_either_key_agree(tmp_path):
    # rope_scaling's 4.x key 'type' and rope_parameters' rope_type name one kind
    # (transformers reads rope_scaling, its rope_type taken from 'type'): they were
    # refused as disagreeing
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    save_hf(Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=1, n_heads=4, max_seq_len=16),
                  seed=0), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_scaling"] = {"type": "dynamic", "factor": 3.0}
    cfg["rope_parameters"] = {**DYNAMIC, "rope_theta": cfg["rope_theta"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = load_hf(tmp_path).config
    assert config.rope_scaling == RopeScaling.from_hf(DYNAMIC, 16)
    assert config.max_seq_len == 48
    cfg["rope_scaling"]["factor"] = 2.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="disagree"):
        load_hf(tmp_path)


def test_a_gemma3_s_dynamic_scaling_under_the_old_key_is_refused(tmp_path):
    # transformers 5 ignores a Gemma 3's old key 'type' (4.x applied it)
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    from ggmlopt.models import Gemma3, Gemma3Config
    save_hf(Gemma3(Gemma3Config(vocab_size=67, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                head_dim=8, max_seq_len=16), seed=0), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_scaling"] = {"type": "dynamic", "factor": 3.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="names its kind by the old key 'type'"):
        load_hf(tmp_path)


@pytest.mark.parametrize("edit", [
    {"rope_parameters": {**DYNAMIC, "rope_theta": 10000.0}},
    {"rope_scaling": {"type": "dynamic", "factor": 3.0}, "rope_theta": 10000.0},
])
def test_a_dynamic_phi3_is_refused_as_transformers_refuses_it(tmp_path, edit):
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    from ggmlopt.models import Phi3, Phi3Config
    save_hf(Phi3(Phi3Config(vocab_size=67, dim=32, n_layers=1, n_heads=4, max_seq_len=16,
                            original_max_seq_len=16), seed=0), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ValueError, match="LongRoPE only .*'dynamic'"):
        load_hf(tmp_path)


@pytest.mark.parametrize("scaling", [
    RopeScaling("linear", 2.0), RopeScaling("dynamic", 2.0, original_max_position_embeddings=8),
    RopeScaling("yarn", 2.0, original_max_position_embeddings=8),
    RopeScaling("llama3", 2.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8)])
def test_save_hf_refuses_a_phi3_scaling_no_phi3_checkpoint_holds(tmp_path, scaling):
    """transformers' Phi3 (and load_hf) read LongRoPE only: a Phi3 built with
    another scaling is refused before a file is written, not written as a
    checkpoint that loads nowhere (a yarn one read back as LongRoPE without its
    factors)."""
    from ggmlopt.io import save_hf
    from ggmlopt.models import Phi3, Phi3Config
    model = Phi3(Phi3Config(vocab_size=67, dim=32, n_layers=1, n_heads=4, max_seq_len=16,
                            original_max_seq_len=8, rope_scaling=scaling), seed=0)
    with pytest.raises(ValueError, match=f"'{scaling.rope_type}' rope scaling .*LongRoPE only"):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
