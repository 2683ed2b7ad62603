"""Layers for the model protocol.

A model is any object with ``parameters()``, ``forward(x)`` and
``backward(grad_out)``; ``backward`` ADDS d loss / d parameter into each
``Parameter.grad`` and returns d loss / d input (unless ``needs_input_grad`` is
False).  The layers here do their matrix products with NumPy's BLAS, write into
buffers they reuse from batch to batch (``forward`` returns such a buffer;
``layer(x)`` returns a copy the caller owns), and always read
``Parameter.data`` / ``.grad`` at call time, so an OptContext can re-point them
at its arena.
"""
from .activation import ReLU
from .container import Sequential
from .conv import Conv2d
from .init import kaiming_uniform
from .linear import Linear
from .module import Module, named_modules, named_parameters
from .parameter import Parameter
from .pooling import AvgPool2d, MaxPool2d

__all__ = ["Linear", "Module", "Parameter", "ReLU", "Sequential", "kaiming_uniform",
           "named_modules", "named_parameters"]
__all__ += ["AvgPool2d", "Conv2d", "MaxPool2d"]
