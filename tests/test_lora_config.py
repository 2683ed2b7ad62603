"""lora.apply(model, config=...): a PEFT LoraConfig (or a dict of its keys, or an
object with its attributes) adapts the layers, with the ranks, scalings and
modules trained whole, that peft.get_peft_model gives the transformers model of
the same checkpoint, and computes its logits; what it cannot honour is refused
by key, the model left unchanged."""
import copy
import math
import types
import warnings

import numpy as np
import pytest

from ggmlopt import _lora_config, lora
from ggmlopt.models import GPT2, GPT2Config, Llama, LlamaConfig

_HF = {"vocab_size": 67, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 3,
       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}

# family: (transformers config class, model class, config keys beyond _HF; None: GPT-2's own)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": None, "bos_token_id": None,
                                               "eos_token_id": None,
                                               "original_max_position_embeddings": 64}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"pad_token_id": None,
                                                        "bos_token_id": None,
                                                        "eos_token_id": None}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", None),
}
# per layout: (a target list, a layer's norm for modules_to_save, the MLP's projection)
LAYOUT = {"gpt2": (["c_attn", "c_fc"], ["ln_1"], "c_fc"),
          "phi3": (["qkv_proj", "down_proj"], ["norm"], "down_proj")}
LLAMA_LAYOUT = (["q_proj", "k_proj", "down_proj"], ["norm"], "down_proj")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: directory} of small random transformers checkpoints, made when asked."""
    made = {}

    def get(family):
        if family not in made:
            transformers = pytest.importorskip("transformers")
            torch = pytest.importorskip("torch")
            config_class, model_class, extra = FAMILIES[family]
            if extra is None:   # GPT-2's own names
                cfg = transformers.GPT2Config(vocab_size=67, n_embd=32, n_layer=3, n_head=4,
                                              n_positions=64, resid_pdrop=0.0,
                                              embd_pdrop=0.0, attn_pdrop=0.0)
            else:
                cfg = getattr(transformers, config_class)(**_HF, **extra)
            torch.manual_seed(0)
            hf = getattr(transformers, model_class)(cfg)
            with torch.no_grad():   # norms off ones, so that training them whole shows
                for _, p in hf.named_parameters():
                    if p.ndim == 1:
                        p.uniform_(0.5, 1.5)
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            made[family] = path
        return made[family]
    return get


def _both(path, family, config, seed=0):
    """(ggmlopt's model adapted by apply(config=...), PEFT's model of the same
    checkpoint and config); each takes its own copy (get_peft_model edits its
    config)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from ggmlopt.io import load_hf
    model = load_hf(path)
    lora.apply(model, config=copy.deepcopy(config), seed=seed)
    hf = getattr(transformers, FAMILIES[family][1]).from_pretrained(path)
    return model, peft.get_peft_model(hf, copy.deepcopy(config))


def _hf(model, name):
    from ggmlopt.models.registry import family_of
    return name if name.startswith("lm_head") else family_of(model).hf_prefix + name


def _peft_trainable(peft_model):
    """{transformers name: PEFT's parameter} of the parameters PEFT trains whole,
    and its trainable count."""
    names, count = {}, 0
    for name, p in peft_model.named_parameters():
        if not p.requires_grad:
            continue
        count += p.numel()
        if "lora_" not in name:
            names[name.removeprefix("base_model.model.").replace(
                ".modules_to_save.default", "")] = p
    return names, count


def _assert_same_as_peft(model, peft_model, config):
    """The adapted layers, their ranks, scalings and dropouts, the parameters
    trained whole and, with PEFT's adapters and trained copies (randomised)
    copied in, the logits."""
    import torch

    from ggmlopt.io.hf_format import transposed_weights
    adapters = {_hf(model, name): layer for name, layer in lora.named_adapters(model)}
    assert set(adapters) == set(peft_model.targeted_module_names)
    root = peft_model.base_model.model
    dropout = float(getattr(config, "lora_dropout", 0.0))
    for name, ours in adapters.items():
        theirs = root.get_submodule(name)
        assert ours.rank == theirs.r["default"], name
        assert ours.scaling == pytest.approx(theirs.scaling["default"], rel=1e-12), name
        if isinstance(ours, lora.LoRALinear):
            assert ours.lora_dropout.p == pytest.approx(dropout)
        if isinstance(ours, lora.LoRALinear) and config.init_lora_weights is True:
            bound = 1 / math.sqrt(ours.in_features)   # PEFT's Kaiming-uniform A
            assert np.abs(ours.lora_a.data).max() <= bound
            assert np.abs(theirs.lora_A["default"].weight.detach().numpy()).max() <= bound
    whole, count = _peft_trainable(peft_model)
    assert {_hf(model, n) for n in lora.other_trainable(model)} == set(whole)
    assert lora.trainable_parameters(model)[0] == count
    # PEFT's values, randomised, into ggmlopt's layers
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if p.requires_grad:
                p.copy_(p + torch.randn(p.shape, generator=gen) * 0.2)
    for name, ours in adapters.items():
        theirs = root.get_submodule(name)
        if isinstance(ours, lora.LoRAEmbedding):
            a, b = theirs.lora_embedding_A["default"], theirs.lora_embedding_B["default"]
        else:
            a, b = theirs.lora_A["default"].weight, theirs.lora_B["default"].weight
        ours.lora_a.data[...] = a.detach().numpy().T
        ours.lora_b.data[...] = b.detach().numpy().T
    params = {_hf(model, n): p for n, p in model.named_parameters()}
    transposed = transposed_weights(model)
    for hf_name, theirs in whole.items():
        p, value = params[hf_name], theirs.detach().numpy()
        p.data[...] = value.T if id(p) in transposed else value
    tokens = np.random.default_rng(3).integers(0, 67, (2, 12))
    want = peft_model.eval()(torch.tensor(tokens)).logits.detach().numpy()
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())


def _configs(family):
    targets, norms, mlp = LAYOUT.get(family, LLAMA_LAYOUT)
    peft = pytest.importorskip("peft")
    return {
        "all-linear": peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear",
                                      rank_pattern={mlp: 2,
                                                    r"(h|layers)\.0\..*attn\.(o|c)_proj": 3},
                                      alpha_pattern={r"(h|layers)\.1\..*": 5},
                                      modules_to_save=norms, lora_dropout=0.1),
        "list": peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_rslora=True,
                                layers_to_transform=[0, 2], exclude_modules=[f"2.mlp.{mlp}"],
                                rank_pattern={targets[0]: 6}),
        "regex": peft.LoraConfig(r=2, lora_alpha=3, target_modules=rf".*\.1\..*\.({mlp}|"
                                                                    rf"{targets[0]})",
                                 init_lora_weights="gaussian", task_type="CAUSAL_LM"),
    }


@pytest.mark.parametrize("kind", ["all-linear", "list", "regex"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_lora_config_adapts_what_peft_adapts(checkpoints, family, kind):
    config = _configs(family)[kind]
    model, peft_model = _both(checkpoints(family), family, config)
    _assert_same_as_peft(model, peft_model, config)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_target_modules_is_peft_s_default_for_the_model_type(checkpoints, family):
    peft = pytest.importorskip("peft")
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_s

    from ggmlopt.io import load_hf
    from ggmlopt.models.registry import family_of
    path = checkpoints(family)
    model_type = family_of(load_hf(path)).hf_model_type
    # the table apply keeps (no peft import) is the installed PEFT's
    want = peft_s.get(model_type)
    assert _lora_config.PEFT_DEFAULT_TARGETS.get(model_type) == (None if want is None else tuple(want))
    config = peft.LoraConfig(r=2, lora_alpha=4)
    if want is None:   # Phi-3, SmolLM3: PEFT has none, and says so
        with pytest.raises(ValueError, match="target_modules"):
            _both(path, family, config)
        model = load_hf(path)
        with pytest.raises(ValueError, match="config's target_modules: None .* PEFT has none "
                                             f"for {model_type}"):
            lora.apply(model, config=config)
        assert not lora.named_adapters(model)
        return
    model, peft_model = _both(path, family, config)
    assert {n.rpartition(".")[2] for n, _ in lora.named_adapters(model)} == set(want)
    _assert_same_as_peft(model, peft_model, config)


def test_a_target_named_whole_escapes_layers_to_transform(checkpoints):
    # PEFT's rule: layers_to_transform filters the targets matched by a suffix only
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["model.layers.1.self_attn.q_proj", "v_proj"],
                             layers_to_transform=[0], layers_pattern="layers")
    model, peft_model = _both(checkpoints("llama"), "llama", config)
    assert sorted(n for n, _ in lora.named_adapters(model)) == [
        "layers.0.self_attn.v_proj", "layers.1.self_attn.q_proj"]
    _assert_same_as_peft(model, peft_model, config)


def test_a_pattern_that_matches_no_adapted_layer_warns():
    with pytest.warns(UserWarning, match="rank_pattern: 'o_proj' matches no adapted layer"):
        lora.apply(_llama(), config={"r": 2, "target_modules": ["q_proj"],
                                     "rank_pattern": {"o_proj": 4, "q_proj": 3}})


def test_modules_to_save_and_embedding_targets_as_peft(checkpoints):
    # modules_to_save excludes the targets inside it ("mlp" takes down_proj), trains
    # every module whose name ends with an entry, and an embedding takes an adapter
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8,
                             target_modules=["q_proj", "down_proj", "embed_tokens"],
                             modules_to_save=["mlp", "lm_head", "model.norm"])
    model, peft_model = _both(checkpoints("llama"), "llama", config)
    assert not any("mlp" in n for n, _ in lora.named_adapters(model))
    assert "layers.0.mlp.down_proj.weight" in lora.other_trainable(model)
    _assert_same_as_peft(model, peft_model, config)


@pytest.mark.parametrize("family, entry", [("gemma3", "embed_tokens"), ("gemma3", "lm_head"),
                                           ("gpt2", "lm_head")])
def test_a_tied_embedding_trained_whole_with_ensure_weight_tying(checkpoints, family, entry):
    # PEFT ties its copies of the embedding and head (one trained matrix): this
    # model's one matrix trains; without ensure_weight_tying PEFT trains one copy
    # apart, which a tied model cannot hold: refused
    peft = pytest.importorskip("peft")
    from ggmlopt.io import load_hf
    target = ["c_attn"] if family == "gpt2" else ["q_proj"]
    config = peft.LoraConfig(r=4, target_modules=target, modules_to_save=[entry],
                             ensure_weight_tying=True)
    model, peft_model = _both(checkpoints(family), family, config)
    _assert_same_as_peft(model, peft_model, config)
    untied = load_hf(checkpoints(family))
    flags = {n: p.requires_grad for n, p in untied.named_parameters()}
    with pytest.raises(ValueError, match="config's modules_to_save: .*ensure_weight_tying=True"):
        lora.apply(untied, config=peft.LoraConfig(r=4, target_modules=target,
                                                  modules_to_save=[entry]))
    assert not lora.named_adapters(untied)
    assert {n: p.requires_grad for n, p in untied.named_parameters()} == flags


def test_an_embedding_adapter_on_a_tied_model(checkpoints):
    # without ensure_weight_tying the head reads the base embedding, in PEFT as here;
    # with it PEFT repeats the adapter on the head, which the tied head cannot hold
    peft = pytest.importorskip("peft")
    from ggmlopt.io import load_hf
    config = peft.LoraConfig(r=4, target_modules=["embed_tokens", "v_proj"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # PEFT's note about tied embeddings
        model, peft_model = _both(checkpoints("gemma3"), "gemma3", config)
    _assert_same_as_peft(model, peft_model, config)
    fresh = load_hf(checkpoints("gemma3"))
    with pytest.raises(ValueError, match="config's ensure_weight_tying: .*tied output head"):
        lora.apply(fresh, config=peft.LoraConfig(r=4, target_modules=["embed_tokens"],
                                                 ensure_weight_tying=True))
    assert not lora.named_adapters(fresh)


def test_targets_peft_cannot_adapt_are_refused_as_there(checkpoints):
    peft = pytest.importorskip("peft")
    from ggmlopt.io import load_hf
    for target, match in [(["norm"], "it selects model.*norm, a RMSNorm.*cannot adapt"),
                          (["mlp"], "it selects model.layers.0.mlp, a .*cannot adapt"),
                          (["qproj"], r"\['qproj'\] selects no layer"),
                          ("q_proj", "'q_proj' selects no layer")]:   # a string is a whole-name pattern
        config = peft.LoraConfig(r=2, target_modules=target)
        with pytest.raises(ValueError):
            _both(checkpoints("llama"), "llama", config)
        model = load_hf(checkpoints("llama"))
        with pytest.raises(ValueError, match="config's target_modules: " + match):
            lora.apply(model, config=config)
        assert not lora.named_adapters(model)


def test_a_peft_config_object_is_read_without_peft_too():
    # an object with LoraConfig's attributes (no peft import needed)
    config = types.SimpleNamespace(r=4, lora_alpha=12, target_modules=["q_proj"],
                                   lora_dropout=0.0, modules_to_save=None)
    model = _llama()
    adapters = dict(lora.apply(model, config=config))
    assert sorted(adapters) == [f"layers.{i}.self_attn.q_proj" for i in range(3)]
    assert {a.scaling for a in adapters.values()} == {3.0}


# ---- peft-free: dicts as adapter_config.json holds them ----------------------------------

def _llama(tied=False):
    return Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=3, n_heads=4, n_kv_heads=2,
                             ffn_dim=48, max_seq_len=64, tie_embeddings=tied), seed=0)


ADAPTER_CONFIG = {   # save_pretrained's keys, as a trained adapter's file holds them
    "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": "some/model",
    "bias": "none", "corda_config": None, "eva_config": None, "exclude_modules": None,
    "fan_in_fan_out": False, "inference_mode": False, "init_lora_weights": True,
    "layer_replication": None, "layers_pattern": None, "layers_to_transform": None,
    "loftq_config": {}, "lora_alpha": 16, "lora_bias": False, "lora_dropout": 0.05,
    "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
    "peft_type": "LORA", "peft_version": "0.21.2", "qalora_group_size": 16, "r": 8,
    "rank_pattern": {}, "revision": None, "target_modules": ["v_proj", "q_proj"],
    "target_parameters": None, "task_type": "CAUSAL_LM", "trainable_token_indices": None,
    "use_dora": False, "use_qalora": False, "use_rslora": False, "ensure_weight_tying": False,
    "alora_invocation_tokens": None, "arrow_config": None, "use_bdlora": None,
    "kasa_config": None, "monteclora_config": None, "velora_config": None,
    "runtime_config": {"ephemeral_gpu_offload": False}}


def test_a_dict_config_is_apply_s_arguments():
    config = {**ADAPTER_CONFIG, "target_modules": ["q_proj", "v_proj", "down_proj"],
              "rank_pattern": {"down_proj": 4, r"layers\.2\.self_attn\.q_proj": 2},
              "alpha_pattern": {"v_proj": 2}, "use_rslora": True,
              "modules_to_save": ["norm"], "layers_to_transform": [1, 2],
              "layers_pattern": "layers", "exclude_modules": "model\\.layers\\.2\\.mlp\\..*"}
    model = _llama()
    adapters = dict(lora.apply(model, config=config, seed=3))
    want = {"layers.1.self_attn.q_proj": (8, 16 / math.sqrt(8)),
            "layers.1.self_attn.v_proj": (8, 2 / math.sqrt(8)),
            "layers.1.mlp.down_proj": (4, 16 / math.sqrt(4)),
            "layers.2.self_attn.q_proj": (2, 16 / math.sqrt(2)),
            "layers.2.self_attn.v_proj": (8, 2 / math.sqrt(8))}
    assert {n: (a.rank, pytest.approx(a.scaling)) for n, a in adapters.items()} == want
    assert {a.lora_dropout.p for a in adapters.values()} == {0.05}
    # "norm" ends input_layernorm and post_attention_layernorm too (PEFT's suffix rule)
    assert sorted(lora.other_trainable(model)) == sorted(
        [f"layers.{i}.{n}.weight" for i in range(3)
         for n in ("input_layernorm", "post_attention_layernorm")] + ["norm.weight"])
    # the same as apply's own arguments, per rank and alpha
    again = _llama()
    lora.apply(again, rank=8, alpha=16 * math.sqrt(8), targets=("layers.1.self_attn.q_proj",),
               seed=3)
    np.testing.assert_array_equal(adapters["layers.1.self_attn.q_proj"].lora_a.data,
                                  lora.named_adapters(again)[0][1].lora_a.data)


def test_seed_draws_the_a_matrices_with_a_config():
    def a_of(seed, init=True):
        model = _llama()
        lora.apply(model, config={"r": 8, "target_modules": ["q_proj"],
                                  "init_lora_weights": init}, seed=seed)
        return lora.named_adapters(model)[0][1].lora_a.data.copy()
    np.testing.assert_array_equal(a_of(1), a_of(1))
    assert not np.array_equal(a_of(1), a_of(2))
    # Kaiming-uniform (bound 1/sqrt(in)) and PEFT's "gaussian" (std 1/r), B zero
    assert 0.9 / math.sqrt(32) < np.abs(a_of(1)).max() <= 1 / math.sqrt(32)
    gauss = np.concatenate([a_of(s, "Gaussian").ravel() for s in range(8)])
    assert abs(gauss.std() - 1 / 8) < 0.01 and np.abs(gauss).max() > 1 / math.sqrt(32)


def test_a_dict_config_on_gpt2_defaults_to_c_attn():
    model = GPT2(GPT2Config(vocab_size=67, dim=32, n_layers=2, n_heads=4, max_seq_len=64),
                 seed=0)
    adapters = lora.apply(model, config={"r": 2, "lora_alpha": 4, "fan_in_fan_out": True})
    assert [n for n, _ in adapters] == ["h.0.attn.c_attn", "h.1.attn.c_attn"]


def test_a_model_of_no_family_needs_target_modules():
    from ggmlopt.nn import Linear, Sequential
    def make():
        return Sequential(Linear(4, 8, rng=0), Linear(8, 8, rng=1),
                          Sequential(Linear(8, 8, rng=2), Linear(8, 2, rng=3)))
    model = make()
    with pytest.raises(ValueError, match="PEFT has none for a model of no family"):
        lora.apply(model, config={"r": 2})
    # a list takes dotted suffixes, a string matches whole names only (PEFT's rules)
    assert [n for n, _ in lora.apply(model, config={"r": 2, "target_modules": ["1"]})] == \
        ["1", "2.1"]
    assert [n for n, _ in lora.apply(make(), config={"r": 2, "target_modules": "1"})] == ["1"]
    assert [n for n, _ in lora.apply(make(), config={"r": 2, "target_modules": ["1"],
                                                     "exclude_modules": "2.*"})] == ["1"]


@pytest.mark.parametrize("arg, value", [("rank", 4), ("alpha", 8.0), ("targets", ("q_proj",)),
                                        ("dropout", 0.0), ("trainable", ()),
                                        ("use_rslora", False)])
def test_an_argument_given_with_config_is_a_type_error(arg, value):
    # even at its default value: the config sets it
    model = _llama()
    key = _lora_config.CONFIG_KEY_OF[arg]
    with pytest.raises(TypeError, match=f"apply: {arg} given with config, which sets {key}"):
        lora.apply(model, config={"r": 4, "target_modules": ["q_proj"]}, **{arg: value})
    assert not lora.named_adapters(model)


def _flags(model):
    return {n: p.requires_grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("edit, match", [
    ({"use_dora": True}, "use_dora: DoRA"),
    ({"bias": "all"}, "bias: 'all' trains the base's biases"),
    ({"bias": "lora_only"}, "bias: 'lora_only'"),
    ({"lora_bias": True}, "lora_bias: a trained bias"),
    ({"use_qalora": True}, "use_qalora: QA-LoRA"),
    ({"init_lora_weights": False}, "init_lora_weights: False starts B nonzero"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights: 'pissa' computes"),
    ({"init_lora_weights": "olora"}, "init_lora_weights: 'olora'"),
    ({"init_lora_weights": "eva"}, "init_lora_weights: 'eva'"),
    ({"init_lora_weights": "mica"}, "init_lora_weights: 'mica'"),
    ({"inference_mode": True}, "inference_mode: True freezes every adapter"),
    ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters: .*parameters"),
    ({"layer_replication": [[0, 2]]}, "layer_replication: .*layer replication"),
    ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
    ({"alora_invocation_tokens": [5]}, "alora_invocation_tokens: .*activated LoRA"),
    ({"use_bdlora": {"nblocks": 2}}, "use_bdlora"),
    ({"peft_type": "IA3"}, "peft_type: 'IA3' is not LoRA"),
    ({"some_future_option": 3}, "some_future_option: 3 is a setting apply does not know"),
    ({"r": 0}, "r: expected >= 1"),
    ({"r": "8"}, "r: expected an int"),
    ({"lora_alpha": 0}, "lora_alpha: expected a finite nonzero"),
    ({"lora_dropout": 1.0}, "lora_dropout: expected a drop probability"),
    ({"use_rslora": "yes"}, "use_rslora: expected a bool"),
    ({"rank_pattern": {"q_proj": 0}}, "rank_pattern for model.layers.0.self_attn.q_proj"),
    ({"rank_pattern": {"q_proj(": 2}}, "rank_pattern: 'q_proj\\(' is not a valid regular"),
    ({"alpha_pattern": ["q_proj"]}, "alpha_pattern: expected an object \\(a dict\\)"),
    ({"target_modules": "q_proj("}, "target_modules: 'q_proj\\(' is not a valid regular"),
    ({"target_modules": [1]}, "target_modules: expected a list of module names"),
    ({"target_modules": ".*q_proj", "layers_to_transform": [0]},
     "layers_to_transform / layers_pattern: PEFT refuses them with a target_modules string"),
    ({"layers_pattern": "layers"}, "layers_pattern: PEFT needs layers_to_transform"),
    ({"layers_to_transform": "0"}, "layers_to_transform: expected a layer index"),
    ({"target_modules": ["down_proj"], "modules_to_save": ["mlp"]},
     "target_modules: .* selects no layer"),
    ({"modules_to_save": "norm"}, "modules_to_save: expected a list"),
    ({"modules_to_save": ["_proj"]}, ("modules_to_save \\(apply's trainable\\): .* covers "
                                      "layers.0.self_attn.q_proj")),
    ({"target_modules": ["lm_head", "q_proj"]},
     "target_modules \\(apply's targets\\): 'lm_head' names the output head.*tied"),
    ({"modules_to_save": ["embed_tokens"]}, ("modules_to_save: it trains model.embed_tokens "
                                            "whole.*tied"))])
def test_what_apply_cannot_honour_is_refused_by_key(edit, match):
    tied = "embed_tokens" in str(edit.get("modules_to_save")) or \
        "lm_head" in str(edit.get("target_modules"))
    model = _llama(tied=tied)
    flags = _flags(model)
    with pytest.raises(ValueError, match="config's " + match):
        lora.apply(model, config={"r": 8, "target_modules": ["q_proj"], **edit})
    assert not lora.named_adapters(model) and _flags(model) == flags


def test_settings_that_change_nothing_are_accepted():
    # metadata, fan_in_fan_out, the settings of unused options, an unknown key unset
    model = _llama()
    config = {**ADAPTER_CONFIG, "loftq_config": {"loftq_bits": 4}, "eva_config": {"rho": 2.0},
              "some_future_option": None, "ensure_weight_tying": True, "task_type": "SEQ_CLS",
              "fan_in_fan_out": True}
    assert len(lora.apply(model, config=config)) == 6


@pytest.mark.parametrize("config", ["q_proj", 8, ["q_proj"], object()])
def test_a_config_of_another_kind_is_a_type_error(config):
    with pytest.raises(TypeError, match="config: "):
        lora.apply(_llama(), config=config)


def test_modules_to_save_that_matches_nothing_warns_as_peft_ignores_it():
    model = _llama()
    with pytest.warns(UserWarning, match="'rotary_emb' matches no module with weights"):
        lora.apply(model, config={"r": 2, "target_modules": ["q_proj"],
                                  "modules_to_save": ["rotary_emb"]})
    assert lora.other_trainable(model) == []


def test_a_config_over_a_base_kept_in_its_file_s_types(tmp_path):
    # QLoRA: the layers kept quantized take the adapters a float32 copy takes, drawn
    # alike; a module trained whole must be float32
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    path = tmp_path / "m.gguf"
    model = Llama(LlamaConfig(vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=96, max_seq_len=64), seed=3)
    save_gguf(model, path, tokenizer=ByteTokenizer(), dtype="q8_0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the float32 load warns that it dequantized
        widened, _ = load_gguf(path)
    kept, _ = load_gguf(path, keep_types=True)
    config = {"r": 4, "target_modules": "all-linear", "modules_to_save": ["norm"],
              "rank_pattern": {"down_proj": 2}}
    ours = lora.apply(kept, config=config, seed=5)
    theirs = lora.apply(widened, config=config, seed=5)
    assert [(n, a.rank) for n, a in ours] == [(n, a.rank) for n, a in theirs]
    assert len(ours) == 14 and {a.rank for n, a in ours if "down_proj" in n} == {2}
    for (_, a), (_, b) in zip(ours, theirs):
        np.testing.assert_array_equal(a.lora_a.data, b.lora_a.data)
    assert lora.other_trainable(kept) == lora.other_trainable(widened)
    again, _ = load_gguf(path, keep_types=True)
    with pytest.raises(ValueError, match="config's modules_to_save \\(apply's trainable\\): "
                                         ".*layers.0.mlp.*kept in its file's type"):
        lora.apply(again, config={"r": 4, "target_modules": ["q_proj"],
                                  "modules_to_save": ["mlp"]})
    assert not lora.named_adapters(again)


def test_every_family_s_default_targets_are_peft_s():
    """PEFT_DEFAULT_TARGETS against the installed PEFT for every registered family
    (a family added without its line would refuse target_modules=None that PEFT takes)."""
    pytest.importorskip("peft")
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_s

    from ggmlopt.models.registry import FAMILIES as registered
    for family in registered:
        want = peft_s.get(family.hf_model_type)
        got = _lora_config.PEFT_DEFAULT_TARGETS.get(family.hf_model_type)
        assert got == (None if want is None else tuple(want)), family.hf_model_type
