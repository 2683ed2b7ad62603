"""What Sequential tells a user: errors that name the layer, and a repr with indices."""
import re

import numpy as np
import pytest

from ggmlopt.nn import Conv2d, Dropout, Flatten, Linear, MaxPool2d, ReLU, Reshape, Sequential


def _zeros(*shape):
    return np.zeros(shape, np.float32)


def test_forward_shape_error_names_the_layer():
    model = Sequential(Linear(784, 100, rng=0), ReLU(), Linear(10, 10, rng=1))
    with pytest.raises(ValueError, match=re.escape(
            "layer 2 (Linear 10->10): x: expected shape (batch, 10), got (3, 100)")):
        model(_zeros(3, 784))
    with pytest.raises(ValueError, match=re.escape("layer 0 (Linear 784->100): x: ")):
        model.forward(_zeros(3, 783))


def test_backward_shape_error_names_the_layer():
    model = Sequential(Linear(4, 100, rng=0), ReLU(), Linear(100, 10, rng=1))
    model.forward(_zeros(2, 4))
    with pytest.raises(ValueError, match=re.escape(
            "layer 2 (Linear 100->10): grad_out: expected shape (batch, 10), got (2, 9)")):
        model.backward(_zeros(2, 9))


def test_fused_runs_name_their_layers():
    # Conv2d, ReLU, MaxPool2d run as one pass; ReLU, MaxPool2d too
    model = Sequential(Reshape((1, 8, 8)), Conv2d(1, 4, 3, padding=1, rng=0), ReLU(),
                       MaxPool2d(2), Flatten(), Linear(64, 8, rng=1), Reshape((2, 2, 2)),
                       ReLU(), MaxPool2d(2))
    model.forward(_zeros(2, 64))
    assert model._fused == {3: 1, 8: 7}  # both fused passes ran
    with pytest.raises(ValueError, match=r"^layer 8 \(MaxPool2d"):
        model.backward(_zeros(2, 2, 2, 2))
    conv = Sequential(Conv2d(1, 4, 3, padding=1, rng=0), ReLU(), MaxPool2d(2))
    with pytest.raises(ValueError, match=r"^layer 0 \(Conv2d 1->4\): x: "):
        conv.forward(_zeros(2, 2, 8, 8))
    conv.forward(_zeros(2, 1, 8, 8))
    with pytest.raises(ValueError, match=r"^layer 2 \(MaxPool2d"):
        conv.backward(_zeros(2, 4, 3, 3))


def test_nested_sequential_names_both_levels_and_keeps_the_traceback():
    model = Sequential(Linear(4, 8, rng=0), Sequential(ReLU(), Linear(7, 2, rng=1)))
    with pytest.raises(ValueError) as info:
        model.forward(_zeros(2, 4))
    assert str(info.value).startswith("layer 1 (Sequential): layer 1 (Linear 7->2): x: ")
    # the traceback still reaches the layer's own check
    assert "linear.py" in "".join(str(entry.path) for entry in info.traceback)


class _Raising:
    """A layer that is not a Module and raises what it was given."""

    def __init__(self, error):
        self.error = error

    def parameters(self):
        return []

    def forward(self, x):
        raise self.error

    def backward(self, grad_out):
        raise self.error


def test_layers_that_are_not_modules_and_other_errors():
    model = Sequential(Linear(3, 3, rng=0), _Raising(TypeError("x: expected float32")))
    with pytest.raises(TypeError, match=r"^layer 1 \(_Raising\): x: expected float32$"):
        model.forward(_zeros(1, 3))
    # other exception types pass unchanged
    model = Sequential(_Raising(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="^boom$"):
        model.forward(_zeros(1, 3))
    # a ValueError subclass with another constructor passes unchanged
    error = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad")
    with pytest.raises(UnicodeDecodeError) as info:
        Sequential(_Raising(error)).forward(_zeros(1, 3))
    assert info.value is error


def test_repr_shows_the_layer_indices():
    model = Sequential(Linear(784, 100, rng=0), ReLU(), Dropout(0.5),
                       Sequential(Linear(100, 10, rng=1), ReLU()))
    assert repr(model) == (
        "Sequential(\n"
        "  (0): Linear(in_features=784, out_features=100, bias=True)\n"
        "  (1): ReLU()\n"
        f"  (2): {Dropout(0.5)!r}\n"
        "  (3): Sequential(\n"
        "    (0): Linear(in_features=100, out_features=10, bias=True)\n"
        "    (1): ReLU()\n"
        "  )\n"
        ")")
