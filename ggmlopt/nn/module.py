"""Module: the base of the layers, the naming of parameters in a module tree, and
the protocol by which an OptContext tells a model whether it trains and where its
random numbers come from.

The model protocol the engine needs is only ``parameters()``, ``forward(x)`` and
``backward(grad_out)``; Module adds what users of torch or Keras expect on top:
names (``named_parameters()``: ``0.weight``, ``2.bias`` in a Sequential,
attribute names in a user's module), a ``training`` flag, and ``module(x)``
returning an array the caller owns.

The training protocol (for every module, also those that do not subclass Module).
On every ``alloc`` an OptContext does the equivalent of (TrainingProtocol, over
the module tree as it was when the context was built):

- ``set_training(model, backward)``: ``model.train(mode)`` when the model has a
  ``train`` method (Module's sets ``training`` on itself and passes the mode to
  every sub-module), else it sets ``model.training = mode`` and does the same for
  each sub-module.  So a module reads ``self.training`` in ``forward``: True in
  evals that train (``alloc(True)``), False otherwise.
- ``set_rng(model, ctx.rng)``: every module in the tree with a ``set_rng(rng)``
  method receives the context's seeded numpy Generator.  A module that draws
  random numbers (Dropout) defines ``set_rng``, keeps the generator and draws
  from it in ``forward`` only while training.  The generator's state is part of
  the context's checkpoints, so after ``OptContext.load`` or
  ``fit(resume=True)`` the draws continue as in an uninterrupted run.  Rebinding
  on every alloc means the last context that ran an eval is the one drawn from.

A user's layer with randomness of its own, without subclassing Module::

    class GaussianNoise:
        def __init__(self, sigma):
            self.sigma, self.training, self.rng = sigma, False, None
        def set_rng(self, rng):            # the context's generator, every alloc
            self.rng = rng
        def parameters(self):
            return []
        def forward(self, x):
            if not self.training:          # evals that do not train: no noise
                return x
            return x + self.sigma * self.rng.standard_normal(x.shape, np.float32)
        def backward(self, grad_out):
            return grad_out

The gradient-ready hook (for data-parallel training, see ggmlopt.distributed).
During a backward pass, ``grads_ready(module)`` announces that the gradients of
every parameter in module's tree are final for this backward pass: nothing
later in it adds into them.  Containers call it for each child right after the
child's backward (Sequential for each layer, in reverse layer order; the
language models for each block), and a layer may call ``grads_ready(self)`` at
the end of its own backward.  Outside an OptContext's exchanging backward pass
it does nothing (one lookup).  An OptContext with ``comm=`` installs a callback
(``on_grads_ready``) for the backward pass of the last physical batch of each
logical batch and starts the exchange of each bucket of gradients as soon as
all of its parameters are announced, while the backward pass goes on.

Rules for a user's layer or container: announce a child only after its
backward returned, and never add into a parameter's gradient after a module
holding it was announced (a parameter held by several modules, such as a tied
embedding, is final only once every module holding it is announced; one
reached only through a parent's own code is final when the parent is).  A
layer or container that announces nothing still trains exactly: its
parameters are then exchanged after the backward pass, as one process would.
A container that does not call the hook for its children hides their
exchange less; nothing else changes.  Sketch::

    class TwoBranches(Module):
        def backward(self, grad_out):
            ga = self.a.backward(grad_out)
            grads_ready(self.a)            # a's gradients are final
            gb = self.b.backward(grad_out)
            grads_ready(self.b)
            return ga + gb

The one forward pass on zeros a static context makes at construction (to learn
the number of outputs) runs with every module's ``training`` False and before
any ``set_rng``, so it draws nothing; the flags are restored afterwards.
Sub-modules are found as ``named_children()`` (Sequential: its layers) or, for
objects without it, as the attributes (and lists or tuples of them) that hold
objects with a ``forward`` method.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np

from ._parts_version import parts_changed
from .parameter import Parameter

__all__ = ["Module", "TrainingProtocol", "eval_mode", "grads_ready", "modules",
           "named_modules", "named_parameters", "on_grads_ready", "set_rng", "set_training"]

# the callback of the backward pass running in this thread (a context variable: ranks
# run as threads in the tests, each with its own)
_GRADS_READY: ContextVar[Callable[[object], None] | None] = ContextVar(
    "ggmlopt_grads_ready", default=None)


class Module:
    """Base of the layers.

    needs_input_grad: whether backward must return the gradient w.r.t. the input
    (Sequential clears it for its first layer, whose input is data).
    training: whether the current eval trains (an OptContext sets it on every
    alloc, see set_training); layers that behave differently while training
    (Dropout) read it in forward.  A layer that draws random numbers defines
    ``set_rng(rng)`` and draws from the generator it was given (see set_rng).

    Output ownership: ``forward(x)`` may return a buffer the layer reuses (the
    next forward overwrites it) or a view of x; that is what keeps training
    free of allocations.  output_is_scratch: True for a layer whose forward
    output is a buffer of its own that its backward never reads (Linear), so a
    caller may overwrite it in place (Residual adds its input into it); False
    (the default) otherwise.  ``module(x)`` (``__call__``) returns a new array the
    caller owns: ``a = m(x1); b = m(x2)`` never changes ``a``.  ``backward``
    of Linear, the norms, the attention, SwiGLU and the decoder blocks returns
    a new array and keeps no backward buffer: between steps a model holds only
    what its forward passes keep (the input gradients of one block at a time
    exist during the backward pass).
    """

    needs_input_grad = True
    training = False
    output_is_scratch = False
    # something keeps a reading of this module's attributes (_parts_version.watch)
    _parts_watched = False

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if self._parts_watched:
            parts_changed()

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        if self._parts_watched:
            parts_changed()

    def __deepcopy__(self, memo):
        """A deep copy whose forward buffers are made anew on its next forward: a
        layer writes into 2-D views of the arrays it returns, and a deep copy
        of a view is a separate array, so copied buffers would return stale
        values (``_shape`` is what every layer compares to rebuild them)."""
        import copy
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            setattr(new, key, copy.deepcopy(value, memo))
        if "_shape" in new.__dict__:
            new._shape = None
        return new

    def __setstate__(self, state):
        """An unpickled (or copy.copy'd) layer makes its forward buffers anew, as a
        deep copy does: pickle stores a view and its base as two arrays."""
        self.__dict__.update(state)
        if "_shape" in self.__dict__:
            self.__dict__["_shape"] = None

    def parameters(self) -> list[Parameter]:
        """The trainable parameters, each once, in the order of named_parameters()."""
        return [p for _, p in self.named_parameters()]

    def named_children(self) -> Iterator[tuple[str, object]]:
        """(attribute name, sub-module) for each direct sub-module, in definition
        order; a list or tuple of modules gives names ``attr.0``, ``attr.1``..."""
        for name, value in vars(self).items():
            if name.startswith("_"):
                continue
            if _is_module(value):
                yield name, value
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if _is_module(item):
                        yield f"{name}.{i}", item

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """(dotted name, Parameter) for every parameter of this module and its
        sub-modules, each parameter once (torch's state_dict names)."""
        yield from _named(self, prefix, set())

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, object]]:
        """(dotted name, module) for this module (name ``prefix`` without its
        trailing dot, "" at the top) and every sub-module below it, each once,
        parents before children (torch's named_modules names)."""
        yield from _named_modules(self, prefix, set())

    def zero_grad(self) -> None:
        """Zero the gradient of every trainable parameter in this module and its
        sub-modules (in place: inside an OptContext these are the arena's views)
        and set each one's ``grad_is_zero``.  Frozen parameters have no gradient
        (``grad`` None) and are left alone."""
        for p in self.parameters():
            grad = getattr(p, "grad", None)
            if grad is None or not getattr(p, "requires_grad", True):
                continue
            grad.fill(0.0)
            if hasattr(p, "grad_is_zero"):
                p.grad_is_zero = True

    def train(self, mode: bool = True):
        """Set ``training`` on this module and every sub-module (set_training on
        each child); returns self."""
        self.training = bool(mode)
        child: Any
        for _, child in self.named_children():
            set_training(child, mode)
        return self

    def eval(self):
        """train(False)."""
        return self.train(False)

    def forward(self, x):
        """The layer's output for x (batch, ...): float32, possibly a buffer the
        layer reuses at the next forward.  Subclasses define it."""
        raise NotImplementedError

    def backward(self, grad_out):
        """Add d loss / d parameters into each parameter's .grad and return the
        gradient w.r.t. the last forward's input (None unless needs_input_grad).
        Subclasses define it."""
        raise NotImplementedError

    def __call__(self, x) -> np.ndarray:
        """forward(x), copied into a new array the caller owns (it shares memory with
        neither x nor the layer's buffers): ``a = m(x1); b = m(x2)`` never changes
        ``a``.  Use ``forward`` where the copy matters and the next call may
        overwrite the result."""
        with in_use(self, "model(x)"):
            return np.array(self.forward(x), copy=True)


def _is_module(obj) -> bool:
    return isinstance(obj, Module) or callable(getattr(obj, "forward", None))


def _children(obj) -> Iterator[object]:
    if isinstance(obj, Module) or callable(getattr(obj, "named_children", None)):
        for _, child in obj.named_children():
            yield child
    elif hasattr(obj, "__dict__"):
        for _, child in Module.named_children(obj):
            yield child


def modules(model) -> Iterator[object]:
    """model and every module below it, each once, parents before children."""
    seen = set()
    stack = [model]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        yield m
        stack.extend(reversed(list(_children(m))))


def with_followers(found: Iterable[Any]) -> list[Any]:
    """The modules in found and those whose training flag one of them sets
    without holding them as sub-modules (its ``training_followers()``: an
    adapter's base layer, which keeps its weights out of the names), with the
    modules below those, each once: every flag ``set_training`` may change, for
    a caller that puts them back."""
    out: list[Any] = []
    seen: set[int] = set()
    stack = list(found)[::-1]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        followers = getattr(m, "training_followers", None)
        if callable(followers):
            stack.extend(reversed([f for follower in followers() for f in modules(follower)]))
    return out


def set_training(model, mode: bool) -> None:
    """Tell model whether the current eval trains: ``model.train(mode)`` when it has
    a train method, else ``model.training = mode`` and the same for each
    sub-module.  OptContext calls it on every alloc with ``backward``."""
    mode = bool(mode)
    train = getattr(model, "train", None)
    if callable(train):
        train(mode)
        return
    try:
        model.training = mode
    except AttributeError:  # a module that cannot hold the flag does not read it
        pass
    for child in _children(model):
        set_training(child, mode)


def set_rng(model, rng: np.random.Generator) -> None:
    """Give rng to every module in model's tree that has a ``set_rng(rng)`` method
    (the modules that draw random numbers, such as Dropout).  OptContext calls it
    with its own ``rng`` on every alloc, so the draws are part of the context's
    seeded, checkpointed stream."""
    for m in modules(model):
        bind = getattr(m, "set_rng", None)
        if callable(bind):
            bind(rng)


def grads_ready(module) -> None:
    """Announce, during a backward pass, that the gradients of every parameter in
    module's tree are final (see the module docstring): the callback installed
    by ``on_grads_ready`` receives module; without one, nothing happens."""
    hook = _GRADS_READY.get()
    if hook is not None:
        hook(module)


@contextmanager
def on_grads_ready(callback: Callable[[object], None]) -> Iterator[None]:
    """with on_grads_ready(callback): model.backward(g) -- callback(module) runs
    for every ``grads_ready(module)`` in the block (in this thread), in the order
    of the announcements.  An OptContext with comm= uses it to start each bucket's
    gradient exchange during the backward pass."""
    token = _GRADS_READY.set(callback)
    try:
        yield
    finally:
        _GRADS_READY.reset(token)


class TrainingProtocol:
    """TrainingProtocol(model): set_training and set_rng for one model, with the
    module tree read once (an OptContext makes one when it takes the model and
    calls ``apply`` on every alloc, where a walk of the tree would cost more than
    the rest of a small eval).

    apply(mode, rng) has the effect of ``set_training(model, mode)`` then
    ``set_rng(model, rng)`` on the tree as it was when the protocol was made.
    When no module in it overrides ``Module.train`` (or has a ``train`` method of
    its own), the flags are set directly; otherwise ``set_training`` runs, so an
    overriding ``train`` is always called.
    """

    __slots__ = ("_direct", "_model", "_rng_setters", "_tree")

    def __init__(self, model):
        self._model = model
        self._tree = list(modules(model))
        self._rng_setters = [m.set_rng for m in self._tree
                             if callable(getattr(m, "set_rng", None))]
        self._direct = all(
            getattr(type(m), "train", None) is Module.train if isinstance(m, Module)
            else not callable(getattr(m, "train", None))
            for m in self._tree)

    def apply(self, mode: bool, rng: np.random.Generator) -> None:
        """Tell the model whether this eval trains (mode) and give it rng."""
        mode = bool(mode)
        if self._direct:
            for m in self._tree:
                try:
                    m.training = mode
                except AttributeError:  # a module that cannot hold the flag
                    pass
        else:
            set_training(self._model, mode)
        for bind in self._rng_setters:
            bind(rng)


_MISSING = object()


# model id -> (the thread computing with it, how deep): in_use
_IN_USE: dict[int, tuple[int, int, str]] = {}
_IN_USE_LOCK = threading.Lock()


@contextmanager
def in_use(model, what: str):
    """with in_use(model, what): the block computes with model in this thread.
    A model's layers keep their buffers and activations between calls, so two
    threads computing with one model at once gave each other's numbers: a
    second thread is refused (RuntimeError) while the first is inside; the same
    thread may nest."""
    key, me = id(model), threading.get_ident()
    with _IN_USE_LOCK:
        holder = _IN_USE.get(key)
        if holder is not None and holder[0] != me:
            raise RuntimeError(f"model: another thread is computing with it ({holder[2]}); "
                               f"a model computes in one thread at a time (its layers keep "
                               f"their buffers between calls): give each thread its own copy "
                               f"(copy.deepcopy(model)), or wait for the other")
        _IN_USE[key] = (me, 1 if holder is None else holder[1] + 1,
                        what if holder is None else holder[2])
    try:
        yield
    finally:
        with _IN_USE_LOCK:
            _, depth, first = _IN_USE[key]
            if depth == 1:
                del _IN_USE[key]
            else:
                _IN_USE[key] = (me, depth - 1, first)


@contextmanager
def eval_mode(model):
    """with eval_mode(model): ... runs the block with training False everywhere in
    model's tree (set_training(model, False)), then puts back every module's own
    ``training`` attribute as it was; the model is in use by this thread
    (in_use) throughout."""
    with in_use(model, "a generation or an evaluation"), _training_off(model):
        yield model


@contextmanager
def _training_off(model):
    saved = [(m, getattr(m, "training", _MISSING)) for m in with_followers(modules(model))]
    try:
        set_training(model, False)
        yield model
    finally:
        for m, flag in saved:
            try:
                if flag is _MISSING:
                    if "training" in getattr(m, "__dict__", {}):
                        del m.training
                else:
                    m.training = flag
            except AttributeError:
                pass


def _direct_parameters(obj) -> Iterator[tuple[str, Parameter]]:
    # a wrapper that adds no level to the names (nn.Checkpoint) holds its
    # module's parameters as its own: Checkpoint(Linear) has a weight
    while getattr(type(obj), "wraps_transparently", False):
        obj = obj.module
    for name, value in vars(obj).items():
        if name.startswith("_"):
            continue
        if isinstance(value, Parameter):
            yield name, value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, Parameter):
                    yield f"{name}.{i}", item


def _named(obj, prefix, seen) -> Iterator[tuple[str, Parameter]]:
    own = getattr(obj, "named_parameters", None)
    if not isinstance(obj, Module) and callable(own):
        # a user's module with its own naming
        for name, p in own():
            if id(p) not in seen:
                seen.add(id(p))
                yield prefix + name, p
        return
    for name, p in _direct_parameters(obj):
        if id(p) not in seen:
            seen.add(id(p))
            yield prefix + name, p
    children = obj.named_children() if isinstance(obj, Module) else \
        Module.named_children(obj)
    for name, child in children:
        yield from _named(child, f"{prefix}{name}.", seen)


def _named_modules(obj, prefix, seen) -> Iterator[tuple[str, object]]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield prefix.removesuffix("."), obj
    children = obj.named_children() if isinstance(obj, Module) else \
        Module.named_children(obj)
    for name, child in children:
        yield from _named_modules(child, f"{prefix}{name}.", seen)


def _children_of(obj) -> dict[str, object]:
    if isinstance(obj, Module):
        return dict(obj.named_children())
    return dict(Module.named_children(obj)) if hasattr(obj, "__dict__") else {}


def get_submodule(model, target: str):
    """The module at dotted name target, as named_modules names it
    (``layers.0.mlp.up_proj``; a Sequential's layers and a list's elements by
    index, through a Checkpoint as if it were not there), as torch's
    ``Module.get_submodule``.  AttributeError names the part not found."""
    obj = model
    walked: list[str] = []
    for part in target.split(".") if target else ():
        children = _children_of(obj)
        if part in children:
            obj = children[part]
        elif isinstance(obj, (list, tuple)) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            where = ".".join(walked) or "the model"
            raise AttributeError(f"{target!r}: {where} ({type(obj).__name__}) has no "
                                 f"sub-module {part!r}; it has {sorted(children) or 'none'}")
        walked.append(part)
    return obj


def set_submodule(model, target: str, module) -> None:
    """Put module at dotted name target, in place of what is there (torch's
    ``Module.set_submodule``): a Sequential's layer by its index, a list's
    element, an attribute, through a Checkpoint to the module it wraps."""
    if not target:
        raise ValueError("target: expected the dotted name of a sub-module, got ''")
    parent_name, _, last = target.rpartition(".")
    parent = get_submodule(model, parent_name)
    while getattr(type(parent), "wraps_transparently", False):
        parent = parent.module
    layers = getattr(parent, "layers", None)
    # a Sequential's own ("0", layer) names (a model's "layers" list is named
    # "layers.0": its "0" is no sub-module)
    if last.isdigit() and isinstance(layers, list) and last in _children_of(parent):
        if int(last) >= len(layers):
            raise AttributeError(f"{target!r}: {parent_name or 'the model'} has "
                                 f"{len(layers)} layers")
        layers[int(last)] = module   # a Sequential's: ("0", layer), ...
    elif isinstance(parent, list):
        parent[int(last)] = module
    else:
        get_submodule(parent, last)   # (AttributeError naming it, as torch's)
        setattr(parent, last, module)


def hidden_parameters(model, reached=()) -> list[str]:
    """Where trainable parameters sit that named_parameters (and so training)
    does not reach: an attribute whose name starts with "_", or a dict (torch
    registers any attribute; ggmlopt's modules name their public ones, and lists
    or tuples of them).  Each as "module.attribute" ("" the model itself).
    reached: parameters that train anyway (what the model's own parameters()
    gives, which may reach what the walk does not)."""
    known = {id(p) for p in _all_named(model)} | {id(p) for p in reached}
    found = []
    for name, module in named_modules(model):
        if not hasattr(module, "__dict__"):
            continue
        for key, value in vars(module).items():
            if not (key.startswith("_") or isinstance(value, dict)):
                continue
            items = value.values() if isinstance(value, dict) else \
                value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if isinstance(item, Parameter):
                    held = [item]
                elif callable(getattr(item, "forward", None)) and \
                        callable(getattr(item, "parameters", None)):
                    try:
                        held = list(item.parameters())
                    except (TypeError, AttributeError, ValueError):
                        held = []
                else:
                    continue
                if any(id(p) not in known and getattr(p, "requires_grad", True) for p in held):
                    found.append(f"{name}.{key}" if name else key)
                    break
    return found


def _all_named(model) -> list[Parameter]:
    try:
        return [p for _, p in _named(model, "", set())]
    except (TypeError, AttributeError, ValueError):
        return []


def named_layers(model) -> list[tuple[str, object]]:
    """named_modules, and inside a wrapper that adds no level to the names
    (nn.Checkpoint) the layer it wraps, under the wrapper's name: every layer
    whose kind decides how its weights are stored (a Linear's are transposed in
    torch's layout, Checkpoint(Linear)'s as well)."""
    out: list[tuple[str, Any]] = []
    for name, m in named_modules(model):
        layer: Any = m
        out.append((name, layer))
        while getattr(type(layer), "wraps_transparently", False):
            layer = layer.module
            out.append((name, layer))
    return out


def named_modules(model) -> list[tuple[str, object]]:
    """(dotted name, module) for any model and every sub-module in it, each once,
    parents first: ``("", model)``, then e.g. ``("0", first layer)`` in a
    Sequential or ``("encoder", ...)`` for an attribute of a user's module.  The
    names are the prefixes of named_parameters' names."""
    return list(_named_modules(model, "", set()))


def named_parameters(model) -> list[tuple[str, Parameter]]:
    """(dotted name, Parameter) for every parameter of any model: a Module, an
    object with its own ``named_parameters()``, or any object whose attributes
    hold Parameters and sub-modules (named after the attributes).

    Raises ValueError when model.parameters() holds a parameter that no name
    reaches (it lives somewhere the walk cannot see, e.g. a dict)."""
    named = list(_named(model, "", set()))
    found = {id(p) for _, p in named}
    get = getattr(model, "parameters", None)
    if callable(get):
        missing = [i for i, p in enumerate(get()) if id(p) not in found]
        if missing:
            raise ValueError(f"model: parameters() at positions {missing} have no name (they "
                             "are not attributes of the model or of its sub-modules); give "
                             "the model a named_parameters() method")
    return named
