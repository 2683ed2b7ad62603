"""ggmlopt.testing.check_gradients: passes for correct layers, names what is wrong."""
import re

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.nn import Conv2d, Linear, Module, Parameter, Sequential
from ggmlopt.testing import check_gradients


def _away_from_zero(shape, seed=0, gap=0.05):
    """Standard normal numbers with none within gap of 0 (kinks of ReLU-like layers)."""
    x = np.random.default_rng(seed).standard_normal(shape)
    return np.where(np.abs(x) < gap, np.sign(x + 1e-12) * gap * 2, x)


class Scale(Module):
    """The docstring's layer: y = x * w over the last axis."""

    def __init__(self, n, wrong=None):
        self.w = Parameter(np.linspace(0.5, 1.5, n), name="w")
        self.wrong = wrong

    def forward(self, x):
        self._x = x
        return x * self.w.data

    def backward(self, grad_out):
        if self.w.requires_grad:
            axes = tuple(range(grad_out.ndim - 1))
            gw = (grad_out * self._x).sum(axis=axes)
            if self.wrong == "param":
                gw[3] *= 1.1  # one element off by 10%
            self.w.grad += gw
        gx = grad_out * self.w.data
        if self.wrong == "input":
            gx = gx.copy()
            gx[1, 2, 0] += 0.5
        return gx


class TableLookup(Module):
    """Rows of a table by integer ids: (...,) int -> (..., dim); no input gradient."""

    def __init__(self, n, dim):
        self.table = Parameter(np.arange(n * dim, dtype=np.float64).reshape(n, dim) / 10,
                               name="table")

    def forward(self, ids):
        self._ids = ids
        return self.table.data[ids]

    def backward(self, grad_out):
        np.add.at(self.table.grad, self._ids, grad_out)


def test_docstring_layer_passes_in_float64():
    x = np.random.default_rng(0).standard_normal((4, 3, 5))
    report = check_gradients(Scale(5), x)
    assert set(report) == {"w", "input"}
    assert max(report.values()) < 1e-5  # float64 differences: tight


def test_wrong_parameter_gradient_names_the_parameter_index_and_values():
    x = np.random.default_rng(0).standard_normal((4, 3, 5))
    with pytest.raises(AssertionError) as e:
        check_gradients(Scale(5, wrong="param"), x)
    msg = str(e.value)
    assert "w[3]" in msg and "analytic" in msg and "numeric" in msg and "input" not in msg
    a, n = map(float, re.search(r"analytic (\S+), numeric (\S+)", msg).groups())
    assert a == pytest.approx(1.1 * n, rel=1e-4)


def test_wrong_input_gradient_is_named_input():
    x = np.random.default_rng(0).standard_normal((4, 3, 5))
    with pytest.raises(AssertionError, match=re.escape("input[1, 2, 0]")):
        check_gradients(Scale(5, wrong="input"), x)


def test_a_float32_layer_with_a_wrong_gradient_fails():
    class BadLinear(Linear):
        def backward(self, grad_out):
            gx = super().backward(grad_out)
            self.weight.grad *= 0.97  # 3% off
            return gx

    x = np.random.default_rng(1).standard_normal((6, 4))
    with pytest.raises(AssertionError, match=r"float32.*weight\[\d+, \d+\]: analytic"):
        check_gradients(BadLinear(4, 3, rng=0), x)


def test_integer_inputs_have_no_input_gradient():
    ids = np.array([[0, 2, 2], [1, 0, 3]], dtype=np.int32)
    report = check_gradients(TableLookup(4, 3), ids)
    assert set(report) == {"table"}


@pytest.mark.parametrize("shape", [(7, 9), (2, 3, 9), (9,)])
def test_linear(shape):
    check_gradients(Linear(9, 5, rng=0), _away_from_zero(shape, 1))
    check_gradients(Linear(9, 5, bias=False, rng=0), _away_from_zero(shape, 1))


@pytest.mark.parametrize("cin,cout,stride,padding", [(2, 3, 1, 1), (3, 20, 2, 0), (17, 33, 1, 1)])
def test_conv2d(cin, cout, stride, padding):
    x = _away_from_zero((2, cin, 5, 6), 2)
    check_gradients(Conv2d(cin, cout, 3, stride, padding, rng=0), x, rtol=2e-2)


@pytest.mark.parametrize("layer", [go.nn.ReLU, go.nn.GELU, go.nn.SiLU, go.nn.Sigmoid,
                                   go.nn.Tanh, lambda: go.nn.LeakyReLU(0.1)])
def test_activations(layer):
    check_gradients(layer(), _away_from_zero((3, 4, 5), 3))


def test_sequential_with_shapes_and_pools():
    model = Sequential(go.nn.Reshape((2, 4, 4)), Conv2d(2, 3, 3, padding=1, rng=0),
                       go.nn.ReLU(), go.nn.AvgPool2d(2), go.nn.Flatten(), Linear(12, 4, rng=1),
                       go.nn.Tanh())
    x = _away_from_zero((3, 32), 4)
    report = check_gradients(model, x, rtol=2e-2)
    assert set(report) == {"1.weight", "1.bias", "5.weight", "5.bias", "input"}
    assert not model.needs_input_grad  # put back


def test_frozen_parameters_are_skipped_and_state_is_put_back():
    lin = Linear(4, 3, rng=0)
    lin.bias.requires_grad = False
    lin.weight.grad[...] = 7
    lin.weight.grad_is_zero = False
    data, grad = lin.weight.data, lin.weight.grad
    values = data.copy()
    report = check_gradients(lin, _away_from_zero((5, 4)))
    assert set(report) == {"weight", "input"}
    assert lin.weight.data is data and lin.weight.grad is grad
    np.testing.assert_array_equal(data, values)
    assert (grad == 7).all() and not lin.weight.grad_is_zero


def test_given_grad_out_and_bad_arguments():
    lin = Linear(3, 2, rng=0)
    x = _away_from_zero((4, 3))
    check_gradients(lin, x, grad_out=np.ones((4, 2)))
    with pytest.raises(ValueError, match="grad_out"):
        check_gradients(lin, x, grad_out=np.ones((2, 4)))
    with pytest.raises(ValueError, match="eps"):
        check_gradients(lin, x, eps=0)
    with pytest.raises(TypeError, match="parameters"):
        check_gradients(object(), x)


def test_a_missing_input_gradient_fails():
    class NoInputGrad(Scale):
        def backward(self, grad_out):
            super().backward(grad_out)

    with pytest.raises(AssertionError, match="no input gradient"):
        check_gradients(NoInputGrad(5), np.ones((2, 5)))


def test_the_module_docstring_example_runs():
    doc = go.testing.__doc__
    block = doc.split("check::\n\n", 1)[1].split("\n\n``Scale``", 1)[0]
    code = "\n".join(line[4:] for line in block.splitlines())
    exec(compile(code, "ggmlopt.testing docstring", "exec"), {})  # noqa: S102 - our own text
