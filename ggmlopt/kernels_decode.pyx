# cython: language_level=3
"""A decode step of a Llama-layout block in one C call (ggmlopt.h's
``ggmlopt_decode_block_f32``): the kernels a LlamaDecoderLayer's ``decode``
calls one by one (norms, the q/k/v products, RoPE, the cache's new row,
attention, the output product, the MLP), for one new token of each of a few
sequences, over weights kept in their file's types or a Linear's float32
ones.  Decoding a small model is a few hundred calls a token of a few microseconds each: in one C call
a block pays none of the interpreter's round trips, and its q, k and v (and
its gate and up) are one threaded product.

``LlamaBlockStep`` holds one block's weights (checked once, kept alive while it
lives); ``step`` runs a token.  The C-level form is ``kernels.decode_block_f32``.
"""
import threading

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t

from ggmlopt cimport kernels as _k
from ggmlopt._kernel_args cimport as_array as _array
from ggmlopt._kernel_args cimport f32_ptr as _f32
from ggmlopt._kernel_args cimport finite_float
from ggmlopt._kernel_args cimport no_overlap as _no_overlap

from ggmlopt import kernels_quant

cnp.import_array()

_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")

# A step's work area holds only that call's temporaries, so every step of a
# thread shares one (a Linear's products keep their partial sums there: a
# block's own would be megabytes a block for a 2048-wide model); each thread
# has its own, as steps of two threads may run at once.
_work_areas = threading.local()


def _work_area(size):
    """A 64-byte aligned uint8 array of at least size bytes, this thread's."""
    area = getattr(_work_areas, "area", None)
    if area is None or area.shape[0] < size:
        buf = np.empty(size + 64, np.uint8)
        start = (-buf.ctypes.data) % 64
        area = _work_areas.area = buf[start:start + size]
    return area


def _vector(a, n, name):
    """a as a C-contiguous float32 array of n values (kept by the caller)."""
    cdef cnp.ndarray v = _array(a, name, np.float32, False)
    if (<object>v).shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got {(<object>v).shape}")
    return v


cdef class LlamaBlockStep:
    """LlamaBlockStep(projections, attn_norm, ffn_norm, *, n_heads, n_kv_heads,
    eps, q_norm=None, k_norm=None, window=None, activations="f32")

    One Llama-layout block's weights for decode steps.  projections: a
    mapping of "q", "k", "v", "o", "gate", "up", "down" to (qtype, raw, bias)
    or (qtype, raw, bias, adapter): raw the C-contiguous rows of the weight's
    transpose in qtype (a QuantizedLinear's ``qweight``), or with qtype
    "linear" a Linear's float32 (in, out) weight with contiguous rows (read in
    place: a column range of a fused one will do), bias None or float32
    (rows,), adapter None or a LoRA adapter (lora_a, lora_b, scale) adding
    scale * (x lora_a) lora_b (a LoRALinear's lora_a (in, rank) and lora_b
    (rank, out) data, read in place: an optimizer's steps on them count; B may
    be a column range of a wider array).  attn_norm,
    ffn_norm: the two RMSNorms' weights (dim,); q_norm, k_norm: the per-head
    RMSNorms' (head_dim,), or None; eps: every norm's.  window: None, or a
    sliding window of that many positions.  activations: "f32", or "q8_0" (the
    types with integer products multiply activations rounded to Q8_0 or, for
    the K types, Q8_K blocks, as kernels_quant.matmul's).  ValueError or TypeError naming the argument when
    the shapes do not fit one block.
    """

    cdef _k.ggmlopt_llama_block blk
    cdef object kept      # the arrays blk points into
    cdef readonly int64_t dim, n_heads, n_kv_heads, head_dim, ffn_dim

    def __init__(self, projections, attn_norm, ffn_norm, *, n_heads, n_kv_heads, eps,
                 q_norm=None, k_norm=None, window=None, activations="f32"):
        if activations not in ("f32", "q8_0"):
            raise ValueError(f"activations: expected 'f32' or 'q8_0', got {activations!r}")
        for name, v in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads: n_heads {n_heads} is not a multiple of {n_kv_heads}")
        cdef float norm_eps = finite_float(eps, "eps")
        if not norm_eps > 0.0:
            raise ValueError(f"eps: expected a number > 0, got {eps!r}")
        if window is not None and (isinstance(window, bool) or
                                   not isinstance(window, (int, np.integer)) or window < 1):
            raise ValueError(f"window: expected None or an int >= 1, got {window!r}")
        missing = [p for p in _PROJECTIONS if p not in projections]
        if missing:
            raise ValueError(f"projections: expected {', '.join(_PROJECTIONS)}; missing "
                             f"{', '.join(missing)}")
        an = _array(attn_norm, "attn_norm", np.float32, False)
        if an.ndim != 1:
            raise ValueError(f"attn_norm: expected shape (dim,), got {(<object>an).shape}")
        dim = an.shape[0]
        rows = {p: _raw_rows(projections[p], p) for p in _PROJECTIONS}
        adapters = {p: projections[p][3] if len(projections[p]) == 4 else None
                    for p in _PROJECTIONS}
        nq, kv, ffn = rows["q"], rows["k"], rows["gate"]
        if nq % n_heads or kv != nq // n_heads * n_kv_heads:
            raise ValueError(f"projections: q's {nq} and k's {kv} rows are not {n_heads} and "
                             f"{n_kv_heads} heads of one width")
        hd = nq // n_heads
        want = {"q": (nq, dim), "k": (kv, dim), "v": (kv, dim), "o": (dim, nq),
                "gate": (ffn, dim), "up": (ffn, dim), "down": (dim, ffn)}
        kept = [an, _vector(ffn_norm, dim, "ffn_norm")]
        cdef _k.ggmlopt_block_weight *w
        cdef _k.ggmlopt_block_weight *ws[7]
        ws[:] = [&self.blk.q, &self.blk.k, &self.blk.v, &self.blk.o, &self.blk.gate,
                 &self.blk.up, &self.blk.down]
        for i, p in enumerate(_PROJECTIONS):
            qtype, raw, bias = projections[p][:3]
            nout, ncols = want[p]
            w = ws[i]
            if _is_linear(qtype):
                w.columns_ld = _checked_linear(raw, nout, ncols, p)
                w.type = 0   # float32, read by columns
                a = raw
            else:
                a = _checked_raw(qtype, raw, nout, ncols, p)
                w.columns_ld = 0
                w.type = kernels_quant.QTYPES[qtype.upper()] if isinstance(qtype, str) \
                    else int(qtype)
            w.nout = nout
            w.w = <const uint8_t *>cnp.PyArray_DATA(<cnp.ndarray>a)
            w.bias = NULL
            w.lora_a = w.lora_b = NULL
            w.rank = w.lora_b_stride = 0
            w.lora_scale = 0.0
            kept.append(a)
            if bias is not None:
                b = _vector(bias, nout, f"projections[{p!r}] bias")
                w.bias = _f32(<cnp.ndarray>b)
                kept.append(b)
            if adapters[p] is not None:
                la, lb, scale = _adapter(adapters[p], ncols, nout, p)
                w.lora_a, w.lora_b = _f32(<cnp.ndarray>la), _f32(<cnp.ndarray>lb)
                w.rank, w.lora_b_stride = la.shape[1], lb.strides[0] // 4
                w.lora_scale = scale
                kept += [la, lb]
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm, k_norm: expected both or neither")
        self.blk.q_norm = self.blk.k_norm = NULL
        if q_norm is not None:
            qn, kn = _vector(q_norm, hd, "q_norm"), _vector(k_norm, hd, "k_norm")
            self.blk.q_norm, self.blk.k_norm = _f32(<cnp.ndarray>qn), _f32(<cnp.ndarray>kn)
            kept += [qn, kn]
        self.blk.attn_norm = _f32(<cnp.ndarray>kept[0])
        self.blk.ffn_norm = _f32(<cnp.ndarray>kept[1])
        self.blk.dim, self.blk.n_heads, self.blk.n_kv_heads = dim, n_heads, n_kv_heads
        self.blk.head_dim, self.blk.ffn_dim = hd, ffn
        self.blk.eps = norm_eps
        self.blk.window = 0 if window is None else window
        self.blk.q8 = activations == "q8_0"
        if _k.decode_block_work_size(&self.blk, 1, 1) < 0:
            raise ValueError("projections: the weights do not make one block")
        self.kept = kept
        self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_dim = \
            dim, n_heads, n_kv_heads, hd, ffn

    def step(self, x, cache_k, cache_v, pos, cos=None, sin=None):
        """The block's decode step, in place: x float32 (batch, dim) C-contiguous,
        the new token of each sequence, becomes the block's output; its key and
        value go to position pos of cache_k and cache_v (batch, max_len,
        n_kv_heads, head_dim) float32 C-contiguous, and the attention reads
        positions 0 .. pos.  cos, sin: the rotary tables (at least pos + 1 rows
        of head_dim // 2; RotaryEmbedding.tables), or None for no RoPE.
        Returns x."""
        cdef cnp.ndarray ax = _array(x, "x", np.float32, True)
        cdef cnp.ndarray ak = _array(cache_k, "cache_k", np.float32, True)
        cdef cnp.ndarray av = _array(cache_v, "cache_v", np.float32, True)
        if ax.ndim != 2 or ax.shape[1] != self.dim:
            raise ValueError(f"x: expected shape (batch, {self.dim}), got {(<object>ax).shape}")
        cdef int64_t batch = ax.shape[0]
        if (ak.ndim != 4 or ak.shape[0] != batch or ak.shape[2] != self.n_kv_heads
                or ak.shape[3] != self.head_dim):
            raise ValueError(f"cache_k: expected shape ({batch}, max_len, {self.n_kv_heads}, "
                             f"{self.head_dim}), got {(<object>ak).shape}")
        if (<object>av).shape != (<object>ak).shape:
            raise ValueError(f"cache_v: expected the shape of cache_k {(<object>ak).shape}, got "
                             f"{(<object>av).shape}")
        cdef int64_t max_len = ak.shape[1]
        if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)):
            raise TypeError(f"pos: expected an int, got {type(pos).__name__}")
        if not 0 <= pos < max_len:
            raise ValueError(f"pos: expected 0 <= pos < max_len={max_len}, got {pos}")
        cdef const float *pc = NULL
        cdef const float *ps = NULL
        cdef cnp.ndarray ac, as_
        if (cos is None) != (sin is None):
            raise ValueError("cos, sin: expected both or neither")
        if cos is not None:
            ac = _array(cos, "cos", np.float32, False)
            as_ = _array(sin, "sin", np.float32, False)
            if (self.head_dim % 2 or ac.ndim != 2 or ac.shape[0] <= pos
                    or ac.shape[1] != self.head_dim // 2
                    or (<object>as_).shape != (<object>ac).shape):
                raise ValueError(f"cos, sin: expected equal shapes (> {pos}, "
                                 f"{self.head_dim // 2}) for an even head_dim, got "
                                 f"{(<object>ac).shape} and {(<object>as_).shape}")
            pc, ps = _f32(ac), _f32(as_)
        _no_overlap([("x", ax), ("cache_k", ak), ("cache_v", av)])
        # the size each call (a cheap C call): a step two threads share keeps no
        # state of its own between calls
        cdef void *work = cnp.PyArray_DATA(<cnp.ndarray>_work_area(
            _k.decode_block_work_size(&self.blk, batch, max_len)))
        cdef int64_t p = pos
        cdef float *px = _f32(ax)
        cdef float *pk = _f32(ak)
        cdef float *pv = _f32(av)
        with nogil:
            _k.decode_block_f32(&self.blk, batch, p, px, pk, pv, max_len, pc, ps, work)
        return ax


def _raw_rows(entry, name):
    """The output width of a projection's (qtype, raw, bias[, adapter]) entry:
    raw's rows, or its columns for a Linear's weight ("linear")."""
    if not isinstance(entry, tuple) or len(entry) not in (3, 4):
        raise TypeError(f"projections[{name!r}]: expected (qtype, raw, bias) or (qtype, raw, "
                        f"bias, (lora_a, lora_b, scale)), got {type(entry).__name__}")
    raw = entry[1]
    if not isinstance(raw, np.ndarray) or raw.ndim != 2:
        raise ValueError(f"projections[{name!r}]: expected raw rows as a 2-D numpy array, got "
                         f"{getattr(raw, 'shape', type(raw).__name__)}")
    return raw.shape[1] if _is_linear(entry[0]) else raw.shape[0]


def _is_linear(qtype):
    return isinstance(qtype, str) and qtype.lower() == "linear"


def _checked_linear(raw, nout, ncols, name):
    """raw checked as a Linear's float32 weight (ncols, nout) with contiguous
    rows (a column range of a wider one will do); its row stride in floats."""
    if raw.dtype != np.float32 or raw.shape != (ncols, nout) or \
            (nout > 1 and raw.strides[1] != 4) or raw.strides[0] % 4 or \
            (ncols > 1 and raw.strides[0] < 4 * nout):
        raise ValueError(f"projections[{name!r}]: expected a float32 ({ncols}, {nout}) weight "
                         f"with contiguous rows, got shape {raw.shape} of {raw.dtype}, "
                         f"strides {raw.strides}")
    return raw.strides[0] // 4 if ncols > 1 else nout


def _checked_raw(qtype, raw, nout, ncols, name):
    """raw checked as nout C-contiguous rows of ncols values of qtype."""
    try:
        want = kernels_quant.row_bytes(qtype, ncols)
    except ValueError as e:
        raise ValueError(f"projections[{name!r}]: {e}") from None
    if raw.dtype.hasobject or not raw.dtype.isnative or raw.dtype.kind not in "uif":
        raise TypeError(f"projections[{name!r}]: expected the rows' bytes as a plain array "
                        f"(uint8, or a numeric dtype in the machine's byte order), got dtype "
                        f"{raw.dtype}")
    if raw.ndim != 2 or raw.shape[0] != nout or raw.shape[1] * raw.itemsize != want or \
            not raw.flags.c_contiguous:
        raise ValueError(f"projections[{name!r}]: expected {nout} C-contiguous rows of {want} "
                         f"bytes ({ncols} {qtype} values), got shape {raw.shape} of "
                         f"{raw.dtype}")
    return raw


def _adapter(adapter, ncols, nout, name):
    """(lora_a, lora_b, scale) checked: A float32 (ncols, rank) C-contiguous, B
    float32 (rank, nout) with contiguous rows (a column range of a wider B
    will do), scale a finite number."""
    if not isinstance(adapter, tuple) or len(adapter) != 3:
        raise TypeError(f"projections[{name!r}]: expected an adapter (lora_a, lora_b, scale), "
                        f"got {type(adapter).__name__}")
    la = <object>_array(adapter[0], f"projections[{name!r}] lora_a", np.float32, False)
    lb = adapter[1]
    if not isinstance(lb, np.ndarray) or lb.dtype != np.float32:
        raise TypeError(f"projections[{name!r}] lora_b: expected a float32 array")
    if la.ndim != 2 or la.shape[0] != ncols or la.shape[1] < 1:
        raise ValueError(f"projections[{name!r}] lora_a: expected shape ({ncols}, rank), got "
                         f"{la.shape}")
    if lb.shape != (la.shape[1], nout) or lb.strides[1] != 4 or lb.strides[0] % 4 or \
            lb.strides[0] < 4 * nout:
        raise ValueError(f"projections[{name!r}] lora_b: expected shape ({la.shape[1]}, {nout}) "
                         f"with contiguous rows, got {lb.shape}, strides {lb.strides}")
    scale = float(adapter[2])
    if not np.isfinite(scale):
        raise ValueError(f"projections[{name!r}]: the adapter's scale must be finite, got "
                         f"{scale}")
    return la, lb, scale
