"""Config fields a checkpoint's config.json may leave out read as transformers
reads them (its config class's defaults), found by an audit of every family's
transformers config class against load_hf.

- num_key_value_heads: transformers' default is the family's own (Mistral 8,
  Qwen2 and Qwen3 32, SmolLM3 and Gemma 3 4), not one per query head
  (Llama's and Phi-3's None): a config without the key loads with those
  key/value heads and transformers' logits;
- use_mrope (Qwen2-VL's key, false in DeepSeek-R1-Distill-Qwen's files, never
  read by transformers' Qwen2): false loads, true is refused by name;
- bias keys a family's transformers class never reads (Mistral's attention_bias
  and mlp_bias, Qwen2's, Qwen3's mlp_bias) load as transformers loads them: the
  same model whatever they say.
"""
import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from ggmlopt.io import load_hf

SMALL = {"vocab_size": 67, "intermediate_size": 40, "num_hidden_layers": 2,
         "max_position_embeddings": 64}
# (class, config class, fields): num_attention_heads a multiple of the family's
# num_key_value_heads default, which the file leaves out
KV_DEFAULTS = {
    "mistral": ("MistralForCausalLM", "MistralConfig", 8,
                {"hidden_size": 64, "num_attention_heads": 16}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", 32,
              {"hidden_size": 128, "num_attention_heads": 64}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", 32,
              {"hidden_size": 32, "num_attention_heads": 64, "head_dim": 4}),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", 4,
                {"hidden_size": 32, "num_attention_heads": 8, "pad_token_id": None}),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", 4,
               {"hidden_size": 32, "num_attention_heads": 8, "head_dim": 8,
                "query_pre_attn_scalar": 8, "sliding_window": 5}),
}


def _logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("family", sorted(KV_DEFAULTS))
def test_a_config_without_num_key_value_heads_takes_the_family_s_default(tmp_path, family):
    cls, config_cls, kv, fields = KV_DEFAULTS[family]
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(getattr(transformers, config_cls)(
        **SMALL, **fields, num_key_value_heads=kv)).eval()
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    del config["num_key_value_heads"]
    path.write_text(json.dumps(config))
    # transformers reads the file with its default: the same model
    assert getattr(transformers, config_cls).from_pretrained(tmp_path).num_key_value_heads == kv
    model = load_hf(tmp_path)
    assert model.config.n_kv_heads == kv
    tokens = np.random.default_rng(0).integers(0, 67, (2, 11))
    want = _logits(hf, tokens)
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())


def test_qwen2_s_use_mrope_false_loads_and_true_is_refused(tmp_path):
    # DeepSeek-R1-Distill-Qwen's config.json carries "use_mrope": false (Qwen2-VL's key,
    # never read by transformers' Qwen2): it was refused as an unknown key
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **SMALL, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)).eval()
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "use_mrope": False}))
    tokens = np.random.default_rng(1).integers(0, 67, (2, 9))
    want = _logits(hf, tokens)
    np.testing.assert_allclose(load_hf(tmp_path).forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())
    path.write_text(json.dumps({**config, "use_mrope": True}))
    with pytest.raises(ValueError, match="use_mrope"):
        load_hf(tmp_path)


@pytest.mark.parametrize("cls,config_cls,fields,extra", [
    ("MistralForCausalLM", "MistralConfig", {}, {"attention_bias": True, "mlp_bias": False}),
    ("Qwen2ForCausalLM", "Qwen2Config", {}, {"attention_bias": False, "mlp_bias": True}),
    ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 8}, {"mlp_bias": True}),
])
def test_bias_keys_transformers_never_reads_change_nothing(tmp_path, cls, config_cls, fields,
                                                           extra):
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(getattr(transformers, config_cls)(
        **SMALL, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, **fields)).eval()
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    # transformers builds the same layers from the file (no bias appears)
    again = getattr(transformers, cls).from_pretrained(tmp_path).eval()
    assert {n for n, _ in again.named_parameters()} == {n for n, _ in hf.named_parameters()}
    tokens = np.random.default_rng(2).integers(0, 67, (2, 9))
    want = _logits(again, tokens)
    np.testing.assert_allclose(load_hf(tmp_path).forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())


def test_phi4_mini_s_own_keys_load_at_their_values_and_others_are_refused(tmp_path):
    # Phi-4-mini's config.json (model_type phi3) carries full_attn_mod, interpolate_factor
    # and lm_head_bias for its own code; transformers' Phi3 never reads them
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **SMALL, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        pad_token_id=0)).eval()
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    phi4 = {"full_attn_mod": 1, "interpolate_factor": 1, "lm_head_bias": False}
    path.write_text(json.dumps({**config, **phi4}))
    tokens = np.random.default_rng(3).integers(0, 67, (2, 9))
    want = _logits(hf, tokens)
    np.testing.assert_allclose(load_hf(tmp_path).forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())
    for key, value in [("full_attn_mod", 2), ("interpolate_factor", 2), ("lm_head_bias", True),
                       ("lm_head_bias", 0)]:
        path.write_text(json.dumps({**config, **phi4, key: value}))
        with pytest.raises(ValueError, match=key):
            load_hf(tmp_path)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_fractional_query_pre_attn_scalar_is_refused_as_transformers_refuses_it(
        tmp_path, family):
    from ggmlopt.io import load_hf, save_hf
    from ggmlopt.models import Gemma2, Gemma2Config, Gemma3, Gemma3Config
    cls, cfg_cls = (Gemma2, Gemma2Config) if family == "gemma2" else (Gemma3, Gemma3Config)
    save_hf(cls(cfg_cls(vocab_size=61, dim=16, n_layers=2, n_heads=2, head_dim=8), seed=0),
            tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "query_pre_attn_scalar": 13.5}))
    with pytest.raises(ValueError, match="query_pre_attn_scalar: expected an int"):
        load_hf(tmp_path)


def test_a_gemma3_with_local_layers_and_no_window_is_refused_both_ways(tmp_path):
    """transformers' Gemma 3 finds no window for its sliding layers and fails: a
    config.json of them is refused, and save_hf writes none."""
    from ggmlopt.io import load_hf, save_hf
    from ggmlopt.models import Gemma3, Gemma3Config
    model = Gemma3(Gemma3Config(vocab_size=61, dim=16, n_layers=2, n_heads=2, head_dim=8,
                                sliding_window=4, sliding_layers=(True, False)), seed=0)
    save_hf(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
    with pytest.raises(ValueError, match="sliding_window: null, with sliding_attention"):
        load_hf(tmp_path)
    windowless = Gemma3(Gemma3Config(vocab_size=61, dim=16, n_layers=2, n_heads=2, head_dim=8,
                                     sliding_window=None, sliding_layers=(True, False)), seed=0)
    with pytest.raises(ValueError, match="local layers have no window"):
        save_hf(windowless, tmp_path / "other")


def test_a_gemma3_without_a_window_saves_one_transformers_can_run(tmp_path):
    """Every layer global and no window (what a gemma3 GGUF without one loads as):
    config.json's sliding_window was null, where transformers' Gemma 3 stops; a
    window no layer reads is written, and the model loads back the same."""
    from ggmlopt.io import load_hf, save_hf
    from ggmlopt.models import Gemma3, Gemma3Config
    model = Gemma3(Gemma3Config(vocab_size=61, dim=16, n_layers=2, n_heads=2, head_dim=8,
                                sliding_window=None, sliding_layers=(False, False)), seed=0)
    save_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["sliding_window"] is not None
    ids = np.arange(12)[None] % 61
    np.testing.assert_array_equal(load_hf(tmp_path)(ids), model(ids))


def test_a_mismatch_names_the_file_s_own_tensors(tmp_path):
    """The base prefix is added only where it makes the names the model's: a
    mismatch names the tensors as the file has them."""
    from safetensors.numpy import load_file, save_file

    from ggmlopt.io import load_hf, save_hf
    from ggmlopt.models import Llama, LlamaConfig
    save_hf(Llama(LlamaConfig(vocab_size=61, dim=16, n_layers=1, n_heads=2), seed=0), tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = {k.replace("model.", "transformer.", 1): v for k, v in load_file(weights).items()}
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=r"unexpected \['transformer\.embed_tokens\.weight'"):
        load_hf(tmp_path)
