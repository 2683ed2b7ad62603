"""How much memory training a language model will take, before anything is
allocated: ``memory_report(model, batch_size, n_ctx)``.

The parts, in bytes:

- weights: every float parameter's data, the bytes of the layers kept in a
  file's types (a quantized base read in place), and the key-values a model
  read from a GGUF file keeps to write them back (its vocabulary's tokens and
  merges as Python strings: 30 MiB for a 128k-token vocabulary);
- gradients: one float32 per trainable element (frozen ones have none); with
  ``optimizer_in_backward`` the pool of lent gradients instead: the largest
  block's, the largest other part's, and those of the parameters held in two
  places (a tied embedding), which live through the whole backward pass;
- optimizer state: AdamW's two moments per trainable element (SGD: none);
- activations: what the layers keep between their forward and backward
  passes, per token, from the buffers ggmlopt's layers allocate (each layer's
  output, the attention's outputs, the MLP's intermediates); with activation
  checkpointing each block's input plus one block's buffers.  The input
  gradients a backward pass makes are dropped block by block: the peak holds
  one block's of them (or the head's buffers, the larger);
- head: the fused head's chunk buffer (the logits, then their gradient over
  them, at most ``ggmlopt.models._fused_head.CHUNK_BYTES``; two under Gemma 2's
  final soft cap, whose slope waits beside them) and the hidden rows it reads
  and writes;
- runtime: the interpreter, NumPy and the BLAS's thread buffers (a constant).

Under ``precision="bf16"`` (where the CPU multiplies bf16 natively) the bf16
copies of the float weights count with the weights, and the bf16 rows every
product keeps from one step to the next (its input, its output's gradient,
the head's chunk) with the activations.

The total is the peak, not the sum of the parts: the head's buffers live only
between the forward and the backward pass, so with checkpointing (where the
blocks then hold only their inputs) the peak holds the larger of the head and
one block's buffers.

The figures follow ggmlopt's own buffers, so they are what a step holds at
its peak: the estimate is checked against the measured peak RSS of whole runs
(bench/memory_peaks.py).
"""
from __future__ import annotations

import dataclasses
import numbers
import os
import sys
from typing import Any, ClassVar

import numpy as np

from ._args import bool_arg, int_arg
from .gemm import bf16_support, check_precision
from .optimizers import optimizer_arg

__all__ = ["MemoryReport", "available_memory", "memory_report"]

F32 = 4
# the interpreter, NumPy, ggmlopt's modules and the BLAS's per-thread buffers: the peak
# RSS of training steps less the arrays the other parts count, 50-62 MiB over full
# fine-tunes and LoRA runs, float32 and bf16, tied and untied heads, on 2 threads
# (bench/memory_peaks.py, tests/test_memory_report.py)
RUNTIME_BYTES = 56 << 20


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes of each part of a training step's peak (see ggmlopt.memory_estimate)."""

    weights: int
    gradients: int
    optimizer_state: int
    activations: int
    head: int
    runtime: int
    total: int
    """The estimated peak resident memory of training, in bytes."""
    batch_size: int
    n_ctx: int
    checkpointing: bool

    PARTS: ClassVar[tuple[str, ...]] = ("weights", "gradients", "optimizer_state", "activations", "head", "runtime",
             "total")

    def to_dict(self) -> dict[str, int]:
        """{part: bytes} of PARTS (weights ... runtime, and total)."""
        return {k: getattr(self, k) for k in self.PARTS}

    def __getitem__(self, part: str) -> int:
        """report["weights"] ... report["total"]: the bytes of a part."""
        if part not in self.PARTS:
            raise KeyError(f"{part!r}: expected one of {', '.join(self.PARTS)}")
        return getattr(self, part)

    def __str__(self) -> str:
        rows = [("weights", self.weights), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state),
                ("activations" + (" (checkpointed)" if self.checkpointing else ""),
                 self.activations),
                ("head (fused, chunked)", self.head), ("runtime", self.runtime),
                ("total (the peak)", self.total)]
        head = f"memory for training at batch {self.batch_size} x {self.n_ctx} tokens:"
        return "\n".join([head] + [f"  {name:28s} {_mib(n):>10}" for name, n in rows])


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def available_memory() -> int | None:
    """Bytes the system can still give this process (Linux's MemAvailable, or
    less where the process's cgroup has a memory limit: what the limit leaves
    above its usage), or None where it is not known."""
    free = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:
        return None
    room = _cgroup_room()
    if room is not None:
        free = room if free is None else min(free, room)
    return free


# the cgroup files of a memory limit and its usage: v2's, then v1's
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                  "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def _cgroup_room() -> int | None:
    """What this process's cgroup memory limit leaves above its usage, or None
    without a limit (a container's limit, which MemAvailable does not see)."""
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            with open(limit_file, encoding="ascii") as f:
                limit = f.read().strip()
            with open(usage_file, encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        # "max" (v2) or a page-rounded 2^63 (v1): no limit
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - usage)
    return None


def resident_memory() -> int | None:
    """This process's resident memory now, in bytes (Linux), or None."""
    try:
        with open(f"/proc/{os.getpid()}/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


# ---- activations: ggmlopt's buffers per token ---------------------------------------------

def _adapter_scratch_bytes(block) -> int:
    """The bytes a block's LoRA adapters keep whatever the tokens: each one's
    dA^T (rank x in float32) between its backward passes."""
    from .nn.lora_layers import LoRALinear
    from .nn.module import modules
    return sum(m.rank * m.in_features * F32 for m in modules(block)
               if isinstance(m, LoRALinear))


def _floats_per_token(module) -> tuple[int, int]:
    """Float32 values module and its sub-modules hold per token of a training
    step: (kept, backward): the forward's outputs kept for the backward pass
    (and buffers a layer keeps between steps), and the buffers its backward
    pass makes and drops (the input gradients: Linear, the norms, the
    attention, SwiGLU and the blocks make them per call)."""
    from .models._causal_lm import PreNormBlock
    from .models.gemma3 import GeGLU, Gemma3DecoderLayer
    from .models.phi3 import Phi3Attention, Phi3MLP
    from .nn.activation import GELU
    from .nn.attention import CausalSelfAttention, GPT2Attention
    from .nn.linear import Linear
    from .nn.lora_layers import LoRALinear
    from .nn.mlp import GPT2MLP, SwiGLU
    from .nn.norm import LayerNorm, RMSNorm
    from .nn.quantized import QuantizedLinear

    def seq(own, *children):
        """own buffers plus sub-layers run one after another: every kept array
        stays; of the backward buffers, a sub-layer's are dropped when it returns,
        so the largest sub-layer's peak adds to the parent's own."""
        return (own[0] + sum(k for k, _ in children),
                own[1] + max((b for _, b in children), default=0))

    def sub(*modules):
        return [_floats_per_token(m) for m in modules]

    def output_not_kept(layer):   # a projection its parent calls with out=
        kept, backward = _floats_per_token(layer)
        return (kept - layer.out_features, backward)

    if isinstance(module, LoRALinear):
        # the output and the adapter's path (rank wide: t, u and their transposes);
        # the input gradient and the adapter's share of it in the backward pass
        # (dA^T, rank x in, is no token's: _adapter_scratch_bytes)
        kept, backward = module.out_features + 4 * module.rank, 2 * module.in_features
        if module.lora_dropout.p > 0.0:
            # the dropout's buffers, kept from step to step: its mask, the dropped
            # input, the gradient through the mask (float32) and the kept flags
            # (bool); the adapter's input gradient before the mask in the backward
            kept += -(-13 * module.in_features // 4)
            backward += module.in_features
        return (kept, backward)
    if isinstance(module, (Linear, QuantizedLinear)):
        return (module.out_features, module.in_features)
    if isinstance(module, (RMSNorm, LayerNorm)):
        return (module.dim + 2, module.dim)
    if isinstance(module, GELU):
        return (0, 0)   # sized by the caller (GPT2MLP)
    if isinstance(module, CausalSelfAttention):
        q, kv = module.n_heads * module.head_dim, module.n_kv_heads * module.head_dim
        own = (q + module.n_heads, q + 2 * kv + module.dim)   # o, lse; dq, dk, dv, dx
        if module.q_norm is not None:   # one row per head of each token
            heads = module.n_heads + module.n_kv_heads
            own = (own[0] + heads * (module.head_dim + 2), own[1] + heads * module.head_dim)
        return seq(own, *sub(module.q_proj, module.k_proj, module.v_proj),
                   output_not_kept(module.o_proj))
    if isinstance(module, Phi3Attention):
        q, kv = module.q_width, module.kv_width
        # kept: the q, k, v copies of the fused product, o and lse; made in the
        # backward pass: dO, dq, dk, dv and their concatenation for qkv_proj
        own = (q + 2 * kv + q + module.n_heads, q + 2 * (q + 2 * kv))
        return seq(own, *sub(module.qkv_proj, module.o_proj))
    if isinstance(module, GPT2Attention):
        own = (module.dim + module.n_heads + 3 * module.dim, 0)   # o, lse, dqkv (kept)
        return seq(own, *sub(module.c_attn, module.c_proj))
    if isinstance(module, SwiGLU):   # the product kept; both gradients and dx made
        return seq((module.hidden, 2 * module.hidden + module.dim),
                   *sub(module.gate_proj, module.up_proj), output_not_kept(module.down_proj))
    if isinstance(module, Phi3MLP):
        # kept: the gate and up copies and their product; made in the backward
        # pass: dh, d gate, d up and their concatenation for gate_up_proj
        return seq((3 * module.hidden, 5 * module.hidden),
                   *sub(module.gate_up_proj, module.down_proj))
    if isinstance(module, GPT2MLP):
        return seq((2 * module.hidden + module.dim, 0), *sub(module.c_fc, module.c_proj))
    if isinstance(module, Gemma3DecoderLayer):
        parts = (module.input_layernorm, module.self_attn, module.post_attention_layernorm,
                 module.pre_feedforward_layernorm, module.mlp, module.post_feedforward_layernorm)
        dim = module.input_layernorm.dim
        return seq((2 * dim, 2 * dim), *sub(*parts))   # h, y kept; dh, dx made
    if isinstance(module, GeGLU):   # the activation (and its kept gradient), the product
        return seq((3 * module.hidden, 2 * module.hidden),
                   *sub(module.gate_proj, module.up_proj, module.down_proj))
    if isinstance(module, PreNormBlock):
        dim = module._parts()[0].dim
        return seq((2 * dim, 2 * dim), *sub(*module._parts()))   # h, y kept; dh, dx made
    return (0, 0)


def _parameter_bytes(model) -> tuple[int, int]:
    """(bytes of every weight, float elements that train)."""
    from .nn.quantized import quantized_layers
    weights = trainable = 0
    for _, p in model.named_parameters():
        weights += p.data.nbytes
        if getattr(p, "requires_grad", True):
            trainable += p.data.size
    weights += sum(int(layer.nbytes) for _, layer in quantized_layers(model))
    metadata = getattr(model, "gguf_metadata", None) or {}
    weights += sum(_object_bytes(metadata[key]) for key in metadata)
    return weights, trainable


def _object_bytes(value) -> int:
    """The bytes a metadata value holds: an array's data, a list's slots and items,
    a string's or number's object."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, (list, tuple)):
        return sys.getsizeof(value) + sum(_object_bytes(v) for v in value)
    return sys.getsizeof(value)


def _bf16_copies(model) -> tuple[int, int, bool]:
    """Under precision="bf16": (bytes of the bf16 copies of the float weights
    the products read, bf16 values kept per token, whether the head multiplies
    in bf16: then it keeps a chunk's rows and logits' gradient in bf16).  Every
    float Linear and a float embedding that is the head keep their weight
    rounded to bf16, and
    each Linear its last input and output gradient rows (ggmlopt.nn._bf16),
    from one step to the next; a layer kept in a file's types multiplies in
    its own type and keeps none."""
    from .nn.embedding import Embedding
    from .nn.linear import Linear
    head, float_head = model.lm_head, False
    weights, per_token = _bf16_linears(model, head)
    if isinstance(head, Linear) and head.weight is not None:
        weights += 2 * head.weight.data.size
        float_head = True
    elif head is None and isinstance(model._embedding, Embedding) \
            and model._embedding.weight is not None:   # (a LoRA adapter's too)
        weights += 2 * model._embedding.weight.data.size
        float_head = True
    return weights, per_token, float_head


def _bf16_linears(module, head=None) -> tuple[int, int]:
    """(bytes of the bf16 weight copies, bf16 values per token) of the float
    Linear layers in module but head."""
    from .nn.linear import Linear
    from .nn.module import modules
    weights = per_token = 0
    for m in modules(module):
        if isinstance(m, Linear) and m.weight is not None and m is not head:
            weights += 2 * m.weight.data.size
            per_token += m.in_features + m.out_features
    return weights, per_token


def _lent_gradient_bytes(model, blocks) -> int:
    """The gradient pool of optimizer_in_backward at its fullest (see
    ggmlopt.step_in_backward): parameters held in two places (a tied
    embedding) for the whole pass, plus the largest block's and the largest
    other part's (an untied head, the embedding): the pool keeps buffers by
    size, so the other blocks and parts reuse them."""
    from ._buckets import _holdings
    from .nn.module import named_parameters

    def trainable_bytes(module, shared):
        return sum(p.data.nbytes for _, p in named_parameters(module)
                   if getattr(p, "requires_grad", True) and id(p) not in shared)

    held = _holdings(model)
    trainable = [p for _, p in named_parameters(model) if getattr(p, "requires_grad", True)]
    shared = {id(p) for p in trainable if held.get(id(p)) != 1}
    in_blocks = {id(p) for b in blocks for _, p in named_parameters(b)}
    largest_block = max((trainable_bytes(b, shared) for b in blocks), default=0)
    largest_other = max((p.data.nbytes for p in trainable
                         if id(p) not in shared and id(p) not in in_blocks), default=0)
    return sum(p.data.nbytes for p in trainable if id(p) in shared) + \
        largest_block + largest_other


def memory_report(model, batch_size: int, n_ctx: int, *, optimizer: Any = "adamw",
                  checkpointing: bool | None = None, labelled: float = 1.0,
                  optimizer_in_backward: bool = False, precision: str = "f32") -> MemoryReport:
    """The memory training model (a ggmlopt language model) takes at its peak:
    batch_size windows of n_ctx tokens a physical batch, AdamW (optimizer
    "adamw") or SGD ("sgd"), or any ggmlopt.optimizers.Optimizer (its
    state_names: one array per name) over the parameters that train now (after
    lora.apply: the adapters), activation checkpointing as the model has it
    (or as checkpointing says).  labelled: the share of positions with a label
    (the fused head skips the others).  optimizer_in_backward: the context
    steps in the backward pass and lends gradients (OptContext's argument).
    precision: "f32" or "bf16" (OptContext's): where the CPU multiplies bf16
    natively, the bf16 copies of the weights count with the weights, and those
    of each product's input and gradient rows, kept from step to step, with
    the activations (elsewhere a "bf16" context runs float32, and so does the
    estimate).  The estimate models ggmlopt's own bf16 products: on Intel MKL's
    (``bf16_engine() == "mkl"``, the default where the CPU has AMX tiles) the
    peak was 2-25% higher in bench/memory_peaks-sized runs, MKL's own buffers
    that the estimate does not see.  Returns a MemoryReport (bytes per part, ``total``; ``print(report)`` shows
    a table)."""
    from .models._causal_lm import CausalLM
    from .models._fused_head import chunk_rows
    if not isinstance(model, CausalLM):
        raise TypeError(f"model: expected a ggmlopt language model (ggmlopt.models), got "
                        f"{type(model).__name__}")
    lm: Any = model   # a family's: config, layers (GPT-2: h)
    batch_size = int_arg(batch_size, "batch_size", 1)
    checkpointing = bool_arg(checkpointing, "checkpointing", allow_none=True)
    n_ctx = int_arg(n_ctx, "n_ctx", 1)
    if n_ctx > lm.config.max_seq_len:
        raise ValueError(f"n_ctx: {n_ctx} is more than the model's max_seq_len "
                         f"{lm.config.max_seq_len}")
    # every form OptContext and fit take: an OptimizerType, its name in any case, an
    # Optimizer (its state_names: one array each)
    nstate = len(optimizer_arg(optimizer).state_names)
    if isinstance(labelled, (bool, np.bool_)) or not isinstance(labelled, numbers.Real):
        raise TypeError(f"labelled: expected a float share in [0, 1], got "
                        f"{type(labelled).__name__}")
    if not 0.0 <= labelled <= 1.0:
        raise ValueError(f"labelled: expected a share in [0, 1], got {labelled!r}")
    if checkpointing is None:
        checkpointing = lm.is_gradient_checkpointing
    weights, trainable = _parameter_bytes(lm)
    tokens = batch_size * n_ctx
    dim = lm.config.dim
    blocks = list(lm.layers if hasattr(lm, "layers") else lm.h)
    per_block = [_floats_per_token(b) for b in blocks]
    scratch = [_adapter_scratch_bytes(b) for b in blocks]
    # the embedding's output, the final norm, the hidden rows' gradient
    outside = (dim + 2 * dim + 2 + dim) * tokens * F32
    rows = max(1, round(labelled * tokens))
    chunk = chunk_rows(rows, lm.config.vocab_size) * lm.config.vocab_size * F32
    # the logits, their gradient over them; under Gemma 2's final cap, the cap's
    # slope beside them (the loss kernel writes the gradient over the logits)
    capped = getattr(lm, "final_logit_softcap", None) is not None
    head = chunk * (2 if capped else 1) + 2 * rows * dim * F32
    # one block's backward buffers: made and dropped block by block
    backward = max((b for _, b in per_block), default=0) * tokens * F32
    if checkpointing:   # every block's input kept; one block's buffers, or the head's
        one_block = max((k + b for k, b in per_block), default=0) * tokens * F32 \
            + max(scratch, default=0)
        activations = len(blocks) * dim * tokens * F32 + one_block + outside
        transient = len(blocks) * dim * tokens * F32 + outside + max(one_block, head)
    else:
        activations = sum(k for k, _ in per_block) * tokens * F32 + sum(scratch) + outside
        transient = activations + max(head, backward)
    optimizer_in_backward = bool_arg(optimizer_in_backward, "optimizer_in_backward")
    if check_precision(precision) == "bf16" and bf16_support()[0]:
        copies, per_token, float_head = _bf16_copies(lm)
        if checkpointing and blocks:
            # each block's bf16 copies go with its buffers (release_buffers): one
            # block's at a time
            parts = [_bf16_linears(b) for b in blocks]
            copies -= sum(w for w, _ in parts) - max(w for w, _ in parts)
            per_token -= sum(t for _, t in parts) - max(t for _, t in parts)
        head_rows = chunk_rows(rows, lm.config.vocab_size) if float_head else 0
        weights += copies
        kept = per_token * tokens * 2 + head_rows * (lm.config.vocab_size + dim) * 2
        activations += kept
        transient += kept
    gradients = (_lent_gradient_bytes(lm, blocks) if optimizer_in_backward
                 else trainable * F32)
    state = nstate * trainable * F32
    return MemoryReport(weights=weights, gradients=gradients, optimizer_state=state,
                        activations=activations, head=head, runtime=RUNTIME_BYTES,
                        total=weights + gradients + state + RUNTIME_BYTES + transient,
                        batch_size=batch_size, n_ctx=n_ctx, checkpointing=bool(checkpointing))


def check_fits(report: MemoryReport, ranks: int = 1) -> None:
    """MemoryError, naming the ways out, when report's total exceeds what the
    system can still give this process plus the weights it already holds
    (the report counts them; the rest of its memory is not the step's).
    ranks: the processes on this machine that each train as report says (MPI
    ranks): each gets its share of what the system can still give."""
    free, held = available_memory(), resident_memory()
    if free is None or held is None:
        return
    budget = free // max(1, ranks) + min(held, report.weights)
    if report.total <= budget:
        return
    parts = [("weights", report.weights), ("gradients", report.gradients),
             ("optimizer state", report.optimizer_state), ("activations", report.activations),
             ("head", report.head), ("runtime", report.runtime)]
    # the ways out of the parts that weigh (the runtime is what it is)
    largest = max(parts[:-1], key=lambda part: part[1])
    quarter = (report.total - report.runtime) / 4
    ways: list[str] = []
    if report.activations + report.head >= quarter:
        ways.append(f"use a smaller physical batch (nbatch_physical; {report.batch_size} "
                    f"now) or shorter windows ({report.n_ctx} tokens now)")
        if not report.checkpointing:
            ways.append("turn on activation checkpointing "
                        "(model.gradient_checkpointing_enable())")
    if report.gradients + report.optimizer_state >= quarter:
        ways.append("train LoRA adapters (ggmlopt.lora.apply)")
        ways.append("step the optimizer in the backward pass (optimizer_in_backward=True: no "
                    "gradient for every weight at once)")
    if report.weights >= quarter:
        ways.append("keep a GGUF base in its types (load_gguf(path, keep_types=True))")
    if ranks > 1:
        ways.append("run fewer ranks on this machine")
    raise MemoryError(
        f"training needs about {_mib(report.total)} ("
        + ", ".join(f"{name} {_mib(n)}" for name, n in parts)
        + f"), more than the {_mib(budget)} this machine has for it"
        + (f" (per rank: {ranks} ranks on this machine share it)" if ranks > 1 else "")
        + "; the largest part is "
        f"the {largest[0]}: " + "; ".join(ways or ["use a smaller physical batch or model"]))
