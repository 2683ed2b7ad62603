"""What uses a language model: perplexity as llama.cpp computes it (and, with the
models' key/value caches, generation).

A language model here is any model whose ``forward(tokens)`` takes int32 token
ids (batch, T) and returns float32 logits (batch, T, vocab), as the models of
ggmlopt.models do.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ._args import int_arg
from .nn.module import eval_mode

__all__ = ["Perplexity", "perplexity"]


class Perplexity(NamedTuple):
    """llama-perplexity's final estimate: ``PPL = ppl +/- unc``, with the
    negative log-likelihood it comes from (the mean over the scored tokens)
    and the running estimate after each chunk (the ``[i]ppl,`` list it prints)."""

    ppl: float
    unc: float
    nll: float
    scored: int
    per_chunk: tuple[float, ...]


def _token_ids(ids: npt.ArrayLike) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"ids: expected integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"ids: expected shape (ntokens,), got {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ValueError(f"ids: token ids must lie in [0, 2**31), got values from {arr.min()} "
                         f"to {arr.max()}")
    return arr


def _nll_rows(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits[i])[targets[i]] per row, as llama-perplexity's
    log_softmax: the max in float, exp in float, their sum in double."""
    mx = logits.max(axis=1)
    sum_exp = np.exp(logits - mx[:, None]).sum(axis=1, dtype=np.float64)
    picked = logits[np.arange(logits.shape[0]), targets] - mx     # float32, as in C
    return np.log(sum_exp) - picked.astype(np.float64)


def perplexity(model: Any, ids: npt.ArrayLike, n_ctx: int, *, add_bos: bool | None = None,
               bos_id: int | None = None, batch_size: int = 1) -> Perplexity:
    """The perplexity of model on the token stream ids, by llama.cpp's
    ``llama-perplexity`` protocol, so a model scores the same in both programs.

    ids: int token ids (ntokens,) exactly as llama.cpp tokenizes the text (with
    the BOS it puts first when the vocabulary adds one); at least 2 * n_ctx.
    The stream is cut into ntokens // n_ctx chunks of n_ctx tokens (the rest is
    dropped); when add_bos (default: bos_id given) the first token of each chunk
    is replaced by bos_id for the forward pass; in each chunk only the positions
    n_ctx/2 .. n_ctx-2 are scored (position j predicting token j+1, so every
    scored token has at least half a window of context).  batch_size: chunks
    per forward pass (the numbers do not depend on it).

    Returns Perplexity(ppl, unc, nll, scored, per_chunk): ``ppl = exp(nll)``, nll
    the mean negative log-likelihood over the scored tokens, and unc =
    ppl * sqrt((mean nll^2 - nll^2) / (count - 1)), llama.cpp's "Final
    estimate: PPL = ppl +/- unc".  The model runs in eval mode.
    """
    tokens = _token_ids(ids)
    n_ctx = int_arg(n_ctx, "n_ctx", 3)
    batch_size = int_arg(batch_size, "batch_size", 1)
    if add_bos is None:
        add_bos = bos_id is not None
    if add_bos:
        if bos_id is None:
            raise ValueError("bos_id: required with add_bos=True")
        bos_id = int_arg(bos_id, "bos_id", 0)
    if tokens.size < 2 * n_ctx:
        raise ValueError(f"ids: you need at least {2 * n_ctx} tokens to evaluate perplexity "
                         f"with a context of {n_ctx}; got {tokens.size}")
    n_chunk = tokens.size // n_ctx
    first = n_ctx // 2
    chunks = tokens[:n_chunk * n_ctx].astype(np.int32).reshape(n_chunk, n_ctx)
    nll = nll2 = 0.0
    count = 0
    per_chunk = []
    with eval_mode(model):
        for start in range(0, n_chunk, batch_size):
            batch = chunks[start:start + batch_size].copy()
            targets = batch[:, first + 1:].copy()   # before the BOS replacement
            if bos_id is not None and add_bos:
                batch[:, 0] = bos_id
            logits = model.forward(batch)
            want = (batch.shape[0], n_ctx)
            if not isinstance(logits, np.ndarray) or logits.shape[:2] != want or logits.ndim != 3:
                raise ValueError(f"model.forward: expected logits of shape {want + ('vocab',)}, "
                                 f"got {getattr(logits, 'shape', type(logits).__name__)}")
            for row in range(batch.shape[0]):
                v = _nll_rows(np.asarray(logits[row, first:n_ctx - 1], np.float32),
                              targets[row])
                nll += float(v.sum())
                nll2 += float((v * v).sum())
                count += v.size
                per_chunk.append(math.exp(nll / count))
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    unc = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else math.nan
    return Perplexity(ppl, unc, mean, count, tuple(per_chunk))
