"""Parameter: a float32 array of a model, its gradient, and whether it trains."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ._parts_version import parts_changed

__all__ = ["Parameter"]


class Parameter:
    """Parameter(data, name=None, *, requires_grad=True): a float32 array of a model.

    data: a float32 C-contiguous copy of the given array (any real dtype, any
    shape).  Assigning ``p.data = a`` later takes ``a`` itself (no copy) and
    requires a float32 C-contiguous ndarray of ``p.shape``: an array of another
    shape (e.g. a weight in torch's ``(out, in)`` layout where ggmlopt's
    ``Linear`` keeps ``(in, out)``) raises ValueError, another dtype TypeError,
    at the assignment rather than later inside a matrix product.  A parameter
    that an OptContext trains takes an assigned array's values into the
    context's memory at its next alloc, and data is the context's array again
    (later writes into ``a`` are not seen: write into ``p.data[...]`` instead).

    grad: float32 zeros of data's shape; backward passes add into it.  None
    while the parameter is frozen (as torch's ``.grad`` of a tensor that does
    not require a gradient).  It is made when first used (a backward pass, an
    OptContext's arena), so a model that only infers holds no gradient memory.
    grad_is_zero: True while grad is known to hold zeros (OptContext sets it after
    zeroing the gradients); a layer that sees it may overwrite grad instead of
    adding into it, and then clears it.

    requires_grad: True (the default) for a parameter that trains.  False
    freezes it: the layers compute no gradient for it (they still return the
    gradient of their input), ``grad`` is None, and an OptContext gives it no
    gradient or optimizer memory, leaves its data where it is and never changes
    it (fine-tuning a part of a model).  Setting it back to True gives a fresh
    zero gradient.  Change it before building the OptContext: a context refuses
    to run once the split it was built with has changed.
    """

    __slots__ = ("_data", "_grad", "_grad_cleared", "_lender", "_requires_grad",
                 "grad_is_zero", "name")
    _grad: np.ndarray | None

    # how many times any parameter's requires_grad changed: an OptContext compares
    # it on every alloc and checks its own parameters only when it moved
    _requires_grad_changes = 0
    # how many times any parameter's data or grad was assigned: likewise (an array
    # assigned is not the arena's view the context steps; a grad set to None, as
    # torch's zero_grad(set_to_none=True) does, is a zero gradient)
    _storage_changes = 0

    def __init__(self, data, name=None, *, requires_grad=True):
        arr = np.asarray(data)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"data: expected real numbers, got dtype {arr.dtype}")
        if not isinstance(requires_grad, (bool, np.bool_)):
            raise TypeError(f"requires_grad: expected a bool, got {type(requires_grad).__name__}")
        self._data = np.array(arr, dtype=np.float32, order="C", copy=True)
        self._requires_grad = bool(requires_grad)
        self._grad = None   # made on first use (the grad property)
        self._grad_cleared = False   # grad = None assigned (a zero gradient)
        # what makes it instead of np.zeros: an OptContext that steps each parameter
        # in the backward pass lends gradients from a pool (ggmlopt.step_in_backward)
        self._lender = None
        self.name = name
        self.grad_is_zero = True

    def __getstate__(self):
        """A copy's state (pickle, copy.deepcopy), as Python's own for a class
        with slots, (a subclass's __dict__ or None, {slot: value}): without the
        lender (a context's gradient pool, which the copy is not in, and which
        does not pickle)."""
        slots = {k: getattr(self, k) for k in Parameter.__slots__
                 if k != "_lender" and hasattr(self, k)}
        return getattr(self, "__dict__", None) or None, slots

    def __setstate__(self, state):
        # (also a pickle written before __getstate__ existed: the same pair)
        own, slots = state if isinstance(state, tuple) else (None, state)
        if own:
            self.__dict__.update(own)
        for k, v in (slots or {}).items():
            object.__setattr__(self, k, v)
        self._lender = None
        if "_grad_cleared" not in (slots or {}):
            self._grad_cleared = False

    @classmethod
    def zeros(cls, shape, name=None, *, requires_grad=True) -> Parameter:
        """A Parameter of zeros of shape, made without touching its memory: the
        pages are the system's zero pages until first written (a layer built
        under ``ggmlopt.nn.init.skip_init()`` whose weight a loader replaces
        costs no memory)."""
        p = cls(np.zeros(0, np.float32), name, requires_grad=requires_grad)
        p._data = np.zeros(shape, np.float32)
        return p

    @property
    def data(self) -> np.ndarray:
        """The values: a float32 C-contiguous array (see the class docstring for
        what an assignment accepts)."""
        return self._data

    @data.setter
    def data(self, value) -> None:
        if not isinstance(value, np.ndarray):
            raise TypeError(f"data: expected a numpy.ndarray, got {type(value).__name__}")
        if value.shape != self._data.shape:
            hint = (" (ggmlopt's Linear keeps weights as (in, out), the transpose of torch's)"
                    if value.ndim == 2 and value.shape == self._data.shape[::-1] else "")
            raise ValueError(f"data{self._label()}: expected shape {self._data.shape}, got "
                             f"{value.shape}{hint}")
        if value.dtype != np.float32:
            raise TypeError(f"data{self._label()}: expected float32, got {value.dtype}")
        if not value.flags.c_contiguous:
            raise ValueError(f"data{self._label()}: expected a C-contiguous array (use "
                             "numpy.ascontiguousarray)")
        self._data = value
        Parameter._storage_changes += 1
        parts_changed()   # a decode step that read the old array reads again

    @property
    def grad(self) -> np.ndarray | None:
        """The gradient (see the class docstring): zeros of data's shape, made on
        first use, or None while frozen."""
        if self._grad is None and self._requires_grad:
            if self._lender is not None:
                self._grad = self._lender(self)
            else:
                # np.zeros maps fresh zero pages: memory is committed only where written
                self._grad = np.zeros(self._data.shape, np.float32)
        return self._grad

    @grad.setter
    def grad(self, value: np.ndarray | None) -> None:
        self._grad = value
        self._grad_cleared = value is None
        Parameter._storage_changes += 1

    def _swap_data(self, data: np.ndarray) -> None:
        """Point data at another array for a moment and back (no checks, not an
        assignment an OptContext acts on: internal)."""
        self._data = data
        parts_changed()

    def _set_storage(self, data: np.ndarray, grad: np.ndarray | None,
                     lender: Callable[[Parameter], np.ndarray] | None = None) -> None:
        """Re-point data and grad at other memory of the same shape and dtype, as
        an OptContext does with its arena's views; lender, when given, makes the
        gradient on its first use after grad is None (no checks: internal)."""
        self._data = data
        self._grad = grad
        self._grad_cleared = False
        self._lender = lender
        parts_changed()

    @property
    def requires_grad(self) -> bool:
        """Whether the parameter trains (see the class docstring)."""
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value) -> None:
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"requires_grad: expected a bool, got {type(value).__name__}")
        value = bool(value)
        if value == self._requires_grad:
            return
        self._requires_grad = value
        self._grad = None   # a fresh zero gradient when next used
        self.grad_is_zero = True
        Parameter._requires_grad_changes += 1

    @property
    def shape(self):
        """The shape of data."""
        return self._data.shape

    @property
    def size(self):
        """The number of elements of data."""
        return self._data.size

    def _label(self):
        return f" of {self.name!r}" if self.name else ""

    def __repr__(self):
        label = f" {self.name!r}" if self.name else ""
        frozen = ", requires_grad=False" if not self._requires_grad else ""
        return f"Parameter{label}(shape={self._data.shape}, dtype={self._data.dtype}{frozen})"
