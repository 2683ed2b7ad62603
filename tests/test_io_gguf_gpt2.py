"""A GPT-2 as llama.cpp's gpt2 GGUF: written and read back bit for bit, its LoRA
adapters too; files it cannot be are refused by name."""
import numpy as np
import pytest

from ggmlopt import lora
from ggmlopt.io import load_gguf, load_gguf_lora, save_gguf, save_gguf_lora
from ggmlopt.io.gguf_gpt2 import gguf_name_gpt2
from ggmlopt.models import GPT2, GPT2Config
from ggmlopt.text import ByteTokenizer

pytest.importorskip("gguf")

CFG = GPT2Config(vocab_size=257, dim=32, n_layers=2, n_heads=4, max_seq_len=48)


def test_a_gpt2_file_reads_back_bit_for_bit(tmp_path):
    from ggmlopt.io.gguf_reader import GgufFile
    model = GPT2(CFG, seed=3)
    save_gguf(model, tmp_path / "g.gguf", tokenizer=ByteTokenizer())
    f = GgufFile(str(tmp_path / "g.gguf"))
    assert f.fields["general.architecture"] == "gpt2"
    assert {"token_embd.weight", "position_embd.weight", "blk.1.attn_qkv.bias",
            "blk.0.ffn_down.weight", "output_norm.bias"} <= set(f.tensors)
    assert "output.weight" not in f.tensors   # tied, as llama.cpp reads it
    back, tok = load_gguf(tmp_path / "g.gguf")
    assert isinstance(back, GPT2) and back.config == CFG and isinstance(tok, ByteTokenizer)
    for (name, p), (_, q) in zip(model.named_parameters(), back.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=name)
    # generate stops at the file's end-of-generation ids, as for every other family
    assert back.eog_ids == tok.eog_ids == {256}
    # without a tokenizer a GPT2 keeps the generic layout
    save_gguf(model, tmp_path / "generic.gguf")
    assert GgufFile(str(tmp_path / "generic.gguf")).fields["general.architecture"] == "ggmlopt"


def test_a_float16_gpt2_file_keeps_its_position_rows_in_float32(tmp_path):
    # llama.cpp's converter and llama-quantize keep position_embd float32 in any file type
    from ggmlopt.io.gguf_reader import GgufFile
    model = GPT2(CFG, seed=3)
    save_gguf(model, tmp_path / "g.gguf", tokenizer=ByteTokenizer(), dtype=np.float16)
    types = {name: t.type_name for name, t in GgufFile(str(tmp_path / "g.gguf")).tensors.items()}
    assert types["position_embd.weight"] == "F32"
    assert types["token_embd.weight"] == types["blk.0.ffn_down.weight"] == "F16"
    back, _ = load_gguf(tmp_path / "g.gguf")
    np.testing.assert_array_equal(back.wpe.weight.data, model.wpe.weight.data)


def test_gpt2_adapters_round_trip(tmp_path):
    model = GPT2(CFG, seed=4)
    lora.apply(model, rank=4, targets=("c_attn", "c_fc"), seed=0)
    rng = np.random.default_rng(0)
    for _, layer in lora.named_adapters(model):
        layer.lora_b.data[...] = rng.normal(0, 0.1, layer.lora_b.shape)
    save_gguf_lora(model, tmp_path / "a.gguf")
    other = GPT2(CFG, seed=4)
    load_gguf_lora(tmp_path / "a.gguf", other)
    x = np.arange(20)[None] % 257
    np.testing.assert_array_equal(other(x), model(x))


def test_what_a_gpt2_file_cannot_hold_is_refused(tmp_path):
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "gpt2")
    w.add_context_length(8)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)   # not 4 x 8
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_layer_norm_eps(1e-5)
    w.add_token_list(["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="feed_forward_length 16 is not 4 x"):
        load_gguf(tmp_path / "bad.gguf")


@pytest.mark.parametrize("key", ["block_count", "embedding_length"])
def test_keys_beyond_the_file_s_tensors_are_refused_before_allocating(tmp_path, key):
    # a corrupt layer count or width: refused, not gigabytes allocated first
    import gguf
    model = GPT2(GPT2Config(vocab_size=257, dim=16, n_layers=1, n_heads=2, max_seq_len=16))
    save_gguf(model, tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    name = f"gpt2.{key}".encode()
    at = data.index(name) + len(name)
    assert int.from_bytes(data[at:at + 4], "little") == gguf.GGUFValueType.UINT32
    value = 1 << 20 if key == "block_count" else 16 * 4096
    data[at + 4:at + 8] = value.to_bytes(4, "little")
    if key == "embedding_length":   # keep feed_forward_length = 4 x it
        ff = b"gpt2.feed_forward_length"
        at2 = data.index(ff) + len(ff)
        data[at2 + 4:at2 + 8] = (4 * value).to_bytes(4, "little")
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="its keys describe a GPT2 of .* the file holds"):
        load_gguf(tmp_path / "bad.gguf")


def test_a_gpt2_read_from_a_gguf_writes_back_what_its_file_said(tmp_path):
    from ggmlopt.io.gguf_gpt2 import save_gpt2_gguf
    from ggmlopt.io.gguf_reader import GgufFile
    save_gpt2_gguf(GPT2(CFG, seed=5), tmp_path / "src.gguf", tokenizer=ByteTokenizer(),
                   name="Tiny GPT", metadata={"general.license": "mit"})
    model, tok = load_gguf(tmp_path / "src.gguf")
    assert model.gguf_metadata["general.license"] == "mit"
    save_gguf(model, tmp_path / "out.gguf", tokenizer=tok)
    f = GgufFile(str(tmp_path / "out.gguf"))
    assert f.fields["general.name"] == "Tiny GPT" and f.fields["general.license"] == "mit"


@pytest.mark.parametrize("dtype,head,qkv", [("q4_k_m", "Q6_K", "Q6_K"), ("q8_0", "Q8_0", "Q8_0"),
                                            ("bf16", "BF16", "BF16")])
def test_a_gpt2_takes_llama_quantizes_file_types(tmp_path, dtype, head, qkv):
    # llama-quantize's choices for llama.cpp's gpt2 (bytes against its own:
    # tests/llamacpp/test_llamacpp_quantize.py): the token embedding is the head,
    # attn_qkv holds the value projection (more bits in the last of two layers under
    # the _M mixes),
    # position rows, norms and biases stay float32; it reads back dequantized
    from ggmlopt.io.gguf_reader import GgufFile
    model = GPT2(GPT2Config(vocab_size=257, dim=256, n_layers=2, n_heads=4, max_seq_len=48),
                 seed=3)
    save_gguf(model, tmp_path / "q.gguf", tokenizer=ByteTokenizer(), dtype=dtype)
    f = GgufFile(str(tmp_path / "q.gguf"))
    types = {n: t.type_name for n, t in f.tensors.items()}
    assert types["token_embd.weight"] == head and types["blk.1.attn_qkv.weight"] == qkv
    assert types["position_embd.weight"] == types["blk.0.attn_qkv.bias"] == "F32"
    assert f.fields["general.file_type"] == {"q4_k_m": 15, "q8_0": 7, "bf16": 32}[dtype]
    with pytest.warns(UserWarning, match="dequantized") if dtype != "bf16" else \
            _no_warning():
        back, _ = load_gguf(tmp_path / "q.gguf")
    for (name, p), (_, q) in zip(model.named_parameters(), back.named_parameters()):
        if p.data.ndim == 2 and name != "wpe.weight":
            want = f.float32(gguf_name_gpt2(name))
            np.testing.assert_array_equal(q.data, want if name == "wte.weight" else want.T,
                                          err_msg=name)
        else:
            np.testing.assert_array_equal(q.data, p.data, err_msg=name)


def _no_warning():
    import contextlib
    import warnings
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("error")
    return stack
