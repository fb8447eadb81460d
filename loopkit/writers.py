"""Metric writers behind one small protocol (``write_scalars`` / ``flush`` / ``close``).

Only process 0 writes on multi-host; the others get a no-op writer.
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol

import jax


class MetricWriter(Protocol):
  """What a metric writer provides. Steps are global steps (optimizer updates)."""

  def write_scalars(self, step: int, scalars: dict[str, Any]) -> None: ...

  def flush(self) -> None: ...

  def close(self) -> None: ...


class JsonlWriter:
  """Appends one JSON object per line: ``{"step": int, name: value, ...}``.

  Args:
    path: the ``.jsonl`` file (parent directories are created).

  Writes only on process 0. Not thread-safe.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    self._f = None
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
      self._f = open(self.path, "a")

  def write_scalars(self, step: int, scalars: dict[str, Any]) -> None:
    if self._f is None:
      return
    row = {"step": int(step)}
    row.update({k: (v.item() if hasattr(v, "item") else v) for k, v in scalars.items()})
    self._f.write(json.dumps(row) + "\n")

  def flush(self) -> None:
    if self._f is not None:
      self._f.flush()

  def close(self) -> None:
    if self._f is not None:
      self._f.close()
      self._f = None
