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
from typing import Any

import numpy as np

from .._optional import import_optional
from ..lora import refuse_adapters
from ..models import GPT2, GPT2Config, Llama, LlamaConfig
from ..nn.linear import Linear
from ..nn.module import named_modules
from ._files import atomic_output

__all__ = ["load_hf", "save_hf"]

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


def _safetensors():
    return import_optional("safetensors.numpy", "interop", "Hugging Face checkpoints")


def _hf_config(model) -> dict[str, Any]:
    cfg = model.config
    if isinstance(model, Llama):
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
            "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base,
            "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
            "torch_dtype": "float32", "use_cache": True,
        }
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_embd": cfg.dim, "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads, "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len,
        "n_inner": None, "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "tie_word_embeddings": True, "torch_dtype": "float32", "use_cache": True,
    }


def _prefix(model) -> str:
    return "model." if isinstance(model, Llama) else "transformer."


def _tensor_map(model) -> list[tuple[str, Any, bool]]:
    """(Hugging Face name, Parameter, transposed) for every parameter."""
    transposed: set[int] = set()
    if isinstance(model, Llama):   # GPT-2's Conv1D weights are (in, out) like ours
        transposed = {id(m.weight) for _, m in named_modules(model) if isinstance(m, Linear)}
    prefix = _prefix(model)
    return [(name if name == "lm_head.weight" else prefix + name, p, id(p) in transposed)
            for name, p in model.named_parameters()]


def save_hf(model, directory) -> None:
    """Write model (a ggmlopt.models.Llama or GPT2) to directory as a Hugging Face
    checkpoint: config.json and model.safetensors (float32), each atomically.
    The directory is created when missing.  transformers' from_pretrained then
    loads it with no missing or unexpected keys."""
    if not isinstance(model, (Llama, GPT2)):
        raise TypeError(f"model: expected a ggmlopt.models.Llama or GPT2, got "
                        f"{type(model).__name__}")
    refuse_adapters(model, "save_hf")
    st = _safetensors()
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"directory: {directory!r} is a file")
    os.makedirs(directory, exist_ok=True)
    tensors = {name: np.ascontiguousarray(p.data.T if t else p.data, dtype=np.float32)
               for name, p, t in _tensor_map(model)}
    with atomic_output(os.path.join(directory, WEIGHTS)) as tmp:
        st.save_file(tensors, tmp, metadata={"format": "pt"})
    with atomic_output(os.path.join(directory, CONFIG)) as tmp, open(tmp, "w") as f:
        json.dump(_hf_config(model), f, indent=2)
        f.write("\n")


def _read_config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"directory: no {CONFIG} in {directory!r}")
    with open(path) as f:
        return json.load(f)


def _model_from_config(hf: dict[str, Any], where: str):
    kind = hf.get("model_type")
    try:
        if kind == "llama":
            act = hf.get("hidden_act", "silu")
            if act != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
                raise ValueError(f"hidden_act={act!r}, attention_bias, mlp_bias: only silu "
                                 "without biases (Llama's) is supported")
            if hf.get("rope_scaling"):
                raise ValueError("rope_scaling: not supported")
            dim, heads = hf["hidden_size"], hf["num_attention_heads"]
            if hf.get("head_dim") not in (None, dim // heads):
                raise ValueError(f"head_dim: {hf['head_dim']} is not hidden_size // "
                                 f"num_attention_heads = {dim // heads}")
            cfg = LlamaConfig(vocab_size=hf["vocab_size"], dim=dim,
                              n_layers=hf["num_hidden_layers"], n_heads=heads,
                              n_kv_heads=hf.get("num_key_value_heads"),
                              ffn_dim=hf["intermediate_size"],
                              max_seq_len=hf.get("max_position_embeddings", 2048),
                              norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                              rope_base=float(hf.get("rope_theta", 10000.0)),
                              tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
            return Llama(cfg)
        if kind == "gpt2":
            dim = hf["n_embd"]
            if hf.get("n_inner") not in (None, 4 * dim):
                raise ValueError(f"n_inner: only 4 * n_embd is supported, got {hf['n_inner']}")
            if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
                raise ValueError(f"activation_function: only GELU's tanh form is supported, got "
                                 f"{hf['activation_function']!r}")
            return GPT2(GPT2Config(vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["n_layer"],
                                   n_heads=hf["n_head"], max_seq_len=hf.get("n_positions", 1024),
                                   norm_eps=float(hf.get("layer_norm_epsilon", 1e-5))))
    except KeyError as e:
        raise ValueError(f"{where}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    raise ValueError(f"{where}: model_type {kind!r} is not supported (llama, gpt2)")


def _read_tensors(directory: str) -> dict[str, np.ndarray]:
    st = _safetensors()
    single = os.path.join(directory, WEIGHTS)
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(os.path.join(directory, INDEX)):
        with open(os.path.join(directory, INDEX)) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(directory, name) for name in shards]
    else:
        raise FileNotFoundError(f"directory: no {WEIGHTS} (or {INDEX}) in {directory!r}")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        tensors.update(st.load_file(path))
    return tensors


def load_hf(directory):
    """A ggmlopt.models.Llama or GPT2 from a Hugging Face checkpoint directory
    (config.json and model.safetensors, or a sharded model.safetensors.index.json),
    as save_hf or transformers' save_pretrained write them.

    Float16 tensors are widened to float32 (bfloat16 files need converting
    first).  A tied output (tie_word_embeddings) may be absent from the file;
    buffers Hugging Face keeps (rotary inv_freq, GPT-2's attention masks) are
    ignored.  Every tensor is checked (names, shapes) before the model is
    returned: ValueError names what is missing, unexpected or misshapen."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"directory: no such directory {directory!r}")
    model = _model_from_config(_read_config(directory), os.path.join(directory, CONFIG))
    tensors = _read_tensors(directory)
    where = os.path.join(directory, WEIGHTS)
    expected = _tensor_map(model)
    names = {name for name, _, _ in expected}
    ignored = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
    if isinstance(model, GPT2) or model.config.tie_embeddings:
        ignored += ("lm_head.weight",)
    missing = sorted(names - set(tensors))
    unexpected = sorted(k for k in tensors if k not in names and not k.endswith(ignored))
    if missing or unexpected:
        raise ValueError(f"{where}: does not match the {type(model).__name__} its config "
                         f"describes: missing {missing}, unexpected {unexpected}")
    values = []
    for name, p, transposed in expected:
        array = tensors[name]
        if array.dtype.kind != "f":
            raise TypeError(f"{where}: tensor {name!r} has dtype {array.dtype}; expected floats")
        array = array.T if transposed else array
        if array.shape != p.data.shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {tensors[name].shape}; "
                             f"expected {p.data.shape[::-1] if transposed else p.data.shape}")
        values.append((p, array))
    for p, array in values:
        p.data[...] = array
    return model
