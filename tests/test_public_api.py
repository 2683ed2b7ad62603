"""Every public name has a docstring, and every public Python function and method
of the engine is annotated; help(OptContext) shows no private parameter."""
import dataclasses
import inspect
import pydoc
import types

import pytest

import ggmlopt as go

# modules whose Python functions must be fully annotated (the compiled modules are
# typed by their .pyi stubs, checked by mypy.stubtest; nn and examples are not yet)
ANNOTATED_MODULES = ("ggmlopt._args", "ggmlopt._runtime", "ggmlopt.checkpoint",
                     "ggmlopt.clipping", "ggmlopt.context", "ggmlopt.datasets",
                     "ggmlopt.inference", "ggmlopt.optim_params", "ggmlopt.progress",
                     "ggmlopt.result", "ggmlopt.schedules", "ggmlopt.training")


def public_names():
    """(qualified name, object) of every public name: ggmlopt.__all__, the __all__
    of its public sub-modules, and the public members of every public class."""
    seen, out = set(), []

    def add(qual, obj):
        if id(obj) in seen and not isinstance(obj, property):
            return
        seen.add(id(obj))
        out.append((qual, obj))
        if isinstance(obj, types.ModuleType):
            for name in getattr(obj, "__all__", []):
                add(f"{qual}.{name}", getattr(obj, name))
        elif inspect.isclass(obj) and obj.__module__.startswith("ggmlopt"):
            fields = {f.name for f in dataclasses.fields(obj)} if \
                dataclasses.is_dataclass(obj) else set()
            for name, member in vars(obj).items():
                if name.startswith("_") or name in fields:
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if callable(member) or isinstance(member, property) or \
                        type(member).__name__ == "getset_descriptor":
                    add(f"{qual}.{name}", member)

    add("ggmlopt", go)
    return out


def doc_of(obj):
    return obj.__doc__ if not isinstance(obj, (int, float, str)) else "constant"


PUBLIC = public_names()


def _documented(qual, obj):
    if isinstance(obj, (int, float, str, tuple)):
        return True
    if type(obj).__name__ == "getset_descriptor" and not obj.__doc__:
        # a Cython readonly attribute cannot carry a docstring: its class names it
        owner, name = qual.rsplit(".", 1)
        return f" {name}" in inspect.getdoc(eval(owner, {"ggmlopt": go}))
    return bool((inspect.getdoc(obj) or "").strip())


def test_every_public_name_has_a_docstring():
    missing = [q for q, obj in PUBLIC if not _documented(q, obj)]
    assert missing == []


def _python_functions():
    for qual, obj in PUBLIC:
        func = obj.fget if isinstance(obj, property) else obj
        if inspect.isclass(func):
            func = func.__init__ if "__init__" in vars(func) else None
        if isinstance(func, types.FunctionType) and func.__module__ in ANNOTATED_MODULES:
            yield qual, func


def test_public_functions_are_annotated():
    missing = []
    for qual, func in _python_functions():
        sig = inspect.signature(func)
        for name, p in sig.parameters.items():
            if name in ("self", "cls") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if p.annotation is inspect.Parameter.empty:
                missing.append(f"{qual}({name})")
        if sig.return_annotation is inspect.Signature.empty:
            missing.append(f"{qual} -> ?")
    assert missing == []


def test_help_of_optcontext_hides_private_parameters():
    text = pydoc.render_doc(go.OptContext, renderer=pydoc.plaintext)
    assert "_before_taking" not in text
    assert "clip_grad_norm" in text
    assert not [p for p in inspect.signature(go.OptContext).parameters if p.startswith("_")]


@pytest.mark.parametrize("name", ["evaluate", "predict", "fit", "epoch"])
def test_top_level_functions_documented_with_their_arguments(name):
    func = getattr(go, name)
    doc = inspect.getdoc(func)
    for param in list(inspect.signature(func).parameters)[:2]:
        assert param in doc or param in ("model", "ctx")
