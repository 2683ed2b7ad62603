"""Causal self-attention: Llama's (grouped-query heads, rotary positions) and
GPT-2's (one fused q|k|v projection), both on the fused attention kernel of
ggmlopt.kernels_attention."""
from __future__ import annotations

import numpy as np

from .. import kernels_attention as ka
from ._buffers import empty
from .linear import Linear
from .module import Module
from .norm import RMSNorm
from .positions import DocumentPositions
from .rope_scaling import RopeScaling, rope_inv_freq, rope_tables

__all__ = ["CausalSelfAttention", "GPT2Attention", "RotaryEmbedding"]


def _positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected >= 1, got {value}")
    return int(value)


def _position(pos, shape=None):
    """pos as an int >= 0 (the first token's position), or the DocumentPositions
    of packed documents, whose (batch, T) must match shape when given."""
    if isinstance(pos, DocumentPositions):
        if shape is not None and pos.shape != tuple(shape):
            raise ValueError(f"pos: DocumentPositions of shape {pos.shape} for tokens of "
                             f"shape {tuple(shape)}")
        return pos
    if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)):
        raise TypeError(f"pos: expected an int or DocumentPositions, got {type(pos).__name__}")
    if pos < 0:
        raise ValueError(f"pos: expected >= 0, got {pos}")
    return int(pos)


def _as_sequence(x, dim, name):
    """x as a C-contiguous float32 (batch, T, dim) array; copies only when needed."""
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.dtype.kind not in "biuf":
        raise TypeError(f"{name}: expected real numbers, got dtype {x.dtype}")
    if x.ndim != 3 or x.shape[2] != dim:
        raise ValueError(f"{name}: expected shape (batch, T, {dim}), got {x.shape}")
    if x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"{name}: expected at least one batch item and one token, got "
                         f"shape {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _trains(param):
    return param is not None and getattr(param, "requires_grad", True)


def _any_trains(layer):
    """Whether any parameter of a projection trains (a frozen Linear's weight and
    bias, or a LoRA adapter's A and B over a frozen weight)."""
    return any(_trains(p) for p in layer.parameters())


def window_kv_start(window, b, t, pos=0):
    """The attention kernels' first key per query over (b, t) tokens: None
    (every earlier key) unless a sliding window leaves some out or pos, the
    DocumentPositions of packed documents, starts a query's document later."""
    starts = pos.starts if isinstance(pos, DocumentPositions) else None
    if window is None or window >= t:
        return starts
    windowed = ka.window_starts(b, t, window)
    return windowed if starts is None else np.maximum(windowed, starts)


def _linear_backward(layer, grad, need_input):
    """layer.backward(grad) with its input gradient only when need_input; a
    plain Linear whose parameters are all frozen computes no parameter gradient
    (only grad @ weight.T, when needed, in its forward's precision)."""
    if type(layer) is Linear and not _any_trains(layer):
        if not need_input:
            return None
        out = empty((grad.shape[0], layer.in_features), dtype=np.float32)
        return layer.product_transposed(grad, out)   # in bf16 when its forward was
    layer.needs_input_grad = need_input
    return layer.backward(grad)


# dynamic NTK's tables by (rotary_dim, base, scaling, length), the last few: every
# layer of a model asks for the same one in a pass
_dynamic_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def _dynamic_rope_tables(rotary_dim: int, base: float, scaling: RopeScaling, length: int
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Dynamic NTK's read-only (cos, sin) of a pass of length positions, one for
    every layer of a model (each layer's RotaryEmbedding asks for the same)."""
    key = (rotary_dim, base, scaling, length)
    tables = _dynamic_cache.get(key)
    if tables is None:
        inv, _ = rope_inv_freq(rotary_dim, base, scaling, n_positions=length)
        cos, sin = rope_tables(inv, length, 1.0)
        cos.flags.writeable = sin.flags.writeable = False
        if len(_dynamic_cache) >= 4:
            _dynamic_cache.pop(next(iter(_dynamic_cache)))
        _dynamic_cache[key] = tables = (cos, sin)
    return tables


class RotaryEmbedding(Module):
    """RotaryEmbedding(head_dim, base=10000.0, scaling=None, *, rotary_dim=None):
    rotary position embedding as Hugging Face's Llama applies it (``rotate_half``);
    scaling, a ggmlopt.nn.RopeScaling, scales the frequencies as the config's
    rope_scaling says (Llama 3's ``llama3``, ``linear``, ``dynamic``, ``yarn``,
    Phi-3's ``longrope``).  rotary_dim (default head_dim): only the first rotary_dim
    features of each head rotate, by frequencies of that width, the others pass
    through (a partial_rotary_factor below 1: Phi-4-mini's).

    For each head of x (batch, T, heads, head_dim) float32, token t at position
    pos + t: with x1, x2 the halves of its first rotary_dim features and theta_i
    = base ** (-2i / rotary_dim), y = (x1 cos - x2 sin, x2 cos + x1 sin) of the
    angles position * theta_i.  LongRoPE: a pass over more positions than the
    original length takes the long factors for all of them (transformers'
    choice; a row padded past it too), a packed window each document by its own
    length (as the document alone).  Dynamic NTK likewise: a pass of L positions
    past the original length rotates all of them by the base L raises (a decode
    step's new tokens by their pass's L, the cached keys keeping theirs, as
    transformers' generate does; transformers also keeps a longer pass's
    frequencies for later shorter ones still past the original length, where
    ggmlopt takes each pass's own).
    The cos/sin table (computed as HF does, float32 angles, cos and sin in
    float64) is cached and grown as positions demand.  No parameters.

    ``forward(x, pos=0)`` returns a buffer the layer reuses; ``layer(x)`` a
    copy the caller owns; ``rotate(x, pos, out=..., inverse=...)`` writes where asked (``out=x``: in place);
    ``backward(grad)`` rotates back by the last forward's angles.
    """

    # the cos/sin tables outlive a pass (activation checkpointing keeps them)
    _kept_arrays = ("_cos", "_sin", "_scaled", "_long", "_long_cos", "_long_sin", "_dyn_cos",
                    "_dyn_sin")
    #: the positions of a whole pass that runs in parts (generation recomputing its
    #: cache a chunk at a time): LongRoPE chooses its factors by it
    pass_positions: int | None = None

    def __init__(self, head_dim, base=10000.0, scaling=None, *, rotary_dim=None):
        head_dim = _positive_int(head_dim, "head_dim")
        if head_dim % 2:
            raise ValueError(f"head_dim: expected an even number, got {head_dim}")
        rotary_dim = head_dim if rotary_dim is None else _positive_int(rotary_dim, "rotary_dim")
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim: expected an even number <= head_dim={head_dim}, got "
                             f"{rotary_dim}")
        if isinstance(base, (str, bytes)) or not isinstance(base, (int, float, np.number)):
            raise TypeError(f"base: expected a real number, got {type(base).__name__}")
        if not np.isfinite(base) or base <= 1.0:
            raise ValueError(f"base: expected a finite number > 1, got {base}")
        if scaling is not None and not isinstance(scaling, RopeScaling):
            raise TypeError(f"scaling: expected a ggmlopt.nn.RopeScaling or None, got "
                            f"{type(scaling).__name__}")
        self.head_dim = head_dim
        # the features rotated, the first of each head (Phi-4-mini's partial rotary
        # embedding); the rest pass through
        self.rotary_dim = rotary_dim
        self.base = float(base)
        self.scaling = scaling
        # a scaled table: its frequencies and the attention factor on cos and sin
        # (dynamic NTK's, within its original length, is the plain one)
        self._scaled = None if scaling is None or scaling.rope_type == "dynamic" else \
            rope_inv_freq(rotary_dim, self.base, scaling)
        # dynamic NTK: a pass whose positions go past the original length takes the
        # frequencies of its length, every position of it (transformers' per pass)
        self._dynamic_from = None
        if scaling is not None and scaling.rope_type == "dynamic":
            self._dynamic_from = scaling.original_max_position_embeddings
            self._dyn_len, self._dyn_cos, self._dyn_sin = 0, None, None
        # LongRoPE: a pass whose positions go past the pretraining length takes the
        # long factors' table, every position of it (transformers' choice per pass)
        self._long_from = None
        if scaling is not None and scaling.rope_type == "longrope":
            self._long_from = scaling.original_max_position_embeddings
            self._long = rope_inv_freq(rotary_dim, self.base, scaling, long=True)
            self._long_cos = self._long_sin = None
        self._cos, self._sin = self._table(0)
        self._out = None
        self._grad_in = None
        self._pos = None

    def tables(self, n_positions):
        """(cos, sin), float32 (>= n_positions, rotary_dim // 2), from the cache:
        those of a pass over positions 0 .. n_positions - 1."""
        scaled = self._pass_tables(max(n_positions, self.pass_positions or 0))
        return self._short_tables(n_positions) if scaled is None else scaled

    def _pass_tables(self, length):
        """The (cos, sin) of a pass of length positions where it is not the
        short (or only) table: LongRoPE's long factors', or dynamic NTK's of
        that length, past their original length; None otherwise."""
        if self._long_from is not None and length > self._long_from:
            return self._long_tables(length)
        if self._dynamic_from is not None and length > self._dynamic_from:
            return self._dynamic_tables(length)
        return None

    def _dynamic_tables(self, length):
        """Dynamic NTK's (cos, sin) of a pass of length positions (past the
        original length): the base raised by that length, kept for the next
        pass of the same length (a decode step's is one longer; the model's
        layers share one computation of it)."""
        if self._dyn_len != length:
            self._dyn_cos, self._dyn_sin = _dynamic_rope_tables(
                self.rotary_dim, self.base, self.scaling, length)
            self._dyn_len = length
        return self._dyn_cos, self._dyn_sin

    def _long_tables(self, n_positions):
        """LongRoPE's long factors' (cos, sin), grown as the short ones are."""
        if self._long_cos is None or self._long_cos.shape[0] < n_positions:
            have = 0 if self._long_cos is None else self._long_cos.shape[0]
            n = max(n_positions, 2 * have, 256)
            self._long_cos, self._long_sin = rope_tables(self._long[0], n, self._long[1])
        return self._long_cos, self._long_sin

    def _short_tables(self, n_positions):
        """The (short factors', or only) table of at least n_positions rows."""
        if self._cos.shape[0] < n_positions:
            n = max(n_positions, 2 * self._cos.shape[0], 256)
            self._cos, self._sin = self._table(n)
        return self._cos, self._sin

    def _table(self, n):
        if self._scaled is None:
            return ka.rope_table(self.rotary_dim, n, self.base)
        return rope_tables(self._scaled[0], n, self._scaled[1])

    def rotate(self, x, pos=0, *, out=None, inverse=False):
        """x: float32 (batch, T, heads, head_dim) C-contiguous -> out (new, or
        the given array; may be x), rotated for positions pos..pos+T-1, or for
        each token's position in its document when pos is a DocumentPositions
        (by the opposite angles when inverse)."""
        if not isinstance(x, np.ndarray) or x.ndim != 4:
            raise ValueError("x: expected an array (batch, T, heads, head_dim), got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        pos = _position(pos, x.shape[:2])
        if x.shape[3] != self.head_dim:
            raise ValueError(f"x: expected head_dim {self.head_dim}, got shape {x.shape}")
        if isinstance(pos, DocumentPositions):
            return self._rotate_documents(x, pos.positions, out, inverse)
        cos, sin = self.tables(pos + x.shape[1])
        if self.rotary_dim < self.head_dim:
            t = x.shape[1]
            return self._rotate_part(x, cos[pos:pos + t], sin[pos:pos + t], out, inverse)
        return ka.rope(x, cos, sin, pos, out, inverse=inverse)

    def _document_tables(self, positions):
        """(cos, sin) rows of each token (batch, T, rotary_dim // 2), by its
        position in its document.  LongRoPE (dynamic NTK): its document's long
        factors' (its length's) where that document is longer than the original
        length, the short (plain) ones' elsewhere (each document as it alone is
        rotated; a window's padding, its own document, moves no other)."""
        n = int(positions.max(initial=0)) + 1
        short_cos, short_sin = self._short_tables(n)
        cos, sin = short_cos[positions], short_sin[positions]
        past = self._long_from if self._long_from is not None else self._dynamic_from
        if past is not None and n > past:
            for r, row in enumerate(positions):
                starts = np.flatnonzero(row == 0)
                ends = np.append(starts[1:], row.size)
                for a, b in zip(starts, ends):
                    scaled = self._pass_tables(int(b - a))
                    if scaled is not None:
                        cos[r, a:b], sin[r, a:b] = scaled[0][row[a:b]], scaled[1][row[a:b]]
        return cos, sin

    def _rotate_part(self, x, cos, sin, out, inverse):
        """The first rotary_dim features of each head rotated by cos, sin (rows
        per token: (T, rotary_dim // 2), or (batch, T, ...)), the others copied,
        in float32 as transformers' apply_rotary_pos_emb: x1 c - x2 s, x2 c + x1 s."""
        half = self.rotary_dim // 2
        c = cos.reshape(cos.shape[:-1] + (1, half)) if cos.ndim == 3 else cos[:, None, :]
        s = sin.reshape(sin.shape[:-1] + (1, half)) if sin.ndim == 3 else sin[:, None, :]
        if inverse:
            s = -s
        x1, x2 = x[..., :half], x[..., half:self.rotary_dim]
        y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
        if out is None:
            out = empty(x.shape, dtype=np.float32)
        if out is not x:
            out[..., self.rotary_dim:] = x[..., self.rotary_dim:]
        out[..., :half], out[..., half:self.rotary_dim] = y1, y2
        return out

    def _rotate_documents(self, x, positions, out, inverse):
        """rotate, each row by the table rows of its tokens' positions (the same
        table values a document alone is rotated by: with LongRoPE, the long
        factors' for a document longer than the original length only)."""
        cos, sin = self._document_tables(positions)
        if self.rotary_dim < self.head_dim:
            return self._rotate_part(x, cos, sin, out, inverse)
        if out is None:
            out = empty(x.shape, dtype=np.float32)
        for r in range(x.shape[0]):
            xr = x[r:r + 1]
            ka.rope(xr, np.ascontiguousarray(cos[r]), np.ascontiguousarray(sin[r]), 0,
                    xr if out is x else out[r:r + 1], inverse=inverse)
        return out

    def forward(self, x, pos=0):
        """x: float32 (batch, T, heads, head_dim) -> the same shape (a buffer this
        layer reuses)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self._out is None or self._out.shape != x.shape:
            self._out = empty(x.shape, dtype=np.float32)
            self._grad_in = empty(x.shape, dtype=np.float32)
        self.rotate(x, pos, out=self._out)
        self._pos = pos
        return self._out

    def backward(self, grad_out):
        """grad_out like the last forward's output -> d loss / d x (the rotation
        by the opposite angles; a buffer this layer reuses), or None when
        needs_input_grad is False."""
        if self._pos is None:
            raise RuntimeError("backward: call forward first")
        if not self.needs_input_grad:
            return None
        g = np.ascontiguousarray(grad_out, dtype=np.float32)
        if g.shape != self._out.shape:
            raise ValueError(f"grad_out: expected shape {self._out.shape} like the last forward "
                             f"output, got {g.shape}")
        return self.rotate(g, self._pos, out=self._grad_in, inverse=True)

    def __call__(self, x, pos=0):
        """forward(x, pos), copied into an array the caller owns."""
        return np.array(self.forward(x, pos), copy=True)

    def __repr__(self):
        scaled = "" if self.scaling is None else f", scaling={self.scaling.rope_type!r}"
        part = "" if self.rotary_dim == self.head_dim else f", rotary_dim={self.rotary_dim}"
        return f"RotaryEmbedding(head_dim={self.head_dim}, base={self.base}{scaled}{part})"


class CausalSelfAttention(Module):
    """CausalSelfAttention(dim, n_heads, n_kv_heads=None, *, rope=True,
    rope_base=10000.0, rope_scaling=None, bias=False, out_bias=None, init=None, rng=None,
    head_dim=None, qk_norm=False, norm_eps=1e-6, sliding_window=None, norm_class=None,
    query_pre_attn_scalar=None, logit_softcap=None)

    Hugging Face's LlamaAttention: x (batch, T, dim) float32 ->
    o_proj(attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x))), causal,
    scale 1/sqrt(head_dim), head_dim = dim // n_heads; grouped-query heads when
    n_kv_heads < n_heads (query head h reads kv head h // (n_heads //
    n_kv_heads), HF's repeat_kv).  Sub-layers ``q_proj`` (dim, n_heads *
    head_dim), ``k_proj``, ``v_proj`` (dim, n_kv_heads * head_dim), ``o_proj``
    (n_heads * head_dim, dim): Linear weights (in, out), the transpose of
    torch's.  init, rng: passed to the four Linear layers (one generator).
    head_dim: None (dim // n_heads) or the width of a head when the config
    gives it (Qwen3: n_heads * head_dim may differ from dim).  qk_norm: an
    RMSNorm over each head of q and of k (``q_norm``, ``k_norm``, weights
    (head_dim,), eps norm_eps) before the rotary embedding, as Qwen3 and
    Gemma 3 have.  sliding_window: None, or W >= 1: query i attends to keys
    i - W + 1 .. i only (Mistral's, Hugging Face's sliding_window), at
    O(T x W) work in the fused kernel.  norm_class: the per-head norm's class
    (RMSNorm; Gemma's keeps 1 + weight).  query_pre_attn_scalar: None (scores
    scaled by 1/sqrt(head_dim)) or Gemma's s: scaled by 1/sqrt(s).
    logit_softcap: None, or Gemma 2's cap c > 0 on the scaled scores: s ->
    c * tanh(s / c) before the softmax (``attn_logit_softcapping``).

    ``forward(x, pos=0)``: token t at position pos + t (for cached generation
    later); returns a new array (o_proj writes it and keeps no output buffer:
    a block's residual sum reads it at once), ``layer(x)`` a copy the caller
    owns.
    ``backward(grad)`` adds into the parameters' .grad (frozen ones,
    ``requires_grad`` False, get none) and returns d loss / d x, or None when
    needs_input_grad is False.  The attention itself is one fused kernel each
    way (no T x T matrix; memory O(T) per head), the projections BLAS.
    """

    def __init__(self, dim, n_heads, n_kv_heads=None, *, rope=True, rope_base=10000.0,
                 rope_scaling=None, bias=False, out_bias=None, init=None, rng=None,
                 head_dim=None, qk_norm=False, norm_eps=1e-6, sliding_window=None,
                 norm_class=None, query_pre_attn_scalar=None, logit_softcap=None):
        dim = _positive_int(dim, "dim")
        if logit_softcap is not None:
            if isinstance(logit_softcap, bool) or not isinstance(logit_softcap,
                                                                 (int, float, np.number)):
                raise TypeError(f"logit_softcap: expected None or a real number, got "
                                f"{type(logit_softcap).__name__}")
            if not (np.isfinite(logit_softcap) and logit_softcap > 0):
                raise ValueError(f"logit_softcap: expected None or a finite number > 0, got "
                                 f"{logit_softcap}")
            logit_softcap = float(logit_softcap)
        if sliding_window is not None:
            sliding_window = _positive_int(sliding_window, "sliding_window")
        n_heads = _positive_int(n_heads, "n_heads")
        n_kv_heads = n_heads if n_kv_heads is None else _positive_int(n_kv_heads, "n_kv_heads")
        if head_dim is None:
            if dim % n_heads:
                raise ValueError(f"dim: {dim} is not a multiple of n_heads {n_heads}")
            head_dim = dim // n_heads
        head_dim = _positive_int(head_dim, "head_dim")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads: n_heads {n_heads} is not a multiple of "
                             f"n_kv_heads {n_kv_heads}")
        if head_dim > ka.MAX_HEAD_DIM:
            raise ValueError(f"n_heads: head_dim {head_dim} is above the largest supported, "
                             f"{ka.MAX_HEAD_DIM}")
        if not isinstance(qk_norm, bool):
            raise TypeError(f"qk_norm: expected a bool, got {type(qk_norm).__name__}")
        self.dim, self.n_heads, self.n_kv_heads, self.head_dim = dim, n_heads, n_kv_heads, head_dim
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        q_width, kv = n_heads * head_dim, n_kv_heads * head_dim
        self.q_proj = Linear(dim, q_width, bias, init=init, rng=gen)
        self.k_proj = Linear(dim, kv, bias, init=init, rng=gen)
        self.v_proj = Linear(dim, kv, bias, init=init, rng=gen)
        # out_bias None: as the others (Llama's attention_bias); Qwen2 has q, k, v only
        self.o_proj = Linear(q_width, dim, bias if out_bias is None else bool(out_bias),
                             init=init, rng=gen)
        norm = RMSNorm if norm_class is None else norm_class
        self.q_norm = norm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = norm(head_dim, norm_eps) if qk_norm else None
        # the scores' scale is query_pre_attn_scalar ** -0.5 (Gemma's); the kernels scale by
        # head_dim ** -0.5, so q is multiplied by the ratio after its rotation
        self.query_scale = None
        if query_pre_attn_scalar is not None:
            if isinstance(query_pre_attn_scalar, bool) or not isinstance(
                    query_pre_attn_scalar, (int, float, np.number)) \
                    or not query_pre_attn_scalar > 0:
                raise ValueError(f"query_pre_attn_scalar: expected a number > 0, got "
                                 f"{query_pre_attn_scalar!r}")
            ratio = float(np.sqrt(head_dim / float(query_pre_attn_scalar)))
            self.query_scale = None if ratio == 1.0 else np.float32(ratio)
        self._rotary = RotaryEmbedding(head_dim, rope_base, rope_scaling) if rope else None
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self._saved = None
        self._o = None


    def project_qk(self, rows, shape_q, shape_kv):
        """(q, k) of rows (batch * T, dim): the projections, per-head norms when
        the layer has them, as contiguous (batch, T, heads, head_dim) arrays the
        rotary embedding may rotate in place (no layer reads them back)."""
        q = self.q_proj.forward(rows).reshape(shape_q)
        k = self.k_proj.forward(rows).reshape(shape_kv)
        if self.q_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        return np.ascontiguousarray(q), np.ascontiguousarray(k)

    @property
    def rotary(self):
        """The RotaryEmbedding (None without rope)."""
        return self._rotary

    def forward(self, x, pos=0):
        """x: float32 (batch, T, dim) -> (batch, T, dim) (a new array); token t
        is at position pos + t, or, with pos a
        DocumentPositions (packed documents), at its position in its document,
        attending to its own document's earlier tokens only."""
        x = _as_sequence(x, self.dim, "x")
        pos = _position(pos, x.shape[:2])
        b, t, _ = x.shape
        x2 = x.reshape(b * t, self.dim)
        shape_q = (b, t, self.n_heads, self.head_dim)
        shape_kv = (b, t, self.n_kv_heads, self.head_dim)
        q, k = self.project_qk(x2, shape_q, shape_kv)
        v = np.ascontiguousarray(self.v_proj.forward(x2)).reshape(shape_kv)
        if self._rotary is not None:  # in place: the projections never read their outputs back
            self._rotary.rotate(q, pos, out=q)
            self._rotary.rotate(k, pos, out=k)
        if self.query_scale is not None:
            np.multiply(q, self.query_scale, out=q)
        if self._o is None or self._o.shape != shape_q:
            self._o = empty(shape_q, dtype=np.float32)
            self._lse = empty((b, self.n_heads, t), dtype=np.float32)
        starts = window_kv_start(self.sliding_window, b, t, pos)
        o, lse = ka.attention_forward(q, k, v, out=self._o, lse=self._lse, kv_start=starts,
                                      softcap=self.logit_softcap)
        self._saved = (q, k, v, o, lse, pos, starts)
        # a new array: the caller (a block's residual sum) reads it at once, so no
        # projection keeps a dead copy between steps
        y = self.o_proj.forward(o.reshape(b * t, -1), out=empty((b * t, self.dim), np.float32))
        return y.reshape(b, t, self.dim)

    def backward(self, grad_out):
        """grad_out: float32 (batch, T, dim) like the last output.  Adds into
        every trainable parameter's .grad; returns d loss / d x (batch, T, dim)
        (a new array), or None when needs_input_grad is False."""
        if self._saved is None:
            raise RuntimeError("backward: call forward first")
        q, k, v, o, lse, pos, starts = self._saved
        b, t = q.shape[:2]
        g = _as_sequence(grad_out, self.dim, "grad_out")
        if g.shape[:2] != (b, t):
            raise ValueError(f"grad_out: expected shape {(b, t, self.dim)} like the last "
                             f"output, got {g.shape}")
        projections = (self.q_proj, self.k_proj, self.v_proj)
        need_input = bool(self.needs_input_grad)
        # the q/k norms (Qwen3's, Gemma 3's) sit between the projections and the
        # kernel: one that trains needs dq and dk even when nothing below does
        norms = tuple(m for m in (self.q_norm, self.k_norm) if m is not None)
        need_qkv = need_input or any(_any_trains(m) for m in projections + norms)
        do = _linear_backward(self.o_proj, g.reshape(b * t, self.dim), need_qkv)
        if not need_qkv:
            return None
        do = np.ascontiguousarray(do, dtype=np.float32).reshape(o.shape)
        # the backward buffers are made here and not kept (as Linear's input gradient)
        dq, dk, dv = ka.attention_backward(q, k, v, o, lse, do, empty(q.shape, np.float32),
                                           empty(k.shape, np.float32),
                                           empty(v.shape, np.float32), kv_start=starts,
                                           softcap=self.logit_softcap)
        del do
        if self.query_scale is not None:
            np.multiply(dq, self.query_scale, out=dq)
        if self._rotary is not None:
            self._rotary.rotate(dq, pos, out=dq, inverse=True)
            self._rotary.rotate(dk, pos, out=dk, inverse=True)
        if self.q_norm is not None:
            dq, dk = self.q_norm.backward(dq), self.k_norm.backward(dk)
        dx = None
        for layer, grad in zip(projections, (dq, dk, dv)):
            part = _linear_backward(layer, grad.reshape(b * t, -1), need_input)
            if need_input:
                part = part.reshape(b * t, self.dim)
                # the first part is the projection's own new array: the sum goes there
                dx = part if dx is None else np.add(dx, part, out=dx)
        return dx.reshape(b, t, self.dim) if need_input else None

    def __call__(self, x, pos=0):
        """forward(x, pos), copied into an array the caller owns."""
        return np.array(self.forward(x, pos), copy=True)

    def __repr__(self):
        rope = "" if self._rotary is None else f", rope_base={self._rotary.base}"
        extra = "" if self.head_dim * self.n_heads == self.dim else f", head_dim={self.head_dim}"
        extra += ", qk_norm=True" if self.q_norm is not None else ""
        if self.sliding_window is not None:
            extra += f", sliding_window={self.sliding_window}"
        if self.logit_softcap is not None:
            extra += f", logit_softcap={self.logit_softcap}"
        return (f"CausalSelfAttention(dim={self.dim}, n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}, rope={self._rotary is not None}{rope}, "
                f"bias={self.q_proj.bias is not None}{extra})")


class GPT2Attention(Module):
    """GPT2Attention(dim, n_heads, *, bias=True, init=None, rng=None)

    Hugging Face's GPT2Attention: x (batch, T, dim) float32 ->
    c_proj(attention(q, k, v)) with q | k | v = c_attn(x) split in that order
    along the last axis, causal, scale 1/sqrt(head_dim), no rotary embedding.
    ``c_attn``: Linear (dim, 3 * dim), ``c_proj``: Linear (dim, dim); their
    (in, out) weights are laid out as HF's Conv1D weights already.  The
    attention reads the fused c_attn rows in place and writes its gradients
    into one fused buffer.  ``forward(x)`` returns a buffer the layer reuses,
    ``layer(x)`` a copy the caller owns; backward as CausalSelfAttention's.
    """

    def __init__(self, dim, n_heads, *, bias=True, init=None, rng=None):
        dim = _positive_int(dim, "dim")
        n_heads = _positive_int(n_heads, "n_heads")
        if dim % n_heads:
            raise ValueError(f"dim: {dim} is not a multiple of n_heads {n_heads}")
        if dim // n_heads > ka.MAX_HEAD_DIM:
            raise ValueError(f"n_heads: head_dim {dim // n_heads} is above the largest "
                             f"supported, {ka.MAX_HEAD_DIM}")
        self.dim, self.n_heads, self.head_dim = dim, n_heads, dim // n_heads
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        self.c_attn = Linear(dim, 3 * dim, bias, init=init, rng=gen)
        self.c_proj = Linear(dim, dim, bias, init=init, rng=gen)
        self._saved = None
        self._o = None

    def forward(self, x, pos=0):
        """x: float32 (batch, T, dim) -> (batch, T, dim) (a buffer this layer
        reuses).  pos is accepted for the interface CausalSelfAttention shares
        (GPT-2's positions are learned outside attention); a DocumentPositions
        keeps each token's attention inside its document."""
        x = _as_sequence(x, self.dim, "x")
        pos = _position(pos, x.shape[:2])
        b, t, _ = x.shape
        qkv = np.ascontiguousarray(self.c_attn.forward(x.reshape(b * t, self.dim)))
        qkv = qkv.reshape(b, t, 3 * self.dim)
        shape_o = (b, t, self.n_heads, self.head_dim)
        if self._o is None or self._o.shape != shape_o:
            self._o = empty(shape_o, dtype=np.float32)
            self._lse = empty((b, self.n_heads, t), dtype=np.float32)
            self._dqkv = empty((b, t, 3 * self.dim), dtype=np.float32)
        starts = window_kv_start(None, b, t, pos)
        o, lse = ka.attention_forward_qkv(qkv, self.n_heads, out=self._o, lse=self._lse,
                                          kv_start=starts)
        self._saved = (qkv, o, lse, starts)
        y = self.c_proj.forward(o.reshape(b * t, self.dim))
        return y.reshape(b, t, self.dim)

    def backward(self, grad_out):
        """grad_out: float32 (batch, T, dim) -> d loss / d x (a buffer this layer
        reuses), or None when needs_input_grad is False; adds into the
        trainable parameters' .grad."""
        if self._saved is None:
            raise RuntimeError("backward: call forward first")
        qkv, o, lse, starts = self._saved
        b, t = o.shape[:2]
        g = _as_sequence(grad_out, self.dim, "grad_out")
        if g.shape[:2] != (b, t):
            raise ValueError(f"grad_out: expected shape {(b, t, self.dim)} like the last "
                             f"output, got {g.shape}")
        need_input = bool(self.needs_input_grad)
        need_qkv = need_input or _any_trains(self.c_attn)
        do = _linear_backward(self.c_proj, g.reshape(b * t, self.dim), need_qkv)
        if not need_qkv:
            return None
        do = np.ascontiguousarray(do, dtype=np.float32).reshape(o.shape)
        dqkv = ka.attention_backward_qkv(qkv, self.n_heads, o, lse, do, dqkv=self._dqkv,
                                         kv_start=starts)
        dx = _linear_backward(self.c_attn, dqkv.reshape(b * t, 3 * self.dim), need_input)
        return dx.reshape(b, t, self.dim) if need_input else None

    def __call__(self, x, pos=0):
        """forward(x, pos), copied into an array the caller owns."""
        return np.array(self.forward(x, pos), copy=True)

    def __repr__(self):
        return (f"GPT2Attention(dim={self.dim}, n_heads={self.n_heads}, "
                f"bias={self.c_attn.bias is not None})")
