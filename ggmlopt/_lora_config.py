"""A PEFT ``LoraConfig`` as lora.apply's plan: which layers
``peft.get_peft_model`` would adapt on the transformers model of a ggmlopt
model's family, with what rank, alpha, dropout and initialisation, and which
modules it trains whole; what ggmlopt cannot honour refused by key
(``apply(model, config=...)``, see ggmlopt.lora.apply)."""
from __future__ import annotations

import dataclasses
import math
import numbers
import re
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._lora_tree import ALL_LINEAR, adaptable_layers, hf_names
from .models.registry import family_of
from .nn.linear import Linear
from .nn.lora_layers import alpha_arg, dropout_arg, rank_arg
from .nn.module import named_modules, named_parameters
from .nn.quantized import QuantizedLinear, quantized_layers

__all__ = ["CONFIG_KEY_OF", "PEFT_DEFAULT_TARGETS", "config_plan", "pattern_value"]

# apply's argument -> the PEFT LoraConfig key that sets it
CONFIG_KEY_OF = {"rank": "r", "alpha": "lora_alpha", "targets": "target_modules",
                  "dropout": "lora_dropout", "trainable": "modules_to_save",
                  "use_rslora": "use_rslora"}

# PEFT's target_modules=None, per transformers model_type: peft.utils.constants'
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING (peft 0.21) for ggmlopt's families;
# a family missing here has no default in PEFT either (phi3, smollm3: PEFT refuses None)
PEFT_DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "llama": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"), "qwen3": ("q_proj", "v_proj"),
    "gemma": ("q_proj", "v_proj"), "gemma2": ("q_proj", "v_proj"),
    "gemma3_text": ("q_proj", "v_proj"), "gpt2": ("c_attn",)}

# keys that change nothing ggmlopt computes (metadata; fan_in_fan_out PEFT sets from
# the layer type; the settings of initialisations and variants refused when chosen)
_CONFIG_INERT = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
    "revision", "fan_in_fan_out", "megatron_config", "megatron_core", "loftq_config",
    "eva_config", "corda_config", "lora_ga_config", "qalora_group_size", "runtime_config"})

# keys apply honours
_CONFIG_HONOURED = frozenset({
    "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "modules_to_save",
    "use_rslora", "rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern",
    "init_lora_weights", "inference_mode", "ensure_weight_tying", "bias", "use_dora",
    "lora_bias", "use_qalora", "target_parameters"})

# set (truthy) these change what PEFT computes in ways ggmlopt has no layer for
_CONFIG_REFUSED = {
    "target_parameters": "adapters on parameters (nn.Parameter targets, MoE experts)",
    "alora_invocation_tokens": "activated LoRA (applied only from the invocation tokens on)",
    "layer_replication": "layer replication (a deeper model built from the base's layers)",
    "trainable_token_indices": "trainable token rows (PEFT's TrainableTokens)",
    "use_bdlora": "block-diagonal LoRA", "kasa_config": "KaSA (an SVD-based adapter)",
    "monteclora_config": "MonteCLoRA (sampled adapters)",
    "velora_config": "VeLoRA (its own tensors beside A and B)",
    "arrow_config": "Arrow (routing among adapters)"}


class _ConfigPlan:
    """What a PEFT config asks of apply: targets (the transformers names of the
    layers to adapt, each whole), trainable (of the modules to train whole),
    dropout, layers ({ggmlopt name: (rank, alpha)}, rsLoRA folded into alpha)
    and init."""

    def __init__(self, targets, trainable, dropout, layers, init):
        self.targets, self.trainable, self.dropout = targets, trainable, dropout
        self.layers, self.init = layers, init


def _config_dict(config) -> dict[str, Any]:
    """config's keys and values: a Mapping's items, a dataclass's fields
    (peft.LoraConfig), or an object's attributes of LoraConfig's names (and
    its own, vars(), so that an unknown setting is seen)."""
    if isinstance(config, Mapping):
        values = dict(config)
        if not all(isinstance(k, str) for k in values):
            raise TypeError("config: expected str keys (LoraConfig's names)")
        return values
    if isinstance(config, (str, bytes, numbers.Number)) or config is None:
        raise TypeError(f"config: expected a peft.LoraConfig, a dict of its keys or an "
                        f"object with its attributes, got {type(config).__name__}")
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    known = _CONFIG_INERT | _CONFIG_HONOURED | set(_CONFIG_REFUSED)
    values = {k: v for k, v in getattr(config, "__dict__", {}).items() if not k.startswith("_")}
    values.update({k: getattr(config, k) for k in known if hasattr(config, k)})
    if not values:
        raise TypeError(f"config: a {type(config).__name__} has none of LoraConfig's "
                        f"attributes (r, lora_alpha, target_modules...)")
    return values


def _config_value(key: str, value, check):
    """check(value) (apply's argument checks), its error naming the config's key."""
    try:
        return check(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config's {key}: {str(e).partition(': ')[2] or e}") from None


def _config_names(key: str, value) -> list[str] | None:
    """A config list of module names (list, tuple, set) as a list; None for None;
    ValueError naming key otherwise."""
    if value is None:
        return None
    if isinstance(value, (list, tuple, set, frozenset)) and \
            all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"config's {key}: expected a list of module names, got {value!r}")


def _refuse_config_settings(values: dict[str, Any]) -> None:
    """ValueError naming the first key whose setting apply cannot honour."""
    peft_type = values.get("peft_type")
    if peft_type is not None and str(getattr(peft_type, "value", peft_type)) != "LORA":
        raise ValueError(f"config's peft_type: {peft_type!r} is not LoRA; apply builds LoRA "
                         f"adapters only")
    if values.get("use_dora"):
        raise ValueError("config's use_dora: DoRA (a magnitude vector beside A and B) is not "
                         "supported; set use_dora=False")
    bias = values.get("bias", "none")
    if bias not in (None, "none"):
        raise ValueError(f"config's bias: {bias!r} trains the base's biases, which apply does "
                         f"not (PEFT's default \"none\" is supported); set bias=\"none\", or "
                         f"name the biased layers in modules_to_save to train them whole")
    if values.get("lora_bias"):
        raise ValueError("config's lora_bias: a trained bias on the adapters' B is not "
                         "supported; set lora_bias=False")
    if values.get("use_qalora"):
        raise ValueError("config's use_qalora: QA-LoRA (pooled adapter inputs for group-wise "
                         "quantized bases) is not supported; set use_qalora=False (ggmlopt's "
                         "QLoRA adapts a kept base with plain LoRA)")
    init = values.get("init_lora_weights", True)
    if not (init is True or (isinstance(init, str) and init.lower() == "gaussian")):
        why = ("starts B nonzero (torch's default init for both matrices), so the adapted "
               "model would not start as the base" if init is False else
               "computes the adapters' start from the base weights or data (or changes the "
               "base), which apply does not")
        raise ValueError(f"config's init_lora_weights: {init!r} {why}; use True (PEFT's "
                         f"default: Kaiming-uniform A, zero B) or \"gaussian\"")
    if values.get("inference_mode"):
        raise ValueError("config's inference_mode: True freezes every adapter (PEFT's "
                         "get_peft_model then trains nothing; adapter_config.json files hold "
                         "it); set inference_mode=False to train new adapters, or load a "
                         "trained adapter with ggmlopt.io.load_peft")
    for key, what in _CONFIG_REFUSED.items():
        if values.get(key):
            raise ValueError(f"config's {key}: {values[key]!r}: {what} is not supported; "
                             f"leave it unset")
    for key, value in values.items():
        known = key in _CONFIG_INERT or key in _CONFIG_HONOURED or key in _CONFIG_REFUSED
        if not known and value not in (None, False, "", [], {}, ()):
            raise ValueError(f"config's {key}: {value!r} is a setting apply does not know "
                             f"(a newer PEFT's?), so it cannot tell whether it changes what "
                             f"is computed; leave it unset")


def _layer_index(key: str, layers_pattern) -> int | None:
    """PEFT's layer index of a module name: the number after the first
    layers_pattern (any segment when None) followed by a dot."""
    if not layers_pattern:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        m = None
        for p in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
            m = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
            if m is not None:
                break
    return None if m is None else int(m.group("idx"))


def pattern_value(patterns, which: str, hf_name: str, default, owner: str = "config's"):
    """PEFT's rank_pattern / alpha_pattern lookup: the value of the first key
    (a regular expression) that matches the whole name or a dotted suffix of
    it, else default.  ValueError naming owner's which (a config's, a file's)
    for patterns that are no {regular expression: value} dict."""
    patterns = patterns or {}
    if not isinstance(patterns, dict):
        raise ValueError(f"{owner} {which}: expected an object (a dict) of module-name "  # noqa: TRY004 (a config's value)
                         f"patterns, got {type(patterns).__name__}")
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", hf_name):
                return value
        except re.error as e:
            raise ValueError(f"{owner} {which}: {key!r} is not a valid regular expression "
                             f"({e})") from None
    return default


def _module_names(model, hf) -> dict[str, str]:
    """{transformers name: ggmlopt name} of the model's modules that hold weights:
    its layers and every module above a parameter (a norm, an mlp, a layer)."""
    names = {hf(name): name for name, *_ in adaptable_layers(model)}
    weights = [name for name, _ in named_parameters(model)] + \
        [f"{name}.weight" for name, _ in quantized_layers(model)]
    for name in weights:
        module = name.rpartition(".")[0]
        while module:
            names.setdefault(hf(module), module)
            module = module.rpartition(".")[0]
    return names


def config_plan(model, config) -> _ConfigPlan:
    """The layers, ranks, alphas and modules trained whole that
    ``peft.get_peft_model(hf_model, config)`` gives the transformers model of
    model's family, by ggmlopt's layer names; ValueError naming the key of a
    setting that cannot be honoured (nothing changes)."""
    values = _config_dict(config)
    _refuse_config_settings(values)
    hf = hf_names(model)
    rank = _config_value("r", values.get("r", 8), rank_arg)
    alpha = _config_value("lora_alpha", values.get("lora_alpha", 8), alpha_arg)
    dropout = _config_value("lora_dropout", values.get("lora_dropout", 0.0) or 0.0, dropout_arg)
    rslora = values.get("use_rslora", False)
    if not isinstance(rslora, (bool, np.bool_)):
        raise ValueError(f"config's use_rslora: expected a bool, got {rslora!r}")  # noqa: TRY004 (a config's value)
    try:
        family = family_of(model)
    except TypeError:
        family = None
    # a tied model (one matrix for the token embedding and the head) has no lm_head
    # layer here, where transformers has one that PEFT can match
    tied = family is not None and getattr(model, "lm_head", True) is None
    modules = _module_names(model, hf)
    entries = adaptable_layers(model)
    adaptable = {hf(name): name for name, *_ in entries}
    keys = list(modules) + (["lm_head"] if tied and "lm_head" not in modules else [])
    target = values.get("target_modules")
    if target is None:
        model_type = family.hf_model_type if family is not None else None
        if model_type not in PEFT_DEFAULT_TARGETS:
            raise ValueError(f"config's target_modules: None asks for PEFT's default targets "
                             f"of the model type, and PEFT has none for "
                             f"{model_type or 'a model of no family'}; name the layers (e.g. "
                             f"[\"q_proj\", \"v_proj\"] or \"all-linear\")")
        target = list(PEFT_DEFAULT_TARGETS[model_type])
    # PEFT refuses layers_to_transform with any target_modules string, "all-linear"
    # too (expanded below into names that would escape the layer filter)
    given_str = isinstance(target, str)
    if isinstance(target, str) and target.lower() == ALL_LINEAR:
        # PEFT's shortcut: every Linear (GPT-2's Conv1D) but the output head
        target = [hf(name) for name, _, _, layer in entries
                  if isinstance(layer, (Linear, QuantizedLinear)) and hf(name) != "lm_head"]
    regex = None
    if isinstance(target, str):
        try:
            regex = re.compile(target)
        except re.error as e:
            raise ValueError(f"config's target_modules: {target!r} is not a valid regular "
                             f"expression ({e})") from None
    else:
        target = _config_names("target_modules", target)
    to_transform = values.get("layers_to_transform")
    layers_pattern = values.get("layers_pattern")
    if given_str and (to_transform is not None or layers_pattern is not None):
        raise ValueError("config's layers_to_transform / layers_pattern: PEFT refuses them "
                         "with a target_modules string; give target_modules as a list")
    if layers_pattern and to_transform is None:
        raise ValueError("config's layers_pattern: PEFT needs layers_to_transform with it")
    if to_transform is not None and not (
            (isinstance(to_transform, int) and not isinstance(to_transform, bool)) or
            (isinstance(to_transform, (list, tuple)) and
             all(isinstance(i, int) and not isinstance(i, bool) for i in to_transform))):
        raise ValueError(f"config's layers_to_transform: expected a layer index or a list of "
                         f"them, got {to_transform!r}")
    if layers_pattern is not None and not isinstance(layers_pattern, str):
        _config_names("layers_pattern", layers_pattern)
    using_indexes = to_transform is not None and (
        len(to_transform) != 0 if isinstance(to_transform, (list, tuple)) else True)
    exclude = values.get("exclude_modules")
    if exclude is not None and not isinstance(exclude, str):
        exclude = _config_names("exclude_modules", exclude)
    saved = _config_names("modules_to_save", values.get("modules_to_save")) or []

    def excluded(key):
        # PEFT's check_target_module_exists: exclude_modules, then modules_to_save
        if isinstance(exclude, str):
            if re.fullmatch(exclude, key):
                return True
        elif exclude and (key in exclude or any(key.endswith("." + e) for e in exclude)):
            return True
        return any(re.match(rf"(^|.*\.){m}($|\..*)", key) for m in saved)

    def targeted(key):
        if regex is not None:
            return bool(regex.fullmatch(key))
        if key in target:
            return True   # a name given whole: no layer filter (as PEFT)
        if not any(key.endswith("." + t) for t in target):
            return False
        if not using_indexes:
            return True
        index = _layer_index(key, layers_pattern)
        if index is None:
            return False
        return index == to_transform if isinstance(to_transform, int) else \
            index in to_transform

    try:
        chosen = [key for key in keys if not excluded(key) and targeted(key)]
    except re.error as e:
        raise ValueError(f"config's exclude_modules or modules_to_save: not a valid regular "
                         f"expression ({e})") from None
    wrong = [key for key in chosen if key not in adaptable and key != "lm_head"]
    if wrong:
        raise ValueError(f"config's target_modules: it selects {wrong[0]}, a "
                         f"{type(_layer_at(model, modules[wrong[0]])).__name__}, which LoRA "
                         f"cannot adapt (PEFT refuses it too): only Linear and Embedding "
                         f"layers take adapters")
    if not chosen:
        given = values.get("target_modules")
        if isinstance(given, (set, frozenset)):   # (LoraConfig keeps a list as a set)
            given = sorted(given)
        raise ValueError(f"config's target_modules: {given!r} selects "
                         f"no layer of the model (after exclude_modules, modules_to_save and "
                         f"layers_to_transform), as PEFT would find none; its layers are named "
                         f"like {next(iter(adaptable), '(none)')!r}")
    # modules_to_save: PEFT trains whole every module whose name ends with an entry
    trained = [key for key in keys if any(key.endswith(m) for m in saved)]
    embedding = next((hf(name) for name, _, _, layer in entries
                      if layer is getattr(model, "_embedding", None)), None)
    tying = bool(values.get("ensure_weight_tying"))
    if tied:
        _refuse_untying(saved, trained, chosen, embedding, tying)
        if tying and any(m.split(".")[-1] in ("embed_tokens", "lm_head") for m in saved):
            # PEFT trains one copy for both: the one matrix here
            trained = [key for key in trained if key != "lm_head"] + \
                ([embedding] if embedding is not None else [])
    outermost = sorted({key for key in trained
                        if not any(key.startswith(o + ".") for o in trained)})
    unused = [m for m in saved if not any(key.endswith(m) for key in keys)]
    if unused:
        warnings.warn(f"config's modules_to_save: {', '.join(map(repr, unused))} match"
                      f"{'es' if len(unused) == 1 else ''} no module with weights; PEFT "
                      f"trains nothing for {'it' if len(unused) == 1 else 'them'} either",
                      UserWarning, stacklevel=3)
    layers = {}
    for key in chosen:
        if key == "lm_head" and key not in adaptable:
            continue   # the tied head: the core refuses it, by name
        r = _config_value(f"rank_pattern for {key}",
                          pattern_value(values.get("rank_pattern"), "rank_pattern", key, rank), rank_arg)
        a = _config_value(f"alpha_pattern for {key}",
                          pattern_value(values.get("alpha_pattern"), "alpha_pattern", key, alpha), alpha_arg)
        # rsLoRA's alpha / sqrt(r) as the alpha that gives it over r
        layers[adaptable[key]] = (r, a * math.sqrt(r) if rslora else a)
    for which in ("rank_pattern", "alpha_pattern"):   # PEFT warns of these too
        unmatched = [k for k in values.get(which) or {}
                     if not any(re.match(rf"(.*\.)?({k})$", key) for key in chosen)]
        if unmatched:
            warnings.warn(f"config's {which}: {', '.join(map(repr, unmatched))} match"
                          f"{'es' if len(unmatched) == 1 else ''} no adapted layer and "
                          f"change nothing", UserWarning, stacklevel=3)
    init = "gaussian" if isinstance(values.get("init_lora_weights"), str) else True
    return _ConfigPlan(tuple(chosen), tuple(outermost), dropout, layers, init)


def _refuse_untying(saved, trained, chosen, embedding, tying) -> None:
    """On a tied model, refuse what PEFT would untie: a copy of the embedding or
    head trained apart from the other (modules_to_save without
    ensure_weight_tying, or naming neither by PEFT's embedding names), and an
    embedding adapter that ensure_weight_tying repeats on the head."""
    whole = [key for key in trained if key in ("lm_head", embedding)]
    if whole and not (tying and any(m.split(".")[-1] in ("embed_tokens", "lm_head")
                                    for m in saved)):
        why = (f"PEFT's ensure_weight_tying ties only a module named embed_tokens or "
               f"lm_head, so for {whole[0]} it" if tying else
               "PEFT without ensure_weight_tying")
        raise ValueError(f"config's modules_to_save: it trains {whole[0]} whole, and this "
                         f"model's token embedding and head are one matrix (tied); {why} "
                         f"trains a copy of one and leaves the other the base's, "
                         f"which this model cannot hold: set ensure_weight_tying=True and "
                         f"name embed_tokens or lm_head, or leave them out")
    if tying and embedding in chosen:
        raise ValueError(f"config's ensure_weight_tying: with it PEFT repeats {embedding}'s "
                         f"adapter on the tied output head, which ggmlopt's tied head (the "
                         f"embedding itself) cannot hold; set ensure_weight_tying=False (the "
                         f"head then reads the base embedding, in PEFT as here)")


def _layer_at(model, name: str):
    """The module at a dotted ggmlopt name."""
    return dict(named_modules(model)).get(name)
