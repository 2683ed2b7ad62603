"""Layers for the model protocol.

A model is any object with ``parameters()``, ``forward(x)`` and
``backward(grad_out)``; ``backward`` ADDS d loss / d parameter into each
``Parameter.grad`` and returns d loss / d input (unless ``needs_input_grad`` is
False).  The layers here do their matrix products with NumPy's BLAS, write into
buffers they reuse from batch to batch (``forward`` returns such a buffer;
``layer(x)`` returns a copy the caller owns), and always read
``Parameter.data`` / ``.grad`` at call time, so an OptContext can re-point them
at its arena.  A frozen parameter (``Parameter.requires_grad = False``) has
``grad`` None: the layers skip its gradient and
still return their input's.  ``Residual(fn)`` is the skip connection
``x + fn(x)`` of transformer blocks; Linear and the elementwise layers take
inputs of any leading shape, e.g. tokens (B, T, D).

Whether an eval trains and where random numbers come from is one protocol for
every module (see ggmlopt.nn.module): on every alloc an OptContext calls
``set_training(model, backward)`` (``model.train(mode)``, or ``.training``
set through the tree) and ``set_rng(model, ctx.rng)`` (each module's
``set_rng(rng)``).  Images are NCHW float32; an image model takes the engine's
flat datapoints (batch, ne_datapoint) and reshapes them itself (Reshape).
"""
from .activation import GELU, LeakyReLU, ReLU, Sigmoid, SiLU, Tanh
from .attention import CausalSelfAttention, GPT2Attention, RotaryEmbedding
from .container import Sequential
from .conv import Conv2d
from .dropout import Dropout
from .embedding import Embedding
from .init import kaiming_uniform
from .linear import Linear
from .mlp import GPT2MLP, SwiGLU
from .module import (
                     Module,
                     eval_mode,
                     get_submodule,
                     grads_ready,
                     modules,
                     named_modules,
                     named_parameters,
                     on_grads_ready,
                     set_rng,
                     set_submodule,
                     set_training,
)
from .norm import LayerNorm, RMSNorm
from .parameter import Parameter
from .pooling import AvgPool2d, MaxPool2d
from .quantized import QuantizedEmbedding, QuantizedLinear
from .recompute import Checkpoint
from .residual import Residual
from .rope_scaling import RopeScaling
from .shape import Flatten, Reshape

__all__ = [
                     "GELU",
                     "GPT2MLP",
                     "AvgPool2d",
                     "CausalSelfAttention",
                     "Checkpoint",
                     "Conv2d",
                     "Dropout",
                     "Embedding",
                     "Flatten",
                     "GPT2Attention",
                     "LayerNorm",
                     "LeakyReLU",
                     "Linear",
                     "MaxPool2d",
                     "Module",
                     "Parameter",
                     "QuantizedEmbedding",
                     "QuantizedLinear",
                     "RMSNorm",
                     "ReLU",
                     "Reshape",
                     "Residual",
                     "RopeScaling",
                     "RotaryEmbedding",
                     "Sequential",
                     "SiLU",
                     "Sigmoid",
                     "SwiGLU",
                     "Tanh",
                     "eval_mode",
                     "get_submodule",
                     "grads_ready",
                     "kaiming_uniform",
                     "modules",
                     "named_modules",
                     "named_parameters",
                     "on_grads_ready",
                     "set_rng",
                     "set_submodule",
                     "set_training",
]
