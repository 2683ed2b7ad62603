"""Sequential: layers applied in order."""
from __future__ import annotations

from .activation import ReLU
from .module import Module
from .pooling import MaxPool2d

__all__ = ["Sequential"]


def _fuses(first, second) -> bool:
    """A ReLU directly followed by a MaxPool2d (exactly these classes: a subclass
    may change either) runs as MaxPool2d.forward_relu."""
    return type(first) is ReLU and type(second) is MaxPool2d


class Sequential(Module):
    """Sequential(*layers): forward through the layers in order, backward in reverse.

    As a top-level model it does not compute the gradient w.r.t. its input (the
    data); nested inside another Sequential the parent decides.

    A ReLU directly followed by a MaxPool2d runs as one pass
    (MaxPool2d.forward_relu: the pool of the pre-activation, clamped at 0, and
    the gradient sent back only where the output is not 0), with the outputs
    and gradients of the two layers run one after the other.  The ReLU's own
    forward and backward are then skipped (its buffers are not filled).
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
        self._fused = ()  # the ReLUs the last forward ran inside the next MaxPool2d
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
        """x through every layer's forward: the last layer's result, usually a buffer
        that layer reuses (the next forward overwrites it); ``model(x)`` returns a
        copy the caller owns."""
        layers, fused = self.layers, []
        i = 0
        while i < len(layers):
            if i + 1 < len(layers) and _fuses(layers[i], layers[i + 1]):
                x = layers[i + 1].forward_relu(x)
                fused.append(i)
                i += 2
                continue
            x = layers[i].forward(x)
            i += 1
        self._fused = tuple(fused)
        return x

    def backward(self, grad_out):
        """grad_out through every layer's backward, last layer first; returns the
        first layer's result (None unless needs_input_grad is set)."""
        g = grad_out
        layers, fused = self.layers, self._fused
        i = len(layers) - 1
        while i >= 0:
            if i - 1 in fused:
                # the pool's backward gives the ReLU input's gradient; skip the ReLU
                # unless that gradient is not wanted
                pool, relu = layers[i], layers[i - 1]
                if not relu.needs_input_grad:
                    pool.backward(g)  # its checks, no gradient
                    g = None
                else:
                    g = pool.backward(g)
                i -= 2
                continue
            g = layers[i].backward(g)
            i -= 1
        return g

    def __getitem__(self, i):
        return self.layers[i]

    def __len__(self):
        return len(self.layers)

    def __repr__(self):
        inner = ",\n  ".join(repr(layer) for layer in self.layers)
        return f"Sequential(\n  {inner}\n)"
