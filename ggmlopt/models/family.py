"""Family: what makes one architecture (Llama, Qwen2, Gemma 3, ...) itself beyond
its model class: how a Hugging Face ``config.json`` and a llama.cpp GGUF file
describe it, both ways.

Each family's file (``ggmlopt/models/<family>.py``) defines one ``FAMILY``;
``ggmlopt.models.registry`` lists them, and the readers and writers of
``ggmlopt.io`` go through the registry, knowing no family by name.  A hook a
family does not need is left at its default: the Llama layout's behaviour.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Family"]


def _no_check(config: Any) -> None:
    return None


def _no_gguf_keys(writer: Any, config: Any, arch: str) -> None:
    return None


def _no_gguf_fields(fields: Mapping[str, Any], key: Callable[..., Any], head_dim: int,
                    where: str) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture.

    Hugging Face: ``hf_model_type`` (config.json's model_type) and
    ``hf_architecture``; ``from_hf(hf, where)`` the config a config.json
    describes (every key implemented or refused by name: a dropped key would be
    another model), ``to_hf(config)`` the config.json that transformers loads;
    ``hf_prefix`` before the parameter names; ``hf_transposed``: Linear weights
    are stored (out, in) (torch's Linear; GPT-2's Conv1D stores ours);
    ``hf_padding``: transformers builds the token embedding with
    ``padding_idx=pad_token_id`` (``embed_tokens``; not GPT-2's), ``hf_pad_default``
    its config class's pad_token_id where a config.json has none.

    llama.cpp: ``gguf_arch`` (general.architecture, None: no GGUF) written by
    the io module of ``gguf_layout`` ("llama": ggmlopt.io.gguf_llama, "gpt2");
    for the llama layout, ``gguf_keys`` the ``<arch>.*`` keys read beyond the
    layout's, ``gguf_fields(fields, key, head_dim, where)`` the config fields
    they give, ``gguf_write(writer, config, arch)`` writes them,
    ``gguf_check(config)`` refuses (or warns about) what the architecture
    cannot hold, ``gguf_names`` maps Hugging Face name suffixes to llama.cpp's
    beyond the layout's, ``gguf_norm_offset`` is added to the norm weights in
    the file (Gemma's 1 + w), and ``parameter_shapes(config)`` lists (name,
    shape) of the model's parameters without building it (None: Llama's).

    ``lora_targets``: the attention's projections by name, what
    ``lora.apply`` adapts by default.
    """

    name: str
    model_class: type
    config_class: type
    hf_model_type: str
    hf_architecture: str
    from_hf: Callable[[Mapping[str, Any], str], Any]
    to_hf: Callable[[Any], dict[str, Any]]
    hf_prefix: str = "model."
    hf_transposed: bool = True
    hf_padding: bool = True
    hf_pad_default: int | None = None
    gguf_arch: str | None = None
    gguf_layout: str = "llama"
    gguf_keys: frozenset[str] = frozenset()
    gguf_fields: Callable[..., dict[str, Any]] = _no_gguf_fields
    gguf_write: Callable[[Any, Any, str], None] = _no_gguf_keys
    gguf_check: Callable[[Any], None] = _no_check
    gguf_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    gguf_norm_offset: float = 0.0
    parameter_shapes: Callable[[Any], list[tuple[str, tuple[int, ...]]]] | None = None
    # the attention's projections, as lora.apply adapts them when not told which
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
