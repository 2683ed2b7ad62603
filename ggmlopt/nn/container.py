"""Sequential: layers applied in order."""
from __future__ import annotations

from .module import Module

__all__ = ["Sequential"]


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

    def named_children(self):
        """("0", first layer), ("1", second layer)...: torch's Sequential names."""
        for i, layer in enumerate(self.layers):
            yield str(i), layer

    def parameters(self):
        """Every layer's parameters in layer order, each once (also for layers
        that are not Modules but have parameters())."""
        seen, params = set(), []
        for layer in self.layers:
            get = getattr(layer, "parameters", None)
            for p in (get() if get is not None else []):
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def forward(self, x):
        """x (batch, n_in) through every layer in order; the last layer's output
        (it may be a buffer that layer reuses)."""
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, grad_out):
        """grad_out (batch, n_out) through the layers in reverse; each adds into its
        parameters' .grad.  Returns the input gradient, or None when the first
        layer does not compute it (needs_input_grad False)."""
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
