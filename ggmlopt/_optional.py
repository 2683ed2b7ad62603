"""Optional dependencies: imported only when a feature needs them."""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "import_optional", "install_hint"]


# what each extra of pyproject.toml installs, by its plain package names (a user of a
# clone has no ggmlopt on PyPI to pull extras from)
EXTRAS = {
    "interop": ("gguf", "safetensors"),
    "tokenizers": ("tokenizers",),
    "plot": ("matplotlib",),
    "chat": ("jinja2",),
    "examples": ("scikit-learn",),
    "mpi": ("mpi4py", "mpich"),
}


def install_hint(extra: str, packages: str | None = None) -> str:
    """How to install what an extra brings: the extra, and the plain package names
    (a clone's user has no ggmlopt on PyPI to take extras from)."""
    plain = packages or " ".join(EXTRAS.get(extra, ()))
    return f"pip install ggmlopt[{extra}]  (or pip install {plain})"


def import_optional(module: str, extra: str, feature: str) -> ModuleType:
    """The module named ``module``, or an ImportError that says which feature
    needed it and how to install it (the extra that holds it, or its package)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = module.split(".")[0]
        raise ImportError(f"{feature} needs the '{package}' package, which is not installed: "
                          f"{install_hint(extra, package)}") from e
