"""What Llama and GPT2 share: token checks, the output head (tied to the token
embedding or its own Linear), the key/value cache of generation."""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _pool_linger, kernels_attention
from .._blas_threads import (
    _usable_cpus,
    blas_limit_for_decoding,
    blas_threads_setting,
    choose_blas_threads,
    current_blas_threads,
    others_running_recently,
)
from ..nn._buffers import empty, trains
from ..nn.embedding import Embedding
from ..nn.linear import Linear
from ..nn.module import Module, grads_ready, in_use
from ..nn.parameter import Parameter
from ..nn.positions import split_documents
from ..nn.recompute import checkpointed_backward, checkpointed_forward
from ._fused_head import head_loss
from ._logit_softcap import soft_cap, soft_cap_backward

__all__ = ["CausalLM", "KVCache", "PreNormBlock", "cached_self_attention", "normal_init"]


def normal_init(std):
    """An init for Linear and Embedding: weights N(0, std), biases zero (Hugging
    Face's _init_weights with initializer_range = std)."""
    def init(weight, bias, rng):
        # a few MiB of float64 draws at a time (the same values as one draw: the
        # generator's stream in order), not a float64 copy of a whole head
        if not weight.flags.c_contiguous or weight.ndim == 0:
            weight[...] = rng.normal(0.0, std, weight.shape)
            return _zero(bias)
        flat = weight.reshape(weight.shape[0], -1)
        step = max(1, (4 << 20) // (8 * max(1, flat.shape[1])))
        for r in range(0, flat.shape[0], step):
            flat[r:r + step] = rng.normal(0.0, std, flat[r:r + step].shape)
        _zero(bias)
    return init


def _zero(bias) -> None:
    if bias is not None:
        bias.fill(0.0)


def _check_labels(labels: np.ndarray, vocab: int) -> None:
    """IndexError, before any work, unless every label is a class in [0, vocab)
    or -1 (masked): the fused head keeps the rows labelled >= 0, so another
    negative label (transformers' -100) would pass as a mask unnoticed."""
    flat = labels.reshape(-1)
    bad = np.flatnonzero((flat < -1) | (flat >= vocab))
    if bad.size:
        raise IndexError(f"labels: class {int(flat[bad[0]])} at position {int(bad[0])} is out "
                         f"of range; expected class indices in [0, {vocab}) or -1 "
                         f"(ignore_index: a masked position)")


class KVCache:
    """The keys and values of the positions a model has seen, per layer:
    k[i], v[i] float32 (batch, max_len, n_kv_heads, head_dim), positions
    [0, length) filled.  Made by a model's ``make_cache``; ``decode`` appends."""

    def __init__(self, n_layers, batch, max_len, n_kv_heads, head_dim):
        shape = (batch, max_len, n_kv_heads, head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(n_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(n_layers)]
        self.batch, self.max_len = batch, max_len
        self.length = 0

    def __repr__(self):
        return (f"KVCache(layers={len(self.k)}, batch={self.batch}, length={self.length}, "
                f"max_len={self.max_len})")


# decode's products have at most this many rows: matrix-vector products, bound by
# memory.  On idle cores a second BLAS thread doubles their bandwidth (a 2-core
# Sapphire Rapids Xeon: a float32 SmolLM2-135M-shaped token 34.8 -> 24.5 ms); on
# cores other processes keep busy, waking OpenBLAS's workers costs more than the
# thread brings (the stories15M head, 1 x 288 x 32000, on a loaded 2-core EPYC:
# 2 ms with one BLAS thread, 28 ms with two)
FEW_ROWS = 32


@contextlib.contextmanager
def blas_threads_for_rows(rows):
    """Within the block, when the products have few rows (rows <= FEW_ROWS) and
    GGMLOPT_BLAS_THREADS is unset or auto, BLAS runs on the cores other processes
    leave idle (one when they are all busy; sampled at most once a second); with a
    number, exactly that many threads; untouched with keep (or an
    OPENBLAS_NUM_THREADS-like variable set) and for more rows.  The previous counts
    come back after."""
    try:
        setting = blas_threads_setting()
    except ValueError:
        setting = "keep"  # training reports a bad value; generation runs as configured
    want = setting if isinstance(setting, int) else None
    if setting == "auto" and rows <= FEW_ROWS:
        current = current_blas_threads()
        if current is not None:
            want = choose_blas_threads(current, _usable_cpus(), others_running_recently())
    with blas_limit_for_decoding(want):   # (shared with a training running)
        yield


# how long the kernel threads poll for the next call during a decode step with
# few rows (kernels.set_pool_linger): a token's products come every few tens of
# microseconds, and waking a sleeping thread took 20-30 us of each
DECODE_LINGER_S = 0.002


@contextlib.contextmanager
def pool_lingering(rows):
    """Within the block, with few rows (rows <= FEW_ROWS), the kernel threads
    keep polling between calls (DECODE_LINGER_S); the previous setting after."""
    if rows > FEW_ROWS:
        yield
        return
    _pool_linger.hold(DECODE_LINGER_S)   # threads decoding at once: each its hold
    try:
        yield
    finally:
        _pool_linger.release(DECODE_LINGER_S)


def attend_cached(q, cache_k, cache_v, pos, window=None, softcap=None):
    """Causal attention of new queries q (batch, t, n_heads, head_dim), at
    positions pos .. pos+t-1, over the cached keys and values of positions
    0 .. pos+t-1 (grouped-query: query head h reads kv head h // group); with
    window, query i sees the keys i - window + 1 .. i only; softcap: None or
    Gemma 2's cap on the scores.
    Returns (batch, t, n_heads * head_dim) float32.  A decode step (t = 1) is
    one fused kernel; a few tokens' scores (t x pos+t per head) are plain NumPy."""
    b, t, n_heads, hd = q.shape
    n_kv = cache_k.shape[2]
    if t == 1:
        first = 0 if window is None else max(0, pos + 1 - window)
        return kernels_attention.attention_decode(
            q.reshape(b, n_heads, hd), cache_k, cache_v, pos + 1,
            start=first, softcap=softcap).reshape(b, 1, n_heads * hd)
    group = n_heads // n_kv
    keys = cache_k[:, :pos + t]                       # (b, L, kv, hd)
    values = cache_v[:, :pos + t]
    qg = q.reshape(b, t, n_kv, group, hd)
    scores = np.einsum("btkgd,blkd->bkgtl", qg, keys) * np.float32(1.0 / np.sqrt(hd))
    if softcap is not None:
        scores = np.tanh(scores / np.float32(softcap)) * np.float32(softcap)
    key_pos, query_pos = np.arange(pos + t)[None, :], (pos + np.arange(t))[:, None]
    visible = key_pos <= query_pos   # (t, L)
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = np.where(visible, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("bkgtl,blkd->btkgd", p.astype(np.float32), values)
    return np.ascontiguousarray(out, dtype=np.float32).reshape(b, t, n_heads * hd)


def cached_self_attention(attn, rows, b, t, pos, cache_k, cache_v):
    """A CausalSelfAttention's output (batch, t, dim) for t new positions at pos..
    of normalised rows (batch * t, dim): q, k (per-head norms, RoPE, Gemma's
    query scale) and v of the rows, k and v appended to the cache, attention
    over every cached position (or its window)."""
    q, k = attn.project_qk(rows, (b, t, attn.n_heads, attn.head_dim),
                           (b, t, attn.n_kv_heads, attn.head_dim))
    q, k = q.copy(), k.copy()
    v = attn.v_proj.forward(rows).reshape(b, t, attn.n_kv_heads, attn.head_dim)
    if attn.rotary is not None:   # a SmolLM3's no-RoPE layers have none
        attn.rotary.rotate(q, pos, out=q)
        attn.rotary.rotate(k, pos, out=k)
    if attn.query_scale is not None:
        q *= attn.query_scale
    cache_k[:, pos:pos + t] = k
    cache_v[:, pos:pos + t] = v
    o = attend_cached(q, cache_k, cache_v, pos, attn.sliding_window, attn.logit_softcap)
    return attn.o_proj.forward(o.reshape(b * t, -1)).reshape(b, t, -1)


def attention_input_grad(block, norm, attn, grad):
    """The backward of a block's first branch, attn(norm(x)), from its output
    gradient: d loss / d x through that branch, or None when the block's input
    needs no gradient (the first block over a frozen embedding, as torch's
    autograd skips it): then the attention makes no input-gradient products and
    norm, if it trains, only adds into its weight's gradient.  The two layers'
    needs_input_grad are put back after."""
    need_x = bool(block.needs_input_grad)
    saved = attn.needs_input_grad, norm.needs_input_grad
    attn.needs_input_grad = need_x or any(trains(p) for p in norm.parameters())
    norm.needs_input_grad = need_x
    try:
        ga = attn.backward(grad)
        grads_ready(attn)
        dx = None if ga is None else norm.backward(ga)
        del ga
        grads_ready(norm)
    finally:
        attn.needs_input_grad, norm.needs_input_grad = saved
    return dx if need_x else None


class PreNormBlock(Module):
    """The pre-norm block of Llama and GPT-2: h = x + attn(norm1(x)),
    y = h + mlp(norm2(h)), x and y (batch, T, dim).  Subclasses make the four
    sub-layers under their Hugging Face names and list them in ``_parts()``
    (norm1, attn, norm2, mlp).  The two sums go to buffers of the block's own
    (the sub-layers' outputs are theirs)."""

    _shape = None

    def _parts(self):
        raise NotImplementedError

    def forward(self, x, pos=0):
        """x: float32 (batch, T, dim) -> (batch, T, dim), a buffer the block reuses."""
        if x.shape != self._shape:
            self._h, self._y = empty(x.shape, np.float32), empty(x.shape, np.float32)
            self._shape = x.shape
        norm1, attn, norm2, mlp = self._parts()
        np.add(x, attn.forward(norm1.forward(x), pos), out=self._h)
        return np.add(self._h, mlp.forward(norm2.forward(self._h)), out=self._y)

    def backward(self, grad_out):
        """grad_out (batch, T, dim) -> d loss / d x, a new array (the sub-layers'
        input gradients are theirs to make: the sums go into them), or None
        when needs_input_grad is False."""
        norm1, attn, norm2, mlp = self._parts()
        gm = mlp.backward(grad_out)
        grads_ready(mlp)  # the gradient-ready hook: each sub-layer once it is done
        dh = norm2.backward(gm)
        del gm
        dh = np.add(grad_out, dh, out=dh)
        grads_ready(norm2)
        dx = attention_input_grad(self, norm1, attn, dh)
        return None if dx is None else np.add(dh, dx, out=dx)


class CausalLM(Module):
    """A decoder-only language model: forward(tokens) int32 (batch, T) -> logits
    float32 (batch, T, vocab_size); backward(grad_logits) adds into every
    trainable parameter's .grad (a tied embedding gets both of its
    contributions) and returns None (token ids have no gradient).

    Subclasses build ``self.config`` and the layers, and define ``_hidden(tokens)``
    (the final hidden states (batch, T, dim)), ``_hidden_backward(dh)``,
    ``_embedding`` (the token Embedding) and ``lm_head`` (a Linear, or None when
    tied to the token embedding).  ``inputs_dtype`` int32 tells an OptContext
    (and fit, evaluate, predict) to pass token ids as int32.
    """

    inputs_dtype = np.dtype(np.int32)
    config: Any   # a family's config (LlamaConfig, GPT2Config ...), set by the subclass
    lm_head: Linear | None
    # the token ids that end a generation (ggmlopt.generate's default stop_ids): set
    # from the tokenizer by load_gguf; empty for a model built from a config
    eog_ids: frozenset[int] = frozenset()
    # what the GGUF file a model was read from says about itself (general.*, the
    # tokenizer's keys; ggmlopt.io.gguf_metadata.GgufMetadata): save_gguf writes it back
    gguf_metadata: Mapping[str, Any] | None = None

    # ---- what a model defines ---------------------------------------------------------

    @property
    def _embedding(self) -> Embedding:
        """The token Embedding."""
        raise NotImplementedError

    def _kv_heads(self) -> int:
        """Key/value heads per layer (the cache's width)."""
        raise NotImplementedError

    def _hidden(self, tokens: np.ndarray, pos=0) -> np.ndarray:
        """int32 (batch, T) -> the final hidden states float32 (batch, T, dim);
        pos: 0, or the DocumentPositions of packed documents."""
        raise NotImplementedError

    def _hidden_backward(self, dh: np.ndarray) -> None:
        """Backward from d loss / d hidden states (batch, T, dim)."""
        raise NotImplementedError

    def _decode_hidden(self, tokens: np.ndarray, cache: KVCache) -> np.ndarray:
        """_hidden for new positions at cache.length.., extending the cache."""
        raise NotImplementedError

    # ---- activation checkpointing (Hugging Face's names) -----------------------------

    _checkpointing = False

    def gradient_checkpointing_enable(
            self, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        """While training, keep only each decoder block's input and recompute the
        block in the backward pass: one block's activations at a time instead of
        every block's, for about one more forward pass of time; the gradients
        are bit-identical.  gradient_checkpointing_kwargs: as Hugging Face's
        models take it (torch.utils.checkpoint's options), None or a dict of
        ``use_reentrant`` (either value: the recomputation is the same) and
        ``preserve_rng_state=True`` (random masks are always replayed); other
        options are refused by name."""
        kwargs = {} if gradient_checkpointing_kwargs is None else gradient_checkpointing_kwargs
        if not isinstance(kwargs, dict):
            raise TypeError(f"gradient_checkpointing_kwargs: expected a dict or None, got "
                            f"{type(kwargs).__name__}")
        for key, value in kwargs.items():
            if key == "use_reentrant" or (key == "preserve_rng_state" and value is True):
                continue
            raise ValueError(f"gradient_checkpointing_kwargs: {key}={value!r} is not supported "
                             f"(ggmlopt takes use_reentrant, either value, and "
                             f"preserve_rng_state=True: it always replays random masks)")
        self._checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        """Keep every block's activations again (the default)."""
        self._checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether gradient_checkpointing_enable() is on."""
        return self._checkpointing

    def _blocks_forward(self, blocks, h, pos=0):
        """h through the decoder blocks in order (checkpointed while training
        with checkpointing on); pos as the blocks' forward takes it."""
        if not (self._checkpointing and self.training):
            self._saved_blocks = None
            for block in blocks:
                h = block.forward(h, pos)
            return h
        saved = []
        for block in blocks:
            h, s = checkpointed_forward(block, h, pos)
            saved.append(s)
        self._saved_blocks = saved
        return h

    def _blocks_backward(self, blocks, g):
        """The gradient g back through the blocks in reverse, each announced by
        the gradient-ready hook once done; returns the first block's input
        gradient (None when no input layer trains)."""
        saved = getattr(self, "_saved_blocks", None)
        input_trains = any(trains(p) for layer in self._input_layers()
                           for p in layer.parameters())
        for i in reversed(range(len(blocks))):
            block = blocks[i]
            # the first block's input gradient only feeds the input layers
            before = block.needs_input_grad
            block.needs_input_grad = bool(before) and (i > 0 or input_trains)
            try:
                g = block.backward(g) if saved is None else \
                    checkpointed_backward(block, saved[i], g)
            finally:
                block.needs_input_grad = before
            grads_ready(block)
        self._saved_blocks = None
        return g

    def _input_layers(self):
        """The layers before the first block (the token embedding; GPT-2's
        position embedding too): when none of their parameters trains, the
        blocks' input gradient is not computed."""
        return (self._embedding,)

    def _tokens(self, tokens, packed=False):
        """tokens as a C-contiguous int32 (batch, T) array, T <= max_seq_len;
        every id checked against the vocabulary before any work.  packed: also
        read the marks of packed documents (ggmlopt.nn.positions), returning
        (ids, DocumentPositions or None)."""
        if not isinstance(tokens, np.ndarray):
            tokens = np.asarray(tokens)
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"tokens: expected integer token ids, got dtype {tokens.dtype}")
        if tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 1:
            raise ValueError(f"tokens: expected shape (batch >= 1, T >= 1), got {tokens.shape}")
        cfg = self.config
        if tokens.shape[1] > cfg.max_seq_len:
            raise ValueError(f"tokens: T={tokens.shape[1]} positions, more than the model's "
                             f"max_seq_len={cfg.max_seq_len}")
        if packed:
            ids, pos = split_documents(tokens)
            return self._tokens(ids), pos
        if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
            bad = np.flatnonzero(((tokens < 0) | (tokens >= cfg.vocab_size)).reshape(-1))[0]
            where = tuple(int(i) for i in np.unravel_index(bad, tokens.shape))
            raise IndexError(f"tokens: id {int(tokens.reshape(-1)[bad])} at position {where} "
                             f"is outside the vocabulary [0, {cfg.vocab_size})")
        return np.ascontiguousarray(tokens, dtype=np.int32)

    def check_token_ids(self, tokens: np.ndarray, name: str = "tokens") -> None:
        """IndexError naming the first id of tokens (int32, any shape) that no
        forward pass reads: ids are in [0, vocab_size), a packed document's
        first token stored as -1 - id (ggmlopt.nn.positions).  fit and epoch ask
        it of a whole dataset before the first step."""
        v = self.config.vocab_size
        if tokens.size and (tokens.min() < -v or tokens.max() >= v):
            bad = np.flatnonzero(((tokens < -v) | (tokens >= v)).reshape(-1))[0]
            where = tuple(int(i) for i in np.unravel_index(bad, tokens.shape))
            raise IndexError(f"{name}: token id {int(tokens.reshape(-1)[bad])} at {where} is "
                             f"outside the vocabulary [0, {v}) (a packed document's first "
                             "token is stored as -1 - id)")

    def _head_weight(self) -> Parameter:
        """The (dim, vocab) matrix of the logits, or the tied (vocab, dim) one."""
        return self._embedding.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, tokens):
        """tokens: integer (batch, T) -> float32 logits (batch, T, vocab_size), a
        buffer the model reuses; ``model(tokens)`` returns a copy.  Windows of
        packed documents (each document's first token stored as -1 - id, as
        ``Dataset.from_chat(..., packing=True)`` makes them) attend within each
        document and restart its positions: each document's logits are those
        it has alone."""
        tokens, pos = self._tokens(tokens, packed=True)
        self._head_grad_rows = None
        h = self._hidden(tokens, 0 if pos is None else pos)
        b, t, d = h.shape
        rows = h.reshape(b * t, d)
        if self.lm_head is not None:
            logits = self.lm_head.forward(rows)
        else:
            if getattr(self, "_logits", None) is None or self._logits.shape[0] != b * t:
                self._logits = empty((b * t, self.config.vocab_size), np.float32)
            logits = self._embedding.project(rows, out=self._logits)
        if self.final_logit_softcap is not None:
            soft_cap(logits, self.final_logit_softcap)
        self._rows, self._b, self._t, self._capped = rows, b, t, logits
        return logits.reshape(b, t, self.config.vocab_size)

    def outputs_shape(self, tokens) -> tuple[int, int, int]:
        """The shape forward(tokens) returns, (batch, T, vocab_size), after the
        checks forward makes of tokens: a static OptContext sizes its buffers
        from it without a forward pass."""
        ids, _ = self._tokens(tokens, packed=True)
        return (*ids.shape, self.config.vocab_size)

    # None, or Gemma 2's cap c on the final logits (z -> c * tanh(z / c)), which every
    # way to the logits applies (forward, the fused head's loss, decode, the head alone)
    final_logit_softcap: float | None = None

    # ---- the head and its loss fused, chunk by chunk (ggmlopt.models._fused_head) -----

    # an OptContext training this model with cross-entropy on next-token labels runs
    # fused_cross_entropy instead of forward + loss + backward(grad_logits); set False
    # on a model (or its class) for the full logits in ctx.outputs
    fused_head = True

    def fused_cross_entropy(self, tokens, labels, *, grad_scale=1.0, backward=True,
                            pred=None):
        """The forward pass and the masked cross-entropy of next-token labels
        (int32 (batch, T), -1: masked) with the output head run chunk by chunk:
        the (batch * T, vocab_size) logits never exist whole, and the masked
        positions cost no head product.  Returns the float32 loss, the mean over
        the labelled positions (0 when none is; NaN, with nothing changed, when
        not finite), as kernels.cross_entropy(logits, labels, ignore_index=-1)
        of the full logits gives it.  backward: the head's parameters get their
        gradient (times grad_scale) now, and ``backward(None)`` then runs the
        rest of the model.  pred: int32 (batch * T,) receiving each labelled
        position's argmax and -1 on the masked ones."""
        tokens, pos = self._tokens(tokens, packed=True)
        labels = np.asarray(labels)
        if labels.dtype != np.int32 or labels.shape != tokens.shape:
            raise ValueError(f"labels: expected int32 next-token labels of shape "
                             f"{tokens.shape} like tokens, got {labels.dtype} {labels.shape}")
        _check_labels(labels, self.config.vocab_size)
        h = self._hidden(tokens, 0 if pos is None else pos)
        b, t, d = h.shape
        loss, self._head_grad_rows = head_loss(self, h.reshape(b * t, d), labels.reshape(-1),
                                               grad_scale=grad_scale, backward=backward,
                                               pred=pred)
        self._rows, self._b, self._t = None, b, t
        return np.float32(loss)

    def backward(self, grad_logits):
        """grad_logits: float32 (batch, T, vocab_size) like the last output; or
        None after fused_cross_entropy(backward=True), whose head gradient is in
        place: the rest of the model's backward."""
        if grad_logits is None:
            grad_rows = getattr(self, "_head_grad_rows", None)
            if grad_rows is None:
                raise RuntimeError("backward(None): call fused_cross_entropy(backward=True) "
                                   "first")
            self._head_grad_rows = None
            if self.lm_head is not None:
                grads_ready(self.lm_head)  # the gradient-ready hook: the head is done
            self._hidden_backward(grad_rows.reshape(self._b, self._t, -1))
            return
        rows = getattr(self, "_rows", None)
        if rows is None:
            raise RuntimeError("backward: call forward first")
        g = np.asarray(grad_logits)
        want = (self._b, self._t, self.config.vocab_size)
        if g.shape != want:
            raise ValueError(f"grad_logits: expected shape {want} like the last logits, got "
                             f"{g.shape}")
        g = np.ascontiguousarray(g, dtype=np.float32).reshape(-1, self.config.vocab_size)
        if self.final_logit_softcap is not None:   # through the cap, on a copy of the caller's
            g = soft_cap_backward(np.array(g, copy=True), self._capped, self.final_logit_softcap)
        if self.lm_head is not None:
            self.lm_head.needs_input_grad = True
            dh = self.lm_head.backward(g)
            grads_ready(self.lm_head)  # the gradient-ready hook
        else:
            # the output's half of the tied gradient goes to the embedding
            dh = self._embedding.project_backward(g, rows)
        self._hidden_backward(dh.reshape(self._b, self._t, -1))

    def __call__(self, tokens):
        """forward(tokens), copied into an array the caller owns (the model in
        use by this thread meanwhile: another thread's call is refused)."""
        with in_use(self, "model(tokens)"):
            return np.array(self.forward(tokens), copy=True)

    # ---- generation ----------------------------------------------------------------

    def make_cache(self, batch, max_len=None):
        """An empty KVCache for batch sequences of up to max_len positions
        (default and most: the model's max_seq_len)."""
        cfg = self.config
        max_len = cfg.max_seq_len if max_len is None else int(max_len)
        if not 1 <= max_len <= cfg.max_seq_len:
            raise ValueError(f"max_len: expected 1 .. max_seq_len={cfg.max_seq_len}, got "
                             f"{max_len}")
        return KVCache(cfg.n_layers, int(batch), max_len, self._kv_heads(), cfg.head_dim)

    @property
    def recompute_cache_at(self) -> int | None:
        """The cache length at which generation recomputes its cache (None: never;
        a Phi-3 with LongRoPE: its pretraining length)."""
        return None

    def decode(self, tokens, cache):
        """The logits (batch, t, vocab_size) of t new tokens (batch, t) at positions
        cache.length .. cache.length+t-1, attending to every cached position;
        their keys and values are appended to cache.  No gradients."""
        tokens = self._tokens(tokens)
        b, t = tokens.shape
        if b != cache.batch:
            raise ValueError(f"tokens: expected {cache.batch} sequences like the cache, got {b}")
        if cache.length + t > cache.max_len:
            raise ValueError(f"tokens: {t} more positions after {cache.length} exceed the "
                             f"cache's max_len={cache.max_len}")
        with blas_threads_for_rows(b * t), pool_lingering(b * t):
            h = self._decode_hidden(tokens, cache)
            logits = self._head(h.reshape(b * t, -1))
        cache.length += t
        return logits.reshape(b, t, self.config.vocab_size)

    def logits_between(self, tokens, start, stop):
        """forward(tokens)[:, start:stop] as a new float32 array (batch, stop - start,
        vocab_size), without the head's product for the other positions (the
        head is most of a small model's forward; llama-perplexity scores half of
        each window).  No gradients."""
        tokens = self._tokens(tokens)
        t = tokens.shape[1]
        for name, v in (("start", start), ("stop", stop)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        if not 0 <= start <= stop <= t:
            raise ValueError(f"start, stop: expected 0 <= start <= stop <= T={t}, got "
                             f"{start}, {stop}")
        h = self._hidden(tokens)
        b, _, d = h.shape
        logits = self._head(np.ascontiguousarray(h[:, start:stop]).reshape(-1, d))
        return logits.reshape(b, stop - start, self.config.vocab_size)

    def _head(self, rows):
        """The logits of hidden rows (n, dim) as a new array, keeping nothing for
        a backward pass: lm_head's ``infer`` (so an adapter wrapping it counts),
        or the tied embedding's transpose."""
        logits = self.lm_head.infer(rows) if self.lm_head is not None else \
            self._embedding.project(rows, keep=False)
        if self.final_logit_softcap is not None:
            soft_cap(logits, self.final_logit_softcap)
        return logits
