"""LoRA's adapter layers: LoRALinear and LoRAEmbedding wrap a base layer (a
float32 Linear or Embedding, or one kept in its file's type) and add
``scale * (x A) B`` to its output, as Hugging Face PEFT's ``LoraLayer`` does.
ggmlopt.lora chooses the layers to wrap and merges them back."""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from .. import gemm, kernels_embedding
from . import init
from ._bf16 import add_product_bf16, bf16_copy
from ._buffers import add_into, rows2d, trains
from .dropout import Dropout
from .embedding import Embedding
from .linear import Linear
from .module import set_training
from .parameter import Parameter
from .quantized import QuantizedEmbedding, QuantizedLinear

__all__ = ["LoRAEmbedding", "LoRALinear", "alpha_arg", "dropout_arg", "rank_arg"]


class _AdapterTraining:
    """What both adapter layers share: the base layer and the merged weight, and
    train(): the base layer (``_base``, not a sub-module: its weight keeps the
    adapter's name) follows, so a kept weight's products of few rows see the
    training flag (float32 while training)."""

    _base: Any
    weight: Any
    lora_a: Parameter
    lora_b: Parameter
    scaling: float

    def train(self, mode: bool = True):
        super().train(mode)  # type: ignore[misc]
        set_training(self._base, mode)
        return self

    def training_followers(self) -> tuple[Any, ...]:
        """The base layer, whose flag train() sets (nn.module.with_followers: what
        eval_mode and the inference helpers put back)."""
        return (self._base,)

    @property
    def base_layer(self):
        """The wrapped layer (a Linear or QuantizedLinear, an Embedding or
        QuantizedEmbedding), PEFT's ``base_layer``: read-only, and not a sub-module,
        so the base weight keeps the adapter's own name (``q_proj.weight``)."""
        return self._base

    def get_base_layer(self):
        """PEFT's accessor: the wrapped layer (``base_layer``)."""
        return self._base

    def merged_weight(self) -> np.ndarray:
        """W + scaling * A B as a new float32 array of W's shape, (in, out) or
        (vocab, dim) (summed in float64; a quantized W dequantized first)."""
        delta = self.lora_a.data.astype(np.float64) @ self.lora_b.data.astype(np.float64)
        w = self._base.dequantize() if self.weight is None else self.weight.data
        return (w.astype(np.float64) + self.scaling * delta).astype(np.float32)


class LoRALinear(_AdapterTraining, Linear):
    """LoRALinear(base, rank, alpha, *, dropout=0.0, rng=None): a Linear with a
    low-rank adapter, y = x W (+ b) + (alpha / rank) * dropout(x) A B.

    base: the Linear or QuantizedLinear to wrap.  A Linear's ``weight`` (in,
    out) and ``bias`` (out,) or None become this layer's own (the same
    Parameter objects, under the same names) and are frozen; ``merge`` gives
    their trainability back.  A QuantizedLinear's weight stays in its type
    (``weight`` is None; QLoRA): the base's product runs through its kernels.
    lora_a: Parameter (in, rank), Kaiming-uniform from rng (PEFT's init: bound
    1/sqrt(in)); lora_b: Parameter (rank, out), zeros.  lora_dropout: a Dropout
    on the adapter's input only, active while training, drawing from the
    context's rng as any Dropout does.  scaling = alpha / rank.

    forward(x): x (..., in) float32 -> (..., out), the buffer this layer reuses;
    the adapter adds two thin products (x A, then (x A) B).  backward adds
    into the gradients of A and B (and of W, b only if made trainable again) and
    returns the input gradient of both paths; a frozen W costs no weight GEMM.
    """

    def __init__(self, base, rank, alpha, *, dropout=0.0, rng=None):
        if not isinstance(base, (Linear, QuantizedLinear)) or isinstance(base, LoRALinear):
            raise TypeError(f"base: expected a Linear or QuantizedLinear without an adapter, "
                            f"got {type(base).__name__}")
        rank = rank_arg(rank)
        alpha = alpha_arg(alpha)
        dropout = dropout_arg(dropout)
        gen = init._generator(rng)   # (TypeError naming rng before the base changes)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = getattr(base, "weight", None)   # None over a QuantizedLinear
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
        rows = self._ones.shape[0]
        self._t = np.empty((rows, self.rank), np.float32)      # scaling * dropout(x) A
        self._t_rows = np.empty((self.rank, rows), np.float32)  # _t transposed
        self._u = np.empty((rows, self.rank), np.float32)      # scaling * grad B^T
        self._u_rows = np.empty((self.rank, rows), np.float32)  # _u transposed
        self._da_rows = np.empty((self.rank, self.in_features), np.float32)  # dA^T

    def forward(self, x, out=None):
        """x: (..., in_features) -> (..., out_features) float32 (a buffer this
        layer reuses: the next forward overwrites it); ``layer(x)`` returns a copy
        the caller owns.  out: as Linear.forward's (written and returned, no
        output buffer kept)."""
        out2 = self._out2_for(x, out)
        x2 = rows2d(self._x)
        self._base.product(x2, out2)
        if self.bias is not None:
            np.add(out2, self.bias.data, out=out2)
        self._xd = self.lora_dropout.forward(x2)   # x2 itself unless dropping
        gemm.matmul(self._xd, self.lora_a.data, self._t)
        np.multiply(self._t, np.float32(self.scaling), out=self._t)
        gemm.matmul(self._t, self.lora_b.data, out2, accumulate=True)
        return self._out if out is None else out

    def infer(self, x):
        """x W + b + scaling * (x A) B as a new float32 array (no dropout: not
        training), keeping nothing for a backward pass."""
        y = self._base.infer(x)
        x2 = np.ascontiguousarray(x, np.float32).reshape(-1, self.in_features)
        # forward's products and order: t = scaling * (x A), then y += t B in the GEMM
        t = gemm.matmul(x2, self.lora_a.data, np.empty((x2.shape[0], self.rank), np.float32))
        np.multiply(t, np.float32(self.scaling), out=t)
        gemm.matmul(t, self.lora_b.data, y.reshape(-1, self.out_features), accumulate=True)
        return y

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
        add_into(self.lora_b, lambda out: gemm.matmul(t_rows, g, out), self, "lora_b")
        gemm.matmul(g, self.lora_b.data.T, u)
        np.multiply(u, np.float32(self.scaling), out=u)
        # dA^T = u^T xd, then transposed into dA: the product reads xd (long out of
        # cache by now) row after row, which the prefetchers follow, where xd^T u
        # walked it column block by column block (4x slower in a step)
        u_rows = np.copyto(self._u_rows, u.T) or self._u_rows
        da_rows = gemm.matmul(u_rows, xd, self._da_rows)
        add_into(self.lora_a, lambda out: np.copyto(out, da_rows.T), self, "lora_a")
        self._add_base_grads(g)  # the frozen weight's product is skipped
        if not self.needs_input_grad:
            return None
        grad_in, grad_in2 = self._input_grad()
        self._base.product_transposed(g, grad_in2)
        if self.lora_dropout.p == 0.0 and gemm.accumulates_in_place():
            # no dropout to undo: the adapter's part is summed onto the base's in
            # the product, without a temporary and a pass to add it
            gemm.matmul(u, self.lora_a.data.T, grad_in2, accumulate=True)
            return grad_in
        lora_in = gemm.matmul(u, self.lora_a.data.T, np.empty_like(grad_in2))
        np.add(grad_in2, self.lora_dropout.backward(lora_in), out=grad_in2)
        return grad_in

    def _add_base_grads(self, g):
        """The base's weight and bias gradients where they train again: in a bf16
        pass the weight's from the bf16 copies of x and g, as a Linear's."""
        base = self._base
        x16 = getattr(base, "_px16", None)
        if not (trains(self.weight) and getattr(base, "_bf16_pass", False) and x16 is not None):
            self._add_dense_grads(g)
            return
        add_product_bf16(self.weight, x16.T, bf16_copy(base, "_pg16", g))
        if trains(self.bias):
            ones = self._ones
            add_into(self.bias, lambda out: gemm.matmul(ones, g, out), self, "bias")

    def __repr__(self):
        return (f"LoRALinear(in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, rank={self.rank}, alpha={self.alpha}, "
                f"dropout={self.lora_dropout.p})")


class LoRAEmbedding(_AdapterTraining, Embedding):
    """LoRAEmbedding(base, rank, alpha, *, rng=None): an Embedding with a low-rank
    adapter, PEFT's ``lora.Embedding``: row ids of W + (alpha / rank) * A[ids] B.

    base: the Embedding or QuantizedEmbedding to wrap.  An Embedding's ``weight``
    (vocab, dim) becomes this layer's own and is frozen; a QuantizedEmbedding's
    stays in its type (``weight`` is None; QLoRA), its rows dequantized as they
    are gathered.  lora_a: Parameter (vocab, rank), zeros; lora_b: Parameter
    (rank, dim), N(0, 1) from rng (PEFT's init for embeddings, so the wrapped
    model starts equal to the base).  PEFT applies no dropout to an embedding's
    adapter, and neither does this.  A tied output head keeps reading the base
    weight, as in PEFT.  backward adds into A's rows of the ids (in the order of
    the ids, as Embedding does; none into the base's padding_idx row, as PEFT
    gathers A) and into B; it returns None.
    """

    def __init__(self, base, rank, alpha, *, rng=None):
        if not isinstance(base, (Embedding, QuantizedEmbedding)) or \
                isinstance(base, LoRAEmbedding):
            raise TypeError(f"base: expected an Embedding or QuantizedEmbedding without an "
                            f"adapter, got {type(base).__name__}")
        rank = rank_arg(rank)
        alpha = alpha_arg(alpha)
        gen = init._generator(rng)   # (TypeError naming rng before the base changes)
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        # PEFT gathers A with the base's padding_idx: that row of A never trains
        self.padding_idx = getattr(base, "padding_idx", None)
        self.weight = getattr(base, "weight", None)   # None over a QuantizedEmbedding
        self.lora_a = Parameter(np.zeros((self.num_embeddings, rank), np.float32),
                                name="lora_a")
        self.lora_b = Parameter(gen.standard_normal((rank, self.embedding_dim)),
                                name="lora_b")
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self._base = base
        self._base_trains = (None if self.weight is None else self.weight.requires_grad,)
        if self.weight is not None:
            self.weight.requires_grad = False
        self._shape = None
        self._ids = None
        self._have_ids = False
        self._scratch = {}

    def forward(self, ids):
        """ids: integers (...) -> float32 (..., dim), a buffer this layer reuses."""
        if self.weight is None:   # the quantized base gathers (and checks) the ids
            out = self._base.forward(ids)
            # a copy: the caller may refill its ids before backward scatters by them
            self._ids = np.array(self._base._ids, dtype=np.int32, copy=True)
            self._shape, self._have_ids = self._base._shape, True
        else:
            out = super().forward(ids)
        self._rows = kernels_embedding.embedding(self._ids, self.lora_a.data)   # A[ids]
        delta = (self._rows.reshape(-1, self.rank) @ self.lora_b.data) * np.float32(self.scaling)
        np.add(out, delta.reshape(out.shape), out=out)
        return out

    def backward(self, grad_out):
        """grad_out like the last forward output: adds into lora_a.grad (the rows
        of the ids) and lora_b.grad; returns None (ids have no gradient)."""
        if self.weight is None:
            if not self._have_ids:
                raise RuntimeError("backward: call forward first")
            self._base.backward(grad_out)   # checks the shape; a kept weight has no gradient
        else:
            super().backward(grad_out)
        g = np.ascontiguousarray(grad_out, np.float32).reshape(-1, self.embedding_dim)
        g = g * np.float32(self.scaling)
        if self.lora_b.requires_grad:
            add_into(self.lora_b, lambda out: np.matmul(self._rows.reshape(-1, self.rank).T, g,
                                                        out=out), self, "lora_b")
        if self.lora_a.requires_grad:
            rows = np.ascontiguousarray((g @ self.lora_b.data.T).reshape(
                self._ids.shape + (self.rank,)), np.float32)
            kernels_embedding.embedding_backward(self._ids, self._without_padding(rows),
                                                 self.lora_a.grad)
            self.lora_a.grad_is_zero = False

    def project(self, rows, out=None, keep=True):
        """A tied head reads the base weight (PEFT's tied embedding adapter)."""
        if self.weight is None:
            return self._base.project(rows, out=out, keep=keep)
        return super().project(rows, out=out, keep=keep)

    def project_backward(self, g, rows):
        if self.weight is None:
            return self._base.project_backward(g, rows)
        return super().project_backward(g, rows)

    def __repr__(self):
        return (f"LoRAEmbedding({self.num_embeddings}, {self.embedding_dim}, rank={self.rank}, "
                f"alpha={self.alpha})")


def rank_arg(rank) -> int:
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise TypeError(f"rank: expected an int, got {type(rank).__name__}")
    if rank < 1:
        raise ValueError(f"rank: expected >= 1, got {rank}")
    return int(rank)


def alpha_arg(alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"alpha: expected a real number, got {type(alpha).__name__}")
    if not math.isfinite(alpha) or alpha == 0:
        raise ValueError(f"alpha: expected a finite nonzero number, got {alpha}")
    return float(alpha)


def dropout_arg(dropout) -> float:
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
        raise TypeError(f"dropout: expected a float in [0, 1), got {type(dropout).__name__}")
    if not 0.0 <= float(dropout) < 1.0:   # NaN fails too
        raise ValueError(f"dropout: expected a drop probability in [0, 1), got {dropout}")
    return float(dropout)
