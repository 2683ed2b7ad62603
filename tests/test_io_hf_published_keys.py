"""Keys that published config.json files carry are read as transformers reads
them: bookkeeping transformers never reads loads (the same model as without
it), a window transformers applies on no layer loads, and what would compute
another model than transformers' is refused, never dropped.

- SmolLM3-3B's file: pretraining_tp and max_window_layers (SmolLM3 reads neither);
- SmolLM2's llama files: nanotron's is_llama_config and rope_interleaved (false);
- distilgpt2 and 4.x re-saves: _num_labels, gradient_checkpointing, and gpt2's
  n_ctx (an old name transformers keeps, whatever its value, and never reads);
- the published GPT-2 files' tensor names, without the base model's
  "transformer." prefix, and their attention-mask buffers;
- Qwen2/Qwen3: use_sliding_window with max_window_layers at or past the last
  layer (transformers lays every layer out as full attention);
- a GPT-2 file whose lm_head.weight differs from its token embedding
  (transformers computes with that head; ggmlopt's GPT-2 has none).
"""
import json
import warnings

import numpy as np
import pytest

from ggmlopt.models import (
    GPT2,
    Gemma3,
    Gemma3Config,
    GPT2Config,
    Llama,
    LlamaConfig,
    Qwen2,
    Qwen2Config,
    Qwen3,
    Qwen3Config,
    SmolLM3,
    SmolLM3Config,
)

pytest.importorskip("safetensors")
from ggmlopt.io import load_hf, save_hf

TOKENS = np.random.default_rng(0).integers(0, 61, (1, 19))


def saved(model, path):
    save_hf(model, path)
    return json.loads((path / "config.json").read_text())


def logits_with(path, cfg, edit):
    (path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # GPT-2's dropout rates
        return np.asarray(load_hf(path).forward(TOKENS))


CASES = {
    "smollm3": (lambda: SmolLM3(SmolLM3Config(vocab_size=61, dim=16, n_layers=2, n_heads=2),
                                seed=0), {"pretraining_tp": 2, "max_window_layers": 28}),
    "llama": (lambda: Llama(LlamaConfig(vocab_size=61, dim=16, n_layers=2, n_heads=2), seed=0),
              {"is_llama_config": True, "rope_interleaved": False}),
    "gpt2": (lambda: GPT2(GPT2Config(vocab_size=61, dim=16, n_layers=2, n_heads=2,
                                     max_seq_len=32), seed=0),
             {"_num_labels": 1, "gradient_checkpointing": False, "n_ctx": 1024}),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_keys_transformers_never_reads_load_the_same_model(tmp_path, family):
    make, keys = CASES[family]
    cfg = saved(make(), tmp_path)
    plain = logits_with(tmp_path, cfg, {})
    np.testing.assert_array_equal(logits_with(tmp_path, cfg, keys), plain)


@pytest.mark.parametrize("make", [
    CASES["llama"][0],
    lambda: Gemma3(Gemma3Config(vocab_size=61, dim=16, n_layers=2, n_heads=2, head_dim=8),
                   seed=0)])
def test_an_interleaved_rotary_embedding_is_refused(tmp_path, make):
    cfg = saved(make(), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_interleaved": True}))
    with pytest.raises(ValueError, match="rope_interleaved"):
        load_hf(tmp_path)


@pytest.mark.parametrize("make", [
    lambda: Qwen2(Qwen2Config(vocab_size=61, dim=16, n_layers=2, n_heads=2), seed=0),
    lambda: Qwen3(Qwen3Config(vocab_size=61, dim=16, n_layers=2, n_heads=2, head_dim=8),
                  seed=0)])
def test_a_window_on_no_layer_loads_and_one_on_some_layer_is_refused(tmp_path, make):
    cfg = saved(make(), tmp_path)
    plain = logits_with(tmp_path, cfg, {})
    for edit in ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
                 {"use_sliding_window": True},   # Qwen2Config's max_window_layers: 28
                 {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0}):
        np.testing.assert_array_equal(logits_with(tmp_path, cfg, edit), plain)
    for first in (0, 1):
        (tmp_path / "config.json").write_text(json.dumps(
            {**cfg, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": first}))
        with pytest.raises(ValueError, match=f"on layers \\[{first}"):
            load_hf(tmp_path)


def test_smollm3_s_window_slides_on_its_nope_layers_only(tmp_path):
    """transformers' SmolLM3 slides a window on the layers without RoPE
    (no_rope_layers 0); its default width is None."""
    cfg = saved(CASES["smollm3"][0](), tmp_path)
    plain = logits_with(tmp_path, cfg, {})
    for edit in ({"use_sliding_window": True},
                 {"use_sliding_window": True, "sliding_window": 8, "no_rope_layers": [1, 1]}):
        np.testing.assert_array_equal(logits_with(tmp_path, cfg, edit), plain)
    (tmp_path / "config.json").write_text(json.dumps(
        {**cfg, "use_sliding_window": True, "sliding_window": 8, "no_rope_layers": [1, 0]}))
    with pytest.raises(ValueError, match=r"on layers \[1\]"):
        load_hf(tmp_path)


def test_gpt2_s_own_differing_head_is_refused_and_a_copy_of_the_embedding_loads(tmp_path):
    from safetensors.numpy import load_file, save_file

    model = CASES["gpt2"][0]()
    save_hf(model, tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].copy()
    save_file(tensors, file, metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np.testing.assert_array_equal(np.asarray(load_hf(tmp_path).forward(TOKENS)),
                                      np.asarray(model.forward(TOKENS)))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 2
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight is not its token embedding"):
        load_hf(tmp_path)


def test_generation_stops_at_generation_config_s_eos_ids(tmp_path):
    """generation_config.json's eos_token_id list (Phi-3.5's [32007, 32001,
    32000], Llama 3's [128001, 128008, 128009]) is where transformers' generate
    stops: the model's eog_ids, and the tokenizer's, hold every id of it."""
    model = CASES["llama"][0]()
    save_hf(model, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 11]}))
    loaded = load_hf(tmp_path)
    assert loaded.eog_ids == {7, 11}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert load_hf(tmp_path).eog_ids == {9}
    (tmp_path / "generation_config.json").unlink()
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [3, 4]}))
    assert load_hf(tmp_path).eog_ids == {3, 4}   # config.json's, without the file
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        load_hf(tmp_path)


def test_the_published_gpt2_layout_without_the_base_prefix_loads(tmp_path):
    """openai-community/gpt2's model.safetensors names its tensors wte.weight,
    h.0.attn.c_attn.weight, ... (no "transformer."), with h.N.attn.bias mask
    buffers: transformers reads them as its base model's; so does load_hf."""
    from safetensors.numpy import load_file, save_file
    model = CASES["gpt2"][0]()
    saved(model, tmp_path)
    want = np.asarray(load_hf(tmp_path).forward(TOKENS))
    weights = tmp_path / "model.safetensors"
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(weights).items()}
    assert "wte.weight" in tensors
    mask = np.tril(np.ones((32, 32), np.float32))[None, None]
    tensors.update({f"h.{i}.attn.bias": mask for i in range(2)})
    save_file(tensors, weights)
    np.testing.assert_array_equal(np.asarray(load_hf(tmp_path).forward(TOKENS)), want)

