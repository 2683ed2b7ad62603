"""Scalar arguments of the kernels: real numbers only, and finite in float32 where
the kernel promises a finite factor."""
import numpy as np
import pytest

from ggmlopt import kernels


def _f32(n=5):
    return np.arange(n, dtype=np.float32)


FINITE_SCALARS = [
    ("scale a", "a", lambda v: kernels.scale(_f32(), v)),
    ("axpy a", "a", lambda v: kernels.axpy(v, _f32(), _f32())),
    ("sgd alpha", "alpha", lambda v: kernels.sgd_step(_f32(), _f32(), alpha=v)),
    ("adamw eps", "eps", lambda v: kernels.adamw_step(
        _f32(), _f32(), _f32(), _f32(), alpha=1e-3, beta1=0.9, beta2=0.999, eps=v, wd=0.0,
        beta1h=1.0, beta2h=1.0)),
    ("ce grad_scale", "grad_scale", lambda v: kernels.cross_entropy(
        _f32(6).reshape(2, 3), _f32(6).reshape(2, 3), grad_scale=v)),
    ("convert scale", "scale", lambda v: kernels.to_float32(np.zeros(3, np.uint8), scale=v)),
]


@pytest.mark.parametrize("name, arg, call", FINITE_SCALARS, ids=[c[0] for c in FINITE_SCALARS])
@pytest.mark.parametrize("value", ["2", b"2", "nan"])
def test_strings_are_not_numbers(name, arg, call, value):
    with pytest.raises(TypeError, match=f"^{arg}:"):
        call(value)


@pytest.mark.parametrize("name, arg, call", FINITE_SCALARS, ids=[c[0] for c in FINITE_SCALARS])
@pytest.mark.parametrize("value", [1e39, -3.5e38, 10**400], ids=["1e39", "-3.5e38", "10**400"])
def test_values_past_float32_are_not_finite(name, arg, call, value):
    # a double that rounds to +-inf in float32 would reach the kernel as inf
    with pytest.raises(ValueError, match=f"^{arg}:"):
        call(value)


def test_float32_max_itself_is_accepted():
    x = np.ones(3, np.float32)
    kernels.scale(x, float(np.finfo(np.float32).max))
    assert np.all(x == np.finfo(np.float32).max)


def test_fill_takes_any_float_but_no_string():
    x = _f32()
    kernels.fill(x, np.inf)
    assert np.all(x == np.inf)
    with pytest.raises(TypeError, match="^value:"):
        kernels.fill(x, "1")
