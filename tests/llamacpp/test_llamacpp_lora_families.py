"""LoRA adapters of the families test_llamacpp_lora leaves out (Mistral, Gemma,
Gemma 2, Gemma 3, Phi-3, GPT-2), written by ggmlopt.io.save_gguf_lora and applied by
llama.cpp itself (through llama-cpp-python, an optional package: these tests skip
without it).

Each adapted model is checked twice: llama.cpp (base + adapter) against ggmlopt's
logits, and against llama.cpp's own logits of the merged model (lora.merge, then
save_gguf), which isolates how llama.cpp applies the adapter from how it runs the
base (ggml's GELU reads a float16 table: the Gemmas and GPT-2 agree with ggmlopt to
about 2^-11 of the logits' scale, as test_llamacpp_gguf finds for their bases, and
their merged models with llama.cpp's adapted ones to that bound too: the table's
float16 input can round the other way).
llama.cpp runs with an f32 KV cache (type_k=0, type_v=0)."""
import warnings

import numpy as np
import pytest
from llamacpp_run import eight_bit_error, logits_of, open_llama, relative

from ggmlopt import lora
from ggmlopt.io import load_gguf, save_gguf, save_gguf_lora
from ggmlopt.models import (
    GPT2,
    Gemma,
    Gemma2,
    Gemma2Config,
    Gemma3,
    Gemma3Config,
    GemmaConfig,
    GPT2Config,
    Mistral,
    MistralConfig,
    Phi3,
    Phi3Config,
)
from ggmlopt.nn import RopeScaling
from ggmlopt.text import ByteTokenizer

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

TOK = ByteTokenizer()
V = TOK.vocab_size
TEXT = "LoRA adapters of six more families, applied by llama.cpp: é ✓ and some words"
GELU_TOL = 2e-3   # ggml's float16 GELU table (test_llamacpp_gguf's bound for these bases)


def _mistral(**kw):
    return Mistral(MistralConfig(vocab_size=V, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                 ffn_dim=96, max_seq_len=64, **kw), seed=3)


def _gemma3(**kw):
    # query_pre_attn_scalar = head_dim: how llama.cpp's gemma3 scales the scores
    return Gemma3(Gemma3Config(vocab_size=V, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               head_dim=16, query_pre_attn_scalar=16.0, ffn_dim=96,
                               max_seq_len=64, **kw), seed=3)


def _gemma(**kw):
    # heads wider than dim / n_heads, as gemma-2b's
    return Gemma(GemmaConfig(vocab_size=V, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=24, ffn_dim=96, max_seq_len=64, **kw), seed=3)


def _gemma2(**kw):
    # llama.cpp's gemma2 scales the scores by head_dim; caps small enough to bite, a
    # local layer then a global one
    fields = {"head_dim": 16, "query_pre_attn_scalar": 16.0, "sliding_window": 8,
              "attn_logit_softcap": 2.0, "final_logit_softcap": 3.0, **kw}
    return Gemma2(Gemma2Config(vocab_size=V, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               ffn_dim=96, max_seq_len=64, **fields), seed=3)


def _phi3(**kw):
    return Phi3(Phi3Config(vocab_size=V, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                           ffn_dim=96, max_seq_len=64, **kw), seed=3)


def _gpt2():
    return GPT2(GPT2Config(vocab_size=V, dim=64, n_layers=2, n_heads=4, max_seq_len=64), seed=3)


def _vectors(model, rng, spread=0.3):
    """Norms and biases drawn (zeros and ones would test nothing of them)."""
    for _, p in model.named_parameters():
        if p.data.ndim == 1:
            p.data[...] += rng.normal(0, spread, p.shape)


def _random_adapters(model, targets, rng):
    lora.apply(model, rank=4, alpha=8.0, targets=targets, seed=1)
    for _, layer in lora.named_adapters(model):   # zeros would test nothing
        layer.lora_a.data[...] = rng.normal(0, 0.05, layer.lora_a.shape)
        layer.lora_b.data[...] = rng.normal(0, 0.05, layer.lora_b.shape)


def _adapted_throughopen_llama(tmp_path, model, targets, rng, tol=1e-4):
    """model saved as the base, adapted on targets with random A and B, the adapter
    written: llama.cpp (base + adapter) gives model's logits within tol of their
    scale and the merged model's (through llama.cpp too) within tol, and the
    adapter moves its logits."""
    base = tmp_path / "base.gguf"
    save_gguf(model, base, tokenizer=TOK)
    _random_adapters(model, targets, rng)
    adapter = tmp_path / "adapter.gguf"
    save_gguf_lora(model, adapter)
    ids = TOK.encode(TEXT)[:64]
    ours = model(ids[None])[0].astype(np.float64)
    theirs = logits_of(open_llama(base, adapter), ids)
    without = logits_of(open_llama(base), ids)
    assert relative(theirs, ours) <= tol
    assert relative(without, ours) > 1e-2   # the adapter is applied
    lora.merge(model)
    merged = tmp_path / "merged.gguf"
    save_gguf(model, merged, tokenizer=TOK)
    # tol, not float32's rounding, for the GELU families: ggml rounds the GELU's input to
    # float16 for its table, and the merged weights' rounding can move an input across
    # a float16 step (a jump of 2^-11 of that value, as the table's own error)
    assert relative(theirs, logits_of(open_llama(merged), ids)) <= tol


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- Mistral: llama.cpp's llama architecture ------------------------------------------

@pytest.mark.parametrize("kw,targets", [
    ({}, "all-linear"),
    # an embedding adapter and the untied head; heads wider than dim / n_heads
    ({"head_dim": 24}, ALL + ("embed_tokens", "lm_head")),
    # a window as long as the context changes nothing: save_gguf writes it
    ({"sliding_window": 64}, "all-linear"),
])
def test_llama_cpp_applies_our_adapter_to_a_mistral(tmp_path, kw, targets):
    _adapted_throughopen_llama(tmp_path, _mistral(**kw), targets, np.random.default_rng(4))


def test_an_adapter_of_a_windowed_mistral_is_refused(tmp_path):
    """llama.cpp's llama architecture has no sliding window: save_gguf refuses such a
    Mistral, and save_gguf_lora wrote its adapter, which llama.cpp applied over the
    same weights without a window (as its converter writes a windowed Mistral) to
    other logits past the window: up to 1.14x their scale with a window of 8."""
    model = _mistral(sliding_window=8)
    with pytest.raises(ValueError, match="sliding window"):
        save_gguf(model, tmp_path / "refused.gguf", tokenizer=TOK)
    _random_adapters(model, "all-linear", np.random.default_rng(4))
    with pytest.raises(ValueError, match="sliding window"):
        save_gguf_lora(model, tmp_path / "adapter.gguf")
    assert not (tmp_path / "adapter.gguf").exists()


@pytest.mark.parametrize("make,match", [
    (lambda: _mistral(rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=16)),
     "yarn"),
    # Gemma3Config's default scalar (256) with heads of 16: llama.cpp scales by 16 ** -0.5
    (lambda: Gemma3(Gemma3Config(vocab_size=V, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                 head_dim=16, ffn_dim=96, max_seq_len=64)),
     "query_pre_attn_scalar"),
    # llama.cpp's gemma2 scales by head_dim ** -0.5 and always soft-caps
    (lambda: _gemma2(query_pre_attn_scalar=256.0), "query_pre_attn_scalar"),
    (lambda: _gemma2(final_logit_softcap=None), "always soft-caps"),
    # llama.cpp's gemma has no bias on the attention's output
    (lambda: _gemma(attention_bias=True), "no bias on its attention's output")])
def test_adapters_of_models_llama_cpp_computes_otherwise_are_refused(tmp_path, make, match):
    # what save_gguf refuses of the base, save_gguf_lora refuses of the adapter
    model = make()
    with pytest.raises(ValueError, match=match):
        save_gguf(model, tmp_path / "base.gguf", tokenizer=TOK)
    lora.apply(model, rank=4, alpha=8.0, targets="all-linear")
    with pytest.raises(ValueError, match=match):
        save_gguf_lora(model, tmp_path / "adapter.gguf")


# ---- Gemma 3: its 1 + w norms, local and global RoPE bases, sqrt(dim) embedding --------

def test_llama_cpp_applies_our_adapter_to_a_gemma3(tmp_path):
    # a local layer (window 8, RoPE base 10000) and a global one (base 1e6)
    model = _gemma3(sliding_window=8, sliding_layers=(True, False))
    rng = np.random.default_rng(5)
    _vectors(model, rng)
    _adapted_throughopen_llama(tmp_path, model, "all-linear", rng, tol=GELU_TOL)


@pytest.mark.parametrize("make", [_gemma, _gemma2, _gemma3])
def test_a_gemmas_tied_embedding_and_head_take_no_adapter(tmp_path, make):
    # llama.cpp's head is the token embedding's tensor: its adapter would adapt both
    model = make()
    lora.apply(model, rank=4, alpha=8.0, targets=("embed_tokens", "q_proj"), seed=1)
    with pytest.raises(ValueError, match="tied to the output head"):
        save_gguf_lora(model, tmp_path / "adapter.gguf")
    with pytest.raises(ValueError, match="names the output head"):
        lora.apply(make(), rank=4, alpha=8.0, targets=("lm_head", "q_proj"))


# ---- Gemma and Gemma 2: Gemma's norms and GeGLU; Gemma 2's soft caps and windows ------

@pytest.mark.parametrize("make", [_gemma, _gemma2])
def test_llama_cpp_applies_our_adapter_to_a_gemma_or_gemma2(tmp_path, make):
    model = make()
    rng = np.random.default_rng(5)
    _vectors(model, rng)
    _adapted_throughopen_llama(tmp_path, model, "all-linear", rng, tol=GELU_TOL)


# ---- Phi-3: fused qkv_proj and gate_up_proj --------------------------------------------

@pytest.mark.parametrize("targets", [
    "all-linear", ("qkv_proj", "gate_up_proj", "embed_tokens", "lm_head")])
def test_llama_cpp_applies_our_adapter_to_a_phi3(tmp_path, targets):
    _adapted_throughopen_llama(tmp_path, _phi3(), targets, np.random.default_rng(6))


def test_a_phi3_refuses_the_unfused_projections_by_name():
    # transformers' Phi-3 has no q_proj or gate_proj either: PEFT adapts nothing there
    model = _phi3()
    for targets in (("q_proj", "v_proj"), ("gate_proj", "up_proj")):
        with pytest.raises(ValueError, match="qkv_proj, o_proj, gate_up_proj"):
            lora.apply(model, rank=4, alpha=8.0, targets=targets)
    assert not lora.named_adapters(model)


def test_an_adapter_of_a_windowed_phi3_is_warned_about(tmp_path):
    # llama.cpp's phi3 ignores the window: warned about, as save_gguf warns
    model = _phi3(sliding_window=16)
    _random_adapters(model, "all-linear", np.random.default_rng(6))
    with pytest.warns(UserWarning, match="ignores the sliding window"):
        save_gguf_lora(model, tmp_path / "adapter.gguf")


# ---- GPT-2: c_attn, c_proj, c_fc with their biases -------------------------------------

def test_llama_cpp_applies_our_adapter_to_a_gpt2(tmp_path):
    model = _gpt2()
    rng = np.random.default_rng(7)
    _vectors(model, rng)
    _adapted_throughopen_llama(tmp_path, model, "all-linear", rng, tol=GELU_TOL)


@pytest.mark.parametrize("targets,match", [
    (("wte", "c_fc"), "tied to the output head"),
    (("wpe", "c_fc"), "other than the token embedding")])
def test_a_gpt2s_embedding_adapters_are_refused(tmp_path, targets, match):
    model = _gpt2()
    lora.apply(model, rank=4, alpha=8.0, targets=targets, seed=1)
    with pytest.raises(ValueError, match=match):
        save_gguf_lora(model, tmp_path / "adapter.gguf")


# ---- every family: modules trained whole are not in an adapter file --------------------

@pytest.mark.parametrize("make,trainable", [
    (_mistral, ("norm",)), (_gemma, ("input_layernorm",)),
    (_gemma2, ("pre_feedforward_layernorm",)), (_gemma3, ("post_feedforward_layernorm",)),
    (_phi3, ("lm_head",)), (_gpt2, ("ln_f",))])
def test_trained_modules_are_refused(tmp_path, make, trainable):
    model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # PEFT's suffix rule would train more
        lora.apply(model, rank=4, alpha=8.0, targets="all-linear", trainable=trainable)
    with pytest.raises(ValueError, match="other than the LoRA adapters are trainable"):
        save_gguf_lora(model, tmp_path / "adapter.gguf")
    assert not (tmp_path / "adapter.gguf").exists()


# ---- over a base kept in its file's Q8_0 -----------------------------------------------

@pytest.mark.parametrize("make,targets,tol", [
    (_phi3, ("embed_tokens", "qkv_proj", "gate_up_proj", "down_proj", "lm_head"), 1e-4),
    (_gemma, "all-linear", GELU_TOL), (_gemma2, "all-linear", GELU_TOL),
    (_gemma3, "all-linear", GELU_TOL)])
def test_llama_cpp_applies_our_adapter_over_a_kept_q8_0_base(tmp_path, make, targets, tol):
    """save_gguf's q8_0 file loaded with keep_types=True, adapted and the adapter
    written: llama.cpp applies it to that file within its 8-bit activations'
    error, and to a float32 file of the same (dequantized) weights exactly."""
    model = make()
    rng = np.random.default_rng(8)
    _vectors(model, rng)
    for _, p in model.named_parameters():
        if p.data.ndim == 2:
            p.data *= 4.0   # logits that depend on the weights more than on rounding
    path = tmp_path / "q8_0.gguf"
    save_gguf(model, path, tokenizer=TOK, dtype="q8_0")
    kept, _ = load_gguf(path, keep_types=True)
    assert type(kept.layers[0].mlp.down_proj).__name__ == "QuantizedLinear"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # it dequantizes
        widened, _ = load_gguf(path)
    wide = tmp_path / "widened.gguf"
    save_gguf(widened, wide, tokenizer=TOK)
    _random_adapters(kept, targets, rng)
    adapter = tmp_path / "adapter.gguf"
    save_gguf_lora(kept, adapter)
    ids = np.array(TOK.encode(TEXT)[:64])
    ours = kept(ids[None])[0].astype(np.float64)
    theirs = logits_of(open_llama(path, adapter), ids)
    err = relative(theirs, ours)
    assert err <= 2 * eight_bit_error(model, ids) + tol
    assert relative(theirs, logits_of(open_llama(path), ids)) > 5 * err
    assert relative(logits_of(open_llama(wide, adapter), ids), ours) <= tol
