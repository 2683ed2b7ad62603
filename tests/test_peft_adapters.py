"""LoRA adapters as PEFT saves them (save_peft, load_peft): an adapter ggmlopt
wrote is what peft.PeftModel.from_pretrained puts on the transformers model of
the same checkpoint, and an adapter PEFT wrote (its rank and alpha patterns,
rsLoRA, modules_to_save, an embedding adapter) is the one ggmlopt computes:
the same logits, on every family's layout."""
import json
import re
import warnings

import numpy as np
import pytest

from ggmlopt import lora, models
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
_SHAPE = {"vocab_size": 67, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
          "ffn_dim": 48, "max_seq_len": 64}
# the other families' layers under all-linear adapters (their biases, q/k norms, soft
# caps, local layers and embedding scales in the way)
FAMILIES.update({
    "qwen2": (lambda: models.Qwen2(models.Qwen2Config(**_SHAPE), seed=0), "Qwen2ForCausalLM",
              "all-linear", ()),
    "qwen3": (lambda: models.Qwen3(models.Qwen3Config(**_SHAPE, head_dim=16), seed=0),
              "Qwen3ForCausalLM", "all-linear", ()),
    "mistral": (lambda: models.Mistral(models.MistralConfig(**_SHAPE, sliding_window=5),
                                       seed=0), "MistralForCausalLM", "all-linear", ()),
    "gemma": (lambda: models.Gemma(models.GemmaConfig(**_SHAPE), seed=0), "GemmaForCausalLM",
              "all-linear", ()),
    "gemma2": (lambda: models.Gemma2(models.Gemma2Config(**_SHAPE, sliding_window=5), seed=0),
               "Gemma2ForCausalLM", "all-linear", ()),
    "gemma3": (lambda: models.Gemma3(models.Gemma3Config(**{**_SHAPE, "n_layers": 3},
                                                         head_dim=8, sliding_window=5), seed=0),
               "Gemma3ForCausalLM", "all-linear", ()),
})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ours_loads_in_peft_and_back(tmp_path, family):
    for needed in ("transformers", "torch", "peft"):
        pytest.importorskip(needed)
    from ggmlopt.io import save_hf
    make, hf_class, targets, trainable = FAMILIES[family]
    model = make()
    save_hf(model, tmp_path / "base")
    lora.apply(model, rank=4, alpha=8.0, targets=targets, trainable=trainable, seed=1)
    again = _through_peft(model, tmp_path, hf_class)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert lora.trainable_parameters(again) == lora.trainable_parameters(model)


def _through_peft(model, tmp_path, hf_class):
    """model's adapters (randomised) saved with save_peft beside its base (tmp_path /
    "base"), put by PeftModel.from_pretrained on transformers' hf_class of that base
    with model's logits, and loaded back with load_peft onto the base: that model."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from ggmlopt.io import load_hf, load_peft, save_peft
    _randomise_adapters(model, 2)
    save_peft(model, tmp_path / "adapter")
    hf = getattr(transformers, hf_class).from_pretrained(tmp_path / "base").eval()
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    tokens = np.random.default_rng(3).integers(0, 67, (2, 12))
    want = peft_model(torch.tensor(tokens)).logits.detach().numpy()
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())
    again = load_hf(tmp_path / "base")
    load_peft(tmp_path / "adapter", again)
    np.testing.assert_array_equal(again.forward(tokens), model.forward(tokens))
    return again


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


def _frozen_flags(model):
    return {n: p.requires_grad for n, p in model.named_parameters()}


def test_bad_values_are_refused_before_any_layer_changes(tmp_path):
    # the embedding's adapter (no dropout of its own) comes first: a dropout, an
    # alpha or a rank that fails the checks must not leave it, or the freeze, behind
    from ggmlopt.io import load_gguf_lora, load_peft, save_gguf_lora, save_peft
    source = FAMILIES["llama"][0]()
    lora.apply(source, rank=4, targets=("embed_tokens", "q_proj", "v_proj"), seed=0)
    save_peft(source, tmp_path / "a")
    save_gguf_lora(source, tmp_path / "a.gguf")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    model = FAMILIES["llama"][0]()
    flags = _frozen_flags(model)
    for call, kind, match in [
            (lambda: load_peft(tmp_path / "a", model, dropout=1.5), ValueError, "dropout"),
            (lambda: load_peft(tmp_path / "a", model, dropout="0.1"), TypeError, "dropout"),
            (lambda: load_gguf_lora(tmp_path / "a.gguf", model, dropout=-1), ValueError,
             "dropout")]:
        with pytest.raises(kind, match=match):
            call()
        assert not lora.named_adapters(model) and _frozen_flags(model) == flags
    for edit, match in [({"alpha_pattern": {"v_proj": 0}}, "alpha_pattern for .*v_proj"),
                        ({"lora_alpha": None}, "lora_alpha"), ({"r": "4"}, "'s r: expected an int"),
                        ({"lora_dropout": 2.0}, "lora_dropout")]:
        (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, **edit}))
        with pytest.raises(ValueError, match=match):
            load_peft(tmp_path / "a", model)
        assert not lora.named_adapters(model) and _frozen_flags(model) == flags


TIED = {
    "llama": (lambda: Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=1, n_heads=4,
                                        n_kv_heads=2, ffn_dim=48, max_seq_len=64,
                                        tie_embeddings=True), seed=0),
              "LlamaForCausalLM", "embed_tokens"),
    "gpt2": (lambda: GPT2(GPT2Config(vocab_size=67, dim=32, n_layers=1, n_heads=4,
                                     max_seq_len=64), seed=0), "GPT2LMHeadModel", "wte"),
}


@pytest.mark.parametrize("family", sorted(TIED))
def test_a_tied_embedding_trained_whole_stays_tied_in_peft(tmp_path, family):
    # one matrix trains for the input and the head: PEFT keeps its copies tied only
    # with ensure_weight_tying, and reads the head's copy from the file
    for needed in ("transformers", "torch", "peft"):
        pytest.importorskip(needed)
    from ggmlopt.io import save_hf
    make, hf_class, embedding = TIED[family]
    model = make()
    save_hf(model, tmp_path / "base")
    lora.apply(model, rank=4, targets="all-linear", trainable=(embedding,), seed=1)
    _through_peft(model, tmp_path, hf_class)


@pytest.mark.parametrize("tying", [False, True])
def test_peft_s_trained_copy_of_a_tied_embedding(tmp_path, tying):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from ggmlopt.io import load_hf, load_peft, save_hf
    save_hf(TIED["llama"][0](), tmp_path / "base")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"],
                          ensure_weight_tying=tying)
    peft_model = peft.get_peft_model(hf, cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.2)
    peft_model.save_pretrained(tmp_path / "adapter")
    model = load_hf(tmp_path / "base")
    if not tying:
        # PEFT trained the embedding's copy and kept the base's head: a tied model
        # has one matrix for both, so the adapter is refused, not half-applied
        with pytest.raises(ValueError, match="embed_tokens.weight whole.*ensure_weight_tying"):
            load_peft(tmp_path / "adapter", model)
        assert not lora.named_adapters(model)
        return
    load_peft(tmp_path / "adapter", model)
    tokens = np.random.default_rng(4).integers(0, 67, (2, 12))
    want = peft_model.eval()(torch.tensor(tokens)).logits.detach().numpy()
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())
    assert model.embed_tokens.weight.requires_grad


@pytest.mark.parametrize("edit, match", [
    ({"init_lora_weights": "pissa"}, "pissa.*changes the base weight"),
    ({"init_lora_weights": "pissa_niter_4"}, "pissa_niter_4.*changes the base weight"),
    ({"init_lora_weights": "olora"}, "olora.*changes the base weight"),
    ({"init_lora_weights": "loftq"}, "loftq.*changes the base weight"),
    ({"alora_invocation_tokens": [5, 6]}, "activated LoRA"),
    ({"layer_replication": [[0, 1], [0, 1]]}, "layer replication"),
    ({"trainable_token_indices": [3, 4]}, "trainable token rows"),
    ({"use_bdlora": True}, "block-diagonal"),
    ({"kasa_config": {"k": 1}}, "KaSA"),
    ({"monteclora_config": {"n": 2}}, "MonteCLoRA"),
    ({"velora_config": {"r": 2}}, "VeLoRA"),
    ({"arrow_config": {"top_k": 2}}, "Arrow")])
def test_adapters_that_change_the_base_are_refused(tmp_path, edit, match):
    # PEFT rebuilds the base (PiSSA, OLoRA, LoftQ subtract the adapter's start from it;
    # layer replication repeats layers) or applies the adapter to some tokens only
    _refused_with_config(tmp_path, edit, match)


def _refused_with_config(tmp_path, edit, match):
    """A q_proj adapter whose adapter_config.json has edit is refused with match,
    the model left without adapters."""
    from ggmlopt.io import load_peft, save_peft
    model = FAMILIES["llama"][0]()
    lora.apply(model, rank=4, targets=("q_proj",), seed=0)
    save_peft(model, tmp_path / "a")
    path = tmp_path / "a" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    fresh = FAMILIES["llama"][0]()
    with pytest.raises(ValueError, match=match):
        load_peft(tmp_path / "a", fresh)
    assert not lora.named_adapters(fresh)


def test_the_counts_are_peft_s_with_modules_trained_whole(tmp_path, capsys):
    # PEFT's total counts each modules_to_save module twice (the frozen original
    # and the trained copy): print_trainable_parameters prints PEFT's line
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from ggmlopt.io import save_hf
    model = FAMILIES["llama"][0]()
    save_hf(model, tmp_path / "base")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")
    targets, whole = ["q_proj", "v_proj"], ["lm_head", "model.norm"]
    peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=targets,
                                                         modules_to_save=whole))
    lora.apply(model, rank=4, targets=tuple(targets), trainable=tuple(whole))
    assert lora.trainable_parameters(model) == peft_model.get_nb_trainable_parameters()
    peft_model.print_trainable_parameters()
    want = capsys.readouterr().out
    lora.print_trainable_parameters(model)
    assert capsys.readouterr().out == want


@pytest.mark.parametrize("pattern", [r".*\.(q_proj|v_proj)", r"model\.layers\.1\..*_proj",
                                     r".*(embed_tokens|down_proj)", r"layers\.0\.mlp\.up_proj"])
def test_a_targets_string_is_peft_s_regular_expression(tmp_path, pattern):
    # PEFT's target_modules as one string: re.fullmatch over each module's full name
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from ggmlopt.io import save_hf
    model = FAMILIES["llama"][0]()
    save_hf(model, tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    try:
        theirs = set(peft.get_peft_model(hf, peft.LoraConfig(
            r=4, target_modules=pattern)).targeted_module_names)
    except ValueError:   # PEFT matches nothing (its full names only)
        theirs = set()
    if theirs:
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # PEFT's choice: nothing to warn about
            ours = {"model." + n for n, _ in lora.apply(model, rank=4, targets=pattern)}
        assert ours == theirs
    else:   # ggmlopt's own names matched it, and it says PEFT would not
        with pytest.warns(UserWarning, match="PEFT would not adapt them"):
            ours = {"model." + n for n, _ in lora.apply(model, rank=4, targets=pattern)}
        assert ours and all(re.fullmatch(pattern, n[len("model."):]) for n in ours)


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.k_proj.base_layer.weight",
                                   "model.layers.0.self_attn.q_proj.weight"])
def test_tensors_peft_does_not_load_are_not_loaded(tmp_path, extra):
    # a base weight of a layer the file does not adapt, a plain weight of one it
    # does: PEFT's state dict has no such key and it loads with strict=False
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    st = pytest.importorskip("safetensors.numpy")
    from ggmlopt.io import load_peft, save_hf, save_peft
    model = FAMILIES["llama"][0]()
    save_hf(model, tmp_path / "base")
    lora.apply(model, rank=4, targets=("q_proj",), seed=1)
    _randomise_adapters(model, 2)
    save_peft(model, tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_model.safetensors"
    stray = np.random.default_rng(4).normal(size=(32, 32)).astype(np.float32)
    st.save_file({**st.load_file(str(path)), "base_model.model." + extra: stray}, str(path))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    tokens = np.random.default_rng(3).integers(0, 67, (2, 12))
    want = peft_model(torch.tensor(tokens)).logits.detach().numpy()
    again = FAMILIES["llama"][0]()
    with pytest.warns(UserWarning, match="1 tensors are not loaded, as PEFT does not"):
        load_peft(tmp_path / "adapter", again)
    np.testing.assert_allclose(again.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("edit, match", [
    ({"rank_pattern": ["q_proj", 4]}, "rank_pattern: expected an object"),
    ({"alpha_pattern": "q_proj"}, "alpha_pattern: expected an object"),
    ({"rank_pattern": {"q_proj(": 4}}, "rank_pattern: 'q_proj\\(' is not a valid regular")])
def test_malformed_patterns_are_refused_by_name(tmp_path, edit, match):
    _refused_with_config(tmp_path, edit, match)


def test_an_adapter_tensor_that_is_no_matrix_is_refused(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    from ggmlopt.io import load_peft, save_peft
    model = FAMILIES["llama"][0]()
    lora.apply(model, rank=4, targets=("q_proj",), seed=0)
    save_peft(model, tmp_path / "a")
    path = tmp_path / "a" / "adapter_model.safetensors"
    tensors = st.load_file(str(path))
    name = next(n for n in tensors if n.endswith("lora_A.weight"))
    st.save_file({**tensors, name: np.array(1.0, np.float32)}, str(path))
    fresh = FAMILIES["llama"][0]()
    with pytest.raises(ValueError, match="expected two matrices"):
        load_peft(tmp_path / "a", fresh)
    assert not lora.named_adapters(fresh)


@pytest.mark.parametrize("tie, modules_to_save", [(False, None), (True, None),
                                                  (False, ["embed_tokens"])])
def test_embedding_layers_peft_saves_beside_an_adapter(tmp_path, tie, modules_to_save):
    # save_embedding_layers=True (PEFT's "auto" after a vocabulary resize) writes the
    # embedding and head as plain weights: PEFT loads them frozen unless the config's
    # modules_to_save names them (then with the trained copy's original beside it)
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from ggmlopt.io import load_hf, load_peft, save_hf
    save_hf(Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=48, max_seq_len=64, tie_embeddings=tie), seed=0),
            tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    made = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                   modules_to_save=modules_to_save))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in made.named_parameters():
            if "lora_" in n or "embed" in n or "lm_head" in n:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    made.save_pretrained(tmp_path / "adapter", save_embedding_layers=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True)
    tokens = np.random.default_rng(3).integers(0, 67, (2, 12))
    want = theirs.eval()(torch.tensor(tokens)).logits.detach().numpy()
    ours = load_hf(tmp_path / "base")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_peft(tmp_path / "adapter", ours)
    np.testing.assert_allclose(ours.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())
    theirs_count = sum(p.numel() for n, p in theirs.named_parameters()
                       if p.requires_grad and "original_module" not in n)
    assert lora.trainable_parameters(ours)[0] == theirs_count
    # the saved base copies differ from the model's (moved above): their loading,
    # which changes the model's base, is said, naming them
    said = [str(w.message) for w in caught if "replace them" in str(w.message)]
    assert len(said) == 1
    moved = {"embed_tokens.weight"} if modules_to_save is None else set()
    moved |= set() if tie else {"lm_head.weight"}
    assert {n for n in ("embed_tokens.weight", "lm_head.weight") if n in said[0]} == moved


def test_base_copies_equal_to_the_model_s_load_without_a_word(tmp_path):
    # PEFT saves the embedding beside an embedding adapter: the model's own weight
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from ggmlopt.io import load_hf, load_peft, save_hf
    save_hf(FAMILIES["llama"][0](), tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    made = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj",
                                                                        "embed_tokens"]))
    made.save_pretrained(tmp_path / "adapter", save_embedding_layers=True)
    ours = load_hf(tmp_path / "base")
    before = ours.embed_tokens.weight.data.copy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_peft(tmp_path / "adapter", ours)
    assert not [w for w in caught if "replace them" in str(w.message)]
    np.testing.assert_array_equal(dict(ours.named_parameters())["embed_tokens.weight"].data,
                                  before)


def test_the_warning_of_a_differing_base_copy_comes_before_the_model_changes(tmp_path):
    # under warnings as errors the warning is the refusal: the model must be as it was
    st = pytest.importorskip("safetensors.numpy")
    from ggmlopt.io import load_peft, save_peft
    source = FAMILIES["llama"][0]()
    lora.apply(source, rank=2, targets=("embed_tokens", "q_proj"), seed=0)
    save_peft(source, tmp_path / "a")
    path = tmp_path / "a" / "adapter_model.safetensors"
    tensors = st.load_file(path)
    name = "base_model.model.model.embed_tokens.base_layer.weight"
    tensors[name] = np.ones((67, 32), np.float32)   # PEFT's save_embedding_layers copy
    st.save_file(tensors, path, metadata={"format": "pt"})
    model = FAMILIES["llama"][0]()
    before = {n: p.data.copy() for n, p in model.named_parameters()}
    flags = _frozen_flags(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="replace them"):
            load_peft(tmp_path / "a", model)
    assert not lora.named_adapters(model)
    assert _frozen_flags(model) == flags
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(p.data, before[n])


@pytest.mark.parametrize("entry", ["mlp", "layers.1.mlp", "model.layers.0.mlp"])
def test_modules_to_save_naming_a_container_trains_what_is_inside(tmp_path, entry):
    # PEFT's modules_to_save=["mlp"] trains every weight under each matching module
    # and saves them under their own names (...mlp.gate_proj.weight): loaded, they
    # train, so save_peft writes them back and PEFT's count is kept
    from ggmlopt.io import load_peft, save_peft
    make = FAMILIES["llama"][0]
    model = make()
    lora.apply(model, rank=4, targets=("q_proj",), trainable=("mlp",), seed=1)
    _randomise_adapters(model, 2)
    save_peft(model, tmp_path / "a")
    path = tmp_path / "a" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "modules_to_save": [entry]}))
    fresh = make()
    load_peft(tmp_path / "a", fresh)
    layers = (0, 1) if entry == "mlp" else (int(entry.split(".")[-2]),)
    want = sorted(f"layers.{i}.mlp.{p}_proj.weight" for i in layers
                  for p in ("gate", "up", "down"))
    assert sorted(lora.other_trainable(fresh)) == want
    tokens = np.random.default_rng(3).integers(0, 67, (2, 12))
    np.testing.assert_array_equal(fresh.forward(tokens), model.forward(tokens))


def test_a_tied_head_s_adapter_peft_ties_is_refused_by_what_it_is(tmp_path):
    # PEFT's ensure_weight_tying adapts lm_head beside a tied embedding: a tied
    # head here is the embedding itself, so the message says so and how to go on
    from safetensors.numpy import load_file, save_file

    from ggmlopt.io import load_peft, save_peft
    make = lambda: Llama(LlamaConfig(vocab_size=67, dim=32, n_layers=1, n_heads=4,
                                     n_kv_heads=2, ffn_dim=48, max_seq_len=64,
                                     tie_embeddings=True), seed=0)
    model = make()
    lora.apply(model, rank=2, targets=("embed_tokens", "q_proj"), seed=1)
    save_peft(model, tmp_path / "a")
    file = tmp_path / "a" / "adapter_model.safetensors"
    tensors = load_file(file)
    tensors["base_model.model.lm_head.lora_A.weight"] = np.zeros((2, 32), np.float32)
    tensors["base_model.model.lm_head.lora_B.weight"] = np.zeros((67, 2), np.float32)
    save_file(tensors, file)
    fresh = make()
    with pytest.raises(ValueError, match="tied embedding.*ensure_weight_tying.*merge_and_unload"):
        load_peft(tmp_path / "a", fresh)
    assert not lora.named_adapters(fresh)
