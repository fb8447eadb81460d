"""Sphinx configuration for the loopkit docs (MyST markdown + autodoc)."""

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
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
html_static_path = ["_static"]
nitpicky = False
suppress_warnings = ["myst.xref_missing"]
