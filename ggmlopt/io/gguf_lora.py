"""LoRA adapters of a Llama-family model or a GPT2 as llama.cpp loads them
(``--lora adapter.gguf``).

The file is what llama.cpp's ``convert_lora_to_gguf.py`` writes:
``general.architecture`` = ``llama`` (the model's, ``gpt2`` for a GPT2),
``general.type`` = ``adapter``,
``adapter.type`` = ``lora``, ``adapter.lora.alpha`` (float32), and per adapted
weight two float32 tensors named after llama.cpp's weight
(``blk.0.attn_q.weight.lora_a`` / ``.lora_b``) in torch's layout: lora_a
(rank, in) (ggml ne (in, rank)), lora_b (out, rank) (ne (rank, out)).  llama.cpp
adds ``alpha / rank * B (A x)`` to the weight's product, which is ggmlopt's
``x A B`` with A, B transposed.  The output rows of q_proj's and k_proj's B are
permuted into llama.cpp's rotary order (ggmlopt.io.llama_names.permute_qk), as
the base model's weights are.
"""
from __future__ import annotations

import collections
import warnings

import numpy as np

from .. import kernels_quant
from .._lora_tree import ADAPTERS, EMBEDDINGS, adaptable_layers, named_adapters, replace_layer
from .._optional import import_optional
from ..lora import freeze_all_but_adapters, other_trainable
from ..models.registry import family_of
from ..nn.lora_layers import LoRAEmbedding, LoRALinear, dropout_arg
from ._files import atomic_output, input_path, output_path
from ._gguf_length import gguf_truncation
from .gguf_gpt2 import GPT2_ARCH, gguf_name_gpt2, hf_name_gpt2
from .gguf_llama import _rope_scaling_out
from .llama_names import gguf_name, hf_name, permute_qk, unpermute_qk

__all__ = ["load_gguf_lora", "save_gguf_lora"]

_SUFFIXES = (".lora_a", ".lora_b")
EMBEDDING = "embed_tokens"   # the token embedding's module name


def _gguf():
    return import_optional("gguf", "interop", "GGUF LoRA adapters")


def _llama_config(model):
    """model's config: a model of a family llama.cpp has an architecture for."""
    try:
        family = family_of(model)
    except TypeError:
        family = None
    if family is None or family.gguf_arch is None:
        raise TypeError(f"model: expected a ggmlopt.models.Llama or GPT2 (llama.cpp's LoRA "
                        f"adapters are per architecture), got {type(model).__name__}")
    return model.config


def _arch(model) -> str:
    """llama.cpp's architecture of model's adapter file."""
    arch = family_of(model).gguf_arch
    assert arch is not None
    return arch


def _qk_heads(module_name: str, config) -> int | None:
    """The head count of the Q/K permutation for a projection, or None (qwen2's,
    qwen3's, phi3's and gpt2's rows are not permuted)."""
    if not getattr(config, "llama_cpp_permutes_qk", False):
        return None
    if module_name.endswith("self_attn.q_proj"):
        return config.n_heads
    if module_name.endswith("self_attn.k_proj"):
        return config.n_kv_heads
    return None


def _weight_name(module_name: str, arch: str) -> str:
    """llama.cpp's weight name of an adapted Linear (ValueError when none)."""
    try:
        if arch == GPT2_ARCH:
            return gguf_name_gpt2(f"{module_name}.weight")
        return gguf_name(f"{module_name}.weight", arch)
    except KeyError:
        raise ValueError(f"model: the adapter on {module_name!r} has no llama.cpp tensor "
                         "(it is not a weight of a Llama)") from None


def check_writable(model) -> None:
    """ValueError where save_gguf_lora could not write model's adapters as a file
    llama.cpp applies to reproduce the model (what a command checks before it
    trains, not after): no adapters, one on a tied embedding, other trainable
    parameters, a layer llama.cpp has no tensor for, a config
    llama.cpp's architecture cannot hold (what save_gguf refuses)."""
    adapters = named_adapters(model)
    if not adapters:
        raise ValueError("model: it has no LoRA adapters (see ggmlopt.lora.apply)")
    for name, a in adapters:
        if not isinstance(a, LoRAEmbedding):
            continue
        if a is not model._embedding:
            # GPT-2's wpe: llama.cpp adds its position rows without any adapter
            raise ValueError(f"model: the adapter on {name!r}, an embedding other than the "
                             "token embedding, is not applied by llama.cpp; merge it "
                             "(lora.merge) and write the model with save_gguf")
        if model.lm_head is None:
            # llama.cpp's tied head is the token embedding's tensor: it would apply the
            # embedding's adapter to the head's product too, which the model never did
            raise ValueError("model: an adapter on a token embedding tied to the output head "
                             "is not written for llama.cpp (it would apply it to the head as "
                             "well); train without it, or merge it (lora.merge, after which "
                             "the tied head reads the merged embedding too: other logits) and "
                             "write the model with save_gguf")
    others = other_trainable(model)
    if others:
        # the file holds the adapters alone: llama.cpp (base + adapter) would not be the
        # model that trained
        raise ValueError(f"model: {len(others)} parameters other than the LoRA adapters are "
                         f"trainable ({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}"
                         "), and an adapter file holds only the adapters: freeze them "
                         "(requires_grad=False; lora.apply does unless named in trainable=), "
                         "or fold the adapters in with ggmlopt.lora.merge(model) and write "
                         "the whole model with save_gguf")
    for name, _ in adapters:
        _weight_name(name, _arch(model))
    _check_architecture(model)


def _file_alpha(adapters) -> float:
    """The alpha an adapter file holds (llama.cpp reads one per file): the one
    most adapters have (PEFT's alpha beside an alpha_pattern; rsLoRA's alpha
    times the square root of each rank where the ranks differ), the first of
    them in the model's order on a tie; an adapter of another alpha is written
    with its B scaled by its alpha over this one, which computes the same."""
    counts = collections.Counter(float(layer.alpha) for _, layer in adapters)
    most = max(counts.values())
    return next(a for a in (float(layer.alpha) for _, layer in adapters) if counts[a] == most)


def _check_architecture(model) -> None:
    """What save_gguf refuses of a model's config (a Mistral's sliding window, a
    rope scaling or a Gemma 3 score scale llama.cpp's architecture does not
    hold) is refused for its adapter too, and warned about where save_gguf
    warns (a Phi-3's window): llama.cpp would apply the adapter over a base that
    computes another model than the one that trained."""
    family = family_of(model)
    if family.gguf_layout != "llama":
        return
    try:
        family.gguf_check(model.config)
        _rope_scaling_out(model.config, _arch(model))
    except ValueError as e:
        raise ValueError(f"{e}; llama.cpp would apply an adapter file over a base that "
                         "computes another model, so none is written (save_peft writes the "
                         "adapter for transformers)") from None


def save_gguf_lora(model, path) -> None:
    """Write the LoRA adapters of a Llama-family model or a GPT2
    (ggmlopt.lora.apply) to path as a GGUF adapter that llama.cpp loads over
    the base model's GGUF (atomically).

    Tensors: ``blk.N.<weight>.lora_a`` float32 (rank, in) and ``.lora_b``
    float32 (out, rank) per adapter (torch's layout, A and B transposed from
    ggmlopt's), the rows of q_proj's and k_proj's B permuted as llama.cpp's
    Q/K weights are; keys ``adapter.lora.alpha`` (float32, one for the file:
    the alpha most adapters have; an adapter of another alpha, of a PEFT
    alpha_pattern or an rsLoRA rank_pattern, has its B scaled by its alpha over
    the file's, so llama.cpp computes the same; load_gguf_lora reads it back as
    that).

    Raises TypeError for a model that is neither; ValueError when it has no
    adapters, when anything else in it is trainable (the file would not hold
    it), when one sits on a layer llama.cpp has no tensor for, or when llama.cpp's
    architecture cannot hold the model's config (what save_gguf refuses: a
    Mistral's sliding window, a rope scaling it has no form of...; warned
    about where save_gguf warns).
    """
    config = _llama_config(model)
    path = output_path(path)
    check_writable(model)
    adapters = named_adapters(model)
    alpha = _file_alpha(adapters)
    tensors = []
    for name, layer in adapters:
        base = _weight_name(name, _arch(model))
        a = np.ascontiguousarray(layer.lora_a.data.T)              # (rank, in)
        b = np.ascontiguousarray(layer.lora_b.data.T)              # (out, rank)
        if layer.alpha != alpha:
            # llama.cpp scales every layer by the file's alpha over its rank: this
            # layer's own alpha goes into its B
            b = (b * (np.float64(layer.alpha) / alpha)).astype(np.float32)
        heads = _qk_heads(name, config)
        if heads is not None:
            b = permute_qk(b, heads)
        if isinstance(layer, LoRAEmbedding):
            # llama.cpp gathers the token's row of A: A stays (vocab, rank) (its
            # convert_lora_to_gguf transposes token_embd's lora_a the same way)
            a = np.ascontiguousarray(a.T)
        tensors += [(base + ".lora_a", a), (base + ".lora_b", b)]
    gguf = _gguf()
    with atomic_output(path) as tmp:
        writer = gguf.GGUFWriter(tmp, _arch(model))
        try:
            writer.add_string("general.type", "adapter")
            writer.add_string("adapter.type", "lora")
            writer.add_float32("adapter.lora.alpha", alpha)
            for tname, array in tensors:
                writer.add_tensor(tname, array)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()


def _read(path: str, gguf, arch: str = "llama"):
    """(alpha, {tensor name: float32 array in torch's layout}); the header is checked
    (a model file is told apart) before any tensor is converted."""
    short = gguf_truncation(path, gguf.GGML_QUANT_SIZES)
    if short is not None:
        raise ValueError(f"path: {path!r} is a truncated GGUF file ({short})")
    kind = gguf.GGMLQuantizationType
    vt = gguf.GGUFValueType
    try:
        reader = gguf.GGUFReader(path)
        fields = {}
        for key in ("general.architecture", "general.type", "adapter.type",
                    "adapter.lora.alpha"):
            field = reader.fields.get(key)
            if field is None or not field.types or field.types[0] == vt.ARRAY:
                continue
            part = field.parts[field.data[0]]
            fields[key] = (bytes(part).decode("utf-8") if field.types[0] == vt.STRING
                           else float(part.tolist()[0]))
        alpha = _check_header(fields, path, arch)
        tensors = {}
        for t in reader.tensors:
            if t.tensor_type in (kind.F32, kind.F16):
                data = np.array(t.data, dtype=np.float32)
            elif reader.endianess == gguf.GGUFEndian.BIG:
                # gguf-py swaps the plain floats only: these words (a BF16's, a
                # block's scales) would read as garbage
                raise ValueError(f"path: {path!r} is a big-endian GGUF file; its tensor "
                                 f"{t.name!r} of type {t.tensor_type.name} cannot be read "
                                 f"(llama.cpp refuses the file)")
            elif t.tensor_type == kind.BF16:
                raw = np.ascontiguousarray(t.data).view(np.uint16).astype(np.uint32) << 16
                data = raw.view(np.float32)
            elif t.tensor_type.name in kernels_quant.QTYPES:
                # convert_lora_to_gguf --outtype q8_0 writes Q8_0 pairs, which
                # llama.cpp applies dequantized: the same values here
                data = kernels_quant.dequantize(t.tensor_type.name,
                                                np.ascontiguousarray(t.data).view(np.uint8),
                                                int(t.shape[0]))
            else:
                raise TypeError(f"path: tensor {t.name!r} of {path!r} has type "
                                f"{t.tensor_type.name}; adapters are read from "
                                f"{', '.join(kernels_quant.QTYPES)}")
            tensors[t.name] = data.reshape(tuple(int(n) for n in t.shape[::-1]))
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        if isinstance(e, ValueError) and str(e).startswith("path:"):
            raise  # ours, already saying what is wrong
        raise ValueError(f"path: {path!r} is not a valid GGUF file ({e})") from None
    finally:
        reader = None  # drop the memory map
    return alpha, tensors


def _check_header(fields, path, arch):
    kind = fields.get("general.type")
    if kind != "adapter" and (kind == "model" or "adapter.type" not in fields):
        raise ValueError(f"path: {path!r} is a model file (general.type is {kind!r}), not a "
                         "LoRA adapter: ggmlopt.io.load_gguf(path) reads it; load_gguf_lora "
                         "reads adapter files (general.type 'adapter')")
    want = {"general.architecture": arch, "general.type": "adapter", "adapter.type": "lora"}
    for key, value in want.items():
        if fields.get(key) != value:
            raise ValueError(f"path: {path!r} is not a {arch} LoRA adapter ({key} is "
                             f"{fields.get(key)!r}, expected {value!r})")
    alpha = fields.get("adapter.lora.alpha")
    if alpha is None or not np.isfinite(alpha) or alpha == 0:
        raise ValueError(f"path: {path!r} has no usable adapter.lora.alpha (got {alpha!r})")
    return alpha


def _pairs(tensors: dict[str, np.ndarray], path: str,
           arch: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{module name: (lora_a (rank, in), lora_b (out, rank))} from the file's
    tensors, in the file's order."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    for tname, data in tensors.items():
        suffix = tname[-len(".lora_a"):]
        if tname.endswith("_norm.weight"):
            # adapters may carry trained norm vectors, which llama.cpp skips too
            warnings.warn(f"path: {path!r}: {tname!r} is not a LoRA pair; skipped, as llama.cpp "
                          "does", UserWarning, stacklevel=3)
            continue
        if suffix not in _SUFFIXES:
            raise ValueError(f"path: {path!r} holds {tname!r}, not a LoRA tensor "
                             "(<weight>.lora_a / .lora_b)")
        base = tname[:-len(suffix)]
        try:
            weight = hf_name_gpt2(base) if arch == GPT2_ARCH else hf_name(base, arch)
        except KeyError:
            raise ValueError(f"path: {path!r} adapts {base!r}, not a weight of a Llama") \
                from None
        if data.ndim != 2:
            raise ValueError(f"path: {tname!r} of {path!r} has shape {data.shape}; expected "
                             "a matrix")
        halves.setdefault(weight.removesuffix(".weight"), {})[suffix] = data
    pairs = {}
    for name, half in halves.items():
        if len(half) != 2:
            missing = next(s for s in _SUFFIXES if s not in half)
            raise ValueError(f"path: {path!r} lacks {_weight_name(name, arch)}{missing}")
        a, b = half[".lora_a"], half[".lora_b"]
        if name == EMBEDDING:
            a = a.T   # token_embd's A is stored (vocab, rank): as the Linear form here
        if a.shape[0] != b.shape[1]:
            raise ValueError(f"path: {path!r}: the ranks of {name}'s lora_a {a.shape} and "
                             f"lora_b {b.shape} differ")
        pairs[name] = (a, b)
    if not pairs:
        raise ValueError(f"path: {path!r} holds no LoRA tensors")
    return pairs


def load_gguf_lora(path, model, *, dropout=0.0
                   ) -> list[tuple[str, LoRALinear | LoRAEmbedding]]:
    """Put the LoRA adapter of a GGUF file (save_gguf_lora's, or llama.cpp's
    convert_lora_to_gguf's in F32, F16, BF16 or Q8_0, or another type ggml
    dequantizes: kernels_quant.QTYPES) onto a Llama-family model or a GPT2, in
    place.

    A model without adapters gets a LoRALinear (the file's rank and alpha,
    dropout as given) on each Linear the file adapts, and everything else frozen
    (as lora.apply leaves it); a model whose adapters are
    exactly those (same layers and ranks) gets their values replaced.  The Q/K
    permutation is undone, so save_gguf_lora then load_gguf_lora gives back
    A and B bit for bit (alpha is stored as float32).

    Returns named_adapters(model).  Raises ValueError for a file that is not a
    llama LoRA adapter, truncated, with unpaired or wrongly shaped tensors, or
    adapting layers the model lacks (or other adapters than the model has);
    TypeError for a model that is neither a Llama-family one nor a GPT2, or a
    tensor of a type ggml does not dequantize; FileNotFoundError for a missing
    file.  On any error the model is unchanged.
    """
    config = _llama_config(model)
    dropout = dropout_arg(dropout)   # checked before any layer changes
    path = input_path(path)
    gguf = _gguf()
    arch = _arch(model)
    alpha, tensors = _read(path, gguf, arch)
    pairs = _pairs(tensors, path, arch)
    linears = {name: (parent, key, layer) for name, parent, key, layer in adaptable_layers(model)}
    existing = {name for name, (_, _, layer) in linears.items() if isinstance(layer, ADAPTERS)}
    if existing and existing != set(pairs):
        raise ValueError(f"model: its adapters ({len(existing)} layers) are not the file's "
                         f"({len(pairs)} layers); load into the base model or one adapted "
                         "like the file")
    values = {}
    for name, (a, b) in pairs.items():
        if name not in linears:
            raise ValueError(f"path: {path!r} adapts {name!r}, which the model does not have")
        layer = linears[name][2]
        rank = a.shape[0]
        n_in, n_out = (layer.num_embeddings, layer.embedding_dim) \
            if isinstance(layer, EMBEDDINGS) else (layer.in_features, layer.out_features)
        if rank < 1 or a.shape[1] != n_in or b.shape[0] != n_out:
            raise ValueError(f"path: {path!r}: {name}'s adapter is lora_a {a.shape}, lora_b "
                             f"{b.shape}; the model's layer needs (rank, {n_in}) and "
                             f"({n_out}, rank)")
        if existing and layer.rank != rank:
            raise ValueError(f"path: {path!r}: {name}'s rank is {rank}, the model's adapter's "
                             f"{layer.rank}")
        if isinstance(layer, EMBEDDINGS) and model.lm_head is None:
            # save_gguf_lora refuses to write such a file: llama.cpp's tied head is this
            # tensor, so it applies the adapter to the head's product as well
            warnings.warn(f"load_gguf_lora: {path!r} adapts the token embedding, which this "
                          "model ties to its output head: ggmlopt applies the adapter to the "
                          "embedding only (as PEFT does), while llama.cpp applies it to the "
                          "head's product too, so the two compute different logits",
                          UserWarning, stacklevel=2)
        heads = _qk_heads(name, config)
        b = unpermute_qk(b, heads) if heads is not None else b
        values[name] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T), rank)
    for name, (a, b, rank) in values.items():
        parent, key, layer = linears[name]
        if not existing:
            layer = LoRAEmbedding(layer, rank, alpha) if isinstance(layer, EMBEDDINGS) \
                else LoRALinear(layer, rank, alpha, dropout=dropout)
            replace_layer(parent, key, layer)
        elif layer.alpha != alpha:
            layer.alpha, layer.scaling = alpha, alpha / layer.rank
        layer.lora_a.data[...] = a
        layer.lora_b.data[...] = b
    if not existing:
        freeze_all_but_adapters(model)   # as lora.apply leaves a model: only adapters train
    return named_adapters(model)
