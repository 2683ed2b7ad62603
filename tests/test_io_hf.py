"""Hugging Face checkpoints: save_hf writes what transformers' from_pretrained
loads with no missing or unexpected keys and the same logits; load_hf reads it
back (bit for bit) and reads what save_pretrained writes."""
import json

import numpy as np
import pytest

from ggmlopt.io import load_hf, save_hf
from ggmlopt.models import GPT2, GPT2Config, Llama, LlamaConfig

pytest.importorskip("safetensors")

MODELS = {
    "llama": lambda: Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=2, n_heads=4,
                                       n_kv_heads=2, ffn_dim=48, max_seq_len=64,
                                       norm_eps=1e-6, rope_base=5000.0), seed=1),
    "llama-tied": lambda: Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=1, n_heads=2,
                                            max_seq_len=64, tie_embeddings=True), seed=2),
    "gpt2": lambda: GPT2(GPT2Config(vocab_size=67, dim=32, n_layers=2, n_heads=4,
                                    max_seq_len=64), seed=3),
}
TOKENS = np.random.default_rng(0).integers(0, 67, (2, 23))


@pytest.mark.parametrize("arch", list(MODELS))
def test_round_trip_is_bit_exact(tmp_path, arch):
    model = MODELS[arch]()
    save_hf(model, tmp_path / "ckpt")
    back = load_hf(tmp_path / "ckpt")
    assert type(back) is type(model) and back.config == model.config
    for (n, p), (m, q) in zip(model.named_parameters(), back.named_parameters()):
        assert n == m
        np.testing.assert_array_equal(p.data, q.data)
    np.testing.assert_array_equal(back(TOKENS), model(TOKENS))


@pytest.mark.parametrize("arch", list(MODELS))
def test_transformers_loads_it_with_the_same_logits(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = MODELS[arch]()
    save_hf(model, tmp_path)
    cls = transformers.GPT2LMHeadModel if arch == "gpt2" else transformers.LlamaForCausalLM
    hf, info = cls.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        want = hf(torch.tensor(TOKENS)).logits.numpy()
    got = model(TOKENS)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_load_hf_reads_what_save_pretrained_writes(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=40,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=1, max_position_embeddings=64)
        hf = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=67, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=64)
        hf = transformers.GPT2LMHeadModel(cfg)
    hf.eval()
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    with torch.no_grad():
        want = hf(torch.tensor(TOKENS)).logits.numpy()
    np.testing.assert_allclose(model(TOKENS), want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_bad_directories_are_refused(tmp_path):
    model = MODELS["llama"]()
    save_hf(model, tmp_path / "ok")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_hf(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf(tmp_path / "empty")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    with pytest.raises(ValueError, match="model_type .falcon. is not supported"):
        load_hf(tmp_path / "ok")
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 50}))
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight' has shape \(48, 32\)"):
        load_hf(tmp_path / "ok")
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"missing \['model.layers.2"):
        load_hf(tmp_path / "ok")
    with pytest.raises(TypeError, match="expected a ggmlopt.models.Llama or GPT2"):
        save_hf(object(), tmp_path / "x")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        save_hf(model, tmp_path / "file")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "smollm3", "mistral", "phi3"])
def test_keys_a_config_leaves_out_take_transformers_defaults(family):
    # a config.json without rope_theta, max_position_embeddings, rms_norm_eps (and
    # head_dim) reads as transformers reads it, not with another family's defaults
    transformers = pytest.importorskip("transformers")
    from ggmlopt.io.hf_format import _model_from_config  # the config reader alone
    hf = {"model_type": family, "vocab_size": 64, "hidden_size": 64,
          "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
          "num_key_value_heads": 1}
    theirs = transformers.AutoConfig.for_model(**hf)
    ours = _model_from_config(dict(hf), "config.json").config
    rope = getattr(theirs, "rope_parameters", None) or {}
    assert ours.rope_base == rope.get("rope_theta", getattr(theirs, "rope_theta", None))
    assert ours.max_seq_len == theirs.max_position_embeddings
    assert ours.norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-7)
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or 64 // 2)
    assert ours.tie_embeddings == theirs.tie_word_embeddings


def _rewrite_safetensors(path, tensors, dtype="F32"):
    """Write {name: float32 array} as a safetensors file of dtype F32 or BF16 (the
    bfloat16 bits rounded to nearest even, as torch rounds), without torch."""
    header, chunks, at = {}, [], 0
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, np.float32)
        if dtype == "BF16":
            bits = array.view(np.uint32).astype(np.uint64)
            data = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()
        else:
            data = array.astype("<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [at, at + len(data)]}
        chunks.append(data)
        at += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(chunks))


def _file_tensors(path):
    st = pytest.importorskip("safetensors.numpy")
    return st.load_file(str(path))


def test_a_bfloat16_checkpoint_loads_widened_to_float32(tmp_path):
    # most published checkpoints (SmolLM2, Llama 3, Qwen2.5) are stored in bfloat16
    model = MODELS["llama"]()
    save_hf(model, tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = _file_tensors(path)
    _rewrite_safetensors(path, tensors, "BF16")
    widened, kept = load_hf(tmp_path), load_hf(tmp_path, keep_types=True)
    for name, p in widened.named_parameters():
        assert p.data.dtype == np.float32
    # each value is the float32 of its bfloat16 (a tenth of a percent off the source)
    w = widened.layers[0].mlp.up_proj.weight.data
    src = tensors["model.layers.0.mlp.up_proj.weight"].T
    assert np.all(w.view(np.uint32) & 0xFFFF == 0)
    np.testing.assert_allclose(w, src, rtol=2.0 ** -8, atol=0)
    a, b = widened(TOKENS), kept(TOKENS)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(a).max())


def test_a_tied_config_with_a_head_of_its_own_loads_that_head(tmp_path):
    # transformers does not tie an lm_head.weight that differs from the embedding
    model = MODELS["llama-tied"]()
    save_hf(model, tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = _file_tensors(path)
    embedding = tensors["model.embed_tokens.weight"]
    head = np.random.default_rng(5).normal(0, 0.02, embedding.shape).astype(np.float32)
    _rewrite_safetensors(path, {**tensors, "lm_head.weight": head})
    with pytest.warns(UserWarning, match="not its token embedding; loaded untied"):
        untied = load_hf(tmp_path)
    assert not untied.config.tie_embeddings and untied.lm_head is not None
    np.testing.assert_array_equal(untied.lm_head.weight.data, head.T)
    np.testing.assert_array_equal(untied.embed_tokens.weight.data, embedding)
    with pytest.warns(UserWarning, match="loaded untied"):
        kept = load_hf(tmp_path, keep_types=True)
    np.testing.assert_allclose(kept(TOKENS), untied(TOKENS), rtol=0,
                               atol=1e-5 * np.abs(untied(TOKENS)).max())
    # the same values as the embedding: tied, as written
    _rewrite_safetensors(path, {**tensors, "lm_head.weight": embedding})
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tied = load_hf(tmp_path)
    assert tied.config.tie_embeddings and tied.lm_head is None
    np.testing.assert_array_equal(tied(TOKENS), model(TOKENS))



def test_a_head_that_differs_in_its_last_row_alone_is_its_own(tmp_path, monkeypatch):
    # the comparison runs a few rows at a time (both whole in float32 would hold four
    # times a kept model's bytes): a difference past the first rows still unties
    from ggmlopt.io import hf_format
    model = MODELS["llama-tied"]()
    save_hf(model, tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = _file_tensors(path)
    embedding = tensors["model.embed_tokens.weight"]
    head = embedding.copy()
    head[-1, -1] += 1.0
    _rewrite_safetensors(path, {**tensors, "lm_head.weight": head})
    monkeypatch.setattr(hf_format, "_COMPARE_BYTES", 1)   # one row a step
    with pytest.warns(UserWarning, match="loaded untied"):
        untied = load_hf(tmp_path, keep_types=True)
    assert not untied.config.tie_embeddings


def _sharded_llama(tmp_path, torch_dtype):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=40,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    hf = transformers.LlamaForCausalLM(cfg).eval().to(torch_dtype)
    # shards of a few tensors each, as save_pretrained cuts a 3B model's
    hf.save_pretrained(tmp_path, max_shard_size="8KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert not (tmp_path / "model.safetensors").exists()
    with torch.no_grad():
        want = hf.float()(torch.tensor(TOKENS)).logits.numpy()
    return want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sharded_checkpoint_loads_every_shard(tmp_path, dtype):
    torch = pytest.importorskip("torch")
    want = _sharded_llama(tmp_path, getattr(torch, dtype))
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    for keep_types in (False, True):
        got = load_hf(tmp_path, keep_types=keep_types)(TOKENS)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_broken_shards_are_refused_by_name(tmp_path):
    torch = pytest.importorskip("torch")
    _sharded_llama(tmp_path, torch.float32)
    index = tmp_path / "model.safetensors.index.json"
    text = index.read_text()
    shard = sorted(tmp_path.glob("model-*-of-*.safetensors"))[1]
    data = shard.read_bytes()
    # an interrupted download: the header is whole, the data is not
    shard.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=f"{shard.name}: truncated"):
        load_hf(tmp_path)
    shard.write_bytes(data)
    # a shard the index names but the directory lacks
    other = tmp_path / "elsewhere.safetensors"
    shard.rename(other)
    with pytest.raises(FileNotFoundError, match=f"{shard.name}: no such shard"):
        load_hf(tmp_path)
    other.rename(shard)
    # the same tensor in two shards: which one transformers reads is not ours to guess
    first = min(tmp_path.glob("model-*-of-*.safetensors"))
    st = pytest.importorskip("safetensors.numpy")
    st.save_file({**st.load_file(str(first)), **st.load_file(str(shard))}, str(first))
    with pytest.raises(ValueError, match="is in two of the checkpoint's files"):
        load_hf(tmp_path)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="not a safetensors index.*weight_map"):
        load_hf(tmp_path)
    index.write_text(text)


def test_an_image_text_checkpoint_says_what_it_is(tmp_path):
    # Gemma 3 4B and up are Gemma3ForConditionalGeneration: a gemma3_text inside
    save_hf(MODELS["llama"](), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {**config, "model_type": "gemma3_text"}, "vision_config": {}}))
    with pytest.raises(ValueError, match="'gemma3' is an image-text model "
                                         r"\(Gemma3ForConditionalGeneration\).*convert_hf_to_gguf"):
        load_hf(tmp_path)


def test_a_llama_with_qkv_biases_is_refused_not_written_without_them(tmp_path):
    # transformers' attention_bias would put a bias on o_proj as well, so a Llama
    # config cannot hold q/k/v biases alone: a config saying false loaded without them
    model = Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=1, n_heads=4, max_seq_len=64,
                              qkv_bias=True), seed=1)
    with pytest.raises(ValueError, match="qkv_bias.*no Hugging Face Llama config.*Qwen2"):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
