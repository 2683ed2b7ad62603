"""Hugging Face checkpoints: a ``config.json`` and a ``model.safetensors`` that
``transformers``' ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` load with
``from_pretrained``, written from and read into ggmlopt.models.

The mapping is the models' parameter names plus Hugging Face's prefix
(``model.`` for Llama, ``transformer.`` for GPT-2; ``lm_head.weight`` has none)
and one rule: a Llama's Linear weights are (in, out) here and (out, in) in
torch, so they are transposed; GPT-2's weights are (in, out) on both sides (its
Conv1D).  Needs only ``safetensors`` and ``json`` (the ``interop`` extra), never
``transformers`` itself.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any

import numpy as np

from .._optional import import_optional
from ..lora import refuse_adapters
from ..models.registry import FAMILIES, family_for_hf, family_of
from ..nn.embedding import padding_index
from ..nn.init import skip_init
from ..nn.linear import Linear
from ..nn.module import get_submodule, named_modules, set_submodule
from ..nn.quantized import QuantizedEmbedding, QuantizedLinear, refuse_quantized
from ._files import atomic_output, path_arg, read_json_object

__all__ = ["load_hf", "save_hf"]

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


def _safetensors():
    return import_optional("safetensors.numpy", "interop", "Hugging Face checkpoints")


def _hf_config(model) -> dict[str, Any]:
    family = family_of(model)
    config = {"architectures": [family.hf_architecture], "model_type": family.hf_model_type,
              **family.to_hf(model.config)}
    if family.hf_padding:   # the embedding's padding row, as transformers builds it
        config["pad_token_id"] = getattr(model.embed_tokens, "padding_idx", None)
    return config


def transposed_weights(model) -> set[int]:
    """ids of the weights transformers stores transposed: torch's Linear keeps
    (out, in); GPT-2's Conv1D keeps (in, out), as ggmlopt does."""
    if not family_of(model).hf_transposed:
        return set()
    return {id(m.weight) for _, m in named_modules(model)
            if isinstance(m, Linear) and m.weight is not None}


def _tensor_map(model) -> list[tuple[str, Any, bool]]:
    """(Hugging Face name, Parameter, transposed) for every parameter."""
    family = family_of(model)
    transposed = transposed_weights(model)
    prefix = family.hf_prefix
    return [(name if name == "lm_head.weight" else prefix + name, p, id(p) in transposed)
            for name, p in model.named_parameters()]


def save_hf(model, directory, *, tokenizer=None) -> None:
    """Write model (a model of one of ggmlopt.models' families: Llama, Qwen2,
    GPT2, ...) to directory as a Hugging Face checkpoint: config.json and
    model.safetensors (float32), each atomically.  The directory is created
    when missing.  transformers' from_pretrained then loads it with no missing
    or unexpected keys.

    tokenizer (a ByteTokenizer, BPETokenizer, SPMTokenizer, or
    load_hf_tokenizer's): also
    tokenizer.json, tokenizer_config.json (its special tokens and chat
    template) and generation_config.json (BOS and end-of-generation ids), so
    that transformers' AutoTokenizer encodes as the tokenizer does
    (ggmlopt.io.hf_tokenizer_files); ValueError when it has more tokens than
    the model's vocab_size, TypeError for what is no ggmlopt tokenizer.
    Without a tokenizer, a model with ``eog_ids`` (load_hf's, load_gguf's)
    gets a generation_config.json of those ids, where generation stops.
    Everything is checked before any file is written."""
    family_of(model)   # TypeError for another model
    refuse_adapters(model, "save_hf")
    refuse_quantized(model, "save_hf")
    st = _safetensors()
    directory = path_arg(directory, "directory")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"directory: {directory!r} is a file")
    tokenizer_files = _tokenizer_files(tokenizer, model.config) if tokenizer is not None \
        else _eog_files(model)   # made (and checked) before anything is written
    config = _hf_config(model)   # (a config transformers could not read is refused here)
    os.makedirs(directory, exist_ok=True)
    for name, text in tokenizer_files.items():
        os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
        with atomic_output(os.path.join(directory, name)) as tmp, \
                open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    tensors = {name: np.ascontiguousarray(p.data.T if t else p.data, dtype=np.float32)
               for name, p, t in _tensor_map(model)}
    with atomic_output(os.path.join(directory, WEIGHTS)) as tmp:
        st.save_file(tensors, tmp, metadata={"format": "pt"})
    with atomic_output(os.path.join(directory, CONFIG)) as tmp, open(tmp, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def _eog_files(model) -> dict[str, str]:
    """generation_config.json of a model without its tokenizer: the ids its
    generation stops at (load_hf's and load_gguf's eog_ids), else transformers'
    generate, reading none, would never stop where the model does."""
    eog = sorted(int(i) for i in getattr(model, "eog_ids", ()))
    if not eog:
        return {}
    from . import hf_tokenizer_files as files
    return {"generation_config.json": files.dumps(
        {"_from_model_config": False, "eos_token_id": eog[0] if len(eog) == 1 else eog})}


def _tokenizer_files(tokenizer, config) -> dict[str, str]:
    """{file name: text} of a tokenizer's Hugging Face files."""
    from . import hf_tokenizer_files as files
    text = files.tokenizer_json(tokenizer)   # TypeError for what is no tokenizer
    size = getattr(tokenizer, "vocab_size", None)
    if size > config.vocab_size:
        # (a model's embedding may have rows past the tokenizer's ids: Qwen's are padded)
        raise ValueError(f"tokenizer: it has {size} tokens, more than the model's "
                         f"vocab_size {config.vocab_size}")
    out = {"tokenizer.json": text,
           "tokenizer_config.json": files.dumps(files.tokenizer_config(
               tokenizer, config.max_seq_len)),
           "generation_config.json": files.dumps(files.generation_config(tokenizer))}
    named = files.named_templates(tokenizer)
    if named:   # the default in chat_template.jinja, the others by name, as transformers
        if tokenizer.chat_template:
            out["chat_template.jinja"] = tokenizer.chat_template
        out.update({f"additional_chat_templates/{name}.jinja": source
                    for name, source in named.items()})
    return out


def _read_config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"directory: no {CONFIG} in {directory!r}")
    return read_json_object(path)


def _model_from_config(hf: dict[str, Any], where: str):
    """The model (its class over the config its family reads) of a config.json."""
    kind = hf.get("model_type")
    family = family_for_hf(kind)
    text = hf.get("text_config")
    if family is None and isinstance(text, dict) and family_for_hf(text.get("model_type")):
        # Gemma 3 from 4B up, Mistral 3...: a language model inside an image-text one
        raise ValueError(f"{where}: model_type {kind!r} is an image-text model "
                         f"({', '.join(hf.get('architectures') or ())}); its language model "
                         f"({text.get('model_type')!r}) is one ggmlopt implements, but not "
                         f"read out of this checkpoint: llama.cpp's convert_hf_to_gguf.py "
                         f"writes it alone as a GGUF, which load_gguf reads")
    if family is None:
        raise ValueError(f"{where}: model_type {kind!r} is not supported "
                         f"({', '.join(f.hf_model_type for f in FAMILIES)})")
    try:
        config = family.from_hf(hf, where)
        # transformers' nn.Embedding(padding_idx=pad_token_id): that row gets no
        # gradient from the lookups (it refuses a pad outside the vocabulary, as here;
        # a family default outside a small vocabulary is no pad)
        pad = hf.get("pad_token_id", family.hf_pad_default)
        if "pad_token_id" not in hf and pad is not None and pad >= config.vocab_size:
            pad = None
        padding = padding_index(pad, config.vocab_size) if family.hf_padding else None
    except KeyError as e:
        raise ValueError(f"{where}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {str(e).replace('padding_idx', 'pad_token_id', 1)}") \
            from None
    model = family.model_class(config)
    if padding is not None:
        model.embed_tokens.padding_idx = padding
    return model


def _weight_files(directory: str) -> list[str]:
    single = os.path.join(directory, WEIGHTS)
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(os.path.join(directory, INDEX)):
        index = os.path.join(directory, INDEX)
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{index}: not a safetensors index (expected a JSON object "
                                 f"with a 'weight_map' of tensor names to shard files; "
                                 f"{type(e).__name__}: {e})") from None
        if not all(isinstance(name, str) and os.path.basename(name) == name for name in shards):
            raise ValueError(f"{index}: weight_map names a shard outside the directory")
        files = [os.path.join(directory, name) for name in shards]
    else:
        raise FileNotFoundError(f"directory: no {WEIGHTS} (or {INDEX}) in {directory!r}")
    return files


# safetensors dtypes a mapped tensor is viewed as (bfloat16 as its raw 16-bit words)
_MAPPED = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def _mapped_tensors(directory: str) -> dict[str, tuple[str, np.ndarray | None]]:
    """{name: (safetensors dtype, read-only view of the memory-mapped file)}: the
    format is an 8-byte header length, a JSON header (dtype, shape, data_offsets
    of each tensor) and the data."""
    out: dict[str, tuple[str, np.ndarray | None]] = {}
    for path in _weight_files(directory):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such shard (named by {INDEX})")
        map_safetensors_file(path, out)
    return out


def map_safetensors_file(path: str, out: dict[str, tuple[str, np.ndarray | None]]) -> None:
    """Add {name: (safetensors dtype, read-only mapped view)} of one safetensors
    file's tensors to out (a view of None for a dtype that is not a float);
    ValueError for a file that is not one."""
    if os.path.getsize(path) < 8:
        raise ValueError(f"{path}: not a safetensors file ({os.path.getsize(path)} bytes)")
    raw = np.memmap(path, np.uint8, "r")
    try:
        n = int(raw[:8].view("<u8")[0])
        header = json.loads(bytes(raw[8:8 + n]).decode("utf-8"))
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")  # noqa: TRY004 (a file's value)
    try:
        _map_header(path, raw, 8 + n, header, out)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        if isinstance(e, ValueError) and str(e).startswith(path):
            raise
        raise ValueError(f"{path}: malformed safetensors header "
                         f"({type(e).__name__}: {e})") from None


def _map_header(path: str, raw: np.ndarray, base: int, header: dict,
                out: dict[str, tuple[str, np.ndarray | None]]) -> None:
    """Add the tensors one safetensors header describes to out (views of raw,
    whose data starts at byte base)."""
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if name in out:
            raise ValueError(f"{path}: tensor {name!r} is in two of the checkpoint's files")
        dtype = info.get("dtype")
        if dtype not in _MAPPED:   # refused if the model reads it (_float_tensor)
            out[name] = (dtype, None)
            continue
        start, end = info["data_offsets"]
        shape = [int(d) for d in info["shape"]]
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(_MAPPED[dtype]).itemsize
        if not 0 <= start <= end or end - start != size:
            raise ValueError(f"{path}: tensor {name!r} has data_offsets {start}..{end} "
                             f"for {size} bytes of {dtype} {shape}")
        if base + end > raw.size:
            # an interrupted download or copy
            raise ValueError(f"{path}: truncated: tensor {name!r} ends at byte "
                             f"{base + end}, the file has {raw.size}")
        view = raw[base + start:base + end].view(np.dtype(_MAPPED[dtype]).newbyteorder("<"))
        out[name] = (dtype, view.reshape(shape))


def _float_tensor(tensors, name: str, where: str) -> tuple[str, np.ndarray]:
    """(dtype, mapped view) of a tensor the model reads; TypeError when it is
    not of a float type."""
    dtype, array = tensors[name]
    if array is None:
        raise TypeError(f"{where}: tensor {name!r} has dtype {dtype}; expected floats "
                        f"({', '.join(_MAPPED)})")
    return dtype, array


def _as_float32(dtype: str, array: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def _tied(model) -> bool:
    """Whether model's output head is its token embedding (GPT-2's always is: its
    config has no such field)."""
    return bool(getattr(model.config, "tie_embeddings", True))


_COMPARE_BYTES = 4 << 20   # float32 bytes of rows _head_differs compares at a time


def _head_differs(model, tensors) -> bool:
    """Whether a model built tied (tie_word_embeddings) meets a file whose own
    lm_head.weight is not its token embedding: transformers then does not tie
    them (its tie_weights: both present with different values), and the
    file's head is the one that computes the logits."""
    if not _tied(model) or "lm_head.weight" not in tensors:
        return False
    embedding = model._embedding.weight
    name = next(n for n, p, _ in _tensor_map(model) if p is embedding)
    if name not in tensors:
        return False   # _check_names says what is missing
    (head_type, head), (emb_type, emb) = tensors["lm_head.weight"], tensors[name]
    if head is None or emb is None:
        return False   # refused when read
    if head.shape != emb.shape:
        return True
    # a few MiB of rows at a time: both whole in float32 would hold 8 bytes a weight
    # of a model kept in 2 (a 128256-word vocabulary of 2048: 2 GiB)
    step = max(1, _COMPARE_BYTES // max(1, 4 * int(np.prod(head.shape[1:]))))
    return not all(np.array_equal(_as_float32(head_type, head[r:r + step]),
                                  _as_float32(emb_type, emb[r:r + step]))
                   for r in range(0, head.shape[0], step))


def _check_names(model, expected, tensors, where: str) -> None:
    """ValueError naming the tensors the model needs that the file lacks and
    those it holds that the model does not have (Hugging Face's buffers and a
    tied output aside)."""
    names = {name for name, _, _ in expected}
    ignored: tuple[str, ...] = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
    if _tied(model):   # a tied head's copy in the file (_head_differs: the same values)
        ignored += ("lm_head.weight",)
    missing = sorted(names - set(tensors))
    unexpected = sorted(k for k in tensors if k not in names and not k.endswith(ignored))
    if missing or unexpected:
        raise ValueError(f"{where}: does not match the {type(model).__name__} its config "
                         f"describes: missing {missing}, unexpected {unexpected}")


def _load_kept(tensors, model, where: str):
    """load_hf's keep_types=True: every Linear weight and the token embedding
    over the mapped file's rows (torch's (out, in) layout is the rows a
    QuantizedLinear reads), the rest widened to float32."""
    expected = _tensor_map(model)
    ours = {id(p): name for name, p in model.named_parameters()}
    _check_names(model, expected, tensors, where)
    plan = []
    for name, p, transposed in expected:
        dtype, array = _float_tensor(tensors, name, where)
        shape = array.T.shape if transposed else array.shape
        if shape != p.data.shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {array.shape}; expected "
                             f"{p.data.shape[::-1] if transposed else p.data.shape}")
        plan.append((ours[id(p)], p, dtype, array, transposed))
    for our_name, p, dtype, array, transposed in plan:
        module_name = our_name.rpartition(".")[0]
        if array.ndim == 2 and our_name.endswith(".weight"):
            old = get_submodule(model, module_name)
            qtype = "F32" if dtype == "F64" else dtype
            rows = np.ascontiguousarray(array.astype(np.float32)) if dtype == "F64" else array
            new: QuantizedLinear | QuantizedEmbedding
            if transposed:
                new = QuantizedLinear(rows, qtype, old.in_features, old.out_features,
                                      bias=old.bias)
            else:
                new = QuantizedEmbedding(rows, qtype, *p.data.shape,
                                         padding_idx=getattr(old, "padding_idx", None))
            set_submodule(model, module_name, new)
        else:
            p.data[...] = _as_float32(dtype, array)
    return model


def _with_base_prefix(tensors: dict, prefix: str, expected: set) -> dict:
    """The tensors under the base model's prefix ("transformer." for GPT-2) where
    none has it and so they are the model's expected names: the published GPT-2
    files store wte.weight, h.0..., which transformers' from_pretrained reads as
    its base model's (base_model_prefix); lm_head.weight stays as it is.  Names
    that match nothing either way stay as the file has them (for the message)."""
    if not prefix or any(name.startswith(prefix) for name in tensors):
        return tensors
    renamed = {name if name == "lm_head.weight" else prefix + name: value
               for name, value in tensors.items()}
    return renamed if (renamed.keys() - {"lm_head.weight"}) & expected else tensors


def load_hf(directory, *, keep_types=False):
    """A model of one of ggmlopt.models' families (Llama, Qwen2, GPT2, ...; the
    registry's, by config.json's model_type) from a Hugging Face checkpoint directory
    (config.json and model.safetensors, or a sharded model.safetensors.index.json),
    as save_hf or transformers' save_pretrained write them.

    Float16 and bfloat16 tensors are widened to float32 (read from the
    memory-mapped files).  A tied output (tie_word_embeddings) may be absent
    from the file; a file whose own lm_head.weight differs from its token
    embedding loads untied, with that head, as transformers loads it (with a
    UserWarning);
    buffers Hugging Face keeps (rotary inv_freq, GPT-2's attention masks) are
    ignored.  Every tensor is checked (names, shapes) before the model is
    returned: ValueError names what is missing, unexpected or misshapen.  The
    model's ``eog_ids`` are the directory's generation_config.json (else
    config.json) eos_token_id ids, where transformers' generate stops.

    keep_types=True (every family but GPT-2, whose Conv1D weights stay float32:
    keep_types=False): every Linear weight and the token
    embedding stay as the file stores them (F32, F16 or BF16), read in place
    from the memory-mapped safetensors, as frozen QuantizedLinear /
    QuantizedEmbedding layers, for LoRA over them; norms and biases are
    float32 Parameters."""
    directory = path_arg(directory, "directory")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"directory: no such directory {directory!r}")
    if not isinstance(keep_types, (bool, np.bool_)):
        raise TypeError(f"keep_types: expected a bool, got {type(keep_types).__name__}")
    config = _read_config(directory)
    config_path, where = os.path.join(directory, CONFIG), os.path.join(directory, WEIGHTS)
    tensors = _mapped_tensors(directory)

    with skip_init():   # every parameter is read from the file
        model = _model_from_config(config, config_path)
    tensors = _with_base_prefix(tensors, family_of(model).hf_prefix,
                                {name for name, _, _ in _tensor_map(model)})
    if _head_differs(model, tensors):
        try:
            with skip_init():
                untied = _model_from_config({**config, "tie_word_embeddings": False},
                                            config_path)
        except ValueError as e:   # a family whose head is always tied (GPT-2)
            raise ValueError(f"{where}: the file's lm_head.weight is not its token embedding, "
                             f"so transformers computes the logits with it, and "
                             f"{type(model).__name__} has no head of its own ({e}); refusing "
                             "rather than computing another model") from None
        warnings.warn(f"{where}: tie_word_embeddings is true but the file's lm_head.weight "
                      f"is not its token embedding; loaded untied, with the file's head, as "
                      f"transformers loads it", UserWarning, stacklevel=2)
        model = untied
    from ..hf_tokenizer import generation_eos_ids
    # generate stops where transformers' generate stops, with or without a tokenizer
    vocab = model.config.vocab_size
    eog = frozenset(i for i in generation_eos_ids(directory) if 0 <= i < vocab)
    if keep_types:
        if not family_of(model).hf_transposed:
            raise ValueError(f"keep_types: reads checkpoints of torch Linear weights "
                             f"({type(model).__name__}'s Conv1D weights are kept as float32: "
                             "load it with keep_types=False)")
        model = _load_kept(tensors, model, where)
        model.eog_ids = eog
        return model
    expected = _tensor_map(model)
    _check_names(model, expected, tensors, where)
    values = []
    for name, p, transposed in expected:
        dtype, array = _float_tensor(tensors, name, where)
        array = array.T if transposed else array
        if array.shape != p.data.shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {tensors[name][1].shape}; "
                             f"expected {p.data.shape[::-1] if transposed else p.data.shape}")
        values.append((p, dtype, array))
    for p, dtype, array in values:
        p.data[...] = _as_float32(dtype, array)
    model.eog_ids = eog
    return model
