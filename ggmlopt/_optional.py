"""Optional dependencies: imported only when a feature needs them."""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["import_optional"]


def import_optional(module: str, extra: str, feature: str) -> ModuleType:
    """The module named ``module``, or an ImportError that says which feature
    needed it and which extra installs it (``pip install ggmlopt[extra]``)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = module.split(".")[0]
        raise ImportError(f"{feature} needs the '{package}' package, which is not installed: "
                          f"pip install ggmlopt[{extra}]  (or pip install {package})") from e
