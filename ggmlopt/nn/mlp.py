"""The feed-forward blocks of decoder-only transformers: Llama's SwiGLU and
GPT-2's MLP."""
from __future__ import annotations

import numpy as np

from .. import kernels_glu
from ._buffers import empty
from ._lm_args import as_rows, check_size
from .activation import GELU
from .linear import Linear
from .module import Module

__all__ = ["GPT2MLP", "SwiGLU"]


def _grad_rows(grad_out, shape, name="grad_out"):
    """grad_out as float32 2-D rows, after checking it has the last output's shape."""
    if not isinstance(grad_out, np.ndarray):
        grad_out = np.asarray(grad_out)
    if grad_out.dtype.kind not in "biuf":
        raise TypeError(f"{name}: expected real numbers, got dtype {grad_out.dtype}")
    if grad_out.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} like the last forward output, got "
                         f"{grad_out.shape}")
    return np.ascontiguousarray(grad_out, dtype=np.float32).reshape(-1, shape[-1])


class SwiGLU(Module):
    """SwiGLU(dim, hidden, *, init=None, rng=None): Llama's MLP,
    y = down_proj(silu(gate_proj(x)) * up_proj(x)), x: (..., dim) -> (..., dim).

    Sub-layers (Hugging Face's LlamaMLP names): gate_proj, up_proj:
    Linear(dim, hidden, bias=False); down_proj: Linear(hidden, dim, bias=False);
    init and rng go to them (rng: one generator drawn in that order).  gate_proj
    and up_proj stay two matrix products, so each weight keeps its own Parameter
    and name; the product silu(g) * u and both its gradients are one kernel pass
    each way (kernels_glu).

    ``forward`` returns a new array (down_proj writes it and keeps no output
    buffer); ``module(x)`` a copy the caller owns.  ``backward`` adds into the
    three weights' gradients and returns d loss / d x, or None when
    needs_input_grad is False.
    """

    def __init__(self, dim, hidden, *, init=None, rng=None):
        self.dim = check_size(dim, "dim")
        self.hidden = check_size(hidden, "hidden")
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        self.gate_proj = Linear(self.dim, self.hidden, bias=False, init=init, rng=gen)
        self.up_proj = Linear(self.dim, self.hidden, bias=False, init=init, rng=gen)
        self.down_proj = Linear(self.hidden, self.dim, bias=False, init=init, rng=gen)
        self._shape = None
        self._rows = -1

    def forward(self, x):
        """x: float32 (..., dim) (other real dtypes are converted) -> (..., dim)."""
        x = as_rows(x, self.dim, "x")
        x2 = x.reshape(-1, self.dim)
        rows = x2.shape[0]
        if rows != self._rows:
            self._h = empty((rows, self.hidden), dtype=np.float32)
            self._rows = rows
        self._g = self.gate_proj.forward(x2)
        self._u = self.up_proj.forward(x2)
        kernels_glu.swiglu(self._g, self._u, out=self._h)
        # a new array: the caller (a block's residual sum) reads it at once, so the
        # projection keeps no dead copy between steps
        y = self.down_proj.forward(self._h, out=empty((rows, self.dim), np.float32))
        self._shape = x.shape
        return y.reshape(x.shape)

    def backward(self, grad_out):
        """grad_out: (..., dim) like the last forward output -> d loss / d x."""
        if self._shape is None:
            raise RuntimeError("backward: call forward first")
        g = _grad_rows(grad_out, self._shape)
        dh = self.down_proj.backward(g)
        # the backward buffers are made here and not kept (as Linear's input gradient)
        dg, du = empty(dh.shape, np.float32), empty(dh.shape, np.float32)
        kernels_glu.swiglu_backward(self._g, self._u, dh, grad_gate=dg, grad_up=du)
        del dh
        need = self.needs_input_grad
        self.gate_proj.needs_input_grad = need
        self.up_proj.needs_input_grad = need
        dx_gate = self.gate_proj.backward(dg)
        del dg
        dx_up = self.up_proj.backward(du)
        if not need:
            return None
        np.add(dx_gate, dx_up, out=dx_gate)
        return dx_gate.reshape(self._shape)

    def __repr__(self):
        return f"SwiGLU(dim={self.dim}, hidden={self.hidden})"


class GPT2MLP(Module):
    """GPT2MLP(dim, hidden=None, *, init=None, rng=None): GPT-2's MLP,
    y = c_proj(gelu_tanh(c_fc(x))), x: (..., dim) -> (..., dim), hidden
    default 4 * dim.

    Sub-layers (Hugging Face's GPT2MLP names): c_fc: Linear(dim, hidden),
    act: GELU(approximate="tanh"), c_proj: Linear(hidden, dim), both with bias;
    init and rng go to the Linears (rng: one generator, c_fc drawn first).

    ``forward`` returns a buffer the layer reuses; ``module(x)`` a copy the
    caller owns.  ``backward`` adds into the weights' and biases' gradients and
    returns d loss / d x, or None when needs_input_grad is False.
    """

    def __init__(self, dim, hidden=None, *, init=None, rng=None):
        self.dim = check_size(dim, "dim")
        self.hidden = 4 * self.dim if hidden is None else check_size(hidden, "hidden")
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        self.c_fc = Linear(self.dim, self.hidden, init=init, rng=gen)
        self.act = GELU(approximate="tanh")
        self.c_proj = Linear(self.hidden, self.dim, init=init, rng=gen)
        self._shape = None

    def forward(self, x):
        """x: float32 (..., dim) (other real dtypes are converted) -> (..., dim)."""
        x = as_rows(x, self.dim, "x")
        y = self.c_proj.forward(self.act.forward(self.c_fc.forward(x.reshape(-1, self.dim))))
        self._shape = x.shape
        return y.reshape(x.shape)

    def backward(self, grad_out):
        """grad_out: (..., dim) like the last forward output -> d loss / d x."""
        if self._shape is None:
            raise RuntimeError("backward: call forward first")
        g = _grad_rows(grad_out, self._shape)
        self.act.needs_input_grad = True
        self.c_fc.needs_input_grad = self.needs_input_grad
        dx = self.c_fc.backward(self.act.backward(self.c_proj.backward(g)))
        return None if dx is None else dx.reshape(self._shape)

    def __repr__(self):
        return f"GPT2MLP(dim={self.dim}, hidden={self.hidden})"
