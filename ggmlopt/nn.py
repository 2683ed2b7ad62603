"""Layers for the model protocol: Parameter, Linear, ReLU, Sequential.

A model is any object with ``parameters()``, ``forward(x)`` and
``backward(grad_out)``; ``backward`` ADDS d loss / d parameter into each
``Parameter.grad``.  The layers here do their matrix products with NumPy's BLAS,
write into buffers they allocate once per batch size, and always read
``Parameter.data`` / ``.grad`` at call time, so an OptContext can re-point them
at its arena.
"""
from __future__ import annotations

import math

import numpy as np

from . import kernels

__all__ = ["Linear", "Module", "Parameter", "ReLU", "Sequential"]


class Parameter:
    """Parameter(data, name=None): a trainable float32 array.

    data: a float32 copy of the given array (any real dtype, any shape).
    grad: float32 zeros of the same shape; backward passes add into it.
    grad_is_zero: True while grad is known to hold zeros (OptContext sets it after
    zeroing the gradients); a layer that sees it may overwrite grad instead of
    adding into it, and then clears it.
    """

    __slots__ = ("data", "grad", "grad_is_zero", "name")

    def __init__(self, data, name=None):
        arr = np.asarray(data)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"data: expected real numbers, got dtype {arr.dtype}")
        self.data = np.array(arr, dtype=np.float32, order="C", copy=True)
        self.grad = np.zeros_like(self.data)
        self.name = name
        self.grad_is_zero = True

    @property
    def shape(self):
        return self.data.shape

    @property
    def size(self):
        return self.data.size

    def __repr__(self):
        label = f" {self.name!r}" if self.name else ""
        return f"Parameter{label}(shape={self.data.shape}, dtype={self.data.dtype})"


def _add_into(param: Parameter, compute, scratch_owner, key):
    """Put compute(out) into param.grad: written straight in when the gradient is
    known to be zero, else computed into a scratch buffer and added."""
    grad = param.grad
    if param.grad_is_zero:
        compute(grad)
        param.grad_is_zero = False
        return
    scratch = scratch_owner._scratch.get(key)
    if scratch is None or scratch.shape != grad.shape:
        scratch = np.empty(grad.shape, dtype=np.float32)
        scratch_owner._scratch[key] = scratch
    compute(scratch)
    np.add(grad, scratch, out=grad)


class Module:
    """Base of the layers.  needs_input_grad: whether backward must return the
    gradient w.r.t. the input (Sequential clears it for its first layer, whose
    input is data)."""

    needs_input_grad = True

    def parameters(self):
        return []

    def forward(self, x):
        raise NotImplementedError

    def backward(self, grad_out):
        raise NotImplementedError

    def __call__(self, x):
        return self.forward(x)


def _as_batch(x, ncols: int, name: str) -> np.ndarray:
    """x as a 2-D float32 array (batch, ncols); copies only when dtype differs."""
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != ncols:
        raise ValueError(f"{name}: expected shape (batch, {ncols}), got {x.shape}")
    if x.dtype != np.float32:
        if x.dtype.kind not in "biuf":
            raise TypeError(f"{name}: expected real numbers, got dtype {x.dtype}")
        x = x.astype(np.float32)
    return x


def kaiming_uniform(weight: np.ndarray, bias, rng: np.random.Generator) -> None:
    """torch.nn.Linear's default: weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    fan_in = weight.shape[0] (weight is (in_features, out_features)).  Fills the
    arrays in place."""
    fan_in = weight.shape[0]
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    weight[...] = rng.uniform(-bound, bound, size=weight.shape)
    if bias is not None:
        bias[...] = rng.uniform(-bound, bound, size=bias.shape)


class Linear(Module):
    """Linear(in_features, out_features, bias=True, *, init=None, rng=None)

    y = x @ weight + bias, x: (batch, in_features) -> y: (batch, out_features).
    weight: Parameter (in_features, out_features) (the transpose of torch's
    layout, which makes both BLAS calls of a training step faster), bias:
    Parameter (out_features,).
    init(weight, bias, rng) fills the float32 arrays in place (bias None without
    one); default kaiming_uniform (torch's default).  rng: None, an int seed or a
    numpy Generator; a fixed seed makes the initialisation reproducible.
    """

    def __init__(self, in_features, out_features, bias=True, *, init=None, rng=None):
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name}: expected >= 1, got {v}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        w = np.zeros((self.in_features, self.out_features), dtype=np.float32)
        b = np.zeros(self.out_features, dtype=np.float32) if bias else None
        (init or kaiming_uniform)(w, b, gen)
        self.weight = Parameter(w, name="weight")
        self.bias = Parameter(b, name="bias") if bias else None
        self._batch = -1
        self._x = None
        self._scratch = {}

    def parameters(self):
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def _buffers(self, batch):
        self._out = np.empty((batch, self.out_features), dtype=np.float32)
        self._grad_in = np.empty((batch, self.in_features), dtype=np.float32)
        self._ones = np.ones(batch, dtype=np.float32)  # bias gradient as one gemv
        self._batch = batch

    def forward(self, x):
        """x: (batch, in_features) -> (batch, out_features) float32 (a buffer this
        layer reuses: the next forward overwrites it)."""
        x = _as_batch(x, self.in_features, "x")
        if x.shape[0] != self._batch:
            self._buffers(x.shape[0])
        out = self._out
        np.matmul(x, self.weight.data, out=out)
        if self.bias is not None:
            kernels.add_bias_rows(out, self.bias.data)
        self._x = x
        return out

    def backward(self, grad_out):
        """grad_out: (batch, out_features) float32.  Adds into weight.grad and
        bias.grad; returns d loss / d x (batch, in_features), or None when
        needs_input_grad is False."""
        if self._x is None:
            raise RuntimeError("backward: call forward first")
        g = _as_batch(grad_out, self.out_features, "grad_out")
        if g.shape[0] != self._batch:
            raise ValueError(f"grad_out: expected {self._batch} rows like the last forward "
                             f"input, got {g.shape[0]}")
        x = self._x
        _add_into(self.weight, lambda out: np.matmul(x.T, g, out=out), self, "weight")
        if self.bias is not None:
            ones = self._ones
            _add_into(self.bias, lambda out: np.matmul(ones, g, out=out), self, "bias")
        if not self.needs_input_grad:
            return None
        np.matmul(g, self.weight.data.T, out=self._grad_in)
        return self._grad_in

    def __repr__(self):
        return (f"Linear(in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None})")


class ReLU(Module):
    """y = x > 0 ? x : 0 elementwise (NaN stays NaN, so it reaches the loss and
    stops training); the gradient is
    passed where y > 0 (0 at x == 0, as ggml's step function).  Both directions
    are single kernel passes."""

    def __init__(self):
        self._shape = None
        self._out = None

    def forward(self, x):
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape != self._shape:
            self._out = np.empty(x.shape, dtype=np.float32)
            self._grad_in = np.empty(x.shape, dtype=np.float32)
            self._shape = x.shape
        return kernels.relu(x, out=self._out)

    def backward(self, grad_out):
        if self._out is None:
            raise RuntimeError("backward: call forward first")
        if not self.needs_input_grad:
            return None
        g = np.ascontiguousarray(grad_out, dtype=np.float32)
        if g.shape != self._shape:
            raise ValueError(f"grad_out: expected shape {self._shape} like the last forward "
                             f"output, got {g.shape}")
        return kernels.relu_backward(self._out, g, out=self._grad_in)

    def __repr__(self):
        return "ReLU()"


class Sequential(Module):
    """Sequential(*layers): forward through the layers in order, backward in reverse.

    As a top-level model it does not compute the gradient w.r.t. its input (the
    data); nested inside another Sequential the parent decides.
    """

    def __init__(self, *layers):
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        if not layers:
            raise ValueError("layers: expected at least one layer")
        for i, layer in enumerate(layers):
            for method in ("forward", "backward"):
                if not callable(getattr(layer, method, None)):
                    raise TypeError(f"layers[{i}]: {type(layer).__name__} has no {method}()")
        self.layers = list(layers)
        self._needs_input_grad = False
        self._propagate()

    def _propagate(self):
        for i, layer in enumerate(self.layers):
            if isinstance(layer, Module):
                layer.needs_input_grad = i > 0 or self._needs_input_grad

    @property
    def needs_input_grad(self):
        return self._needs_input_grad

    @needs_input_grad.setter
    def needs_input_grad(self, value):
        self._needs_input_grad = bool(value)
        self._propagate()

    def parameters(self):
        seen, params = set(), []
        for layer in self.layers:
            get = getattr(layer, "parameters", None)
            for p in (get() if get is not None else []):
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, grad_out):
        g = grad_out
        for layer in reversed(self.layers):
            g = layer.backward(g)
        return g

    def __getitem__(self, i):
        return self.layers[i]

    def __len__(self):
        return len(self.layers)

    def __repr__(self):
        inner = ",\n  ".join(repr(layer) for layer in self.layers)
        return f"Sequential(\n  {inner}\n)"
