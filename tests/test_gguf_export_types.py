"""save_gguf's quantized file types as llama-quantize makes them: each matrix
gets the block type llama-quantize's rules give it (the K mixes' Q6_K head and
value/down projections, the fall-backs for rows that are not whole blocks),
quantized to bytes ggmlopt's own kernels decode to the grid they chose; and a
model read from a GGUF writes back what its file said about itself.  The
bytes against llama-quantize's own: tests/llamacpp/test_llamacpp_quantize.py."""
import warnings

import numpy as np
import pytest

from ggmlopt import kernels_quant as kq
from ggmlopt.io import load_gguf, save_gguf
from ggmlopt.io._quant_mix import tensor_type
from ggmlopt.io.gguf_llama import save_llama_gguf
from ggmlopt.io.gguf_reader import GgufFile
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.nn.quantized import quantized_layers
from ggmlopt.text import ByteTokenizer

gguf = pytest.importorskip("gguf")
TOK = ByteTokenizer()


def llama(dim=256, n_layers=8, tie=False, seed=0):
    cfg = LlamaConfig(vocab_size=TOK.vocab_size, dim=dim, n_layers=n_layers, n_heads=4,
                      n_kv_heads=2, ffn_dim=256, max_seq_len=32, tie_embeddings=tie)
    return Llama(cfg, seed=seed)


def types_of(path):
    return {name: t.type_name for name, t in GgufFile(str(path)).tensors.items()}


# llama.cpp's use_more_bits over 8 layers: the first and last eighth and every third between
MORE_BITS_OF_8 = {0, 3, 6, 7}


@pytest.mark.parametrize("dtype,base,more", [("q4_k_m", "Q4_K", "Q6_K"), ("q4_k", "Q4_K", "Q6_K"),
                                             ("q5_k_m", "Q5_K", "Q6_K"), ("q6_k", "Q6_K", "Q6_K")])
def test_k_mixes_give_each_matrix_llama_quantizes_type(tmp_path, dtype, base, more):
    path = tmp_path / "m.gguf"
    save_gguf(llama(), path, tokenizer=TOK, dtype=dtype)
    types = types_of(path)
    assert types["output.weight"] == "Q6_K"
    assert types["token_embd.weight"] == base
    assert types["output_norm.weight"] == "F32"
    for i in range(8):
        for proj in ("attn_v", "ffn_down"):
            want = more if i in MORE_BITS_OF_8 else base
            assert types[f"blk.{i}.{proj}.weight"] == want, (i, proj)
        for proj in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{proj}.weight"] == base
    want_ftype = {"q4_k_m": 15, "q4_k": 15, "q5_k_m": 17, "q6_k": 18}[dtype]
    f = GgufFile(str(path))
    assert f.fields["general.file_type"] == want_ftype
    assert f.fields["general.quantization_version"] == gguf.GGML_QUANT_VERSION


def test_q4_k_s_and_a_tied_head(tmp_path):
    path = tmp_path / "s.gguf"
    save_gguf(llama(tie=True), path, tokenizer=TOK, dtype="q4_k_s")
    types = types_of(path)
    assert "output.weight" not in types
    assert types["token_embd.weight"] == "Q6_K"   # the tied embedding is the head
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(8)] == ["Q5_K"] * 4 + ["Q4_K"] * 4
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(8)] == ["Q5_K"] + ["Q4_K"] * 7


def test_rows_that_are_not_whole_blocks_fall_back_with_a_warning(tmp_path):
    """dim 96: no 256-value super-block fits a row, so Q4_K falls back to Q5_0 and
    Q6_K to Q8_0, as llama-quantize does; a 48-value row fits no block: F16."""
    path = tmp_path / "f.gguf"
    with pytest.warns(UserWarning, match="fall back.*blk.0.attn_q.weight Q4_K -> Q5_0"):
        save_gguf(llama(dim=96, n_layers=2), path, tokenizer=TOK, dtype="q4_k_m")
    types = types_of(path)
    assert types["blk.0.attn_q.weight"] == "Q5_0"
    assert types["blk.0.attn_v.weight"] == "Q5_0"
    assert types["blk.1.attn_v.weight"] == "Q8_0"   # the last layer's Q6_K -> Q8_0
    assert types["output.weight"] == "Q8_0"
    assert tensor_type("q4_k_m", "blk.0.ffn_up.weight", 48, 2, False) == ("F16", "Q4_K")
    assert tensor_type("q4_0", "output.weight", 256, 2, False) == ("Q6_K", "Q6_K")
    assert tensor_type("q8_0", "output.weight", 256, 2, False) == ("Q8_0", "Q8_0")
    assert tensor_type("bf16", "output.weight", 100, 2, False) == ("BF16", "BF16")


def test_the_written_blocks_are_the_quantized_weights(tmp_path):
    model = llama(n_layers=2)
    path = tmp_path / "q.gguf"
    save_gguf(model, path, tokenizer=TOK, dtype="q4_k_m")
    f = GgufFile(str(path))
    w = np.ascontiguousarray(model.layers[1].mlp.up_proj.weight.data.T)
    np.testing.assert_array_equal(f.raw("blk.1.ffn_up.weight"), kq.quantize(w, "Q4_K"))
    kept, _ = load_gguf(path, keep_types=True)
    layer = kept.layers[1].mlp.up_proj
    assert layer.qtype == "Q4_K"
    np.testing.assert_array_equal(layer.dequantize(), kq.dequantize("Q4_K", kq.quantize(w, "Q4_K"),
                                                                    256).T)


def test_a_non_finite_weight_is_refused_before_writing(tmp_path):
    model = llama(n_layers=2)
    model.layers[0].self_attn.q_proj.weight.data[3, 4] = np.inf
    with pytest.raises(ValueError, match="q_proj.weight holds a non-finite value"):
        save_gguf(model, tmp_path / "x.gguf", tokenizer=TOK, dtype="q4_k")
    assert not (tmp_path / "x.gguf").exists()


def test_a_model_read_from_a_gguf_writes_back_what_its_file_said(tmp_path):
    src = tmp_path / "src.gguf"
    save_llama_gguf(llama(n_layers=2), src, tokenizer=TOK, name="Tiny Base",
              metadata={"general.license": "apache-2.0", "general.author": "someone",
                        "general.base_model.count": 1})
    # a tokenizer key this writer does not set itself, as convert_hf_to_gguf writes one
    _add_keys(src, tmp_path / "src2.gguf", {"tokenizer.ggml.padding_token_id": (256, "UINT32")})
    model, tok = load_gguf(tmp_path / "src2.gguf")
    assert model.gguf_metadata["general.license"] == "apache-2.0"
    assert "general.architecture" not in model.gguf_metadata
    out = tmp_path / "out.gguf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_gguf(model, out, tokenizer=tok, dtype="q8_0", metadata={"general.author": "me"})
    f = GgufFile(str(out))
    assert f.fields["general.name"] == "Tiny Base"
    assert f.fields["general.license"] == "apache-2.0"
    assert f.fields["general.base_model.count"] == 1
    assert f.fields["general.author"] == "me"            # what the caller says wins
    assert f.fields["tokenizer.ggml.padding_token_id"] == 256
    assert f.field_types["tokenizer.ggml.padding_token_id"][0] == 4   # still a uint32
    assert f.fields["general.file_type"] == 7            # the new file's own type
    # written with another vocabulary, the source's tokenizer keys stay behind
    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "llama")
    added = model.gguf_metadata.add_to(writer, ["a", "b"])
    assert "general.license" in added and "tokenizer.ggml.padding_token_id" not in added
    writer.close()


def test_a_file_loaded_into_a_model_gives_it_that_file_s_metadata(tmp_path):
    # load_gguf(path, model): the weights are the second file's, and so must be the
    # license and provenance written back, not those of the file loaded before
    first, second = tmp_path / "first.gguf", tmp_path / "second.gguf"
    save_llama_gguf(llama(n_layers=2, seed=0), first, tokenizer=TOK, name="First",
                    metadata={"general.license": "llama3.1", "general.base_model.count": 1})
    save_llama_gguf(llama(n_layers=2, seed=1), second, tokenizer=TOK, name="Second",
                    metadata={"general.license": "mit"})
    model, tok = load_gguf(first)
    load_gguf(second, model)
    assert model.gguf_metadata["general.license"] == "mit"
    out = tmp_path / "out.gguf"
    save_gguf(model, out, tokenizer=tok)
    f = GgufFile(str(out))
    assert f.fields["general.name"] == "Second" and f.fields["general.license"] == "mit"
    assert "general.base_model.count" not in f.fields
    # a model built in ggmlopt takes the file's too
    fresh = llama(n_layers=2, seed=2)
    load_gguf(second, fresh)
    save_gguf(fresh, out, tokenizer=tok)
    assert GgufFile(str(out)).fields["general.license"] == "mit"


def test_kept_weights_another_file_type_leaves_as_they_are_are_labelled_and_warned(tmp_path):
    # an F16 base kept in its type, saved with dtype="q4_k_m": the float32
    # weights (a merge's) are quantized, the kept F16 ones written as F16, which
    # the label says (the most common type) and a warning names
    from ggmlopt import lora
    src = tmp_path / "f16.gguf"
    save_gguf(llama(n_layers=2), src, tokenizer=TOK, dtype=np.float16)
    model, tok = load_gguf(src, keep_types=True)
    lora.apply(model, rank=2)
    lora.merge(model)
    out = tmp_path / "out.gguf"
    with pytest.warns(UserWarning, match=r"dtype: 'q4_k_m' quantizes the float32 weights; "
                                         r"\d+ F16 weight matrices kept in their file's types"):
        save_gguf(model, out, tokenizer=tok, dtype="q4_k_m")
    types = types_of(out)
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.0.ffn_up.weight"] == "F16"
    assert GgufFile(str(out)).fields["general.file_type"] == 1      # MOSTLY_F16
    # kept weights in the types dtype gives anyway: its label, no warning
    q4, tok = load_gguf(_saved(tmp_path / "q4km.gguf", "q4_k_m"), keep_types=True)
    lora.apply(q4, rank=2)
    lora.merge(q4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_gguf(q4, out, tokenizer=tok, dtype="q4_k_m")
    assert GgufFile(str(out)).fields["general.file_type"] == 15     # MOSTLY_Q4_K_M


def _saved(path, dtype):
    save_gguf(llama(n_layers=2), path, tokenizer=TOK, dtype=dtype)
    return path


def _add_keys(src, dst, keys):
    """A copy of the GGUF src with extra or other key-values {key: (value, GGUF
    type name)}."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", *keys):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub)
    for key, (value, tname) in keys.items():
        writer.add_key_value(key, value, gguf.GGUFValueType[tname])
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())),
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_add_eos_goes_back_as_the_file_had_it(tmp_path):
    # llama.cpp appends EOS to every text of a file that says add_eos_token: a
    # fine-tuned model written back must say it too
    save_llama_gguf(llama(n_layers=2), tmp_path / "src.gguf", tokenizer=TOK)
    for add_eos in (True, False):
        src = tmp_path / f"eos{add_eos}.gguf"
        _add_keys(tmp_path / "src.gguf", src, {"tokenizer.ggml.add_eos_token": (add_eos, "BOOL")})
        model, tok = load_gguf(src)
        save_gguf(model, tmp_path / "out.gguf", tokenizer=tok)
        assert GgufFile(str(tmp_path / "out.gguf")).fields["tokenizer.ggml.add_eos_token"] \
            is add_eos
    # a model of no file says False (llama.cpp's default for these vocabularies)
    save_gguf(llama(n_layers=2), tmp_path / "new.gguf", tokenizer=TOK)
    assert GgufFile(str(tmp_path / "new.gguf")).fields["tokenizer.ggml.add_eos_token"] is False


@pytest.mark.parametrize("pre, bos", [("llama-bpe", True), ("tekken", True), ("qwen2", False),
                                      ("default", False)])
def test_bos_without_the_key_is_llama_cpps_default_for_the_pre_tokenizer(pre, bos):
    pytest.importorskip("tokenizers")
    from ggmlopt.io.gguf_llama import tokenizer_from_fields
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
              "tokenizer.ggml.tokens": ["a", "b", "ab", "<s>"], "tokenizer.ggml.merges": ["a b"],
              "tokenizer.ggml.token_type": [1, 1, 1, 3], "tokenizer.ggml.bos_token_id": 3,
              "tokenizer.ggml.eos_token_id": 3}
    assert tokenizer_from_fields(fields, "f").add_bos is bos
    for said in (True, False):   # the key, when the file has it, decides
        assert tokenizer_from_fields({**fields, "tokenizer.ggml.add_bos_token": said},
                                     "f").add_bos is said


@pytest.mark.parametrize("dtype", ["q4_k_m", "q4_k_s", "q5_k_m", "q8_0"])
def test_a_kept_model_written_back_keeps_its_files_type(tmp_path, dtype):
    from ggmlopt import lora
    src = tmp_path / "src.gguf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_gguf(llama(n_layers=2), src, tokenizer=TOK, dtype=dtype)
    label = GgufFile(str(src)).fields["general.file_type"]
    kept, tok = load_gguf(src, keep_types=True)
    # every matrix as the file had it: the file's own label (a mix, not its most
    # common type), whatever dtype the call names
    for asked in (np.float32, "q4_0"):
        save_gguf(kept, tmp_path / "out.gguf", tokenizer=tok, dtype=asked)
        assert GgufFile(str(tmp_path / "out.gguf")).fields["general.file_type"] == label
        assert types_of(tmp_path / "out.gguf") == types_of(src)
    # adapters merged into float32 weights, quantized as asked: the asked type's label
    lora.apply(kept, rank=2)
    lora.merge(kept)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_gguf(kept, tmp_path / "merged.gguf", tokenizer=tok, dtype="q4_0")
    assert GgufFile(str(tmp_path / "merged.gguf")).fields["general.file_type"] == \
        gguf.LlamaFileType.MOSTLY_Q4_0
    # ... or left in float beside the matrices still kept: the float ones outnumber
    # them, and the label is theirs (it was the kept ones' mix)
    for asked, want in ((np.float32, gguf.LlamaFileType.ALL_F32),
                        (np.float16, gguf.LlamaFileType.MOSTLY_F16)):
        kept, tok = load_gguf(src, keep_types=True)
        lora.apply(kept, rank=2, targets="all-linear")
        lora.merge(kept)
        assert quantized_layers(kept)   # (the embedding)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save_gguf(kept, tmp_path / "float.gguf", tokenizer=tok, dtype=asked)
        assert GgufFile(str(tmp_path / "float.gguf")).fields["general.file_type"] == want


def test_a_70b_gives_its_value_projections_more_bits():
    """llama-quantize's LLM_TYPE_70B rule: a llama of 80 layers with grouped
    heads (or a qwen2 of 80) has its Q4_K value projections at Q5_K."""
    from ggmlopt.io._quant_mix import is_70b
    assert is_70b("llama", 80, 64, 8) and is_70b("qwen2", 80, 64, 8)
    assert not is_70b("llama", 80, 64, 64) and not is_70b("llama", 32, 32, 8)
    name = "blk.11.attn_v.weight"   # not one of use_more_bits' layers of 80
    assert tensor_type("q4_k_m", name, 8192, 80, False, is_70b=True) == ("Q5_K", "Q5_K")
    assert tensor_type("q4_k_m", name, 8192, 80, False) == ("Q4_K", "Q4_K")
    assert tensor_type("q4_k_s", "blk.5.attn_v.weight", 8192, 80, False, True)[0] == "Q5_K"
    assert tensor_type("q4_k_m", "blk.11.attn_q.weight", 8192, 80, False, True)[0] == "Q4_K"


def test_an_f16_fall_back_refuses_values_beyond_float16(tmp_path):
    cfg = LlamaConfig(vocab_size=TOK.vocab_size, dim=48, n_layers=1, n_heads=4, ffn_dim=48,
                      max_seq_len=16)
    model = Llama(cfg, seed=0)
    model.layers[0].mlp.up_proj.weight.data[2, 3] = 1e5   # rows of 48: f16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="beyond float16's range"):
            save_gguf(model, tmp_path / "x.gguf", tokenizer=TOK, dtype="q4_0")
    assert not (tmp_path / "x.gguf").exists()


def test_quantization_version_is_the_writers(tmp_path):
    with pytest.raises(ValueError, match="general.quantization_version.*reserved"):
        save_gguf(llama(n_layers=1), tmp_path / "x.gguf", tokenizer=TOK, dtype="q8_0",
                  metadata={"general.quantization_version": 7})


# weights whose block scale (float16: up to 65504) overflows under each type: Q8_0's
# d = max / 127, Q4_0's max / 8, Q4_1's min itself, the K types' d of sub-block
# scales; BF16 rounds past its largest finite value.  llama-quantize refuses such a
# row (ggml_validate_row_data); written, llama.cpp would read inf / NaN
@pytest.mark.parametrize("dtype,big,fine", [("q8_0", 1e7, 1e6), ("q4_0", 1e6, 1e5),
                                            ("q4_1", -1e5, -1e4), ("q5_1", 4e6, 1e5),
                                            ("q4_k_m", 1e9, 1e6), ("q6_k", 1e9, 1e6),
                                            ("bf16", 3.4e38, 3.3e38)])
def test_weights_beyond_a_types_scales_are_refused_before_writing(tmp_path, dtype, big, fine):
    model = llama(n_layers=1)
    up = model.layers[0].mlp.up_proj.weight.data
    up[2, 3] = fine   # within range: written, and reads back finite
    save_gguf(model, tmp_path / "ok.gguf", tokenizer=TOK, dtype=dtype)
    assert np.isfinite(GgufFile(str(tmp_path / "ok.gguf")).float32("blk.0.ffn_up.weight")).all()
    up[2, 3] = big
    with pytest.raises(ValueError, match=r"up_proj\.weight holds values too large for"):
        save_gguf(model, tmp_path / "x.gguf", tokenizer=TOK, dtype=dtype)
    assert not (tmp_path / "x.gguf").exists()
