"""LoRA adapters as Hugging Face PEFT saves them: a directory with
``adapter_config.json`` and ``adapter_model.safetensors``, which
``peft.PeftModel.from_pretrained`` puts on the transformers model of the same
checkpoint (and llama.cpp's ``convert_lora_to_gguf.py`` converts, except
GPT-2's, whose Conv1D pairs it writes transposed: ``save_gguf_lora`` writes
those).

    lora.apply(model, rank=8)  ... fit ...
    ggmlopt.io.save_peft(model, "adapter/")     # PeftModel.from_pretrained(hf, "adapter/")
    ggmlopt.io.load_peft("adapter/", model)     # and an adapter PEFT trained

PEFT's layout: ``base_model.model.<module>.lora_A.weight`` (rank, in) and
``.lora_B.weight`` (out, rank) for a Linear (A and B transposed from ggmlopt's),
``.lora_embedding_A`` (rank, vocab) and ``.lora_embedding_B`` (dim, rank) for an
embedding, ``<module>.weight`` of the modules trained whole (``modules_to_save``);
module names are the Hugging Face ones (``model.layers.0.self_attn.q_proj``).
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections import Counter
from typing import Any

import numpy as np

from .._lora_tree import EMBEDDINGS, adaptable_layers, named_adapters, replace_layer
from .._optional import import_optional
from ..lora import freeze_all_but_adapters, other_trainable
from ..models.registry import family_of
from ..nn.lora_layers import LoRAEmbedding, LoRALinear, alpha_arg, dropout_arg, rank_arg
from ..nn.module import named_parameters
from ._files import atomic_output, path_arg, read_json_object
from .hf_format import _as_float32, _tied, map_safetensors_file, transposed_weights

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "load_peft", "save_peft"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_ROOT = "base_model.model."   # PeftModel's prefix before the transformers model's names


def _safetensors():
    return import_optional("safetensors.numpy", "interop", "PEFT adapters")


def _hf_name(model, name: str) -> str:
    """A ggmlopt module or parameter name as transformers' model names it."""
    return name if name == "lm_head" or name.startswith("lm_head.") else \
        family_of(model).hf_prefix + name


def _our_name(model, hf_name: str) -> str | None:
    if hf_name == "lm_head" or hf_name.startswith("lm_head."):
        return hf_name
    prefix = family_of(model).hf_prefix
    return hf_name[len(prefix):] if hf_name.startswith(prefix) else None


def _common(values):
    """The most common value (ties: the first seen) and {name: value} of the others."""
    common = Counter(v for _, v in values).most_common(1)[0][0]   # (first seen on ties)
    return common, {name: v for name, v in values if v != common}


def save_peft(model, directory, *, base_model_name_or_path: str | None = None) -> None:
    """Write model's LoRA adapters (ggmlopt.lora.apply's) to directory as PEFT
    saves a LoRA adapter (adapter_config.json and adapter_model.safetensors,
    each atomically; the directory is made when missing), with the parameters
    that train beside them (``apply(trainable=...)``) as its modules_to_save.

    model: a model of one of ggmlopt.models' families.  Ranks and alphas that
    differ between layers go to rank_pattern and alpha_pattern; target_modules
    names each adapted module whole.  Raises ValueError when the model has no
    adapters, when their dropouts differ (PEFT keeps one) or when a module
    trained whole is partly frozen; TypeError for a model of no family."""
    family = family_of(model)   # TypeError for another model
    directory = path_arg(directory, "directory")
    if base_model_name_or_path is not None and not isinstance(base_model_name_or_path, str):
        raise TypeError(f"base_model_name_or_path: expected a str or None, got "
                        f"{type(base_model_name_or_path).__name__}")
    st = _safetensors()
    adapters = named_adapters(model)
    if not adapters:
        raise ValueError("model: it has no LoRA adapters (see ggmlopt.lora.apply)")
    # an embedding adapter has no dropout (as in PEFT): the Linear adapters' one
    dropouts = {float(getattr(getattr(a, "lora_dropout", None), "p", 0.0))
                for _, a in adapters if not isinstance(a, LoRAEmbedding)} or {0.0}
    if len(dropouts) > 1:
        raise ValueError(f"model: its adapters' dropouts differ ({sorted(dropouts)}); a PEFT "
                         "adapter has one lora_dropout")
    tensors: dict[str, np.ndarray] = {}
    for name, a in adapters:
        base = _ROOT + _hf_name(model, name)
        kind = "lora_embedding_" if isinstance(a, LoRAEmbedding) else "lora_"
        suffix = "" if isinstance(a, LoRAEmbedding) else ".weight"
        tensors[f"{base}.{kind}A{suffix}"] = np.ascontiguousarray(a.lora_a.data.T, np.float32)
        tensors[f"{base}.{kind}B{suffix}"] = np.ascontiguousarray(a.lora_b.data.T, np.float32)
    saved_whole = _modules_to_save(model)
    transposed = transposed_weights(model)
    for module, params in saved_whole.items():
        for leaf, p in params:
            data = p.data.T if id(p) in transposed else p.data
            tensors[_ROOT + _hf_name(model, f"{module}.{leaf}")] = \
                np.ascontiguousarray(data, np.float32)
    # a tied embedding that trains whole is one matrix in the input and the head:
    # PEFT keeps its copies tied only with ensure_weight_tying, and then reads the
    # head's copy from the file too
    embedding = _embedding_weight(model)
    tied_whole = _tied(model) and embedding is not None and embedding.requires_grad
    if tied_whole:
        tensors[_ROOT + "lm_head.weight"] = np.ascontiguousarray(embedding.data, np.float32)
    ranks = [(_hf_name(model, n), int(a.rank)) for n, a in adapters]
    alphas = [(_hf_name(model, n), float(a.alpha)) for n, a in adapters]
    rank, rank_pattern = _common(ranks)
    alpha, alpha_pattern = _common(alphas)
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": dropouts.pop(), "target_modules": sorted(n for n, _ in ranks),
        "rank_pattern": {re.escape(k): v for k, v in rank_pattern.items()},
        "alpha_pattern": {re.escape(k): v for k, v in alpha_pattern.items()},
        "modules_to_save": sorted(_hf_name(model, m) for m in saved_whole) or None,
        "bias": "none", "fan_in_fan_out": not family.hf_transposed, "use_rslora": False,
        # every B frozen and every A training: PEFT's MiCA, which trains A alone
        "use_dora": False, "init_lora_weights": "mica" if all(
            not a.lora_b.requires_grad and a.lora_a.requires_grad for _, a in adapters) else True,
        "inference_mode": True,
        "layers_to_transform": None, "layers_pattern": None,
        "ensure_weight_tying": bool(tied_whole),
        "base_model_name_or_path": base_model_name_or_path, "revision": None}
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"directory: {directory!r} is a file")
    os.makedirs(directory, exist_ok=True)
    with atomic_output(os.path.join(directory, ADAPTER_WEIGHTS)) as tmp:
        st.save_file(tensors, tmp, metadata={"format": "pt"})
    with atomic_output(os.path.join(directory, ADAPTER_CONFIG)) as tmp, open(tmp, "w") as f:
        json.dump(config, f, indent=2)


def _embedding_weight(model):
    """The token embedding's float32 weight Parameter, or None when the embedding
    keeps its weight in its file's type (keep_types=True)."""
    return getattr(model._embedding, "weight", None)


def _modules_to_save(model) -> dict[str, list[tuple[str, Any]]]:
    """{module name: [(parameter leaf, Parameter)]} of the parameters that train
    beside the adapters, each module whole (PEFT saves modules, not parameters)."""
    others = set(other_trainable(model))
    if not others:
        return {}
    params = named_parameters(model)
    modules: dict[str, list[tuple[str, Any]]] = {}
    for name in sorted(others):
        module, _, _ = name.rpartition(".")
        modules.setdefault(module, [])
    for name, p in params:
        module, _, leaf = name.rpartition(".")
        if module in modules:
            if name not in others:
                raise ValueError(f"model: {name} is frozen while {module}'s other parameters "
                                 "train; PEFT's modules_to_save trains a module whole")
            modules[module].append((leaf, p))
    return modules


def _read_config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"directory: no {ADAPTER_CONFIG} in {directory!r}")
    config = read_json_object(path)
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r}; only LORA adapters "
                         "are read")
    for key, refused in (("use_dora", "DoRA"), ("bias", "trained biases")):
        value = config.get(key)
        if value not in (None, False, "none"):
            raise ValueError(f"{path}: {key}={value!r}: {refused} are not supported")
    if config.get("lora_bias"):
        raise ValueError(f"{path}: lora_bias: trained adapter biases are not supported")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and (init in _BASE_CHANGING_INITS or init.startswith("pissa")):
        # PEFT computes these adapters' starting point from the base weight and
        # subtracts it from the base when it loads them: the saved A and B mean
        # nothing over the unchanged base
        raise ValueError(f"{path}: init_lora_weights={init!r}: PEFT changes the base weight "
                         f"when it loads such an adapter, which is not supported; save it "
                         f"converted to a plain LoRA (PEFT's save_pretrained with "
                         f"path_initial_model_for_weight_conversion)")
    unsupported = {"alora_invocation_tokens": "activated LoRA (applied only from the invocation "
                                              "tokens on)",
                   "layer_replication": "layer replication (a deeper model built from the "
                                        "base's layers)",
                   "trainable_token_indices": "trainable token rows (PEFT's TrainableTokens)",
                   "use_bdlora": "block-diagonal LoRA",
                   "kasa_config": "KaSA (an SVD-based adapter with its own tensors)",
                   "monteclora_config": "MonteCLoRA (sampled adapters)",
                   "velora_config": "VeLoRA (its own tensors beside A and B)",
                   "arrow_config": "Arrow (routing among adapters)"}
    for key, what in unsupported.items():
        if config.get(key):
            raise ValueError(f"{path}: {key}={config[key]!r}: {what} is not supported")
    return config


# initialisations after which PEFT's base weight is not the checkpoint's
_BASE_CHANGING_INITS = frozenset({"olora", "corda", "loftq", "lora_ga"})


def _tie_whole_embedding(model, whole: dict[str, np.ndarray], config, path: str) -> None:
    """A tied model (one matrix for the token embedding and the head) meeting an
    adapter that trains either whole: PEFT's ensure_weight_tying saves the
    trained matrix as both, which is the tied model's one matrix (the head's
    copy is dropped from whole); without it PEFT trains a copy of one of them
    and leaves the other the base's, which a tied model cannot hold: refused."""
    weight = _embedding_weight(model)
    if not _tied(model) or weight is None:
        return   # (a kept embedding trains no row whole: refused with the other tensors)
    embedding = next(n for n, p in named_parameters(model) if p is weight)
    head = whole.get("lm_head.weight")
    if embedding not in whole and head is None:
        return
    if config.get("ensure_weight_tying") and embedding in whole and head is not None \
            and np.array_equal(head, whole[embedding]):
        del whole["lm_head.weight"]
        return
    trained = embedding if head is None else "lm_head.weight"
    raise ValueError(f"{path}: the adapter trains {trained} whole (modules_to_save) apart "
                     f"from the matrix tied to it (without ensure_weight_tying PEFT trains a "
                     f"copy and leaves the other the base's); this model's token embedding "
                     f"and head are one matrix, so that adapter cannot be loaded onto it")


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    """The adapter file's tensors as float32 (float16 and bfloat16 widened: PEFT
    saves the modules it trains whole in the base's type)."""
    mapped: dict[str, tuple[str, np.ndarray | None]] = {}
    try:
        map_safetensors_file(path, mapped)
    except ValueError as e:
        detail = str(e).removeprefix(f"{path}: ")
        raise ValueError(f"{path}: not a valid safetensors file ({detail})") from None
    tensors = {}
    for name, (dtype, array) in mapped.items():
        if array is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {dtype}; expected floats")
        tensors[name] = np.array(_as_float32(dtype, array), np.float32)
    return tensors


def _in_modules_to_save(config, hf_module: str, path: str) -> bool:
    """PEFT's modules_to_save rule: hf_module, or a module it is inside (an entry
    "mlp" trains the whole MLP: its projections' weights are saved under their
    own names), has a name that ends with an entry."""
    entries = config.get("modules_to_save") or []
    if isinstance(entries, str) or not isinstance(entries, list) or \
            not all(isinstance(e, str) for e in entries):
        raise ValueError(f"{path}: adapter_config.json's modules_to_save: expected a list of "
                         f"module names, got {entries!r}")
    parts = hf_module.split(".")
    return any(".".join(parts[:i]).endswith(e) for i in range(len(parts), 0, -1)
               for e in entries)


def _tie_loaded_embedding(model, loaded: dict[str, np.ndarray], path: str) -> None:
    """The embedding and head weights PEFT saves beside an adapter
    (save_embedding_layers) on a tied model: one matrix, which both copies must
    give; the head's is then the embedding's."""
    head = loaded.pop("lm_head.weight", None)
    if head is None:
        return
    if not _tied(model):
        loaded["lm_head.weight"] = head
        return
    embedding = _embedding_name(model)
    if embedding is None:
        raise ValueError(f"{path}: lm_head.weight fits no parameter of the model")
    if embedding in loaded and not np.array_equal(loaded[embedding], head):
        raise ValueError(f"{path}: its token embedding and lm_head weights differ; this "
                         f"model's are one matrix (tied embeddings)")
    loaded.setdefault(embedding, head)


def _embedding_name(model) -> str | None:
    """The dotted name of the token embedding's weight (float32, or kept in its
    file's type)."""
    weight = _embedding_weight(model)
    if weight is not None:
        return next((n for n, p in named_parameters(model) if p is weight), None)
    layer = model._embedding
    base = getattr(layer, "_base", layer)
    return next((f"{n}.weight" for n, kept in _kept_layers(model).items()
                 if kept is base or kept is layer), None)


def _drop_what_peft_ignores(bases: dict, plain: tuple[dict, ...], adapted: set,
                            path: str) -> None:
    """PEFT loads a base_layer weight only into a layer the file adapts, and a
    plain module weight (trained whole or not) only into a module it does not
    (its state dict has no such key otherwise, and it loads with strict=False):
    the others are dropped, with a UserWarning, instead of overwriting the
    model's weights."""
    found = [(bases, n) for n in bases if n.rpartition(".")[0] not in adapted]
    found += [(d, n) for d in plain for n in d if n.rpartition(".")[0] in adapted]
    for held_in, name in found:
        del held_in[name]
    stray = [name for _, name in found]
    if stray:
        warnings.warn(f"{path}: {len(stray)} tensors are not loaded, as PEFT does not load "
                      f"them ({', '.join(stray[:3])}{', ...' if len(stray) > 3 else ''}: a "
                      f"base weight of a layer it does not adapt, or a whole weight of one "
                      f"it does)", UserWarning, stacklevel=3)


def _kept_layers(model) -> dict:
    """{module name: layer} of the layers that keep their weight in the file's
    type, an adapter's base under the adapter's name."""
    from ..nn.quantized import quantized_layers
    return dict(quantized_layers(model))


def _warn_base_copies_that_differ(params, bases, transposed, path: str) -> None:
    """PEFT saves the base weights of an adapted embedding and head beside the
    adapter and loads them over the model's, as load_peft does.  Where a copy
    differs from the float32 weight the model holds (rounded by a bf16 run, or
    saved over another checkpoint) the model's base changes: said, since an
    adapter written from it (save_gguf_lora) then fits this base, not the
    original file's."""
    moved = []
    for name, value in bases.items():
        p = params.get(name)
        if p is None:
            continue
        given = value.T if id(p) in transposed else value
        if given.shape == p.data.shape and not np.array_equal(given, p.data):
            worst = float(np.max(np.abs(np.asarray(given, np.float32) - p.data)))
            moved.append(f"{name} (by up to {worst:.3g})")
    if moved:
        warnings.warn(f"{path}: the base weights saved with the adapter differ from the "
                      f"model's and replace them, as PEFT loads them: {', '.join(moved[:5])}; "
                      "the model's base is no longer its file's (an adapter written with "
                      "save_gguf_lora then fits this base, not the file it came from)",
                      stacklevel=3)


def _check_kept_base(layer, name: str, value: np.ndarray, path: str) -> None:
    """PEFT saves a base weight with an adapter (an adapted embedding's, the
    embedding and head after a resize); a base kept in its file's type cannot
    take it.  The file's matrix rounded to that type must give the kept bytes:
    then it is the model's own.  A row further than half its norm from the kept
    one (another embedding, a row initialised for an added token) is refused;
    anything between is said with a warning (the model keeps its own base)."""
    from .. import kernels_quant
    # the stored rows: an embedding's, or a Linear's (out, in) as torch holds it
    rows, cols = layer.qweight.shape[0], value.shape[-1] if value.ndim else 0
    if value.shape != (rows, getattr(layer, "embedding_dim", getattr(layer, "in_features", -1))):
        raise ValueError(f"{path}: base tensor {name!r} {value.shape} does not fit the "
                         f"model's layer, kept as {layer.qtype}")
    step, worst = 4096, 0.0
    for r0 in range(0, rows, step):
        ids = np.arange(r0, min(rows, r0 + step), dtype=np.int32)
        given = np.ascontiguousarray(value[r0:r0 + len(ids)], np.float32)
        same = _rounded_as(given, layer.qtype).reshape(len(ids), -1) == \
            np.ascontiguousarray(layer.qweight[r0:r0 + len(ids)]).view(np.uint8).reshape(
                len(ids), -1)
        if same.all():
            continue
        kept = kernels_quant.gather(ids, layer.qtype, layer.qweight, cols)
        apart = np.linalg.norm(given - kept, axis=1)
        size = np.maximum(np.linalg.norm(given, axis=1), np.linalg.norm(kept, axis=1))
        bad = np.flatnonzero(~(apart <= 0.5 * size + 1e-6))
        if bad.size:
            raise ValueError(f"{path}: base tensor {name!r} row {r0 + int(bad[0])} is not the "
                             f"model's (kept as {layer.qtype}): the adapter was trained over "
                             f"another base")
        worst = max(worst, float(np.max(apart / np.maximum(size, 1e-30))))
    if worst > 0:
        warnings.warn(f"{path}: base tensor {name!r} differs from the model's (kept as "
                      f"{layer.qtype}) by up to {100 * worst:.2g}% of a row, more than that "
                      f"type's rounding of it; the model keeps its own (load the base with "
                      f"keep_types=False to take the file's)", UserWarning, stacklevel=3)


def _rounded_as(rows: np.ndarray, qtype: str) -> np.ndarray:
    """float32 rows as a file of type qtype stores them, as bytes (uint8, one row
    a row): float16 and bfloat16 rounded to nearest even, block types through
    the quantizers save_gguf uses."""
    from .. import kernels_quant
    if qtype == "F32":
        out = rows
    elif qtype == "F16":
        out = rows.astype(np.float16)
    elif qtype == "BF16":
        bits = rows.view(np.uint32).astype(np.uint64)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    elif qtype in kernels_quant.QUANTIZE_TYPES:
        out = kernels_quant.quantize(rows, qtype)
    else:
        gguf = import_optional("gguf", "interop", "a GGUF base's rounding")
        out = gguf.quants.quantize(rows, gguf.GGMLQuantizationType[qtype])
    return np.ascontiguousarray(out).view(np.uint8).reshape(rows.shape[0], -1)


def _pattern_value(config, which: str, hf_name: str, default, path: str):
    """PEFT's rank_pattern / alpha_pattern lookup (lora's, the file named in
    its errors)."""
    from .._lora_config import pattern_value
    return pattern_value(config.get(which), which, hf_name, default,
                         f"{path}: adapter_config.json's")


def _config_value(value, path, key: str, check):
    """check(value) (lora's argument checks), its error naming the config's key."""
    try:
        return check(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: adapter_config.json's {key}: "
                         f"{str(e).partition(': ')[2] or e}") from None


def load_peft(directory, model, *, dropout: float | None = None
              ) -> list[tuple[str, LoRALinear | LoRAEmbedding]]:
    """Put a PEFT LoRA adapter (save_peft's, or ``PeftModel.save_pretrained``'s)
    onto model, in place: a LoRALinear (LoRAEmbedding) with the file's rank,
    alpha and values on every module the file adapts, its modules_to_save
    loaded and left trainable, everything else frozen (as lora.apply leaves a
    model).  use_rslora's scaling (alpha / sqrt(rank)) is kept as the alpha
    that gives it; a MiCA adapter (init_lora_weights "mica") trains A alone,
    as in PEFT.  Float16 and bfloat16 tensors are widened to float32.  Plain
    weights the config's modules_to_save does not name (PEFT's
    save_embedding_layers) load frozen, as PEFT loads them; tensors PEFT would
    not load (an adapter of a module the config's target_modules,
    exclude_modules and layers_to_transform do not select) are left out with a
    UserWarning.  Over a base kept in its file's
    types (keep_types=True) a base weight in the file is compared with the kept
    one in that type's rounding (see _check_kept_base), and a module trained
    whole must be float32.  dropout: the adapters' (default the file's
    lora_dropout).

    Returns named_adapters(model).  Raises FileNotFoundError for a missing
    file; ValueError for another adapter type (DoRA, trained biases, adapters
    on parameters other than torch Linear weights: target_parameters), a tensor
    naming a module the model lacks, shapes that do not fit, or a model that
    already has adapters; TypeError for a model of no family.  On any error the
    model is unchanged."""
    family_of(model)
    directory = path_arg(directory, "directory")
    config = _read_config(directory)
    path = os.path.join(directory, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"directory: no {ADAPTER_WEIGHTS} in {directory!r}")
    tensors = _read_tensors(path)
    if named_adapters(model):
        raise ValueError("model: it already has LoRA adapters; load into the base model")
    layers = {name: (parent, key, layer) for name, parent, key, layer in adaptable_layers(model)}
    pairs: dict[str, dict[str, np.ndarray]] = {}
    whole: dict[str, np.ndarray] = {}
    bases: dict[str, np.ndarray] = {}   # an adapted layer's own weight (PEFT saves an
    # embedding's with its adapter: save_embedding_layers)
    loaded: dict[str, np.ndarray] = {}   # a frozen layer's weight, not in modules_to_save
    plain_pairs: set[str] = set()   # adapted by lora_A / lora_B keys (not lora_embedding_)
    adapter_key = re.compile(r"(.+)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)"
                             r"(?:\.default)?(?:\.weight)?$")
    for key, value in tensors.items():
        if not key.startswith(_ROOT):
            raise ValueError(f"{path}: tensor {key!r} is not under {_ROOT!r}")
        hf = key[len(_ROOT):]
        m = adapter_key.match(hf)
        if m is None and ".base_layer." in hf:
            ours = _our_name(model, hf.replace(".base_layer.", "."))
            if ours is None:
                raise ValueError(f"{path}: tensor {key!r} names no module of the model")
            bases[ours] = value
            continue
        if m is None and ".original_module." in hf:
            continue   # the frozen original of a module trained whole: unused beside it
        if m is None:   # a module trained whole, or a base weight PEFT loads as it is
            plain = hf.replace(".modules_to_save.default.", ".").replace(
                ".modules_to_save.", ".")
            ours = _our_name(model, plain)
            if ours is None:
                raise ValueError(f"{path}: tensor {key!r} names no module of the model")
            if plain != hf or _in_modules_to_save(config, plain.rpartition(".")[0], path):
                if ours in whole and not np.array_equal(whole[ours], value):
                    raise ValueError(f"{path}: two different tensors for {plain!r}")
                whole[ours] = value
            else:   # (save_embedding_layers: the embedding and head after a resize)
                loaded[ours] = value
            continue
        ours = _our_name(model, m.group(1))
        if m.group(1) == "lm_head" and _tied(model) and (ours is None or ours not in layers):
            raise ValueError(f"{path}: {key!r} adapts 'lm_head', this model's tied embedding "
                             "(PEFT's ensure_weight_tying adapts the output head beside the "
                             "embedding), which ggmlopt's tied head cannot hold: merge the "
                             "adapter in PEFT (merge_and_unload) and load the merged model, or "
                             "train the adapter without ensure_weight_tying")
        if ours is None or ours not in layers:
            raise ValueError(f"{path}: {key!r} adapts {m.group(1)!r}, which the model does "
                             "not have")
        pairs.setdefault(ours, {})[m.group(2).replace("embedding_", "")] = value
        if "embedding_" not in m.group(2):
            plain_pairs.add(ours)
    _refuse_parameter_adapters(model, config, layers, plain_pairs, path)
    _drop_untargeted_pairs(model, config, pairs, directory)
    _drop_what_peft_ignores(bases, (whole, loaded), set(pairs), path)
    params = dict(named_parameters(model))
    if config.get("ensure_weight_tying") and "lm_head.weight" in loaded and \
            _embedding_name(model) in whole:
        # the head's copy of a tied embedding PEFT trains whole (ensure_weight_tying)
        whole["lm_head.weight"] = loaded.pop("lm_head.weight")
    _tie_whole_embedding(model, whole, config, path)
    _tie_loaded_embedding(model, loaded, path)
    bases.update(loaded)   # frozen weights PEFT loads, as an adapted layer's base
    transposed = transposed_weights(model)
    kept = _kept_layers(model)
    for name, value in list(bases.items()):
        if name.rpartition(".")[0] in kept and name.endswith(".weight"):
            _check_kept_base(kept[name.rpartition(".")[0]], name, value, path)
            del bases[name]   # the model keeps its own (quantized) copy of that base
    for name in whole:
        module = name.rpartition(".")[0]
        if module in kept and name.endswith(".weight"):
            raise ValueError(f"{path}: the adapter trains {module} whole (modules_to_save), "
                             f"which this model keeps in its file's type "
                             f"({kept[module].qtype}); load the base with keep_types=False "
                             f"to load it")
    for name, value in {**whole, **bases}.items():
        p = params.get(name)
        want = None if p is None else (p.data.T.shape if id(p) in transposed else p.data.shape)
        if p is None or tuple(value.shape) != want:
            raise ValueError(f"{path}: modules_to_save tensor {name!r} "
                             f"{tuple(value.shape)} fits no parameter of the model"
                             + ("" if p is None else f" (it is {want})"))
    rate = _config_value(config.get("lora_dropout") or 0.0, path, "lora_dropout", dropout_arg) \
        if dropout is None else dropout_arg(dropout)
    default_rank = _config_value(config.get("r", 8), path, "r", rank_arg)
    default_alpha = _config_value(config.get("lora_alpha", 8), path, "lora_alpha", alpha_arg)
    made = []
    for name, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{path}: {name} has {sorted(pair)}, not lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.ndim != 2 or b.ndim != 2:
            raise ValueError(f"{path}: {name}'s adapter is A {a.shape}, B {b.shape}; "
                             f"expected two matrices")
        layer = layers[name][2]
        n_in, n_out = (layer.num_embeddings, layer.embedding_dim) \
            if isinstance(layer, EMBEDDINGS) else (layer.in_features, layer.out_features)
        rank = a.shape[0]
        if a.shape != (rank, n_in) or b.shape != (n_out, rank):
            raise ValueError(f"{path}: {name}'s adapter is A {a.shape}, B {b.shape}; the "
                             f"model's layer needs (rank, {n_in}) and ({n_out}, rank)")
        hf = _hf_name(model, name)
        alpha = _config_value(_pattern_value(config, "alpha_pattern", hf, default_alpha, path),
                              path, f"alpha_pattern for {hf}", alpha_arg)
        want = _config_value(_pattern_value(config, "rank_pattern", hf, default_rank, path),
                             path, f"rank_pattern for {hf}", rank_arg)
        if rank != want:
            raise ValueError(f"{path}: {name}'s tensors have rank {rank}, the config says {want}")
        if config.get("use_rslora"):
            alpha *= math.sqrt(rank)   # alpha / sqrt(r) as ggmlopt's alpha / r
        made.append((name, a, b, rank, alpha))
    if not made:
        raise ValueError(f"{path}: it holds no LoRA adapter tensors")
    # said before anything changes: a warning raised as an error leaves the model as it was
    _warn_base_copies_that_differ(params, bases, transposed, path)
    for name, a, b, rank, alpha in made:   # everything checked: now the model changes
        parent, key, layer = layers[name]
        adapter = LoRAEmbedding(layer, rank, alpha) if isinstance(layer, EMBEDDINGS) \
            else LoRALinear(layer, rank, alpha, dropout=rate)
        adapter.lora_a.data[...] = a.T
        adapter.lora_b.data[...] = b.T
        replace_layer(parent, key, adapter)
    for name, value in {**whole, **bases}.items():
        p = params[name]
        p.data[...] = value.T if id(p) in transposed else value
    modules = sorted({n.rpartition(".")[0] for n in whole})
    freeze_all_but_adapters(model, tuple(modules))
    if _frozen_b(config):
        for _, adapter in named_adapters(model):
            adapter.lora_b.requires_grad = False
    return named_adapters(model)


def _drop_untargeted_pairs(model, config, pairs: dict, directory: str) -> None:
    """PEFT puts adapters only on the modules its config selects (target_modules,
    exclude_modules, layers_to_transform, layers_pattern) and loads the file
    into those, ignoring, without a word, the adapter tensors of any other
    module: those are dropped here too, with a UserWarning, rather than
    applied."""
    if config.get("target_parameters"):
        return   # (its parameters' modules are targets beside target_modules)
    from .._lora_config import config_plan
    selection = {k: config[k] for k in ("target_modules", "exclude_modules",
                                        "layers_to_transform", "layers_pattern")
                 if k in config}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # (apply's advice, not load_peft's)
            targeted = set(config_plan(model, selection).targets)
    except ValueError as e:
        raise ValueError(f"{os.path.join(directory, ADAPTER_CONFIG)}: {e}") from None
    if config.get("init_lora_weights", True) is False:
        # PEFT starts a selected module the file has no tensors for with random A
        # and B (init_lora_weights false), a model no one can reproduce
        held = {_hf_name(model, name) for name in pairs}
        missing = sorted(targeted - held)
        if missing:
            raise ValueError(f"{os.path.join(directory, ADAPTER_CONFIG)}: init_lora_weights "
                             f"is false and the file has no adapter for {len(missing)} of the "
                             f"modules the config selects ({', '.join(missing[:3])}"
                             f"{', ...' if len(missing) > 3 else ''}): PEFT would start them "
                             f"at random")
    stray = [name for name in pairs if _hf_name(model, name) not in targeted]
    for name in stray:
        del pairs[name]
    if stray:
        warnings.warn(f"{os.path.join(directory, ADAPTER_CONFIG)}: the adapters of "
                      f"{len(stray)} modules ({', '.join(stray[:3])}"
                      f"{', ...' if len(stray) > 3 else ''}) are not loaded: the config's "
                      f"target_modules, exclude_modules and layers_to_transform do not "
                      f"select them, so PEFT does not load them either", UserWarning,
                      stacklevel=3)


def _refuse_parameter_adapters(model, config, layers: dict, plain_pairs: set,
                               path: str) -> None:
    """PEFT's adapters on parameters (target_parameters) add B A in the
    parameter's own layout: a LoRA layer's for a torch Linear weight (out, in),
    but transposed for GPT-2's Conv1D weights (in, out) and an embedding's
    (vocab, dim), where a square matrix would load with no error.  Those are
    refused."""
    targets = config.get("target_parameters")
    if not targets:
        return
    if not family_of(model).hf_transposed:
        raise ValueError(f"{path}: target_parameters={targets!r}: PEFT's adapters on "
                         f"parameters of Conv1D weights (in, out) add B A transposed from a "
                         f"LoRA layer's, which is not supported; train the adapter with "
                         f"target_modules")
    odd = [name for name in sorted(plain_pairs) if isinstance(layers[name][2], EMBEDDINGS)]
    if odd:
        raise ValueError(f"{path}: target_parameters={targets!r}: {odd[0]} is an embedding "
                         f"adapted on its weight parameter, whose B A is (vocab, dim), not "
                         f"PEFT's embedding adapter; not supported (train it with "
                         f"target_modules)")


def _frozen_b(config) -> bool:
    """Whether PEFT trains only A of this adapter's layers (MiCA: B is frozen)."""
    init = config.get("init_lora_weights")
    return isinstance(init, str) and init.lower() == "mica"
