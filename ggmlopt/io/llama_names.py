"""llama.cpp's names for a Llama's tensors, and its Q/K row order.

ggmlopt names a Llama's parameters as Hugging Face does
(``layers.0.self_attn.q_proj.weight``); llama.cpp's GGUF files name them as
its ``convert_hf_to_gguf.py`` does (``blk.0.attn_q.weight``).  This module is
the one place that maps between the two, so the model writer, the model
reader and the LoRA adapter files agree.

Hugging Face's rotary embedding rotates the two halves of each head
(``rotate_half``); llama.cpp's rotates adjacent pairs.  convert_hf_to_gguf
reorders the output rows of q_proj and k_proj so the two agree: within each
head, row ``2*i + j`` of the GGUF tensor is row ``j*head_dim/2 + i`` of
Hugging Face's.  ``permute_qk`` applies that order and ``unpermute_qk``
undoes it; both work on torch's layout (output rows first), which is also
the layout of a LoRA ``B`` matrix.
"""
from __future__ import annotations

import re

import numpy as np

from ..models.registry import family_for_gguf

__all__ = ["gguf_name", "hf_name", "permute_qk", "unpermute_qk"]

# Hugging Face suffix (after "layers.N.") -> llama.cpp suffix (after "blk.N.")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Qwen2's (llama.cpp's qwen2 architecture)
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    # Qwen3's per-head norms (llama.cpp's qwen3 architecture)
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GLOBAL_NAMES = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES_BACK = {v: k for k, v in _LAYER_NAMES.items()}
_GLOBAL_NAMES_BACK = {v: k for k, v in _GLOBAL_NAMES.items()}
_HF_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def _family_names(arch: str) -> dict[str, str]:
    """The family's own Hugging Face -> llama.cpp suffixes (Phi-3's fused
    projections, Gemma 3's four norms), beyond the llama layout's."""
    family = family_for_gguf(arch)
    return dict(family.gguf_names) if family is not None else {}


def gguf_name(name: str, arch: str = "llama") -> str:
    """llama.cpp's tensor name for a Llama parameter name in architecture arch
    (``layers.3.mlp.up_proj.weight`` -> ``blk.3.ffn_up.weight``); KeyError
    for a name a Llama does not have."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _HF_LAYER.fullmatch(name)
    if match:
        suffix = match.group(2)
        gguf = _family_names(arch).get(suffix) or _LAYER_NAMES.get(suffix)
        if gguf is not None:
            return f"blk.{match.group(1)}.{gguf}"
    raise KeyError(f"{name!r} is not a parameter name of a Llama")


def hf_name(name: str, arch: str = "llama") -> str:
    """The Llama parameter name of a llama.cpp tensor name (the inverse of
    gguf_name) in architecture arch ("phi3": its fused attn_qkv and ffn_up);
    KeyError for a tensor a Llama does not have."""
    if name in _GLOBAL_NAMES_BACK:
        return _GLOBAL_NAMES_BACK[name]
    back = {**_LAYER_NAMES_BACK, **{v: k for k, v in _family_names(arch).items()}}
    match = _GGUF_LAYER.fullmatch(name)
    if match and match.group(2) in back:
        return f"layers.{match.group(1)}.{back[match.group(2)]}"
    raise KeyError(f"{name!r} is not a tensor name of a llama-architecture GGUF")


def _check_rows(rows: np.ndarray, n_heads: int) -> None:
    if rows.ndim < 1 or n_heads < 1 or rows.shape[0] % (2 * n_heads) != 0:
        raise ValueError(f"rows: expected a first axis that is a multiple of 2 * n_heads = "
                         f"{2 * n_heads}, got shape {rows.shape}")


def permute_qk(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face's q/k output rows -> llama.cpp's (convert_hf_to_gguf's
    ``permute``).  rows: (n_heads * head_dim, ...) in torch's layout; pass
    n_kv_heads for k_proj.  Returns a new C-contiguous array."""
    _check_rows(rows, n_heads)
    half = rows.shape[0] // n_heads // 2
    split = rows.reshape(n_heads, 2, half, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(rows.shape).copy(order="C")


def unpermute_qk(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k output rows -> Hugging Face's (the inverse of
    permute_qk).  Returns a new C-contiguous array."""
    _check_rows(rows, n_heads)
    half = rows.shape[0] // n_heads // 2
    split = rows.reshape(n_heads, half, 2, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(rows.shape).copy(order="C")
