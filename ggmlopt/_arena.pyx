# cython: language_level=3
"""ParamArena: every parameter of a model, its gradients and its optimizer's state
(AdamW's momenta) in one aligned block, updated by one kernel call per optimizer
step.

Layout: consecutive sections of ``section`` floats (``size``, or
``min_section`` when larger, rounded up to 16, so each section starts on a
64-byte line): weights, gradients, then the optimizer's state arrays in the
order it names them (AdamW: the first and second moments, 'm' and 'v'; see
ggmlopt.optimizers).  Backward passes add into the gradients, so they
accumulate over the physical batches of a logical batch in place (ggml's
grad_accs) until the context zeroes them.

Parameters sit back to back inside each section, so one parameter is
the same element range in every section.  The padding at the end of a section is
never touched by a kernel.

An arena built with ``grads=False`` has no gradient section (the weights are
followed by the optimizer's state): a context that steps each parameter as
soon as its gradient is final (``optimizer_in_backward``) lends gradients from
a small pool instead of keeping one for every parameter.
"""
import numpy as np

cimport numpy as cnp
from libc.math cimport sqrt
from libc.stdint cimport int64_t

from ggmlopt._kernel_args cimport adamw_params, count, finite_float, real_number
from ggmlopt._memory cimport AlignedBuffer
from ggmlopt.kernels cimport adamw_step_f32, fill_f32, scale_f32, sgd_step_f32, sumsq_f32

cnp.import_array()

_ADAMW_STATE = ("m", "v")
# the most bytes an arena holds (as the dataset's shards): sizes past it wrap
_MAX_BYTES = 1 << 62


cdef class ParamArena:
    """ParamArena(size, momenta=False, min_section=0, state=None, grads=True)

    size: parameter elements (>= 1).  momenta: keep AdamW's m and v (the same
    as state=('m', 'v')).  state: the names of the optimizer's state sections
    (a tuple of distinct str, none of them 'weights' or 'grads'), each as large
    as the weights.  min_section: floats per section at least
    (ggmlopt.distributed pads the sections so that P equal shards cover them);
    the padding stays zero.  grads: keep a gradient section (False: none; the
    gradient methods then raise RuntimeError).  All sections start zeroed.
    """

    def __cinit__(self, size, bint momenta=False, min_section=0,
                  state=None, bint grads=True):
        size, min_section = count(size, "size"), count(min_section, "min_section")
        if size < 1:
            raise ValueError(f"size: expected at least 1 parameter element, got {size}")
        if state is None:
            state = _ADAMW_STATE if momenta else ()
        if not isinstance(state, tuple) or not all(isinstance(n, str) and n for n in state):
            raise TypeError(f"state: expected a tuple of section names (str), got {state!r}")
        if len(set(state)) != len(state) or {"weights", "grads"} & set(state):
            raise ValueError(f"state: expected distinct names other than 'weights' and "
                             f"'grads', got {state!r}")
        if momenta and state != _ADAMW_STATE:
            raise ValueError(f"momenta: AdamW's state is ('m', 'v'), got state={state!r}")
        section = (max(size, min_section) + 15) // 16 * 16
        nsections_wanted = 1 + (1 if grads else 0) + len(state)
        # Python ints: a product that wraps int64 would size a buffer of nothing
        if section * nsections_wanted * 4 > _MAX_BYTES:
            raise ValueError(f"size: {nsections_wanted} sections of {section} floats exceed "
                             f"{_MAX_BYTES} bytes")
        self.size = size
        self.section = section
        self.state_names = state
        self.nstate = len(state)
        self.momenta = len(state) > 0
        self.has_grads = grads
        cdef int64_t nsections = 1 + (1 if grads else 0) + len(state)
        self._buf = AlignedBuffer(nsections * self.section * sizeof(float))
        cdef float *base = <float *>self._buf.data
        self._w = base
        self._g = base + self.section if grads else NULL
        self._state = base + (2 if grads else 1) * self.section
        self._m = NULL
        self._v = NULL
        if state == _ADAMW_STATE:
            self._m = self._state
            self._v = self._m + self.section

    # ---- C level ----------------------------------------------------------------

    cdef void zero_grads_c(self) noexcept nogil:
        if self._g != NULL:
            fill_f32(self.size, 0.0, self._g)

    cdef void zero_momenta_c(self) noexcept nogil:
        # every state section: back to back after the weights and gradients
        cdef int64_t k
        for k in range(self.nstate):
            fill_f32(self.size, 0.0, self._state + k * self.section)

    # without a gradient section the gradient methods do nothing (C callers check
    # has_grads; the Python methods raise)
    cdef void adamw_step_c(self, const float *params) noexcept nogil:
        if self._g == NULL or self._m == NULL:
            return
        adamw_step_f32(self.size, self._w, self._g, self._m, self._v, params)

    cdef void sgd_step_c(self, float alpha, float wd) noexcept nogil:
        if self._g == NULL:
            return
        sgd_step_f32(self.size, self._w, self._g, alpha, wd)

    cdef double clip_grad_norm_c(self, double max_norm) noexcept nogil:
        # torch.nn.utils.clip_grad_norm_'s rule: one sum-of-squares pass over the
        # whole gradient section, then one scale by min(1, max / (norm + 1e-6)),
        # which is below 1 from norm > max - 1e-6 on, as torch's clamp has it
        if self._g == NULL:
            return 0.0
        cdef double norm = sqrt(sumsq_f32(self.size, self._g))
        # (written as "not within": a NaN norm scales by NaN, as torch's clamp does)
        if not (norm + 1e-6 <= max_norm):
            scale_f32(self.size, <float>(max_norm / (norm + 1e-6)), self._g)
        return norm

    # ---- Python level -----------------------------------------------------------

    cdef int64_t _offset(self, str which) except -1:
        cdef int64_t k
        cdef int64_t first_state = 2 if self.has_grads else 1
        if which == "weights":
            k = 0
        elif which == "grads" and self.has_grads:
            k = 1
        elif which == "grads":
            raise ValueError("which: this arena has no gradient section (built with "
                             "grads=False)")
        elif which in self.state_names:
            k = first_state + self.state_names.index(which)
        elif which in ("m", "v"):
            raise ValueError(f"which: this arena has no {which!r} section")
        else:
            raise ValueError(f"which: expected one of "
                             f"{('weights', 'grads') + self.state_names}, got {which!r}")
        return k * self.section * sizeof(float)

    def view(self, str which, start, tuple shape):
        """A writable float32 view of `shape` starting at element `start` of the
        section `which` ('weights', 'grads', or one of state_names); it keeps the
        arena's memory alive."""
        start = count(start, "start")
        elements = 1   # Python ints: no product or sum wraps
        for d in shape:
            elements *= count(d, "shape")
        if start + elements > self.size:
            raise ValueError(f"elements [{start}, {start + elements}) lie outside the "
                             f"arena's {self.size} parameter elements")
        cdef int64_t offset = self._offset(which) + <int64_t>start * sizeof(float)
        return self._buf.view(np.float32, shape, offset)

    def flat(self, str which):
        """The whole section `which` as a flat float32 view of `size` elements."""
        return self.view(which, 0, (self.size,))

    def padded(self, str which):
        """The whole section `which`, padding included: a flat float32 view of
        `section` elements (collectives over equal shards of the arena)."""
        return self._buf.view(np.float32, (self.section,), self._offset(which))

    def _need_grads(self, str what):
        if not self.has_grads:
            raise RuntimeError(f"{what}: this arena has no gradient section (built with "
                               "grads=False)")

    def zero_grads(self):
        """Zero the per-batch gradient."""
        with nogil:
            self.zero_grads_c()

    def zero_momenta(self):
        """Zero the optimizer's state (AdamW's m and v; nothing without state)."""
        with nogil:
            self.zero_momenta_c()

    def adamw_step(self, alpha, beta1, beta2, eps, wd, beta1h, beta2h):
        """One AdamW step over every parameter; see ggmlopt.kernels.adamw_step for
        the formula.  ValueError for a parameter that is not a finite float32."""
        if self._m == NULL:
            raise RuntimeError("adamw_step: this arena was built without AdamW momenta")
        self._need_grads("adamw_step")
        cdef float params[7]
        adamw_params(params, alpha, beta1, beta2, eps, wd, beta1h, beta2h)
        with nogil:
            self.adamw_step_c(params)

    def sgd_step(self, alpha, wd):
        """w = w*(1 - alpha*wd) - alpha*g over every parameter.  ValueError for a
        parameter that is not a finite float32."""
        self._need_grads("sgd_step")
        cdef float a = finite_float(alpha, "alpha"), w = finite_float(wd, "wd")
        with nogil:
            self.sgd_step_c(a, w)

    def grad_sumsq(self):
        """Sum of squares of all gradients (double)."""
        cdef double s
        self._need_grads("grad_sumsq")
        with nogil:
            s = sumsq_f32(self.size, self._g)
        return s

    def clip_grad_norm(self, max_norm):
        """Clip the gradients to global L2 norm max_norm (>= 0, inf allowed): when
        norm = sqrt(sum(g^2)) > max_norm - 1e-6, g *= max_norm / (norm + 1e-6)
        (torch's clip_grad_norm_).
        Returns the norm before clipping (float)."""
        cdef double norm
        cdef double most = real_number(max_norm, "max_norm")
        if not (most >= 0.0):   # inf clips nothing (the norm alone), as torch's
            raise ValueError(f"max_norm: expected a number >= 0 (inf: no clipping), got "
                             f"{max_norm!r}")
        self._need_grads("clip_grad_norm")
        with nogil:
            norm = self.clip_grad_norm_c(most)
        return norm

    @property
    def nbytes(self):
        return self._buf.nbytes
