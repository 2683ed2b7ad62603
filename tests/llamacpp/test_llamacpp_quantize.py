"""save_gguf's quantized files are llama-quantize's: ggmlopt's K-type
quantizer gives ggml's own bytes (ggml_quantize_chunk, called in llama.cpp's
library), and save_gguf(dtype=...) writes, tensor for tensor, the types and
bytes llama_model_quantize writes from the float32 file of the same model;
llama.cpp runs the file with ggmlopt's logits."""
import ctypes
import pathlib
import warnings

import numpy as np
import pytest
from test_llamacpp_qlora import _quantize  # llama_model_quantize on a file

from ggmlopt import kernels_quant as kq
from ggmlopt.io import load_gguf, save_gguf
from ggmlopt.io.gguf_reader import GgufFile
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.text import ByteTokenizer

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

TOK = ByteTokenizer()
GGML_TYPES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def _ggml_base():
    lib = pathlib.Path(llama_cpp.__file__).parent / "lib"
    found = sorted(lib.glob("libggml-base.*"))
    if not found:
        pytest.skip(f"llama_cpp ships no libggml-base in {lib}")
    ggml = ctypes.CDLL(str(found[0]))
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_void_p]
    return ggml


def _ggml_quantize(ggml, rows, qtype):
    out = np.zeros((rows.shape[0], kq.row_bytes(qtype, rows.shape[1])), np.uint8)
    ggml.ggml_quantize_chunk(GGML_TYPES[qtype], rows.ctypes.data, out.ctypes.data, 0,
                             rows.shape[0], rows.shape[1], None)
    return out


def _awkward_rows(rng):
    """Gaussian rows at several scales, heavy tails, all-positive and
    all-negative blocks, constant and zero sub-blocks, tiny and huge values."""
    rows = rng.standard_normal((24, 1024)).astype(np.float32)
    rows *= np.float32(10.0) ** rng.uniform(-6, 3, (24, 1)).astype(np.float32)
    rows[1] = rng.standard_cauchy(1024).astype(np.float32).clip(-1e4, 1e4)
    rows[2] = np.abs(rows[2])
    rows[3] = -np.abs(rows[3])
    rows[4, :300] = 0.25
    rows[5, 100:400] = 0
    rows[6] = rng.integers(-8, 8, 1024).astype(np.float32) * np.float32(0.125)
    rows[7] = 0
    rows[8, ::37] = 1e30
    return np.ascontiguousarray(rows)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_quantize_gives_ggmls_own_bytes(qtype):
    ggml = _ggml_base()
    rows = _awkward_rows(np.random.default_rng(11))
    ours, theirs = kq.quantize(rows, qtype), _ggml_quantize(ggml, rows, qtype)
    differ = np.nonzero((ours != theirs).any(axis=1))[0]
    assert differ.size == 0, f"{qtype}: rows {differ.tolist()} differ from ggml's"


def _model(dim=256, n_layers=8, tie=False):
    cfg = LlamaConfig(vocab_size=TOK.vocab_size, dim=dim, n_layers=n_layers, n_heads=4,
                      n_kv_heads=2, ffn_dim=256, max_seq_len=64, tie_embeddings=tie)
    model = Llama(cfg, seed=5)
    for _, p in model.named_parameters():
        if p.data.ndim == 2:
            p.data *= 4.0
    return model


CASES = [("q4_k_m", "LLAMA_FTYPE_MOSTLY_Q4_K_M", 256, False),
         ("q4_k_s", "LLAMA_FTYPE_MOSTLY_Q4_K_S", 256, True),
         ("q5_k_m", "LLAMA_FTYPE_MOSTLY_Q5_K_M", 256, False),
         ("q5_k_s", "LLAMA_FTYPE_MOSTLY_Q5_K_S", 256, False),
         ("q6_k", "LLAMA_FTYPE_MOSTLY_Q6_K", 256, True),
         ("q4_0", "LLAMA_FTYPE_MOSTLY_Q4_0", 256, False),
         ("q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0", 256, True),
         ("q4_k_m", "LLAMA_FTYPE_MOSTLY_Q4_K_M", 96, False),   # every K type falls back
         ("q5_1", "LLAMA_FTYPE_MOSTLY_Q5_1", 96, True)]


@pytest.mark.parametrize("dtype,ftype,dim,tie", CASES)
def test_save_gguf_writes_what_llama_quantize_writes(tmp_path, dtype, ftype, dim, tie):
    model = _model(dim=dim, tie=tie)
    f32, theirs, ours = tmp_path / "f32.gguf", tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    save_gguf(model, f32, tokenizer=TOK)
    _quantize(f32, theirs, ftype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the fall-backs' warning
        save_gguf(model, ours, tokenizer=TOK, dtype=dtype)
    a, b = GgufFile(str(ours)), GgufFile(str(theirs))
    assert set(a.tensors) == set(b.tensors)
    for name in b.tensors:
        assert a.tensors[name].type_name == b.tensors[name].type_name, name
        np.testing.assert_array_equal(a.raw(name), b.raw(name), err_msg=name)
    assert a.fields["general.file_type"] == b.fields["general.file_type"]


def test_llama_cpp_runs_a_q4_k_m_file_with_ggmlopts_logits(tmp_path):
    """The file's weights are what both read (kept in their types by ggmlopt):
    the logits differ by llama.cpp's 8-bit activations only, well below what
    the quantization itself moved them."""
    model = _model(n_layers=2)
    path = tmp_path / "q4km.gguf"
    save_gguf(model, path, tokenizer=TOK, dtype="q4_k_m")
    kept, _ = load_gguf(path, keep_types=True)
    ids = np.array(TOK.encode("save_gguf(dtype='q4_k_m') read by llama.cpp: é ✓ " * 2)[:64])
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_ubatch=64,
                          logits_all=True, type_k=0, type_v=0, n_threads=1, verbose=False)
    llm.eval([int(i) for i in ids])
    theirs = np.array(llm.scores[:len(ids)], np.float64)
    ours = kept(ids[None])[0].astype(np.float64)
    f32 = model(ids[None])[0].astype(np.float64)
    scale = np.abs(theirs).max()
    err = np.abs(ours - theirs).max() / scale
    assert err < 0.5 * np.abs(f32 - theirs).max() / scale, err


@pytest.mark.parametrize("dtype,ftype,dim", [("q4_k_m", "LLAMA_FTYPE_MOSTLY_Q4_K_M", 256),
                                             ("q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0", 64),
                                             ("q5_k_s", "LLAMA_FTYPE_MOSTLY_Q5_K_S", 64),
                                             ("bf16", "LLAMA_FTYPE_MOSTLY_BF16", 64)])
def test_a_gpt2_file_is_what_llama_quantize_writes(tmp_path, dtype, ftype, dim):
    """llama.cpp's gpt2: its token embedding is the head (Q6_K in the K mixes,
    Q8_0 where rows of 64 are no super-block), attn_qkv a value projection,
    position_embd float32; and llama.cpp runs the file."""
    from ggmlopt.models import GPT2, GPT2Config
    model = GPT2(GPT2Config(vocab_size=TOK.vocab_size, dim=dim, n_layers=4, n_heads=4,
                            max_seq_len=64), seed=5)
    for _, p in model.named_parameters():
        if p.data.ndim == 2:
            p.data *= 4.0
    f32, theirs, ours = tmp_path / "f32.gguf", tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    save_gguf(model, f32, tokenizer=TOK)
    _quantize(f32, theirs, ftype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the fall-backs' warning
        save_gguf(model, ours, tokenizer=TOK, dtype=dtype)
    a, b = GgufFile(str(ours)), GgufFile(str(theirs))
    assert set(a.tensors) == set(b.tensors)
    for name in b.tensors:
        assert a.tensors[name].type_name == b.tensors[name].type_name, name
        np.testing.assert_array_equal(a.raw(name), b.raw(name), err_msg=name)
    for key in ("general.file_type", "general.quantization_version"):
        assert a.fields[key] == b.fields[key], key
    ids = [int(i) for i in TOK.encode("a quantized GPT-2 read by llama.cpp: é ✓")]
    llm = llama_cpp.Llama(model_path=str(ours), n_ctx=64, n_batch=64, n_ubatch=64,
                          logits_all=True, type_k=0, type_v=0, n_threads=1, verbose=False)
    llm.eval(ids)
    assert np.isfinite(np.array(llm.scores[:len(ids)])).all()
