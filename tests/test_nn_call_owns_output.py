"""Every layer in ggmlopt.nn: ``a = layer(x1); b = layer(x2)`` leaves ``a`` unchanged
(``__call__`` returns an array the caller owns), while ``forward`` may return a
buffer it reuses or a view of its input, and says so in its docstring.

A new layer is one entry in LAYER_CASES: test_every_layer_has_a_case fails until
it has one."""
import inspect

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import nn

# name -> (make the layer, datapoint shape without the batch); several cases may
# cover one class (the class name is the part before ":")
LAYER_CASES = {
    "Linear": (lambda: nn.Linear(7, 5, rng=0), (7,)),
    "ReLU": (lambda: nn.ReLU(), (5,)),
    "ReLU:images": (lambda: nn.ReLU(), (3, 4, 5)),
    "Sequential": (lambda: nn.Sequential(nn.Linear(7, 6, rng=0), nn.ReLU(),
                                         nn.Linear(6, 3, rng=1)), (7,)),
    "Dropout": (lambda: nn.Dropout(0.5, rng=0).train(), (9,)),
    "Dropout:eval": (lambda: nn.Dropout(0.5, rng=0).eval(), (9,)),
    "Reshape": (lambda: nn.Reshape((2, -1)), (6,)),
    "Flatten": (lambda: nn.Flatten(), (2, 3)),
    "Conv2d": (lambda: nn.Conv2d(2, 3, 3, padding=1, rng=0), (2, 5, 5)),
    "MaxPool2d": (lambda: nn.MaxPool2d(2), (2, 4, 6)),
    "AvgPool2d": (lambda: nn.AvgPool2d(2, stride=1), (3, 3, 5)),
    "Tanh": (lambda: nn.Tanh(), (9,)),
    "Sigmoid": (lambda: nn.Sigmoid(), (2, 3, 3)),
    "SiLU": (lambda: nn.SiLU(), (9,)),
    "GELU": (lambda: nn.GELU(), (9,)),
    "GELU:tanh": (lambda: nn.GELU(approximate="tanh"), (9,)),
    "LeakyReLU": (lambda: nn.LeakyReLU(0.1), (9,)),
    "Residual": (lambda: nn.Residual(nn.Linear(9, 9, rng=0)), (9,)),   # into fn's buffer
    "Residual:own": (lambda: nn.Residual(nn.Tanh()), (2, 9)),         # into its own
    "Residual:x": (lambda: nn.Residual(nn.Dropout(0.5)), (9,)),       # fn returns x itself
    "Embedding": (lambda: nn.Embedding(10, 4, rng=0), (6,),
                  lambda rng, shape: rng.integers(0, 10, shape)),
    "RMSNorm": (lambda: nn.RMSNorm(9), (4, 9)),
    "LayerNorm": (lambda: nn.LayerNorm(9), (4, 9)),
    "SwiGLU": (lambda: nn.SwiGLU(8, 12, rng=0), (3, 8)),
    "GPT2MLP": (lambda: nn.GPT2MLP(8, rng=0), (3, 8)),
    "CausalSelfAttention": (lambda: nn.CausalSelfAttention(8, 2, 1, rng=0), (5, 8)),
    "GPT2Attention": (lambda: nn.GPT2Attention(8, 2, rng=0), (5, 8)),
    "RotaryEmbedding": (lambda: nn.RotaryEmbedding(4), (5, 2, 4)),
    "Checkpoint": (lambda: nn.Checkpoint(nn.Linear(7, 5, rng=0)), (7,)),
    "QuantizedLinear": (lambda: nn.QuantizedLinear(
        np.random.default_rng(0).standard_normal((5, 7)).astype(np.float16), "F16", 7, 5),
        (7,)),
    "QuantizedEmbedding": (lambda: nn.QuantizedEmbedding(
        np.random.default_rng(0).standard_normal((10, 4)).astype(np.float16), "F16", 10, 4),
        (6,), lambda rng, shape: rng.integers(0, 10, shape)),
}


def draw(case, rng, shape):
    """An input for the case: its own draw (a third entry), else standard normal floats."""
    entry = LAYER_CASES[case]
    if len(entry) > 2:
        return entry[2](rng, shape)
    return rng.standard_normal(shape).astype(np.float32)


def layer_classes():
    return sorted(name for name in nn.__all__
                  if inspect.isclass(getattr(nn, name))
                  and issubclass(getattr(nn, name), nn.Module) and name != "Module")


def test_every_layer_has_a_case():
    covered = {case.split(":")[0] for case in LAYER_CASES}
    missing = [name for name in layer_classes() if name not in covered]
    assert not missing, f"add these layers to LAYER_CASES: {missing}"


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
@pytest.mark.parametrize("batch", [1, 3])
def test_call_returns_an_array_the_caller_owns(case, batch):
    make, shape = LAYER_CASES[case][:2]
    layer = make()
    rng = np.random.default_rng(0)
    x1, x2, x3 = (draw(case, rng, (batch, *shape)) for _ in range(3))
    a = layer(x1)
    a_before = a.copy()
    b = layer(x2)
    layer.forward(x3)             # the next forward overwrites the layer's buffers ...
    x1[...] = 7.0                 # ... and the caller may change its input
    np.testing.assert_array_equal(a, a_before)   # ... a is the caller's
    assert isinstance(a, np.ndarray) and a.flags.owndata and a.flags.writeable
    assert not np.shares_memory(a, b)
    assert not np.shares_memory(a, x1)
    assert a.shape[0] == batch


# forward returns a new array: the last projection writes it and keeps no output
# buffer (a decoder block's residual sum reads it at once)
NEW_ARRAY = {"CausalSelfAttention", "SwiGLU"}


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_forward_may_reuse_its_buffer(case):
    """What the docstrings promise: forward's result is the layer's (a reused buffer
    or a view of x), so the caller copies it or calls layer(x)."""
    make, shape = LAYER_CASES[case][:2]
    layer = make()
    x = draw(case, np.random.default_rng(0), (2, *shape))
    out1 = layer.forward(x)
    out2 = layer.forward(x)
    if case in NEW_ARRAY:
        assert not np.shares_memory(out1, out2) and not np.shares_memory(out1, x)
    else:
        assert out1 is out2 or np.shares_memory(out1, out2) or np.shares_memory(out1, x)


@pytest.mark.parametrize("name", layer_classes())
def test_forward_docstring_documents_buffer_reuse(name):
    """The layer's forward (or class) docstring says what forward returns and that
    layer(x) is the caller's copy."""
    cls = getattr(nn, name)
    doc = " ".join(((inspect.getdoc(cls.forward) or "") + " " + (cls.__doc__ or "")).split())
    assert "caller owns" in doc, f"{name}: say that layer(x) returns a copy the caller owns"
    assert "reuse" in doc or "view of x" in doc or "x itself" in doc or (
        name in NEW_ARRAY and "new array" in doc), \
        f"{name}.forward: say which buffer it returns"


def test_call_and_module_docstrings_promise_ownership():
    assert "caller owns" in " ".join(inspect.getdoc(nn.Module.__call__).split())
    doc = " ".join(inspect.getdoc(nn.Module).split())
    assert "reuses" in doc and "caller owns" in doc


def test_fitted_model_call_survives_training_on():
    """a = model(x) taken during training is not changed by later evals."""
    rng = np.random.default_rng(1)
    model = go.nn.Sequential(go.nn.Linear(4, 3, rng=0))
    ctx = go.OptContext(model, loss_type=go.LossType.SUM)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    a = model(x)
    kept = a.copy()
    ctx.alloc(True)
    ctx.eval(inputs=x)
    np.testing.assert_array_equal(a, kept)
    assert not np.array_equal(model(x), kept)   # the parameters did move


def _copied(layer, how):
    import copy
    import pickle
    return copy.deepcopy(layer) if how == "deepcopy" else pickle.loads(pickle.dumps(layer))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_a_copy_after_a_forward_computes_afresh(case, how):
    """A layer writes into views of the buffers it returns; a deep copy or a
    pickled copy made after a forward must not return its stale copies (each
    once did: the copied view was no view any more, so the copy's output never
    changed)."""
    make, shape = LAYER_CASES[case][:2]
    layer = make()
    rng = np.random.default_rng(1)
    x1, x2 = draw(case, rng, (2, *shape)), draw(case, rng, (2, *shape))
    layer.forward(x1)
    twin = _copied(layer, how)
    want = np.array(layer.forward(x2), copy=True)
    np.testing.assert_array_equal(twin.forward(x2), want)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_language_model_after_a_forward_follows_its_weights(how):
    from ggmlopt.models import Llama, LlamaConfig
    model = Llama(LlamaConfig(vocab_size=40, dim=16, n_layers=1, n_heads=2, ffn_dim=24,
                              max_seq_len=8), seed=0)
    ids = np.arange(8)[None] % 40
    before = model(ids)
    twin = _copied(model, how)
    for p in twin.parameters():
        p.data[...] = p.data * 1.5
    model_scaled = Llama(model.config, seed=0)
    for p, q in zip(model_scaled.parameters(), twin.parameters()):
        p.data[...] = q.data
    np.testing.assert_array_equal(twin(ids), model_scaled(ids))
    assert np.abs(twin(ids) - before).max() > 0


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("base", ["Linear", "QuantizedLinear"])
def test_a_copy_of_a_lora_layer_after_a_forward_computes_afresh(base, how):
    """LoRALinear writes the adapter's product into its base's output buffer: a
    copy after a forward computes both parts anew (a pickled one returned the
    original's last output)."""
    from ggmlopt.lora import LoRALinear
    w = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float16)
    inner = nn.Linear(7, 5, rng=0) if base == "Linear" else nn.QuantizedLinear(w, "F16", 7, 5)
    layer = LoRALinear(inner, rank=2, alpha=4.0, rng=1)
    layer.lora_b.data[...] = 0.25
    rng = np.random.default_rng(2)
    x1, x2 = (rng.standard_normal((3, 7)).astype(np.float32) for _ in range(2))
    layer.forward(x1)
    twin = _copied(layer, how)
    want = np.array(layer.forward(x2), copy=True)
    np.testing.assert_array_equal(twin.forward(x2), want)


def test_get_and_set_submodule_follow_the_names_named_modules_gives():
    """A Sequential's layers by index, a Checkpoint passed through, as torch's
    get_submodule / set_submodule (a Sequential's layer was set as a stray
    attribute "1", and its names raised AttributeError)."""
    from ggmlopt.nn.module import get_submodule, named_modules, set_submodule
    inner = nn.Sequential(nn.Linear(4, 4, rng=0), nn.ReLU())
    model = nn.Sequential(nn.Linear(3, 4, rng=1), nn.Dropout(0.5), inner,
                          nn.Checkpoint(nn.Sequential(nn.Linear(4, 2, rng=2))))
    for name, module in named_modules(model):
        assert get_submodule(model, name) is module, name
    relu = nn.ReLU()
    set_submodule(model, "1", relu)
    assert model.layers[1] is relu and "1" not in vars(model)
    tanh = nn.Tanh()
    set_submodule(model, "2.1", tanh)
    assert inner.layers[1] is tanh
    last = nn.Linear(4, 2, rng=3)
    set_submodule(model, "3.0", last)
    assert get_submodule(model, "3.0") is last
    with pytest.raises(AttributeError, match=r"'2\.7': 2 \(Sequential\) has no sub-module '7'"):
        get_submodule(model, "2.7")
    with pytest.raises(AttributeError):
        set_submodule(model, "9", nn.ReLU())


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_model_copies_after_a_fit_that_stepped_in_the_backward_pass(how):
    """The parameters keep their context's gradient lender after such a fit: a
    pickle failed on it (a weak reference) and a deep copy dragged it along."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype(np.float32)
    y = rng.normal(size=(32, 3)).astype(np.float32)
    model = nn.Sequential(nn.Linear(6, 8, rng=0), nn.ReLU(), nn.Linear(8, 3, rng=2))
    go.fit(model, go.Dataset.from_arrays(x, y), "mean_squared_error", nepoch=1,
           nbatch_logical=8, silent=True, seed=0, optimizer_in_backward=True)
    twin = _copied(model, how)
    assert all(p._lender is None for p in twin.parameters())
    np.testing.assert_array_equal(twin(x), model(x))
    twin.forward(x)
    twin.backward(np.ones((32, 3), np.float32))
    assert not np.shares_memory(twin[0].weight.grad, model[0].weight.grad)


def test_parameters_where_the_tree_is_not_walked_are_said_not_left_silent():
    """A sub-layer in an attribute named with a leading '_' or in a dict: torch
    registers it, ggmlopt's parameters() does not reach it. Training it
    silently left it as initialised; the context now warns (and the error of a
    model with nothing else says where its parameters are)."""
    class Hidden(go.nn.Module):
        def __init__(self, visible):
            self._proj = nn.Linear(4, 4, rng=0)
            self.heads = {"out": nn.Linear(4, 2, rng=1)}
            if visible:
                self.scale = nn.Linear(2, 2, rng=2)

        def forward(self, x):
            return self.heads["out"].forward(self._proj.forward(x))

        def backward(self, g):
            return self._proj.backward(self.heads["out"].backward(g))

    with pytest.raises(ValueError, match="no parameters to train.*_proj, heads hold"):
        go.OptContext(Hidden(False), loss_type=go.LossType.MEAN_SQUARED_ERROR)
    with pytest.warns(UserWarning, match="_proj, heads hold trainable parameters that "
                                         "parameters\\(\\) does not reach"):
        go.OptContext(Hidden(True), loss_type=go.LossType.MEAN_SQUARED_ERROR)


class _ScaledParameter(go.nn.Parameter):
    decay = 1.0


def test_a_parameter_subclass_keeps_its_attributes_in_copies_and_older_pickles_load():
    """Parameter's copy state leaves the context's lender out: it also dropped a
    subclass's own attributes (silently back to the class default), and a pickle
    written before it (Python's (None, slots) state) failed to load."""
    import copy
    import pickle

    from ggmlopt.nn.parameter import Parameter
    p = _ScaledParameter(np.ones(3, np.float32), name="w")
    p.decay = 0.0
    for twin in (copy.copy(p), copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert twin.decay == 0.0 and twin.name == "w" and twin._lender is None
        np.testing.assert_array_equal(twin.data, p.data)
    old = Parameter(np.arange(4, dtype=np.float32), name="b")
    slots = {k: getattr(old, k) for k in Parameter.__slots__ if k not in ("_lender", "_grad_cleared")}
    back = Parameter.__new__(Parameter)
    back.__setstate__((None, slots))   # the state an older ggmlopt pickled
    assert back.name == "b" and back._lender is None and not back._grad_cleared
    np.testing.assert_array_equal(back.data, old.data)


def test_set_submodule_puts_no_layer_by_a_name_the_model_does_not_have():
    """A Llama's blocks are named "layers.0": "0" names nothing, and set_submodule
    refuses it (it replaced the first block)."""
    from ggmlopt.models import Llama, LlamaConfig
    from ggmlopt.nn.module import set_submodule
    model = Llama(LlamaConfig(vocab_size=31, dim=16, n_layers=2, n_heads=2), seed=0)
    first = model.layers[0]
    with pytest.raises(AttributeError):
        set_submodule(model, "0", nn.Linear(16, 16, rng=0))
    assert model.layers[0] is first
