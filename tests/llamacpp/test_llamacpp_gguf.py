"""ggmlopt's Llama GGUF files against llama.cpp itself, through llama-cpp-python
(not a dependency: ``pip install llama-cpp-python`` builds llama.cpp; these tests
skip without it and are not part of the default run: ``pytest -q tests/llamacpp``).

- a model save_gguf writes: llama.cpp's logits at every position equal ggmlopt's
  within 1e-4 of their scale (float32) or 2e-2 (float16);
- its tokenizer: llama.cpp tokenizes any text to ByteTokenizer's ids;
- perplexity: ggmlopt.lm.perplexity equals the same protocol on llama.cpp's
  logits, within 1e-4 relative;
- the other way: files written by llama.cpp's own writer (llama_model_quantize
  of our float32 file to Q8_0, Q4_0 and Q4_K_M) load with load_gguf and give
  llama.cpp's logits on that file, within the error of llama.cpp quantizing the
  activations too (see eight_bit_error).
"""
import ctypes
import math
import os
import warnings

import numpy as np
import pytest

from ggmlopt.io import load_gguf, save_gguf
from ggmlopt.lm import perplexity
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.text import ByteTokenizer

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

N_CTX = 64
F32_KV = 0  # GGML_TYPE_F32: the KV cache in float32, so only the weights' type differs


def structured_llama(dim=64, ffn_dim=96, tie=True, seed=0, gain=8.0):
    """A small Llama whose logits have structure (weights N(0, 0.02 * gain), RMSNorm
    gains in [0.5, 1.5]), as after training, instead of the near-uniform logits
    of the 0.02 initialisation."""
    model = Llama(LlamaConfig(vocab_size=257, dim=dim, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=ffn_dim, max_seq_len=N_CTX, tie_embeddings=tie),
                  seed=seed)
    rng = np.random.default_rng(seed + 100)
    for _, p in model.named_parameters():
        if p.data.ndim == 2:
            p.data *= gain
        else:
            p.data[...] = rng.uniform(0.5, 1.5, p.data.shape)
    return model


def open_llama(path, n_ctx=N_CTX):
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                           logits_all=True, type_k=F32_KV, type_v=F32_KV, n_threads=2,
                           n_threads_batch=2, verbose=False)


def llama_cpp_logits(llm, ids):
    """llama.cpp's logits at every position of ids (one sequence from position 0)."""
    llm.reset()
    llm.eval([int(i) for i in ids])
    return np.array(llm.scores[:len(ids)], dtype=np.float64)


def spread(model, seed, gain=8.0):
    """model's matrices scaled by gain and its vectors (norms) drawn from
    U(0.5, 1.5): logits of some size, and norms that count."""
    rng = np.random.default_rng(seed)
    for _, p in model.named_parameters():
        if p.data.ndim == 2:
            p.data *= gain
        else:
            p.data[...] = rng.uniform(0.5, 1.5, p.shape)


def our_logits(model, ids):
    return model.forward(np.asarray(ids, np.int32)[None])[0].astype(np.float64)


def relative_error(got, want):
    """max |got - want| over the logits' scale (their largest magnitude)."""
    return float(np.abs(got - want).max() / np.abs(want).max())


TEXT = ("The quick brown fox jumps over the lazy dog. Café, naïve, Ångström; "
        "emoji 😀👍🏽, 中文字符 日本語 한국어!\n\tTabs,   runs of spaces,\r\nand 12345 digits. ")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("llamacpp")
    model = structured_llama()
    paths = {}
    for name, dtype in (("f32", np.float32), ("f16", np.float16)):
        paths[name] = d / f"model-{name}.gguf"
        save_gguf(model, paths[name], tokenizer=ByteTokenizer(), dtype=dtype)
    untied = structured_llama(tie=False, seed=3)
    paths["untied"] = d / "untied.gguf"
    save_gguf(untied, paths["untied"], tokenizer=ByteTokenizer())
    return model, untied, paths


def test_logits_float32_every_position(files):
    model, untied, paths = files
    ids = ByteTokenizer().encode(TEXT)[:N_CTX]
    for m, path in ((model, paths["f32"]), (untied, paths["untied"])):
        llm = open_llama(path)
        want = our_logits(m, ids)
        got = llama_cpp_logits(llm, ids)
        assert got.shape == want.shape == (N_CTX, 257)
        assert np.abs(want).max() > 1.0   # logits with structure, not ~0
        assert relative_error(got, want) < 1e-4


def test_logits_float16_every_position(files):
    _, _, paths = files
    ids = ByteTokenizer().encode(TEXT)[:N_CTX]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back, _ = load_gguf(paths["f16"])   # the weights as llama.cpp has them
    got = llama_cpp_logits(open_llama(paths["f16"]), ids)
    assert relative_error(got, our_logits(back, ids)) < 2e-2


def replace_invalid_bytes(data: bytes) -> str:
    """data decoded as llama.cpp does: each byte that starts no valid UTF-8
    sequence becomes U+FFFD (Python's "replace" joins a cut sequence into one)."""
    out, i = [], 0
    while i < len(data):
        for n in (1, 2, 3, 4):
            try:
                out.append(data[i:i + n].decode("utf-8"))
                i += n
                break
            except UnicodeDecodeError:
                continue
        else:
            out.append("\ufffd")
            i += 1
    return "".join(out)


TEXTS = ["Hello, world!", "a1 b2 c3a 1a1 x1y2", "café naïve Ångström façade",
         "emoji 😀👍🏽🇫🇷 ok", "中文字符 日本語 한국어", "line\nbreaks\r\n\ttabs",
         "   runs  of   spaces   ", "it's we'll I'd <|endoftext|> 123456 x=1+2",
         " ", "\n\n\n", "ａ１ ٣a ﬁ", "tab\t\t\tend", "mixed   \n   \t  "]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenization_equals_byte_tokenizer(files, text):
    _, _, paths = files
    llm = open_llama(paths["f32"])
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)
    assert ids == ByteTokenizer().encode(text).tolist()
    assert llm.detokenize(ids) == text.encode()


@pytest.mark.parametrize("data", [b"ab\xffcd\x80ef", b"\xfe\xfe", b"cut \xe2\x82 here",
                                  b"\xc3(", b"ok \xf0\x9f\x98 end"])
def test_tokenization_of_invalid_utf8(files, data):
    _, _, paths = files
    llm = open_llama(paths["f32"])
    ids = llm.tokenize(data, add_bos=False, special=False)
    assert ids == ByteTokenizer().encode(replace_invalid_bytes(data)).tolist()


def test_no_bos_is_added(files):
    _, _, paths = files
    llm = open_llama(paths["f32"])
    assert llm.tokenize(b"abc", add_bos=True, special=False) == [97, 98, 99]
    assert llm.token_eos() == 256


def llama_cpp_perplexity(llm, ids, n_ctx):
    """llama-perplexity's protocol on llama.cpp's logits: chunks of n_ctx tokens,
    positions n_ctx/2 .. n_ctx-2 scored, log-softmax in float64."""
    n_chunk = len(ids) // n_ctx
    first = n_ctx // 2
    nll, count = 0.0, 0
    for c in range(n_chunk):
        chunk = ids[c * n_ctx:(c + 1) * n_ctx]
        logits = llama_cpp_logits(llm, chunk)[first:n_ctx - 1]
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll -= logp[np.arange(logits.shape[0]), chunk[first + 1:]].sum()
        count += logits.shape[0]
    return math.exp(nll / count), count


def test_perplexity_equals_llama_cpp(files):
    model, _, paths = files
    ids = ByteTokenizer().encode(TEXT * 3)
    ours = perplexity(model, ids, N_CTX)
    theirs, count = llama_cpp_perplexity(open_llama(paths["f32"]), ids, N_CTX)
    assert ours.scored == count > 0
    assert ours.ppl == pytest.approx(theirs, rel=1e-4)


# ---- files written by llama.cpp's own code ----

# llama.cpp multiplies a quantized weight by activations it rounds to 8 bits per
# block (Q8_0: 32 values, Q8_K: 256) with one scale, where load_gguf's model
# multiplies the same dequantized weights by float32 activations.  That rounding is
# the same kind and size as rounding the weights to Q8_0, so its effect on the
# logits is measured on this very model: eight_bit_error = how far ggmlopt's logits
# move when its float32 weights are rounded through Q8_0 (gguf-py).  Measured: the
# difference from llama.cpp is 0.7-1.0 times that (Q8_0, Q4_0, Q4_K_M; gain 4);
# the tests allow 2 times, which a wrong permutation or dequantization (off by
# the logits' whole scale) never meets.
QUANT_GAIN = 4.0


def eight_bit_error(model, ids):
    import copy

    import gguf
    q8 = gguf.GGMLQuantizationType.Q8_0
    rounded = copy.deepcopy(model)
    for name, p in rounded.named_parameters():
        if p.data.ndim == 2:   # round along ggml's rows, as a Q8_0 file stores them
            rows = p.data if name == "embed_tokens.weight" else p.data.T
            r = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(rows), q8), q8)
            p.data[...] = r if name == "embed_tokens.weight" else r.T
    return relative_error(our_logits(rounded, ids), our_logits(model, ids))


def quantize(src, dst, ftype):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                        ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize failed ({rc})"


@pytest.mark.parametrize("ftype,dim,ffn,expect", [
    ("LLAMA_FTYPE_MOSTLY_Q8_0", 64, 96, "Q8_0"),
    ("LLAMA_FTYPE_MOSTLY_Q4_0", 64, 96, "Q4_0"),
    ("LLAMA_FTYPE_MOSTLY_Q4_K_M", 256, 256, "Q4_K")])
def test_files_quantized_by_llama_cpp_load(tmp_path, ftype, dim, ffn, expect):
    model = structured_llama(dim=dim, ffn_dim=ffn, tie=False, seed=7, gain=QUANT_GAIN)
    f32 = tmp_path / "f32.gguf"
    save_gguf(model, f32, tokenizer=ByteTokenizer())
    out = tmp_path / f"{expect}.gguf"
    quantize(f32, out, getattr(llama_cpp, ftype))
    with pytest.warns(UserWarning, match=expect):
        back, tokenizer = load_gguf(out)
    assert isinstance(tokenizer, ByteTokenizer)
    assert back.config == model.config
    ids = ByteTokenizer().encode(TEXT)[:N_CTX]
    want = llama_cpp_logits(open_llama(out), ids)
    err = relative_error(our_logits(back, ids), want)
    assert err < 2 * eight_bit_error(model, ids)
    # the quantized weights are what is read: the float32 model is further away
    assert relative_error(our_logits(model, ids), want) > err


def test_bpe_tokenizer_equals_llama_cpp(tmp_path):
    pytest.importorskip("tokenizers")
    from ggmlopt.io.gguf_llama import byte_vocabulary
    from ggmlopt.text import BPETokenizer
    vocab = byte_vocabulary()
    # three real merges in the slots of control bytes the texts never hold
    vocab[1], vocab[2], vocab[3] = "Ġt", "he", "Ġthe"
    bpe = BPETokenizer(vocab, ["Ġ t", "h e", "Ġt he"], eos_id=256, pre="gpt-2")
    path = tmp_path / "bpe.gguf"
    save_gguf(structured_llama(), path, tokenizer=bpe)
    _, back = load_gguf(path)
    assert isinstance(back, BPETokenizer)
    llm = open_llama(path)
    for text in ["the cat and the hat", "then the theme", "other the", TEXT]:
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        assert ids == back.encode(text).tolist() == bpe.encode(text).tolist()
    assert llm.tokenize(b" the", add_bos=False, special=False) == [3]


def _vocabulary_written_and_read(tmp_path, name):
    """llama.cpp's vocabulary ggml-vocab-<name>.gguf as load_gguf_tokenizer reads it,
    written by save_gguf with a small model of its size and read back by load_gguf:
    (the tokenizer, the one read back, the file's path)."""
    src = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
    if not src:
        pytest.skip("GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source) is not set")
    from ggmlopt.io import load_gguf_tokenizer
    tok = load_gguf_tokenizer(os.path.join(src, "models", f"ggml-vocab-{name}.gguf"))
    model = Llama(LlamaConfig(vocab_size=tok.vocab_size, dim=16, n_layers=1, n_heads=2,
                              ffn_dim=16, max_seq_len=64), seed=0)
    path = tmp_path / f"{name}.gguf"
    save_gguf(model, path, tokenizer=tok)
    _, back = load_gguf(path)
    return tok, back, path


def test_sentencepiece_tokenizer_is_written_as_llama_cpp_reads_it(tmp_path):
    """An SPMTokenizer (llama.cpp's Llama 2 vocabulary) written by save_gguf: read
    back equal, and llama.cpp's own tokenization of the file equals it."""
    from ggmlopt.spm import SPMTokenizer
    spm, back, path = _vocabulary_written_and_read(tmp_path, "llama-spm")
    assert isinstance(back, SPMTokenizer)
    assert (back.tokens, back.scores, back.token_types) == (spm.tokens, spm.scores,
                                                            spm.token_types)
    assert (back.bos_id, back.eos_id, back.unk_id, back.add_bos, back.add_space_prefix) == \
        (spm.bos_id, spm.eos_id, spm.unk_id, spm.add_bos, spm.add_space_prefix)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in ["Hello world, ça va? 123", " leading space", TEXT]:
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        assert ids == back.encode(text).tolist() == spm.encode(text).tolist()


def test_gemma4_vocabulary_is_written_as_llama_cpp_reads_it(tmp_path):
    """A MetaspaceBPETokenizer (llama.cpp's Gemma 4 vocabulary) written by save_gguf:
    read back equal, and llama.cpp's tokenization of the file equals it, special
    tokens parsed and not, spaces before '</' (a token joins them) included."""
    from ggmlopt.metaspace_bpe import MetaspaceBPETokenizer
    g4, back, path = _vocabulary_written_and_read(tmp_path, "gemma-4")
    assert isinstance(back, MetaspaceBPETokenizer)
    assert (back.tokens, back.merges, back.token_types) == (g4.tokens, g4.merges,
                                                            g4.token_types)
    assert (back.bos_id, back.eos_id, back.add_bos) == (g4.bos_id, g4.eos_id, True)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    texts = ["Hello world, ça va? 123", " leading  spaces\n\n\nthree lines", TEXT,
             "<b>x</b> <i> </i>\u2581</", "<|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n"]
    for text in texts:
        for special in (False, True):
            ids = llm.tokenize(text.encode(), add_bos=False, special=special)
            assert ids == back.encode(text, parse_special=special).tolist(), (text, special)
    assert llm.tokenize(b"hi", add_bos=True, special=False)[0] == g4.bos_id


# ---- the other architectures of the family ----------------------------------------------

@pytest.mark.parametrize("head_dim,tied", [(16, True), (24, False)])
def test_a_qwen3_file_gives_llama_cpp_our_logits(tmp_path, head_dim, tied):
    # llama.cpp's qwen3: per-head q/k norms, a head width from key_length (24: a query
    # width of 96 over a hidden size of 64)
    from ggmlopt.models import Qwen3, Qwen3Config
    model = Qwen3(Qwen3Config(vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              head_dim=head_dim, ffn_dim=96, max_seq_len=N_CTX,
                              tie_embeddings=tied), seed=0)
    spread(model, 4)
    save_gguf(model, tmp_path / "qwen3.gguf", tokenizer=ByteTokenizer())
    ids = ByteTokenizer().encode(TEXT)[:N_CTX]
    want = llama_cpp_logits(open_llama(tmp_path / "qwen3.gguf"), ids)
    assert relative_error(our_logits(model, ids), want) < 1e-4
    # the norms count: without them llama.cpp's logits would be far from these
    for layer in model.layers:
        layer.self_attn.q_norm.weight.data[...] = 1.0
    assert relative_error(our_logits(model, ids), want) > 1e-2


def test_a_mistral_with_its_own_head_width_gives_llama_cpp_our_logits(tmp_path):
    # Mistral Nemo's heads (128 of 5120 / 32): llama.cpp's llama architecture reads
    # the width from key_length; the file loads back as a Mistral
    from ggmlopt.io import load_gguf
    from ggmlopt.models import Mistral, MistralConfig
    model = Mistral(MistralConfig(vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                  head_dim=24, ffn_dim=96, max_seq_len=N_CTX), seed=0)
    spread(model, 6)
    save_gguf(model, tmp_path / "nemo.gguf", tokenizer=ByteTokenizer())
    ids = ByteTokenizer().encode(TEXT)[:N_CTX]
    want = llama_cpp_logits(open_llama(tmp_path / "nemo.gguf"), ids)
    assert relative_error(our_logits(model, ids), want) < 1e-4
    back, _ = load_gguf(tmp_path / "nemo.gguf")
    assert type(back) is Mistral and back.config.head_dim == 24
    assert relative_error(our_logits(back, ids), want) < 1e-4


def test_a_smollm3_file_gives_llama_cpp_our_logits(tmp_path):
    # llama.cpp's smollm3: layer 3 (every fourth) attends without RoPE
    from ggmlopt.models import SmolLM3, SmolLM3Config
    model = SmolLM3(SmolLM3Config(vocab_size=257, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                                  ffn_dim=96, max_seq_len=N_CTX), seed=0)
    spread(model, 5)
    save_gguf(model, tmp_path / "smollm3.gguf", tokenizer=ByteTokenizer())
    ids = ByteTokenizer().encode(TEXT)[:N_CTX]
    want = llama_cpp_logits(open_llama(tmp_path / "smollm3.gguf"), ids)
    assert relative_error(our_logits(model, ids), want) < 1e-4


def test_a_phi3_file_gives_llama_cpp_our_logits(tmp_path):
    # llama.cpp's phi3: fused attn_qkv and ffn_up (gate | up), NeoX rotation
    from ggmlopt.models import Phi3, Phi3Config
    model = Phi3(Phi3Config(vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            ffn_dim=96, max_seq_len=N_CTX), seed=0)
    spread(model, 6)
    save_gguf(model, tmp_path / "phi3.gguf", tokenizer=ByteTokenizer())
    ids = ByteTokenizer().encode(TEXT)[:N_CTX]
    want = llama_cpp_logits(open_llama(tmp_path / "phi3.gguf"), ids)
    assert relative_error(our_logits(model, ids), want) < 1e-4


def test_a_gpt2_file_gives_llama_cpp_our_logits(tmp_path):
    # llama.cpp's gpt2; its GELU reads a float16 table (2^-11 relative), so the
    # logits agree to that, not to float32 rounding
    from ggmlopt.models import GPT2, GPT2Config
    model = GPT2(GPT2Config(vocab_size=257, dim=64, n_layers=2, n_heads=4,
                            max_seq_len=N_CTX), seed=0)
    rng = np.random.default_rng(7)
    for _, p in model.named_parameters():
        if p.data.ndim == 1:
            p.data[...] = rng.uniform(0.5, 1.5, p.shape)
    save_gguf(model, tmp_path / "gpt2.gguf", tokenizer=ByteTokenizer())
    ids = ByteTokenizer().encode(TEXT)[:N_CTX]
    want = llama_cpp_logits(open_llama(tmp_path / "gpt2.gguf"), ids)
    assert relative_error(our_logits(model, ids), want) < 2e-3


@pytest.mark.parametrize("scaled", [False, True])
def test_a_gemma3_file_gives_llama_cpp_our_logits(tmp_path, scaled):
    # llama.cpp's gemma3: norms stored as 1 + weight, local layers (a window of 5, their
    # own RoPE base) and global ones (linear scaling when scaled); ggml's GELU reads a
    # float16 table, so the logits agree to 2^-11 relative, not float32 rounding
    from ggmlopt.models import Gemma3, Gemma3Config
    from ggmlopt.nn import RopeScaling
    cfg = Gemma3Config(vocab_size=257, dim=64, n_layers=7, n_heads=4, n_kv_heads=2, head_dim=16,
                       ffn_dim=96, max_seq_len=N_CTX, query_pre_attn_scalar=16.0,
                       sliding_window=5,
                       rope_scaling=RopeScaling("linear", 8.0) if scaled else None)
    model = Gemma3(cfg, seed=0)
    rng = np.random.default_rng(8)
    for _, p in model.named_parameters():
        if p.data.ndim == 2:
            p.data *= 4.0
        else:
            p.data[...] = rng.uniform(-0.5, 0.5, p.shape)
    save_gguf(model, tmp_path / "gemma3.gguf", tokenizer=ByteTokenizer())
    back, _ = load_gguf(tmp_path / "gemma3.gguf")
    assert back.config == cfg
    ids = ByteTokenizer().encode(TEXT)[:N_CTX]
    want = llama_cpp_logits(open_llama(tmp_path / "gemma3.gguf"), ids)
    assert relative_error(our_logits(model, ids), want) < 2e-3
    # the local layers count: with every layer global the logits are far from llama.cpp's
    for layer in model.layers:
        layer.self_attn.sliding_window = None
    assert relative_error(our_logits(model, ids), want) > 1e-2


def test_a_qwen2_file_gives_llama_cpp_our_logits(tmp_path):
    from ggmlopt.models import Qwen2, Qwen2Config
    model = Qwen2(Qwen2Config(vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=96, max_seq_len=N_CTX, tie_embeddings=True), seed=0)
    rng = np.random.default_rng(3)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.data[...] = rng.normal(0, 0.5, p.shape)
        elif p.data.ndim == 2:
            p.data *= 8.0
        else:
            p.data[...] = rng.uniform(0.5, 1.5, p.shape)
    save_gguf(model, tmp_path / "qwen2.gguf", tokenizer=ByteTokenizer())
    ids = ByteTokenizer().encode(TEXT)[:N_CTX]
    want = llama_cpp_logits(open_llama(tmp_path / "qwen2.gguf"), ids)
    assert relative_error(our_logits(model, ids), want) < 1e-4


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_a_phi3_longrope_file_gives_llama_cpp_our_logits(tmp_path, partial):
    """A Phi-3.5's LongRoPE in llama.cpp's form (rope_factors_long/short tensors,
    phi3.rope.scaling.attn_factor): within its original length llama.cpp at a
    context that short and ggmlopt both take the short factors, and a pass over it
    at a longer context both the long ones.  (llama.cpp pads a context to 256.)
    partial: Phi-4-mini's share of each head that rotates (rope.dimension_count)."""
    from ggmlopt.models import Phi3, Phi3Config
    from ggmlopt.nn import RopeScaling
    rng = np.random.default_rng(3)
    original = 256
    half = int(16 * partial) // 2
    scaling = RopeScaling("longrope", 2.0, original_max_position_embeddings=original,
                          short_factor=tuple(1 + rng.random(half)),
                          long_factor=tuple(2 + 3 * rng.random(half)))
    model = Phi3(Phi3Config(vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            ffn_dim=96, max_seq_len=2 * original, original_max_seq_len=original,
                            rope_scaling=scaling, partial_rotary_factor=partial), seed=0)
    spread(model, 6)
    with pytest.warns(UserWarning, match="llama.cpp takes LongRoPE's long factors"):
        save_gguf(model, tmp_path / "phi35.gguf", tokenizer=ByteTokenizer())
    back, _ = load_gguf(tmp_path / "phi35.gguf")
    assert back.config.rope_scaling.short_factor == tuple(
        float(np.float32(f)) for f in scaling.short_factor)
    ids = np.resize(ByteTokenizer().encode(TEXT), 2 * original)
    for n_ctx, n in ((original, 200), (2 * original, original + 60)):
        want = llama_cpp_logits(open_llama(tmp_path / "phi35.gguf", n_ctx=n_ctx), ids[:n])
        assert relative_error(our_logits(model, ids[:n]), want) < 1e-4, n_ctx
