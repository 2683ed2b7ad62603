"""Embedding: a lookup table of vectors indexed by integer ids."""
from __future__ import annotations

import numpy as np

from .. import gemm, kernels_embedding
from ._bf16 import add_product_bf16, bf16_copy, bf16_weight
from ._buffers import add_product, empty
from ._lm_args import check_size, trains
from .init import initializing
from .module import Module
from .parameter import Parameter

__all__ = ["Embedding", "standard_normal"]


def padding_index(padding_idx, num_embeddings: int) -> int | None:
    """A padding_idx checked as torch checks it (an int in [-num, num); a
    negative one counts from the end), as a row index, or None."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, (int, np.integer)):
        raise TypeError(f"padding_idx: expected an int or None, got "
                        f"{type(padding_idx).__name__}")
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"padding_idx: {padding_idx} is outside the vocabulary "
                         f"[-{num_embeddings}, {num_embeddings})")
    return int(padding_idx) % num_embeddings


def standard_normal(weight: np.ndarray, bias, rng: np.random.Generator) -> None:
    """torch.nn.Embedding's default: weight ~ N(0, 1) (bias, always None here,
    is ignored).  Fills the array in place."""
    weight[...] = rng.standard_normal(size=weight.shape)


class Embedding(Module):
    """Embedding(num_embeddings, embedding_dim, *, init=None, rng=None, padding_idx=None)

    forward(ids): integer ids of any shape (...) -> float32 (..., embedding_dim),
    row ids[...] of weight (torch.nn.Embedding).  weight: Parameter
    (num_embeddings, embedding_dim).  init(weight, None, rng) fills the float32
    array in place; default standard_normal, N(0, 1) as torch's layer (Hugging
    Face's Llama and GPT-2 re-initialise with std 0.02: pass such an init, or
    let the model do it).  rng: None, an int seed or a numpy Generator.

    Ids must be integers (TypeError otherwise, floats included) in
    [0, num_embeddings) (IndexError naming the first bad id and its position,
    before any work).  ``backward(grad_out)`` adds grad_out's rows into the rows
    of weight.grad its ids name (repeated ids add up, in the order of the ids:
    the same bits on any number of threads; nothing when weight.requires_grad
    is False) and returns None: ids have no gradient.  padding_idx (torch's,
    a negative one counting from the end): the row whose lookups add no
    gradient (a model's pad token, as transformers builds its embeddings), zeros
    when the layer initialises its weight.
    """

    # a tied head's bf16 operands (project under precision="bf16")
    _bf16_pass = False
    _h16 = _w16 = _g16 = None

    def __init__(self, num_embeddings, embedding_dim, *, init=None, rng=None, padding_idx=None):
        self.num_embeddings = check_size(num_embeddings, "num_embeddings")
        self.embedding_dim = check_size(embedding_dim, "embedding_dim")
        self.padding_idx = padding_index(padding_idx, self.num_embeddings)
        if not initializing():   # inside skip_init(): a loader fills the weight
            self.weight = Parameter.zeros((self.num_embeddings, self.embedding_dim), "weight")
        else:
            gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
            # initialised in the Parameter's own array: no transient copy of the table
            self.weight = Parameter.zeros((self.num_embeddings, self.embedding_dim), "weight")
            w = self.weight.data
            (init or standard_normal)(w, None, gen)
            if self.padding_idx is not None:
                w[self.padding_idx] = 0.0
        self._shape = None
        self._ids = None
        self._have_ids = False
        self._scratch = {}   # add_product's, where the BLAS cannot accumulate in place

    def _check_ids(self, ids):
        if not isinstance(ids, np.ndarray):
            ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"ids: expected integer token ids, got dtype {ids.dtype}")
        if ids.size:
            bad = (ids < 0) | (ids >= self.num_embeddings)
            if bad.any():
                flat = int(np.flatnonzero(bad.reshape(-1))[0])
                pos = tuple(int(p) for p in np.unravel_index(flat, ids.shape))
                raise IndexError(f"ids: id {int(ids.reshape(-1)[flat])} at position {pos} is "
                                 f"out of range; expected ids in [0, {self.num_embeddings})")
        return ids

    def forward(self, ids):
        """ids: integers (...) -> float32 (..., embedding_dim), a buffer this layer
        reuses (the next forward overwrites it); ``layer(ids)`` returns a copy the
        caller owns."""
        ids = self._check_ids(ids)
        if ids.shape != self._shape:
            self._out = empty(ids.shape + (self.embedding_dim,), dtype=np.float32)
            self._ids = empty(ids.shape, dtype=np.int32)
            self._shape = ids.shape
        # a copy of the ids: the caller may reuse its array before backward
        np.copyto(self._ids, ids, casting="unsafe")
        self._have_ids = True
        return kernels_embedding.embedding(self._ids, self.weight.data, out=self._out)

    def backward(self, grad_out):
        """grad_out: float32 (..., embedding_dim) like the last forward output.
        Adds into weight.grad; returns None."""
        if not self._have_ids:
            raise RuntimeError("backward: call forward first")
        if not isinstance(grad_out, np.ndarray):
            grad_out = np.asarray(grad_out)
        if grad_out.dtype.kind not in "biuf":
            raise TypeError(f"grad_out: expected real numbers, got dtype {grad_out.dtype}")
        expected = self._shape + (self.embedding_dim,)
        if grad_out.shape != expected:
            raise ValueError(f"grad_out: expected shape {expected} like the last forward "
                             f"output, got {grad_out.shape}")
        if trains(self.weight):
            g = self._without_padding(np.ascontiguousarray(grad_out, dtype=np.float32))
            # adding into zeros is writing: no special case for grad_is_zero
            kernels_embedding.embedding_backward(self._ids, g, self.weight.grad)
            self.weight.grad_is_zero = False

    def _without_padding(self, rows):
        """rows (the last ids' shape, then features) with the padding id's rows
        zeroed (a copy where there are any): what backward scatters."""
        if self.padding_idx is None:
            return rows
        pad = self._ids == self.padding_idx
        if not pad.any():
            return rows
        rows = rows.copy()
        rows[pad] = 0.0
        return rows

    def project(self, rows, out=None, keep=True):
        """rows (n, embedding_dim) float32 -> rows W^T (n, num_embeddings): the
        logits of an output head tied to this embedding (into out when given;
        bf16 operands inside a ``precision="bf16"`` context).  keep=False: an
        inference product (float32) that leaves what project_backward reads alone."""
        if out is None:
            out = empty((rows.shape[0], self.num_embeddings), dtype=np.float32)
        if not keep:
            return gemm.matmul(rows, self.weight.data.T, out)
        self._bf16_pass = gemm.bf16_active()
        if not self._bf16_pass:
            return gemm.matmul(rows, self.weight.data.T, out)
        return gemm.matmul_bf16(bf16_copy(self, "_h16", rows),
                                bf16_weight(self, self.weight.data).T, out)

    def project_backward(self, g, rows):
        """The tied head's backward for the logits' gradient g (n, num_embeddings)
        of project(rows): adds g^T rows into weight.grad (when it trains) and
        returns the rows' gradient g W (n, embedding_dim)."""
        w = self.weight
        if self._bf16_pass and self._w16 is not None and self._h16 is not None:
            return self.project_backward_bf16(bf16_copy(self, "_g16", g))
        dh = gemm.matmul(g, w.data, empty((g.shape[0], self.embedding_dim), np.float32))
        add_product(w, g.T, rows, self, "weight")
        return dh

    def takes_bf16_gradient(self) -> bool:
        """Whether the last project() was a bf16 pass whose backward can take
        the logits' gradient as bf16 bits (project_backward_bf16)."""
        return bool(self._bf16_pass) and self._w16 is not None and self._h16 is not None

    def project_backward_bf16(self, g16):
        """project_backward of a bf16 pass for the logits' gradient already
        rounded to bfloat16 bits (uint16 (n, num_embeddings)): what
        project_backward multiplies after rounding a float32 gradient."""
        dh = gemm.matmul_bf16(g16, self._w16, empty((g16.shape[0], self.embedding_dim),
                                                    np.float32))
        add_product_bf16(self.weight, g16.T, self._h16)
        return dh

    def __repr__(self):
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"Embedding({self.num_embeddings}, {self.embedding_dim}{pad})"
