# cython: language_level=3
"""The row-normalisation kernels (RMSNorm, LayerNorm), callable on NumPy arrays.

x is float32 (..., dim): the rows are its last axis.  The forward passes save
per-row statistics (rstd, and mean for LayerNorm) that the backward passes take
back.  The backward passes write the input gradient and ADD the parameter
gradients, summed over fixed blocks of rows added in block order (the same
bits on any number of threads).  Every function checks its arguments and raises TypeError
or ValueError naming the argument before any memory is touched; the work runs
without the GIL.  The C-level forms are in ``kernels_norm.pxd``.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t

from ggmlopt cimport kernels as _k
from ggmlopt._kernel_args cimport as_array as _array
from ggmlopt._kernel_args cimport f32_ptr as _f32
from ggmlopt._kernel_args cimport finite_float as _finite_float
from ggmlopt._kernel_args cimport outputs_apart as _outputs_apart
from ggmlopt._kernel_args cimport same_size as _same_size

cnp.import_array()


cdef void rmsnorm_f32(int64_t nrows, int64_t dim, const float *x, const float *weight, float eps,
                      float *y, float *rstd) noexcept nogil:
    _k.rmsnorm_f32(nrows, dim, x, weight, eps, y, rstd)


cdef void rmsnorm_backward_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                               const float *rstd, const float *grad_y, float *grad_x,
                               float *grad_weight, float *work) noexcept nogil:
    _k.rmsnorm_backward_f32(nrows, dim, x, weight, rstd, grad_y, grad_x, grad_weight, work)


cdef void layernorm_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                        const float *bias, float eps, float *y, float *mean,
                        float *rstd) noexcept nogil:
    _k.layernorm_f32(nrows, dim, x, weight, bias, eps, y, mean, rstd)


cdef void layernorm_backward_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                                 const float *mean, const float *rstd, const float *grad_y,
                                 float *grad_x, float *grad_weight, float *grad_bias,
                                 float *work) noexcept nogil:
    _k.layernorm_backward_f32(nrows, dim, x, weight, mean, rstd, grad_y, grad_x, grad_weight,
                              grad_bias, work)


cdef int64_t norm_backward_work_size(int64_t nrows, int64_t dim) noexcept nogil:
    return _k.norm_backward_work_size(nrows, dim)


def norm_backward_workspace(nrows, dim):
    """The number of float32 elements of the workspace rmsnorm_backward and
    layernorm_backward need for nrows rows of dim when they compute a parameter
    gradient (0 otherwise: pass None).  A workspace of that size can be reused
    from call to call."""
    for name, v in (("nrows", nrows), ("dim", dim)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"{name}: expected >= 0, got {v}")
    return int(_k.norm_backward_work_size(nrows, dim))


cdef cnp.ndarray _workspace(object workspace, int64_t nrows, int64_t dim):
    """workspace as a writable float32 array of at least the size the backward
    passes need, 8-byte aligned (it holds double partial sums); allocated when
    None."""
    cdef int64_t need = _k.norm_backward_work_size(nrows, dim)
    if workspace is None:
        return np.empty(need, dtype=np.float32)
    cdef cnp.ndarray a = _array(workspace, "workspace", np.float32, True)
    if a.size < need:
        raise ValueError(f"workspace: expected at least {need} float32 elements "
                         f"(norm_backward_workspace), got {a.size}")
    if (<size_t>cnp.PyArray_DATA(a)) % 8 != 0:
        raise ValueError("workspace: expected an 8-byte aligned array")
    return a


cdef float _eps(object eps) except? -1:
    if isinstance(eps, bool):
        raise TypeError("eps: expected a real number, got bool")
    cdef float e = _finite_float(eps, "eps")
    if e < 0:
        raise ValueError(f"eps: expected >= 0, got {eps}")
    return e


cdef cnp.ndarray _rows(object x, str name, int64_t dim):
    """x as float32 (..., dim), C-contiguous."""
    cdef cnp.ndarray ax = _array(x, name, np.float32, False)
    if ax.ndim < 1 or ax.shape[ax.ndim - 1] != dim:
        raise ValueError(f"{name}: expected shape (..., {dim}) (dim = weight's size), got "
                         f"{(<object>ax).shape}")
    return ax


cdef cnp.ndarray _vector(object a, str name, int64_t n, bint writable):
    """a as float32 of n elements (any shape), C-contiguous."""
    cdef cnp.ndarray arr = _array(a, name, np.float32, writable)
    if arr.size != n:
        raise ValueError(f"{name}: expected {n} elements, got {arr.size}")
    return arr


cdef cnp.ndarray _weight(object weight, str name):
    cdef cnp.ndarray aw = _array(weight, name, np.float32, False)
    if aw.ndim != 1 or aw.size < 1:
        raise ValueError(f"{name}: expected shape (dim,) with dim >= 1, got "
                         f"{(<object>aw).shape}")
    return aw


cdef cnp.ndarray _out_like(object out, cnp.ndarray ax, str name):
    if out is None:
        out = np.empty((<object>ax).shape, dtype=np.float32)
    cdef cnp.ndarray ao = _array(out, name, np.float32, True)
    _same_size(ax, "x", ao, name)
    return ao


cdef cnp.ndarray _stats(object a, str name, int64_t nrows):
    if a is None:
        a = np.empty(nrows, dtype=np.float32)
    return _vector(a, name, nrows, True)


def rmsnorm(x, weight, eps=1e-6, out=None, rstd=None):
    """y = x / sqrt(mean(x^2, -1) + eps) * weight (torch.nn.RMSNorm), the mean
    of squares summed in double.

    x: float32 (..., dim); weight: float32 (dim,); eps: >= 0; out: float32 of
    x's size; rstd: float32 of nrows = x.size / dim elements, receives
    1/sqrt(mean(x^2) + eps) per row.  Those allocated when None.  Returns
    (out, rstd).
    """
    cdef cnp.ndarray aw = _weight(weight, "weight")
    cdef int64_t dim = aw.size
    cdef cnp.ndarray ax = _rows(x, "x", dim)
    cdef float e = _eps(eps)
    cdef int64_t nrows = ax.size // dim
    cdef cnp.ndarray ao = _out_like(out, ax, "out")
    cdef cnp.ndarray ar = _stats(rstd, "rstd", nrows)
    _outputs_apart([("x", ax), ("weight", aw)], [("out", ao), ("rstd", ar)])
    cdef float *px = _f32(ax)
    cdef float *pw = _f32(aw)
    cdef float *po = _f32(ao)
    cdef float *pr = _f32(ar)
    with nogil:
        _k.rmsnorm_f32(nrows, dim, px, pw, e, po, pr)
    return <object>ao, <object>ar


def rmsnorm_backward(x, weight, rstd, grad_y, grad_x=None, grad_weight=None, *,
                     input_grad=True, workspace=None):
    """The gradients of rmsnorm from its input x, weight, saved rstd and grad_y
    (float32, x's shape).

    grad_x = rstd * (g - xhat * mean(g * xhat)), g = grad_y * weight,
    xhat = x * rstd: written into grad_x (allocated when None), or skipped when
    input_grad is False.  grad_weight: float32 (dim,) or None; when given,
    ADDS sum over rows of grad_y * xhat, summed in blocks of rows that depend on
    the shape only and added in block order (the same bits on any number of
    threads).  workspace: float32 of norm_backward_workspace(nrows, dim)
    elements for those sums (allocated when None).  Returns grad_x (None when
    input_grad is False).
    """
    cdef cnp.ndarray aw = _weight(weight, "weight")
    cdef int64_t dim = aw.size
    cdef cnp.ndarray ax = _rows(x, "x", dim)
    cdef int64_t nrows = ax.size // dim
    cdef cnp.ndarray ar = _vector(rstd, "rstd", nrows, False)
    cdef cnp.ndarray ag = _array(grad_y, "grad_y", np.float32, False)
    _same_size(ax, "x", ag, "grad_y")
    outputs = []
    cdef cnp.ndarray adx = None
    cdef cnp.ndarray adw = None
    cdef cnp.ndarray awk = None
    if input_grad:
        adx = _out_like(grad_x, ax, "grad_x")
        outputs.append(("grad_x", adx))
    if grad_weight is not None:
        adw = _vector(grad_weight, "grad_weight", dim, True)
        outputs.append(("grad_weight", adw))
        awk = _workspace(workspace, nrows, dim)
        outputs.append(("workspace", awk))
    _outputs_apart([("x", ax), ("weight", aw), ("rstd", ar), ("grad_y", ag)], outputs)
    cdef float *px = _f32(ax)
    cdef float *pw = _f32(aw)
    cdef float *pr = _f32(ar)
    cdef float *pg = _f32(ag)
    cdef float *pdx = _f32(adx) if adx is not None else NULL
    cdef float *pdw = _f32(adw) if adw is not None else NULL
    cdef float *pwk = _f32(awk) if awk is not None else NULL
    with nogil:
        _k.rmsnorm_backward_f32(nrows, dim, px, pw, pr, pg, pdx, pdw, pwk)
    return <object>adx if adx is not None else None


def layernorm(x, weight, bias=None, eps=1e-5, out=None, mean=None, rstd=None):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last axis
    (torch.nn.LayerNorm: the biased variance), sums in double.

    x: float32 (..., dim); weight: float32 (dim,); bias: float32 (dim,) or None;
    eps: >= 0; out: float32 of x's size; mean, rstd: float32 of nrows =
    x.size / dim elements, receive each row's mean and 1/sqrt(var + eps).  Those
    allocated when None.  Returns (out, mean, rstd).
    """
    cdef cnp.ndarray aw = _weight(weight, "weight")
    cdef int64_t dim = aw.size
    cdef cnp.ndarray ab = None
    if bias is not None:
        ab = _vector(bias, "bias", dim, False)
    cdef cnp.ndarray ax = _rows(x, "x", dim)
    cdef float e = _eps(eps)
    cdef int64_t nrows = ax.size // dim
    cdef cnp.ndarray ao = _out_like(out, ax, "out")
    cdef cnp.ndarray am = _stats(mean, "mean", nrows)
    cdef cnp.ndarray ar = _stats(rstd, "rstd", nrows)
    inputs = [("x", ax), ("weight", aw)]
    if ab is not None:
        inputs.append(("bias", ab))
    _outputs_apart(inputs, [("out", ao), ("mean", am), ("rstd", ar)])
    cdef float *px = _f32(ax)
    cdef float *pw = _f32(aw)
    cdef float *pb = _f32(ab) if ab is not None else NULL
    cdef float *po = _f32(ao)
    cdef float *pm = _f32(am)
    cdef float *pr = _f32(ar)
    with nogil:
        _k.layernorm_f32(nrows, dim, px, pw, pb, e, po, pm, pr)
    return <object>ao, <object>am, <object>ar


def layernorm_backward(x, weight, mean, rstd, grad_y, grad_x=None, grad_weight=None,
                       grad_bias=None, *, input_grad=True, workspace=None):
    """The gradients of layernorm from its input x, weight, saved mean and rstd
    and grad_y (float32, x's shape).

    grad_x = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = grad_y * weight,
    xhat = (x - mean) * rstd: written into grad_x (allocated when None), or
    skipped when input_grad is False.  grad_weight, grad_bias: float32 (dim,) or
    None; when given, ADD the sums over rows of grad_y * xhat and of grad_y
    (summed as in rmsnorm_backward, in workspace).  Returns grad_x (None when
    input_grad is False).
    """
    cdef cnp.ndarray aw = _weight(weight, "weight")
    cdef int64_t dim = aw.size
    cdef cnp.ndarray ax = _rows(x, "x", dim)
    cdef int64_t nrows = ax.size // dim
    cdef cnp.ndarray am = _vector(mean, "mean", nrows, False)
    cdef cnp.ndarray ar = _vector(rstd, "rstd", nrows, False)
    cdef cnp.ndarray ag = _array(grad_y, "grad_y", np.float32, False)
    _same_size(ax, "x", ag, "grad_y")
    outputs = []
    cdef cnp.ndarray adx = None
    cdef cnp.ndarray adw = None
    cdef cnp.ndarray adb = None
    cdef cnp.ndarray awk = None
    if input_grad:
        adx = _out_like(grad_x, ax, "grad_x")
        outputs.append(("grad_x", adx))
    if grad_weight is not None:
        adw = _vector(grad_weight, "grad_weight", dim, True)
        outputs.append(("grad_weight", adw))
    if grad_bias is not None:
        adb = _vector(grad_bias, "grad_bias", dim, True)
        outputs.append(("grad_bias", adb))
    if adw is not None or adb is not None:
        awk = _workspace(workspace, nrows, dim)
        outputs.append(("workspace", awk))
    _outputs_apart([("x", ax), ("weight", aw), ("mean", am), ("rstd", ar), ("grad_y", ag)],
                   outputs)
    cdef float *px = _f32(ax)
    cdef float *pw = _f32(aw)
    cdef float *pm = _f32(am)
    cdef float *pr = _f32(ar)
    cdef float *pg = _f32(ag)
    cdef float *pdx = _f32(adx) if adx is not None else NULL
    cdef float *pdw = _f32(adw) if adw is not None else NULL
    cdef float *pdb = _f32(adb) if adb is not None else NULL
    cdef float *pwk = _f32(awk) if awk is not None else NULL
    with nogil:
        _k.layernorm_backward_f32(nrows, dim, px, pw, pm, pr, pg, pdx, pdw, pdb, pwk)
    return <object>adx if adx is not None else None
