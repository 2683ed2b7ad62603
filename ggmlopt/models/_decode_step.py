"""A Llama-layout block's decode step in one C call (kernels_decode.LlamaBlockStep)
when its parts are the ones that call reads: RMSNorms, attention without Gemma's
query scale or soft cap, a SwiGLU, and q, k, v, o, gate, up and down weights kept in their
file's types (QuantizedLinear layers, ``load_gguf(..., keep_types=True)``) or
float32 Linear layers, bare or under LoRA adapters, the kept ones multiplying
their activations one way.  A block names the weight rows of each
(``step_projections``): Llama's seven layers, or Phi-3's fused q|k|v and gate|up
cut into row ranges.  Any other block (other norms, other layers) decodes layer
by layer.  Without adapters both ways give the same bits for kept weights; a
Linear's product sums over 64 inputs at a time
(each weight byte read once, threads on whole rows of it) where BLAS sums its
own way, both within float32 rounding of the exact product; an adapter's two
small products are the C call's own float32 sums.  A bf16 pass
(precision="bf16") decodes layer by layer, as its products are bf16.

The step object is made once per block and kept beside it (not on it: a model
pickles and copies without it); it is made again whenever a part it read has
changed (an adapter applied, a norm's weight replaced, set_activations).  The
parts are read again only after a change nn._parts_version counts (an attribute
set on a module of a block that has a step, a Parameter's data assigned), or in
a bf16 pass.  It reads every weight in place, so an optimizer's steps on the
adapters count at once."""
from __future__ import annotations

import operator
import weakref

import numpy as np

from .. import gemm
from ..kernels_decode import LlamaBlockStep
from ..nn._parts_version import parts_version, watch
from ..nn.attention import RotaryEmbedding
from ..nn.linear import Linear
from ..nn.lora_layers import LoRALinear
from ..nn.module import Module, modules, with_followers
from ..nn.norm import RMSNorm
from ..nn.quantized import FEW_ROWS, QuantizedLinear, _activations

# block -> (the parts the step read, the step, nn._parts_version's count when they
# were read)
_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _parts_read(block):
    """Everything a step of block reads, as a tuple compared by identity, or
    None when block's parts are not the ones a step takes."""
    norm1, attn, norm2, _ = block._parts()
    if (type(norm1) is not RMSNorm or type(norm2) is not RMSNorm
            or getattr(attn, "query_scale", None) is not None
            or getattr(attn, "logit_softcap", None) is not None):
        return None
    if attn.rotary is not None and (type(attn.rotary) is not RotaryEmbedding
                                    or attn.rotary.rotary_dim != attn.rotary.head_dim):
        return None
    norms = [norm1, norm2]
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q_norm is not None:
        norms += [q_norm, k_norm]
        if type(q_norm) is not RMSNorm or type(k_norm) is not RMSNorm:
            return None
    if any(n.eps != norm1.eps for n in norms):
        return None
    rows = block.step_projections()
    if rows is None:
        return None
    kept = [_kept_weight(p) for p, _, _ in rows]
    if any(k is None for k in kept):
        return None
    activations = _step_activations(kept)
    if activations is None:
        return None
    parts = [*norms, *(n.weight.data for n in norms), norm1.eps, attn.rotary,
             attn.sliding_window, activations]
    for (p, first, count), (base, adapter) in zip(rows, kept):
        parts += [p, *_weight_read(base), p.bias, None if p.bias is None else p.bias.data,
                  first, count]
        if adapter is not None:
            parts += [adapter.lora_a.data, adapter.lora_b.data, adapter.scaling]
    return tuple(parts)


def _kept_weight(layer):
    """(base layer, its LoRALinear or None) of a projection a step takes: a
    weight kept in its file's type or a Linear's float32 one, bare or under an
    adapter that is not dropping out (not training); None for any other layer."""
    if _step_reads(layer):
        return layer, None
    if (type(layer) is LoRALinear and _step_reads(layer._base)
            and not (layer.training and layer.lora_dropout.p > 0)):
        return layer._base, layer
    return None


def _step_activations(kept) -> str | None:
    """How a step multiplies the activations of its kept weights: their one
    setting ("f32" when every weight is a Linear's), None when they differ."""
    settings = {_activations(base) for base, _ in kept if type(base) is QuantizedLinear}
    if len(settings) > 1:
        return None
    return settings.pop() if settings else "f32"


def _step_reads(layer) -> bool:
    """Whether a step multiplies by layer's weight: a QuantizedLinear's, or a
    Linear's (float32 (in, out), C-contiguous as every Parameter) outside a
    bf16 pass (whose products are bf16)."""
    if type(layer) is QuantizedLinear:
        return True
    return type(layer) is Linear and not gemm.bf16_active()


def _weight_read(base) -> tuple:
    """What a step reads of a base layer's weight: the array and its type."""
    if type(base) is QuantizedLinear:
        return base.qweight, base.qtype
    return base.weight.data, "linear"


def _same(a, b):
    """Whether two _parts_read tuples name the same objects (and equal values)."""
    if len(a) != len(b):
        return False
    if all(map(operator.is_, a, b)):   # the common case, every token: at C speed
        return True
    return all(x is y or (isinstance(x, (str, int, float)) and type(x) is type(y) and x == y)
               for x, y in zip(a, b))


def block_step(block) -> LlamaBlockStep | None:
    """The LlamaBlockStep of block's parts as they are now, or None when they
    are not the ones it takes."""
    kept = _steps.get(block)
    version = parts_version()
    if kept is not None and kept[2] == version and not gemm.bf16_active():
        return kept[1]   # nothing under any block's watch changed since it was read
    parts = _parts_read(block)
    if parts is None:
        return None
    if kept is not None and _same(kept[0], parts):
        _watch_parts(block)   # a part may be a new object holding the same ones
        _steps[block] = (kept[0], kept[1], version)
        return kept[1]
    norm1, attn, norm2, _ = block._parts()
    names = ("q", "k", "v", "o", "gate", "up", "down")
    projections: dict[str, tuple] = {}
    rows = block.step_projections()
    for name, (p, first, count) in zip(names, rows):
        base, adapter = _kept_weight(p)
        bias = None if p.bias is None else p.bias.data[first:first + count]
        lora = None if adapter is None else (   # B's columns of the range (a fused part's)
            adapter.lora_a.data, adapter.lora_b.data[:, first:first + count],
            np.float32(adapter.scaling))
        weight, qtype = _weight_read(base)
        part = weight[:, first:first + count] if qtype == "linear" else weight[first:first + count]
        projections[name] = (qtype, part, bias, lora)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    q_norm = None if q_norm is None else q_norm.weight.data
    k_norm = None if k_norm is None else k_norm.weight.data
    activations = _step_activations([_kept_weight(p) for p, _, _ in rows])
    assert activations is not None   # _parts_read saw one setting
    step = LlamaBlockStep(projections, norm1.weight.data, norm2.weight.data,
                          n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads, eps=norm1.eps,
                          q_norm=q_norm, k_norm=k_norm, window=attn.sliding_window,
                          activations=activations)
    _watch_parts(block)
    _steps[block] = (parts, step, version)
    return step


def _watch_parts(block) -> None:
    """Every module of block, an adapter's base layer included (held outside
    the sub-modules), and each projection's base and adapter: an attribute set
    on (or deleted from) any of them counts as a change, as a Parameter's data
    assignment anywhere does, so until one comes the next tokens need not read
    the parts again."""
    found = with_followers(modules(block))
    for p, _, _ in block.step_projections() or ():
        found += [m for m in _kept_weight(p) or () if m is not None]
    for module in found:
        if isinstance(module, Module):
            watch(module)


def decode_in_one_call(block, x, cache_k, cache_v, pos):
    """block.decode's result for x (batch, 1, dim), batch <= FEW_ROWS (the
    products of more rows go through panels and BLAS), in one
    C call, or None when block's parts are not the ones it takes."""
    b, t, d = x.shape
    if t != 1 or b > FEW_ROWS:
        return None
    step = block_step(block)
    if step is None:
        return None
    rotary = block._parts()[1].rotary
    cos, sin = (None, None) if rotary is None else rotary.tables(pos + 1)
    y = np.array(x, dtype=np.float32, copy=True).reshape(b, d)
    step.step(y, cache_k, cache_v, pos, cos, sin)
    return y.reshape(b, 1, d)
