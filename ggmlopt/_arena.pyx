# cython: language_level=3
"""ParamArena: every parameter of a model, its gradients and AdamW momenta in one
aligned block, updated by one kernel call per optimizer step.

Layout: consecutive sections of ``section`` floats (``size`` rounded up to 16,
so each section starts on a 64-byte line): weights, the gradient of the current
physical batch, then (when accumulating over several physical batches, as ggml's
grad_accs) the gradient accumulator, then (for AdamW) the first and second
moments.  Parameters sit back to back inside each section, so one parameter is
the same element range in every section.  The padding at the end of a section is
never touched by a kernel.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t

from ggmlopt._memory cimport AlignedBuffer
from libc.math cimport sqrt

from ggmlopt.kernels cimport (adamw_step_f32, axpy_f32, fill_f32, scale_f32, sgd_step_f32,
                              sumsq_f32)

cnp.import_array()

_SECTIONS = ("weights", "grads", "accumulator", "m", "v")


cdef class ParamArena:
    """ParamArena(size, accumulate=False, momenta=False)

    size: parameter elements (>= 1).  accumulate: keep a gradient accumulator
    apart from the per-batch gradient.  momenta: keep AdamW's m and v.
    All sections start zeroed.
    """

    def __cinit__(self, int64_t size, bint accumulate=False, bint momenta=False):
        if size < 1:
            raise ValueError(f"size: expected at least 1 parameter element, got {size}")
        self.size = size
        self.section = (size + 15) // 16 * 16
        self.accumulate = accumulate
        self.momenta = momenta
        cdef int64_t nsections = 2 + (1 if accumulate else 0) + (2 if momenta else 0)
        self._buf = AlignedBuffer(nsections * self.section * sizeof(float))
        cdef float *base = <float *>self._buf.data
        self._w = base
        self._g = base + self.section
        base = self._g + self.section
        self._acc = NULL
        self._m = NULL
        self._v = NULL
        if accumulate:
            self._acc = base
            base += self.section
        if momenta:
            self._m = base
            self._v = base + self.section

    # ---- C level ----------------------------------------------------------------

    cdef float *step_grads(self) noexcept nogil:
        """The gradient an optimizer step uses: the accumulator when there is one."""
        return self._acc if self._acc != NULL else self._g

    cdef void zero_grads_c(self) noexcept nogil:
        fill_f32(self.size, 0.0, self._g)

    cdef void zero_accumulator_c(self) noexcept nogil:
        if self._acc != NULL:
            fill_f32(self.size, 0.0, self._acc)

    cdef void accumulate_c(self) noexcept nogil:
        if self._acc != NULL:
            axpy_f32(self.size, 1.0, self._g, self._acc)

    cdef void zero_momenta_c(self) noexcept nogil:
        if self._m != NULL:
            fill_f32(self.size, 0.0, self._m)
            fill_f32(self.size, 0.0, self._v)

    cdef void adamw_step_c(self, const float *params) noexcept nogil:
        adamw_step_f32(self.size, self._w, self.step_grads(), self._m, self._v, params)

    cdef void sgd_step_c(self, float alpha, float wd) noexcept nogil:
        sgd_step_f32(self.size, self._w, self.step_grads(), alpha, wd)

    cdef double clip_grad_norm_c(self, double max_norm) noexcept nogil:
        # torch.nn.utils.clip_grad_norm_'s rule: one sum-of-squares pass over the
        # whole step gradient, then one scale when the global norm is too large
        cdef float *g = self.step_grads()
        cdef double norm = sqrt(sumsq_f32(self.size, g))
        if norm > max_norm:
            scale_f32(self.size, <float>(max_norm / (norm + 1e-6)), g)
        return norm

    # ---- Python level -----------------------------------------------------------

    cdef int64_t _offset(self, str which) except -1:
        cdef float *p
        if which == "weights":
            p = self._w
        elif which == "grads":
            p = self._g
        elif which == "accumulator":
            p = self._acc
        elif which == "m":
            p = self._m
        elif which == "v":
            p = self._v
        else:
            raise ValueError(f"which: expected one of {_SECTIONS}, got {which!r}")
        if p == NULL:
            raise ValueError(f"which: this arena has no {which!r} section")
        return (<char *>p) - self._buf.data

    def view(self, str which, int64_t start, tuple shape):
        """A writable float32 view of `shape` starting at element `start` of the
        section `which` ('weights', 'grads', 'accumulator', 'm', 'v'); it keeps the
        arena's memory alive."""
        cdef int64_t count = 1
        for d in shape:
            count *= d
        if start < 0 or start + count > self.size:
            raise ValueError(f"elements [{start}, {start + count}) lie outside the arena's "
                             f"{self.size} parameter elements")
        return self._buf.view(np.float32, shape, self._offset(which) + start * sizeof(float))

    def flat(self, str which):
        """The whole section `which` as a flat float32 view of `size` elements."""
        return self.view(which, 0, (self.size,))

    def zero_grads(self):
        """Zero the per-batch gradient."""
        with nogil:
            self.zero_grads_c()

    def zero_accumulator(self):
        """Zero the gradient accumulator (nothing without one)."""
        with nogil:
            self.zero_accumulator_c()

    def accumulate_grads(self):
        """accumulator += per-batch gradient (nothing without an accumulator)."""
        with nogil:
            self.accumulate_c()

    def zero_momenta(self):
        """Zero AdamW's m and v (nothing without them)."""
        with nogil:
            self.zero_momenta_c()

    def adamw_step(self, float alpha, float beta1, float beta2, float eps, float wd,
                   float beta1h, float beta2h):
        """One AdamW step over every parameter, with the accumulated gradient when
        there is an accumulator; see ggmlopt.kernels.adamw_step for the formula."""
        if self._m == NULL:
            raise RuntimeError("adamw_step: this arena was built without AdamW momenta")
        cdef float params[7]
        params[0] = alpha
        params[1] = beta1
        params[2] = beta2
        params[3] = eps
        params[4] = wd
        params[5] = beta1h
        params[6] = beta2h
        with nogil:
            self.adamw_step_c(params)

    def sgd_step(self, float alpha, float wd):
        """w = w*(1 - alpha*wd) - alpha*g over every parameter."""
        with nogil:
            self.sgd_step_c(alpha, wd)

    def grad_sumsq(self):
        """Sum of squares of the gradient an optimizer step would use (double)."""
        cdef double s
        with nogil:
            s = sumsq_f32(self.size, self.step_grads())
        return s

    def clip_grad_norm(self, double max_norm):
        """Clip the gradient an optimizer step would use to global L2 norm
        max_norm: when norm = sqrt(sum(g^2)) > max_norm, g *= max_norm / (norm + 1e-6).
        Returns the norm before clipping (float)."""
        cdef double norm
        with nogil:
            norm = self.clip_grad_norm_c(max_norm)
        return norm

    @property
    def nbytes(self):
        return self._buf.nbytes
