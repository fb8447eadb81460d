"""The logging hook: metric rows averaged over the steps since the last row.

Rows go to a writer (:mod:`loopkit.observe.writers`) and to the ``loopkit``
logger; each row is the fold of the per-step values in step order, so it is the
same for every ``iterations_per_loop``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import jax

from loopkit import metrics as metrics_lib
from loopkit.core.context import RunContext
from loopkit.core.hooks import Hook, LoopInfo
from loopkit.core.ledger import hook_seconds
from loopkit.observe import goodput
from loopkit.observe.writers import as_writer, keep_rows_through, prints_to_console

log = logging.getLogger("loopkit")


class LoggingHook(Hook):
  """Logs metrics averaged (merged) over all steps since its last firing.

  A row is the fold of the per-step values in step order (:func:`loopkit.metrics.fold_steps`
  of ``LoopInfo.step_values``), so its values are bitwise the same for every
  ``iterations_per_loop``.

  Args:
    writer: optional object with ``write_scalars(step: int, scalars: dict)``
      (e.g. :class:`loopkit.observe.writers.JsonlWriter`, CLU's ``metric_writers``) or
      Flax's ``tensorboard.SummaryWriter`` (see :func:`loopkit.observe.writers.as_writer`);
      metrics are also logged to
      the ``loopkit`` Python logger at INFO (by process 0 only on multi-host),
      unless the writer prints them itself (asked at each row:
      :func:`~loopkit.observe.writers.prints_to_console`; a
      :class:`~loopkit.observe.writers.ConsoleWriter`, alone or inside a
      ``MultiWriter`` / ``AsyncWriter``, as :func:`create_default_writer` makes; CLU's
      ``LoggingWriter`` while absl shows INFO lines): each row is printed once.
    per_step: also write every step's value at its true step number, under
      the key ``per_step/<name>`` (its own key and TensorBoard section, so a
      per-step row never reads as an averaged row of the same step).
    throughput: add host-clock throughput to each row written to ``writer``
      (not to ``records`` or the log line), measured since the previous row;
      the first window of a run starts after its first device call, so the
      compilation is not counted (as CLU's ``ReportProgress``):
      ``throughput/steps_per_sec``, ``throughput/examples_per_sec``,
      ``throughput/secs_per_call`` (wall seconds per device call, the hooks'
      time included), ``throughput/loop_secs_per_call`` (the same without
      the hooks: how long one loop takes, i.e. dispatch, the device, the data
      wait and the loop's bookkeeping), ``throughput/hook_secs`` (the
      seconds the hooks took in the window, all of them: logging, evaluation,
      checkpoints..., from the loop's ledger, :func:`loopkit.core.ledger.hook_seconds`;
      ``secs_per_call = loop_secs_per_call + hook_secs / calls``), and
      ``throughput/goodput`` (:func:`loopkit.observe.goodput.summarize` of the loop's
      ledger: the productive fraction of the job so far, in [0, 1]). A row
      whose window holds only the run's first call has no throughput keys.
    clock: monotonic clock in seconds for the throughput (inject in tests).
    **trigger: see :class:`Hook` (default: every call).

  Durability: :meth:`flush` flushes the writer; the loop calls it (for every
  hook with a ``flush``) before a :class:`~loopkit.checkpoint.CheckpointHook`
  saves, and ``on_run_end`` calls it, so the rows up to a checkpoint are on
  disk before the checkpoint is.
  Put the LoggingHook *before* the CheckpointHook in ``hooks`` so that the
  row of the checkpoint's own step is written (and flushed) before the save.

  Attributes:
    records: ``[(step, scalars)]`` of every row, in order.
    first_steps: for each row, the first step its averages cover (the row at
      ``step`` covers ``first_steps[i]..step``). The accumulator is saved with
      checkpoints (:meth:`checkpoint_state`), so a resumed run's first row
      covers the same steps as an uninterrupted one.
  """

  needs_state = False

  def __init__(self, writer: Any = None, *, per_step: bool = False, throughput: bool = True,
               clock: Callable[[], float] = time.perf_counter, **trigger):
    super().__init__(**trigger)
    self.writer = None if writer is None else as_writer(writer)
    self.per_step = per_step
    self.throughput = throughput
    self.clock = clock
    self._acc: dict[str, metrics_lib.Metric] = {}
    self._first_step: int | None = None  # first step merged into _acc
    self._ctx: RunContext | None = None
    # (time, step, examples, calls, hooks' seconds in the ledger) at the window's start
    self._mark: tuple[float, int, int, int, float] | None = None
    self._calls = 0
    self.records: list[tuple[int, dict[str, float]]] = []
    self.first_steps: list[int | None] = []

  def on_run_start(self, ctx: RunContext, state: Any) -> None:
    del state
    self._ctx = ctx
    self._mark = None

  def adjust_ledger(self, ctx: RunContext) -> None:
    """Tells the writer the step the run continues from (restores applied), so a resumed
    run's file writers keep the earlier rows up to it (``keep_rows_through``)."""
    if self.writer is not None:
      keep_rows_through(self.writer, ctx.ledger.step)

  def after_each_call(self, info: LoopInfo) -> None:
    if not self._acc:
      self._first_step = info.start_step + 1
    for k, v in info.step_values.items():  # one fold in step order: the same for every K
      self._acc[k] = metrics_lib.fold_steps(v, self._acc[k]) if k in self._acc else (
          info.metric_values[k])
    self._calls += 1
    if self._mark is None:  # the run's first call (compiles): throughput starts after it
      self._mark = (self.clock(), info.end_step, info.examples_seen, self._calls,
                    self._hook_secs())
    if self.per_step and self.writer is not None:
      for i in range(info.num_steps):
        self.writer.write_scalars(
            info.start_step + i + 1,
            {f"per_step/{k}": float(v[i]) for k, v in info.traces.items()})

  def flush(self) -> None:
    """Flushes the writer (makes the rows written so far durable)."""
    flush = getattr(self.writer, "flush", None)
    if flush is not None:
      flush()

  def on_run_end(self, ctx: RunContext, state: Any) -> None:
    """Flushes the writer: the run's last rows are on disk even if the writer is never closed."""
    del ctx, state
    self.flush()

  def checkpoint_state(self) -> dict[str, Any]:
    """The running accumulator (metrics merged since the last row), for checkpoints.

    Restored by :meth:`restore_checkpoint_state`, so after a kill and resume
    the first row averages the same steps as without the kill: a
    row at step 20 with a checkpoint at 12 covers steps 11..20, bitwise the
    same values. (The loop has called :meth:`flush` just before: the rows a
    checkpoint covers survive a kill.)
    """
    return {"acc": {k: metrics_lib.to_json(v) for k, v in self._acc.items()},
            "first_step": self._first_step}

  def restore_checkpoint_state(self, d: dict[str, Any]) -> None:
    self._acc = {k: metrics_lib.from_json(v) for k, v in d.get("acc", {}).items()}
    self._first_step = d.get("first_step")

  def _hook_secs(self) -> float:
    """The hooks' seconds in the loop's ledger so far (0 outside a run)."""
    return 0.0 if self._ctx is None else hook_seconds(self._ctx.ledger.seconds)

  def _throughput(self, info: LoopInfo) -> dict[str, float]:
    if self._mark is None:
      return {}
    now, hooks = self.clock(), self._hook_secs()
    t0, s0, e0, c0, h0 = self._mark
    self._mark = (now, info.end_step, info.examples_seen, self._calls, hooks)
    dt, calls = now - t0, self._calls - c0
    if calls <= 0 or dt <= 0:
      return {}
    hook_secs = hooks - h0
    out = {"throughput/steps_per_sec": (info.end_step - s0) / dt,
           "throughput/examples_per_sec": (info.examples_seen - e0) / dt,
           "throughput/secs_per_call": dt / calls,
           "throughput/loop_secs_per_call": max(dt - hook_secs, 0.0) / calls,
           "throughput/hook_secs": hook_secs}
    if self._ctx is not None:
      ledger = self._ctx.ledger
      g = goodput.summarize(ledger, info.end_step).goodput
      if math.isfinite(g):
        out["throughput/goodput"] = g
    return out

  def on_trigger(self, info, state):
    if not self._acc:  # nothing ran since the last row (e.g. a run that made no call)
      return None
    scalars = {k: metrics_lib.compute(v) for k, v in self._acc.items()}
    self._acc = {}
    scalars.update(epoch=info.epoch, examples_seen=info.examples_seen)
    self.records.append((info.end_step, scalars))
    self.first_steps.append(self._first_step)
    if jax.process_index() == 0 and not prints_to_console(self.writer):  # printed once
      log.info("step %d: %s", info.end_step,
               ", ".join(f"{k}={v:.6g}" if isinstance(v, float) and not math.isnan(v)
                         else f"{k}={v}" for k, v in scalars.items()))
    extra = self._throughput(info) if self.throughput else {}
    if self.writer is not None:
      self.writer.write_scalars(info.end_step, {**scalars, **extra})
