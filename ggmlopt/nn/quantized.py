"""Layers over a frozen weight kept as its file stores it: float32, float16,
bfloat16 or a GGUF block type (Q8_0, Q4_K, ...), often a read-only view of the
memory-mapped file.

The weight is not a Parameter: it has no gradient and no optimizer state, and
its float32 form never exists whole.  A product dequantizes a panel of rows
(about PANEL_FLOATS values) at a time and runs the BLAS on it; a product of
few rows (decoding) reads the blocks directly (ggmlopt.kernels_quant.matmul).
LoRA adapters wrap these layers as they wrap Linear and Embedding (QLoRA).
"""
from __future__ import annotations

import enum
import threading

import numpy as np

from .. import gemm, kernels, kernels_quant
from ._buffers import add_into, as_rows, empty, output_array, rows2d
from .embedding import padding_index
from .module import Module, named_layers, named_modules
from .parameter import Parameter

__all__ = ["ACTIVATIONS", "QuantizedEmbedding", "QuantizedLinear", "is_quantized",
           "quantized_layers", "refuse_full_finetune_of_quantized", "refuse_quantized",
           "set_activations"]

# dequantized values a panel holds (4 MiB): the BLAS's working set stays in cache
PANEL_FLOATS = 1 << 20
# products of at most this many rows read the blocks directly: they are bound
# by the weight's bytes, which dequantizing into a panel would multiply by 4-8
# (a 2-core Sapphire Rapids Xeon, Q4_0 576 x 1536: 8 rows 175 us directly, 466
# through a panel and OpenBLAS; 16 rows about even, 32 the panel's).  It also
# keeps a short prompt's products off OpenBLAS, whose threads spin for a while
# after a call, slowing the decode steps that follow by a sixth
FEW_ROWS = 16

_scratch = threading.local()


def _panel_buffer(n: int) -> np.ndarray:
    """A float32 scratch of at least n values, one per thread, shared by every
    layer (one layer's panel is dead once its product is done)."""
    buf = getattr(_scratch, "panel", None)
    if buf is None or buf.size < n:
        buf = empty(n, np.float32)
        _scratch.panel = buf
    return buf[:n]


def _panels(qtype, qweight, ncols):
    """(r0, r1, float32 rows [r0, r1) of qweight (r1 - r0, ncols)) over all rows."""
    nrows = qweight.shape[0]
    step = max(1, min(nrows, PANEL_FLOATS // max(1, ncols)))
    buf = _panel_buffer(step * ncols).reshape(step, ncols)
    for r0 in range(0, nrows, step):
        r1 = min(nrows, r0 + step)
        yield r0, r1, kernels_quant.dequantize(qtype, qweight, ncols, r0, r1, out=buf[:r1 - r0])


def _product_args(a, a_name, width, out, want):
    """a (2-D float32, width columns) and out (float32, writable, of shape want)
    checked for the products below: ValueError or TypeError naming them."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != 2:
        raise TypeError(f"{a_name}: expected a 2-D float32 array, got "
                        f"{getattr(a, 'dtype', type(a).__name__)} "
                        f"{getattr(a, 'shape', '')}")
    if a.shape[1] != width:
        raise ValueError(f"{a_name}: expected {width} columns, got shape {a.shape}")
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != want \
            or not out.flags.writeable:
        raise ValueError(f"out: expected a writable float32 array of shape {want}, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} "
                         f"{getattr(out, 'shape', '')}")


def rows_times_transpose(x2, qtype, qweight, out, activations="f32"):
    """out (n, nrows) = x2 (n, ncols) times the transpose of qweight's rows
    (a Linear's x W with W = rows^T; the tied head's h E^T); activations: as
    kernels_quant.matmul's, for products of few rows (more go through panels)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: expected one of {', '.join(ACTIVATIONS)}, got "
                         f"{activations!r}")
    ncols = x2.shape[1] if isinstance(x2, np.ndarray) and x2.ndim == 2 else -1
    _product_args(x2, "x2", ncols, out, (x2.shape[0], qweight.shape[0]))
    # qweight's rows are checked by the kernels that read them
    if x2.shape[0] <= FEW_ROWS:   # the block kernel reads rows of contiguous values
        return kernels_quant.matmul(np.ascontiguousarray(x2), qtype, qweight, out=out,
                                    activations=activations)
    for r0, r1, panel in _panels(qtype, qweight, x2.shape[1]):
        gemm.matmul(x2, panel.T, out[:, r0:r1])
    return out


def rows_times(g, qtype, qweight, ncols, out):
    """out (n, ncols) = g (n, nrows) times qweight's rows (nrows, ncols) (a
    Linear's input gradient g W^T; the tied head's g E)."""
    nrows = qweight.shape[0]
    _product_args(g, "g", nrows, out, (g.shape[0] if isinstance(g, np.ndarray) and g.ndim
                                       else -1, ncols))
    first = True
    for r0, r1, panel in _panels(qtype, qweight, ncols):
        part = g if r1 - r0 == g.shape[1] else g[:, r0:r1]
        gemm.matmul(part, panel, out, accumulate=not first)
        first = False
    if first:
        out.fill(0.0)
    return out


ACTIVATIONS = ("f32", "q8_0")


def _activations(layer) -> str:
    """What layer's product of few rows multiplies now: its setting, except
    float32 while training (the backward pass multiplies float32 gradients)."""
    return "f32" if layer.training else layer.activations


def set_activations(model, activations) -> int:
    """Sets how every QuantizedLinear and QuantizedEmbedding under model (model
    included) multiplies products of few rows (decoding) outside training:
    "f32" (the default: the float32 activations, the same numbers as a
    product of many rows) or "q8_0" (each row first rounded as llama.cpp
    rounds it and multiplied in integers, for the weights of
    kernels_quant.Q8_ACTIVATION_TYPES: faster, and off by that rounding of the
    activations; F32, F16 and BF16 weights keep float32).  As in llama.cpp,
    Q8_0, Q4_0, Q5_0, IQ4_NL, Q4_1 and Q5_1 weights take activations rounded
    to Q8_0 blocks of 32 as llama.cpp's x86 kernels round them (x times
    127 / amax, to the nearest integer with ties to even: activations on a
    quantized grid, a Q4_0 embedding's rows, sit on half-steps often, where
    ggml's scalar reference and gguf-py round away from zero; Q4_1 and Q5_1
    also take each block's s = f16(d * its sum of quants), llama.cpp's Q8_1,
    which overflows to inf as llama.cpp's does past 65504: a block of 32
    activations near 2,000), and the types of 256-value super-blocks (Q2_K
    to Q6_K, IQ4_XS) activations rounded to Q8_K blocks of 256, exactly as ggml's
    quantize_row_q8_K_ref rounds them, each super-block's products summed in
    integers.  Returns how many layers multiply in integers now."""
    # any case, as save_gguf's dtype and QuantizedLinear's qtype take a type's name
    if isinstance(activations, str) and activations.lower() in ACTIVATIONS:
        activations = activations.lower()
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: expected one of {', '.join(ACTIVATIONS)}, got "
                         f"{activations!r}")
    count = 0
    for _, layer in quantized_layers(model):
        layer.activations = activations
        count += activations == "q8_0" and layer.qtype in kernels_quant.Q8_ACTIVATION_TYPES
    return count


def _qtype_arg(qtype) -> str:
    if isinstance(qtype, enum.Enum):   # gguf-py's GGMLQuantizationType, as its reader gives it
        qtype = qtype.name
    if not isinstance(qtype, str):
        raise TypeError(f"qtype: expected a type name such as 'Q4_K', got {type(qtype).__name__}")
    name = qtype.upper()
    if name not in kernels_quant.QTYPES:
        raise ValueError(f"qtype: {qtype!r} is not a type ggmlopt's kernels read; expected one "
                         f"of {', '.join(kernels_quant.QTYPES)}")
    return name


def _rows_arg(qweight, qtype, nrows, ncols, ncols_name) -> np.ndarray:
    """qweight as a C-contiguous 2-D array of nrows rows of the bytes of ncols
    values of qtype (any dtype: uint8 blocks, float16 or uint16 words);
    ncols_name: the argument that gave ncols, named when rows of ncols values
    are not whole blocks of qtype."""
    if not isinstance(qweight, np.ndarray):
        raise TypeError(f"qweight: expected a numpy.ndarray of the rows' bytes, got "
                        f"{type(qweight).__name__}")
    try:
        want = kernels_quant.row_bytes(qtype, ncols)
    except ValueError as e:   # the kernel names its own argument, ncols
        raise ValueError(f"{ncols_name}: {str(e).partition(': ')[2] or e}") from None
    if qweight.ndim != 2 or qweight.shape[0] != nrows or \
            qweight.shape[1] * qweight.itemsize != want:
        raise ValueError(f"qweight: expected {nrows} rows of {want} bytes ({ncols} {qtype} "
                         f"values each), got shape {qweight.shape} of {qweight.dtype}")
    if not qweight.flags.c_contiguous:
        raise ValueError("qweight: expected a C-contiguous array")
    if not qweight.dtype.isnative:   # the kernels read its bytes as native words
        raise ValueError(f"qweight: expected the native byte order, got {qweight.dtype.str} "
                         f"(qweight.astype(qweight.dtype.newbyteorder('=')) converts it)")
    return qweight


def _size_arg(value, name) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected >= 1, got {value}")
    return int(value)


class QuantizedLinear(Module):
    """QuantizedLinear(qweight, qtype, in_features, out_features, bias=None)

    y = x W + b over the last axis, x (..., in_features) float32, with the
    frozen weight W (in, out) stored as a GGUF file stores it: qweight holds
    out_features rows, row j the in_features values of W's column j in type
    qtype ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K",
    "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", any case, or gguf-py's
    GGMLQuantizationType; ``.qtype`` is
    the upper-case name): the uint8 blocks, or the float16 / uint16 words of F16 /
    BF16.  qweight may be read-only (a view of a mapped file); it is read in
    place, never copied.  bias: None, an array (out_features,) (a frozen
    Parameter of it), or a Parameter (kept as it is).

    No Parameter holds the weight: no gradient, no optimizer state.  backward
    returns the input gradient (and adds into bias.grad if the bias trains).
    ``dequantize()`` gives W as a float32 (in, out) array; ``nbytes`` the
    weight's bytes.  Wrap it with ``ggmlopt.lora`` to train over it.
    """

    output_is_scratch = True  # backward reads the input, never the output
    #: products of few rows outside training: "f32" or "q8_0" (set_activations)
    activations = "f32"

    def __init__(self, qweight, qtype, in_features, out_features, bias=None):
        self.in_features = _size_arg(in_features, "in_features")
        self.out_features = _size_arg(out_features, "out_features")
        self.qtype = _qtype_arg(qtype)
        self.qweight = _rows_arg(qweight, self.qtype, self.out_features, self.in_features,
                                 "in_features")
        if bias is not None and not isinstance(bias, Parameter):
            b = np.asarray(bias)
            if b.shape != (self.out_features,):
                raise ValueError(f"bias: expected shape ({self.out_features},), got {b.shape}")
            bias = Parameter(b, name="bias", requires_grad=False)
        elif bias is not None and bias.data.shape != (self.out_features,):
            raise ValueError(f"bias: expected shape ({self.out_features},), got "
                             f"{bias.data.shape}")
        self.bias = bias
        self._shape = None
        self._x = None

    @property
    def nbytes(self) -> int:
        """The bytes of the stored weight."""
        return int(self.qweight.nbytes)

    @property
    def size(self) -> int:
        """The weight's element count (in_features * out_features)."""
        return self.in_features * self.out_features

    def dequantize(self) -> np.ndarray:
        """W as a new float32 (in_features, out_features) array."""
        rows = kernels_quant.dequantize(self.qtype, self.qweight, self.in_features)
        return np.ascontiguousarray(rows.T)

    def _input(self, x):
        one_row = np.ndim(x) == 1
        x = as_rows(np.reshape(x, (1, -1)) if one_row else x, self.in_features, "x")
        return x, (x.shape[1:] if one_row else x.shape)

    def product(self, x2, out2):
        """out2 (rows, out) = x2 (rows, in) W, both float32 C-contiguous: the seam
        an adapter computes its base through."""
        rows_times_transpose(x2, self.qtype, self.qweight, out2, _activations(self))
        return out2

    def product_transposed(self, g, out):
        """out (rows, in) = g (rows, out) W^T: the input gradient's product."""
        return rows_times(g, self.qtype, self.qweight, self.in_features, out)

    def forward(self, x, out=None):
        """x: (..., in_features) -> (..., out_features) float32 (a buffer this
        layer reuses); ``layer(x)`` returns a copy the caller owns.  out: as
        Linear.forward's (written and returned, no output buffer kept)."""
        x, shape = self._input(x)
        want = (*shape[:-1], self.out_features)
        if out is not None:
            out = output_array(out, want, (x,))
        if shape != self._shape:
            rows = int(np.prod(shape[:-1], dtype=np.int64))
            self._out = None   # made by the first forward without out=
            self._out_shape = want
            self._ones = np.ones(rows, np.float32)
            self._shape = shape
        self._x = x
        if out is None:
            if self._out is None:
                self._out = empty(want, np.float32)
            out = self._out
        out2 = out.reshape(-1, self.out_features)
        self.product(rows2d(x), out2)
        if self.bias is not None:
            kernels.add_bias_rows(out2, self.bias.data)
        return out

    def infer(self, x):
        """x W + b as a new float32 array, keeping nothing for a backward pass."""
        x, shape = self._input(x)
        x2 = rows2d(x)
        y = empty((x2.shape[0], self.out_features), np.float32)
        self.product(x2, y)
        if self.bias is not None:
            y += self.bias.data
        return y.reshape(*shape[:-1], self.out_features)

    def backward(self, grad_out):
        """grad_out like the last output -> d loss / d x (None when
        needs_input_grad is False); the weight gets no gradient."""
        if self._x is None:
            raise RuntimeError("backward: call forward first")
        want = self._out_shape
        grad_out = np.asarray(grad_out)
        if grad_out.shape != want:
            raise ValueError(f"grad_out: expected shape {want} like the last forward output, "
                             f"got {grad_out.shape}")
        g = as_rows(grad_out.reshape(-1, self.out_features), self.out_features, "grad_out")
        if self.bias is not None and self.bias.requires_grad:
            ones = self._ones
            add_into(self.bias, lambda out: gemm.matmul(ones, g, out), self, "bias")
        if not self.needs_input_grad:
            return None
        # a new array per call, not kept (as Linear's input gradient)
        grad_in = empty(self._shape, np.float32)
        self.product_transposed(g, grad_in.reshape(-1, self.in_features))
        return grad_in

    def __repr__(self):
        return (f"QuantizedLinear(in_features={self.in_features}, "
                f"out_features={self.out_features}, qtype={self.qtype!r}, "
                f"bias={self.bias is not None})")


class QuantizedEmbedding(Module):
    """QuantizedEmbedding(qweight, qtype, num_embeddings, embedding_dim, *,
    padding_idx=None)

    A token embedding whose frozen weight (num_embeddings, embedding_dim) is
    stored as a GGUF file stores it: qweight holds num_embeddings rows of
    embedding_dim values of qtype (see QuantizedLinear).  forward(ids) gathers
    the rows of the ids, dequantizing each as it is gathered; backward returns
    None (no gradient).  As a tied output head, ``project(rows)`` gives
    rows E^T and ``project_backward(g, rows)`` the hidden rows' gradient g E.
    """

    #: the tied head's products of few rows outside training (set_activations)
    activations = "f32"

    def __init__(self, qweight, qtype, num_embeddings, embedding_dim, *, padding_idx=None):
        self.num_embeddings = _size_arg(num_embeddings, "num_embeddings")
        self.embedding_dim = _size_arg(embedding_dim, "embedding_dim")
        # (no gradient here; an adapter over it trains no row of this id, as PEFT's)
        self.padding_idx = padding_index(padding_idx, self.num_embeddings)
        self.qtype = _qtype_arg(qtype)
        self.qweight = _rows_arg(qweight, self.qtype, self.num_embeddings, self.embedding_dim,
                                 "embedding_dim")
        self._shape = None
        self._ids = None

    @property
    def nbytes(self) -> int:
        """The bytes of the stored weight."""
        return int(self.qweight.nbytes)

    @property
    def size(self) -> int:
        """The weight's element count (num_embeddings * embedding_dim)."""
        return self.num_embeddings * self.embedding_dim

    def dequantize(self) -> np.ndarray:
        """E as a new float32 (num_embeddings, embedding_dim) array."""
        return kernels_quant.dequantize(self.qtype, self.qweight, self.embedding_dim)

    def forward(self, ids):
        """ids: integers (...) -> float32 (..., embedding_dim), a buffer this
        layer reuses (``layer(ids)`` returns a copy the caller owns); IndexError
        for an id outside the vocabulary."""
        if not isinstance(ids, np.ndarray):
            ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"ids: expected integer token ids, got dtype {ids.dtype}")
        if ids.shape != self._shape:
            self._out = empty(ids.shape + (self.embedding_dim,), np.float32)
            self._shape = ids.shape
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            flat = int(np.flatnonzero(((ids < 0) | (ids >= self.num_embeddings)).reshape(-1))[0])
            pos = tuple(int(p) for p in np.unravel_index(flat, ids.shape))
            raise IndexError(f"ids: id {int(ids.reshape(-1)[flat])} at position {pos} is out "
                             f"of range; expected ids in [0, {self.num_embeddings})")
        self._ids = np.ascontiguousarray(ids, np.int32)
        return kernels_quant.gather(self._ids, self.qtype, self.qweight, self.embedding_dim,
                                    out=self._out)

    def backward(self, grad_out):
        """grad_out like the last output: checked; the frozen weight gets no
        gradient and ids have none: returns None."""
        if self._ids is None:
            raise RuntimeError("backward: call forward first")
        expected = self._shape + (self.embedding_dim,)
        if np.shape(grad_out) != expected:
            raise ValueError(f"grad_out: expected shape {expected} like the last forward "
                             f"output, got {np.shape(grad_out)}")

    def project(self, rows, out=None, keep=True):
        """rows (n, embedding_dim) float32 -> rows E^T (n, num_embeddings): the
        logits of a head tied to this embedding (into out when given; keep is
        Embedding.project's: this layer keeps nothing for its backward)."""
        rows = as_rows(rows, self.embedding_dim, "rows")
        if out is None:
            out = empty((rows.shape[0], self.num_embeddings), np.float32)
        return rows_times_transpose(rows, self.qtype, self.qweight, out, _activations(self))

    def project_backward(self, g, rows):
        """The tied head's backward: g (n, num_embeddings) -> g E (n, dim); the
        frozen weight gets no gradient (rows unused)."""
        out = empty((g.shape[0], self.embedding_dim), np.float32)
        return rows_times(np.ascontiguousarray(g, np.float32), self.qtype, self.qweight,
                          self.embedding_dim, out)

    def __repr__(self):
        return (f"QuantizedEmbedding({self.num_embeddings}, {self.embedding_dim}, "
                f"qtype={self.qtype!r})")


QUANTIZED = (QuantizedLinear, QuantizedEmbedding)


def is_quantized(layer) -> bool:
    """Whether layer keeps a frozen weight in its file's type."""
    return isinstance(layer, QUANTIZED)


def quantized_layers(model) -> list[tuple[str, QuantizedLinear | QuantizedEmbedding]]:
    """(dotted name, layer) of every QuantizedLinear and QuantizedEmbedding of
    model, an adapter's base included."""
    found: list[tuple[str, QuantizedLinear | QuantizedEmbedding]] = []
    for name, m in named_layers(model):   # (inside a Checkpoint too)
        if isinstance(m, QUANTIZED):
            found.append((name, m))
        base = getattr(m, "_base", None)
        if isinstance(base, QUANTIZED):
            found.append((name, base))
    return found


def refuse_full_finetune_of_quantized(model) -> None:
    """ValueError when model keeps weights in their file's types and holds no
    LoRA adapter: a full fine-tune cannot change a quantized weight, and
    training the rest alone is rarely what was meant."""
    quantized = quantized_layers(model)
    if not quantized:
        return
    if any(hasattr(m, "lora_a") for _, m in named_modules(model)):
        return
    raise ValueError(f"model: {len(quantized)} of its layers keep their weights in the file's "
                     f"types (e.g. {quantized[0][0]}: {quantized[0][1].qtype}), which do not "
                     f"train; call ggmlopt.lora.apply(model) to train adapters over them "
                     f"(QLoRA), or load the model with keep_types=False to fine-tune every "
                     f"weight in float32")


def refuse_quantized(model, saver: str) -> None:
    """ValueError when model keeps weights in their file's types: saver (e.g.
    "save_hf") writes float32 Parameters only and would silently drop them."""
    quantized = quantized_layers(model)
    if quantized:
        raise ValueError(f"model: {saver} writes float32 parameters, but {len(quantized)} layers "
                         f"keep their weights in the file's types (e.g. {quantized[0][0]}: "
                         f"{quantized[0][1].qtype}); write it with ggmlopt.io.save_gguf, which "
                         f"keeps those types, or load the model with keep_types=False")
