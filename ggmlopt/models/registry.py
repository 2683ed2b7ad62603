"""The model families ggmlopt implements, by Hugging Face model_type, by
llama.cpp architecture and by model class.  Adding a family: its file (its
config, model and ``FAMILY``) and one line in ``FAMILIES``; see the docs page
"Adding an architecture"."""
from __future__ import annotations

from . import gemma, gemma2, gemma3, gpt2, llama, mistral, phi3, qwen2, qwen3, smollm3
from .family import Family

__all__ = ["FAMILIES", "Family", "family_for_gguf", "family_for_hf", "family_of", "gguf_archs"]

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    phi3.FAMILY,
    smollm3.FAMILY,
    gemma.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    gpt2.FAMILY,
)


def family_of(model) -> Family:
    """The family of a model or config: its class's own (a Qwen2 is a Llama
    subclass, but of Qwen2's family), else its nearest base's; TypeError for
    another object."""
    for cls in type(model).__mro__:   # a user's subclass belongs to its base's family
        for family in FAMILIES:
            if cls in (family.model_class, family.config_class):
                return family
    raise TypeError(f"model: expected a ggmlopt.models.Llama or GPT2 (or another of the "
                    f"families: {', '.join(f.model_class.__name__ for f in FAMILIES)}), got "
                    f"{type(model).__name__}")


def family_for_hf(model_type) -> Family | None:
    """The family of a config.json's model_type, or None."""
    return next((f for f in FAMILIES if f.hf_model_type == model_type), None)


def family_for_gguf(arch) -> Family | None:
    """The family of a GGUF file's general.architecture, or None."""
    return next((f for f in FAMILIES if f.gguf_arch is not None and f.gguf_arch == arch), None)


def gguf_archs(layout: str) -> frozenset[str]:
    """The llama.cpp architectures written by the io module of layout."""
    return frozenset(f.gguf_arch for f in FAMILIES if f.gguf_layout == layout and f.gguf_arch)
