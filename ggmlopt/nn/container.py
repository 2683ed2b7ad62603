"""Sequential: layers applied in order."""
from __future__ import annotations

from .activation import ReLU
from .conv import Conv2d
from .module import Module, grads_ready
from .pooling import MaxPool2d

__all__ = ["Sequential"]


def _fused_length(layers, i) -> int:
    """How many layers from i run as one pass: 3 for Conv2d (on its direct
    kernels), ReLU, MaxPool2d; 2 for ReLU, MaxPool2d; else 1.  Exactly these
    classes: a subclass may change any of them."""
    if i + 1 < len(layers) and type(layers[i]) is ReLU and type(layers[i + 1]) is MaxPool2d:
        return 2
    if (i + 2 < len(layers) and type(layers[i]) is Conv2d and layers[i]._direct
            and type(layers[i + 1]) is ReLU and type(layers[i + 2]) is MaxPool2d):
        return 3
    return 1


# a layer's complaint about its input or gradient (shape, dtype, size) gets the
# layer's index in front; other exceptions pass unchanged
_NAMED_ERRORS = (ValueError, TypeError, IndexError)


def _layer_description(layer) -> str:
    """"Linear 100->10", "Conv2d 8->16", a short repr, or the class name."""
    name = type(layer).__name__
    for ins, outs in (("in_features", "out_features"), ("in_channels", "out_channels")):
        if hasattr(layer, ins) and hasattr(layer, outs):
            return f"{name} {getattr(layer, ins)}->{getattr(layer, outs)}"
    text = repr(layer)
    return text if len(text) <= 60 and "\n" not in text else name


def _naming_layer(error, i, layer):
    """error with "layer i (description): " in front of its message, its traceback
    kept; error itself when its type cannot be built from one message."""
    try:
        named = type(error)(f"layer {i} ({_layer_description(layer)}): {error}")
    except TypeError:  # an exception class with another constructor
        return error
    return named.with_traceback(error.__traceback__)


class Sequential(Module):
    """Sequential(*layers): forward through the layers in order, backward in reverse.

    As a top-level model it does not compute the gradient w.r.t. its input (the
    data); nested inside another Sequential the parent decides.

    A ReLU directly followed by a MaxPool2d runs as one pass
    (MaxPool2d.forward_relu: the pool of the pre-activation, clamped at 0, and
    the gradient sent back only where the output is not 0); a Conv2d on its
    direct kernels (thin stride-1 layers) followed by both runs as one pass
    too, each image's convolution output pooled while in the cache.  Outputs
    and gradients are those of the layers run one after the other, bit for
    bit; the ReLU's (and the Conv2d's) full-size output buffers are then not
    filled.

    A ValueError, TypeError or IndexError raised by a layer's forward or
    backward names the layer: ``layer 2 (Linear 100->10): x: expected ...``.
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
        self._fused = {}  # last forward: last layer -> first layer of each fused run
        self._propagate()

    def _propagate(self):
        for i, layer in enumerate(self.layers):
            if isinstance(layer, Module):
                layer.needs_input_grad = i > 0 or self._needs_input_grad

    @property
    def needs_input_grad(self):
        """Whether backward returns the gradient w.r.t. the input (bool, default
        False for a top-level model, whose input is data).  Setting it passes it
        on to the first layer; the other layers always compute theirs."""
        return self._needs_input_grad

    @needs_input_grad.setter
    def needs_input_grad(self, value):
        self._needs_input_grad = bool(value)
        self._propagate()

    @property
    def output_is_scratch(self):
        """Whether the output may be overwritten by the caller: the last layer's
        (a fused ReLU and MaxPool2d ending reads its output: False)."""
        return bool(getattr(self.layers[-1], "output_is_scratch", False))

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
        layers, fused = self.layers, {}
        i = 0
        try:
            while i < len(layers):
                length = _fused_length(layers, i)
                if length == 1:
                    x = layers[i].forward(x)
                elif length == 2:
                    x = layers[i + 1].forward_relu(x)
                else:
                    x = layers[i]._forward_relu_maxpool(x, layers[i + 2])
                if length > 1:
                    fused[i + length - 1] = i
                i += length
        except _NAMED_ERRORS as e:
            raise _naming_layer(e, i, layers[i]) from None
        self._fused = fused
        return x

    def backward(self, grad_out):
        """grad_out through every layer's backward, last layer first; returns the
        first layer's result (None unless needs_input_grad is set).  Each layer is
        announced to the gradient-ready hook (``grads_ready``) once its backward
        (or its fused run's) returned."""
        g = grad_out
        layers, fused = self.layers, self._fused
        i = len(layers) - 1
        try:
            while i >= 0:
                first = fused.get(i)
                if first is None:
                    g = layers[i].backward(g)
                    grads_ready(layers[i])  # its gradients are final (gradient-ready hook)
                    i -= 1
                    continue
                if i - first == 2:  # Conv2d, ReLU, MaxPool2d
                    g = layers[first]._backward_relu_maxpool(g, layers[i])
                elif layers[first].needs_input_grad:  # ReLU, MaxPool2d: the pool's
                    g = layers[i].backward(g)         # gradient is the ReLU input's
                else:
                    layers[i].backward(g)  # its checks; the ReLU wants no gradient
                    g = None
                for k in range(i, first - 1, -1):
                    grads_ready(layers[k])
                i = first - 1
        except _NAMED_ERRORS as e:
            raise _naming_layer(e, i, layers[i]) from None
        return g

    def __getitem__(self, i):
        return self.layers[i]

    def __len__(self):
        return len(self.layers)

    def __repr__(self):
        # torch's form: each layer after its index, nested containers indented
        inner = "\n".join(f"  ({i}): " + repr(layer).replace("\n", "\n  ")
                           for i, layer in enumerate(self.layers))
        return f"Sequential(\n{inner}\n)"
