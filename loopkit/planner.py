"""The call planner: how many steps the next device call runs. Pure functions.

Each call runs ``min(K, steps to the next hook event, steps to the epoch end,
steps left)`` steps (K = ``iterations_per_loop``), so every requested event
lands exactly on its step and no call crosses an epoch end (policy of
``shared/cases/CASES.md``: cases C01-C04). Calls shorter than K reuse the same
compiled program (see :mod:`loopkit.program`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from loopkit.triggers import Trigger, steps_until

__all__ = ["next_call_length", "plan_calls"]


def next_call_length(step: int, *, iterations_per_loop: int, num_steps: int,
                     steps_per_epoch: int | None = None,
                     triggers: Sequence[Trigger] = ()) -> int:
  """Length (in steps) of the device call that starts at global ``step``.

  Args:
    step: global step before the call (optimizer updates applied so far).
    iterations_per_loop: K >= 1, the most steps one call may run.
    num_steps: the global step at which the run ends (absolute, not a count
      of further steps; like TPUEstimator's ``max_steps``).
    steps_per_epoch: if known, calls never cross a multiple of it.
    triggers: step-based triggers whose marks a call must land on.

  Returns:
    An int in ``[1, K]``; 0 when ``step >= num_steps``.

  Raises:
    ValueError: if K < 1 or ``steps_per_epoch`` < 1.
  """
  if iterations_per_loop < 1:
    raise ValueError(f"iterations_per_loop must be >= 1, got {iterations_per_loop!r}")
  if steps_per_epoch is not None and steps_per_epoch < 1:
    raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch!r}")
  left = num_steps - step
  if left <= 0:
    return 0
  to_epoch_end = math.inf
  if steps_per_epoch is not None:
    to_epoch_end = steps_per_epoch - step % steps_per_epoch
  to_event = steps_until(triggers, step, steps_per_epoch)
  return int(min(iterations_per_loop, left, to_epoch_end, to_event))


def plan_calls(step: int, *, iterations_per_loop: int, num_steps: int,
               steps_per_epoch: int | None = None,
               triggers: Sequence[Trigger] = ()) -> Iterator[int]:
  """Yields the lengths of every call from ``step`` to ``num_steps``.

  Example:
    >>> list(plan_calls(0, iterations_per_loop=4, num_steps=10))
    [4, 4, 2]
    >>> list(plan_calls(0, iterations_per_loop=4, num_steps=24,
    ...                 triggers=[Trigger(every_steps=6)]))
    [4, 2, 4, 2, 4, 2, 4, 2]
  """
  while True:
    n = next_call_length(step, iterations_per_loop=iterations_per_loop,
                         num_steps=num_steps, steps_per_epoch=steps_per_epoch,
                         triggers=triggers)
    if n == 0:
      return
    yield n
    step += n
