"""Sphinx configuration for the loopkit docs (MyST markdown + autodoc)."""

import importlib.util
import os
import sys

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

project = "loopkit"
author = "loopkit developers"
copyright = "2026, loopkit developers"
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "scripts"]
myst_enable_extensions = ["colon_fence", "deflist"]  # deflist: concepts.md's "term\n: definition"
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# The JAX ecosystem's look (JAX, Flax and optax use sphinx-book-theme; `pip install
# 'loopkit[docs]'` brings it). Without it (a test environment that has only Sphinx and MyST)
# the same pages build with Sphinx's default theme, so tests/test_docs.py still checks them.
if importlib.util.find_spec("sphinx_book_theme") is not None:
  html_theme = "sphinx_book_theme"
  html_title = "loopkit"
  html_theme_options = {"show_toc_level": 2}
else:
  html_theme = "alabaster"
html_static_path = ["_static"]
nitpicky = False
suppress_warnings = ["myst.xref_missing"]
