"""Documents packed into token windows, as the layers see them.

A packed window (``Dataset.from_chat(..., packing=True)``) holds several
documents one after another.  The window carries its boundaries in the token ids
themselves: the first token of each document is stored as ``-1 - id`` (a
negative number no vocabulary holds), so the boundaries travel with the batch
through every path a batch of token ids takes (fit, evaluate, checkpoints, many
processes), and a consumer that does not know the convention fails on the
negative id instead of silently attending across documents.

``split_documents(tokens)`` turns such a window into the ids and a
``DocumentPositions``: each token's position inside its document (where RoPE and
learned positions restart) and the first token of its document (the first key
it may attend to: the attention kernels' ``kv_start``).
"""
from __future__ import annotations

import numpy as np

__all__ = ["DocumentPositions", "document_ids", "mark_document_starts", "split_documents"]


class DocumentPositions:
    """Where each token of a (batch, T) window of packed documents stands.

    positions: int32 (batch, T), each token's position in its document (0 at
    its first token).  starts: int32 (batch, T), the column of its document's
    first token (``arange(T) - positions``), the first key it attends to.
    """

    __slots__ = ("positions", "starts")

    def __init__(self, positions: np.ndarray):
        p = np.asarray(positions)
        if p.ndim != 2 or p.dtype.kind not in "iu":
            raise ValueError(f"positions: expected integer positions of shape (batch, T), got "
                             f"{p.dtype} {p.shape}")
        p = np.ascontiguousarray(p, dtype=np.int32)
        t = p.shape[1]
        # each row restarts at 0 and otherwise counts up by one
        ok = p[:, :1] == 0 if t else np.ones((p.shape[0], 1), bool)
        steps = p[:, 1:]
        if not (ok.all() and ((steps == 0) | (steps == p[:, :-1] + 1)).all()):
            raise ValueError("positions: expected each row to start at 0 and each token to "
                             "be 0 (a new document) or the previous token's position + 1")
        self.positions = p
        self.starts = np.ascontiguousarray(np.arange(t, dtype=np.int32) - p)

    @property
    def shape(self) -> tuple[int, int]:
        """(batch, T)."""
        b, t = self.positions.shape
        return b, t

    def __repr__(self):
        return f"DocumentPositions(shape={self.shape}, documents={int((self.positions == 0).sum())})"


def mark_document_starts(ids: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """ids int32 (..., T) with each token at a True of starts (same shape) stored
    as -1 - id: the packed form split_documents reads."""
    ids = np.asarray(ids, dtype=np.int32)
    return np.where(starts, -1 - ids, ids).astype(np.int32)


def split_documents(tokens: np.ndarray) -> tuple[np.ndarray, DocumentPositions | None]:
    """(ids, positions) of an int32 (batch, T) window: ids with every marked
    document start (-1 - id) read back as id, and their DocumentPositions, or
    None when the window has no mark (one document per row: plain positions).
    Column 0 always starts a document."""
    tokens = np.asarray(tokens)
    if not tokens.size or tokens.min() >= 0:
        return tokens, None
    marked = tokens < 0
    ids = np.where(marked, -1 - tokens, tokens).astype(np.int32)
    t = tokens.shape[1]
    col = np.arange(t, dtype=np.int32)
    begins = np.where(marked, col, 0)
    starts = np.maximum.accumulate(begins, axis=1)
    return ids, DocumentPositions(col - starts)


def document_ids(tokens: np.ndarray) -> np.ndarray:
    """int32 like tokens (batch, T): the index of each token's document in its
    row (0 for the first), read from the marks split_documents reads."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens: expected shape (batch, T), got {tokens.shape}")
    marked = tokens < 0
    marked[:, 0] = True
    return (np.cumsum(marked, axis=1) - 1).astype(np.int32)
