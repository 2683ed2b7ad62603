"""Which block type each tensor of a model file takes under a quantization
type, as llama-quantize chooses it (llama.cpp's llama-quant.cpp,
llama_tensor_get_type, without an importance matrix or overrides).

A file type such as ``q4_k_m`` names a mix, not one type: the output head
(or a tied token embedding, which is the head too) keeps Q6_K, and the
_M mixes give half of the value projections and of the feed-forward down
projections Q6_K (the first and last eighth of the layers and every third
between).  A tensor whose rows are not whole blocks of the chosen type falls
back to a smaller block (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0) and, when
even that does not fit, to F16.  Tensors are named as llama.cpp names them
(``blk.3.attn_v.weight``); 1-D tensors (norms, biases) stay float32.
"""
from __future__ import annotations

import re

# file type (as save_gguf's dtype names it) -> (llama.cpp's LlamaFileType name, default type)
FILE_TYPES = {
    "bf16": ("MOSTLY_BF16", "BF16"),
    "q8_0": ("MOSTLY_Q8_0", "Q8_0"),
    "q4_0": ("MOSTLY_Q4_0", "Q4_0"),
    "q4_1": ("MOSTLY_Q4_1", "Q4_1"),
    "q5_0": ("MOSTLY_Q5_0", "Q5_0"),
    "q5_1": ("MOSTLY_Q5_1", "Q5_1"),
    "q4_k_s": ("MOSTLY_Q4_K_S", "Q4_K"),
    "q4_k_m": ("MOSTLY_Q4_K_M", "Q4_K"),
    "q5_k_s": ("MOSTLY_Q5_K_S", "Q5_K"),
    "q5_k_m": ("MOSTLY_Q5_K_M", "Q5_K"),
    "q6_k": ("MOSTLY_Q6_K", "Q6_K"),
}
# llama-quantize's own aliases: Q4_K is Q4_K_M, Q5_K is Q5_K_M; and bfloat16 for bf16, as
# float16 and float32 are taken for f16 and f32 (NumPy's names) and fit's precision takes it
ALIASES = {"q4_k": "q4_k_m", "q5_k": "q5_k_m", "bfloat16": "bf16"}

_BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32,
          "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "BF16": 1, "F16": 1}
# a 256-value type's 32-value stand-in for rows that are not whole super-blocks
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_LAYER = re.compile(r"blk\.(\d+)\.")


def file_type_name(dtype: str) -> str | None:
    """dtype's file type as FILE_TYPES keys it (aliases resolved), or None."""
    key = dtype.strip().lower()
    key = ALIASES.get(key, key)
    return key if key in FILE_TYPES else None


def _more_bits(i_layer: int, n_layers: int) -> bool:
    """The layers an _M mix gives more bits: the first and last eighth, and
    every third one between."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def _mixed_type(ftype: str, default: str, name: str, ncols: int, n_layers: int,
                tied: bool, is_70b: bool) -> str:
    """The type llama-quantize's rules pick for one quantizable tensor, before
    the shape's fallback."""
    layer_match = _LAYER.match(name)
    layer = int(layer_match.group(1)) if layer_match else -1
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if ncols % _BLOCK[default]:
            return "Q8_0"
        return "Q6_K" if default != "Q8_0" else default
    if name == "token_embd.weight":
        return default
    if "attn_v.weight" in name or "attn_qkv.weight" in name:
        chosen = default
        if ftype in ("q4_k_m", "q5_k_m") and _more_bits(layer, n_layers):
            chosen = "Q6_K"
        elif ftype == "q4_k_s" and layer < 4:
            chosen = "Q5_K"
        # a 70B's value projection is 8x narrower than its query: more bits cost little
        if is_70b and chosen == "Q4_K":
            chosen = "Q5_K"
        return chosen
    if "ffn_down" in name:
        if ftype in ("q4_k_m", "q5_k_m") and _more_bits(layer, n_layers):
            return "Q6_K"
        if ftype == "q4_k_s" and layer < n_layers // 8:
            return "Q5_K"
    return default


def is_70b(arch: str, n_layers: int, n_heads: int, n_kv_heads: int) -> bool:
    """Whether llama.cpp types the model LLM_TYPE_70B (its llama with 80 layers and
    grouped heads, its qwen2 with 80 layers), for which llama-quantize gives the
    value projections more bits."""
    return n_layers == 80 and ((arch == "llama" and n_heads != n_kv_heads) or arch == "qwen2")


def tensor_type(ftype: str, name: str, ncols: int, n_layers: int, tied: bool,
                is_70b: bool = False) -> tuple[str, str]:
    """(the block type, the type the rules chose before the shape's fallback)
    of a 2-D tensor called name with rows of ncols values in a file of type
    ftype (a FILE_TYPES key), in a model of n_layers blocks whose head is the
    token embedding when tied (is_70b: see is_70b).  Types by llama.cpp's names
    ("Q4_K", "F16")."""
    default = FILE_TYPES[ftype][1]
    if default == "BF16":   # llama-quantize's float types apply to every matrix
        return default, default
    chosen = preferred = _mixed_type(ftype, default, name, ncols, n_layers, tied, is_70b)
    if ncols % _BLOCK[chosen]:
        chosen = _FALLBACK.get(chosen, chosen)
        if ncols % _BLOCK[chosen]:
            chosen = "F16"
    return chosen, preferred
