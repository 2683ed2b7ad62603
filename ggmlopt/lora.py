"""LoRA: low-rank adapters over the frozen Linear layers of any model.

``apply(model)`` wraps the chosen Linear layers (by attribute name: ``q_proj``,
``up_proj``, ``c_attn``...) in place; each one then computes

    y = x W (+ b) + (alpha / rank) * dropout(x) A B

with W (in, out) and b frozen (``requires_grad=False``) and only A (in, rank)
and B (rank, out) trained, as Hugging Face PEFT's ``LoraLayer`` does: A is
Kaiming-uniform (torch's ``kaiming_uniform_(a=sqrt(5))``, fan_in = in) and B
zero, so the wrapped model starts equal to the base.  An OptContext or ``fit``
over the wrapped model holds (and its optimizer and checkpoints keep) only the
adapters.  ``merge(model)`` folds each adapter into its weight and puts the
plain Linear back.  ``ggmlopt.io.save_gguf_lora`` writes the adapters as
llama.cpp loads them::

    lora.apply(llama, rank=8, alpha=16.0)            # q, k, v, o projections
    fit(llama, tokens, labels, ...)                  # trains A and B only
    ggmlopt.io.save_gguf_lora(llama, "adapter.gguf")
    lora.merge(llama)                                # a plain Llama again
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import numpy as np

from .nn import init
from .nn._buffers import add_into, rows2d
from .nn.dropout import Dropout
from .nn.linear import Linear
from .nn.module import Module, named_modules, named_parameters
from .nn.parameter import Parameter

__all__ = ["DEFAULT_TARGETS", "LoRALinear", "apply", "merge", "named_adapters", "refuse_adapters"]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoRALinear(Linear):
    """LoRALinear(base, rank, alpha, *, dropout=0.0, rng=None): a Linear with a
    low-rank adapter, y = x W (+ b) + (alpha / rank) * dropout(x) A B.

    base: the Linear to wrap.  Its ``weight`` (in, out) and ``bias`` (out,) or
    None become this layer's own (the same Parameter objects, under the same
    names) and are frozen; ``merge`` gives their trainability back.
    lora_a: Parameter (in, rank), Kaiming-uniform from rng (PEFT's init: bound
    1/sqrt(in)); lora_b: Parameter (rank, out), zeros.  lora_dropout: a Dropout
    on the adapter's input only, active while training, drawing from the
    context's rng as any Dropout does.  scaling = alpha / rank.

    forward(x): x (..., in) float32 -> (..., out), the buffer this layer reuses;
    the adapter adds two thin BLAS products (x A, then (x A) B).  backward adds
    into the gradients of A and B (and of W, b only if made trainable again) and
    returns the input gradient of both paths; a frozen W costs no weight GEMM.
    """

    def __init__(self, base, rank, alpha, *, dropout=0.0, rng=None):
        if not isinstance(base, Linear) or isinstance(base, LoRALinear):
            raise TypeError(f"base: expected a Linear without an adapter, got "
                            f"{type(base).__name__}")
        rank = _rank_arg(rank)
        alpha = _alpha_arg(alpha)
        dropout = _dropout_arg(dropout)
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        a = np.zeros((self.in_features, rank), dtype=np.float32)
        # PEFT draws kaiming_uniform_(a=sqrt(5)) on torch's (rank, in) tensor: fan_in = in,
        # which is ggmlopt's (in, rank) layout's fan_in too
        init.kaiming_uniform_(a, a=math.sqrt(5), rng=gen)
        self.lora_a = Parameter(a, name="lora_a")
        self.lora_b = Parameter(np.zeros((rank, self.out_features), np.float32), name="lora_b")
        self.lora_dropout = Dropout(dropout, rng=gen)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        if "needs_input_grad" in vars(base):
            self.needs_input_grad = base.needs_input_grad
        self._base = base
        self._base_trains = tuple(None if p is None else p.requires_grad
                                  for p in (self.weight, self.bias))
        for p in (self.weight, self.bias):
            if p is not None:
                p.requires_grad = False
        self._shape = None
        self._x = None
        self._scratch = {}

    def _buffers(self, shape):
        super()._buffers(shape)
        rows = self._out2.shape[0]
        self._t = np.empty((rows, self.rank), np.float32)      # scaling * dropout(x) A
        self._t_rows = np.empty((self.rank, rows), np.float32)  # _t transposed
        self._u = np.empty((rows, self.rank), np.float32)      # scaling * grad B^T
        self._delta = np.empty((rows, self.out_features), np.float32)
        self._grad_lora_in = np.empty((rows, self.in_features), np.float32)

    def forward(self, x):
        """x: (..., in_features) -> (..., out_features) float32 (a buffer this
        layer reuses: the next forward overwrites it); ``layer(x)`` returns a copy
        the caller owns."""
        out2 = self._out2_for(x)
        x2 = rows2d(self._x)
        np.matmul(x2, self.weight.data, out=out2)
        if self.bias is not None:
            np.add(out2, self.bias.data, out=out2)
        self._xd = self.lora_dropout.forward(x2)   # x2 itself unless dropping
        np.matmul(self._xd, self.lora_a.data, out=self._t)
        np.multiply(self._t, np.float32(self.scaling), out=self._t)
        np.add(out2, np.matmul(self._t, self.lora_b.data, out=self._delta), out=out2)
        return self._out

    def infer(self, x):
        """x W + b + scaling * (x A) B as a new float32 array (no dropout: not
        training), keeping nothing for a backward pass."""
        y = super().infer(x)
        x2 = np.asarray(x, np.float32).reshape(-1, self.in_features)
        delta = (x2 @ self.lora_a.data) * np.float32(self.scaling) @ self.lora_b.data
        return y + delta.reshape(y.shape)

    def backward(self, grad_out):
        """grad_out: float32 of the last forward output's shape (..., out_features).
        Adds into lora_a.grad and lora_b.grad (and weight.grad, bias.grad when
        those train); returns d loss / d x (the last input's shape), or None when
        needs_input_grad is False."""
        g = self._grad_rows(grad_out)
        t, u, xd = self._t, self._u, self._xd
        # dB = (s xd A)^T g; dA = xd^T (s g B^T); dx = g W^T + dropout'(s g B^T A^T)
        # t^T as a contiguous (rank, rows) copy: OpenBLAS splits the product with a
        # transposed thin operand over its threads (on a busy 2-core machine 0.09 ms
        # became 78 ms), the contiguous one it runs at once
        t_rows = np.copyto(self._t_rows, t.T) or self._t_rows
        add_into(self.lora_b, lambda out: np.matmul(t_rows, g, out=out), self, "lora_b")
        np.matmul(g, self.lora_b.data.T, out=u)
        np.multiply(u, np.float32(self.scaling), out=u)
        add_into(self.lora_a, lambda out: np.matmul(xd.T, u, out=out), self, "lora_a")
        self._add_dense_grads(g)  # the frozen weight's product is skipped
        if not self.needs_input_grad:
            return None
        np.matmul(g, self.weight.data.T, out=self._grad_in2)
        lora_in = np.matmul(u, self.lora_a.data.T, out=self._grad_lora_in)
        np.add(self._grad_in2, self.lora_dropout.backward(lora_in), out=self._grad_in2)
        return self._grad_in

    def merged_weight(self) -> np.ndarray:
        """W + scaling * A B as a new float32 (in, out) array (summed in float64)."""
        delta = self.lora_a.data.astype(np.float64) @ self.lora_b.data.astype(np.float64)
        return (self.weight.data.astype(np.float64) + self.scaling * delta).astype(np.float32)

    def __repr__(self):
        return (f"LoRALinear(in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, rank={self.rank}, alpha={self.alpha}, "
                f"dropout={self.lora_dropout.p})")


# ---- argument checks ---------------------------------------------------------------------

def _rank_arg(rank) -> int:
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise TypeError(f"rank: expected an int, got {type(rank).__name__}")
    if rank < 1:
        raise ValueError(f"rank: expected >= 1, got {rank}")
    return int(rank)


def _alpha_arg(alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"alpha: expected a real number, got {type(alpha).__name__}")
    if not math.isfinite(alpha) or alpha == 0:
        raise ValueError(f"alpha: expected a finite nonzero number, got {alpha}")
    return float(alpha)


def _dropout_arg(dropout) -> float:
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
        raise TypeError(f"dropout: expected a float in [0, 1), got {type(dropout).__name__}")
    if not 0.0 <= float(dropout) < 1.0:   # NaN fails too
        raise ValueError(f"dropout: expected a drop probability in [0, 1), got {dropout}")
    return float(dropout)


def _targets_arg(targets) -> tuple[str, ...]:
    if isinstance(targets, str):
        targets = (targets,)
    if not isinstance(targets, Iterable):
        raise TypeError(f"targets: expected names of Linear layers (a tuple of str), got "
                        f"{type(targets).__name__}")
    targets = tuple(targets)
    for t in targets:
        if not isinstance(t, str):
            raise TypeError(f"targets: expected str names, got {type(t).__name__} {t!r}")
        if not t:
            raise ValueError("targets: an empty name matches nothing")
    if not targets:
        raise ValueError("targets: expected at least one name of a Linear layer")
    return targets


# ---- the module tree ---------------------------------------------------------------------

def _matches(name: str, targets) -> bool:
    """PEFT's rule: a module matches a target that is its whole dotted name or a
    suffix of it on a dot (``q_proj`` and ``self_attn.q_proj`` both match
    ``layers.0.self_attn.q_proj``)."""
    return any(name == t or name.endswith("." + t) for t in targets)


def _linears(model):
    """(dotted name, parent, key in parent, Linear) of every Linear in model's
    tree; key is an attribute name or (attribute, index) for a list element."""
    found = []
    for parent_name, parent in named_modules(model):
        prefix = f"{parent_name}." if parent_name else ""
        children = parent.named_children() if callable(getattr(parent, "named_children", None)) \
            else Module.named_children(parent) if hasattr(parent, "__dict__") else ()
        for child_name, child in children:
            if isinstance(child, Linear):
                found.append((prefix + child_name, parent, child_name, child))
    seen, unique = set(), []
    for entry in found:
        if id(entry[3]) not in seen:
            seen.add(id(entry[3]))
            unique.append(entry)
    # in the order of the model's parameter names (lm_head after the layers)
    order = {id(p): i for i, (_, p) in enumerate(named_parameters(model))}
    return sorted(unique, key=lambda e: order.get(id(e[3].weight), len(order)))


def _replace(parent, key: str, new) -> None:
    """Put new where parent's child named key (``attr`` or ``attr.i``; a
    Sequential's ``i``) was."""
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
        setattr(parent, attr, type(holder)(items))


def named_adapters(model) -> list[tuple[str, LoRALinear]]:
    """(dotted module name, LoRALinear) of every adapted layer of model, in the
    order of named_parameters (``layers.0.self_attn.q_proj``, ...)."""
    return [(name, layer) for name, _, _, layer in _linears(model)
            if isinstance(layer, LoRALinear)]


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


def apply(model, rank=8, alpha=16.0, targets=DEFAULT_TARGETS, dropout=0.0, seed=0):
    """Wrap model's Linear layers named in targets in LoRALinear adapters, in place.

    model: any module tree (a Llama, a GPT2, a Sequential, a user's module).
    targets: names of Linear layers: a layer matches a target equal to its
    dotted module name or to a dot-separated suffix of it (``q_proj``,
    ``mlp.up_proj``, ``layers.0.self_attn.v_proj``; GPT-2's ``c_attn``...).
    rank (int >= 1), alpha (finite, nonzero): every adapter's A is (in, rank),
    B (rank, out), its output scaled by alpha / rank.  dropout: the drop
    probability in [0, 1) on the adapters' input while training.  seed: the A
    matrices are drawn from ``numpy.random.default_rng(seed)`` in the order of
    the model's parameters.

    Afterwards the base weights and biases are frozen (``requires_grad=False``)
    and keep their names (``layers.0.self_attn.q_proj.weight``); the adapters are
    ``layers.0.self_attn.q_proj.lora_a`` (in, rank) and ``.lora_b`` (rank, out).
    The model's output is unchanged (B is zero).  Build the OptContext (or call
    fit) after apply.  Returns the list of named_adapters(model).

    Raises ValueError when no Linear matches (the message lists the Linear
    names the model has), when the model already has adapters (merge first), for
    rank < 1 or a bad alpha or dropout; TypeError for arguments of the wrong
    type.  On an error the model is unchanged.
    """
    rank = _rank_arg(rank)
    alpha = _alpha_arg(alpha)
    dropout = _dropout_arg(dropout)
    targets = _targets_arg(targets)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    linears = _linears(model)
    adapted = [name for name, _, _, layer in linears if isinstance(layer, LoRALinear)]
    if adapted:
        raise ValueError(f"model: it already has LoRA adapters ({', '.join(adapted[:3])}"
                         f"{', ...' if len(adapted) > 3 else ''}); merge(model) first")
    chosen = [entry for entry in linears if _matches(entry[0], targets)]
    if not chosen:
        if not linears:
            raise ValueError(f"targets: no Linear layer of the model is named {list(targets)}; "
                             "the model has no Linear layers")
        short = ", ".join(dict.fromkeys(name.rsplit(".", 1)[-1] for name, *_ in linears))
        raise ValueError(f"targets: no Linear layer of the model is named {list(targets)}; "
                         f"its {len(linears)} Linear layers are named {short} (e.g. "
                         f"{linears[0][0]})")
    gen = np.random.default_rng(int(seed))
    for _, parent, key, layer in chosen:
        _replace(parent, key, LoRALinear(layer, rank, alpha, dropout=dropout, rng=gen))
    return named_adapters(model)


def merge(model):
    """Fold every adapter of model into its weight (W += alpha / rank * A B,
    summed in float64) and put the plain Linear back, in place; the weights and
    biases train again if they did before apply.  The merged model's forward
    equals the adapted model's (to float32 rounding).  Returns model.

    Raises ValueError when model has no adapters."""
    adapters = [(parent, key, layer) for _, parent, key, layer in _linears(model)
                if isinstance(layer, LoRALinear)]
    if not adapters:
        raise ValueError("model: it has no LoRA adapters to merge (see ggmlopt.lora.apply)")
    for parent, key, layer in adapters:
        layer.weight.data[...] = layer.merged_weight()
        base = layer._base
        base.weight, base.bias = layer.weight, layer.bias
        for p, trained in zip((layer.weight, layer.bias), layer._base_trains):
            if p is not None:
                p.requires_grad = trained
        if "needs_input_grad" in vars(layer):
            base.needs_input_grad = layer.needs_input_grad
        base._shape = None   # its buffers are stale: the next forward makes new ones
        _replace(parent, key, base)
    return model
