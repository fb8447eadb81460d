"""A wall-clock budget for one ``run``: stop at the first boundary past it, status ``"time limit"``.

``TrainLoop.run(..., max_time=...)`` takes seconds, a duration (``"30m"``, ``"4h"``), a
``datetime.timedelta`` or a :class:`TimeLimit` (which also takes the clock, for tests). The
budget counts from the start of ``run`` (restore and compilation included) on this process's
clock. At every boundary, before the next device call, the run asks :meth:`TimeLimit.expired`
and agrees on the answer across processes with its other host-local decisions
(:mod:`loopkit.core.agreement`): every process stops at the same boundary. The stop is
handled like a preemption, since the run is meant to be resumed: the ``at_end`` hooks with
``fires_at_preemption`` fire (a :class:`~loopkit.checkpoint.CheckpointHook` saves there, off
its cadence, and waits for the write), the hooks that write rows at their marks
(``LoggingHook``, ``EvalHook``) do not, and ``loop.status == "time limit"``.

The budget is not a deadline for the save: the run stops at the first boundary at or past it,
then saves. Leave a margin of one device call plus one save under a scheduler's own limit.

**When the clock is read.** Once when ``run`` starts (before the hooks' ``on_run_start``), then
once per boundary, in the agreement before the next device call is dispatched. The hooks of a
call run one call late, while the next call runs (:mod:`loopkit.core.run`): the clock is read
*before* the ``after_each_call`` and ``on_trigger`` of the call that just ended, unless a hook
that needs the state fires there (its hooks then run before the next agreement). So a clock that
a hook moves (one that counts steps in ``after_each_call``, say) is seen one call later: with a
budget of 21 such steps the run stops at 22, 24 and 28 for K = 1, 3 and 7. The stop's log line
reports the reading the decision used (:attr:`TimeLimit.decided_at`).

Not thread-safe (the loop's thread reads it).
"""

from __future__ import annotations

import datetime
import numbers
import time
from collections.abc import Callable

from loopkit.core.planner import parse_duration

__all__ = ["TIME_LIMIT", "TimeLimit", "as_time_limit"]

TIME_LIMIT = "time limit"
"""The status of a run stopped by its ``max_time``."""


class TimeLimit:
  """A wall-clock budget in seconds, read at loop boundaries.

  Args:
    seconds: the budget (> 0), counted from :meth:`start`.
    clock: returns the time in seconds (default ``time.monotonic``); injectable for tests.
      The run reads it once when ``run`` starts and once at every boundary before the next
      call is dispatched (module docstring: that is before the hooks of the call just ended).

  Attributes:
    decided_at: seconds since :meth:`start` at the latest :meth:`expired` (None before one).

  Raises:
    ValueError: ``seconds`` not a number > 0 (naming it).
  """

  def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic):
    if (isinstance(seconds, bool) or not isinstance(seconds, numbers.Real)
        or not float(seconds) > 0):
      raise ValueError(f"max_time must be a number of seconds > 0, got {seconds!r}")
    self.seconds: float = float(seconds)
    self.clock: Callable[[], float] = clock
    self._start: float | None = None
    self.decided_at: float | None = None

  def start(self) -> None:
    """Starts the budget now (the loop calls it when ``run`` starts)."""
    self._start = self.clock()
    self.decided_at = None

  def elapsed(self) -> float:
    """Seconds since :meth:`start` (0 before it)."""
    return 0.0 if self._start is None else self.clock() - self._start

  def expired(self) -> bool:
    """Whether the budget is spent (reads the clock once; this process's answer).

    The seconds read are kept as :attr:`decided_at`: the stop's message reports the reading
    the decision used, not a later one.
    """
    if self._start is None:
      return False
    self.decided_at = self.elapsed()
    return self.decided_at >= self.seconds

  def __repr__(self) -> str:
    return f"TimeLimit({self.seconds:g})"


def as_time_limit(max_time: float | str | datetime.timedelta | TimeLimit | None
                  ) -> TimeLimit | None:
  """``max_time`` as a :class:`TimeLimit` (None: no budget).

  Args:
    max_time: seconds (int or float > 0), a duration ``"<N>s"`` / ``"<N>m"`` / ``"<N>h"``, a
      ``datetime.timedelta``, a :class:`TimeLimit`, or None.

  Raises:
    ValueError: anything else, naming the value.
  """
  if max_time is None or isinstance(max_time, TimeLimit):
    return max_time
  if isinstance(max_time, datetime.timedelta):
    return TimeLimit(max_time.total_seconds())
  if isinstance(max_time, str):
    try:
      return TimeLimit(parse_duration(max_time))
    except ValueError:
      raise ValueError(f"max_time must be seconds, a duration like '30m' or '4h' (a positive "
                       f"integer and a unit s/m/h), a datetime.timedelta or a TimeLimit, got "
                       f"{max_time!r}") from None
  return TimeLimit(max_time)
