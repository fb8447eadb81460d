"""When a hook fires: periodic triggers with crossing semantics.

A device call advances the global step from ``start`` to ``end`` (``end - start``
<= K). A trigger fires for that call when the half-open range ``(start, end]``
*crosses* one of its marks, never by ``step % n == 0``, which misfires when the
step jumps by K. Step-based triggers also tell the call planner the next step
they need (:meth:`Trigger.next_step`), so the planner can cut calls for the
event to land exactly on its step.

Triggers are plain host objects; not thread-safe; identical on every process.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence


@dataclasses.dataclass
class Trigger:
  """Fires when a call's step range crosses a mark.

  Set at most one of the step marks; ``every_secs`` may be combined with them.

  Attributes:
    every_steps: fire at global steps that are multiples of this (> 0).
    every_epochs: fire at the end of every this many epochs; needs
      ``steps_per_epoch`` from the loop.
    at_steps: fire at exactly these global steps.
    every_secs: fire at the first boundary at least this many seconds (wall
      clock) after the last firing; does not cut calls.
    at_end: also fire at the last boundary of a run.

  Raises:
    ValueError: for a non-positive period.
  """

  every_steps: int | None = None
  every_epochs: int | None = None
  at_steps: Sequence[int] | None = None
  every_secs: float | None = None
  at_end: bool = True
  clock: Callable[[], float] = time.monotonic
  _last_fire_time: float | None = dataclasses.field(default=None, repr=False)

  def __post_init__(self):
    for name in ("every_steps", "every_epochs", "every_secs"):
      v = getattr(self, name)
      if v is not None and not v > 0:
        raise ValueError(f"{name} must be > 0, got {v!r}")
    if self.at_steps is not None:
      self.at_steps = sorted(int(s) for s in self.at_steps)

  @property
  def every_call(self) -> bool:
    """True when no mark is set: the trigger fires after every device call."""
    return (self.every_steps is None and self.every_epochs is None
            and self.at_steps is None and self.every_secs is None)

  def _period(self, steps_per_epoch: int | None) -> int | None:
    if self.every_steps is not None:
      return self.every_steps
    if self.every_epochs is not None:
      if steps_per_epoch is None:
        raise ValueError("every_epochs needs the loop's steps_per_epoch")
      return self.every_epochs * steps_per_epoch
    return None

  def next_step(self, step: int, steps_per_epoch: int | None = None) -> int | None:
    """The first step > ``step`` at which this trigger must fire, or None."""
    period = self._period(steps_per_epoch)
    if period is not None:
      return (step // period + 1) * period
    if self.at_steps is not None:
      for s in self.at_steps:
        if s > step:
          return s
    return None

  def crossed(self, start: int, end: int, steps_per_epoch: int | None = None) -> bool:
    """Whether the step range ``(start, end]`` crosses a step mark."""
    period = self._period(steps_per_epoch)
    if period is not None:
      return end // period > start // period
    if self.at_steps is not None:
      return any(start < s <= end for s in self.at_steps)
    return False

  def should_fire(self, start: int, end: int, *, steps_per_epoch: int | None = None,
                  is_last: bool = False) -> bool:
    """Decides (and records, for ``every_secs``) whether to fire after a call."""
    if self.every_call:
      fire = True
    else:
      fire = self.crossed(start, end, steps_per_epoch) or (is_last and self.at_end)
      if self.every_secs is not None:
        now = self.clock()
        if self._last_fire_time is None:
          self._last_fire_time = now
        elif now - self._last_fire_time >= self.every_secs:
          fire = True
    if fire and self.every_secs is not None:
      self._last_fire_time = self.clock()
    return fire


def steps_until(triggers: Sequence[Trigger], step: int,
                steps_per_epoch: int | None) -> float:
  """Steps from ``step`` to the nearest next step mark of any trigger (inf if none)."""
  best: float = math.inf
  for t in triggers:
    nxt = t.next_step(step, steps_per_epoch)
    if nxt is not None:
      best = min(best, nxt - step)
  return best
