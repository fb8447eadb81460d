"""Where loopkit 0.1's top-level names live since 0.2, for the front door's ``__getattr__``.

loopkit 0.1 exported about 90 names from the package (``loopkit.JsonlWriter``,
``loopkit.Ledger``, the modules ``loopkit.writers``, ``loopkit.hooks``, ...); 0.2 keeps
the names a first loop needs at the top and moves the rest into namespaces
(:mod:`loopkit.core`, :mod:`loopkit.data`, :mod:`loopkit.observe`,
:mod:`loopkit.checkpoint`, :mod:`loopkit.tools`). Asking the package for a moved
name raises an error that says where it is now. Pure host code; thread-safe.
"""

from __future__ import annotations

from typing import Any

# 0.1's top-level name -> its public home since 0.2 (from 0.1's loopkit/__init__.py).
MOVED = {
    **{n: f"loopkit.observe.{n}" for n in (
        "AsyncWriter", "ConsoleWriter", "FlaxSummaryWriter", "JsonlWriter", "MetricWriter",
        "MultiWriter", "NullWriter", "TensorBoardWriter", "as_writer", "create_default_writer",
        "GoodputHook", "GoodputSummary", "ProfilerHook")},
    **{n: f"loopkit.data.{n}" for n in (
        "BatchLayoutWarning", "DeviceDataState", "DeviceDataset", "batch_arrays",
        "eval_batches_per_process", "grain_shard_for_process", "grain_shard_options",
        "process_shard_bounds", "shard_for_process", "steps_per_epoch_of",
        "tfds_split_for_process")},
    **{n: f"loopkit.core.{n}" for n in (
        "Bucket", "Ledger", "LedgerAdjustment", "MultiStepProgram", "PreemptionWatcher",
        "Restore", "TimeBasedK", "accumulate", "plan_calls")},
    "next_call_length": "loopkit.core.planner.next_call_length",
    **{n: f"loopkit.checkpoint.{n}" for n in (
        "CheckpointError", "CheckpointWarning", "RestoredCheckpoint")},
    "evaluate": "loopkit.evaluation.evaluate",
    "per_example": "loopkit.evaluation.per_example",
}
# 0.1's modules (attributes of the package once it was imported) -> their home since 0.2.
MOVED_MODULES = {
    **{n: f"loopkit.core.{n}" for n in (
        "accumulation", "context", "hooks", "ledger", "loop", "planner", "preemption",
        "program", "rng", "triggers")},
    **{n: f"loopkit.observe.{n}" for n in ("goodput", "profiler", "progress", "writers")},
    "device_data": "loopkit.data.device_data",
    "sources": "loopkit.data.sources",
    "aot": "loopkit.tools.aot",
    "testing": "loopkit.tools.testing",
    "tune": "loopkit.tools.tune",
}

# 0.1's modules that are internal since 0.2: their public names moved elsewhere.
INTERNAL = {"checks": "loopkit.data.BatchLayoutWarning"}


def moved_error(name: str, caller: Any = None) -> Exception | None:
  """The error for ``loopkit.<name>`` when ``name`` is one of 0.1's moved names, else None.

  Args:
    name: the attribute asked of the package.
    caller: the frame that asked (``sys._getframe(1)`` in the package's ``__getattr__``):
      for ``from loopkit import name`` the error is an ImportError, since Python replaces
      an AttributeError there by its own "cannot import name", which would drop the new
      home; for ``loopkit.name`` and ``getattr`` it is an AttributeError (``hasattr`` stays
      False).

  Returns:
    An AttributeError or ImportError whose message names the new home, or None.
  """
  if name in MOVED:
    where = MOVED[name]
    home, _, short = where.rpartition(".")
    message = f"loopkit.{name} moved in loopkit 0.2: it is {where} (from {home} import {short})"
  elif name in MOVED_MODULES:
    where = MOVED_MODULES[name]
    message = f"loopkit.{name} moved in loopkit 0.2: it is {where} (import {where})"
  elif name in INTERNAL:
    message = (f"loopkit.{name} is internal since loopkit 0.2; its public name is "
               f"{INTERNAL[name]}")
  else:
    return None
  if _importing_from(caller):
    return ImportError(message, name="loopkit")
  return AttributeError(message)


def _importing_from(frame: Any) -> bool:
  """Whether ``frame`` is executing a ``from ... import`` (its current opcode is IMPORT_FROM)."""
  if frame is None:
    return False
  try:
    import dis  # pylint: disable=g-import-not-at-top  # only on this error path
    return dis.opname[frame.f_code.co_code[frame.f_lasti]] == "IMPORT_FROM"
  except Exception:  # pylint: disable=broad-except  # another interpreter: AttributeError
    return False


__all__ = ["INTERNAL", "MOVED", "MOVED_MODULES", "moved_error"]
