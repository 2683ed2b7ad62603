"""QLoRA checked against llama.cpp itself (through llama-cpp-python, an optional
package: these tests skip without it): files llama-quantize wrote, loaded with
keep_types=True, give llama.cpp's logits; an adapter trained over such a base
and written by save_gguf_lora is applied by llama.cpp to that same file with
ggmlopt's logits; save_gguf's quantized files load in llama.cpp.

llama.cpp multiplies a quantized weight by activations it quantizes to 8 bits
(its vec_dot types Q8_0 / Q8_K), which ggmlopt does not: the logits differ by
what an 8-bit rounding moves them, measured here on the same model as the
error of rounding its weights to Q8_0 (as test_llamacpp_gguf does)."""
import ctypes
import warnings

import numpy as np
import pytest
from llamacpp_run import eight_bit_error, logits_of, open_llama, relative

from ggmlopt import lora
from ggmlopt.io import load_gguf, save_gguf, save_gguf_lora
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.nn import QuantizedLinear
from ggmlopt.text import ByteTokenizer

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

TOK = ByteTokenizer()
TEXT = "QLoRA: adapters over a quantized base, applied by llama.cpp: é ✓ " * 2


def _model(seed=7, gain=4.0, tie=False):
    """K types need rows of 256 values: dim and ffn 256.  Weights scaled up
    (gain) so that the logits depend on them more than on rounding."""
    cfg = LlamaConfig(vocab_size=TOK.vocab_size, dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_dim=256, max_seq_len=64, tie_embeddings=tie)
    model = Llama(cfg, seed=seed)
    for name, p in model.named_parameters():
        if p.data.ndim == 2:
            p.data *= gain
    return model


def _quantize(src, dst, ftype):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                          ctypes.byref(params)) == 0


FTYPES = ["LLAMA_FTYPE_MOSTLY_Q8_0", "LLAMA_FTYPE_MOSTLY_Q4_0", "LLAMA_FTYPE_MOSTLY_Q4_1",
          "LLAMA_FTYPE_MOSTLY_Q5_0", "LLAMA_FTYPE_MOSTLY_Q5_1", "LLAMA_FTYPE_MOSTLY_Q4_K_M",
          "LLAMA_FTYPE_MOSTLY_Q5_K_M", "LLAMA_FTYPE_MOSTLY_Q6_K", "LLAMA_FTYPE_MOSTLY_BF16",
          "LLAMA_FTYPE_MOSTLY_F16", "LLAMA_FTYPE_MOSTLY_Q2_K", "LLAMA_FTYPE_MOSTLY_Q3_K_M",
          "LLAMA_FTYPE_MOSTLY_IQ4_NL", "LLAMA_FTYPE_MOSTLY_IQ4_XS"]


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory):
    model = _model()
    path = tmp_path_factory.mktemp("qlora") / "f32.gguf"
    save_gguf(model, path, tokenizer=TOK)
    return model, path


@pytest.mark.parametrize("ftype", FTYPES)
def test_kept_types_give_llama_cppslogits_of(f32_file, tmp_path, ftype):
    model, f32 = f32_file
    path = tmp_path / "q.gguf"
    _quantize(f32, path, ftype)
    kept, _ = load_gguf(path, keep_types=True)
    types = {layer.qtype for layer in (kept.layers[0].self_attn.q_proj,
                                       kept.layers[1].mlp.down_proj, kept.lm_head)}
    assert all(isinstance(m, QuantizedLinear) for m in (kept.layers[0].mlp.up_proj,
                                                        kept.lm_head))
    assert types - {"F32"}, types   # something quantized is read as it is
    ids = np.array(TOK.encode(TEXT)[:64])
    ours = kept(ids[None])[0].astype(np.float64)
    theirs = logits_of(open_llama(path), ids)
    err = relative(ours, theirs)
    assert err <= 2 * eight_bit_error(model, ids), (ftype, types, err)
    # and the file's values are what is read: the float32 model is further away
    assert relative(model(ids[None])[0], theirs) > err


@pytest.mark.parametrize("ftype,qtype", [("LLAMA_FTYPE_MOSTLY_Q2_K", "Q2_K"),
                                         ("LLAMA_FTYPE_MOSTLY_Q3_K_M", "Q3_K"),
                                         ("LLAMA_FTYPE_MOSTLY_IQ4_NL", "IQ4_NL"),
                                         ("LLAMA_FTYPE_MOSTLY_IQ4_XS", "IQ4_XS")])
def test_the_low_bit_and_iq4_types_are_kept_not_widened(f32_file, tmp_path, ftype, qtype):
    """Q2_K, Q3_K, IQ4_NL and IQ4_XS matrices stay in their type (no float32 copy,
    no warning) and their values are gguf-py's dequantization of the file's bytes."""
    _, f32 = f32_file
    path = tmp_path / "q.gguf"
    _quantize(f32, path, ftype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept, _ = load_gguf(path, keep_types=True)
    layers = [m for _, m in kept.named_modules() if isinstance(m, QuantizedLinear)]
    assert qtype in {m.qtype for m in layers}
    gguf = pytest.importorskip("gguf")
    for m in layers:
        if m.qtype == qtype:
            raw = np.asarray(m.qweight)
            want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
            np.testing.assert_array_equal(m.dequantize().T, want)


@pytest.mark.parametrize("ftype", ["LLAMA_FTYPE_MOSTLY_Q4_K_M", "LLAMA_FTYPE_MOSTLY_Q8_0",
                                   "LLAMA_FTYPE_MOSTLY_Q3_K_M", "LLAMA_FTYPE_MOSTLY_IQ4_XS"])
def test_llama_cpp_applies_an_adapter_trained_over_the_quantized_file(f32_file, tmp_path,
                                                                       ftype):
    _, f32 = f32_file
    path = tmp_path / "q.gguf"
    _quantize(f32, path, ftype)
    kept, _ = load_gguf(path, keep_types=True)
    lora.apply(kept, rank=4, alpha=8.0, targets="all-linear", seed=1)
    rng = np.random.default_rng(3)
    for _, layer in lora.named_adapters(kept):   # B = 0 would test nothing
        layer.lora_b.data[...] = rng.normal(0, 0.05, layer.lora_b.shape)
    adapter = tmp_path / "adapter.gguf"
    save_gguf_lora(kept, adapter)
    ids = np.array(TOK.encode(TEXT)[:64])
    ours = kept(ids[None])[0].astype(np.float64)
    theirs = logits_of(open_llama(path, adapter), ids)
    without = logits_of(open_llama(path), ids)
    # llama.cpp (quantized file + adapter) is as close to ggmlopt's adapted model
    # as its 8-bit activations allow, and the adapter moves its logits far more
    err = relative(ours, theirs)
    assert err <= 2 * eight_bit_error(model_of(f32), ids)
    assert relative(theirs, without) > 5 * err
    # exactly so without the activations' rounding: the same adapter on a float32
    # file of the dequantized weights, which llama.cpp multiplies in float32
    widened = tmp_path / "widened.gguf"
    save_gguf(model_of(path), widened, tokenizer=TOK)
    exact = logits_of(open_llama(widened, adapter), ids)
    assert np.abs(exact - ours).max() <= 1e-4 * np.abs(ours).max()


def model_of(path):
    """The file's model widened to float32 (load_gguf warns that it dequantized)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model, _ = load_gguf(path)
    return model


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q5_1"])
def test_quantized_files_of_save_gguf_load_inopen_llama(tmp_path, dtype):
    model = _model(tie=True)
    path = tmp_path / f"{dtype}.gguf"
    save_gguf(model, path, tokenizer=TOK, dtype=dtype)
    kept, _ = load_gguf(path, keep_types=True)
    ids = np.array(TOK.encode(TEXT)[:64])
    theirs = logits_of(open_llama(path), ids)
    err = relative(kept(ids[None])[0], theirs)
    assert err <= 2 * eight_bit_error(model, ids)


def test_llama_cpp_applies_an_embedding_adapter_over_a_kept_embedding(f32_file, tmp_path):
    """embed_tokens adapted over a Q8_0 token embedding kept in its type (an
    untied head: llama.cpp would add a tied embedding's adapter to the head):
    llama.cpp applies the adapter to the quantized file within its 8-bit
    activations' error, exactly so over the float32 file of the same weights."""
    model, f32 = f32_file
    path = tmp_path / "q8.gguf"
    _quantize(f32, path, "LLAMA_FTYPE_MOSTLY_Q8_0")
    kept, _ = load_gguf(path, keep_types=True)
    lora.apply(kept, rank=4, alpha=8.0, targets=("embed_tokens", "q_proj", "down_proj"), seed=2)
    rng = np.random.default_rng(5)
    for _, layer in lora.named_adapters(kept):
        for p in (layer.lora_a, layer.lora_b):
            p.data[...] = rng.normal(0, 0.05, p.shape)
    adapter = tmp_path / "adapter.gguf"
    save_gguf_lora(kept, adapter)
    ids = np.array(TOK.encode(TEXT)[:64])
    ours = kept(ids[None])[0].astype(np.float64)
    theirs = logits_of(open_llama(path, adapter), ids)
    assert relative(ours, theirs) <= 2 * eight_bit_error(model, ids)
    assert relative(theirs, logits_of(open_llama(path), ids)) > 5 * relative(ours, theirs)
    widened = tmp_path / "widened.gguf"
    save_gguf(model_of(path), widened, tokenizer=TOK)
    exact = logits_of(open_llama(widened, adapter), ids)
    assert np.abs(exact - ours).max() <= 1e-4 * np.abs(ours).max()
