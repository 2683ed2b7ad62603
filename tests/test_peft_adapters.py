"""LoRA adapters as PEFT saves them (save_peft, load_peft): an adapter ggmlopt
wrote is what peft.PeftModel.from_pretrained puts on the transformers model of
the same checkpoint, and an adapter PEFT wrote (its rank and alpha patterns,
rsLoRA, modules_to_save, an embedding adapter) is the one ggmlopt computes:
the same logits, on every family's layout."""
import json

import numpy as np
import pytest

from ggmlopt import lora
from ggmlopt.models import GPT2, GPT2Config, Llama, LlamaConfig, Phi3, Phi3Config

pytest.importorskip("safetensors")


def _randomise_adapters(model, seed):
    rng = np.random.default_rng(seed)
    for _, p in model.named_parameters():
        if p.requires_grad:
            p.data[...] = rng.normal(size=p.shape) * 0.2


FAMILIES = {
    "llama": (lambda: Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=2, n_heads=4,
                                        n_kv_heads=2, ffn_dim=48, max_seq_len=64), seed=0),
              "LlamaForCausalLM", ("q_proj", "v_proj", "down_proj", "embed_tokens"),
              ("norm",)),
    "phi3": (lambda: Phi3(Phi3Config(vocab_size=67, dim=32, n_layers=2, n_heads=4,
                                     n_kv_heads=2, ffn_dim=48, max_seq_len=64), seed=0),
             "Phi3ForCausalLM", ("qkv_proj", "gate_up_proj"), ("lm_head",)),
    "gpt2": (lambda: GPT2(GPT2Config(vocab_size=67, dim=32, n_layers=2, n_heads=4,
                                     max_seq_len=64), seed=0),
             "GPT2LMHeadModel", ("c_attn", "c_proj"), ()),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ours_loads_in_peft_and_back(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from ggmlopt.io import load_hf, load_peft, save_hf, save_peft
    make, hf_class, targets, trainable = FAMILIES[family]
    model = make()
    save_hf(model, tmp_path / "base")
    lora.apply(model, rank=4, alpha=8.0, targets=targets, trainable=trainable, seed=1)
    _randomise_adapters(model, 2)
    save_peft(model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    hf = getattr(transformers, hf_class).from_pretrained(tmp_path / "base").eval()
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    tokens = np.random.default_rng(3).integers(0, 67, (2, 12))
    want = peft_model(torch.tensor(tokens)).logits.detach().numpy()
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())
    again = load_hf(tmp_path / "base")
    load_peft(tmp_path / "adapter", again)
    np.testing.assert_array_equal(again.forward(tokens), model.forward(tokens))
    assert lora.trainable_parameters(again) == lora.trainable_parameters(model)


def test_an_adapter_peft_trained_is_the_one_ggmlopt_computes(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from ggmlopt.io import load_hf, load_peft, save_hf
    save_hf(FAMILIES["llama"][0](), tmp_path / "base")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    cfg = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "up_proj",
                                                                "embed_tokens"],
                          rank_pattern={"up_proj": 2}, alpha_pattern={"k_proj": 4},
                          use_rslora=True, modules_to_save=["lm_head"], lora_dropout=0.1)
    peft_model = peft.get_peft_model(hf, cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(tmp_path / "adapter")
    peft_model.eval()
    model = load_hf(tmp_path / "base")
    adapters = dict(load_peft(tmp_path / "adapter", model))
    assert adapters["layers.0.mlp.up_proj"].rank == 2
    assert adapters["layers.0.self_attn.q_proj"].lora_dropout.p == pytest.approx(0.1)
    tokens = np.random.default_rng(4).integers(0, 67, (2, 12))
    want = peft_model(torch.tensor(tokens)).logits.detach().numpy()
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())
    assert model.lm_head.weight.requires_grad   # modules_to_save trains on
    assert not model.layers[0].mlp.down_proj.weight.requires_grad


def test_refusals_leave_the_model_unchanged(tmp_path):
    from ggmlopt.io import load_peft, save_peft
    model = FAMILIES["llama"][0]()
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_peft(model, tmp_path / "none")
    other = FAMILIES["llama"][0]()
    lora.apply(other, rank=4, targets=("q_proj",), seed=0)
    save_peft(other, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    for edit, match in [({"use_dora": True}, "DoRA"), ({"peft_type": "IA3"}, "only LORA"),
                        ({"bias": "all"}, "trained biases"), ({"r": 8}, "rank 4, the config")]:
        (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, **edit}))
        with pytest.raises(ValueError, match=match):
            load_peft(tmp_path / "a", model)
        assert not lora.named_adapters(model)
    small = Llama(LlamaConfig(vocab_size=67, dim=16, n_layers=2, n_heads=4, max_seq_len=64))
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="the model's layer needs"):
        load_peft(tmp_path / "a", small)
    assert not lora.named_adapters(small)
    with pytest.raises(FileNotFoundError):
        load_peft(tmp_path / "missing", model)
    # an interrupted download of the adapter's weights
    weights = tmp_path / "a" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(ValueError, match="adapter_model.safetensors: not a valid safetensors"):
        load_peft(tmp_path / "a", model)
    assert not lora.named_adapters(model)
