# cython: language_level=3
"""The embedding kernels, callable on NumPy arrays: gather rows of a weight
matrix by int32 ids, and scatter-add gradient rows back (exact and
deterministic with repeated ids, threads included).

Every function checks its arguments (dtype, C-contiguity, shapes, writability,
overlap, ids in range) and raises TypeError, ValueError or IndexError naming the
argument before any memory is touched; the work then runs without the GIL.  The
C-level forms are in ``kernels_embedding.pxd``.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t

from ggmlopt cimport kernels as _k
from ggmlopt._kernel_args cimport as_array as _array
from ggmlopt._kernel_args cimport f32_ptr as _f32
from ggmlopt._kernel_args cimport outputs_apart as _outputs_apart

cnp.import_array()


cdef void embedding_f32(int64_t n, int64_t dim, const int32_t *ids, const float *weight,
                        float *out) noexcept nogil:
    _k.embedding_f32(n, dim, ids, weight, out)


cdef void embedding_backward_f32(int64_t n, int64_t dim, const int32_t *ids, const float *grad,
                                 int64_t num, float *grad_weight) noexcept nogil:
    _k.embedding_backward_f32(n, dim, ids, grad, num, grad_weight)


cdef int64_t first_bad_id(int64_t n, const int32_t *ids, int64_t num) noexcept nogil:
    """The position of the first id outside [0, num), or -1."""
    cdef int64_t i
    for i in range(n):
        if ids[i] < 0 or ids[i] >= num:
            return i
    return -1


cdef check_ids(cnp.ndarray ids, int64_t num, str name):
    """IndexError naming the first id outside [0, num) and its position in ids."""
    cdef int64_t bad
    with nogil:
        bad = first_bad_id(ids.size, <int32_t *>cnp.PyArray_DATA(ids), num)
    if bad >= 0:
        pos = np.unravel_index(bad, (<object>ids).shape)
        raise IndexError(f"{name}: id {int(ids.reshape(-1)[bad])} at position "
                         f"{tuple(int(p) for p in pos)} is out of range; expected ids in "
                         f"[0, {num})")


cdef cnp.ndarray _weight(object weight, str name, bint writable):
    cdef cnp.ndarray aw = _array(weight, name, np.float32, writable)
    if aw.ndim != 2:
        raise ValueError(f"{name}: expected shape (num_embeddings, embedding_dim), got "
                         f"{(<object>aw).shape}")
    return aw


def embedding(ids, weight, out=None):
    """out[..., :] = weight[ids[...], :].

    ids: int32, any shape (...), every id in [0, num) (else IndexError naming the
    first bad id and its position); weight: float32 (num, dim); out: float32
    (..., dim), allocated when None.  Returns out.
    """
    cdef cnp.ndarray ai = _array(ids, "ids", np.int32, False)
    cdef cnp.ndarray aw = _weight(weight, "weight", False)
    cdef int64_t num = aw.shape[0], dim = aw.shape[1]
    shape = (<object>ai).shape + (dim,)
    if out is None:
        out = np.empty(shape, dtype=np.float32)
    cdef cnp.ndarray ao = _array(out, "out", np.float32, True)
    if (<object>ao).shape != shape:
        raise ValueError(f"out: expected shape {shape}, got {(<object>ao).shape}")
    _outputs_apart([("ids", ai), ("weight", aw)], [("out", ao)])
    check_ids(ai, num, "ids")
    cdef int64_t n = ai.size
    cdef const int32_t *pi = <int32_t *>cnp.PyArray_DATA(ai)
    cdef float *pw = _f32(aw)
    cdef float *po = _f32(ao)
    with nogil:
        _k.embedding_f32(n, dim, pi, pw, po)
    return out


def embedding_backward(ids, grad, grad_weight):
    """grad_weight[ids[...], :] += grad[..., :], every row's contributions added
    in the order of the ids (the same bits on any number of threads).

    ids: int32 (...), every id in [0, num); grad: float32 (..., dim);
    grad_weight: float32 (num, dim), written in place.  Returns grad_weight.
    """
    cdef cnp.ndarray ai = _array(ids, "ids", np.int32, False)
    cdef cnp.ndarray ag = _array(grad, "grad", np.float32, False)
    cdef cnp.ndarray aw = _weight(grad_weight, "grad_weight", True)
    cdef int64_t num = aw.shape[0], dim = aw.shape[1]
    shape = (<object>ai).shape + (dim,)
    if (<object>ag).shape != shape:
        raise ValueError(f"grad: expected shape {shape} (ids' shape + (dim,)), got "
                         f"{(<object>ag).shape}")
    _outputs_apart([("ids", ai), ("grad", ag)], [("grad_weight", aw)])
    check_ids(ai, num, "ids")
    cdef int64_t n = ai.size
    cdef const int32_t *pi = <int32_t *>cnp.PyArray_DATA(ai)
    cdef float *pg = _f32(ag)
    cdef float *pw = _f32(aw)
    with nogil:
        _k.embedding_backward_f32(n, dim, pi, pg, num, pw)
    return grad_weight
