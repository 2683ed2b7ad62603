# Build the site (from the repository root, against the installed package):
#
#     python -m sphinx -W --keep-going -b html docs docs/_build/html
#
# pip install -e '.[docs]' installs Sphinx, the theme, MyST and matplotlib (the
# benchmark plot is drawn at build time from docs/benchmarks.csv).
"""Sphinx configuration of ggmlopt's documentation."""
from __future__ import annotations

import os
import sys

import ggmlopt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ext"))

project = "ggmlopt"
author = "the ggmlopt authors"
copyright = "2026 the ggmlopt authors (MIT License)"
release = ggmlopt.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_parser",
    "matplotlib.sphinxext.plot_directive",
    "plaintext_docstrings",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]

# MyST: $...$ maths, ::: fences, heading anchors for links within pages
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3

# autodoc imports the compiled package (pip install -e '.[docs]' builds it)
autosummary_generate = True
autosummary_imported_members = False
autodoc_default_options = {"members": True, "undoc-members": False}
autodoc_member_order = "bysource"
# the docstrings say the shapes, dtypes and types in words; signatures stay short
autodoc_typehints = "none"
autodoc_preserve_defaults = True
add_module_names = False

html_theme = "furo"
html_title = f"ggmlopt {release}"
html_static_path = ["_static"]
html_css_files = ["side-by-side.css"]

# the benchmark plot (benchmarks.md) is drawn at build time from benchmarks.csv
plot_include_source = False
plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 110)]
