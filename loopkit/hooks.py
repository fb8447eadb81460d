"""Hooks: host code that runs only at loop boundaries.

A hook sees a :class:`LoopInfo` (the call's step range, epoch, metrics already on
the host) and, if it asks for it, the train state. Hooks are called in the order
given, always in step order. Two entry points:

* :meth:`Hook.observe` after *every* device call (cheap host bookkeeping; may
  run one loop late, after the next call was dispatched);
* :meth:`Hook.after_call` when the hook's :class:`~loopkit.triggers.Trigger`
  fires. The step-based marks of the trigger are landed on exactly by the
  planner. A hook with ``needs_state=True`` gets the state and may return a
  replacement (same structure, shapes, dtypes and shardings); the loop then
  synchronises at that boundary. Hooks with ``needs_state=False`` get
  ``state=None`` and never stall the next dispatch.

Early stop and preemption: when a run stops before its planned end
(``loop.request_stop(reason)``, or a SIGTERM/SIGINT that the processes agree on
at a boundary, see :mod:`loopkit.preemption`), the loop stops *before*
dispatching the next call; hooks whose trigger has ``at_end`` and that did not
fire on the last call then fire with that boundary's state and
``info.is_last=True`` (this is how a checkpoint lands off its cadence at a
preemption), then ``on_run_end`` runs and ``loop.status`` is the reason
(``"preempted"``).

Every decision to fire is the same on every process: step marks are
deterministic, and the wall-clock part of a trigger (``every_secs``), stop
requests and preemption flags are agreed at each boundary
(:mod:`loopkit.boundary`). A run that makes no device call (stopped before the
first one, or started at its target) fires its ``at_end`` hooks that have a
mark once with an empty :class:`LoopInfo` (``num_steps == 0``, no metrics).

What a hook may touch (:mod:`loopkit.context`): it reads its
:class:`LoopInfo` and a read-only :class:`~loopkit.context.RunContext` (``ctx``,
given to ``on_run_start`` / ``on_run_end`` / ``on_run_error``), and *returns*
what it changes: a new state, a :class:`~loopkit.context.Restore` (state,
ledger and data position together) from ``on_run_start``, or a
:class:`~loopkit.context.LedgerAdjustment` from ``adjust_ledger``. It may ask
for a stop (``ctx.request_stop``, ``ctx.preemption.request()``); it may write
its own attributes and files. Only the run writes the ledger, the data
position, the status and the state.

Hooks are not thread-safe; on multi-host every process runs every hook (a hook
that writes files should write on process 0 only).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from loopkit import metrics as metrics_lib
from loopkit.context import LedgerAdjustment, RunContext
from loopkit.ledger import Bucket
from loopkit.triggers import Trigger
from loopkit.writers import ConsoleWriter, as_writer

log = logging.getLogger("loopkit")


@dataclasses.dataclass(frozen=True)
class LoopInfo:
  """Record of one device call, on the host.

  Attributes:
    start_step: global step before the call.
    end_step: global step after the call (= state step = optimizer count).
    loop_index: 0-based index of this device call in the whole training (resumes
      included).
    epoch: 0-based epoch the call's steps belong to (a call never crosses an
      epoch end); 0 if ``steps_per_epoch`` is unknown.
    step_in_epoch: steps done in the epoch after the call (== steps_per_epoch
      at an epoch end).
    examples_seen: training examples consumed after the call.
    metrics: metric values for the call (float): ``compute()`` of ``metric_values``.
    metric_values: the call's per-step values folded in step order (mergeable float32
      values, numpy scalars): ``fold_steps(step_values[name])``.
    traces: per-step values, float32 arrays ``[end_step - start_step]``.
    is_last: the last call of this ``run``.
    data_position: the source position after this call's last batch (what a
      checkpoint must store to resume with the next unconsumed batch).
    step_values: the per-step mergeable values, fields ``[end_step - start_step]``
      (float32 numpy). A value over several calls that must not depend on K continues
      the fold, ``fold_steps(info.step_values[name], running)``, as
      :class:`LoggingHook` does; merging ``metric_values`` across calls instead
      associates the sums by call, which changes the last bits with K (case C50).
  """

  start_step: int
  end_step: int
  loop_index: int
  epoch: int
  step_in_epoch: int
  examples_seen: int
  metrics: dict[str, float]
  metric_values: dict[str, metrics_lib.Metric]
  traces: dict[str, np.ndarray]
  is_last: bool = False
  data_position: Any = None
  step_values: dict[str, metrics_lib.Metric] = dataclasses.field(default_factory=dict)

  @property
  def num_steps(self) -> int:
    return self.end_step - self.start_step


class Hook:
  """Base class of hooks.

  Args:
    every_steps, every_epochs, at_steps, every_secs, at_end: the hook's
      trigger (see :class:`loopkit.triggers.Trigger`); none set = every call.
      ``at_end`` also covers early stops and preemption (module docstring).

  A hook whose own state must survive a resume may define
  ``checkpoint_state() -> dict`` (JSON-serialisable) and
  ``restore_checkpoint_state(d: dict)``; :class:`loopkit.checkpoint.CheckpointHook`
  saves it with each checkpoint, keyed by the hook's stable name
  (``hook_name``, default the class name, ``#2``... for repeats; see
  :func:`loopkit.context.hook_names`), and the loop hands it back on a restore.
  A hook with ``flush()`` is flushed by the loop before a checkpoint is saved.

  Attributes:
    needs_state: the hook reads the state in ``after_call`` (the loop then
      synchronises at its boundaries).
    time_bucket: the ledger bucket its time goes to (:class:`~loopkit.ledger.Bucket`).
    hook_name: stable name for its saved state (None: the class name).
  """

  needs_state: bool = True
  time_bucket: str = Bucket.HOOKS
  hook_name: str | None = None

  def __init__(self, *, every_steps: int | None = None, every_epochs: float | None = None,
               at_steps: Sequence[int] | None = None, every_secs: float | None = None,
               at_end: bool = True):
    self.trigger = Trigger(every_steps=every_steps, every_epochs=every_epochs,
                           at_steps=at_steps, every_secs=every_secs, at_end=at_end)

  def on_run_start(self, ctx: RunContext, state: Any) -> Any | None:
    """Called once per ``run`` before the first call, in hook order.

    Args:
      ctx: the run's read-only :class:`~loopkit.context.RunContext`
        (``ctx.ledger`` is at the state's step, or at a restore by an earlier hook).
      state: the state the run starts from.

    Returns:
      None; a replacement state at the same step; or a
      :class:`~loopkit.context.Restore` (state, ledger and data position
      together, e.g. from a checkpoint), which the loop applies.
    """

  def adjust_ledger(self, ctx: RunContext) -> LedgerAdjustment | None:
    """Called once per ``run`` after every ``on_run_start`` (restores applied).

    Returns:
      None or a :class:`~loopkit.context.LedgerAdjustment` for the loop to
      apply (e.g. :class:`~loopkit.goodput.GoodputHook`'s work lost to restarts).
    """
    del ctx
    return None

  def observe(self, info: LoopInfo) -> None:
    """Called after every device call, in step order."""

  def after_call(self, info: LoopInfo, state: Any) -> Any | None:
    """Called when the trigger fires; return a new state or None."""
    return None

  def on_run_end(self, ctx: RunContext, state: Any) -> Any | None:
    """Called once at the end of ``run`` (also after a stop or preemption).

    ``ctx.ledger.seconds["total"]`` is current (up to this call). May return a
    replacement state.
    """
    return None

  def on_run_error(self, ctx: RunContext, error: BaseException) -> None:
    """Called once when ``run`` leaves by an exception, if this hook's ``on_run_start`` ran.

    Every hook whose ``on_run_start`` was called gets it, in hook order: all
    of them for an error after the start; when an ``on_run_start`` raises,
    the hooks before it and that hook itself (it may have half-opened
    something), not the hooks after it, which never started. For cleanup that
    must finish before the error reaches the caller, e.g. waiting for a
    background write (:class:`~loopkit.checkpoint.CheckpointHook` waits for
    its in-flight save and releases its directory). ``on_run_end`` is not
    called then; the loop keeps the work done in ``loop.last_state``.
    Exceptions raised here are logged, not raised: ``run`` raises ``error``.

    Args:
      ctx: the run's :class:`~loopkit.context.RunContext`.
      error: the exception that ends the run (any ``BaseException``, e.g. a
        ``KeyboardInterrupt``).
    """


class CallbackHook(Hook):
  """Calls ``fn(info, state)`` when the trigger fires; ``fn`` may return a new state.

  Args:
    fn: the callback.
    needs_state: pass False when ``fn`` ignores the state (then it gets None and
      the loop does not synchronise for it).
    **trigger: see :class:`Hook`.
  """

  def __init__(self, fn: Callable[[LoopInfo, Any], Any], *, needs_state: bool = True,
               **trigger):
    super().__init__(**trigger)
    self.fn = fn
    self.needs_state = needs_state

  def after_call(self, info, state):
    return self.fn(info, state)


class NonFiniteError(FloatingPointError):
  """A metric became NaN or Inf; the message names the metric and the step."""


class NonFiniteWarning(RuntimeWarning):
  """A metric became NaN or Inf in a run without :class:`NanCheckHook` (once per run; the
  message names the metric and the first such step)."""


class NanCheckHook(Hook):
  """Stops training when a metric is NaN or Inf, naming the first bad step.

  Checks every call's per-step traces (so the exact step is known) and raises
  :class:`NonFiniteError` with the metric name, that step and the call's step
  range. Runs one loop late (it needs no state).

  Args:
    metric_names: metrics to check (default: all).
  """

  needs_state = False

  def __init__(self, metric_names: Sequence[str] | None = None):
    super().__init__()
    self.metric_names = metric_names

  def observe(self, info: LoopInfo) -> None:
    names = self.metric_names if self.metric_names is not None else sorted(info.traces)
    for name in names:
      trace = info.traces[name]
      if np.isfinite(trace).all():
        continue
      bad = np.flatnonzero(~np.isfinite(trace))
      if bad.size:
        step = info.start_step + int(bad[0]) + 1
        raise NonFiniteError(
            f"metric {name!r} is {trace[bad[0]]} at step {step} (device call "
            f"{info.loop_index} ran steps {info.start_step + 1}..{info.end_step})")


def _prints_to_console(writer: Any) -> bool:
  """Whether ``writer`` logs its scalars itself (a ConsoleWriter, possibly wrapped)."""
  if isinstance(writer, ConsoleWriter):
    return True
  inner = getattr(writer, "writers", None)  # MultiWriter
  if isinstance(inner, list):
    return any(_prints_to_console(w) for w in inner)
  wrapped = getattr(writer, "writer", None)  # AsyncWriter
  return wrapped is not None and wrapped is not writer and _prints_to_console(wrapped)


class LoggingHook(Hook):
  """Logs metrics averaged (merged) over all steps since its last firing.

  A row is the fold of the per-step values in step order (:func:`loopkit.metrics.fold_steps`
  of ``LoopInfo.step_values``), so its values are bitwise the same for every
  ``iterations_per_loop`` (case C50).

  Args:
    writer: optional object with ``write_scalars(step: int, scalars: dict)``
      (e.g. :class:`loopkit.writers.JsonlWriter`, CLU's ``metric_writers``) or
      Flax's ``tensorboard.SummaryWriter`` (see :func:`loopkit.writers.as_writer`);
      metrics are also logged to
      the ``loopkit`` Python logger at INFO (by process 0 only on multi-host),
      unless the writer prints them itself (a
      :class:`~loopkit.writers.ConsoleWriter`, alone or inside a
      ``MultiWriter`` / ``AsyncWriter``, as :func:`create_default_writer` makes).
    per_step: also write every step's value at its true step number, under
      the key ``per_step/<name>`` (its own key and TensorBoard section, so a
      per-step row never reads as an averaged row of the same step).
    throughput: add host-clock throughput to each row written to ``writer``
      (not to ``records`` or the log line), measured since the previous row;
      the first window of a run starts after its first device call, so the
      compilation is not counted (as CLU's ``ReportProgress``):
      ``throughput/steps_per_sec``, ``throughput/examples_per_sec``,
      ``throughput/secs_per_call`` (seconds per device call), and
      ``throughput/goodput`` (:func:`loopkit.goodput.summarize` of the loop's
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
    self._log = not _prints_to_console(writer)
    self._acc: dict[str, metrics_lib.Metric] = {}
    self._first_step: int | None = None  # first step merged into _acc
    self._ctx: RunContext | None = None
    self._mark: tuple[float, int, int, int] | None = None  # (time, step, examples, calls)
    self._calls = 0
    self.records: list[tuple[int, dict[str, float]]] = []
    self.first_steps: list[int | None] = []

  def on_run_start(self, ctx: RunContext, state: Any) -> None:
    del state
    self._ctx = ctx
    self._mark = None

  def observe(self, info: LoopInfo) -> None:
    if not self._acc:
      self._first_step = info.start_step + 1
    for k, v in info.step_values.items():  # one fold in step order: the same for every K
      self._acc[k] = metrics_lib.fold_steps(v, self._acc[k]) if k in self._acc else (
          info.metric_values[k])
    self._calls += 1
    if self._mark is None:  # the run's first call (compiles): throughput starts after it
      self._mark = (self.clock(), info.end_step, info.examples_seen, self._calls)
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
    the first row averages the same steps as without the kill (case C42): a
    row at step 20 with a checkpoint at 12 covers steps 11..20, bitwise the
    same values. (The loop has called :meth:`flush` just before: the rows a
    checkpoint covers survive a kill.)
    """
    return {"acc": {k: metrics_lib.to_json(v) for k, v in self._acc.items()},
            "first_step": self._first_step}

  def restore_checkpoint_state(self, d: dict[str, Any]) -> None:
    self._acc = {k: metrics_lib.from_json(v) for k, v in d.get("acc", {}).items()}
    self._first_step = d.get("first_step")

  def _throughput(self, info: LoopInfo) -> dict[str, float]:
    if self._mark is None:
      return {}
    now = self.clock()
    t0, s0, e0, c0 = self._mark
    self._mark = (now, info.end_step, info.examples_seen, self._calls)
    dt, calls = now - t0, self._calls - c0
    if calls <= 0 or dt <= 0:
      return {}
    out = {"throughput/steps_per_sec": (info.end_step - s0) / dt,
           "throughput/examples_per_sec": (info.examples_seen - e0) / dt,
           "throughput/secs_per_call": dt / calls}
    if self._ctx is not None:
      ledger = self._ctx.ledger
      from loopkit import goodput  # goodput imports this module
      g = goodput.summarize(ledger, info.end_step).goodput
      if math.isfinite(g):
        out["throughput/goodput"] = g
    return out

  def after_call(self, info, state):
    if not self._acc:  # nothing ran since the last row (e.g. a run that made no call)
      return None
    scalars = {k: metrics_lib.compute(v) for k, v in self._acc.items()}
    self._acc = {}
    scalars.update(epoch=info.epoch, examples_seen=info.examples_seen)
    self.records.append((info.end_step, scalars))
    self.first_steps.append(self._first_step)
    if self._log and jax.process_index() == 0:  # multi-host: one line per boundary
      log.info("step %d: %s", info.end_step,
               ", ".join(f"{k}={v:.6g}" if isinstance(v, float) and not math.isnan(v)
                         else f"{k}={v}" for k, v in scalars.items()))
    extra = self._throughput(info) if self.throughput else {}
    if self.writer is not None:
      self.writer.write_scalars(info.end_step, {**scalars, **extra})
