# cython: language_level=3
"""Causal attention and rotary position embedding, callable on NumPy arrays.

The kernels (fused flash-style causal attention with grouped-query heads,
forward and backward; rotary embedding as Hugging Face's Llama applies it)
live in ``ggmlopt.kernels`` with the others; this module checks the arguments
(dtype, C-contiguity, shapes, writability, overlap), raising TypeError or
ValueError naming the argument before any memory is touched, and runs them
without the GIL.  Tensors are token-major: (batch, T, heads, head_dim), which
is how the projections' (batch*T, heads*head_dim) outputs lie in memory.
"""
import numpy as np

cimport numpy as cnp
from libc.float cimport FLT_MAX
from libc.stdint cimport int32_t, int64_t

from ggmlopt._kernel_args cimport as_array as _array
from ggmlopt._kernel_args cimport f32_ptr as _f32
from ggmlopt._kernel_args cimport outputs_apart as _outputs_apart
from ggmlopt.kernels cimport attention_backward_f32 as _attention_backward
from ggmlopt.kernels cimport attention_backward_capped_f32 as _attention_backward_capped
from ggmlopt.kernels cimport attention_forward_f32 as _attention_forward
from ggmlopt.kernels cimport attention_decode_capped_f32 as _attention_decode_capped
from ggmlopt.kernels cimport attention_decode_f32 as _attention_decode
from ggmlopt.kernels cimport attention_forward_capped_f32 as _attention_forward_capped
from ggmlopt.kernels cimport rope_f32 as _rope

cnp.import_array()


# ---- C-level API (declared in kernels_attention.pxd) ---------------------------

cdef int attention_forward_f32(int64_t batch, int64_t seq, int64_t n_heads, int64_t n_kv_heads,
                               int64_t head_dim, const float *q, int64_t q_stride,
                               const float *k, int64_t k_stride, const float *v,
                               int64_t v_stride, float *out, int64_t out_stride,
                               float *lse) noexcept nogil:
    return _attention_forward(batch, seq, n_heads, n_kv_heads, head_dim, q, q_stride, k,
                              k_stride, v, v_stride, out, out_stride, lse)

cdef int attention_backward_f32(int64_t batch, int64_t seq, int64_t n_heads, int64_t n_kv_heads,
                                int64_t head_dim, const float *q, int64_t q_stride,
                                const float *k, int64_t k_stride, const float *v,
                                int64_t v_stride, const float *out, int64_t out_stride,
                                const float *lse, const float *dout, float *dq, float *dk,
                                float *dv) noexcept nogil:
    return _attention_backward(batch, seq, n_heads, n_kv_heads, head_dim, q, q_stride, k,
                               k_stride, v, v_stride, out, out_stride, lse, dout, dq, dk, dv)

cdef void rope_f32(int64_t nrows, int64_t seq, int64_t pos0, int64_t n_heads, int64_t head_dim,
                   const float *x, int64_t x_stride, float *y, int64_t y_stride,
                   const float *cos, const float *sin, int inverse) noexcept nogil:
    _rope(nrows, seq, pos0, n_heads, head_dim, x, x_stride, y, y_stride, cos, sin, inverse)

cdef int attention_decode_f32(int64_t batch, int64_t n_heads, int64_t n_kv_heads,
                              int64_t head_dim, int64_t length, const float *q, const float *k,
                              const float *v, int64_t kv_item_stride, float *out, float *scores,
                              float scale) noexcept nogil:
    return _attention_decode(batch, n_heads, n_kv_heads, head_dim, length, q, k, v,
                             kv_item_stride, out, scores, scale)


# ---- Python entry points -------------------------------------------------------

MAX_HEAD_DIM = 256


cdef int64_t _count(object value, str name, int64_t minimum) except -1:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}")
    return int(value)


cdef tuple _heads(cnp.ndarray a, str name):
    """(batch, T, heads, head_dim) of a 4-D token-major array."""
    if a.ndim != 4:
        raise ValueError(f"{name}: expected shape (batch, T, heads, head_dim), got "
                         f"{(<object>a).shape}")
    return (<object>a).shape


cdef _check_head_dim(int64_t d, str name):
    if d > MAX_HEAD_DIM:
        raise ValueError(f"{name}: head_dim {d} is above the largest supported, {MAX_HEAD_DIM}")


cdef cnp.ndarray _out(object out, tuple shape, str name):
    if out is None:
        return np.empty(shape, dtype=np.float32)
    cdef cnp.ndarray ao = _array(out, name, np.float32, True)
    if (<object>ao).shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {(<object>ao).shape}")
    return ao


cdef float _softcap(object softcap) except -1.0:
    """0 for None, else the cap: a finite real number > 0."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, str, bytes)) or not isinstance(softcap, (int, float, np.number)):
        raise TypeError(f"softcap: expected None or a real number, got {type(softcap).__name__}")
    cdef float cap = 0.0
    if np.isfinite(softcap) and abs(softcap) <= FLT_MAX:
        cap = <float>softcap
    # as a float32: finite and > 0 (1e39 would be inf, 1e-50 zero, which is no cap)
    if not (cap > 0.0):
        raise ValueError(f"softcap: expected None or a number > 0 that is finite as a float32, "
                         f"got {softcap}")
    return cap


cdef _check_rc(int rc, str what):
    """A kernel's refusal (a nonzero return: arguments the checks above let
    through) as an error, never its unwritten output as a result."""
    if rc != 0:
        raise ValueError(f"{what}: the kernel refused its arguments (code {rc})")


cdef tuple _qkv_shapes(object q, object k, object v):
    cdef cnp.ndarray aq = _array(q, "q", np.float32, False)
    cdef cnp.ndarray ak = _array(k, "k", np.float32, False)
    cdef cnp.ndarray av = _array(v, "v", np.float32, False)
    b, t, hq, d = _heads(aq, "q")
    ks = _heads(ak, "k")
    if ks[0] != b or ks[1] != t or ks[3] != d:
        raise ValueError(f"k: expected shape ({b}, {t}, n_kv_heads, {d}) like q {(b, t, hq, d)}, "
                         f"got {ks}")
    if (<object>av).shape != ks:
        raise ValueError(f"v: expected shape {ks} like k, got {(<object>av).shape}")
    if ks[2] < 1:
        raise ValueError(f"k: expected at least one kv head, got shape {ks}")
    if hq < 1:
        raise ValueError(f"q: expected at least one head, got shape {(b, t, hq, d)}")
    if hq % ks[2] != 0:
        raise ValueError(f"k: n_heads {hq} is not a multiple of n_kv_heads {ks[2]}")
    if d < 1:
        raise ValueError(f"q: head_dim must be >= 1, got {d}")
    _check_head_dim(d, "q")
    return aq, ak, av, b, t, hq, ks[2], d


def attention_forward(q, k, v, out=None, lse=None, kv_start=None, softcap=None):
    """Causal scaled dot-product attention with grouped-query heads.

    q: float32 (batch, T, n_heads, head_dim); k, v: float32 (batch, T,
    n_kv_heads, head_dim), n_heads a multiple of n_kv_heads (query head h uses
    kv head h // (n_heads // n_kv_heads)); head_dim 1..256.  All C-contiguous.
    out = softmax(q k^T / sqrt(head_dim), causal mask) v, float32 (batch, T,
    n_heads, head_dim); lse: float32 (batch, n_heads, T), the log of each
    softmax's denominator (with the scores' maximum folded in), which the
    backward needs.  Returns (out, lse); either may be given to be written.
    kv_start: None (every earlier key), or int32 (batch, T): query i of item b
    sees keys kv_start[b, i] .. i only, each in [0, i] and non-decreasing along
    T (ValueError otherwise): documents packed into one window (each token's
    document start, see ``document_starts``) or a sliding window
    (``window_starts``); the work follows the keys seen.  The keys before a
    row's first are masked by exact zeros: exact for finite inputs, but an inf
    or NaN in a key or value a row cannot see reaches it as NaN.
    softcap: None, or Gemma 2's cap c > 0: each score s becomes c * tanh(s / c)
    before the softmax (transformers' attn_logit_softcapping).
    """
    cdef float cap = _softcap(softcap)
    aq, ak, av, b, t, hq, hkv, d = _qkv_shapes(q, k, v)
    cdef cnp.ndarray ao = _out(out, (b, t, hq, d), "out")
    cdef cnp.ndarray al = _out(lse, (b, hq, t), "lse")
    starts = _starts(kv_start, b, t)
    _outputs_apart([("q", aq), ("k", ak), ("v", av)], [("out", ao), ("lse", al)])
    _forward(b, t, hq, hkv, d, aq, hq * d, ak, hkv * d, av, hkv * d, ao, al, starts, cap)
    return ao, al


cdef object _starts(object kv_start, int64_t b, int64_t t):
    """kv_start checked (int32 C-contiguous (b, t), each row's first key in [0, i],
    non-decreasing), or None."""
    if kv_start is None:
        return None
    cdef cnp.ndarray a = _array(kv_start, "kv_start", np.int32, False)
    if (<object>a).shape != (b, t):
        raise ValueError(f"kv_start: expected shape {(b, t)} (batch, T), got {(<object>a).shape}")
    if t:
        rows = np.arange(t, dtype=np.int64)
        if (a < 0).any() or (a > rows).any():
            raise ValueError("kv_start: expected each query's first key in [0, its position]")
        if t > 1 and (np.diff(a, axis=1) < 0).any():
            raise ValueError("kv_start: expected first keys that never decrease along T")
    return a


def document_starts(doc_ids):
    """kv_start for documents packed into windows: doc_ids int (batch, T), the
    document of each token, contiguous runs (a token sees the earlier tokens of
    its own run only) -> int32 (batch, T) each token's run start."""
    ids = np.asarray(doc_ids)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise ValueError(f"doc_ids: expected integer ids of shape (batch, T), got "
                         f"{ids.dtype} {ids.shape}")
    b, t = ids.shape
    starts = np.zeros((b, t), dtype=np.int32)
    if t > 1:
        change = np.zeros((b, t), dtype=bool)
        change[:, 1:] = ids[:, 1:] != ids[:, :-1]
        pos = np.where(change, np.arange(t, dtype=np.int32), 0)
        starts = np.maximum.accumulate(pos, axis=1).astype(np.int32)
    return np.ascontiguousarray(starts)


def window_starts(batch, t, window):
    """kv_start of a sliding window of window keys (Mistral's, Hugging Face's
    sliding_window: query i sees keys i - window + 1 .. i) over (batch, t)."""
    cdef int64_t w = _count(window, "window", 1)
    cdef int64_t nb = _count(batch, "batch", 0)
    cdef int64_t nt = _count(t, "t", 0)
    first = np.maximum(np.arange(nt, dtype=np.int64) - (w - 1), 0).astype(np.int32)
    return np.ascontiguousarray(np.broadcast_to(first, (nb, nt)))


cdef _forward(int64_t b, int64_t t, int64_t hq, int64_t hkv, int64_t d, cnp.ndarray aq,
              int64_t qs, cnp.ndarray ak, int64_t ks, cnp.ndarray av, int64_t vs,
              cnp.ndarray ao, cnp.ndarray al, object starts=None, float cap=0.0):
    cdef const float *pq = _f32(aq)
    cdef const float *pk = _f32(ak)
    cdef const float *pv = _f32(av)
    cdef float *po = _f32(ao)
    cdef float *pl = _f32(al)
    cdef const int32_t *pst = NULL
    if starts is not None:
        pst = <const int32_t *>cnp.PyArray_DATA(<cnp.ndarray>starts)
    if (<object>aq).ndim == 3:  # fused q|k|v rows: k and v start after q's heads
        pk = pq + hq * d
        pv = pk + hkv * d
    cdef int rc
    with nogil:
        rc = _attention_forward_capped(b, t, hq, hkv, d, pq, qs, pk, ks, pv, vs, po, hq * d, pl,
                                       pst, cap)
    _check_rc(rc, "attention_forward")


def attention_backward(q, k, v, out, lse, grad_out, dq=None, dk=None, dv=None, kv_start=None,
                       softcap=None):
    """Gradients of attention_forward for grad_out = d loss / d out.

    q, k, v, out, lse: the forward's inputs and outputs (shapes as there);
    grad_out: float32 like out.  Returns (dq, dk, dv), float32 like q, k, v
    (for grouped heads dk, dv summed over the query heads of each group),
    written (not added to); any may be given.  Deterministic: the same bits
    for any number of threads.  kv_start, softcap: the forward's.
    """
    cdef float cap = _softcap(softcap)
    aq, ak, av, b, t, hq, hkv, d = _qkv_shapes(q, k, v)
    cdef cnp.ndarray ao = _array(out, "out", np.float32, False)
    cdef cnp.ndarray al = _array(lse, "lse", np.float32, False)
    cdef cnp.ndarray ag = _array(grad_out, "grad_out", np.float32, False)
    oshape = (b, t, hq, d)
    if (<object>ao).shape != oshape:
        raise ValueError(f"out: expected shape {oshape}, got {(<object>ao).shape}")
    if (<object>al).shape != (b, hq, t):
        raise ValueError(f"lse: expected shape {(b, hq, t)}, got {(<object>al).shape}")
    if (<object>ag).shape != oshape:
        raise ValueError(f"grad_out: expected shape {oshape}, got {(<object>ag).shape}")
    cdef cnp.ndarray adq = _out(dq, (<object>aq).shape, "dq")
    cdef cnp.ndarray adk = _out(dk, (<object>ak).shape, "dk")
    cdef cnp.ndarray adv = _out(dv, (<object>av).shape, "dv")
    _outputs_apart([("q", aq), ("k", ak), ("v", av), ("out", ao), ("lse", al),
                    ("grad_out", ag)], [("dq", adq), ("dk", adk), ("dv", adv)])
    starts = _starts(kv_start, b, t)
    _backward(b, t, hq, hkv, d, aq, hq * d, ak, hkv * d, av, hkv * d, ao, al, ag, adq, adk, adv,
              starts, cap)
    return adq, adk, adv


cdef _backward(int64_t b, int64_t t, int64_t hq, int64_t hkv, int64_t d, cnp.ndarray aq,
               int64_t qs, cnp.ndarray ak, int64_t ks, cnp.ndarray av, int64_t vs,
               cnp.ndarray ao, cnp.ndarray al, cnp.ndarray ag, cnp.ndarray adq,
               cnp.ndarray adk, cnp.ndarray adv, object starts=None, float cap=0.0):
    cdef const float *pq = _f32(aq)
    cdef const float *pk = _f32(ak)
    cdef const float *pv = _f32(av)
    cdef float *pdq = _f32(adq)
    cdef float *pdk = _f32(adk)
    cdef float *pdv = _f32(adv)
    cdef const float *po = _f32(ao)
    cdef const float *pl = _f32(al)
    cdef const float *pg = _f32(ag)
    if (<object>aq).ndim == 3:  # fused rows, for the inputs and for the gradients
        pk = pq + hq * d
        pv = pk + hkv * d
        pdk = pdq + hq * d
        pdv = pdk + hkv * d
    cdef const int32_t *pst = NULL
    if starts is not None:
        pst = <const int32_t *>cnp.PyArray_DATA(<cnp.ndarray>starts)
    cdef int rc
    with nogil:
        rc = _attention_backward_capped(b, t, hq, hkv, d, pq, qs, pk, ks, pv, vs, po, hq * d, pl,
                                        pg, pdq, pdk, pdv, pst, cap)
    _check_rc(rc, "attention_backward")


cdef tuple _fused_shape(cnp.ndarray a, int64_t hq, int64_t hkv):
    if a.ndim != 3:
        raise ValueError(f"qkv: expected shape (batch, T, (n_heads + 2 * n_kv_heads) * head_dim), "
                         f"got {(<object>a).shape}")
    b, t, width = (<object>a).shape
    if width % (hq + 2 * hkv) != 0 or width == 0:
        raise ValueError(f"qkv: last axis {width} is not a positive multiple of "
                         f"n_heads + 2 * n_kv_heads = {hq + 2 * hkv}")
    d = width // (hq + 2 * hkv)
    _check_head_dim(d, "qkv")
    return b, t, d


cdef tuple _fused_heads(object n_heads, object n_kv_heads):
    cdef int64_t hq = _count(n_heads, "n_heads", 1)
    cdef int64_t hkv = hq if n_kv_heads is None else _count(n_kv_heads, "n_kv_heads", 1)
    if hq % hkv != 0:
        raise ValueError(f"n_kv_heads: n_heads {hq} is not a multiple of n_kv_heads {hkv}")
    return hq, hkv


def attention_forward_qkv(qkv, n_heads, n_kv_heads=None, out=None, lse=None, kv_start=None,
                          softcap=None):
    """attention_forward on fused rows: qkv float32 (batch, T, (n_heads + 2 *
    n_kv_heads) * head_dim), each row q | k | v (GPT-2's c_attn output, read in
    place).  n_kv_heads defaults to n_heads.  Returns (out (batch, T, n_heads,
    head_dim), lse (batch, n_heads, T)).  kv_start, softcap: as attention_forward's."""
    cdef float cap = _softcap(softcap)
    hq, hkv = _fused_heads(n_heads, n_kv_heads)
    cdef cnp.ndarray a = _array(qkv, "qkv", np.float32, False)
    b, t, d = _fused_shape(a, hq, hkv)
    cdef cnp.ndarray ao = _out(out, (b, t, hq, d), "out")
    cdef cnp.ndarray al = _out(lse, (b, hq, t), "lse")
    starts = _starts(kv_start, b, t)
    _outputs_apart([("qkv", a)], [("out", ao), ("lse", al)])
    cdef int64_t w = (hq + 2 * hkv) * d
    _forward(b, t, hq, hkv, d, a, w, a, w, a, w, ao, al, starts, cap)
    return ao, al


def attention_backward_qkv(qkv, n_heads, out, lse, grad_out, n_kv_heads=None, dqkv=None,
                           kv_start=None, softcap=None):
    """attention_backward on fused rows: returns dqkv, float32 like qkv, each
    row dq | dk | dv (written, not added to).  kv_start, softcap: the forward's."""
    cdef float cap = _softcap(softcap)
    hq, hkv = _fused_heads(n_heads, n_kv_heads)
    cdef cnp.ndarray a = _array(qkv, "qkv", np.float32, False)
    b, t, d = _fused_shape(a, hq, hkv)
    cdef cnp.ndarray ao = _array(out, "out", np.float32, False)
    cdef cnp.ndarray al = _array(lse, "lse", np.float32, False)
    cdef cnp.ndarray ag = _array(grad_out, "grad_out", np.float32, False)
    oshape = (b, t, hq, d)
    if (<object>ao).shape != oshape:
        raise ValueError(f"out: expected shape {oshape}, got {(<object>ao).shape}")
    if (<object>al).shape != (b, hq, t):
        raise ValueError(f"lse: expected shape {(b, hq, t)}, got {(<object>al).shape}")
    if (<object>ag).shape != oshape:
        raise ValueError(f"grad_out: expected shape {oshape}, got {(<object>ag).shape}")
    cdef cnp.ndarray ad = _out(dqkv, (<object>a).shape, "dqkv")
    _outputs_apart([("qkv", a), ("out", ao), ("lse", al), ("grad_out", ag)], [("dqkv", ad)])
    starts = _starts(kv_start, b, t)
    cdef int64_t w = (hq + 2 * hkv) * d
    _backward(b, t, hq, hkv, d, a, w, a, w, a, w, ao, al, ag, ad, ad, ad, starts, cap)
    return ad


def rope(x, cos, sin, pos=0, out=None, *, inverse=False):
    """Rotary position embedding as Hugging Face's Llama applies it.

    x: float32 (batch, T, heads, head_dim), head_dim even; token t is at
    position pos + t.  cos, sin: float32 (positions, head_dim // 2) tables
    (rope_table), positions >= pos + T.  With x1, x2 the two halves of each
    head and c, s the table rows: out = (x1 c - x2 s, x2 c + x1 s).
    inverse=True rotates by the opposite angle: the backward pass (the rotation
    is orthogonal).  out: float32 like x, may be x itself (in place).  Returns
    out.
    """
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    b, t, h, d = _heads(ax, "x")
    if d % 2 != 0 or d == 0:
        raise ValueError(f"x: head_dim must be even and positive for the rotation, got {d}")
    cdef int64_t p0 = _count(pos, "pos", 0)
    cdef cnp.ndarray ac = _array(cos, "cos", np.float32, False)
    cdef cnp.ndarray asn = _array(sin, "sin", np.float32, False)
    for name, table in (("cos", cos), ("sin", sin)):
        shape = table.shape
        if len(shape) != 2 or shape[1] != d // 2:
            raise ValueError(f"{name}: expected shape (positions, {d // 2}), got {shape}")
        if shape[0] < p0 + t:
            raise ValueError(f"{name}: holds {shape[0]} positions, positions up to "
                             f"{p0 + t - 1} are needed (pos={p0}, T={t})")
    cdef cnp.ndarray ao = _out(out, (b, t, h, d), "out")
    if ao is not ax:
        _outputs_apart([("x", ax), ("cos", ac), ("sin", asn)], [("out", ao)])
    else:
        _outputs_apart([("cos", ac), ("sin", asn)], [("out", ao)])
    cdef int inv = 1 if inverse else 0
    cdef int64_t nrows = b * t, seq = t, nh = h, hd = d
    cdef const float *px = _f32(ax)
    cdef float *po = _f32(ao)
    cdef const float *pc = _f32(ac)
    cdef const float *ps = _f32(asn)
    with nogil:
        rope_f32(nrows, seq, p0, nh, hd, px, nh * hd, po, nh * hd, pc, ps, inv)
    return ao


def rope_table(head_dim, n_positions, base=10000.0):
    """(cos, sin), float32 (n_positions, head_dim // 2): the angles of
    positions 0..n_positions-1, computed as Hugging Face's Llama does (float32
    inv_freq = 1 / base ** (2i / head_dim), float32 angle = position *
    inv_freq), then cos and sin of each angle in float64, rounded once."""
    cdef int64_t d = _count(head_dim, "head_dim", 2)
    cdef int64_t n = _count(n_positions, "n_positions", 0)
    if d % 2 != 0:
        raise ValueError(f"head_dim: expected an even number, got {d}")
    if isinstance(base, (str, bytes)) or not isinstance(base, (int, float, np.number)):
        raise TypeError(f"base: expected a real number, got {type(base).__name__}")
    if not np.isfinite(base) or base <= 1.0:
        raise ValueError(f"base: expected a finite number > 1, got {base}")
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    inv_freq = (np.float32(1.0) / (np.float32(base) ** exponent)).astype(np.float32)
    angles = np.arange(n, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles64 = angles.astype(np.float64)
    return np.cos(angles64).astype(np.float32), np.sin(angles64).astype(np.float32)


def attention_decode(q, cache_k, cache_v, length, out=None, start=0, softcap=None):
    """One decode step's attention over a key/value cache: q float32 (batch,
    n_heads, head_dim), one new query per head; cache_k, cache_v float32
    (batch, max_len, n_kv_heads, head_dim), of which positions 0 .. length-1
    are read (the new one's key and value among them), or positions start ..
    length-1 (a sliding window); query head h reads kv head h // (n_heads //
    n_kv_heads).  out (batch, n_heads * head_dim) = softmax(q . k_l /
    sqrt(head_dim)) weighting v_l, into out when given; softcap: as
    attention_forward's.  Returns out."""
    cdef float cap = _softcap(softcap)
    cdef cnp.ndarray aq = _array(q, "q", np.float32, False)
    cdef cnp.ndarray ak = _array(cache_k, "cache_k", np.float32, False)
    cdef cnp.ndarray av = _array(cache_v, "cache_v", np.float32, False)
    if aq.ndim != 3:
        raise ValueError(f"q: expected shape (batch, n_heads, head_dim), got {(<object>aq).shape}")
    b, nh, d = (<object>aq).shape
    if ak.ndim != 4 or (<object>ak).shape[0] != b or (<object>ak).shape[3] != d:
        raise ValueError(f"cache_k: expected shape ({b}, max_len, n_kv_heads, {d}), got "
                         f"{(<object>ak).shape}")
    if (<object>av).shape != (<object>ak).shape:
        raise ValueError(f"cache_v: expected the shape of cache_k {(<object>ak).shape}, got "
                         f"{(<object>av).shape}")
    max_len, nkv = (<object>ak).shape[1], (<object>ak).shape[2]
    if nh < 1:
        raise ValueError(f"q: expected at least one head, got shape {(<object>aq).shape}")
    if nkv < 1 or nh % nkv != 0:
        raise ValueError(f"q: {nh} heads are not a multiple of the cache's {nkv} kv heads")
    if d < 1:
        raise ValueError("q: expected head_dim >= 1")
    cdef int64_t n = _count(length, "length", 1)
    if n > max_len:
        raise ValueError(f"length: expected at most the cache's max_len={max_len}, got {n}")
    cdef int64_t first = _count(start, "start", 0)
    if first >= n:
        raise ValueError(f"start: expected a position before length={n}, got {first}")
    cdef cnp.ndarray ao = _out(out, (b, nh * d), "out")
    _outputs_apart([("q", aq), ("cache_k", ak), ("cache_v", av)], [("out", ao)])
    cdef cnp.ndarray scores = np.empty(max(nh * n, 1), np.float32)
    cdef int64_t bb = b, h = nh, hk = nkv, hd = d, item = max_len * nkv * d
    cdef float scale = 1.0 / np.sqrt(np.float32(d))
    cdef const float *pq = _f32(aq)
    cdef const float *pk = _f32(ak) + first * hk * hd
    cdef const float *pv = _f32(av) + first * hk * hd
    cdef float *po = _f32(ao)
    cdef float *ps = <float *>cnp.PyArray_DATA(scores)
    cdef int rc = 0
    if b:
        with nogil:
            rc = _attention_decode_capped(bb, h, hk, hd, n - first, pq, pk, pv, item, po, ps,
                                          scale, cap)
    _check_rc(rc, "attention_decode")
    return ao
