"""The model families' registry: each family found by its model class, its
Hugging Face model_type and its llama.cpp architecture; ggmlopt.io and lora
name no family (they go through the registry); and a family defined outside
the package (its config, model and FAMILY, plus its line in FAMILIES) is read
and written by load_hf / save_hf / save_gguf with no other change."""
import dataclasses
import io
import json
import pathlib
import tokenize

import numpy as np
import pytest

import ggmlopt
from ggmlopt.models import registry
from ggmlopt.models.family import Family
from ggmlopt.models.llama import FAMILY as LLAMA

FAMILY_CLASSES = {"Mistral", "MistralConfig", "Qwen2", "Qwen2Config", "Qwen3", "Qwen3Config",
                  "Phi3", "Phi3Config", "SmolLM3", "SmolLM3Config", "Gemma", "GemmaConfig",
                  "Gemma2", "Gemma2Config", "Gemma3", "Gemma3Config"}


def test_every_family_is_found_three_ways():
    for family in registry.FAMILIES:
        assert registry.family_of(family.model_class.__new__(family.model_class)) is family
        assert registry.family_for_hf(family.hf_model_type) is family
        if family.gguf_arch is not None and family.name != "mistral":
            assert registry.family_for_gguf(family.gguf_arch) is family
    # llama.cpp runs a Mistral as its llama: such a file comes back a Llama
    assert registry.family_for_gguf("llama").name == "llama"
    assert registry.family_for_hf("bert") is None and registry.family_for_gguf("bert") is None
    with pytest.raises(TypeError, match="expected a ggmlopt.models.Llama or GPT2"):
        registry.family_of(object())


def _names_in(path: pathlib.Path) -> set[str]:
    """The identifiers a module's code uses (not its comments or docstrings)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in tokens if t.type == tokenize.NAME}


@pytest.mark.parametrize("module", sorted(
    [p.name for p in (pathlib.Path(ggmlopt.__file__).parent / "io").glob("*.py")]
    + ["../lora.py"]))
def test_io_and_lora_name_no_family(module):
    path = pathlib.Path(ggmlopt.__file__).parent / "io" / module
    assert not _names_in(path) & FAMILY_CLASSES


@dataclasses.dataclass(frozen=True)
class WideConfig(ggmlopt.models.LlamaConfig):
    """A family of a test's own: a Llama under another model_type."""


class Wide(ggmlopt.models.Llama):
    pass


def _wide_from_hf(hf, where):
    cfg = LLAMA.from_hf({**hf, "model_type": "llama"}, where)
    return WideConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})


WIDE = dataclasses.replace(LLAMA, name="wide", model_class=Wide, config_class=WideConfig,
                           hf_model_type="wide_llama", hf_architecture="WideForCausalLM",
                           from_hf=_wide_from_hf)


def test_a_family_from_outside_is_one_entry(tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, load_hf, save_gguf, save_hf
    from ggmlopt.text import ByteTokenizer
    monkeypatch.setattr(registry, "FAMILIES", registry.FAMILIES + (WIDE,))
    model = Wide(WideConfig(vocab_size=257, dim=32, n_layers=2, n_heads=4, ffn_dim=48,
                            max_seq_len=32), seed=1)
    save_hf(model, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "wide_llama"
    assert config["architectures"] == ["WideForCausalLM"]
    back = load_hf(tmp_path / "hf")
    assert type(back) is Wide and back.config == model.config
    for (n, p), (_, q) in zip(model.named_parameters(), back.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=n)
    save_gguf(model, tmp_path / "w.gguf", tokenizer=ByteTokenizer())   # as llama.cpp's llama
    llama, _ = load_gguf(tmp_path / "w.gguf")
    ids = np.arange(20)[None] % 257
    np.testing.assert_array_equal(llama(ids), model(ids))
    assert isinstance(WIDE, Family)
