"""ProfilerHook: a ``jax.profiler`` trace over a chosen range of steps.

The trace covers the device calls for steps ``start_step + 1 .. start_step +
num_steps``. Both ends are step marks of the hook's trigger, so the planner
cuts calls to land on them exactly: the trace starts right after the call that
ends at ``start_step`` and stops right after the call that ends at
``start_step + num_steps`` has finished. At those two boundaries (only) the
loop synchronises (the hook has ``needs_state=True``), so the trace holds whole
calls and nothing of the neighbouring ones.

Files go to ``logdir/plugins/profile/<run>/<host>.xplane.pb`` (plus a
``.trace.json.gz``): the layout TensorBoard's profile plugin reads, so
``tensorboard --logdir <logdir>`` shows them next to the metrics.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax

from loopkit.core.hooks import Hook, LoopInfo

__all__ = ["ProfilerHook"]

log = logging.getLogger("loopkit")


class ProfilerHook(Hook):
  """Traces steps ``(start_step, start_step + num_steps]`` into ``logdir``.

  Args:
    logdir: the TensorBoard log directory (usually the workdir).
    start_step: the global step after which tracing starts (>= 0). Skip the
      first calls: they include compilation.
    num_steps: steps to trace (>= 1); the trace ends at step
      ``start_step + num_steps``.

  Raises:
    ValueError: for ``start_step`` < 0 or ``num_steps`` < 1.

  Attributes:
    trace_dirs: the ``plugins/profile/<run>`` directories this hook wrote.

  Not thread-safe. Multi-host: each process traces itself into ``logdir``
  (one file per host, as TensorBoard expects).
  """

  needs_state = True  # synchronise at the two boundaries so the trace holds whole calls

  def __init__(self, logdir: str | os.PathLike, *, start_step: int, num_steps: int):
    if start_step < 0:
      raise ValueError(f"start_step must be >= 0, got {start_step}")
    if num_steps < 1:
      raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    self.start_step = int(start_step)
    self.stop_step = int(start_step) + int(num_steps)
    # A start at step 0 is handled by on_run_start (no call ends at step 0).
    super().__init__(at_steps=[s for s in (self.start_step, self.stop_step) if s > 0],
                     at_end=False)
    self.logdir = os.fspath(logdir)
    self.trace_dirs: list[str] = []
    self._active = False

  @property
  def active(self) -> bool:
    """Whether a trace is being recorded."""
    return self._active

  def on_run_start(self, loop: Any, state: Any) -> None:
    del state
    if loop.ledger.step == self.start_step:  # e.g. start_step=0 on a fresh run
      self._start()

  def on_trigger(self, info: LoopInfo, state: Any) -> None:
    del state
    if info.end_step == self.start_step and not self._active:
      self._start()
    elif info.end_step == self.stop_step and self._active:
      self._stop()

  def on_run_end(self, loop: Any, state: Any) -> None:
    del loop, state
    if self._active:  # the run ended inside the range
      self._stop()

  def on_run_error(self, ctx: Any, error: BaseException) -> None:
    """The run raises inside the traced range: the trace is stopped and written."""
    del ctx, error
    if self._active:
      self._stop()

  def _start(self) -> None:
    profile_dir = os.path.join(self.logdir, "plugins", "profile")
    before = set(os.listdir(profile_dir)) if os.path.isdir(profile_dir) else set()
    self._before = before
    jax.profiler.start_trace(self.logdir)
    self._active = True
    log.info("profiler: tracing steps %d..%d into %s", self.start_step + 1, self.stop_step,
             self.logdir)

  def _stop(self) -> None:
    jax.profiler.stop_trace()
    self._active = False
    profile_dir = os.path.join(self.logdir, "plugins", "profile")
    new = sorted(set(os.listdir(profile_dir)) - self._before) if os.path.isdir(profile_dir) \
        else []
    self.trace_dirs.extend(os.path.join(profile_dir, d) for d in new)
    log.info("profiler: trace written to %s", ", ".join(self.trace_dirs[-len(new):] or
                                                       [self.logdir]))
