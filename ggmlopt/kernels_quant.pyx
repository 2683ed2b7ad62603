# cython: language_level=3
"""The GGUF block-type kernels, callable on NumPy arrays: dequantize rows of a
weight matrix stored as a GGUF file stores it (bit-identical to ggml and to
gguf-py's ``dequantize``), and multiply float32 rows by such a matrix without
widening it.

``quantize`` goes the other way for the K types (Q4_K, Q5_K, Q6_K), with
the bytes llama-quantize writes.

A matrix is ``raw``: a C-contiguous array of nrows rows, each row the bytes of
ncols values of the type (``row_bytes(qtype, ncols)``; the uint8 view
``GgufFile.raw`` gives, or float16 / uint16 words for F16 / BF16), read-only
memory (a mapped file) included.  Every function checks its arguments and
raises TypeError or ValueError naming the argument before any memory is
touched; the work then runs without the GIL.  The C-level forms are in
``kernels_quant.pxd``.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t

from ggmlopt.kernels_embedding cimport check_ids as _check_ids

from ggmlopt cimport kernels as _k
from ggmlopt._kernel_args cimport as_array as _array
from ggmlopt._kernel_args cimport f32_ptr as _f32
from ggmlopt._kernel_args cimport outputs_apart as _outputs_apart

cnp.import_array()

# the types these kernels read, by llama.cpp's names, with ggml's type numbers
QTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
          "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20,
          "IQ4_XS": 23, "BF16": 30}
_NAMES = {v: k for k, v in QTYPES.items()}
# the weight types matmul(..., activations="q8_0") multiplies in integers: x
# rounded to Q8_0 blocks for the first six (with each block's sum of quants for
# Q4_1 and Q5_1, as llama.cpp's Q8_1 blocks carry it), to Q8_K blocks for the
# types of 256-value super-blocks (Q8_K_ACTIVATION_TYPES), as llama.cpp rounds it
Q8_ACTIVATION_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K",
                       "Q5_K", "Q6_K", "IQ4_XS")
Q8_K_ACTIVATION_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")


cdef int64_t quant_row_bytes(int type, int64_t ncols) noexcept nogil:
    return _k.quant_row_bytes(type, ncols)


cdef int dequantize_rows(int type, int64_t r0, int64_t r1, int64_t ncols, const uint8_t *src,
                         float *dst, int64_t dst_stride) noexcept nogil:
    return _k.dequantize_rows(type, r0, r1, ncols, src, dst, dst_stride)


cdef int dequantize_gather(int type, int64_t n, const int32_t *ids, int64_t ncols,
                           const uint8_t *src, float *dst) noexcept nogil:
    return _k.dequantize_gather(type, n, ids, ncols, src, dst)


cdef int quant_matmul_f32(int type, int64_t nx, int64_t ncols, const float *x, int64_t x_stride,
                          int64_t nout, const uint8_t *w, float *y,
                          int64_t y_stride) noexcept nogil:
    return _k.quant_matmul_f32(type, nx, ncols, x, x_stride, nout, w, y, y_stride)


cdef int quantize_rows_f32(int type, int64_t nrows, int64_t ncols, const float *src,
                           uint8_t *dst) noexcept nogil:
    return _k.quantize_rows_f32(type, nrows, ncols, src, dst)


cdef int quant_matmul_q8(int type, int64_t nx, int64_t ncols, const float *x, int64_t x_stride,
                         int64_t nout, const uint8_t *w, float *y, int64_t y_stride,
                         int8_t *xqs, float *xd, float *xsum) noexcept nogil:
    return _k.quant_matmul_q8(type, nx, ncols, x, x_stride, nout, w, y, y_stride, xqs, xd, xsum)


cdef int _qtype(object qtype) except -1:
    """A type name ("Q4_K") or ggml type number as the number; TypeError or
    ValueError naming what these kernels read otherwise."""
    if isinstance(qtype, str):
        if qtype.upper() not in QTYPES:
            raise ValueError(f"qtype: {qtype!r} is not a type these kernels read; expected one "
                             f"of {', '.join(QTYPES)}")
        return QTYPES[qtype.upper()]
    if isinstance(qtype, bool) or not isinstance(qtype, (int, np.integer)):
        raise TypeError(f"qtype: expected a type name such as 'Q4_K' or a ggml type number, "
                        f"got {type(qtype).__name__}")
    if int(qtype) not in _NAMES:
        raise ValueError(f"qtype: ggml type {int(qtype)} is not a type these kernels read; "
                         f"expected one of {', '.join(QTYPES)}")
    return int(qtype)


cdef int _block(int t):
    """Values per block of type t, as the kernels' own table gives them (the
    shortest row they take)."""
    for n in (1, 32, 256):
        if _k.quant_row_bytes(t, n) >= 0:
            return n
    return 0


def row_bytes(qtype, ncols):
    """The bytes of one row of ncols values of qtype (ValueError when ncols is
    not a whole number of the type's blocks: 32 values, 256 for the K types and
    IQ4_XS)."""
    cdef int t = _qtype(qtype)
    if isinstance(ncols, bool) or not isinstance(ncols, (int, np.integer)):
        raise TypeError(f"ncols: expected an int, got {type(ncols).__name__}")
    cdef int64_t n = ncols
    cdef int64_t b = _k.quant_row_bytes(t, n)
    if b < 0:
        raise ValueError(f"ncols: {_NAMES[t]} rows hold whole blocks of {_block(t)} values; "
                         f"got {ncols}")
    return int(b)


cdef cnp.ndarray _raw(object raw, int t, int64_t ncols, str name):
    """raw as a C-contiguous 2-D array whose rows are the row_bytes of ncols
    values of type t."""
    if not isinstance(raw, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray of the rows' bytes, got "
                        f"{type(raw).__name__}")
    cdef cnp.ndarray a = <cnp.ndarray>raw
    if a.dtype.hasobject or not a.dtype.isnative or a.dtype.kind not in "uif":
        # the bytes are read as they lie: another kind or byte order reads wrong values
        raise TypeError(f"{name}: expected the rows' bytes as a plain array (uint8, or a "
                        f"numeric dtype in the machine's byte order), got dtype {a.dtype}")
    if a.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array (rows, bytes of a row), got shape "
                         f"{(<object>a).shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")
    want = row_bytes(t, ncols)
    have = a.shape[1] * a.itemsize
    if have != want:
        raise ValueError(f"{name}: a row of {ncols} {_NAMES[t]} values is {want} bytes, but "
                         f"its rows are {have} bytes (shape {(<object>a).shape}, dtype "
                         f"{a.dtype})")
    return a


cdef cnp.ndarray _out(object out, tuple shape):
    """out, or a new float32 array of shape when None; checked as a writable
    C-contiguous float32 array of exactly shape."""
    if out is None:
        out = np.empty(shape, np.float32)
    cdef cnp.ndarray ao = _array(out, "out", np.float32, True)
    if (<object>ao).shape != shape:
        raise ValueError(f"out: expected shape {shape}, got {(<object>ao).shape}")
    return ao


def dequantize(qtype, raw, ncols, start=0, stop=None, out=None):
    """Rows [start, stop) of raw as float32 (stop - start, ncols), into out
    (allocated when None; a C-contiguous float32 array of that shape, or any
    float32 2-D array whose rows are C-contiguous, e.g. a column block of a
    wider matrix is not: a row block of one is).  Returns out."""
    cdef int t = _qtype(qtype)
    cdef cnp.ndarray a = _raw(raw, t, ncols, "raw")
    cdef int64_t nrows = a.shape[0]
    if stop is None:
        stop = nrows
    for name, v in (("start", start), ("stop", stop)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if not 0 <= start <= stop <= nrows:
        raise ValueError(f"start, stop: expected 0 <= start <= stop <= {nrows}, got "
                         f"{start}, {stop}")
    cdef int64_t r0 = start, r1 = stop, n = ncols
    shape = (int(r1 - r0), int(n))
    cdef cnp.ndarray ao = _out(out, shape)
    _outputs_apart([("raw", a)], [("out", ao)])
    cdef const uint8_t *src = <const uint8_t *>cnp.PyArray_DATA(a)
    cdef float *dst = _f32(ao)
    with nogil:
        _k.dequantize_rows(t, r0, r1, n, src, dst, n)
    return ao


def matmul(x, qtype, raw, out=None, activations="f32"):
    """x (n, ncols) float32 times the transpose of raw's nout rows of ncols
    values: out (n, nout) float32, out[i, j] = dot(x row i, weight row j) (the
    product of a Linear whose (in, out) weight is raw's transpose).  Each
    weight row is dequantized a chunk at a time, never whole; meant for few
    rows of x (decoding), where the weight's bytes bound the time.

    activations="q8_0", for a weight of a type in Q8_ACTIVATION_TYPES: each
    row of x is first rounded as llama.cpp rounds it for that type and each
    block's dot taken in integers, as llama.cpp multiplies these types: to
    Q8_0 blocks of 32 (quantize_q8_0_activations) for Q8_0, Q4_0, Q5_0,
    IQ4_NL, Q4_1 and Q5_1 (whose values d q + m take the m part as m times
    the block's sum of x), to Q8_K blocks of 256 (quantize_q8_k_activations)
    for the types of 256-value super-blocks in Q8_K_ACTIVATION_TYPES (Q2_K
    to Q6_K, IQ4_XS), whose super-blocks then sum in integers.  The result
    is off the float product by that rounding of x (at most half a block's
    scale per value).  F32, F16 and BF16 weights multiply the float32 rows
    either way."""
    if activations not in ("f32", "q8_0"):
        raise ValueError(f"activations: expected 'f32' or 'q8_0', got {activations!r}")
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    if ax.ndim != 2:
        raise ValueError(f"x: expected shape (rows, ncols), got {(<object>ax).shape}")
    cdef int t = _qtype(qtype)
    cdef int64_t ncols = ax.shape[1]
    if _k.quant_row_bytes(t, ncols) < 0:
        raise ValueError(f"x: rows of {ncols} values are not whole {_NAMES[t]} blocks of "
                         f"{_block(t)} values (x's width is the weight's row length)")
    cdef cnp.ndarray a = _raw(raw, t, ncols, "raw")
    cdef int64_t nx = ax.shape[0], nout = a.shape[0]
    shape = (int(nx), int(nout))
    cdef cnp.ndarray ao = _out(out, shape)
    _outputs_apart([("x", ax), ("raw", a)], [("out", ao)])
    cdef const uint8_t *w = <const uint8_t *>cnp.PyArray_DATA(a)
    cdef const float *px = _f32(ax)
    cdef float *py = _f32(ao)
    cdef cnp.ndarray xqs, xd
    cdef int8_t *pq
    cdef float *pd
    if activations == "q8_0" and _NAMES[t] in Q8_ACTIVATION_TYPES:
        # one row's quants (and 32 more for an odd last block), scales and sums of
        # quants: the C side never allocates
        xqs = np.empty(ncols + 32, np.int8)
        xd = np.empty(2 * max(ncols // 32, 1), np.float32)
        pq = <int8_t *>cnp.PyArray_DATA(xqs)
        pd = <float *>cnp.PyArray_DATA(xd)
        with nogil:
            _k.quant_matmul_q8(t, nx, ncols, px, ncols, nout, w, py, nout, pq, pd,
                               pd + max(ncols // 32, 1))
        return ao
    with nogil:
        _k.quant_matmul_f32(t, nx, ncols, px, ncols, nout, w, py, nout)
    return ao


def matmul_many(x, weights, activations="f32"):
    """The products of the same rows x (n, ncols) float32 by several weights,
    ``weights`` a sequence of (qtype, raw) (at most 8), as one threaded job
    over all their rows (a decode step's q, k and v): a list of float32 arrays
    (n, rows of raw), each the same bits as matmul(x, qtype, raw,
    activations=activations) alone."""
    if activations not in ("f32", "q8_0"):
        raise ValueError(f"activations: expected 'f32' or 'q8_0', got {activations!r}")
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    if ax.ndim != 2:
        raise ValueError(f"x: expected shape (rows, ncols), got {(<object>ax).shape}")
    weights = list(weights)
    if not 1 <= len(weights) <= _k.GGMLOPT_QPRODUCTS_MAX:
        raise ValueError(f"weights: expected 1 to {_k.GGMLOPT_QPRODUCTS_MAX} (qtype, raw) "
                         f"pairs, got {len(weights)}")
    cdef int64_t nx = ax.shape[0], ncols = ax.shape[1]
    cdef _k.ggmlopt_qproduct p[8]
    cdef int n = len(weights), m, q8 = 0
    raws, outs = [], []
    for m in range(n):
        pair = weights[m]
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TypeError(f"weights[{m}]: expected a (qtype, raw) pair, got "
                            f"{type(pair).__name__}")
        t = _qtype(pair[0])
        if _k.quant_row_bytes(t, ncols) < 0:
            raise ValueError(f"x: rows of {ncols} values are not whole {_NAMES[t]} blocks of "
                             f"{_block(t)} values (weights[{m}])")
        a = _raw(pair[1], t, ncols, f"weights[{m}]")
        raws.append(a)
        outs.append(np.empty((int(nx), int(a.shape[0])), np.float32))
        q8 |= activations == "q8_0" and _NAMES[t] in Q8_ACTIVATION_TYPES
        p[m].type = t
        p[m].nout = a.shape[0]
        p[m].w = <const uint8_t *>cnp.PyArray_DATA(<cnp.ndarray>a)
        p[m].y = _f32(<cnp.ndarray>outs[m])
        p[m].y_stride = a.shape[0]
    cdef cnp.ndarray xqs = np.empty(max(nx * (ncols + 32), 1), np.int8)
    cdef cnp.ndarray xd = np.empty(max(2 * nx * (ncols // 32), 1), np.float32)
    cdef int8_t *pq = <int8_t *>cnp.PyArray_DATA(xqs)
    cdef float *pd = <float *>cnp.PyArray_DATA(xd)
    cdef const float *px = _f32(ax)
    with nogil:
        _k.quant_matmul_many(n, p, nx, ncols, px, ncols, q8, pq, pd, pd + nx * (ncols // 32))
    return outs


def quantize_q8_0_activations(x):
    """x (n, ncols) float32 rounded as matmul(..., activations="q8_0") rounds it
    for Q8_0-form weights, as llama.cpp's x86 quantize_row_q8_0 does (x times
    127 / amax, to nearest with ties to even): (quants int8 (n, ncols), scales
    float32 (n, ncols // 32)); ncols a multiple of 32.  Value j of row i stands
    for quants[i, j] * scales[i, j // 32]."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    if ax.ndim != 2 or ax.shape[1] % 32:
        raise ValueError(f"x: expected shape (rows, a multiple of 32), got "
                         f"{(<object>ax).shape}")
    cdef int64_t nx = ax.shape[0], ncols = ax.shape[1], i
    quants = np.empty((nx, ncols), np.int8)
    scales = np.empty((nx, ncols // 32), np.float32)
    cdef int8_t[:, ::1] q = quants
    cdef float[:, ::1] d = scales
    cdef const float *px = _f32(ax)
    if nx and ncols:
        with nogil:
            for i in range(nx):
                _k.quantize_q8_0_row(px + i * ncols, ncols, &q[i, 0], &d[i, 0])
    return quants, scales


def quantize_q8_k_activations(x):
    """x (n, ncols) float32 rounded as matmul(..., activations="q8_0") rounds it
    for the K types (ggml's quantize_row_q8_K_ref): (quants int8 (n, ncols),
    scales float32 (n, ncols // 256), sums int16 (n, ncols // 16)); ncols a
    multiple of 256.  Value j of row i stands for quants[i, j] * scales[i, j //
    256]; sums[i, k] is the sum of quants[i, 16 k: 16 k + 16]."""
    cdef cnp.ndarray ax = _array(x, "x", np.float32, False)
    if ax.ndim != 2 or ax.shape[1] % 256:
        raise ValueError(f"x: expected shape (rows, a multiple of 256), got "
                         f"{(<object>ax).shape}")
    cdef int64_t nx = ax.shape[0], ncols = ax.shape[1], i
    quants = np.empty((nx, ncols), np.int8)
    scales = np.empty((nx, ncols // 256), np.float32)
    sums = np.empty((nx, ncols // 16), np.int16)
    cdef int8_t[:, ::1] q = quants
    cdef float[:, ::1] d = scales
    cdef int16_t[:, ::1] s = sums
    cdef const float *px = _f32(ax)
    if nx and ncols:
        with nogil:
            for i in range(nx):
                _k.quantize_q8_k_row(px + i * ncols, ncols, &q[i, 0], &d[i, 0], &s[i, 0])
    return quants, scales, sums


def gather(ids, qtype, raw, ncols, out=None):
    """out[..., :] = row ids[...] of raw dequantized: float32 (..., ncols), the
    lookup of a token embedding stored as the file stores it.  ids: int32, any
    shape, each a row of raw (else IndexError naming the first bad id)."""
    cdef cnp.ndarray ai = _array(ids, "ids", np.int32, False)
    cdef int t = _qtype(qtype)
    cdef cnp.ndarray a = _raw(raw, t, ncols, "raw")
    cdef int64_t n = ncols
    shape = (<object>ai).shape + (int(n),)
    cdef cnp.ndarray ao = _out(out, shape)
    _outputs_apart([("ids", ai), ("raw", a)], [("out", ao)])
    _check_ids(ai, a.shape[0], "ids")
    cdef const int32_t *pi = <const int32_t *>cnp.PyArray_DATA(ai)
    cdef const uint8_t *src = <const uint8_t *>cnp.PyArray_DATA(a)
    cdef float *dst = _f32(ao)
    cdef int64_t count = ai.size
    with nogil:
        _k.dequantize_gather(t, count, pi, n, src, dst)
    return ao


# the types quantize writes (the legacy ones come from gguf-py's quantizers)
QUANTIZE_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def quantize(rows, qtype, out=None):
    """float32 rows (nrows, ncols) as qtype's blocks: a uint8 array (nrows,
    row_bytes(qtype, ncols)), into out when given.  qtype: Q4_K, Q5_K or Q6_K;
    ncols a multiple of 256.  The bytes are ggml's quantize_row_q*_K_ref's,
    which llama-quantize writes for a model without an importance matrix; the
    same whatever the threads.  ValueError for a non-finite value (ggml's
    reference has no meaning for one) or another type."""
    cdef int t = _qtype(qtype)
    if _NAMES[t] not in QUANTIZE_TYPES:
        raise ValueError(f"qtype: quantize writes {', '.join(QUANTIZE_TYPES)}; got "
                         f"{_NAMES[t]} (gguf.quants.quantize writes the 32-value types)")
    cdef cnp.ndarray a = _array(rows, "rows", np.float32, False)
    if a.ndim != 2:
        raise ValueError(f"rows: expected a 2-D array (rows, values), got shape "
                         f"{(<object>a).shape}")
    cdef int64_t nrows = a.shape[0], ncols = a.shape[1]
    if _k.quant_row_bytes(t, ncols) < 0:
        raise ValueError(f"rows: {_NAMES[t]} rows hold whole blocks of 256 values; got rows "
                         f"of {ncols}")
    cdef int64_t nbytes = _k.quant_row_bytes(t, ncols)
    if not np.isfinite(a).all():
        raise ValueError("rows: every value must be finite to be quantized")
    shape = (int(nrows), int(nbytes))
    if out is None:
        out = np.empty(shape, np.uint8)
    cdef cnp.ndarray ao = _array(out, "out", np.uint8, True)
    if (<object>ao).shape != shape:
        raise ValueError(f"out: expected shape {shape}, got {(<object>ao).shape}")
    _outputs_apart([("rows", a)], [("out", ao)])
    cdef const float *src = _f32(a)
    cdef uint8_t *dst = <uint8_t *>cnp.PyArray_DATA(ao)
    with nogil:
        _k.quantize_rows_f32(t, nrows, ncols, src, dst)
    return ao
