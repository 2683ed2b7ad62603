"""Testing helpers for users' layers: check_gradients.

A layer written for ggmlopt (the model protocol: ``parameters()``,
``forward(x)``, ``backward(grad_out)`` that adds into each ``Parameter.grad`` and
returns the input gradient) is correct when its backward is the derivative of
its forward.  ``check_gradients`` compares the two numerically, as torch's
``gradcheck`` does.  A layer written from scratch, and its check::

    import numpy as np
    import ggmlopt as go

    class Scale(go.nn.Module):
        '''y = x * w over the last axis: x (..., n) -> (..., n), w (n,).'''

        def __init__(self, n):
            self.w = go.nn.Parameter(np.linspace(0.5, 1.5, n), name="w")

        def forward(self, x):
            self._x = x
            return x * self.w.data

        def backward(self, grad_out):
            if self.w.requires_grad:
                axes = tuple(range(grad_out.ndim - 1))
                self.w.grad += (grad_out * self._x).sum(axis=axes)
            return grad_out * self.w.data

    x = np.random.default_rng(0).standard_normal((4, 3, 5))
    go.testing.check_gradients(Scale(5), x)   # passes silently; a wrong backward raises

``Scale`` computes in whatever dtype it is given, so the numerical derivatives
are taken in float64; the layers of ``ggmlopt.nn`` compute in float32 (their
kernels take nothing else), and are then checked with float32 differences and
looser default tolerances (see check_gradients).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .nn.module import named_parameters

__all__ = ["check_gradients"]

# default (rtol, atol) by the dtype the numerical derivatives are computed in
_TOLERANCES = {np.float64: (1e-3, 1e-5), np.float32: (1e-2, 1e-3)}


def check_gradients(module: Any, x: Any, *, eps: float = 1e-3, atol: float | None = None,
                    rtol: float | None = None, grad_out: Any = None,
                    seed: int = 0) -> dict[str, float]:
    """Check module's backward against central differences of its forward.

    module: any model (``parameters()``, ``forward(x)``, ``backward(grad_out)``).
    x: its input; float inputs are checked too (their gradient is the value
    backward returns), integer inputs (token ids) have no gradient.
    The loss is ``sum(forward(x) * grad_out)``; grad_out: float32 of the
    output's shape, by default standard normal numbers from ``seed``.

    The analytic side runs forward and backward once in float32 (every trainable
    parameter's gradient zeroed first; frozen parameters, requires_grad=False,
    are skipped).  The numerical side perturbs each element of each trainable
    parameter and of x by +-eps and evaluates the loss, in float64 where the
    module can run in float64 (its forward, given float64 x and float64
    parameter data, returns float64: layers written with NumPy do), else in
    float32 (ggmlopt.nn's layers), the loss always summed in float64 and the
    step taken as the difference of the perturbed values actually stored.
    Default tolerances: rtol=1e-3, atol=1e-5 in float64; rtol=1e-2, atol=1e-3
    in float32, where the rounding of the outputs (about 6e-8 of their size)
    divided by 2*eps dominates.  Inputs of order 1 suit the defaults; an input
    within eps of a kink (ReLU at 0, a tie in a max pool) makes the numerical
    derivative wrong, as in any finite-difference check.  The cost is two
    forward passes per checked element: use small shapes.

    An element passes when ``|analytic - numeric| <= atol + rtol * |numeric|``.
    Raises AssertionError naming each gradient that fails (the parameter's
    dotted name, or ``input``), with its worst element's index and both values.
    Returns {name: largest |analytic - numeric|} for every checked gradient.

    Afterwards the parameters' data, gradients and grad_is_zero flags are as
    before; the buffers the layers reuse hold a perturbed evaluation (call
    forward again before a backward).
    """
    eps = float(eps)
    if not eps > 0:
        raise ValueError(f"eps: expected > 0, got {eps}")
    for name, v in (("atol", atol), ("rtol", rtol)):
        if v is not None and not float(v) >= 0:
            raise ValueError(f"{name}: expected >= 0, got {v}")
    for method in ("parameters", "forward", "backward"):
        if not callable(getattr(module, method, None)):
            raise TypeError(f"module: {type(module).__name__} has no {method}() method")
    x = np.asarray(x)
    if x.dtype.kind not in "biuf":
        raise TypeError(f"x: expected real numbers or integer ids, got dtype {x.dtype}")
    x_is_float = x.dtype.kind == "f"
    params = [p for p in module.parameters() if getattr(p, "requires_grad", True)]
    names = _names(module, params)
    saved = [(p, p.data, p.grad, p.grad.copy(), getattr(p, "grad_is_zero", None))
             for p in params]
    had_flag = hasattr(module, "needs_input_grad")
    needs_input_grad = getattr(module, "needs_input_grad", None)
    try:
        if had_flag and x_is_float:
            module.needs_input_grad = True
        analytic, grad_out = _analytic(module, x, x_is_float, params, grad_out, seed)
        numeric, dtype = _numeric(module, x, x_is_float, params, grad_out, eps)
    finally:
        for p, data, grad, values, flag in saved:
            _set_data(p, data)
            p.grad = grad
            grad[...] = values
            if flag is not None:
                p.grad_is_zero = flag
        if had_flag and x_is_float:
            module.needs_input_grad = needs_input_grad
    rtol_default, atol_default = _TOLERANCES[dtype]
    rtol = rtol_default if rtol is None else float(rtol)
    atol = atol_default if atol is None else float(atol)
    report, failures = {}, []
    for name, a, n in zip([*names, "input"], analytic, numeric):
        if a is None:
            continue
        diff = np.abs(a.astype(np.float64) - n)
        report[name] = float(diff.max()) if diff.size else 0.0
        ratio = diff / (atol + rtol * np.abs(n))
        bad = ~(ratio <= 1)  # NaN fails too
        if bad.any():
            ratio = np.where(np.isnan(ratio), np.inf, ratio)
            i = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
            idx = tuple(int(k) for k in i)
            failures.append(f"{name}{list(idx)}: analytic {float(a[idx]):.7g}, numeric "
                            f"{float(n[idx]):.7g} ({int(bad.sum())} of {bad.size} elements "
                            "fail)")
    if failures:
        raise AssertionError(
            f"check_gradients: {type(module).__name__}'s backward differs from central "
            f"differences ({np.dtype(dtype).name}, eps={eps:g}, rtol={rtol:g}, atol={atol:g}) "
            f"for {', '.join(f.split('[')[0] for f in failures)}; worst elements: "
            + "; ".join(failures))
    return report


def _names(module, params):
    try:
        found = {id(p): name for name, p in named_parameters(module)}
    except (ValueError, TypeError, AttributeError):
        found = {}
    return [found.get(id(p)) or getattr(p, "name", None) or f"parameters()[{i}]"
            for i, p in enumerate(params)]


def _set_data(p, data):
    setter = getattr(p, "_set_storage", None)
    if setter is not None:
        setter(data, p.grad)
    else:
        p.data = data


def _analytic(module, x, x_is_float, params, grad_out, seed):
    """[each parameter's gradient..., the input gradient or None], grad_out."""
    x32 = x.astype(np.float32) if x_is_float else x
    for p in params:
        p.grad[...] = 0
        if hasattr(p, "grad_is_zero"):
            p.grad_is_zero = True
    out = np.asarray(module.forward(x32))
    if out.dtype.kind != "f":
        raise TypeError(f"module.forward: expected float outputs, got {out.dtype}")
    if grad_out is None:
        grad_out = np.random.default_rng(seed).standard_normal(out.shape).astype(np.float32)
    else:
        grad_out = np.asarray(grad_out, dtype=np.float32)
        if grad_out.shape != out.shape:
            raise ValueError(f"grad_out: expected the output's shape {out.shape}, got "
                             f"{grad_out.shape}")
    gx = module.backward(grad_out)
    grads = [np.array(p.grad, dtype=np.float64) for p in params]
    if not x_is_float:
        return [*grads, None], grad_out
    if gx is None:
        raise AssertionError("check_gradients: backward returned no input gradient (None) "
                             "for a float input; it must return d loss / d x")
    gx = np.asarray(gx)
    if gx.shape != x.shape:
        raise AssertionError(f"check_gradients: backward returned an input gradient of shape "
                             f"{gx.shape}, the input has {x.shape}")
    return [*grads, gx.astype(np.float64)], grad_out


def _numeric(module, x, x_is_float, params, grad_out, eps):
    """The central differences of every checked gradient, and the dtype they were
    computed in (float64 when the module runs in it, else float32)."""
    g64 = grad_out.astype(np.float64)
    for dtype in (np.float64, np.float32):
        arrays = [np.array(p.data, dtype=dtype) for p in params]
        xin = x.astype(dtype) if x_is_float else x
        for p, a in zip(params, arrays):
            _set_data(p, a)

        def loss(xin=xin):
            out = np.asarray(module.forward(xin))
            return float(np.sum(out.astype(np.float64) * g64))

        if dtype is np.float64:
            try:
                runs = np.asarray(module.forward(xin)).dtype == np.float64
            except Exception:  # noqa: BLE001 - float32 kernels refuse float64: fall back
                runs = False
            if not runs:
                continue
        targets = [*arrays, xin] if x_is_float else arrays
        result = [_differences(loss, a, eps) for a in targets]
        return ([*result] if x_is_float else [*result, None]), dtype
    raise AssertionError("unreachable")  # the float32 pass always returns


def _differences(loss, arr, eps):
    """Central differences of loss() w.r.t. each element of arr (changed in place
    and put back), over the step between the values actually stored."""
    g = np.zeros(arr.shape, dtype=np.float64)
    flat, gflat = arr.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        hi = float(flat[i])
        fp = loss()
        flat[i] = old - eps
        lo = float(flat[i])
        fm = loss()
        flat[i] = old
        gflat[i] = (fp - fm) / (hi - lo)
    return g
