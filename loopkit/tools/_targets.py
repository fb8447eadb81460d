"""``module:function`` targets of the tools' command lines (``python -m loopkit.tools.tune``,
``python -m loopkit.tools.follow``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_target(spec: str) -> Callable[[], Any]:
  """The function named by ``spec`` (``"package.module:function"``), imported.

  Raises:
    SystemExit: ``spec`` is not ``module:function``, or the module has no such attribute
      (the message names both). An import error of the module itself propagates.
  """
  module, _, name = spec.partition(":")
  if not module or not name:
    raise SystemExit(f"target must be module:function, got {spec!r}")
  fn = getattr(importlib.import_module(module), name, None)
  if fn is None:
    raise SystemExit(f"module {module!r} has no attribute {name!r}")
  return fn
