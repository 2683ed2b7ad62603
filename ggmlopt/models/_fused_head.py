"""The output head and the cross-entropy of a language model in training, chunk by
chunk of rows, so the (rows, vocab) logits and their gradient never exist whole.

For each chunk of labelled rows: the chunk's logits through the head (its own
Linear, or the tied embedding), their masked cross-entropy and its gradient
(one kernel), the predictions, then the head's backward on that gradient: the
head's weight gradient gets the chunk's share and the rows' gradient is kept.
Rows labelled -1 cost no head product at all: in supervised fine-tuning most
positions are the prompt.  One chunk buffer of at most CHUNK_BYTES (the
logits, then their gradient written over them) is the head's working memory at
any vocabulary and length, beside the copies of the labelled rows it reads and
their gradient (2 x rows x dim floats: 18 MiB for 4096 rows of 576).

The loss is the mean over the labelled rows, scaled as OptContext scales it,
equal to the unfused kernel's on the whole logits up to float32 rounding.  An
OptContext raises on a non-finite loss before any gradient changes; here the
head's gradient changes chunk by chunk, so a head that trains is first shown
to give finite logits (finite hidden rows and weights whose norms cannot
overflow a product); failing that, a first pass computes the loss alone.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import kernels
from ..nn._bf16 import bf16_buffer, weight_fixed
from ..nn._buffers import empty, trains
from ..nn.embedding import Embedding
from ..nn.linear import Linear
from ._logit_softcap import soft_cap, soft_cap_with_slope

__all__ = ["CHUNK_BYTES", "chunk_rows", "head_loss"]

# 256 rows of a 49152 vocabulary in one chunk: each chunk packs the head's whole
# weight again for its two products (two chunks of 128 rows cost 12-30 ms of a
# SmolLM2-135M-shaped LoRA step of 0.63-0.7 s)
CHUNK_BYTES = 56 << 20
# a product of norms below this cannot overflow float32 (max 3.4e38) in a dot product
_SAFE_PRODUCT = 1e37


def _head(model):
    """The layer that makes the logits: the model's own head, or the tied embedding."""
    return model.lm_head if model.lm_head is not None else model._embedding


def _takes_bf16_gradient(head) -> bool:
    """Whether head (a plain Linear or a tied Embedding, nothing wrapped) took
    its last forward in a bf16 pass that can take the gradient's bf16 bits."""
    return type(head) in (Linear, Embedding) and head.takes_bf16_gradient()


def _head_trains(model) -> bool:
    return any(trains(p) for p in _head(model).parameters())


def _max_norm(a: np.ndarray, axis: int) -> float:
    """An upper bound on the largest L2 norm along axis: float32 sums of squares
    (chunked: no full temporary) are within n u of the exact ones, n the length
    summed, so (1 + 2 n u) covers the rounding; a square that overflows gives inf
    (then no bound, and the caller takes the safe path)."""
    best = 0.0
    n = a.shape[1 - axis]
    step = max(1, (4 << 20) // max(1, a.shape[axis] * 4))
    with np.errstate(over="ignore"):
        for s in range(0, n, step):
            part = a[:, s:s + step] if axis == 0 else a[s:s + step]
            sq = np.einsum("ij,ij->j" if axis == 0 else "ij,ij->i", part, part)
            best = max(best, float(sq.max(initial=0.0)))
    return math.sqrt(best * (1.0 + 2.0 * a.shape[axis] * 2.0 ** -24))


def _finite_by_bound(model, rows: np.ndarray) -> bool:
    """Whether every logit of rows through a head that trains is surely finite:
    Cauchy-Schwarz on the rows' and the weight's norms (a plain Linear head or a
    tied float embedding; any other head that trains is not shown finite)."""
    head = model.lm_head
    if head is None:
        if type(model._embedding) is not Embedding:
            return False
        w, axis, bias = model._embedding.weight.data, 1, None
    elif type(head) is Linear:
        w, axis, bias = head.weight.data, 0, head.bias
    else:
        return False
    bound = _max_norm(rows, 1) * _max_norm(w, axis)
    if bias is not None:
        bound += float(np.abs(bias.data).max(initial=0.0))
    return math.isfinite(bound) and bound < _SAFE_PRODUCT


def _dropout_streams(head) -> list[tuple[np.random.Generator, Any]]:
    """(generator, state) of each Dropout in head (a LoRA adapter's), to draw
    the same masks again."""
    from ..nn.dropout import Dropout
    from ..nn.module import modules
    return [(m.rng, m.rng.bit_generator.state) for m in modules(head)
            if isinstance(m, Dropout) and m.p > 0]


def head_loss(model, hidden_rows: np.ndarray, labels: np.ndarray, *, grad_scale: float,
              backward: bool, pred: np.ndarray | None) -> tuple[float, np.ndarray | None]:
    """(loss, grad_rows) of hidden_rows (rows, dim) and labels (rows,) int32 (-1:
    masked) through model's head: the float32 mean over the labelled rows (0
    when none is; NaN, with nothing changed, when it is not finite); with
    backward the head's parameters get their gradient (times grad_scale) and
    grad_rows is d loss / d hidden_rows (zero on the masked rows; None without
    backward).  pred (rows,) int32: each labelled row's argmax, -1 on the
    masked rows."""
    labelled = np.flatnonzero(labels >= 0)
    n = labelled.size
    if pred is not None:
        pred.fill(-1)
    grad_rows = np.zeros(hidden_rows.shape, np.float32) if backward else None
    if n == 0:
        return 0.0, grad_rows
    h = np.take(hidden_rows, labelled, axis=0, out=empty((n,) + hidden_rows.shape[1:]))
    y = np.ascontiguousarray(labels[labelled])
    if not np.isfinite(h).all():
        return float("nan"), grad_rows
    if backward and _head_trains(model) and not _finite_by_bound(model, h):
        # the gradient changes chunk by chunk: know the loss is finite first, with
        # the masks the training pass then draws again (a head adapter's dropout):
        # the loss checked is the one trained, and the stream moves as one pass's
        streams = _dropout_streams(_head(model))
        loss = _chunks(model, h, y, labelled, grad_scale)
        for rng, state in streams:
            rng.bit_generator.state = state
        if not math.isfinite(loss):
            return loss, grad_rows
    # the head's weight is the same for every chunk: its bf16 copy is made once
    with weight_fixed(_head(model)):
        return _chunks(model, h, y, labelled, grad_scale, grad_rows, pred), grad_rows


def chunk_rows(n: int, vocab: int) -> int:
    """Rows per chunk of n labelled rows: as few chunks as CHUNK_BYTES of logits
    allow (each chunk's products pack the head's whole weight again), their rows
    shared out evenly (512 rows of a 49152 vocabulary: two chunks of 256, 48 MiB
    each, not 298 and 214 in 56 MiB buffers)."""
    most = max(1, CHUNK_BYTES // (4 * vocab))
    chunks = max(1, -(-n // most))
    return max(1, -(-n // chunks))


def _chunks(model, h, y, labelled, grad_scale, grad_rows=None, pred=None) -> float:
    """The chunk loop over the labelled rows h (n, dim): the loss, the
    predictions into pred, and with grad_rows (rows, dim) the head's backward
    into its parameters and the rows' gradient."""
    vocab = model.config.vocab_size
    n = h.shape[0]
    step = chunk_rows(n, vocab)
    with_grads = grad_rows is not None
    rows = min(step, n)
    # the logits, then their gradient written over them (the backward reads the
    # rows and the weight, never the logits): one chunk buffer, no layer keeps it
    lbuf = empty((rows, vocab), np.float32)
    pbuf = empty(rows if pred is not None else 0, np.int32)
    head = _head(model)
    cap = getattr(model, "final_logit_softcap", None)
    # Gemma 2's capped logits: the cap's slope, read after the loss kernel has
    # written the gradient over the logits
    sbuf = empty((rows, vocab), np.float32) if cap is not None and with_grads else None
    total = 0.0
    for s in range(0, n, step):
        hc, yc = h[s:s + step], y[s:s + step]
        m = hc.shape[0]
        if model.lm_head is not None:
            logits = model.lm_head.forward(hc, out=lbuf[:m])
        else:
            logits = model._embedding.project(hc, out=lbuf[:m])
        if cap is not None:
            if sbuf is not None:
                soft_cap_with_slope(logits, cap, sbuf[:m])
            else:
                soft_cap(logits, cap)
        # a bf16 pass's head multiplies the gradient's bf16 bits: the loss kernel
        # writes them (into the buffer the head's own rounding would fill) in
        # place of a float32 gradient read again to be rounded
        g16 = bf16_buffer(head, "_g16", logits.shape) \
            if with_grads and cap is None and _takes_bf16_gradient(head) else None
        g = (logits if g16 is None else g16) if with_grads else None
        # the chunk's mean times m / n: its share of the mean over every labelled row
        # (the predictions read in the loss's pass over the logits)
        pc = pbuf[:m] if pred is not None else None
        part = float(kernels.cross_entropy(logits, yc, g, grad_scale=grad_scale * m / n,
                                           pred=pc))
        if not math.isfinite(part):
            return part
        total += part * m
        if pred is not None:
            pred[labelled[s:s + m]] = pc
        if with_grads:
            if sbuf is not None and g is not None:
                np.multiply(g, sbuf[:m], out=g)
            if model.lm_head is not None:
                model.lm_head.needs_input_grad = True
                dh = model.lm_head.backward(g) if g16 is None else \
                    model.lm_head.backward_bf16(g16)
            else:
                dh = model._embedding.project_backward(g, hc) if g16 is None else \
                    model._embedding.project_backward_bf16(g16)
            grad_rows[labelled[s:s + m]] = dh
    return float(np.float32(total / n))
