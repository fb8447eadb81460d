"""The call planner: how many steps the next device call runs. Pure functions.

Each call runs ``min(K, steps to the next hook event, steps to the epoch end,
steps left)`` steps (K = ``iterations_per_loop``), so every requested event
lands exactly on its step and no call crosses an epoch end. Calls shorter than K reuse the same
compiled program (see :mod:`loopkit.core.program`).

Time-based K (:class:`TimeBasedK`, TPUEstimator's ``iterations_per_loop="30s"``)
replaces the fixed K by one re-chosen from the measured step time, capped by a
fixed slot count so the program is still compiled once.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from loopkit.core.triggers import Trigger, steps_until

__all__ = ["TimeBasedK", "next_call_length", "parse_duration", "plan_calls"]

log = logging.getLogger("loopkit")

# TPUEstimator's form (tpu_config.py): a positive integer with an s, m or h suffix.
_DURATION = re.compile(r"^\s*([1-9][0-9]*)\s*([smh])\s*$")
_UNIT_SECS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str) -> float:
  """Parses TPUEstimator's time form of ``iterations_per_loop``.

  Args:
    value: ``"<N>s"``, ``"<N>m"`` or ``"<N>h"`` with N a positive integer, e.g.
      ``"30s"``, ``"5m"``, ``"1h"`` (as ``TPUConfig(iterations_per_loop=...)``).

  Returns:
    The duration in seconds (float).

  Raises:
    ValueError: for any other string.

  Example:
    >>> parse_duration("30s"), parse_duration("2m"), parse_duration("1h")
    (30.0, 120.0, 3600.0)
  """
  m = _DURATION.match(value) if isinstance(value, str) else None
  if m is None:
    raise ValueError(f"iterations_per_loop must be an int >= 1 or a duration like '30s', "
                     f"'5m' or '1h' (a positive integer and a unit s/m/h), got {value!r}")
  return int(m.group(1)) * _UNIT_SECS[m.group(2)]


class TimeBasedK:
  """Chooses steps per device call so that a call takes about ``target_secs``.

  The loop reports every call boundary (:meth:`record`, with the global step
  reached); the wall time between two consecutive boundaries is the call's
  time (it includes the host's share: dispatch, data wait, hooks). A call of
  n steps is modelled as ``overhead + n * step_time``: one-step calls are
  mostly per-call overhead, so dividing their time by their steps would
  overestimate the step time and ramp K up over many calls. The overhead is
  fitted from the latest call and the most recent earlier one whose length
  differs by 2x or more (kept while the fit gives a positive step time and a
  non-negative overhead; 0 until then), and the step time from the latest
  call given that overhead. The next calls run
  ``clamp(floor((target_secs - overhead) / step_time), 1, max_iterations_per_loop)``
  steps, re-estimated at every boundary (no smoothing: a call of
  ``target_secs`` averages out the noise of single steps). So K reaches its
  level two measured calls after the compile (a one-step call, then one of the
  first estimate's length) instead of growing by ``target / overhead`` per call.
  Before the first measurement calls run ``initial`` steps. The first boundary
  (whose call includes compilation) only starts the clock.

  When the cap binds (the model wants more than ``max_iterations_per_loop``
  steps per call), :attr:`capped` is True, :attr:`wanted` holds the uncapped
  length, and a ``loopkit`` warning says so once per instance (calls then take
  less than ``target_secs``; raise the cap to reach it).

  The program is compiled once for ``max_iterations_per_loop`` slots; a call of
  n steps still transfers ``max_iterations_per_loop - n`` padding batches (see
  :mod:`loopkit.core.program`), so keep the cap near the expected K.

  With prefetching the feeder plans up to ``prefetch`` calls ahead, so a new
  choice takes effect ``prefetch + 1`` calls after its measurement.

  Args:
    target_secs: seconds per call (float > 0), or a string ``"30s"`` /
      ``"5m"`` / ``"1h"`` (:func:`parse_duration`).
    max_iterations_per_loop: the most steps per call, the compiled slot count.
    initial: steps per call until the first measurement (default 1).
    clock: monotonic clock in seconds (inject a fake one in tests).

  Raises:
    ValueError: for ``target_secs`` <= 0, a malformed string,
      ``max_iterations_per_loop`` < 1 or ``initial`` outside
      ``[1, max_iterations_per_loop]``.

  Thread-safe: :meth:`current` may be called from the prefetch thread while the
  loop thread calls :meth:`record`.
  """

  def __init__(self, target_secs: float | str, *, max_iterations_per_loop: int,
               initial: int = 1, clock: Callable[[], float] = time.perf_counter):
    if isinstance(target_secs, str):
      target_secs = parse_duration(target_secs)
    if not target_secs > 0:
      raise ValueError(f"target_secs must be > 0, got {target_secs!r}")
    if isinstance(max_iterations_per_loop, bool) or not isinstance(max_iterations_per_loop, int) \
        or max_iterations_per_loop < 1:
      raise ValueError(f"max_iterations_per_loop must be an int >= 1, got "
                       f"{max_iterations_per_loop!r}")
    if not 1 <= initial <= max_iterations_per_loop:
      raise ValueError(f"initial must be in [1, {max_iterations_per_loop}], got {initial!r}")
    self.target_secs = float(target_secs)
    self.max_iterations_per_loop = max_iterations_per_loop
    self.initial = initial
    self.clock = clock
    self.secs_per_step: float | None = None
    self.overhead_secs = 0.0
    self.wanted: int | None = None
    self.capped = False
    self._k = initial
    self._mark: tuple[float, int] | None = None
    self._history: list[tuple[int, float]] = []  # (steps, secs) of the last measured calls
    self._warned_cap = False
    self._lock = threading.Lock()

  def start(self) -> None:
    """Forgets the clock mark (called at the start of every ``run``); keeps the estimate."""
    with self._lock:
      self._mark = None

  def record(self, step: int) -> None:
    """Records a call boundary at global ``step`` and re-chooses K."""
    now = self.clock()
    with self._lock:
      if self._mark is not None:
        t0, s0 = self._mark
        if step > s0 and now > t0:
          self._measure(step - s0, now - t0)
      self._mark = (now, step)
    if self.capped and not self._warned_cap and self.secs_per_step is not None:
      self._warned_cap = True
      log.warning("time-based iterations_per_loop: a %g s call wants %d steps (%.3g ms per "
                  "step + %.3g ms per call) but max_iterations_per_loop=%d caps it, so calls "
                  "take about %.3g s; raise max_iterations_per_loop to reach %g s",
                  self.target_secs, self.wanted, 1e3 * self.secs_per_step,
                  1e3 * self.overhead_secs, self.max_iterations_per_loop,
                  self.overhead_secs + self.max_iterations_per_loop * self.secs_per_step,
                  self.target_secs)

  def _measure(self, n: int, secs: float) -> None:
    """Updates the overhead / step-time model from a call of ``n`` steps (holds the lock)."""
    for n_a, secs_a in reversed(self._history):
      if 2 * n_a <= n or 2 * n <= n_a:
        step_time = (secs - secs_a) / (n - n_a)
        overhead = secs - n * step_time
        if step_time > 0 and overhead >= 0:
          self.overhead_secs = overhead
        break
    self._history = (self._history + [(n, secs)])[-8:]
    if secs - self.overhead_secs <= 0:  # the overhead no longer fits: forget it
      self.overhead_secs = 0.0
    self.secs_per_step = (secs - self.overhead_secs) / n
    k = math.floor((self.target_secs - self.overhead_secs) / self.secs_per_step + 1e-9)
    self.wanted = max(1, k)
    self.capped = self.wanted > self.max_iterations_per_loop
    self._k = min(self.max_iterations_per_loop, self.wanted)

  def current(self) -> int:
    """Steps the next call should run (before events and epoch ends cut it)."""
    with self._lock:
      return self._k

  def __repr__(self) -> str:
    return (f"TimeBasedK(target_secs={self.target_secs}, max_iterations_per_loop="
            f"{self.max_iterations_per_loop}, current={self._k})")


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


def plan_calls(step: int, *, iterations_per_loop: int | TimeBasedK, num_steps: int,
               steps_per_epoch: int | None = None,
               triggers: Sequence[Trigger] = ()) -> Iterator[int]:
  """Yields the lengths of every call from ``step`` to ``num_steps``.

  ``iterations_per_loop`` may be a :class:`TimeBasedK`; its current choice is
  read when each length is drawn.

  Example:
    >>> list(plan_calls(0, iterations_per_loop=4, num_steps=10))
    [4, 4, 2]
    >>> list(plan_calls(0, iterations_per_loop=4, num_steps=24,
    ...                 triggers=[Trigger(every_steps=6)]))
    [4, 2, 4, 2, 4, 2, 4, 2]
  """
  while True:
    k = (iterations_per_loop.current() if isinstance(iterations_per_loop, TimeBasedK)
         else iterations_per_loop)
    n = next_call_length(step, iterations_per_loop=k,
                         num_steps=num_steps, steps_per_epoch=steps_per_epoch,
                         triggers=triggers)
    if n == 0:
      return
    yield n
    step += n
