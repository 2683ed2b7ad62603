"""A Llama as llama.cpp's GGUF: the keys and tensors llama.cpp reads, the Q/K row
order, the tied output, ByteTokenizer's byte-level vocabulary; round trips
bit-exact in float32 and within float16's rounding; files as other writers make
them (quantized, bfloat16, another tokenizer); every refusal leaving the model
unchanged.  (The checks against llama.cpp itself are in tests/llamacpp.)"""
import os
import warnings

import numpy as np
import pytest

from ggmlopt.io import load_gguf, save_gguf
from ggmlopt.io.gguf_llama import BYTE_MERGES, byte_vocabulary
from ggmlopt.io.llama_names import gguf_name, permute_qk
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.nn import Linear, ReLU, Sequential
from ggmlopt.text import ByteTokenizer

gguf = pytest.importorskip("gguf")
GT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType


def small(tie=True, n_kv_heads=2, norm_eps=1e-5, rope_base=10000.0, vocab=257, seed=1):
    return Llama(LlamaConfig(vocab_size=vocab, dim=64, n_layers=2, n_heads=4,
                             n_kv_heads=n_kv_heads, ffn_dim=96, max_seq_len=64,
                             norm_eps=norm_eps, rope_base=rope_base, tie_embeddings=tie),
                 seed=seed)


def params(model):
    return {n: p.data.copy() for n, p in model.named_parameters()}


def assert_params_equal(model, expected):
    got = params(model)
    assert got.keys() == expected.keys()
    for name in got:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def read(path):
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (tuple(int(n) for n in t.shape), t.tensor_type, np.array(t.data))
               for t in reader.tensors}
    return fields, tensors


def rewrite(src, dst, *, drop_keys=(), set_keys=None, drop_tensors=(), tensors=None):
    """dst: src's GGUF with keys dropped or replaced and tensors dropped or replaced
    ({name: (array, raw_dtype or None)}), as another writer would make it."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    set_keys = dict(set_keys or {})
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        if key in set_keys:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == VT.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, (value, vtype, sub) in set_keys.items():
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        if tensors and t.name in tensors:
            array, raw = tensors[t.name]
            if raw is None:
                writer.add_tensor(t.name, array)
            else:
                writer.add_tensor(t.name, array, raw_shape=array.shape, raw_dtype=raw)
            continue
        writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- writing ----

@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_round_trip_float32_is_bit_exact(tmp_path, tie, n_kv_heads):
    model = small(tie=tie, n_kv_heads=n_kv_heads)
    path = tmp_path / "m.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer())
    back, tokenizer = load_gguf(path)
    assert isinstance(back, Llama) and back.config == model.config
    assert isinstance(tokenizer, ByteTokenizer)
    assert_params_equal(back, params(model))
    tokens = np.array([[1, 200, 7, 256, 33, 9, 17]])
    np.testing.assert_array_equal(back.forward(tokens), model.forward(tokens))


@pytest.mark.parametrize("norm_eps,rope_base", [(1e-5, 10000.0), (1e-6, 500000.0),
                                                (3e-7, 1234.5)])
def test_config_floats_come_back_exactly(tmp_path, norm_eps, rope_base):
    # GGUF stores them as float32: the reader takes the shortest decimal of that float32
    model = small(norm_eps=norm_eps, rope_base=rope_base)
    save_gguf(model, tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    back, _ = load_gguf(tmp_path / "m.gguf")
    assert back.config == model.config


def test_round_trip_float16_within_rounding(tmp_path):
    model = small(tie=False)
    path = tmp_path / "m.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer(), dtype=np.float16)
    fields, tensors = read(path)
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_F16
    for name, (_, kind, _) in tensors.items():
        assert kind == (GT.F32 if name.endswith("norm.weight") else GT.F16), name
    back, _ = load_gguf(path)
    for name, p in back.named_parameters():
        expected = params(model)[name]
        if expected.ndim == 2:
            expected = expected.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(p.data, expected, err_msg=name)


def test_float16_refuses_values_beyond_its_range(tmp_path):
    model = small()
    model.layers[0].mlp.up_proj.weight.data[3, 5] = 1e6
    path = tmp_path / "m.gguf"
    with pytest.raises(ValueError, match="float16"):
        save_gguf(model, path, tokenizer=ByteTokenizer(), dtype=np.float16)
    assert not os.path.exists(path)


def test_keys_llama_cpp_reads(tmp_path):
    model = Llama(LlamaConfig(vocab_size=257, dim=48, n_layers=3, n_heads=6, n_kv_heads=2,
                              ffn_dim=80, max_seq_len=96, norm_eps=1e-6, rope_base=5e5))
    save_gguf(model, tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    fields, _ = read(tmp_path / "m.gguf")
    expected = {
        "general.architecture": "llama", "general.file_type": 0, "llama.vocab_size": 257,
        "llama.context_length": 96, "llama.embedding_length": 48, "llama.block_count": 3,
        "llama.feed_forward_length": 80, "llama.attention.head_count": 6,
        "llama.attention.head_count_kv": 2, "llama.rope.dimension_count": 8,
        "llama.attention.key_length": 8, "llama.attention.value_length": 8,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.bos_token_id": 256, "tokenizer.ggml.eos_token_id": 256,
        "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False,
    }
    for key, value in expected.items():
        assert fields[key] == value, key
    assert isinstance(fields["general.name"], str) and fields["general.name"]
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6, rel=1e-7)
    assert fields["llama.rope.freq_base"] == 5e5
    assert fields["tokenizer.ggml.tokens"] == byte_vocabulary()
    assert fields["tokenizer.ggml.token_type"] == [1] * 256 + [3]
    assert fields["tokenizer.ggml.merges"] == list(BYTE_MERGES)


@pytest.mark.parametrize("tie", [True, False])
def test_tensor_names_layout_and_qk_order(tmp_path, tie):
    model = small(tie=tie, n_kv_heads=2)
    save_gguf(model, tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    _, tensors = read(tmp_path / "m.gguf")
    names = {gguf_name(n) for n, _ in model.named_parameters()}
    assert set(tensors) == names
    assert ("output.weight" in tensors) == (not tie)
    cfg = model.config
    for name, p in model.named_parameters():
        ne, kind, data = tensors[gguf_name(name)]
        assert kind == GT.F32
        if name == "embed_tokens.weight":
            assert ne == (cfg.dim, cfg.vocab_size)
            np.testing.assert_array_equal(data, p.data)
        elif p.data.ndim == 1:
            np.testing.assert_array_equal(data, p.data)
        else:   # Linear (in, out) -> ggml ne (in, out), rows = torch's (out, in)
            assert ne == p.data.shape
            rows = p.data.T
            if "q_proj" in name:
                rows = permute_qk(rows, cfg.n_heads)
            elif "k_proj" in name:
                rows = permute_qk(rows, cfg.n_kv_heads)
            np.testing.assert_array_equal(data, rows, err_msg=name)


def test_q_rows_follow_llama_cpp_rotary_pairs():
    # HF's head rows [x0..x3 | y0..y3] (rotate_half pairs x_i with y_i) become
    # llama.cpp's adjacent pairs x0 y0 x1 y1 ...
    rows = np.arange(8.0)[:, None]
    np.testing.assert_array_equal(permute_qk(rows, 1)[:, 0], [0, 4, 1, 5, 2, 6, 3, 7])


def test_byte_vocabulary_is_gpt2_byte_to_unicode():
    vocab = byte_vocabulary()
    assert len(vocab) == 257 and len(set(vocab)) == 257 and vocab[256] == "<|endoftext|>"
    assert all(len(s) == 1 for s in vocab[:256])
    assert vocab[ord("A")] == "A" and vocab[ord(" ")] == "Ġ" and vocab[ord("\n")] == "Ċ"
    assert vocab[0] == "Ā" and vocab[0xAD] == "Ń" and vocab[0xFF] == "ÿ"


TEXTS = ["Hello, world!", "a1 b2 c3a 1a1", "café naïve Ångström", "emoji 😀👍🏽 ok",
         "中文字符 日本語 한국어", "line\nbreaks\r\n\ttabs   runs  of   spaces  ",
         "it's we'll I'd <|endoftext|> 123456 x=1+2", "", " ", "ａ１ ٣a"]


def test_the_never_applying_merge_never_meets_its_pair():
    regex = pytest.importorskip("regex")
    # llama.cpp's gpt-2 pre-tokenizer; a word never holds a letter then a digit
    pattern = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"
                            r"|\s+(?!\S)|\s+")
    left, right = BYTE_MERGES[0].split(" ")
    for text in TEXTS + ["a1", "xa1a1a", "\u00e0" + "a1"]:
        words = pattern.findall(text)
        assert "".join(words) == text
        for word in words:
            assert left + right not in word, (text, word)


def test_bpe_tokenizer_on_the_byte_vocabulary_gives_byte_ids():
    pytest.importorskip("tokenizers")
    from ggmlopt.text import BPETokenizer
    bpe = BPETokenizer(byte_vocabulary(), list(BYTE_MERGES), eos_id=256, pre="gpt-2")
    byte = ByteTokenizer()
    for text in TEXTS:
        # (parse_special: "<|endoftext|>" is one token, a control one whatever its type
        # says, as llama.cpp makes the end-of-generation tokens it knows by their text)
        ids = bpe.encode(text, parse_special=False)
        np.testing.assert_array_equal(ids, byte.encode(text), err_msg=text)
        assert bpe.decode(ids) == text
    assert bpe.encode("a<|endoftext|>").tolist() == [97, 256]


def test_save_refusals(tmp_path):
    model = small()
    path = tmp_path / "m.gguf"
    with pytest.raises(ValueError, match="tokenizer"):
        save_gguf(model, path)
    with pytest.raises(ValueError, match="257 tokens but the model's vocab_size is 300"):
        save_gguf(small(vocab=300), path, tokenizer=ByteTokenizer())
    with pytest.raises(TypeError, match="tokenizer"):
        save_gguf(model, path, tokenizer="bytes")
    with pytest.raises(ValueError, match="reserved"):
        save_gguf(model, path, tokenizer=ByteTokenizer(), metadata={"llama.block_count": 3})
    with pytest.raises(ValueError, match="tokenizer"):
        save_gguf(Sequential(Linear(3, 2), ReLU()), path, tokenizer=ByteTokenizer())
    assert not os.path.exists(path)


def test_generic_layout_of_a_llama_still_available(tmp_path):
    model = small()
    save_gguf(model, tmp_path / "g.gguf", arch="ggmlopt")
    fields, _ = read(tmp_path / "g.gguf")
    assert fields["general.architecture"] == "ggmlopt"
    other = small(seed=5)
    load_gguf(tmp_path / "g.gguf", other)
    assert_params_equal(other, params(model))


def test_metadata_is_written(tmp_path):
    save_gguf(small(), tmp_path / "m.gguf", tokenizer=ByteTokenizer(),
              metadata={"training.steps": 12})
    fields, _ = read(tmp_path / "m.gguf")
    assert fields["training.steps"] == 12


# ---- reading into a given model ----

def test_load_into_a_given_llama(tmp_path):
    model = small(tie=False)
    save_gguf(model, tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    other = small(tie=False, seed=9)
    fields = load_gguf(tmp_path / "m.gguf", other)
    assert fields["general.architecture"] == "llama"
    assert_params_equal(other, params(model))


def test_load_into_a_llama_of_other_shapes_is_refused(tmp_path):
    save_gguf(small(tie=False), tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    for other in (small(tie=True, seed=3), small(tie=False, n_kv_heads=4, seed=3)):
        before = params(other)
        with pytest.raises(ValueError, match="does not (fit|hold) the model"):
            load_gguf(tmp_path / "m.gguf", other)
        assert_params_equal(other, before)


def test_load_into_a_model_with_adapters_says_so(tmp_path):
    from ggmlopt import lora
    save_gguf(small(tie=False), tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    adapted = small(tie=False, seed=3)
    lora.apply(adapted, rank=2, targets=("q_proj",), seed=0)
    before = params(adapted)
    with pytest.raises(ValueError, match=r"LoRA adapters .*lora\.merge"):
        load_gguf(tmp_path / "m.gguf", adapted)
    assert_params_equal(adapted, before)


def test_a_llama_file_into_another_model_is_refused(tmp_path):
    save_gguf(small(), tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    mlp = Sequential(Linear(4, 3), ReLU())
    before = [p.data.copy() for p in mlp.parameters()]
    with pytest.raises(ValueError, match="'llama'"):
        load_gguf(tmp_path / "m.gguf", mlp)
    for p, b in zip(mlp.parameters(), before):
        np.testing.assert_array_equal(p.data, b)


def test_other_architectures_need_a_model(tmp_path):
    save_gguf(Sequential(Linear(4, 3)), tmp_path / "g.gguf")
    with pytest.raises(ValueError, match="holds a 'ggmlopt' model, not a 'llama' one"):
        load_gguf(tmp_path / "g.gguf")
    with pytest.raises(ValueError, match="model: required"):
        load_gguf(tmp_path / "g.gguf", arch="ggmlopt")


# ---- files as other writers make them ----

@pytest.fixture
def saved(tmp_path):
    model = small(tie=False)
    path = tmp_path / "m.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer())
    return model, path


# (gguf-py quantizes no K-quant: Q4_K files are made by llama.cpp in tests/llamacpp)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_tensors_are_dequantized_with_a_warning(saved, tmp_path, qtype):
    model, path = saved
    kind = GT[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    _, tensors = read(path)
    replaced, expected = {}, {}
    for name, (ne, _, data) in tensors.items():
        if len(ne) == 2 and ne[0] % block == 0:
            q = gguf.quants.quantize(data, kind)
            replaced[name] = (q, kind)
            expected[name] = gguf.quants.dequantize(q, kind)
    assert replaced, "no tensor has rows of a whole number of blocks"
    out = tmp_path / "q.gguf"
    rewrite(path, out, tensors=replaced)
    with pytest.warns(UserWarning, match=qtype):
        back, tokenizer = load_gguf(out)
    assert back.config == model.config and isinstance(tokenizer, ByteTokenizer)
    for name, p in back.named_parameters():
        g = gguf_name(name)
        if g not in expected:
            np.testing.assert_array_equal(p.data, params(model)[name])
            continue
        rows = expected[g]
        if "attn_q" in g:
            from ggmlopt.io.llama_names import unpermute_qk
            rows = unpermute_qk(rows, back.config.n_heads)
        elif "attn_k" in g:
            from ggmlopt.io.llama_names import unpermute_qk
            rows = unpermute_qk(rows, back.config.n_kv_heads)
        ours = rows if g == "token_embd.weight" else rows.T
        np.testing.assert_array_equal(p.data, ours, err_msg=name)
        # and the quantization error is what a 4- or 8-bit code gives
        scale = np.abs(params(model)[name]).max()
        assert np.abs(p.data - params(model)[name]).max() < 0.2 * scale


def test_bfloat16_tensors(saved, tmp_path):
    model, path = saved
    _, tensors = read(path)
    replaced = {n: (gguf.quants.quantize(d, GT.BF16), GT.BF16)
                for n, (ne, _, d) in tensors.items() if len(ne) == 2}
    rewrite(path, tmp_path / "b.gguf", tensors=replaced)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back, _ = load_gguf(tmp_path / "b.gguf")
    for name, p in back.named_parameters():
        want = params(model)[name]
        if want.ndim == 2:
            np.testing.assert_allclose(p.data, want, rtol=2 ** -8, atol=0)
        else:
            np.testing.assert_array_equal(p.data, want)


def test_an_spm_vocabulary_without_scores_gives_none_with_a_warning(saved, tmp_path):
    model, path = saved
    out = tmp_path / "spm.gguf"
    rewrite(path, out, drop_keys=("tokenizer.ggml.merges", "tokenizer.ggml.pre"),
            set_keys={"tokenizer.ggml.model": ("llama", VT.STRING, None)})
    with pytest.warns(UserWarning, match="'llama'"):
        back, tokenizer = load_gguf(out)
    assert tokenizer is None
    assert_params_equal(back, params(model))


def test_an_spm_vocabulary_gives_an_spm_tokenizer(saved, tmp_path):
    from ggmlopt.spm import SPMTokenizer
    model, path = saved
    out = tmp_path / "spm.gguf"
    scores = [float(-i) for i in range(257)]
    rewrite(path, out, drop_keys=("tokenizer.ggml.merges", "tokenizer.ggml.pre"),
            set_keys={"tokenizer.ggml.model": ("llama", VT.STRING, None),
                      "tokenizer.ggml.scores": (scores, VT.ARRAY, VT.FLOAT32)})
    back, tokenizer = load_gguf(out)
    assert isinstance(tokenizer, SPMTokenizer) and tokenizer.vocab_size == 257
    assert_params_equal(back, params(model))


def test_other_gpt2_vocabulary_gives_a_bpe_tokenizer(saved, tmp_path):
    pytest.importorskip("tokenizers")
    from ggmlopt.text import BPETokenizer
    _, path = saved
    vocab = byte_vocabulary()
    # two real merges: "Ġ" + "t" -> "Ġt", "h" + "e" -> "he"; the vocabulary keeps 257
    # tokens by renaming two byte tokens nobody uses in the text below
    vocab[1], vocab[2] = "Ġt", "he"
    out = tmp_path / "bpe.gguf"
    rewrite(path, out, set_keys={
        "tokenizer.ggml.tokens": (vocab, VT.ARRAY, VT.STRING),
        "tokenizer.ggml.merges": (["Ġ t", "h e"], VT.ARRAY, VT.STRING)})
    _, tokenizer = load_gguf(out)
    assert isinstance(tokenizer, BPETokenizer) and tokenizer.vocab_size == 257
    ids = tokenizer.encode("the cat the")
    assert ids.tolist() == [ord("t"), 2, ord(" "), ord("c"), ord("a"), ord("t"), 1, 2]
    assert tokenizer.decode(ids) == "the cat the"
    assert tokenizer.eos_id == 256


def test_a_bpe_tokenizer_is_written_back(saved, tmp_path):
    pytest.importorskip("tokenizers")
    from ggmlopt.text import BPETokenizer
    model, _ = saved
    vocab = byte_vocabulary()
    vocab[1] = "he"
    bpe = BPETokenizer(vocab, ["h e"], eos_id=256, pre="gpt-2")
    save_gguf(model, tmp_path / "bpe.gguf", tokenizer=bpe)
    _, tokenizer = load_gguf(tmp_path / "bpe.gguf")
    assert isinstance(tokenizer, BPETokenizer)
    assert tokenizer.tokens == vocab and tokenizer.merges == ["h e"]
    assert tokenizer.encode("hehe").tolist() == [1, 1]


# ---- refusals ----

def assert_refused(path, match, model=None):
    if model is None:
        with pytest.raises(ValueError, match=match):
            load_gguf(path)
        return
    before = params(model)
    with pytest.raises(ValueError, match=match):
        load_gguf(path, model)
    assert_params_equal(model, before)


@pytest.mark.parametrize("key", ["llama.embedding_length", "llama.block_count",
                                 "llama.attention.head_count", "llama.feed_forward_length",
                                 "llama.context_length",
                                 "llama.attention.layer_norm_rms_epsilon"])
def test_missing_key_is_refused(saved, tmp_path, key):
    _, path = saved
    rewrite(path, tmp_path / "k.gguf", drop_keys=(key,))
    assert_refused(tmp_path / "k.gguf", f"missing key '{key}'")
    assert_refused(tmp_path / "k.gguf", f"missing key '{key}'", small(tie=False, seed=4))


def test_unsupported_keys_are_refused(saved, tmp_path):
    _, path = saved
    for key, value, vt, match in [
            ("llama.rope.dimension_count", 8, VT.UINT32, "rope.dimension_count"),
            ("llama.rope.scaling.type", "yarn", VT.STRING, "rope scaling .yarn. is not supported"),
            ("llama.rope.scaling.type", "linear", VT.STRING, "missing key .llama.rope.scaling.factor"),
            ("llama.expert_count", 8, VT.UINT32, "mixture of experts"),
            # a key of the architecture ggmlopt does not implement: refused, not dropped
            ("llama.attention.sliding_window", 64, VT.UINT32,
             r"keys \['llama.attention.sliding_window'\] are not implemented"),
            ("llama.rope.scaling.attn_factor", 1.5, VT.FLOAT32, "rope.scaling.attn_factor")]:
        out = tmp_path / "u.gguf"
        rewrite(path, out, set_keys={key: (value, vt, None)})
        assert_refused(out, match)


@pytest.mark.parametrize("count", [3, 1 << 20, (1 << 31) + 2])
def test_a_block_count_beyond_the_file_is_refused_at_once(saved, tmp_path, count):
    # one flipped bit made 2**31 + 1 layers: refused before any per-layer list
    _, path = saved
    rewrite(path, tmp_path / "b.gguf", set_keys={"llama.block_count": (count, VT.UINT32, None)})
    match = "missing tensors" if count == 3 else f"block_count is {count}, but the file holds"
    assert_refused(tmp_path / "b.gguf", match)


def test_a_family_s_per_layer_defaults_are_not_built_for_a_corrupt_block_count(tmp_path):
    # SmolLM3's config makes its no-RoPE pattern one entry a layer: 10**9 of them
    # took a minute and gigabytes before the count was compared with the file
    from ggmlopt.models import SmolLM3, SmolLM3Config
    model = SmolLM3(SmolLM3Config(vocab_size=257, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                                  ffn_dim=40, max_seq_len=64), seed=0)
    save_gguf(model, tmp_path / "s.gguf", tokenizer=ByteTokenizer())
    rewrite(tmp_path / "s.gguf", tmp_path / "b.gguf",
            set_keys={"smollm3.block_count": (10**9, VT.UINT32, None)})
    assert_refused(tmp_path / "b.gguf", "smollm3.block_count is 1000000000, but the file holds")


@pytest.mark.parametrize("tensor", ["blk.1.attn_k.weight", "output_norm.weight"])
def test_missing_tensor_is_refused(saved, tmp_path, tensor):
    _, path = saved
    rewrite(path, tmp_path / "t.gguf", drop_tensors=(tensor,))
    assert_refused(tmp_path / "t.gguf", f"missing tensors \\['{tensor}'\\]")
    assert_refused(tmp_path / "t.gguf", "missing tensors", small(tie=False, seed=4))


def test_extra_tensor_is_refused(saved, tmp_path):
    _, path = saved
    reader_path = tmp_path / "x.gguf"
    rewrite(path, reader_path, tensors=None)
    # a bias llama.cpp would add to the projection: refused, it changes the model
    out = tmp_path / "bias.gguf"
    writer_src = gguf.GGUFReader(reader_path)
    arrays = {t.name: np.array(t.data) for t in writer_src.tensors}
    writer_src = None
    w = gguf.GGUFWriter(out, "llama")
    fields = gguf.GGUFReader(reader_path).fields
    for key, field in fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        w.add_key_value(key, field.contents(), vtype,
                        sub_type=field.types[-1] if vtype == VT.ARRAY else None)
    for name, array in arrays.items():
        w.add_tensor(name, array)
    w.add_tensor("blk.0.attn_q.bias", np.zeros(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_refused(out, "unexpected tensors \\['blk.0.attn_q.bias'\\]")


def test_wrong_shape_is_refused(saved, tmp_path):
    _, path = saved
    rewrite(path, tmp_path / "s.gguf",
            tensors={"blk.0.ffn_up.weight": (np.zeros((97, 64), np.float32), None)})
    assert_refused(tmp_path / "s.gguf", "blk.0.ffn_up.weight")
    assert_refused(tmp_path / "s.gguf", "blk.0.ffn_up.weight", small(tie=False, seed=4))


@pytest.mark.parametrize("keep", [3, 100, 5000, -1])
def test_truncated_file_is_refused(saved, tmp_path, keep):
    _, path = saved
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep] if keep > 0 else data[:-40])
    assert_refused(cut, "truncated")
    assert_refused(cut, "truncated", small(tie=False, seed=4))


def test_garbage_file_is_refused(tmp_path):
    path = tmp_path / "g.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    assert_refused(path, "path:")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "none.gguf")


def test_a_chat_vocabulary_comes_back_with_its_special_tokens(tmp_path):
    pytest.importorskip("tokenizers")
    import ggmlopt as go
    from ggmlopt.text import BPETokenizer
    vocab = byte_vocabulary() + ["<|im_start|>", "<|im_end|>"]
    tok = BPETokenizer(vocab, list(BYTE_MERGES), token_types=[1] * 256 + [3, 3, 3],
                       eos_id=258, bos_id=257, eot_id=258)
    model = Llama(LlamaConfig(vocab_size=259, dim=16, n_layers=1, n_heads=2, max_seq_len=32),
                  seed=1)
    save_gguf(model, tmp_path / "chat.gguf", tokenizer=tok)
    loaded, tok2 = load_gguf(tmp_path / "chat.gguf")
    assert tok2.token_types == tok.token_types and tok2.eot_id == 258
    assert tok2.encode("<|im_start|>hi<|im_end|>").tolist() == [257, *b"hi", 258]
    # generate stops at the file's end-of-generation ids by default
    assert loaded.eog_ids == tok2.eog_ids == {256, 258}
    first = int(go.generate(loaded, [257], 1, temperature=0)[0])
    loaded.eog_ids = frozenset({first})
    assert go.generate(loaded, [257], 10, temperature=0).tolist() == [first]


def test_a_tokenizer_s_pad_unknown_and_named_templates_are_written(tmp_path):
    # what load_gguf_tokenizer reads beside the vocabulary (Qwen2's pad, a BPE
    # vocabulary's unknown token, Command R's tool_use and rag templates) comes
    # back from the file save_gguf writes, whatever model it is written with
    pytest.importorskip("tokenizers")
    from ggmlopt.io.gguf_reader import GgufFile
    from ggmlopt.text import BPETokenizer
    vocab = byte_vocabulary() + ["<|im_start|>", "<|im_end|>", "<|pad|>"]
    tok = BPETokenizer(vocab, list(BYTE_MERGES), token_types=[1] * 256 + [3, 3, 3, 3],
                       eos_id=258, bos_id=257, chat_template="D:{{ messages[0]['content'] }}")
    tok.pad_id, tok.unk_id = 259, 256
    tok.named_chat_templates = {"tool_use": "T:{{ messages[0]['content'] }}",
                                "rag": "R:{{ messages[0]['content'] }}"}
    model = Llama(LlamaConfig(vocab_size=260, dim=16, n_layers=1, n_heads=2, max_seq_len=32),
                  seed=1)
    save_gguf(model, tmp_path / "t.gguf", tokenizer=tok)
    fields = GgufFile(tmp_path / "t.gguf").fields
    assert fields["tokenizer.ggml.padding_token_id"] == 259
    assert fields["tokenizer.ggml.unknown_token_id"] == 256
    _, back = load_gguf(tmp_path / "t.gguf")
    assert (back.pad_id, back.unk_id) == (259, 256)
    assert back.chat_template == tok.chat_template
    assert back.named_chat_templates == tok.named_chat_templates
    chat = [{"role": "user", "content": "hi"}]
    assert back.apply_chat_template(chat, tokenize=False, chat_template="rag") == "R:hi"


def test_template_names_a_gguf_key_cannot_hold_are_said_or_refused(tmp_path):
    # GGUF keys keep letters and digits (gguf-py and llama.cpp's converter write
    # "tool-use" as tool_use): said with a warning; two names made one are refused
    model = Llama(LlamaConfig(vocab_size=257, dim=16, n_layers=1, n_heads=2, max_seq_len=32),
                  seed=1)
    tok = ByteTokenizer(chat_template="D")
    tok.named_chat_templates = {"tool-use": "A"}
    with pytest.warns(UserWarning, match="'tool-use' is written as tokenizer.chat_template.tool_use"):
        save_gguf(model, tmp_path / "a.gguf", tokenizer=tok)
    assert load_gguf(tmp_path / "a.gguf")[1].named_chat_templates == {"tool_use": "A"}
    tok.named_chat_templates = {"tool-use": "A", "tool.use": "B"}
    with pytest.raises(ValueError, match="'tool-use' and 'tool.use' would both be written"):
        save_gguf(model, tmp_path / "b.gguf", tokenizer=tok)
    assert not (tmp_path / "b.gguf").exists()


@pytest.mark.parametrize("name, dtype", [("f32", np.float32), ("F32", np.float32),
                                         ("f16", np.float16)])
def test_llama_cpp_type_names_are_dtypes(tmp_path, name, dtype):
    model = small(seed=3)
    save_gguf(model, tmp_path / "a.gguf", tokenizer=ByteTokenizer(), dtype=name)
    save_gguf(model, tmp_path / "b.gguf", tokenizer=ByteTokenizer(), dtype=dtype)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    with pytest.raises(TypeError, match="f32"):
        save_gguf(model, tmp_path / "c.gguf", tokenizer=ByteTokenizer(), dtype="f8")


def test_an_adapter_file_is_named_as_one_by_load_gguf(tmp_path):
    from ggmlopt import lora
    from ggmlopt.io import load_gguf_lora, save_gguf_lora
    model = small(seed=3)
    save_gguf(model, tmp_path / "model.gguf", tokenizer=ByteTokenizer())
    lora.apply(model, rank=2)
    save_gguf_lora(model, tmp_path / "adapter.gguf")
    with pytest.raises(ValueError, match=r"LoRA adapter \(general.type is 'adapter'.*"
                                         r"load_gguf_lora"):
        load_gguf(tmp_path / "adapter.gguf")
    with pytest.raises(ValueError, match="LoRA adapter.*load_gguf_lora"):
        load_gguf(tmp_path / "adapter.gguf", small())
    with pytest.raises(ValueError, match=r"model file.*load_gguf\(path\) reads it"):
        load_gguf_lora(tmp_path / "model.gguf", small())


def test_a_llama_with_qkv_biases_is_not_written_as_llama_cpp_s_llama(tmp_path):
    # llama.cpp permutes a llama's q/k rows, biases included, and ggmlopt's llama
    # reader has no biases: refused rather than written for the two to differ
    from ggmlopt.io import save_gguf
    from ggmlopt.models import Llama, LlamaConfig
    from ggmlopt.text import ByteTokenizer
    model = Llama(LlamaConfig(vocab_size=257, dim=16, n_layers=1, n_heads=2, qkv_bias=True))
    with pytest.raises(ValueError, match="qkv_bias"):
        save_gguf(model, tmp_path / "b.gguf", tokenizer=ByteTokenizer())
    assert not (tmp_path / "b.gguf").exists()
