"""ggmlopt.io.save_gguf_lora / load_gguf_lora: llama.cpp's LoRA adapter files."""
import warnings

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.io import load_gguf_lora, save_gguf_lora
from ggmlopt.models import GPT2, GPT2Config, Llama, LlamaConfig

gguf = pytest.importorskip("gguf")

CFG = LlamaConfig(vocab_size=29, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24,
                  max_seq_len=16)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def _adapted(targets=ALL, rank=3, alpha=6.0, seed=0):
    model = Llama(CFG, seed=7)
    lora.apply(model, rank=rank, alpha=alpha, targets=targets, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for _, layer in lora.named_adapters(model):
        layer.lora_b.data[...] = rng.normal(0, 0.2, layer.lora_b.shape)
    return model


def _read(path):
    reader = gguf.GGUFReader(path)
    fields = {}
    for name, f in reader.fields.items():
        part = f.parts[f.data[0]] if f.data else None
        if part is not None and f.types and f.types[0] == gguf.GGUFValueType.STRING:
            fields[name] = bytes(part).decode()
        elif part is not None:
            fields[name] = part.tolist()[0]
    tensors = {t.name: (tuple(int(n) for n in t.shape), t.tensor_type.name,
                        np.array(t.data).reshape(tuple(int(n) for n in t.shape[::-1])))
               for t in reader.tensors}
    return fields, tensors


def test_the_file_is_a_llama_cpp_lora_adapter(tmp_path):
    model = _adapted(rank=3, alpha=6.0)
    path = tmp_path / "a.gguf"
    save_gguf_lora(model, path)
    fields, tensors = _read(path)
    assert fields["general.architecture"] == "llama"
    assert fields["general.type"] == "adapter"
    assert fields["adapter.type"] == "lora"
    assert fields["adapter.lora.alpha"] == 6.0
    assert len(tensors) == 2 * (2 * 7 + 1)
    ne, kind, a = tensors["blk.1.attn_k.weight.lora_a"]
    assert ne == (16, 3) and kind == "F32" and a.shape == (3, 16)        # ne (in, rank)
    ne, kind, b = tensors["blk.1.attn_k.weight.lora_b"]
    assert ne == (3, 8) and kind == "F32" and b.shape == (8, 3)          # ne (rank, out)
    assert tensors["blk.0.ffn_down.weight.lora_a"][0] == (24, 3)
    assert tensors["output.weight.lora_b"][0] == (3, 29)
    layer = model.layers[0].mlp.up_proj
    np.testing.assert_array_equal(tensors["blk.0.ffn_up.weight.lora_a"][2], layer.lora_a.data.T)
    np.testing.assert_array_equal(tensors["blk.0.ffn_up.weight.lora_b"][2], layer.lora_b.data.T)


@pytest.mark.parametrize("proj,tensor,heads", [("q_proj", "attn_q", 4), ("k_proj", "attn_k", 2)])
def test_q_and_k_rows_are_in_llama_cpp_rotary_order(tmp_path, proj, tensor, heads):
    model = _adapted()
    save_gguf_lora(model, tmp_path / "a.gguf")
    _, tensors = _read(tmp_path / "a.gguf")
    layer = getattr(model.layers[1].self_attn, proj)
    b_hf = layer.lora_b.data.T                       # (out, rank), Hugging Face's rows
    b_cpp = tensors[f"blk.1.{tensor}.weight.lora_b"][2]
    half = CFG.head_dim // 2
    for h in range(heads):
        for i in range(half):
            for j in range(2):   # llama.cpp's row 2i+j of a head is HF's row j*half+i
                np.testing.assert_array_equal(b_cpp[h * CFG.head_dim + 2 * i + j],
                                              b_hf[h * CFG.head_dim + j * half + i])
    np.testing.assert_array_equal(tensors[f"blk.1.{tensor}.weight.lora_a"][2], layer.lora_a.data.T)


def test_round_trip_is_bit_exact(tmp_path):
    model = _adapted()
    save_gguf_lora(model, tmp_path / "a.gguf")
    other = Llama(CFG, seed=7)
    adapters = load_gguf_lora(tmp_path / "a.gguf", other)
    assert [n for n, _ in adapters] == [n for n, _ in lora.named_adapters(model)]
    for (n, p), (m, q) in zip(model.named_parameters(), other.named_parameters()):
        assert n == m and p.requires_grad == q.requires_grad
        np.testing.assert_array_equal(p.data, q.data, err_msg=n)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 9))
    np.testing.assert_array_equal(model(tokens), other(tokens))
    # into a model adapted the same way: the values are replaced
    again = _adapted(seed=5)
    load_gguf_lora(tmp_path / "a.gguf", again)
    np.testing.assert_array_equal(again(tokens), model(tokens))


def test_round_trip_of_a_tied_model_with_attention_adapters(tmp_path):
    cfg = LlamaConfig(vocab_size=13, dim=8, n_layers=1, n_heads=2, max_seq_len=8,
                      tie_embeddings=True)
    model = Llama(cfg, seed=1)
    lora.apply(model, rank=1, alpha=0.5)
    for _, layer in lora.named_adapters(model):
        layer.lora_b.data[...] = 0.25
    save_gguf_lora(model, tmp_path / "a.gguf")
    other = Llama(cfg, seed=1)
    load_gguf_lora(tmp_path / "a.gguf", other, dropout=0.1)
    assert all(layer.lora_dropout.p == 0.1 and layer.alpha == 0.5
               for _, layer in lora.named_adapters(other))
    np.testing.assert_array_equal(model(np.array([[1, 2, 3]])), other(np.array([[1, 2, 3]])))


def test_adapters_of_several_alphas_are_written_with_one(tmp_path):
    # PEFT's alpha_pattern, rsLoRA over a rank_pattern: a llama.cpp file holds one
    # alpha, the one most adapters have; the others' B carry their own alpha over it
    model = Llama(CFG, seed=2)
    config = {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "v_proj"],
              "rank_pattern": {"layers.1.self_attn.q_proj": 2},
              "alpha_pattern": {"layers.0.self_attn.v_proj": 3}}
    lora.apply(model, config=config, seed=1)
    rng = np.random.default_rng(3)
    for _, layer in lora.named_adapters(model):
        layer.lora_b.data[...] = rng.normal(0, 0.2, layer.lora_b.shape)
    alphas = [layer.alpha for _, layer in lora.named_adapters(model)]
    assert len(set(alphas)) == 3
    save_gguf_lora(model, tmp_path / "a.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "a.gguf"))
    field = reader.get_field("adapter.lora.alpha")
    assert float(field.parts[field.data[0]][0]) == np.float32(8 * 2.0)   # 8 * sqrt(4)
    other = Llama(CFG, seed=2)
    load_gguf_lora(tmp_path / "a.gguf", other)
    ids = np.array([[1, 5, 9, 2, 7]])
    want = model(ids)
    np.testing.assert_allclose(other(ids), want, rtol=0, atol=1e-6 * np.abs(want).max())
    assert [layer.rank for _, layer in lora.named_adapters(other)] == \
        [layer.rank for _, layer in lora.named_adapters(model)]


def test_save_refuses_what_llama_cpp_cannot_load(tmp_path):
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_gguf_lora(Llama(CFG), tmp_path / "a.gguf")
    other = go.nn.Sequential(go.nn.Linear(4, 4))
    lora.apply(other, targets=("0",))
    with pytest.raises(TypeError, match="Llama or GPT2"):
        save_gguf_lora(other, tmp_path / "a.gguf")
    with pytest.raises(FileNotFoundError, match="path"):
        save_gguf_lora(_adapted(), tmp_path / "missing" / "a.gguf")
    assert not (tmp_path / "a.gguf").exists()


def _write(path, tensors, **keys):
    fields = {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": 4.0}
    fields.update(keys)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_float32(key, value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _pair(rank=2, n_in=16, n_out=16):
    return np.ones((rank, n_in), np.float32), np.ones((n_out, rank), np.float32)


@pytest.mark.parametrize("case,tensors,keys,match", [
    ("base model", {"blk.0.attn_q.weight.lora_a": _pair()[0],
                    "blk.0.attn_q.weight.lora_b": _pair()[1]},
     {"general.type": None}, "not a llama LoRA adapter"),
    ("other adapter", {"blk.0.attn_q.weight.lora_a": _pair()[0],
                       "blk.0.attn_q.weight.lora_b": _pair()[1]},
     {"adapter.type": "control_vector"}, "adapter.type"),
    ("no alpha", {"blk.0.attn_q.weight.lora_a": _pair()[0],
                  "blk.0.attn_q.weight.lora_b": _pair()[1]},
     {"adapter.lora.alpha": None}, "alpha"),
    ("half", {"blk.0.attn_q.weight.lora_a": _pair()[0]}, {}, r"lacks blk\.0\.attn_q\.weight\.lora_b"),
    ("ranks", {"blk.0.attn_q.weight.lora_a": _pair(2)[0],
               "blk.0.attn_q.weight.lora_b": _pair(3)[1]}, {}, "ranks"),
    ("shape", {"blk.0.attn_k.weight.lora_a": _pair()[0],
               "blk.0.attn_k.weight.lora_b": _pair()[1]}, {}, r"needs \(rank, 16\) and \(8, rank\)"),
    ("layer", {"blk.5.attn_q.weight.lora_a": _pair()[0],
               "blk.5.attn_q.weight.lora_b": _pair()[1]}, {}, "does not have"),
    ("name", {"blk.0.attn_q.weight": _pair()[0]}, {}, "not a LoRA tensor"),
    ("foreign", {"blk.0.ssm_in.weight.lora_a": _pair()[0],
                 "blk.0.ssm_in.weight.lora_b": _pair()[1]}, {}, "not a weight of a Llama"),
])
def test_load_refuses_bad_files_and_leaves_the_model_alone(tmp_path, case, tensors, keys, match):
    path = tmp_path / f"{case.replace(' ', '_')}.gguf"
    _write(path, tensors, **keys)
    model = Llama(CFG)
    with pytest.raises(ValueError, match=match):
        load_gguf_lora(path, model)
    assert not lora.named_adapters(model)
    assert all(p.requires_grad for p in model.parameters())


def test_load_refuses_truncated_files_other_models_and_other_adapters(tmp_path):
    path = tmp_path / "a.gguf"
    save_gguf_lora(_adapted(targets=("q_proj",)), path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-40])
    model = Llama(CFG)
    with pytest.raises(ValueError, match="truncated"):
        load_gguf_lora(cut, model)
    with pytest.raises(FileNotFoundError):
        load_gguf_lora(tmp_path / "none.gguf", model)
    with pytest.raises(ValueError, match="not a gpt2 LoRA adapter"):   # a llama's adapter
        load_gguf_lora(path, GPT2(GPT2Config(vocab_size=13, dim=8, n_layers=1, n_heads=2)))
    other = _adapted(targets=("v_proj",))
    before = [p.data.copy() for p in other.parameters()]
    with pytest.raises(ValueError, match="not the file's"):
        load_gguf_lora(path, other)
    for p, q in zip(other.parameters(), before):
        np.testing.assert_array_equal(p.data, q)
    with pytest.raises(ValueError, match="rank"):
        load_gguf_lora(path, _adapted(targets=("q_proj",), rank=5))
    assert not lora.named_adapters(model)


def test_f16_adapters_load_and_norm_vectors_are_skipped_as_llama_cpp_does(tmp_path):
    a, b = np.full((2, 16), 0.5, np.float16), np.full((8, 2), 0.25, np.float16)
    _write(tmp_path / "h.gguf", {"blk.1.attn_v.weight.lora_a": a,
                                 "blk.1.attn_v.weight.lora_b": b,
                                 "blk.1.attn_norm.weight": np.ones(16, np.float32)})
    model = Llama(CFG)
    with pytest.warns(UserWarning, match="attn_norm.weight.*skipped"):
        (name, layer), = load_gguf_lora(tmp_path / "h.gguf", model)
    assert name == "layers.1.self_attn.v_proj" and layer.rank == 2 and layer.scaling == 2.0
    np.testing.assert_array_equal(layer.lora_a.data, a.T.astype(np.float32))
    np.testing.assert_array_equal(layer.lora_b.data, b.T.astype(np.float32))


def test_an_adapter_file_refuses_a_model_that_trains_more_than_its_adapters(tmp_path):
    model = _adapted(targets=("q_proj",))
    model.norm.weight.requires_grad = True
    model.layers[0].mlp.up_proj.weight.requires_grad = True
    with pytest.raises(ValueError, match=r"2 parameters other than the LoRA adapters are "
                                         r"trainable \(layers.0.mlp.up_proj.weight, "
                                         r"norm.weight\).*freeze them.*lora.merge"):
        save_gguf_lora(model, tmp_path / "a.gguf")
    assert not (tmp_path / "a.gguf").exists()
    kept = Llama(CFG, seed=7)
    lora.apply(kept, rank=2, trainable=("layers.0.input_layernorm",))
    with pytest.raises(ValueError, match="layers.0.input_layernorm.weight"):
        save_gguf_lora(kept, tmp_path / "b.gguf")


def test_loading_an_adapter_leaves_only_the_adapters_trainable(tmp_path):
    save_gguf_lora(_adapted(), tmp_path / "a.gguf")
    model = Llama(CFG, seed=7)
    load_gguf_lora(tmp_path / "a.gguf", model)
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    save_gguf_lora(model, tmp_path / "b.gguf")   # and it writes back


def test_an_embedding_adapter_goes_both_ways(tmp_path):
    model = Llama(CFG, seed=7)
    lora.apply(model, rank=3, alpha=6.0, targets=("embed_tokens", "v_proj"))
    rng = np.random.default_rng(4)
    for _, layer in lora.named_adapters(model):
        layer.lora_a.data[...] = rng.normal(0, 0.2, layer.lora_a.shape)
        layer.lora_b.data[...] = rng.normal(0, 0.2, layer.lora_b.shape)
    save_gguf_lora(model, tmp_path / "e.gguf")
    _, tensors = _read(tmp_path / "e.gguf")
    # llama.cpp's form: token_embd's A stays (vocab, rank), B is (dim, rank)
    assert tensors["token_embd.weight.lora_a"][2].shape == (CFG.vocab_size, 3)
    assert tensors["token_embd.weight.lora_b"][2].shape == (CFG.dim, 3)
    base = Llama(CFG, seed=7)
    load_gguf_lora(tmp_path / "e.gguf", base)
    ours, theirs = dict(lora.named_adapters(model)), dict(lora.named_adapters(base))
    for name, layer in ours.items():
        np.testing.assert_array_equal(layer.lora_a.data, theirs[name].lora_a.data)
        np.testing.assert_array_equal(layer.lora_b.data, theirs[name].lora_b.data)
    tokens = np.arange(12).reshape(1, 12)
    np.testing.assert_array_equal(base(tokens), model(tokens))


def test_a_position_embedding_adapter_is_refused_by_what_it_is(tmp_path):
    # llama.cpp adds GPT-2's position rows without adapters; wpe is not the head
    model = GPT2(GPT2Config(vocab_size=29, dim=16, n_layers=1, n_heads=4, max_seq_len=16))
    lora.apply(model, rank=2, targets=("wpe",))
    with pytest.raises(ValueError, match="'wpe', an embedding other than the token embedding"):
        save_gguf_lora(model, tmp_path / "t.gguf")
    assert not (tmp_path / "t.gguf").exists()


def test_an_embedding_adapter_on_a_tied_head_is_refused_for_llama_cpp(tmp_path):
    from ggmlopt.models import LlamaConfig as Config
    model = Llama(Config(vocab_size=29, dim=16, n_layers=1, n_heads=4, tie_embeddings=True))
    lora.apply(model, rank=2, targets=("embed_tokens",))
    with pytest.raises(ValueError, match="tied to the output head"):
        save_gguf_lora(model, tmp_path / "t.gguf")


def test_an_embedding_adapter_loaded_onto_a_tied_head_warns_what_llama_cpp_differs_in(tmp_path):
    # the file another model's save_gguf_lora writes (an untied head) loads onto a tied
    # one: ggmlopt adapts the embedding only, llama.cpp's tied head reads the same tensor
    from ggmlopt.models import LlamaConfig as Config
    untied = Llama(Config(vocab_size=29, dim=16, n_layers=1, n_heads=4), seed=0)
    lora.apply(untied, rank=2, targets=("embed_tokens",), seed=0)
    save_gguf_lora(untied, tmp_path / "e.gguf")
    tied = Llama(Config(vocab_size=29, dim=16, n_layers=1, n_heads=4, tie_embeddings=True))
    with pytest.warns(UserWarning, match="ties to its output head.*llama.cpp applies it to "
                                         "the head's product too"):
        load_gguf_lora(tmp_path / "e.gguf", tied)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_gguf_lora(tmp_path / "e.gguf",
                       Llama(Config(vocab_size=29, dim=16, n_layers=1, n_heads=4), seed=0))


def test_an_adapter_quantized_as_the_converter_writes_it_loads_dequantized(tmp_path):
    # convert_lora_to_gguf --outtype q8_0: the pairs whose rows hold whole blocks
    # (lora_a's input side) are Q8_0, the others F32; llama.cpp applies the
    # dequantized values, and so does load_gguf_lora
    cfg = LlamaConfig(vocab_size=29, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      max_seq_len=16)
    model = Llama(cfg, seed=7)
    lora.apply(model, rank=3, alpha=6.0, targets=("q_proj", "down_proj"), seed=0)
    for _, layer in lora.named_adapters(model):
        layer.lora_b.data[...] = np.random.default_rng(1).normal(0, 0.2, layer.lora_b.shape)
    save_gguf_lora(model, tmp_path / "f32.gguf")
    reader = gguf.GGUFReader(tmp_path / "f32.gguf")
    writer = gguf.GGUFWriter(tmp_path / "q8.gguf", "llama")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 6.0)
    want = {}
    for t in reader.tensors:
        data = np.array(t.data, np.float32).reshape(tuple(int(n) for n in t.shape[::-1]))
        if data.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            want[t.name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, data)
            want[t.name] = data
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert any(t.tensor_type.name == "Q8_0" for t in gguf.GGUFReader(tmp_path / "q8.gguf").tensors)
    fresh = Llama(cfg, seed=7)
    load_gguf_lora(tmp_path / "q8.gguf", fresh)
    down = fresh.layers[0].mlp.down_proj
    np.testing.assert_array_equal(down.lora_a.data, want["blk.0.ffn_down.weight.lora_a"].T)
    np.testing.assert_array_equal(down.lora_b.data, want["blk.0.ffn_down.weight.lora_b"].T)
    assert not np.array_equal(down.lora_a.data, model.layers[0].mlp.down_proj.lora_a.data)
    np.testing.assert_allclose(down.lora_a.data, model.layers[0].mlp.down_proj.lora_a.data,
                               atol=np.abs(down.lora_a.data).max() / 127)
