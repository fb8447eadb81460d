"""A hang and straggler watchdog: a run stuck in one phase dumps its stacks and exits.

A live but stuck process (a device call that never returns, a source that blocks, a peer
that stops answering at the boundary agreement, a checkpoint save that hangs) holds a
multi-host job forever: JAX's heartbeats only catch a process that is gone or frozen, not
one whose background threads still answer. :class:`Watchdog` is a hook whose daemon thread
watches the phase the run is in; the run tells it each phase it enters and leaves
(:meth:`Watchdog.enter_phase` / :meth:`Watchdog.leave_phase`, a duck-typed protocol that
:class:`loopkit.core.run.Run` calls around its own steps):

================  =========================================================================
phase             what the run is doing
================  =========================================================================
``compile``       the first dispatch (trace and compile)
``device_call``   a later device call: its dispatch (which blocks where the backend runs it
                  synchronously, e.g. a CPU program with a host callback) and the host
                  waiting for its outputs (their medians are kept apart)
``data``          the host waiting for the next input chunk
``agreement``     the boundary agreement across processes (several processes only)
``checkpoint``    a hook whose ``time_bucket`` is ``checkpoint`` (a save or a restore)
``eval``          a hook whose ``time_bucket`` is ``eval``
``hooks``         other hooks (their ``after_each_call`` together; ``setup`` outside calls)
================  =========================================================================

A phase's deadline is, in order: its entry in ``deadlines`` (seconds; None: never);
else, once the phase has ``min_samples`` finished samples in this run,
``max(floor_secs, multiple x the median of its last 100 durations)``; else
``first_secs``. The step named is the ledger's when the phase began (a hook's: the
boundary it runs at; a device call's: the step it starts after).

On expiry the watchdog logs one line at ERROR on the ``loopkit`` logger naming the
process, the phase, the step, the elapsed time and the deadline (for the agreement on
several processes: the processes whose answer is not in the coordination service's store,
:func:`loopkit.core.agreement.waiting_for`), writes every thread's stack to stderr
(:func:`faulthandler.dump_traceback`), appends the record to ``workdir/watchdog.jsonl``
(one JSON object per line; :class:`~loopkit.observe.GoodputHook` with the same
``workdir`` counts the stuck time as lost when the next attempt starts) and exits the
process with :data:`EXIT_CODE` (``os._exit``: no ``finally`` or ``atexit`` runs, as for
a killed process; an orchestrator restarts the job, which resumes from its last
checkpoint). Writers are not flushed: the rows past the last checkpoint are dropped and
written again by the resumed run, as after a kill.

Cost: entering and leaving a phase is two attribute writes and two clock readings, about
3 us for a device call's five phases (``tests/test_watchdog.py``); the thread wakes every
``poll_secs``. Thread-safe as used: the run's thread writes the current phase, the
watchdog's reads it. Multi-host: every process runs its own watchdog and decides alone,
with no agreement (a stuck process cannot take part in one); the process that exits ends
the job (its peers fail on the lost coordinator or collective).
"""

from __future__ import annotations

import collections
import faulthandler
import json
import logging
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import jax

from loopkit.core import agreement
from loopkit.core.context import RunContext
from loopkit.core.hooks import Hook

__all__ = ["EXIT_CODE", "PHASES", "Watchdog"]

log = logging.getLogger("loopkit")

EXIT_CODE = 75
"""The exit status of a process the watchdog ends (``EX_TEMPFAIL``, "try again later":
distinct from 1, an exception, and from a signal's negative status)."""

PHASES = ("compile", "device_call", "data", "agreement", "checkpoint", "eval",
          "hooks", "setup")
"""The phases the run reports (a hook's own ``time_bucket`` names its phase too)."""

_HISTORY = 100  # durations kept per phase for its median


class Watchdog(Hook):
  """Ends a process stuck in one phase of the run, with its stacks and the phase named.

  Args:
    deadlines: seconds per phase name (:data:`PHASES`); None for a phase: no deadline.
      Overrides the median rule for that phase. Default: ``{"compile": 3600.0}``, merged
      with what is given.
    multiple: a phase without an explicit deadline expires after ``multiple`` x the median
      of its durations so far (once it has ``min_samples``).
    floor_secs: the least such a median-derived deadline is (seconds).
    min_samples: durations of a phase needed before its median counts.
    first_secs: the deadline of a phase with neither an explicit deadline nor enough
      samples (seconds; None: none).
    poll_secs: how often the thread looks (seconds).
    workdir: a directory for ``watchdog.jsonl`` (the records of expiries), or None.
    exit_code: the status the process exits with (default :data:`EXIT_CODE`).
    exit: the function that ends the process (default ``os._exit``; tests inject one).

  Raises:
    ValueError: a deadline, ``multiple``, ``floor_secs``, ``first_secs`` or ``poll_secs``
      that is not a positive number, or ``min_samples`` < 1 (the message names it).

  Attributes:
    expired: the record of the expiry (a dict, as written to ``watchdog.jsonl``), or None.
  """

  needs_state = False
  fires_at_preemption = False

  def __init__(self, deadlines: Mapping[str, float | None] | None = None, *,
               multiple: float = 20.0, floor_secs: float = 300.0, min_samples: int = 5,
               first_secs: float | None = 3600.0, poll_secs: float = 1.0,
               workdir: str | os.PathLike | None = None, exit_code: int = EXIT_CODE,
               exit: Callable[[int], Any] = os._exit):  # pylint: disable=redefined-builtin
    super().__init__(every_steps=None, at_steps=(), at_end=False)
    given = dict(deadlines or {})
    for name, secs in given.items():
      if secs is not None:
        _check_positive(f"deadlines[{name!r}]", secs)
    for name, value in (("multiple", multiple), ("floor_secs", floor_secs),
                        ("poll_secs", poll_secs)):
      _check_positive(name, value)
    if first_secs is not None:
      _check_positive("first_secs", first_secs)
    if not isinstance(min_samples, int) or min_samples < 1:
      raise ValueError(f"min_samples must be an int >= 1, got {min_samples!r}")
    self.deadlines: dict[str, float | None] = {"compile": 3600.0, **given}
    self.multiple, self.floor_secs, self.min_samples = multiple, floor_secs, min_samples
    self.first_secs, self.poll_secs = first_secs, poll_secs
    self.workdir = None if workdir is None else os.fspath(workdir)
    self.exit_code, self._exit = exit_code, exit
    self.expired: dict[str, Any] | None = None
    # (phase, step, start time, samples' name) of the phase the run is in, or None; written
    # by the run's thread only (one assignment: the watchdog's thread reads a whole tuple).
    self._current: tuple[str, int, float, str] | None = None
    self._samples: dict[str, collections.deque] = {}
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  # -- the run's side (called around each phase) -------------------------------------------

  def enter_phase(self, phase: str, step: int, samples: str | None = None) -> None:
    """The run enters ``phase`` at global step ``step``.

    ``samples``: the name its duration's median is kept under (default ``phase``: a
    device call's dispatch and its wait for outputs are one phase, two medians).
    """
    self._current = (phase, step, time.perf_counter(), samples or phase)

  def leave_phase(self) -> None:
    """The run leaves the phase it entered; its duration joins the phase's samples."""
    current = self._current
    if current is None:
      return
    self._current = None
    samples = self._samples.get(current[3])
    if samples is None:
      samples = self._samples[current[3]] = collections.deque(maxlen=_HISTORY)
    samples.append(time.perf_counter() - current[2])

  def deadline(self, phase: str, samples_name: str | None = None) -> tuple[float | None, str]:
    """The deadline of ``phase`` now, in seconds (None: none), and how it was set.

    ``samples_name``: whose durations give the median (default ``phase``).
    """
    if phase in self.deadlines:
      return self.deadlines[phase], "explicit"
    samples = self._samples.get(samples_name or phase)
    if samples is not None and len(samples) >= self.min_samples:
      try:
        median = statistics.median(list(samples))
      except RuntimeError:  # appended to while copied: the next poll reads it
        return None, "busy"
      secs = max(self.floor_secs, self.multiple * median)
      return secs, (f"max(floor {self.floor_secs:g} s, {self.multiple:g} x median "
                    f"{median:.3g} s of {len(samples)} samples)")
    return self.first_secs, "first_secs (too few samples for a median)"

  # -- hook protocol -----------------------------------------------------------------------

  def on_run_start(self, ctx: RunContext, state: Any) -> None:
    del ctx, state
    self._samples = {}
    self._stop.clear()
    self._thread = threading.Thread(target=self._watch, name="loopkit-watchdog", daemon=True)
    self._thread.start()

  def on_run_end(self, ctx: RunContext, state: Any) -> None:
    del ctx, state
    self._halt()

  def on_run_error(self, ctx: RunContext, error: BaseException) -> None:
    del ctx, error
    self._halt()

  # -- the watchdog's thread ---------------------------------------------------------------

  def _halt(self) -> None:
    self._stop.set()
    self._current = None
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(timeout=self.poll_secs + 1.0)
    self._thread = None

  def _watch(self) -> None:
    while not self._stop.wait(self.poll_secs):
      current = self._current
      if current is None:
        continue
      phase, step, t0, samples_name = current
      secs, how = self.deadline(phase, samples_name)
      elapsed = time.perf_counter() - t0
      if secs is not None and elapsed > secs and self._current is current:
        self._expire(phase, step, elapsed, secs, how)
        return

  def _expire(self, phase: str, step: int, elapsed: float, secs: float, how: str) -> None:
    """Reports the stuck phase, dumps every thread's stack, records it, exits."""
    me, count = jax.process_index(), jax.process_count()
    record: dict[str, Any] = {
        "process": me, "process_count": count, "phase": phase, "step": step,
        "elapsed_secs": elapsed, "deadline_secs": secs, "deadline": how,
        "time": time.time(), "exit_code": self.exit_code}
    line = (f"loopkit watchdog: process {me} of {count} stuck in phase {phase!r} after step "
            f"{step}: {elapsed:.1f} s, past its deadline of {secs:g} s ({how})")
    if phase == "agreement" and count > 1:
      waiting = agreement.waiting_for()
      if waiting is not None:
        number, missing = waiting
        record.update(agreement=number, not_arrived=missing)
        line += (f"; not arrived at agreement {number}: process"
                 f"{'es' * (len(missing) != 1)} {', '.join(map(str, missing)) or 'none'}")
    line += f"; exiting with status {self.exit_code}"
    record["message"] = line
    self.expired = record
    try:
      log.error("%s", line)
      sys.stderr.write(f"loopkit watchdog: every thread's stack in process {me}:\n")
      sys.stderr.flush()
      _dump_stacks()
      sys.stderr.flush()
      if self.workdir is not None:
        os.makedirs(self.workdir, exist_ok=True)
        with open(os.path.join(self.workdir, "watchdog.jsonl"), "a") as f:
          f.write(json.dumps(record) + "\n")
    finally:
      self._exit(self.exit_code)


def _dump_stacks() -> None:
  """Every thread's stack to stderr: :mod:`faulthandler` (which also reads a thread stuck in
  C code), or, where stderr has no file descriptor (a notebook, a captured stream), the
  frames Python holds."""
  try:
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    return
  except (AttributeError, ValueError, OSError):  # no fileno (io.UnsupportedOperation too)
    pass
  names = {t.ident: t.name for t in threading.enumerate()}
  for ident, frame in sys._current_frames().items():  # pylint: disable=protected-access
    sys.stderr.write(f"Thread {ident:#x} ({names.get(ident, '?')}, most recent call last):\n")
    sys.stderr.write("".join(traceback.format_stack(frame)))


def _check_positive(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
    raise ValueError(f"Watchdog: {name} must be a positive number of seconds, got {value!r}")
