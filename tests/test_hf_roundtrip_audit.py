"""Hugging Face checkpoints both ways, family by family: save_hf's directory
computes in transformers as the model does (also after LoRA and merge, and
keeps where generation stops), load_hf reads what save_pretrained writes (bf16,
f16, sharded, kept types) as transformers computes it in float32, the tokenizer
files of llama.cpp's vocabularies encode as AutoTokenizer does, and what
ggmlopt does not implement is refused by name."""
import json
import os
import warnings

import numpy as np
import pytest
from hf_oracle import randomised

import ggmlopt as go
from ggmlopt.io import load_hf, save_hf
from ggmlopt.models import (
    GPT2,
    Gemma3,
    Gemma3Config,
    GPT2Config,
    Llama,
    LlamaConfig,
    Mistral,
    MistralConfig,
    Phi3,
    Phi3Config,
    Qwen2,
    Qwen2Config,
    Qwen3,
    Qwen3Config,
    SmolLM3,
    SmolLM3Config,
)

pytest.importorskip("safetensors")

V = 67
SMALL = {"vocab_size": V, "dim": 32, "n_heads": 4, "ffn_dim": 48, "max_seq_len": 64}
MODELS = {
    "llama": lambda: Llama(LlamaConfig(n_layers=2, n_kv_heads=2, **SMALL)),
    "llama-tied": lambda: Llama(LlamaConfig(n_layers=2, n_kv_heads=2, tie_embeddings=True,
                                            **SMALL)),
    "mistral": lambda: Mistral(MistralConfig(n_layers=2, n_kv_heads=1, sliding_window=5,
                                             **SMALL)),
    "qwen2": lambda: Qwen2(Qwen2Config(n_layers=2, n_kv_heads=2, **SMALL)),
    "qwen3": lambda: Qwen3(Qwen3Config(n_layers=2, n_kv_heads=2, head_dim=12, **SMALL)),
    "smollm3": lambda: SmolLM3(SmolLM3Config(n_layers=5, n_kv_heads=2, **SMALL)),
    "gemma3": lambda: Gemma3(Gemma3Config(n_layers=7, n_kv_heads=2, head_dim=12,
                                          query_pre_attn_scalar=20.0, sliding_window=5,
                                          **SMALL)),
    "phi3": lambda: Phi3(Phi3Config(n_layers=2, n_kv_heads=2, sliding_window=6, **SMALL)),
    "gpt2": lambda: GPT2(GPT2Config(vocab_size=V, dim=32, n_layers=2, n_heads=4,
                                    max_seq_len=64)),
}
TOKENS = np.random.default_rng(0).integers(0, V, (2, 20))


def _assert_logits(got, want):
    # the oracle's bound (DESIGN 6): 1e-4 of the logits' scale, float32 rounding
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def _hf_logits(directory, **kw):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return hf(torch.tensor(TOKENS)).logits.float().numpy(), hf


@pytest.mark.parametrize("family", list(MODELS))
def test_save_hf_gives_transformers_the_same_model_and_config(tmp_path, family):
    model = randomised(MODELS[family](), 1)
    save_hf(model, tmp_path)
    want, hf = _hf_logits(tmp_path)
    _assert_logits(model.forward(TOKENS), want)
    config = json.loads((tmp_path / "config.json").read_text())
    fam = go.models.registry.family_of(model)
    assert config["model_type"] == fam.hf_model_type
    assert config["architectures"] == [fam.hf_architecture] == [type(hf).__name__]
    assert str(hf.config.dtype) == "torch.float32"
    assert hf.config.tie_word_embeddings == (model.lm_head is None)
    np.testing.assert_array_equal(load_hf(tmp_path).forward(TOKENS), model.forward(TOKENS))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "phi3", "gpt2"])
def test_lora_then_merge_then_save_hf_computes_the_adapted_model(tmp_path, family):
    model = randomised(MODELS[family](), 1)
    go.lora.apply(model, rank=4, alpha=8, targets="all-linear")
    rng = np.random.default_rng(5)
    for name, p in model.named_parameters():
        if "lora_B" in name:   # B starts at zero: a trained adapter's is not
            p.data[...] = rng.normal(0, 0.1, p.shape)
    adapted = model.forward(TOKENS).copy()
    go.lora.merge(model)
    save_hf(model, tmp_path)
    _assert_logits(adapted, _hf_logits(tmp_path)[0])


def test_save_hf_keeps_the_ids_a_loaded_checkpoint_stops_at(tmp_path):
    """load_hf then save_hf without a tokenizer: the checkpoint's eos ids were
    dropped (no generation_config.json), so transformers' generate never
    stopped and load_hf of the copy had no eog_ids."""
    transformers = pytest.importorskip("transformers")
    model = randomised(MODELS["llama"](), 1)
    save_hf(model, tmp_path / "src")
    (tmp_path / "src" / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 7, "eos_token_id": [9, 11]}))
    loaded = load_hf(tmp_path / "src")
    assert loaded.eog_ids == {9, 11}
    save_hf(loaded, tmp_path / "out")
    assert load_hf(tmp_path / "out").eog_ids == {9, 11}
    gen = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert gen.eos_token_id == [9, 11]
    # a model with no such ids writes none, and its config.json no LlamaConfig
    # defaults (bos 1, eos 2: another vocabulary's) for generate to stop at
    save_hf(model, tmp_path / "fresh")
    assert not (tmp_path / "fresh" / "generation_config.json").exists()
    for family, make in MODELS.items():   # (GPT2Config's default: 50256)
        save_hf(randomised(make(), 1), tmp_path / family)
        config = transformers.AutoConfig.from_pretrained(tmp_path / family)
        assert (family, config.bos_token_id, config.eos_token_id) == (family, None, None)


TRANSFORMERS_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"sliding_window": 7}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}),
    "smollm3": ("SmolLM3Config", {"pad_token_id": None, "bos_token_id": None,
                                  "eos_token_id": None}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 6,
                                    "query_pre_attn_scalar": 16}),
    "phi3": ("Phi3Config", {"pad_token_id": None, "bos_token_id": None,
                            "eos_token_id": None}),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", list(TRANSFORMERS_CONFIGS))
def test_load_hf_reads_a_sharded_half_precision_save_pretrained(tmp_path, family, dtype):
    """transformers' save_pretrained in bf16 / f16, in many shards (a tied head
    absent from the files): load_hf, widened or kept, computes what transformers
    computes in float32 on the same (upcast) weights."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    name, extra = TRANSFORMERS_CONFIGS[family]
    config = getattr(transformers, name)(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
        num_hidden_layers=4 if family == "smollm3" else 2, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0, 0.2)
    hf.to(getattr(torch, dtype)).save_pretrained(tmp_path, max_shard_size="4KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 2
    want, _ = _hf_logits(tmp_path, dtype=torch.float32)
    for keep in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the families' notes on dropout and windows
            model = load_hf(tmp_path, keep_types=keep)
        _assert_logits(model.forward(TOKENS), want)


def test_a_kept_model_is_refused_by_save_hf_naming_keep_types(tmp_path):
    model = randomised(MODELS["qwen2"](), 1)
    save_hf(model, tmp_path / "src")
    kept = load_hf(tmp_path / "src", keep_types=True)
    with pytest.raises(ValueError, match="keep_types=False"):
        save_hf(kept, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _edited_copy(tmp_path, config_edit=None, tensors_edit=None):
    from safetensors.numpy import load_file, save_file
    model = randomised(MODELS["llama"](), 1)
    save_hf(model, tmp_path)
    if config_edit:
        config = json.loads((tmp_path / "config.json").read_text())
        config_edit(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
    if tensors_edit:
        tensors = load_file(tmp_path / "model.safetensors")
        tensors_edit(tensors)
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


@pytest.mark.parametrize("config_edit, tensors_edit, error, match", [
    (lambda c: c.update(quantization_config={"quant_method": "bitsandbytes",
                                             "load_in_4bit": True}),
     None, ValueError, "quantization_config"),
    (lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}),
     None, ValueError, "quantization_config"),
    (lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}),
     None, ValueError, "quantization_config"),
    (None, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias":
                               np.zeros(32, np.float32)}), ValueError, "q_proj.bias"),
    (None, lambda t: t.update({"lm_head.bias": np.zeros(V, np.float32)}), ValueError,
     "lm_head.bias"),
    (None, lambda t: t.update({"model.layers.0.mlp.up_proj.weight":
                               np.zeros((48, 32), np.int8)}), TypeError, "I8"),
    (None, lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale_inv":
                               np.ones(1, np.float32)}), ValueError, "weight_scale_inv"),
    (lambda c: c.update(mlp_bias=True), None, ValueError, "mlp_bias"),
    (lambda c: c.update(base_model_tp_plan={"layers.*.mlp": "colwise"}), None, ValueError,
     "base_model_tp_plan"),
])
def test_what_is_not_implemented_is_refused_by_name(tmp_path, config_edit, tensors_edit,
                                                     error, match):
    directory = _edited_copy(tmp_path, config_edit, tensors_edit)
    with pytest.raises(error, match=match):
        load_hf(directory)


SRC = "/work/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp/models"
ADVERSARIAL = [
    "", " ", "  ", "\n", "\n\n\n", " \n \t ", "Hello  world\n\nBye ", "emoji 🦙🤖👩‍👩‍👧 ok",
    "\u00a0nbsp", "\x00nul\x01", "\ufffd", "日本語のテキスト", "ﬁ ligature Ⅻ", "e\u0301",
    "<s>", "</s>", "<s><s>", " <s> ", "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|><|endoftext|>", "<start_of_turn>user\nhi<end_of_turn>\n",
    "<|user|>\nhi<|end|>\n<|assistant|>", "<unk>", "<pad>", "<bos>hello<eos>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "\u200b zero width", "a\r\nb", "    indented\n\tdef f():", "\U0010ffff",
    "don't I'll WE'LL", "12345678901234",
]


@pytest.mark.parametrize("vocab", ["llama-bpe", "llama-spm", "qwen2", "phi-3", "gemma-4"])
def test_tokenizer_files_of_llama_cpp_vocabularies_encode_as_auto_tokenizer(tmp_path, vocab):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    pytest.importorskip("gguf")
    path = os.path.join(SRC, f"ggml-vocab-{vocab}.gguf")
    if not os.path.isfile(path):
        pytest.skip("llama.cpp's source is not here")
    from ggmlopt.io import load_gguf_tokenizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = load_gguf_tokenizer(path)
    save_hf(Llama(LlamaConfig(vocab_size=tok.vocab_size, dim=16, n_layers=1, n_heads=2,
                              max_seq_len=32)), tmp_path, tokenizer=tok)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    bos = [tok.bos_id] if tok.add_bos else []
    for text in ADVERSARIAL:
        ours = tok.encode(text).tolist()
        assert auto(text)["input_ids"] == bos + ours, text
        assert auto.decode(ours) == tok.decode(np.asarray(ours, np.int32)), text
    assert (auto.bos_token_id, auto.eos_token_id) == (tok.bos_id, tok.eos_id)
    assert auto.pad_token_id == getattr(tok, "pad_id", None)
    assert (auto.chat_template or None) == (tok.chat_template or None)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    assert set(eos if isinstance(eos, list) else [eos]) == set(tok.eog_ids)
    if tok.chat_template:
        chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi 🦙\n there"},
                {"role": "assistant", "content": " Yo "}, {"role": "user", "content": "again"}]
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == text
