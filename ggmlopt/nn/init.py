"""Initialisations: torch.nn.init's functions under torch's names, and the layers'
default init functions.

The torch-named functions (``normal_``, ``uniform_``, ``trunc_normal_``,
``constant_``, ``ones_``, ``zeros_``, ``xavier_uniform_``, ``xavier_normal_``,
``kaiming_uniform_``, ``kaiming_normal_``, and ``calculate_gain``) take torch's
arguments and formulas and fill a float32 NumPy array in place (or a Parameter's
``.data``), returning it.  Random ones take ``rng=``: None (fresh entropy), an
int seed or a numpy Generator.

Fans follow ggmlopt's layouts, so a layer gets the distribution torch gives the
same layer:

- a 2-D array is a Linear weight, ``(in_features, out_features)``, the
  transpose of torch's ``(out, in)``: fan_in = shape[0], fan_out = shape[1];
- an array of 3 or more dimensions is laid out as torch's (Conv2d's weight is
  ``(out_channels, in_channels, kh, kw)``): fan_in = shape[1] * kh * kw,
  fan_out = shape[0] * kh * kw;
- fans of a 1-D array (a bias) are undefined, as in torch (ValueError).

A layer's ``init=`` takes ``init(weight, bias, rng)``; to use these::

    def xavier(weight, bias, rng):
        init.xavier_uniform_(weight, rng=rng)
        if bias is not None:
            init.zeros_(bias)

    layer = Linear(784, 500, init=xavier, rng=0)

``kaiming_uniform(weight, bias, rng)`` is Linear's default init (torch's default
for nn.Linear).
"""
from __future__ import annotations

import contextlib
import math
import numbers
import threading
from typing import Any

import numpy as np

__all__ = [
    "calculate_gain",
    "constant_",
    "initializing",
    "kaiming_normal_",
    "kaiming_uniform",
    "kaiming_uniform_",
    "normal_",
    "ones_",
    "skip_init",
    "trunc_normal_",
    "uniform_",
    "xavier_normal_",
    "xavier_uniform_",
    "zeros_",
]

_LINEAR_GAIN = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                "conv_transpose2d", "conv_transpose3d", "sigmoid")


_skipping = threading.local()


@contextlib.contextmanager
def skip_init():
    """Within the block, Linear and Embedding layers are built with zero weights
    that touch no memory instead of initialised ones (Hugging Face's
    ``no_init_weights``, torch's ``skip_init``): for a loader that fills or
    replaces every weight, so building the model costs neither the random
    draws nor the float32 memory of weights it never keeps."""
    before = getattr(_skipping, "on", False)
    _skipping.on = True
    try:
        yield
    finally:
        _skipping.on = before


def initializing() -> bool:
    """False inside skip_init() (on this thread), else True."""
    return not getattr(_skipping, "on", False)


def kaiming_uniform(weight: np.ndarray, bias, rng: np.random.Generator) -> None:
    """torch.nn.Linear's default: weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    fan_in = weight.shape[0] (weight is (in_features, out_features)).  Fills the
    arrays in place."""
    fan_in = weight.shape[0]
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    weight[...] = rng.uniform(-bound, bound, size=weight.shape)
    if bias is not None:
        bias[...] = rng.uniform(-bound, bound, size=bias.shape)


# ---- argument checks ---------------------------------------------------------------------

def _target(array, name: str = "array") -> np.ndarray:
    """The float32 ndarray to fill: array itself, or a Parameter's .data."""
    data = array if isinstance(array, np.ndarray) else getattr(array, "data", None)
    if not isinstance(data, np.ndarray):
        raise TypeError(f"{name}: expected a float32 numpy.ndarray or a Parameter, got "
                        f"{type(array).__name__}")
    if data.dtype != np.float32:
        raise TypeError(f"{name}: expected dtype float32, got {data.dtype}")
    if not data.flags.writeable:
        raise ValueError(f"{name}: the array is read-only")
    return data


def _real(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    return value


def _generator(rng) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None:
        return np.random.default_rng()
    if isinstance(rng, numbers.Integral) and not isinstance(rng, bool):
        return np.random.default_rng(int(rng))
    raise TypeError(f"rng: expected None, an int seed or a numpy Generator, got "
                    f"{type(rng).__name__}")


def _fill(data: np.ndarray, values: np.ndarray) -> np.ndarray:
    data[...] = values
    return data


# ---- fans and gains ----------------------------------------------------------------------

def _fan_in_and_fan_out(data: np.ndarray) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight in ggmlopt's layouts (see the module docstring)."""
    if data.ndim < 2:
        raise ValueError(f"array: fan in and fan out need at least 2 dimensions (a weight), "
                         f"got shape {data.shape}")
    if data.ndim == 2:  # Linear: (in_features, out_features)
        return int(data.shape[0]), int(data.shape[1])
    receptive = math.prod(data.shape[2:])  # torch's (out, in, *kernel)
    return int(data.shape[1]) * receptive, int(data.shape[0]) * receptive


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """torch.nn.init.calculate_gain: the recommended gain for a nonlinearity
    ("linear", "conv1d"... and "sigmoid": 1; "tanh": 5/3; "relu": sqrt(2);
    "leaky_relu": sqrt(2 / (1 + param**2)), param the negative slope, default
    0.01; "selu": 3/4)."""
    if nonlinearity in _LINEAR_GAIN:
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else _real(param, "param")
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"nonlinearity: expected one of {', '.join(_LINEAR_GAIN)}, tanh, relu, "
                     f"leaky_relu, selu; got {nonlinearity!r}")


def _kaiming_std(data, a, mode, nonlinearity) -> float:
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"mode: expected 'fan_in' or 'fan_out', got {mode!r}")
    fan_in, fan_out = _fan_in_and_fan_out(data)
    fan = fan_in if mode == "fan_in" else fan_out
    gain = calculate_gain(nonlinearity, a)
    return gain / math.sqrt(fan) if fan > 0 else 0.0


# ---- the initialisers --------------------------------------------------------------------

def uniform_(array: Any, a: float = 0.0, b: float = 1.0, *, rng=None) -> np.ndarray:
    """Fill array (float32, any shape) with values from U(a, b); returns it."""
    data, a, b = _target(array), _real(a, "a"), _real(b, "b")
    if a > b:
        raise ValueError(f"a, b: expected a <= b, got a={a}, b={b}")
    return _fill(data, _generator(rng).uniform(a, b, size=data.shape))


def normal_(array: Any, mean: float = 0.0, std: float = 1.0, *, rng=None) -> np.ndarray:
    """Fill array (float32, any shape) with values from N(mean, std**2); returns it."""
    data, mean, std = _target(array), _real(mean, "mean"), _real(std, "std")
    if std < 0:
        raise ValueError(f"std: expected >= 0, got {std}")
    return _fill(data, _generator(rng).normal(mean, std, size=data.shape))


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def trunc_normal_(array: Any, mean: float = 0.0, std: float = 1.0, a: float = -2.0,
                  b: float = 2.0, *, rng=None) -> np.ndarray:
    """Fill array (float32) with values from N(mean, std**2) truncated to [a, b] (a
    and b are values, not multiples of std, as in torch); returns it.  Drawn by
    rejection, so [a, b] must hold at least 1e-4 of the distribution's mass."""
    data, mean, std = _target(array), _real(mean, "mean"), _real(std, "std")
    a, b = _real(a, "a"), _real(b, "b")
    if not a < b:
        raise ValueError(f"a, b: expected a < b, got a={a}, b={b}")
    if std <= 0:
        raise ValueError(f"std: expected > 0, got {std}")
    mass = _normal_cdf((b - mean) / std) - _normal_cdf((a - mean) / std)
    if mass < 1e-4:
        raise ValueError(f"a, b: [{a}, {b}] holds {mass:.3g} of N({mean}, {std}**2); "
                         "expected at least 1e-4")
    gen = _generator(rng)
    out = np.empty(data.size)
    filled = 0
    while filled < out.size:
        # enough draws that one round usually fills the rest; at most 4M at a time
        want = min(int((out.size - filled) / mass * 1.1) + 16, 1 << 22)
        draws = gen.normal(mean, std, size=want)
        draws = draws[(draws >= a) & (draws <= b)][:out.size - filled]
        out[filled:filled + draws.size] = draws
        filled += draws.size
    return _fill(data, out.reshape(data.shape))


def constant_(array: Any, val: float) -> np.ndarray:
    """Fill array (float32) with val; returns it."""
    data = _target(array)
    data[...] = _real(val, "val")
    return data


def ones_(array: Any) -> np.ndarray:
    """Fill array (float32) with 1; returns it."""
    return constant_(array, 1.0)


def zeros_(array: Any) -> np.ndarray:
    """Fill array (float32) with 0; returns it."""
    return constant_(array, 0.0)


def xavier_uniform_(array: Any, gain: float = 1.0, *, rng=None) -> np.ndarray:
    """Glorot uniform: U(-bound, bound), bound = gain * sqrt(6 / (fan_in + fan_out)),
    fans in ggmlopt's layouts (module docstring); returns array."""
    data, gain = _target(array), _real(gain, "gain")
    fan_in, fan_out = _fan_in_and_fan_out(data)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out)) if fan_in + fan_out else 0.0
    return _fill(data, _generator(rng).uniform(-bound, bound, size=data.shape))


def xavier_normal_(array: Any, gain: float = 1.0, *, rng=None) -> np.ndarray:
    """Glorot normal: N(0, std**2), std = gain * sqrt(2 / (fan_in + fan_out)), fans
    in ggmlopt's layouts (module docstring); returns array."""
    data, gain = _target(array), _real(gain, "gain")
    fan_in, fan_out = _fan_in_and_fan_out(data)
    std = gain * math.sqrt(2.0 / (fan_in + fan_out)) if fan_in + fan_out else 0.0
    return _fill(data, _generator(rng).normal(0.0, std, size=data.shape))


def kaiming_uniform_(array: Any, a: float = 0, mode: str = "fan_in",
                     nonlinearity: str = "leaky_relu", *, rng=None) -> np.ndarray:
    """He uniform: U(-bound, bound), bound = sqrt(3) * gain / sqrt(fan), gain =
    calculate_gain(nonlinearity, a) (a: leaky_relu's negative slope), fan the
    fan_in or fan_out (mode) in ggmlopt's layouts (module docstring); returns
    array.  ``a=math.sqrt(5)`` gives torch's default for Linear and Conv2d
    weights."""
    data = _target(array)
    bound = math.sqrt(3.0) * _kaiming_std(data, a, mode, nonlinearity)
    return _fill(data, _generator(rng).uniform(-bound, bound, size=data.shape))


def kaiming_normal_(array: Any, a: float = 0, mode: str = "fan_in",
                    nonlinearity: str = "leaky_relu", *, rng=None) -> np.ndarray:
    """He normal: N(0, std**2), std = gain / sqrt(fan), gain and fan as in
    kaiming_uniform_; returns array."""
    data = _target(array)
    std = _kaiming_std(data, a, mode, nonlinearity)
    return _fill(data, _generator(rng).normal(0.0, std, size=data.shape))
