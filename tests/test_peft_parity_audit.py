"""LoRA against PEFT 0.21 on every family's small random transformers model:
the same adapters give the same logits and adapter gradients, save_peft's files
load in PEFT and merge as merge_and_unload does; and what PEFT would select or
refuse in an adapter config is selected or refused here too (a config key
never dropped, an adapter tensor PEFT ignores never applied)."""
import copy
import json
import warnings

import numpy as np
import pytest
from test_lora_config import FAMILIES, checkpoints  # noqa: F401 (a fixture)

from ggmlopt import lora

pytest.importorskip("safetensors")

# float32 rounding of a 3-layer model's logits and gradients, relative to their scale
_TOL = 1e-4


def _hf(model, name):
    from ggmlopt.models.registry import family_of
    return name if name.startswith("lm_head") else family_of(model).hf_prefix + name


def _hf_model(family, path):
    transformers = pytest.importorskip("transformers")
    return getattr(transformers, FAMILIES[family][1]).from_pretrained(path).eval()


def _pair(peft_model, name, ours):
    t = peft_model.base_model.model.get_submodule(name)
    if isinstance(ours, lora.LoRAEmbedding):
        return t.lora_embedding_A["default"], t.lora_embedding_B["default"]
    return t.lora_A["default"].weight, t.lora_B["default"].weight


def _close(got, want, what):
    scale = max(float(np.abs(want).max()), 1e-30)
    assert float(np.abs(got - want).max()) <= _TOL * scale, what


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_adapter_gradients_are_peft_s(checkpoints, family):  # noqa: F811
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from ggmlopt.io import load_hf
    path = checkpoints(family)
    embedding = "wte" if family == "gpt2" else "embed_tokens"
    # every Linear and the token embedding, rsLoRA's scaling, dropout (eval: none)
    targets = ["c_attn", "c_proj", "c_fc"] if family == "gpt2" else \
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if family == "phi3" else \
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = load_hf(path)
    lora.apply(model, rank=3, alpha=5.0, targets=targets + [embedding], use_rslora=True,
               dropout=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # (PEFT's tied-embedding advice)
        peft_model = peft.get_peft_model(_hf_model(family, path), peft.LoraConfig(
            r=3, lora_alpha=5, target_modules=targets + [embedding], use_rslora=True,
            lora_dropout=0.1))
    adapters = {_hf(model, n): a for n, a in lora.named_adapters(model)}
    assert set(adapters) == set(peft_model.targeted_module_names)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in peft_model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    for name, ours in adapters.items():
        a, b = _pair(peft_model, name, ours)
        ours.lora_a.data[...] = a.detach().numpy().T
        ours.lora_b.data[...] = b.detach().numpy().T
    tokens = np.random.default_rng(3).integers(0, 67, (2, 12))
    logits = peft_model.eval()(torch.tensor(tokens)).logits
    want = logits.detach().numpy()
    _close(model.forward(tokens), want, "logits")
    g = np.random.default_rng(5).normal(size=want.shape).astype(np.float32)
    (logits * torch.tensor(g)).sum().backward()
    model.zero_grad()
    model.backward(g)
    for name, ours in adapters.items():
        a, b = _pair(peft_model, name, ours)
        _close(ours.lora_a.grad, a.grad.numpy().T, f"{name} A")
        _close(ours.lora_b.grad, b.grad.numpy().T, f"{name} B")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_peft_loads_in_peft_and_merges_as_merge_and_unload(checkpoints, tmp_path,  # noqa: F811
                                                                family):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from ggmlopt.io import load_hf, save_peft
    from ggmlopt.io.hf_format import transposed_weights
    path = checkpoints(family)
    model = load_hf(path)
    lora.apply(model, config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear",
                              "use_rslora": True,
                              "rank_pattern": {r"(h|layers)\.1\..*": 2},
                              "alpha_pattern": {r"(h|layers)\.0\..*": 3}}, seed=1)
    rng = np.random.default_rng(2)
    for _, p in model.named_parameters():
        if p.requires_grad:
            p.data[...] = rng.normal(size=p.shape) * 0.2
    save_peft(model, tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.PeftModel.from_pretrained(_hf_model(family, path),
                                                    tmp_path / "adapter").eval()
    tokens = np.random.default_rng(3).integers(0, 67, (2, 12))
    _close(model.forward(tokens), peft_model(torch.tensor(tokens)).logits.detach().numpy(),
           "adapted logits")
    lora.merge(model)
    merged = peft_model.merge_and_unload()
    theirs = dict(merged.named_parameters())
    transposed = transposed_weights(model)
    for name, p in model.named_parameters():
        want = theirs[_hf(model, name)].detach().numpy()
        _close(p.data.T if id(p) in transposed else p.data, want, name)
    _close(model.forward(tokens), merged(torch.tensor(tokens)).logits.detach().numpy(),
           "merged logits")


@pytest.mark.parametrize("selection", [{"layers_to_transform": [0]},
                                       {"layers_to_transform": 1, "layers_pattern": "layers"}])
def test_all_linear_with_a_layer_filter_is_refused_as_peft_refuses_it(checkpoints,  # noqa: F811
                                                                    selection):
    # PEFT: "layers_to_transform cannot be used when target_modules is a str"; the
    # filter was dropped, every layer adapted
    from ggmlopt.io import load_hf
    model = load_hf(checkpoints("llama"))
    config = {"r": 2, "target_modules": "all-linear", **selection}
    peft = pytest.importorskip("peft")
    with pytest.raises(ValueError, match="layers_to_transform"):
        peft.LoraConfig(**copy.deepcopy(config))
    with pytest.raises(ValueError, match="layers_to_transform / layers_pattern"):
        lora.apply(model, config=config)
    assert not lora.named_adapters(model)


def _peft_adapter(family, path, directory, **config):
    """A PEFT adapter of config on family's checkpoint at path, its trained tensors
    randomised, saved to directory; returns the PEFT model (eval)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.get_peft_model(_hf_model(family, path), peft.LoraConfig(**config))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in peft_model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    peft_model.save_pretrained(directory)
    return peft_model.eval()


def _logits(model_or_peft, tokens):
    torch = pytest.importorskip("torch")
    return model_or_peft(torch.tensor(tokens)).logits.detach().numpy()


@pytest.mark.parametrize("family, parameters", [
    ("gpt2", ["attn.c_proj.weight"]),      # Conv1D (in, out), square here: B A transposed
    ("llama", ["embed_tokens.weight"])])   # an embedding's weight: (vocab, dim)
def test_parameter_adapters_of_another_layout_are_refused(checkpoints, tmp_path,  # noqa: F811
                                                          family, parameters):
    from ggmlopt.io import load_hf, load_peft
    path = checkpoints(family)
    _peft_adapter(family, path, tmp_path / "a", r=4, target_modules=[],
                  target_parameters=parameters)
    model = load_hf(path)
    with pytest.raises(ValueError, match="target_parameters"):
        load_peft(tmp_path / "a", model)   # (GPT-2's c_proj loaded, 0.7 of the logits off)
    assert not lora.named_adapters(model)


def test_parameter_adapters_on_linear_weights_are_peft_s(checkpoints, tmp_path):  # noqa: F811
    from ggmlopt.io import load_hf, load_peft
    path = checkpoints("llama")
    peft_model = _peft_adapter("llama", path, tmp_path / "a", r=4, target_modules=[],
                               target_parameters=["k_proj.weight", "down_proj.weight"])
    model = load_hf(path)
    load_peft(tmp_path / "a", model)
    tokens = np.random.default_rng(3).integers(0, 67, (2, 12))
    _close(model.forward(tokens), _logits(peft_model, tokens), "logits")


def _q_v_adapter_edited(path, directory, edit):
    """A PEFT adapter of the llama checkpoint at path on q_proj and v_proj, saved
    to directory, its adapter_config.json then updated with edit."""
    _peft_adapter("llama", path, directory, r=4, target_modules=["q_proj", "v_proj"])
    config_path = directory / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **edit}))


@pytest.mark.parametrize("edit", [{"target_modules": ["q_proj"]},
                                  {"layers_to_transform": [0]},
                                  {"exclude_modules": ["v_proj"]}])
def test_adapters_the_config_does_not_select_are_not_loaded(checkpoints, tmp_path,  # noqa: F811
                                                           edit):
    # PEFT adapts what its config selects and ignores, without a word, the file's
    # tensors of other modules (they were applied: 1.3 to 1.5 of the logits' scale off)
    peft = pytest.importorskip("peft")
    from ggmlopt.io import load_hf, load_peft
    path = checkpoints("llama")
    _q_v_adapter_edited(path, tmp_path / "a", edit)
    theirs = peft.PeftModel.from_pretrained(_hf_model("llama", path), tmp_path / "a").eval()
    model = load_hf(path)
    with pytest.warns(UserWarning, match="not loaded.*PEFT does not load them"):
        load_peft(tmp_path / "a", model)
    assert {_hf(model, n) for n, _ in lora.named_adapters(model)} == \
        set(theirs.targeted_module_names)
    tokens = np.random.default_rng(3).integers(0, 67, (2, 12))
    _close(model.forward(tokens), _logits(theirs, tokens), "logits")


@pytest.mark.parametrize("init", [True, False])
def test_a_selected_module_without_tensors_loads_as_peft_starts_it(checkpoints, tmp_path,  # noqa: F811
                                                                  init):
    # a module the config selects and the file holds nothing for: PEFT starts its
    # B at zero (init_lora_weights true: no change, as no adapter) or A and B at
    # random (false: no one can reproduce it, so refused)
    peft = pytest.importorskip("peft")
    from ggmlopt.io import load_hf, load_peft
    path = checkpoints("llama")
    _q_v_adapter_edited(path, tmp_path / "a", {"target_modules": ["q_proj", "k_proj", "v_proj"],
                                               "init_lora_weights": init})
    model = load_hf(path)
    if not init:
        with pytest.raises(ValueError, match=r"init_lora_weights is false and the file has "
                                             r"no adapter for .*k_proj"):
            load_peft(tmp_path / "a", model)
        assert lora.named_adapters(model) == []
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.PeftModel.from_pretrained(_hf_model("llama", path), tmp_path / "a")
    load_peft(tmp_path / "a", model)
    tokens = np.random.default_rng(3).integers(0, 67, (2, 12))
    _close(model.forward(tokens), _logits(theirs.eval(), tokens), "logits")
