"""LoRA: low-rank adapters over the frozen Linear layers of any model.

``apply(model)`` wraps the chosen Linear layers (by attribute name: ``q_proj``,
``up_proj``, ``c_attn``...) in place; each one then computes

    y = x W (+ b) + (alpha / rank) * dropout(x) A B

with W (in, out) and b frozen (``requires_grad=False``) and only A (in, rank)
and B (rank, out) trained, as Hugging Face PEFT's ``LoraLayer`` does; every
other parameter of the model is frozen too (PEFT's ``get_peft_model``), except
those named in ``apply(..., trainable=...)`` (PEFT's ``modules_to_save``): A is
Kaiming-uniform (torch's ``kaiming_uniform_(a=sqrt(5))``, fan_in = in) and B
zero, so the wrapped model starts equal to the base.  An OptContext or ``fit``
over the wrapped model holds (and its optimizer and checkpoints keep) only the
adapters.  ``merge(model)`` folds each adapter into its weight and puts the
plain Linear back.  ``apply(model, config=lora_config)`` takes a PEFT
``LoraConfig`` (or a dict of its keys) and adapts what ``peft.get_peft_model``
would, refusing by key what it cannot honour.  ``ggmlopt.io.save_gguf_lora``
writes the adapters as llama.cpp loads them::

    lora.apply(llama, rank=8, alpha=16.0)            # q, k, v, o projections
    windows = ggmlopt.Dataset.from_tokens(ids, n_ctx=256)
    ggmlopt.fit(llama, windows, "cross_entropy", nepoch=1, nbatch_logical=8)
                                                     # trains A and B only
    ggmlopt.io.save_gguf_lora(llama, "adapter.gguf")
    lora.merge(llama)                                # a plain Llama again
"""
from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterable

import numpy as np

from ._args import int_arg
from ._lora_tree import (
    ADAPTERS,
    ALL_LINEAR,
    EMBEDDINGS,
    adaptable_layers,
    hf_names,
    layers_of,
    linears_of,
    matches,
    named_adapters,
    order_in,
    replace_layer,
)
from .models.registry import family_of
from .nn import init
from .nn.embedding import Embedding
from .nn.linear import Linear
from .nn.lora_layers import LoRAEmbedding, LoRALinear, alpha_arg, dropout_arg, rank_arg
from .nn.module import Module, named_parameters
from .nn.quantized import quantized_layers

__all__ = [
    "ALL_LINEAR",
    "DEFAULT_TARGETS",
    "EMBEDDINGS",
    "LoRALinear",
    "apply",
    "freeze_all_but_adapters",
    "merge",
    "named_adapters",
    "other_trainable",
    "print_trainable_parameters",
    "refuse_adapters",
    "trainable_parameters",
]

# the attention's projections by the Llama layout's names: what apply adapts by
# default in a model of no family (a family names its own: Phi-3's fused qkv_proj)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


# ---- argument checks ---------------------------------------------------------------------

def _names_arg(names, arg: str, what: str, allow_empty: bool) -> tuple[str, ...]:
    """names (a str or an iterable of non-empty str) as a tuple; TypeError or
    ValueError naming arg otherwise."""
    if isinstance(names, str):
        names = (names,)
    if isinstance(names, (bytes, bytearray)) or not isinstance(names, Iterable):
        raise TypeError(f"{arg}: expected names of {what} (a tuple of str), got "
                        f"{type(names).__name__}")
    names = tuple(names)
    for t in names:
        if not isinstance(t, str):
            raise TypeError(f"{arg}: expected str names, got {type(t).__name__} {t!r}")
        if not t:
            raise ValueError(f"{arg}: an empty name matches nothing")
    if not names and not allow_empty:
        raise ValueError(f"{arg}: expected at least one name of {what}")
    return names


# characters a module name never holds: a targets string with one is PEFT's
# regular expression (target_modules="...": re.fullmatch over each module's name)
_REGEX_CHARS = frozenset("*+?[](){}|^$\\")


def _target_pattern(targets):
    """The compiled regular expression a targets string other than a plain
    (dotted) name is, or None."""
    if not isinstance(targets, str) or not _REGEX_CHARS & set(targets):
        return None
    try:
        return re.compile(targets)
    except re.error as e:
        raise ValueError(f"targets: {targets!r} is not a valid regular expression "
                         f"({e})") from None


def _refuse_no_match(model, targets, pattern, linears) -> None:
    """The ValueError of targets that adapt nothing: the names the model's layers
    have, and for a regular expression how it is matched."""
    how = ""
    if pattern is not None:
        how = (" (read as a regular expression, which must match a layer's whole dotted "
               "name, as PEFT's target_modules string does: e.g. r'.*\\.(q_proj|v_proj)')")
    if not linears:
        raise ValueError(f"targets: no Linear layer of the model is named {list(targets)}"
                         f"{how}; the model has no Linear layers")
    short = ", ".join(dict.fromkeys(name.rsplit(".", 1)[-1] for name, *_ in linears))
    embeds = ", ".join(dict.fromkeys(e[0].rsplit(".", 1)[-1]
                                     for e in layers_of(model, EMBEDDINGS)))
    raise ValueError(f"targets: no Linear layer of the model is named {list(targets)}{how}; "
                     f"its {len(linears)} Linear layers are named {short} (e.g. "
                     f"{linears[0][0]})" + (f", its embeddings {embeds}" if embeds else ""))


def _warn_unmatched_targets(targets, chosen_names, hf) -> None:
    """Warn about target names that adapt nothing while others do: a misspelt
    name (``qproj``) would otherwise leave its layers without adapters unsaid."""
    unmatched = [t for t in targets if not any(matches(hf(name), (t,)) for name in chosen_names)]
    if unmatched:
        warnings.warn(f"targets: {', '.join(map(repr, unmatched))} "
                      f"match{'es' if len(unmatched) == 1 else ''} no layer of the model; "
                      f"the other names adapt {len(chosen_names)} layer(s)", UserWarning,
                      stacklevel=4)


def _warn_short_name_matches(pattern, names, hf) -> None:
    """Warn when a targets regular expression picks layers by ggmlopt's names
    alone: PEFT matches the transformers names only, so the same
    target_modules there adapts fewer layers (or none)."""
    extra = [name for name in names if not pattern.fullmatch(hf(name))]
    if extra:
        shown = ", ".join(f"{name!r} (not {hf(name)!r})" for name in extra[:2])
        more = f" and {len(extra) - 2} more" if len(extra) > 2 else ""
        warnings.warn(f"targets: the regular expression matches {len(extra)} layer(s) only by "
                      f"ggmlopt's name, not by the transformers name PEFT matches: {shown}"
                      f"{more}; PEFT would not adapt them; write the expression for the "
                      f"transformers names to adapt what PEFT adapts", stacklevel=4)


def _default_targets(model) -> tuple[str, ...]:
    """The attention's projections of model's family (the Llama layout's names
    for a model of no family)."""
    try:
        return family_of(model).lora_targets
    except TypeError:
        return DEFAULT_TARGETS


def _model_arg(model) -> None:
    """TypeError naming model unless it is a module tree: a Module, or an object
    with parameters() or named_parameters() (the model protocol)."""
    if not (isinstance(model, Module) or callable(getattr(model, "parameters", None))
            or callable(getattr(model, "named_parameters", None))):
        raise TypeError(f"model: expected a model (a ggmlopt.nn.Module or an object with "
                        f"parameters()), got {type(model).__name__}")


def _targets_arg(targets) -> tuple[str, ...]:
    return _names_arg(targets, "targets", "Linear layers", allow_empty=False)


# ---- adapters in the tree (walked in ggmlopt._lora_tree) -------------------------------

def refuse_adapters(model, saver: str) -> None:
    """Raise ValueError when model holds LoRA adapters: a model file written by
    saver (e.g. "save_gguf") holds the base weights only, and writing it from an
    adapted model would silently drop the adapters."""
    adapted = named_adapters(model)
    if adapted:
        raise ValueError(f"model: {saver} writes a base model, but {len(adapted)} layers hold "
                         f"LoRA adapters ({adapted[0][0]}, ...): call ggmlopt.lora.merge(model) "
                         f"first to fold them in, or write the adapters alone with "
                         f"ggmlopt.io.save_gguf_lora")


_OUTPUT_HEADS = ("lm_head",)


def _trainable_arg(trainable) -> tuple[str, ...]:
    return _names_arg(trainable, "trainable", "modules or parameters", allow_empty=True)


def _kept_trainable(name: str, trainable) -> bool:
    """apply's trainable rule on a parameter's dotted name: its own name or the
    name of a module above it (its layer, ``mlp``, ``layers.0``...) equals an
    entry or ends with "." + the entry, as targets match."""
    while name:
        if matches(name, trainable):
            return True
        name = name.rpartition(".")[0]
    return False


def _refuse_a_tied_head(model, targets, linears, hf, selects) -> None:
    """A target naming the output head of a model whose head is its token
    embedding (tied) is refused, not dropped: PEFT wraps such a head's lm_head
    module in an adapter of its own, and ggmlopt's tied head is the embedding
    itself, with no layer to wrap."""
    try:
        family_of(model)
    except TypeError:
        return   # a user's model: its names are its own
    if any(matches(hf(name), _OUTPUT_HEADS) for name, *_ in linears):
        return   # an untied head: a Linear like the others
    if not selects("lm_head"):
        return
    # the target that names it (a regular expression is the one target)
    t = next((t for t in targets if matches("lm_head", (t,))), targets[0])
    raise ValueError(f"targets: {t!r} names the output head, which is the token "
                     f"embedding in this model (tied embeddings); PEFT would adapt "
                     f"the tied lm_head apart, ggmlopt has no adapter for it: adapt "
                     f"the embedding (targets 'embed_tokens', or 'wte' for GPT-2) or "
                     f"train it whole (trainable)")


def _peft_would_also_train(param_names, entry: str) -> list[str]:
    """The modules PEFT's modules_to_save=[entry] trains beyond what apply's
    trainable=(entry,) keeps: PEFT matches any module name that ends with the
    entry, on a dot or not ("norm" also takes every input_layernorm)."""
    extra: dict[str, None] = {}
    for name in param_names:
        if _kept_trainable(name, (entry,)):
            continue
        module = name.rpartition(".")[0]
        while module:
            if module.endswith(entry):
                extra[module] = None
                break
            module = module.rpartition(".")[0]
    return list(extra)


def trainable_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts of model, each parameter once (a tied
    embedding counts once), adapters included: PEFT's get_nb_trainable_parameters.
    As there, a module that trains whole beside adapters (apply's ``trainable``,
    PEFT's modules_to_save) counts twice in the total: PEFT keeps its frozen
    original beside the trained copy (ggmlopt trains the module itself, but the
    line stays PEFT's)."""
    _model_arg(model)
    trainable = total = 0
    for _, p in named_parameters(model):
        total += p.data.size
        if p.requires_grad:
            trainable += p.data.size
    for _, layer in quantized_layers(model):   # weights kept in their file's types
        total += layer.size
    if named_adapters(model):
        adapters = {id(p) for _, layer in named_adapters(model)
                    for p in (layer.lora_a, layer.lora_b)}
        total += sum(p.data.size for _, p in named_parameters(model)
                     if p.requires_grad and id(p) not in adapters)
    return trainable, total


def print_trainable_parameters(model) -> None:
    """Print PEFT's line: ``trainable params: 921,600 || all params: 135,436,608 ||
    trainable%: 0.6805``."""
    trainable, total = trainable_parameters(model)
    share = 100 * trainable / total if total else 0.0
    print(f"trainable params: {trainable:,d} || all params: {total:,d} || "
          f"trainable%: {share:.4f}")


def other_trainable(model) -> list[str]:
    """The dotted names of model's trainable parameters that are not LoRA adapters."""
    adapters = {id(p) for _, layer in named_adapters(model) for p in (layer.lora_a, layer.lora_b)}
    return [name for name, p in named_parameters(model)
            if p.requires_grad and id(p) not in adapters]


class _Default:
    """An argument's default, told apart from the same value given (which
    clashes with apply's config); repr: the value's, as help() shows it."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return repr(self.value)

    # equal to its value, as the plain default it stands for is (a test or tool
    # reading inspect.signature(apply) sees trainable=() and rank=8)
    def __eq__(self, other):
        return self.value == (other.value if isinstance(other, _Default) else other)

    def __hash__(self):
        return hash(self.value)


# apply's defaults (help() shows the values)
_RANK, _ALPHA, _TARGETS = _Default(8), _Default(16.0), _Default(None)
_DROPOUT, _TRAINABLE, _USE_RSLORA = _Default(0.0), _Default(()), _Default(False)


def apply(model, rank=_RANK, alpha=_ALPHA, targets=_TARGETS, dropout=_DROPOUT, seed=0,
          trainable=_TRAINABLE, use_rslora=_USE_RSLORA, *, config=None):
    """Wrap model's Linear layers named in targets in LoRALinear adapters, in place,
    and freeze everything else, as PEFT's ``get_peft_model`` does.

    model: any module tree (a Llama, a GPT2, a Sequential, a user's module).
    targets: names of Linear layers: a layer matches a target equal to its
    dotted module name or to a dot-separated suffix of it (``q_proj``,
    ``mlp.up_proj``, ``layers.0.self_attn.v_proj``; GPT-2's ``c_attn``...), or
    ``"all-linear"``: every Linear but the output head (``lm_head``), PEFT's
    shortcut; default (None): the attention's projections, ``q_proj``,
    ``k_proj``, ``v_proj`` and ``o_proj`` (Phi-3's ``qkv_proj`` and ``o_proj``,
    GPT-2's ``c_attn`` and ``attn.c_proj``); or, as PEFT's target_modules
    string, a regular expression that
    matches a layer's whole name (``r".*\\.(q_proj|v_proj)"``; the transformers
    name, ``model.layers.0.self_attn.q_proj``, or ggmlopt's, with a UserWarning
    for the layers matched by ggmlopt's name alone, which PEFT, matching the
    transformers names, would not adapt).  rank (int >= 1),
    alpha (finite, nonzero): every adapter's A is (in, rank), B (rank, out), its
    output scaled by alpha / rank.  dropout: the drop probability in [0, 1) on
    the adapters' input while training.  seed: the
    A matrices are drawn from ``numpy.random.default_rng(seed)`` in the order of
    the model's parameters.  trainable: names of modules or parameters that keep
    training beside the adapters (PEFT's ``modules_to_save``), matched as targets
    are: ``("lm_head", "norm")`` keeps the head and the final norm trainable;
    a module's name (``mlp``, ``layers.0``) keeps every parameter under it.  A
    name may not cover a layer that targets adapt.  PEFT matches
    modules_to_save on any suffix (its "norm" also trains every
    ``input_layernorm``): where a name would train more there, a UserWarning
    names the modules to add.  use_rslora: PEFT's rank-stabilised scaling,
    alpha / sqrt(rank) (the adapters then hold alpha * sqrt(rank) as their
    alpha, which PEFT's and llama.cpp's alpha / rank make the same scale).

    Afterwards only the adapters (and what trainable names) train: every other
    parameter is frozen (``requires_grad=False``: no gradient, no optimizer
    state) and keeps its name (``layers.0.self_attn.q_proj.weight``); the
    adapters are ``layers.0.self_attn.q_proj.lora_a`` (in, rank) and ``.lora_b``
    (rank, out).  The model's output is unchanged (B is zero).  Build the
    OptContext (or call fit) after apply; ``print_trainable_parameters(model)``
    shows what trains.  Returns the list of named_adapters(model).

    config: a ``peft.LoraConfig``, a dict with its keys (as adapter_config.json
    holds them) or any object with its attributes: the layers and settings
    ``peft.get_peft_model(hf_model, config)`` gives the transformers model of
    model's family, matched on the transformers module names
    (``model.layers.0.self_attn.q_proj``) as PEFT matches them.  It takes the
    place of rank, alpha, targets, dropout, trainable and use_rslora (giving
    one of those too is a TypeError); seed still draws the A matrices.  The
    keys (a missing one takes LoraConfig's default: r 8, lora_alpha 8, so a
    scaling of 1): r, lora_alpha, lora_dropout, use_rslora as those arguments;
    target_modules a list of names (PEFT's rule: a whole name or a dotted
    suffix), a regular expression string over the whole name, "all-linear",
    or None: PEFT's default for the model type (``q_proj`` and ``v_proj`` for
    Llama, Mistral, Qwen2, Qwen3 and Gemma 3, ``c_attn`` for GPT-2; Phi-3 and
    SmolLM3 have none, so PEFT and apply refuse None); exclude_modules,
    layers_to_transform and layers_pattern as PEFT selects with them;
    rank_pattern and alpha_pattern give the matched layers their own rank and
    alpha (PEFT's first matching key); modules_to_save trains whole every
    module whose name ends with an entry (PEFT's rule: ``"norm"`` takes
    ``input_layernorm`` too), and no adapter goes inside one; init_lora_weights
    True (Kaiming-uniform A, torch's ``kaiming_uniform_(a=sqrt(5))`` as PEFT
    draws it, from seed's generator rather than torch's) or "gaussian" (A ~
    N(0, (1/rank)^2)).  Accepted as they change nothing computed here:
    task_type, peft_type "LORA", base_model_name_or_path, revision,
    fan_in_fan_out (PEFT sets it from the layer type), ensure_weight_tying on
    an untied model, and the settings of refused options left at their
    defaults.  Refused (ValueError naming the key): use_dora, bias other than
    "none", lora_bias, use_qalora, target_parameters, any other
    init_lora_weights (False starts B nonzero; PiSSA, OLoRA, LoftQ, EVA...
    compute the start from the base or data), inference_mode=True (PEFT then
    trains nothing; adapter_config.json files hold it: set it False to train,
    or load a trained adapter with ggmlopt.io.load_peft), layer replication,
    trainable tokens, aLoRA and the other variants with tensors of their own,
    and on a model whose head is its token embedding (tied) what PEFT would
    untie: modules_to_save naming the embedding or head without
    ensure_weight_tying, an embedding adapter with it; any other key that is
    set and unknown.  A modules_to_save entry, rank_pattern or alpha_pattern
    key that matches nothing is warned about (PEFT ignores it too).

    Raises ValueError when no Linear matches (the message lists the Linear
    names the model has), when a trainable name matches no parameter or covers
    a layer that targets adapt, when the model already has adapters (merge
    first), for rank < 1 or a bad alpha or dropout, for a config setting
    ggmlopt cannot honour (naming the key); TypeError for arguments of
    the wrong type, a config of another kind, or config with one of the
    arguments it replaces.  On an error the model is unchanged.
    """
    _model_arg(model)
    given = [name for name, value in (("rank", rank), ("alpha", alpha), ("targets", targets),
                                      ("dropout", dropout), ("trainable", trainable),
                                      ("use_rslora", use_rslora))
             if not isinstance(value, _Default)]
    if config is not None:
        # (the plan reads lora's own helpers: imported here, not at lora's import)
        from ._lora_config import CONFIG_KEY_OF, config_plan
        if given:
            raise TypeError(f"apply: {', '.join(given)} given with config, which sets "
                            f"{', '.join(CONFIG_KEY_OF[g] for g in given)} itself; "
                            f"set {'them' if len(given) > 1 else 'it'} in config, or pass no "
                            f"config")
        plan = config_plan(model, config)
        try:
            return _apply(model, 8, 8.0, plan.targets, plan.dropout, seed, plan.trainable,
                          False, layers=plan.layers, init=plan.init, exact=True)
        except ValueError as e:   # the core's message names its argument: say the key
            arg = str(e).partition(":")[0]
            if arg in ("targets", "trainable"):
                key = CONFIG_KEY_OF[arg]
                raise ValueError(f"config's {key} (apply's {arg}): "
                                 f"{str(e).partition(': ')[2]}") from None
            raise
    rank, alpha, targets, dropout, trainable, use_rslora = (
        v.value if isinstance(v, _Default) else v
        for v in (rank, alpha, targets, dropout, trainable, use_rslora))
    return _apply(model, rank, alpha, targets, dropout, seed, trainable, use_rslora)


def _apply(model, rank, alpha, targets, dropout, seed, trainable, use_rslora, *,
           layers=None, init=True, exact=False):
    """apply's work, its arguments resolved.  layers: {ggmlopt module name:
    (rank, alpha)} of layers whose adapter differs from rank and alpha (a
    PEFT config's rank_pattern and alpha_pattern); init: True (Kaiming-uniform
    A) or "gaussian" (PEFT's A ~ N(0, (1/rank)^2)); B is zero either way.
    exact: targets are whole transformers names, matched whole (a config's
    choice: a suffix rule would add a nested layer PEFT left out)."""
    rank = rank_arg(rank)
    alpha = alpha_arg(alpha)
    dropout = dropout_arg(dropout)
    if not isinstance(use_rslora, (bool, np.bool_)):
        raise TypeError(f"use_rslora: expected a bool, got {type(use_rslora).__name__}")
    if use_rslora:
        alpha = alpha * math.sqrt(rank)
    if targets is None:
        targets = _default_targets(model)
    # PEFT takes its shortcut in any case ("ALL-LINEAR")
    all_linear = isinstance(targets, str) and targets.lower() == ALL_LINEAR
    pattern = _target_pattern(targets)
    targets = _targets_arg(targets)
    trainable = _trainable_arg(trainable)
    seed = int_arg(seed, "seed", 0)
    linears = linears_of(model)
    hf = hf_names(model)
    if exact:
        def selects(name):
            return hf(name) in targets
    elif pattern is not None:   # PEFT's regular expression over the whole module name
        def selects(name):
            return bool(pattern.fullmatch(hf(name)) or pattern.fullmatch(name))
    else:
        def selects(name):
            return matches(hf(name), targets)
    embeddings = [e for e in layers_of(model, EMBEDDINGS) if selects(e[0]) and not all_linear]
    adapted = [name for name, layer in named_adapters(model)]
    if adapted:
        raise ValueError(f"model: it already has LoRA adapters ({', '.join(adapted[:3])}"
                         f"{', ...' if len(adapted) > 3 else ''}); merge(model) first")
    if all_linear:
        chosen = [entry for entry in linears if not matches(entry[0], _OUTPUT_HEADS)]
    else:
        chosen = [entry for entry in linears if selects(entry[0])]
    if pattern is not None:
        _warn_short_name_matches(pattern, [e[0] for e in chosen + embeddings], hf)
    _refuse_a_tied_head(model, targets, linears, hf, selects)
    if not chosen and not embeddings:
        _refuse_no_match(model, targets, pattern, linears)
    if pattern is None and not all_linear:
        _warn_unmatched_targets(targets, [e[0] for e in chosen + embeddings], hf)
    params = named_parameters(model)
    to_adapt = [name for name, *_ in chosen + embeddings]
    kept = [(name, layer) for name, layer in quantized_layers(model) if name not in to_adapt]
    for t in trainable:
        # a layer kept in its file's type has no Parameter to train whole: naming it
        # (or a block holding it) would train the rest and leave it frozen
        covered = [(name, layer) for name, layer in kept if _kept_trainable(hf(name), (t,))]
        if covered:
            name, layer = covered[0]
            more = f" (and {len(covered) - 1} more)" if len(covered) > 1 else ""
            raise ValueError(f"trainable: {t!r} covers {name}{more}, kept in its file's type "
                             f"({layer.qtype}), which cannot train whole; give it an adapter "
                             f"(targets) or load the model with keep_types=False")
        if not any(_kept_trainable(hf(name), (t,)) for name, _ in params):
            tied = " (its output head is the token embedding, tied: name that, " \
                "'embed_tokens', or 'wte' for GPT-2)" if matches("lm_head", (t,)) else ""
            raise ValueError(f"trainable: {t!r} names no module or parameter of the model"
                             f"{tied} (its parameters are named like {params[0][0]!r})")
        # a layer is adapted or trained whole, never both: the adapter would freeze
        # the weight the name asked to train
        both = [name for name in to_adapt if _kept_trainable(hf(name), (t,))]
        # ... and a name inside an adapted layer (its bias) would stay frozen
        both += [name for name, _ in params if _kept_trainable(hf(name), (t,))
                 and any(name.startswith(a + ".") for a in to_adapt)]
        if both:
            raise ValueError(f"trainable: {t!r} covers {both[0]}"
                             f"{f' (and {len(both) - 1} more)' if len(both) > 1 else ''}, "
                             f"which targets adapt; a layer either gets an adapter (targets) "
                             f"or trains whole (trainable), not both")
    for t in trainable:
        # the same names in PEFT's modules_to_save train more (a plain suffix): say so,
        # where a user porting a PEFT config would otherwise train fewer parameters
        extra = [m for m in _peft_would_also_train((name for name, _ in params), t)
                 if not any(_kept_trainable(m, (a,)) for a in to_adapt)]
        if extra:
            shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5
                                            else "")
            warnings.warn(f"trainable: {t!r} keeps the modules whose dotted name is or ends "
                          f"in .{t} training; PEFT's modules_to_save=[{t!r}] matches any name "
                          f"ending in {t!r} and would also train {shown}: name those to "
                          f"train them too", UserWarning, stacklevel=3)
    chosen_weights = {id(p) for *_, layer in chosen
                      for p in (getattr(layer, "weight", None), layer.bias)
                      if p is not None} | {id(layer.weight) for *_, layer in embeddings
                                           if getattr(layer, "weight", None) is not None}
    _forget_frozen(model)
    gen = np.random.default_rng(int(seed))
    # in the order of the parameter names (an embedding's first), one generator
    targets_found = chosen + embeddings
    # every adapter is made before any goes in, and a failure anywhere (a MemoryError
    # of a big rank_pattern rank, a layer that cannot be put in its place) puts the
    # model back as it was: its layers in their places, every parameter's flag
    flags = [(p, p.requires_grad) for _, p in named_parameters(model)]
    built, replaced = [], []
    try:
        for name, parent, key, layer in sorted(targets_found,
                                               key=order_in(model, targets_found)):
            r, a = (layers or {}).get(name, (rank, alpha))
            adapter = LoRAEmbedding(layer, r, a, rng=gen) if isinstance(layer, EMBEDDINGS) \
                else LoRALinear(layer, r, a, dropout=dropout, rng=gen)
            built.append((parent, key, adapter))
            if init == "gaussian" and isinstance(adapter, LoRALinear):
                # PEFT's "gaussian" redraws A (B stays zero; an embedding's init is
                # the same either way there)
                adapter.lora_a.data[...] = gen.normal(0.0, 1.0 / r, adapter.lora_a.data.shape)
        for parent, key, adapter in built:
            replace_layer(parent, key, adapter)
            replaced.append((parent, key, adapter))
        freeze_all_but_adapters(model, trainable, skip=chosen_weights)
    except BaseException:
        for parent, key, adapter in reversed(replaced):
            replace_layer(parent, key, adapter._base)
        for p, trained in flags:
            p.requires_grad = trained
        _forget_frozen(model)
        raise
    return named_adapters(model)


def freeze_all_but_adapters(model, trainable=(), *, skip=frozenset()) -> None:
    """Freeze every parameter of model that is not a LoRA adapter and not named in
    trainable (apply's rule); merge gives their trainability back."""
    adapters = {id(p) for _, layer in named_adapters(model) for p in (layer.lora_a, layer.lora_b)}
    hf = hf_names(model)
    frozen = set()
    for name, p in named_parameters(model):
        if id(p) in skip or id(p) in adapters:
            continue  # an adapter froze its base itself and gives it back on merge
        if not _kept_trainable(hf(name), trainable):
            if p.requires_grad:
                p.requires_grad = False
                frozen.add(name)
        else:   # as PEFT's modules_to_save: what it names trains, frozen before or not
            p.requires_grad = True
    _remember_frozen(model, frozen)


# The dotted names of the parameters apply froze beside the adapted weights, so that
# merge gives their trainability back: an attribute of the model (every model apply
# walks has a __dict__), which goes with it, and which a deep copy or a pickle of it
# carries, where its parameters' ids change.  Names, not Parameters: the record
# keeps no frozen base alive.
_FROZEN_ATTR = "_lora_frozen_names"


def _remember_frozen(model, frozen: set[str]) -> None:
    setattr(model, _FROZEN_ATTR, frozenset(frozen) | frozenset(getattr(model, _FROZEN_ATTR, ())))


def _forget_frozen(model) -> frozenset[str]:
    """What apply froze, forgotten (merge gives it back)."""
    names = frozenset(getattr(model, _FROZEN_ATTR, ()))
    if _FROZEN_ATTR in vars(model):
        delattr(model, _FROZEN_ATTR)
    return names


def _merged_linear(layer: LoRALinear) -> Linear:
    """A float32 Linear of layer's merged weight (its quantized base dequantized)
    and its bias Parameter; the weight trains, as a Linear's does, unless the
    model's other parameters were frozen by apply."""
    with init.skip_init():
        merged = Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    merged.weight.data[...] = layer.merged_weight()
    if layer.bias is not None:
        merged.bias = layer.bias
        merged.bias.requires_grad = bool(layer._base_trains[1])
    if "needs_input_grad" in vars(layer):
        merged.needs_input_grad = layer.needs_input_grad
    return merged


def _merged_embedding(layer: LoRAEmbedding) -> Embedding:
    """A float32 Embedding of layer's merged weight (its quantized base
    dequantized), trainable as an Embedding's weight is unless apply froze the
    model's other parameters."""
    with init.skip_init():
        merged = Embedding(layer.num_embeddings, layer.embedding_dim,
                           padding_idx=layer.padding_idx)
    merged.weight.data[...] = layer.merged_weight()
    return merged


def merge(model):
    """Fold every adapter of model into its weight (W += alpha / rank * A B,
    summed in float64) and put the plain Linear back, in place; every parameter
    trains again if it did before apply.  The merged model's forward
    equals the adapted model's (to float32 rounding).  Returns model.

    Raises ValueError when model has no adapters."""
    _model_arg(model)
    adapters = [(parent, key, layer) for _, parent, key, layer in adaptable_layers(model)
                if isinstance(layer, ADAPTERS)]
    if not adapters:
        raise ValueError("model: it has no LoRA adapters to merge (see ggmlopt.lora.apply)")
    # a language model's tied head (lm_head None: GPT-2 always) reads the token
    # embedding the adapter is merged into
    if getattr(model, "lm_head", True) is None and \
            any(layer is getattr(model, "_embedding", None) for *_, layer in adapters):
        warnings.warn("model: its output head is tied to the token embedding, so merging the "
                      "embedding's adapter changes the head too (the adapted model's head read "
                      "the base weight): the merged model's logits differ", UserWarning,
                      stacklevel=2)
    for parent, key, layer in adapters:
        if layer.weight is None:   # over a quantized base: a float32 layer comes back
            replace_layer(parent, key, _merged_embedding(layer) if isinstance(layer, LoRAEmbedding)
                     else _merged_linear(layer))
            continue
        layer.weight.data[...] = layer.merged_weight()
        base = layer._base
        own = (layer.weight, getattr(layer, "bias", None))
        base.weight = layer.weight
        if isinstance(layer, LoRALinear):
            base.bias = layer.bias
        for p, trained in zip(own, layer._base_trains):
            if p is not None:
                p.requires_grad = trained
        if "needs_input_grad" in vars(layer):
            base.needs_input_grad = layer.needs_input_grad
        base._shape = None   # its buffers are stale: the next forward makes new ones
        replace_layer(parent, key, base)
    frozen = _forget_frozen(model)
    for name, p in named_parameters(model):
        if name in frozen:
            p.requires_grad = True
    return model
