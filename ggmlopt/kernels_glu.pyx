# cython: language_level=3
"""The SwiGLU product kernels, callable on NumPy arrays: h = silu(gate) * up
elementwise, and both input gradients in one pass.

gate and up are separate arrays (the outputs of Llama's gate_proj and up_proj,
two Parameters under Hugging Face's names), so the product is elementwise over
any shape.  Every function checks its arguments and raises TypeError or
ValueError naming the argument before any memory is touched; the work runs
without the GIL.  The C-level forms are in ``kernels_glu.pxd``.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t

from ggmlopt cimport kernels as _k
from ggmlopt._kernel_args cimport as_array as _array
from ggmlopt._kernel_args cimport f32_ptr as _f32
from ggmlopt._kernel_args cimport no_overlap as _no_overlap
from ggmlopt._kernel_args cimport outputs_apart as _outputs_apart
from ggmlopt._kernel_args cimport same_size as _same_size

cnp.import_array()


cdef void swiglu_f32(int64_t n, const float *gate, const float *up, float *h) noexcept nogil:
    _k.swiglu_f32(n, gate, up, h)


cdef void swiglu_backward_f32(int64_t n, const float *gate, const float *up, const float *grad_h,
                              float *grad_gate, float *grad_up) noexcept nogil:
    _k.swiglu_backward_f32(n, gate, up, grad_h, grad_gate, grad_up)


cdef cnp.ndarray _out(object out, cnp.ndarray like, str name):
    if out is None:
        out = np.empty((<object>like).shape, dtype=np.float32)
    cdef cnp.ndarray ao = _array(out, name, np.float32, True)
    _same_size(like, "gate", ao, name)
    return ao


def swiglu(gate, up, out=None):
    """h = silu(gate) * up = gate * sigmoid(gate) * up elementwise (silu(-inf) = 0).

    gate, up: float32 arrays of one size (any shape); out: float32 of that size
    (allocated with gate's shape when None), may be gate or up itself.  Returns
    out.
    """
    cdef cnp.ndarray ag = _array(gate, "gate", np.float32, False)
    cdef cnp.ndarray au = _array(up, "up", np.float32, False)
    _same_size(ag, "gate", au, "up")
    cdef cnp.ndarray ao = _out(out, ag, "out")
    # elementwise: out may be exactly gate or up, but not overlap them otherwise
    if cnp.PyArray_DATA(ao) != cnp.PyArray_DATA(ag):
        _no_overlap([("gate", ag), ("out", ao)])
    if cnp.PyArray_DATA(ao) != cnp.PyArray_DATA(au):
        _no_overlap([("up", au), ("out", ao)])
    cdef int64_t n = ag.size
    cdef float *pg = _f32(ag)
    cdef float *pu = _f32(au)
    cdef float *po = _f32(ao)
    with nogil:
        _k.swiglu_f32(n, pg, pu, po)
    return <object>ao


def swiglu_backward(gate, up, grad_h, grad_gate=None, grad_up=None):
    """The gradients of swiglu from its inputs and grad_h, in one pass:
    grad_gate = grad_h * up * s * (1 + gate * (1 - s)), s = sigmoid(gate);
    grad_up = grad_h * silu(gate).

    gate, up, grad_h: float32 of one size; grad_gate, grad_up: float32 of that
    size, apart from the inputs and each other (allocated with gate's shape when
    None).  Returns (grad_gate, grad_up).
    """
    cdef cnp.ndarray ag = _array(gate, "gate", np.float32, False)
    cdef cnp.ndarray au = _array(up, "up", np.float32, False)
    cdef cnp.ndarray ah = _array(grad_h, "grad_h", np.float32, False)
    _same_size(ag, "gate", au, "up")
    _same_size(ag, "gate", ah, "grad_h")
    cdef cnp.ndarray adg = _out(grad_gate, ag, "grad_gate")
    cdef cnp.ndarray adu = _out(grad_up, ag, "grad_up")
    _outputs_apart([("gate", ag), ("up", au), ("grad_h", ah)],
                   [("grad_gate", adg), ("grad_up", adu)])
    cdef int64_t n = ag.size
    cdef float *pg = _f32(ag)
    cdef float *pu = _f32(au)
    cdef float *ph = _f32(ah)
    cdef float *pdg = _f32(adg)
    cdef float *pdu = _f32(adu)
    with nogil:
        _k.swiglu_backward_f32(n, pg, pu, ph, pdg, pdu)
    return <object>adg, <object>adu
