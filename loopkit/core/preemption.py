"""Preemption: a signal sets a flag, the processes agree at a loop boundary.

Cluster schedulers announce a preemption with SIGTERM (and a person at a
terminal with SIGINT) some seconds before killing the job. :class:`TrainLoop`
owns a :class:`PreemptionWatcher` for the duration of each ``run``:

1. the signal handler only sets a flag (safe at any moment, even while the
   main thread waits for the device);
2. a flag set while the next chunk is being formed makes the feeder abandon
   it (after the batch being read: user code is not interrupted), so the loop
   reaches the boundary within about one batch's read time, not a chunk's;
3. before dispatching each device call, the loop agrees on this flag together
   with every other host-local decision of the boundary
   (:func:`loopkit.core.agreement.agree`): on one process that is the flag itself; on
   several processes one exchange through ``jax.distributed``'s coordination service, so
   every process stops at the *same*
   boundary even if the signal reached them at different times;
4. when they agree, the loop stops there: hooks with ``at_end`` fire with the
   state (a :class:`~loopkit.checkpoint.CheckpointHook` saves at that step even
   off its cadence and waits for the write in ``on_run_end``), and
   ``loop.status == "preempted"``.

This does not use JAX's preemption sync service
(``multihost_utils.reached_preemption_sync_point``), which needs a call at
every consecutive step id; with K steps per call the step jumps by K.

A flag set before ``run`` (``loop.preemption.request()``) or by a hook's
``on_run_start`` stops the run at its first boundary, before any call; the
loop starts a fresh watcher when a run ends, so the next run starts unflagged.

Cost: on one process, reading a Python bool per call. On several processes,
one blocking all-gather per call, shared with the other decisions agreed at each boundary.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence
from typing import Any

from loopkit.core.agreement import agree

log = logging.getLogger("loopkit")

DEFAULT_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)


class PreemptionWatcher:
  """Turns preemption signals into a flag the processes agree on.

  Args:
    signals: signal numbers to catch (default SIGTERM and SIGINT); empty to
      catch none (:meth:`request` still works).

  A second SIGINT while the flag is already set raises ``KeyboardInterrupt``
  (a person insisting); a repeated SIGTERM is ignored. Handlers can only be
  installed from the main thread; elsewhere :meth:`install` is a no-op with a
  log message. Thread-safety: the flag may be set from any thread; install,
  uninstall and agreed are for the loop's thread. Multi-host-safe: every
  process must call :meth:`agreed` at the same boundaries.
  """

  def __init__(self, signals: Sequence[int] = DEFAULT_SIGNALS):
    self.signals = tuple(signals)
    self._flag = threading.Event()
    self._previous: dict[int, Any] = {}
    self.signal_received: int | None = None

  def install(self) -> None:
    """Installs the handlers, remembering the previous ones."""
    if not self.signals:
      return
    if threading.current_thread() is not threading.main_thread():
      log.info("not in the main thread, preemption signals are not caught")
      return
    for sig in self.signals:
      self._previous[sig] = signal.getsignal(sig)
      signal.signal(sig, self._handle)

  def uninstall(self) -> None:
    """Restores the handlers that were there before :meth:`install`."""
    for sig, previous in self._previous.items():
      signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
    self._previous.clear()

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    if self._flag.is_set() and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signal_received = signum
    self._flag.set()
    log.warning("received %s; stopping at the next loop boundary",
                signal.Signals(signum).name)

  def request(self) -> None:
    """Sets the flag as a signal would (e.g. from a scheduler's notice)."""
    self._flag.set()

  @property
  def event(self) -> threading.Event:
    """This process's flag as an event (set once, never cleared), for waits that
    should end at a preemption, e.g. the feeder's chunk formation."""
    return self._flag

  @property
  def requested(self) -> bool:
    """This process's flag (no communication)."""
    return self._flag.is_set()

  def agreed(self) -> bool:
    """Whether any process has its flag set; the same answer on every process.

    Returns:
      True if this or any other process received a preemption signal.
    """
    return agree([self._flag.is_set()])[0]
