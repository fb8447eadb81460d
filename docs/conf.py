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


def _resolve_reexport(app, env, node, contnode):
  """Links a re-exported name (``loopkit.TrainLoop``) to where the API page documents it.

  The API page documents each object under the module that defines it
  (``loopkit.core.loop.TrainLoop``); docstrings and pages also name it by its shorter
  import path (the front door, a subpackage's ``__init__``).
  """
  target = node.get("reftarget", "")
  if node.get("refdomain") != "py" or not target.startswith("loopkit."):
    return None
  import importlib  # pylint: disable=g-import-not-at-top
  parts = target.split(".")
  for i in range(len(parts) - 1, 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
      break
    except ImportError:
      continue
  else:
    return None
  obj = getattr(obj, parts[i], None)
  module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
  if not module or not qualname:
    return None
  resolved = ".".join([module, qualname, *parts[i + 1:]])
  if resolved == target:
    return None
  retry = node.deepcopy()
  retry["reftarget"] = resolved
  return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, node["reftype"],
                                          resolved, retry, contnode)


def setup(app):
  app.connect("missing-reference", _resolve_reexport)
