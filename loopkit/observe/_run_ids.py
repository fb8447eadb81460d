"""A tracker's run id kept in a file of the run's directory (MLflow's and W&B's writers), so
a restarted run finds its run again."""

from __future__ import annotations

import os


def _read_id(path: str) -> str | None:
  """The run id kept in file ``path``, or None (no file, or empty)."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    run_id = f.read().strip()
  return run_id or None


def _write_id(path: str, run_id: str) -> None:
  """Keeps ``run_id`` in file ``path`` (written to a temporary file, moved into place)."""
  if _read_id(path) == run_id:
    return
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(run_id + "\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
