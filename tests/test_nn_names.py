"""Parameter and module names: torch's state_dict names for Sequential, attribute
names for user modules, and a clear error for parameters no name reaches."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.nn import Linear, Module, Parameter, ReLU, Sequential, named_modules, named_parameters


class Block(Module):
    def __init__(self):
        self.fc = Linear(3, 4, rng=0)
        self.act = ReLU()
        self.heads = [Linear(4, 2, rng=1), Linear(4, 1, bias=False, rng=2)]
        self.scale = Parameter(np.ones(4))
        self._private = Linear(2, 2, rng=3)  # underscore attributes are not walked

    def forward(self, x):
        return x

    def backward(self, g):
        return g


def test_sequential_names_are_torchs():
    m = Sequential(Linear(5, 4, rng=0), ReLU(), Linear(4, 3, rng=1))
    names = [n for n, _ in m.named_parameters()]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [p for _, p in m.named_parameters()] == m.parameters()
    assert [n for n, _ in named_parameters(m)] == names


def test_user_module_names_follow_attributes():
    b = Block()
    names = [n for n, _ in b.named_parameters()]
    assert names == ["scale", "fc.weight", "fc.bias", "heads.0.weight", "heads.0.bias",
                     "heads.1.weight"]
    nested = Sequential(Linear(2, 3, rng=0), b)
    assert [n for n, _ in nested.named_parameters()][:3] == ["0.weight", "0.bias", "1.scale"]


def test_shared_parameter_named_once():
    lin = Linear(3, 3, rng=0)
    m = Sequential(lin, ReLU(), lin)
    assert [n for n, _ in m.named_parameters()] == ["0.weight", "0.bias"]


def test_plain_object_model_named_from_attributes():
    class Plain:  # not a Module: the protocol only
        def __init__(self):
            self.body = Sequential(Linear(2, 2, rng=0))
            self.w = Parameter(np.zeros(3))

        def parameters(self):
            return [self.w, *self.body.parameters()]

    names = [n for n, _ in named_parameters(Plain())]
    assert names == ["w", "body.0.weight", "body.0.bias"]


def test_own_named_parameters_is_used():
    class Custom:
        def __init__(self):
            self.p = {"a": Parameter(np.zeros(2))}

        def parameters(self):
            return [self.p["a"]]

        def named_parameters(self):
            return [("alpha", self.p["a"])]

        def forward(self, x):
            return x

        def backward(self, g):
            return g

    assert [n for n, _ in named_parameters(Custom())] == ["alpha"]
    outer = Sequential(Linear(2, 2, rng=0), Custom())
    assert [n for n, _ in named_parameters(outer)][-1] == "1.alpha"


def test_unnamed_parameters_raise_value_error():
    class Hidden:
        def __init__(self):
            self.store = {"w": Parameter(np.zeros(2)), "v": Parameter(np.zeros(1))}

        def parameters(self):
            return list(self.store.values())

    with pytest.raises(ValueError, match=r"positions \[0, 1\] have no name"):
        named_parameters(Hidden())


def test_named_modules_parents_first_with_parameter_prefixes():
    b = Block()
    m = Sequential(Linear(2, 3, rng=0), b)
    mods = named_modules(m)
    assert [n for n, _ in mods] == ["", "0", "1", "1.fc", "1.act", "1.heads.0", "1.heads.1"]
    assert mods[0][1] is m and mods[3][1] is b.fc
    assert [n for n, _ in m.named_modules()] == [n for n, _ in mods]
    assert [n for n, _ in b.named_modules("x.")][:2] == ["x", "x.fc"]
    # every parameter name is a module name plus an attribute
    module_names = {n for n, _ in mods}
    for name, _ in m.named_parameters():
        assert name.rpartition(".")[0] in module_names | {"1.heads"}


def test_named_modules_shared_module_once():
    lin = Linear(2, 2, rng=0)
    m = Sequential(lin, ReLU(), lin)
    assert [n for n, _ in named_modules(m)] == ["", "0", "1"]


def test_names_survive_opt_context():
    m = Sequential(Linear(4, 3, rng=0), ReLU(), Linear(3, 2, rng=1))
    before = [(n, p.data.copy()) for n, p in m.named_parameters()]
    go.OptContext(m, batch_size=2, ne_datapoint=4, loss_type=go.LossType.CROSS_ENTROPY)
    after = m.named_parameters()
    for (n0, d0), (n1, p1) in zip(before, after):
        assert n0 == n1
        np.testing.assert_array_equal(d0, p1.data)
