"""Every public name of ggmlopt has a docstring (the API reference is built from them).

Public names: the top-level ``__all__``, ``ggmlopt.nn.__all__`` and the ``__all__`` of
the public modules listed there (checkpoint, clipping, datasets, distributed, io,
schedules); for each public class, its public methods and properties, including the
read-only attributes of the Cython classes (``Dataset.ndata`` ...), as long as ggmlopt
defines them (what a class inherits from ``int`` or ``enum`` is not ggmlopt's to document).
"""
from __future__ import annotations

import inspect
import types

import pytest

import ggmlopt
import ggmlopt.nn

# properties: Python's, and getset_descriptor for the Cython classes' properties and
# readonly attributes; methods: functions, Cython functions and method descriptors
_PROPERTY_TYPES = (property, types.GetSetDescriptorType)


def _is_method_or_property(member) -> bool:
    return (isinstance(member, (*_PROPERTY_TYPES, classmethod, staticmethod))
            or (callable(member) and not inspect.isclass(member)))


def _public_modules():
    """ggmlopt and the public modules whose names are part of its API."""
    mods = [ggmlopt, ggmlopt.nn]
    for name in ggmlopt.__all__:
        value = getattr(ggmlopt, name)
        if isinstance(value, types.ModuleType) and value not in mods:
            mods.append(value)
    return mods


def _defined_by_ggmlopt(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "ggmlopt"


def _public_objects():
    """(qualified name, object) for every public name to check, each object once."""
    seen: set[int] = set()
    found = []
    for mod in _public_modules():
        found.append((mod.__name__, mod))
        for name in getattr(mod, "__all__", ()):
            value = getattr(mod, name)
            if isinstance(value, types.ModuleType):
                continue  # checked as a module of its own
            if not (callable(value) and _defined_by_ggmlopt(value)):
                continue  # constants (FORMAT_VERSION, IDX_DTYPES ...) document themselves
            if id(value) in seen:
                continue
            seen.add(id(value))
            found.append((f"{mod.__name__}.{name}", value))
            if inspect.isclass(value):
                found.extend(_public_members(f"{mod.__name__}.{name}", value))
    return found


def _public_members(qualname, cls):
    """(name, docstring) for the public methods and properties ggmlopt defines on cls."""
    names = []
    for klass in cls.__mro__:
        if _defined_by_ggmlopt(klass):
            names += [name for name, member in vars(klass).items()
                      if not name.startswith("_") and _is_method_or_property(member)
                      and name not in names]
    return [(f"{qualname}.{name}", _member_doc(cls, name)) for name in names]


def _member_doc(cls, name) -> str:
    """The docstring help() shows for cls.name: its own, or (a method overriding a
    documented one) that of the same method or property in a ggmlopt base class."""
    for klass in cls.__mro__:
        member = vars(klass).get(name)
        if member is None or not _defined_by_ggmlopt(klass):
            continue
        if not _is_method_or_property(member):
            return ""  # a plain class attribute (Module.needs_input_grad = True)
        if isinstance(member, (classmethod, staticmethod)):
            member = member.__func__
        doc = (member.__doc__ or "").strip()
        if doc:
            return doc
    return ""


def _doc(obj) -> str:
    """A module's, class's or function's own docstring (members come as their docstring)."""
    if isinstance(obj, str):
        return obj
    return (obj.__doc__ or "").strip()


PUBLIC = _public_objects()


def test_the_walk_finds_the_api():
    """The walk sees the names users reach first, Cython properties included."""
    names = {name for name, _ in PUBLIC}
    for expected in ("ggmlopt.fit", "ggmlopt.Dataset", "ggmlopt.Dataset.ndata",
                     "ggmlopt.Dataset.get_batch", "ggmlopt.Dataset.from_arrays",
                     "ggmlopt.OptContext.alloc", "ggmlopt.OptContext.inputs",
                     "ggmlopt.nn.Sequential.needs_input_grad", "ggmlopt.nn.Linear.forward",
                     "ggmlopt.schedules.WarmupCosine", "ggmlopt.io.save_gguf"):
        assert expected in names
    assert len(PUBLIC) > 150


@pytest.mark.parametrize("name, obj", PUBLIC, ids=[name for name, _ in PUBLIC])
def test_public_name_has_a_docstring(name, obj):
    assert _doc(obj), f"{name} has no docstring"
