"""The import circles that were real at run time stay open: each module of them
imports alone in a fresh interpreter, no two of them import each other (at the top
or inside a function), and none reaches for another's private names."""
import ast
import os
import subprocess
import sys

import pytest

import ggmlopt

PACKAGE = os.path.dirname(ggmlopt.__file__)
# the old circles: (module, module)
PAIRS = [("training", "_fit_loop"), ("checkpoint", "rank_rng"),
         ("io.gguf_format", "io.gguf_llama")]


def _imports(module):
    """(imported module, [names]) of every relative import in module's file,
    resolved to dotted names under ggmlopt."""
    path = os.path.join(PACKAGE, *module.split(".")) + ".py"
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    package = module.rsplit(".", 1)[0] if "." in module else ""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".") if package else []
            base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                # "from . import rank_rng" imports the module rank_rng
                if not node.module:
                    out.append((".".join(base + [alias.name]), []))
                else:
                    out.append((target, [alias.name]))
    return out


@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_no_circle_and_no_private_names_across_it(a, b):
    for one, other in ((a, b), (b, a)):
        for target, names in _imports(one):
            if target == other:
                private = [n for n in names if n.startswith("_")]
                assert not private, f"{one} imports {other}'s private {private}"
    a_to_b = any(t == b for t, _ in _imports(a))
    b_to_a = any(t == a for t, _ in _imports(b))
    assert not (a_to_b and b_to_a), f"{a} and {b} import each other"


@pytest.mark.parametrize("module", sorted({m for pair in PAIRS for m in pair}
                                          | {"epoch_loop", "history", "_rng_state",
                                             "io._gguf_common"}))
def test_each_module_imports_alone(module):
    proc = subprocess.run([sys.executable, "-c", f"import ggmlopt.{module}"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
