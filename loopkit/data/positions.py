"""The data position a step-indexed source saves, and its check when a run resumes.

A step-indexed source (``batch_at(step)``: :class:`~loopkit.data.ArraySource`,
:class:`~loopkit.data.GrainSource`, :class:`~loopkit.data.DeviceDataset`) needs no
iterator state to resume: the batch of step ``s`` is a function of ``s`` and of how the
source was built. So the position it saves is the step together with what decides which
examples a step holds, ``{"<kind>_step": s, "seed", "global_batch_size", <examples>}``,
and at a resume the source checks that the checkpoint's position came from a source of
its kind built the same way. Without that check, a run saved at batch 64 and resumed at
batch 32 would go on at step ``s`` with other examples than the run that saved it had
left, silently (its epoch's permutation is cut at other places). One check, with one
form of message, for every step-indexed source: :func:`check_step_position`.

Pure host functions; thread-safe.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger("loopkit")

STEP_KEYS = {
    "array_step": "an ArraySource",
    "grain_step": "a GrainSource",
    "device_data_step": "a DeviceDataset",
}
"""The step key of each step-indexed source's saved position, and the source it names."""


def step_position(step_key: str, step: int, **built: int) -> dict[str, int]:
  """A step-indexed source's saved position: ``{step_key: step, **built}``.

  Args:
    step_key: the source's key in :data:`STEP_KEYS`.
    step: the global step the next batch belongs to.
    **built: what decides a step's examples (``seed``, ``global_batch_size``, the
      number of examples or records), as ints.

  Returns:
    A JSON-serialisable dict (the checkpoint stores it as it is).
  """
  return {step_key: int(step), **{k: int(v) for k, v in built.items()}}


def _origin(position: Any) -> str:
  """Which pipeline a data position that is not the reader's came from, in words."""
  if isinstance(position, dict):
    for key, source in STEP_KEYS.items():
      if key in position:
        return f"{source} (loopkit.data.{source.split()[-1]})"
    if "tf_batches" in position:
      return "a tf.data pipeline (loopkit.data.TfDataSource)"
  if isinstance(position, (int, np.integer)) and not isinstance(position, bool):
    return ("a batch count or the bare step of a step-indexed source (a plain iterable, or an "
            "ArraySource of loopkit 0.2)")
  return "another pipeline's iterator state"


def check_step_position(position: Any, mine: dict[str, int], *, step: int, source: str,
                        accept_bare_step: bool = False) -> None:
  """Checks a checkpoint's data position before a step-indexed source resumes at ``step``.

  Args:
    position: the position the checkpoint holds.
    mine: the position this source saves at ``step``
      (:func:`step_position`; its first key is the step key).
    step: the global step the run resumes at.
    source: the source's name in messages, e.g. ``"ArraySource"``.
    accept_bare_step: take a bare int equal to ``step``, the position an
      :class:`~loopkit.data.ArraySource` or a :class:`~loopkit.data.DeviceDataset`
      saved before it saved what it was built with (loopkit 0.2); the batch size
      and seed cannot be checked then, and a warning says so.

  Raises:
    ValueError: a position from another pipeline (naming it and this source's
      position), or one whose step, seed, global batch size or example count
      differs from this source's; the message names every differing key with both
      values (``has global_batch_size=64 but this ArraySource has
      global_batch_size=32``) and both positions.
  """
  step_key = next(iter(mine))
  if (accept_bare_step and isinstance(position, (int, np.integer))
      and not isinstance(position, bool) and int(position) == step):
    log.warning("the checkpoint's data position is the bare step %d (saved by loopkit 0.2): "
                "this %s cannot check that the run that saved it had the same global batch "
                "size (%d), seed and examples; a step's batch is other examples if not",
                step, source, mine.get("global_batch_size", -1))
    return
  if not isinstance(position, dict) or step_key not in position:
    raise ValueError(f"the checkpoint's data position {position!r} came from "
                     f"{_origin(position)}, not from {STEP_KEYS[step_key]} (whose position "
                     f"here is {mine!r}): resume with the pipeline that saved it, or start a "
                     "new run in another directory")
  differ = [key for key, value in mine.items() if position.get(key) != value]
  if not differ:
    return
  saved = ", ".join(f"{key}={position.get(key)!r}" for key in differ)
  here = ", ".join(f"{key}={mine[key]!r}" for key in differ)
  why = ("the checkpoint's state and data position disagree" if differ == [step_key] else
         f"step {step}'s batch would hold other examples than the saved run's")
  raise ValueError(f"the checkpoint's data position has {saved} but this {source} has {here} "
                   f"(saved {position!r}, here {mine!r}): {why}; build the source as the run "
                   "that saved it did, or start a new run in another directory")
