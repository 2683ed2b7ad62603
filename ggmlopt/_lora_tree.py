"""The module tree as LoRA sees it: the layers an adapter wraps, the adapters in
place, their names in the transformers model of the family (where PEFT matches
target_modules), and putting a layer in another's place.  ggmlopt.lora (choosing
and applying), its PEFT config reading and the adapter files all walk the tree
through here."""
from __future__ import annotations

from .models.registry import family_of
from .nn.embedding import Embedding
from .nn.linear import Linear
from .nn.lora_layers import LoRAEmbedding, LoRALinear
from .nn.module import Module, named_modules, named_parameters
from .nn.quantized import QuantizedEmbedding, QuantizedLinear
from .nn.recompute import Checkpoint

__all__ = ["ADAPTABLE", "ADAPTERS", "ALL_LINEAR", "EMBEDDINGS", "adaptable_layers", "hf_names",
           "layers_of", "linears_of", "matches", "named_adapters", "order_in", "replace_layer"]

ALL_LINEAR = "all-linear"   # PEFT's shortcut: every Linear but the output head


def matches(name: str, targets) -> bool:
    """PEFT's rule: a module matches a target that is its whole dotted name or a
    suffix of it on a dot (``q_proj`` and ``self_attn.q_proj`` both match
    ``layers.0.self_attn.q_proj``)."""
    return any(name == t or name.endswith("." + t) for t in targets)


def hf_names(model):
    """name -> the module's name in the transformers model of model's family
    (``model.layers.0.self_attn.q_proj``; the head is ``lm_head`` in both), where
    PEFT matches its target_modules and modules_to_save: a target written as
    PEFT's full name matches as it does there.  The name itself for a model of
    no family (a user's Sequential)."""
    try:
        prefix = family_of(model).hf_prefix
    except TypeError:
        return lambda name: name
    return lambda name: name if name == "lm_head" or name.startswith("lm_head.") \
        else prefix + name


def linears_of(model):
    """(dotted name, parent, key in parent, layer) of every Linear and
    QuantizedLinear in model's tree; key is an attribute name, ``attr.i`` for
    an element of a list or tuple, or a Sequential's ``i`` (what replace_layer
    takes)."""
    return layers_of(model, (Linear, QuantizedLinear))


# the layers an adapter wraps, float32 or kept in their file's types
EMBEDDINGS = (Embedding, QuantizedEmbedding)
ADAPTABLE = (Linear, QuantizedLinear, Embedding, QuantizedEmbedding)


def adaptable_layers(model):
    """layers_of of the kinds an adapter wraps: Linear and Embedding, float32 or
    quantized."""
    return layers_of(model, ADAPTABLE)


ADAPTERS = (LoRALinear, LoRAEmbedding)


def layers_of(model, kinds, *, sort=True):
    """(dotted name, parent, key in parent, layer) of every layer of kinds in
    model's tree, in the order of the model's parameter names (in the tree's
    order without sort)."""
    found = []
    for parent_name, parent in named_modules(model):
        prefix = f"{parent_name}." if parent_name else ""
        for child_name, child in _children(parent):
            if isinstance(child, kinds):
                found.append((prefix + child_name, parent, child_name, child))
            elif isinstance(child, Checkpoint) and isinstance(child.module, kinds):
                # Checkpoint(Linear): the layer under the wrapper's name, put back
                # into the wrapper
                found.append((prefix + child_name, child, WRAPPED, child.module))
    seen, unique = set(), []
    for entry in found:
        if id(entry[3]) not in seen:
            seen.add(id(entry[3]))
            unique.append(entry)
    if not sort:
        return unique
    # in the order of the model's parameter names (lm_head after the layers)
    return sorted(unique, key=order_in(model, unique))


def _children(parent):
    """(name, child) of parent's children as the tree lists them."""
    if callable(getattr(parent, "named_children", None)):
        return list(parent.named_children())
    return list(Module.named_children(parent)) if hasattr(parent, "__dict__") else []


def order_in(model, entries):
    """A sort key of the layers_of entries: the position of each layer's weight
    among named_parameters; where some layer holds no weight Parameter (a kept
    QuantizedLinear), the layer's place in the module tree walked depth first,
    parents before children (named_modules), which is the same order for
    ggmlopt's models: the same seed draws the same adapters over a kept base as
    over its float32 copy."""
    order = {id(p): i for i, (_, p) in enumerate(named_parameters(model))}
    weights = [getattr(entry[3], "weight", None) for entry in entries]
    if all(id(w) in order for w in weights):
        keys = {id(e[3]): order[id(w)] for e, w in zip(entries, weights)}
    else:
        place = {id(m): i for i, (_, m) in enumerate(named_modules(model))}
        keys = {id(e[3]): place.get(id(e[3]), len(place)) for e in entries}
    return lambda entry: keys[id(entry[3])]


# layers_of's key of a layer a Checkpoint wraps itself (Checkpoint(Linear))
WRAPPED = "<wrapped>"


def replace_layer(parent, key: str, new) -> None:
    """Put new where parent's child named key (``attr`` or ``attr.i``; a
    Sequential's ``i``) was.  parent may be a Checkpoint, which lists its
    module's children as its own: the layer goes into that module, or, with
    key WRAPPED, becomes the module the Checkpoint wraps.  TypeError
    (parent as it was) where the tree would not then list new under key."""
    if key == WRAPPED and isinstance(parent, Checkpoint):
        parent.module = new
        return
    holder = parent
    while isinstance(holder, Checkpoint):
        holder = holder.module
    old = dict(_children(holder)).get(key)
    _put(holder, key, new)
    if dict(_children(holder)).get(key) is not new:
        if old is not None:
            _put(holder, key, old)
        raise TypeError(f"parent: a {type(holder).__name__} lists {key!r} as a child but "
                        "does not take another layer in its place")


def _put(parent, key: str, new) -> None:
    """replace_layer's assignment, as parent's kind of container takes it."""
    layers = getattr(parent, "layers", None)
    if key.isdigit() and isinstance(layers, list):   # Sequential: ("0", layer)...
        layers[int(key)] = new
        return
    attr, _, index = key.partition(".")
    if not index:
        setattr(parent, attr, new)
        return
    holder = getattr(parent, attr)
    if isinstance(holder, list):
        holder[int(index)] = new
    else:
        items = list(holder)
        items[int(index)] = new
        # a namedtuple takes its items one by one (its _make takes the list)
        make = getattr(holder, "_make", None) or type(holder)
        setattr(parent, attr, make(items))


def named_adapters(model) -> list[tuple[str, LoRALinear | LoRAEmbedding]]:
    """(dotted module name, LoRALinear or LoRAEmbedding) of every adapted layer of
    model, in the order of named_parameters (``embed_tokens``,
    ``layers.0.self_attn.q_proj``, ...)."""
    return [(name, layer) for name, _, _, layer in adaptable_layers(model)
            if isinstance(layer, ADAPTERS)]
