"""Module: the base of the layers, and the naming of parameters in a module tree.

The model protocol the engine needs is only ``parameters()``, ``forward(x)`` and
``backward(grad_out)``; Module adds what users of torch or Keras expect on top:
names (``named_parameters()``: ``0.weight``, ``2.bias`` in a Sequential,
attribute names in a user's module), a ``training`` flag, and ``module(x)``
returning an array the caller owns.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .parameter import Parameter

__all__ = ["Module", "named_parameters"]


class Module:
    """Base of the layers.

    needs_input_grad: whether backward must return the gradient w.r.t. the input
    (Sequential clears it for its first layer, whose input is data).
    training: whether the current eval trains (an OptContext sets it on every
    alloc); layers that behave differently while training (Dropout) read it.

    ``forward(x)`` may return a buffer the layer reuses (the next forward
    overwrites it); ``module(x)`` returns a copy the caller owns.
    """

    needs_input_grad = True
    training = False

    def parameters(self) -> list[Parameter]:
        """The trainable parameters, each once, in the order of named_parameters()."""
        return [p for _, p in self.named_parameters()]

    def named_children(self) -> Iterator[tuple[str, object]]:
        """(attribute name, sub-module) for each direct sub-module, in definition
        order; a list or tuple of modules gives names ``attr.0``, ``attr.1``..."""
        for name, value in vars(self).items():
            if name.startswith("_"):
                continue
            if _is_module(value):
                yield name, value
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if _is_module(item):
                        yield f"{name}.{i}", item

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """(dotted name, Parameter) for every parameter of this module and its
        sub-modules, each parameter once (torch's state_dict names)."""
        yield from _named(self, prefix, set())

    def train(self, mode: bool = True):
        """Set ``training`` on this module and every sub-module; returns self."""
        self.training = bool(mode)
        child: Any
        for _, child in self.named_children():
            setter = getattr(child, "train", None)
            if callable(setter):
                setter(mode)
            else:
                child.training = bool(mode)
        return self

    def eval(self):
        """train(False)."""
        return self.train(False)

    def forward(self, x):
        """The layer's output for x (batch, ...): float32, possibly a buffer the
        layer reuses at the next forward.  Subclasses define it."""
        raise NotImplementedError

    def backward(self, grad_out):
        """Add d loss / d parameters into each parameter's .grad and return the
        gradient w.r.t. the last forward's input (None unless needs_input_grad).
        Subclasses define it."""
        raise NotImplementedError

    def __call__(self, x) -> np.ndarray:
        """forward(x), copied into an array the caller owns: ``a = m(x1); b = m(x2)``
        never changes ``a``."""
        return np.array(self.forward(x), copy=True)


def _is_module(obj) -> bool:
    return isinstance(obj, Module) or (
        callable(getattr(obj, "parameters", None)) and callable(getattr(obj, "forward", None)))


def _direct_parameters(obj) -> Iterator[tuple[str, Parameter]]:
    for name, value in vars(obj).items():
        if name.startswith("_"):
            continue
        if isinstance(value, Parameter):
            yield name, value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, Parameter):
                    yield f"{name}.{i}", item


def _named(obj, prefix, seen) -> Iterator[tuple[str, Parameter]]:
    own = getattr(obj, "named_parameters", None)
    if not isinstance(obj, Module) and callable(own):
        # a user's module with its own naming
        for name, p in own():
            if id(p) not in seen:
                seen.add(id(p))
                yield prefix + name, p
        return
    for name, p in _direct_parameters(obj):
        if id(p) not in seen:
            seen.add(id(p))
            yield prefix + name, p
    children = obj.named_children() if isinstance(obj, Module) else \
        Module.named_children(obj)
    for name, child in children:
        yield from _named(child, f"{prefix}{name}.", seen)


def named_parameters(model) -> list[tuple[str, Parameter]]:
    """(dotted name, Parameter) for every parameter of any model: a Module, an
    object with its own ``named_parameters()``, or any object whose attributes
    hold Parameters and sub-modules (named after the attributes).

    Raises ValueError when model.parameters() holds a parameter that no name
    reaches (it lives somewhere the walk cannot see, e.g. a dict)."""
    named = list(_named(model, "", set()))
    found = {id(p) for _, p in named}
    get = getattr(model, "parameters", None)
    if callable(get):
        missing = [i for i, p in enumerate(get()) if id(p) not in found]
        if missing:
            raise ValueError(f"model: parameters() at positions {missing} have no name (they "
                             "are not attributes of the model or of its sub-modules); give "
                             "the model a named_parameters() method")
    return named
