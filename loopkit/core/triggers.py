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
import numbers
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def _whole_steps(name: str, value: Any) -> int:
  """``value`` as an int number of steps (> 0); ValueError naming ``name`` otherwise."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or value <= 0:
    raise ValueError(f"{name} must be a whole number of steps > 0, got {value!r}")
  if isinstance(value, numbers.Integral):
    return int(value)
  if not float(value).is_integer():
    raise ValueError(f"{name} must be a whole number of steps, got {value!r}")
  return int(float(value))


@dataclasses.dataclass
class Trigger:
  """Fires when a call's step range crosses a mark.

  Marks combine: a trigger with several of ``every_steps``, ``every_epochs`` and
  ``at_steps`` fires when any of them is crossed, and the planner lands on
  each (as CLU's periodic actions OR their ``every_steps`` and ``every_secs``).
  ``every_secs`` may be combined with all of them.

  Marks are whole steps: ``every_epochs`` may be fractional (``0.5``) when
  ``every_epochs * steps_per_epoch`` is a whole number of steps.

  Deciding and recording are separate (a decision never changes the trigger):
  :meth:`should_fire` answers for one call; the loop then calls :meth:`fired`
  when the hook really fired. The wall-clock part is read by :meth:`time_due`,
  which the loop agrees on across processes (:mod:`loopkit.core.agreement`) before
  passing it to :meth:`should_fire`.

  Attributes:
    every_steps: fire at global steps that are multiples of this (int > 0).
    every_epochs: fire at the end of every this many epochs (> 0); needs
      ``steps_per_epoch`` from the loop.
    at_steps: fire at exactly these global steps (ints > 0).
    every_secs: fire at the end of the first call that starts at least this
      many seconds (wall clock) after the last firing (or after
      :meth:`start_clock`); does not cut calls.
    at_end: also fire at the last boundary of a run.

  ``clock`` (default ``time.monotonic``, seconds) is injectable for tests.

  Raises:
    ValueError: a non-positive period, a step mark that is not a whole number
      (``every_steps=2.5``, ``at_steps=[1.5]``), or a non-positive ``at_steps``
      entry (naming the value).
  """

  every_steps: int | None = None
  every_epochs: float | None = None
  at_steps: Sequence[int] | None = None
  every_secs: float | None = None
  at_end: bool = True
  clock: Callable[[], float] = time.monotonic
  _last_fire_time: float | None = dataclasses.field(default=None, repr=False)

  def __post_init__(self):
    if self.every_steps is not None:
      self.every_steps = _whole_steps("every_steps", self.every_steps)
    for name in ("every_epochs", "every_secs"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not v > 0):
        raise ValueError(f"{name} must be > 0, got {v!r}")
    if self.at_steps is not None:
      if isinstance(self.at_steps, (str, bytes)) or not isinstance(self.at_steps, Iterable):
        raise ValueError(f"at_steps must be a sequence of steps, got {self.at_steps!r}")
      self.at_steps = sorted({_whole_steps("at_steps entry", s) for s in self.at_steps})

  @property
  def every_call(self) -> bool:
    """True when no mark is set: the trigger fires after every device call."""
    return (self.every_steps is None and self.every_epochs is None
            and self.at_steps is None and self.every_secs is None)

  def epoch_period(self, steps_per_epoch: int | None) -> int | None:
    """``every_epochs`` in steps, or None when ``every_epochs`` is not set.

    Raises:
      ValueError: ``every_epochs`` without ``steps_per_epoch``, or
        ``every_epochs * steps_per_epoch`` not a whole number of steps (naming
        both, e.g. 0.5 epochs of 3 steps).
    """
    if self.every_epochs is None:
      return None
    if steps_per_epoch is None:
      raise ValueError("every_epochs needs the loop's steps_per_epoch")
    steps = self.every_epochs * steps_per_epoch
    if abs(steps - round(steps)) > 1e-9 * max(1.0, abs(steps)) or round(steps) < 1:
      raise ValueError(
          f"every_epochs={self.every_epochs!r} with steps_per_epoch={steps_per_epoch} is "
          f"{steps:g} steps; a trigger fires on whole steps: choose every_epochs so that "
          "every_epochs * steps_per_epoch is a whole number, or use every_steps")
    return int(round(steps))

  def _periods(self, steps_per_epoch: int | None) -> list[int]:
    return [p for p in (self.every_steps, self.epoch_period(steps_per_epoch)) if p is not None]

  def next_step(self, step: int, steps_per_epoch: int | None = None) -> int | None:
    """The first step > ``step`` at which this trigger must fire, or None."""
    marks = [(step // p + 1) * p for p in self._periods(steps_per_epoch)]
    if self.at_steps is not None:
      marks += [s for s in self.at_steps if s > step][:1]
    return min(marks) if marks else None

  def crossed(self, start: int, end: int, steps_per_epoch: int | None = None) -> bool:
    """Whether the step range ``(start, end]`` crosses a step mark of any kind."""
    if any(end // p > start // p for p in self._periods(steps_per_epoch)):
      return True
    return self.at_steps is not None and any(start < s <= end for s in self.at_steps)

  # -- wall clock --------------------------------------------------------------

  def start_clock(self) -> None:
    """Starts the ``every_secs`` period now (the loop calls it when a run starts)."""
    self._last_fire_time = self.clock()

  def time_due(self) -> bool:
    """Whether ``every_secs`` have passed since the last firing (this process's clock).

    Reads the clock and changes nothing; False without ``every_secs``. An
    unstarted clock counts from now on (this call starts it).
    """
    if self.every_secs is None:
      return False
    if self._last_fire_time is None:
      self.start_clock()
      return False
    return self.clock() - self._last_fire_time >= self.every_secs

  def should_fire(self, start: int, end: int, *, steps_per_epoch: int | None = None,
                  is_last: bool = False, time_due: bool = False) -> bool:
    """Whether to fire after a call that took the step from ``start`` to ``end``.

    Args:
      start, end: the call's step range ``(start, end]``.
      steps_per_epoch: the loop's, for ``every_epochs``.
      is_last: the call is the last of the run (for ``at_end``).
      time_due: the agreed answer of :meth:`time_due` for this boundary.

    Changes nothing; call :meth:`fired` when the hook fired.
    """
    if self.every_call:
      return True
    return (self.crossed(start, end, steps_per_epoch) or (is_last and self.at_end)
            or (self.every_secs is not None and time_due))

  def fired(self) -> None:
    """Records a firing (restarts the ``every_secs`` period)."""
    if self.every_secs is not None:
      self._last_fire_time = self.clock()


def steps_until(triggers: Sequence[Trigger], step: int,
                steps_per_epoch: int | None) -> float:
  """Steps from ``step`` to the nearest next step mark of any trigger (inf if none)."""
  best: float = math.inf
  for t in triggers:
    nxt = t.next_step(step, steps_per_epoch)
    if nxt is not None:
      best = min(best, nxt - step)
  return best
