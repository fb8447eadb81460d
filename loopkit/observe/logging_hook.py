"""The logging hook: metric rows averaged over the steps since the last row.

Rows go to a writer (:mod:`loopkit.observe.writers`) and to the ``loopkit``
logger; each row is the fold of the per-step values in step order, so it is the
same for every ``iterations_per_loop``.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

from loopkit import metrics as metrics_lib
from loopkit.core.context import RunContext
from loopkit.core.hooks import Hook, LoopInfo, drop_after
from loopkit.core.ledger import hook_seconds
from loopkit.observe import goodput, peaks
from loopkit.observe.writers import (
  as_writer,
  keep_rows_through,
  mark_run_outcome,
  prints_to_console,
)

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
      ledger: the productive fraction of the job so far, in [0, 1]), and
      ``throughput/call_secs_vs_median`` (step-time deviation: this row's
      ``loop_secs_per_call`` over the median of the run's last 100 rows' values, this
      one included; 1.0 is a typical call, 3.0 a window three times slower: a straggler,
      a slow input, a throttled device; with rows every call, as by default, it is this call
      against the median call; :class:`~loopkit.observe.Watchdog` ends a call that never
      returns). A row
      whose window holds only the run's first call has no throughput keys.
      Compute rows (as MaxText and Levanter log them): ``throughput/tflops_per_device``,
      the TFLOP/s one device ran, ``flops_per_step * steps / loop seconds / 1e12`` with the
      window's steps, its loop seconds (``loop_secs_per_call * calls``: the hooks' time left
      out) and ``flops_per_step`` the train program's FLOPs of one step on one device, from
      XLA's cost analysis of the executable the run dispatches, or from the step's jaxpr
      (matmul and convolution FLOPs) where XLA counted less because it counts an inner
      ``scan``'s body once (layers scanned with ``nnx.scan``)
      (:meth:`loopkit.core.MultiStepProgram.flops_per_step`: no second compilation, the same
      for every K); and, where the device's peak is known, ``throughput/mfu =
      tflops_per_device * 1e12 / peak`` (model FLOPs utilization, 1 = the chip's peak), the
      peak from :data:`loopkit.observe.peaks.PEAKS` for the mesh's ``device_kind`` and
      ``peak_dtype``. Where no peak is known (CPUs, chips not in the table, float32 on TPUs)
      there is no ``mfu`` key, and the reason is logged once per run at INFO; where there are
      no FLOPs (see :meth:`~loopkit.core.MultiStepProgram.cost_analysis`), neither compute
      key. Written only with a ``writer``.
    clock: monotonic clock in seconds for the throughput (inject in tests).
    peak_dtype: the dtype whose peak the MFU divides by: ``"bfloat16"`` (default: the
      matmul dtype of mixed-precision training) or ``"float32"`` (a program whose matmuls
      run in float32); a name or a dtype. loopkit does not guess it from the program: a
      model kept in float32 with bfloat16 matmuls is common.
    peak_flops_per_device: the peak FLOP/s of one device, for a chip not in the table
      (overrides the table and ``peak_dtype``).
    **trigger: see :class:`Hook` (default: every call).

  Raises:
    ValueError: ``peak_dtype`` other than bfloat16 or float32, or ``peak_flops_per_device``
      not a positive number (the message names the value).

  Durability: :meth:`flush` flushes the writer; the loop calls it (for every
  hook with a ``flush``) before a :class:`~loopkit.checkpoint.CheckpointHook`
  saves, and ``on_run_end`` calls it, so the rows up to a checkpoint are on
  disk before the checkpoint is.
  Put the LoggingHook *before* the CheckpointHook in ``hooks`` so that the
  row of the checkpoint's own step is written (and flushed) before the save.

  Cuts and resumes: the rows of a run that was cut and resumed from its
  checkpoints are the rows of the uninterrupted run, the same steps and
  bitwise the same values, however it was cut. A preemption (SIGTERM /
  SIGINT, ``ctx.preemption.request()``) writes no row (``fires_at_preemption``
  is False): the window open there goes into the checkpoint saved there
  (:meth:`checkpoint_state`) and the resumed run's row at the next mark covers
  it whole. After a kill or an exception the run resumes from the last
  checkpoint, whose window is restored, and the file writers drop the rows
  written past it (:func:`~loopkit.observe.writers.keep_rows_through`).

  Attributes:
    records: ``[(step, scalars)]`` of every row, in order (at each run's start and after
      a rewind, those past the step it continues from are dropped, as the writer's rows).
    first_steps: for each row, the first step its averages cover (the row at
      ``step`` covers ``first_steps[i]..step``). The accumulator is saved with
      checkpoints (:meth:`checkpoint_state`), so a resumed run's first row
      covers the same steps as an uninterrupted one.
  """

  needs_state = False
  fires_at_preemption = False  # the open window is saved with the checkpoint, not logged

  def __init__(self, writer: Any = None, *, per_step: bool = False, throughput: bool = True,
               clock: Callable[[], float] = time.perf_counter, peak_dtype: Any = "bfloat16",
               peak_flops_per_device: float | None = None, **trigger):
    super().__init__(**trigger)
    self.peak_dtype = peaks.peak_dtype_name(peak_dtype)
    if peak_flops_per_device is not None and not (
        isinstance(peak_flops_per_device, (int, float)) and math.isfinite(peak_flops_per_device)
        and peak_flops_per_device > 0):
      raise ValueError("peak_flops_per_device must be a positive number of FLOP/s, got "
                       f"{peak_flops_per_device!r}")
    self.peak_flops_per_device = peak_flops_per_device
    self.writer = None if writer is None else as_writer(writer)
    self.per_step = per_step
    self.throughput = throughput
    self.clock = clock
    self._acc: dict[str, metrics_lib.Metric] = {}
    self._first_step: int | None = None  # first step merged into _acc
    self._end_step: int | None = None  # last step merged (None: fresh, or a restored window)
    self._ctx: RunContext | None = None
    # (time, step, examples, calls, hooks' seconds in the ledger) at the window's start
    self._mark: tuple[float, int, int, int, float] | None = None
    self._calls = 0
    self._compute: tuple[float | None, float | None] | None = None  # (FLOPs per step, peak)
    self._loop_secs: collections.deque = collections.deque(maxlen=100)  # rows' loop s / call
    self.records: list[tuple[int, dict[str, float]]] = []
    self.first_steps: list[int | None] = []

  def on_run_start(self, ctx: RunContext, state: Any) -> None:
    del state
    self._ctx = ctx
    self._mark = None
    self._compute = None
    self._loop_secs.clear()

  def adjust_ledger(self, ctx: RunContext) -> None:
    """Takes the step ``S`` the run continues from (restores applied).

    Tells the writer (``keep_rows_through``: a resumed run's file writers keep
    the earlier rows up to ``S``), drops :attr:`records` past ``S``, and starts
    a new window when the one held does not end at ``S`` (a second run of the
    same hook from another state, without a restore of its window). Also called
    after a rewind (the run went back to ``S``): the throughput is measured
    afresh from the next call.
    """
    step = ctx.ledger.step
    if self.writer is not None:
      keep_rows_through(self.writer, step)
    if self._end_step is not None and self._end_step != step:
      self._acc, self._first_step = {}, None
    self._end_step = step
    if self._mark is not None and self._mark[1] > step:  # a rewind: throughput starts again
      self._mark = None
      self._loop_secs.clear()
    drop_after(self.records, step)
    del self.first_steps[len(self.records):]

  def after_each_call(self, info: LoopInfo) -> None:
    self._end_step = info.end_step
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
    """Flushes the writer: the run's last rows are on disk even if the writer is never closed;
    tells it how the run ended (:func:`~loopkit.observe.writers.mark_run_outcome`: a tracker
    marks its run)."""
    del state
    self.flush()
    if self.writer is not None:
      mark_run_outcome(self.writer, status=ctx.status)

  def on_run_error(self, ctx: RunContext, error: BaseException) -> None:
    """Tells the writer the run failed or was interrupted
    (:func:`~loopkit.observe.writers.mark_run_outcome`); the loop flushed it just before."""
    del ctx
    if self.writer is not None:
      mark_run_outcome(self.writer, error=error)

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
    """Takes the window a checkpoint saved (:meth:`checkpoint_state`): it ends at the
    checkpoint's step, where the run continues."""
    self._acc = {k: metrics_lib.from_json(v) for k, v in d.get("acc", {}).items()}
    self._first_step = d.get("first_step")
    self._end_step = None

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
    loop_secs = out["throughput/loop_secs_per_call"]
    self._loop_secs.append(loop_secs)
    median = statistics.median(self._loop_secs)
    if median > 0:
      out["throughput/call_secs_vs_median"] = loop_secs / median
    if self.writer is not None:  # the compute keys go to the writer only (as the others)
      out.update(self._utilization(info.end_step - s0,
                                   out["throughput/loop_secs_per_call"] * calls))
    if self._ctx is not None:
      ledger = self._ctx.ledger
      g = goodput.summarize(ledger, info.end_step).goodput
      if math.isfinite(g):
        out["throughput/goodput"] = g
    return out

  def _flops_and_peak(self) -> tuple[float | None, float | None]:
    """(FLOPs per step per device, peak FLOP/s per device), read once per run; logs at INFO
    why a row will lack ``tflops_per_device`` or ``mfu``."""
    if self._compute is None:
      assert self._ctx is not None
      flops = self._ctx.flops_per_step
      kind = self._ctx.mesh.devices.flat[0].device_kind
      peak = self.peak_flops_per_device
      if peak is None:
        peak = peaks.peak_flops(kind, self.peak_dtype)
      self._compute = (flops, peak)
      say = log.info if jax.process_index() == 0 else log.debug
      if flops is None:
        say("LoggingHook: no throughput/tflops_per_device or throughput/mfu: no FLOPs per "
            "step for the train program (XLA's cost analysis gives none, or reading it would "
            "compile the program again: loopkit.core.MultiStepProgram.cost_analysis)")
      elif peak is None:
        known = peaks.PEAKS.get(kind)
        why = (f"device kind {kind!r} has no {self.peak_dtype} peak in "
               "loopkit.observe.peaks.PEAKS (its source publishes none)" if known else
               f"device kind {kind!r} is not in loopkit.observe.peaks.PEAKS")
        say("LoggingHook: no throughput/mfu: %s; pass LoggingHook(peak_flops_per_device=...) "
            "to set the peak (%.6g FLOPs per step per device)", why, flops)
    return self._compute

  def _utilization(self, steps: int, loop_secs: float) -> dict[str, float]:
    """``tflops_per_device`` and ``mfu`` over a window of ``steps`` steps and ``loop_secs``."""
    if self._ctx is None or steps <= 0 or loop_secs <= 0:
      return {}
    flops, peak = self._flops_and_peak()
    if flops is None:
      return {}
    tflops = flops * steps / loop_secs / 1e12
    out = {"throughput/tflops_per_device": tflops}
    if peak is not None:
      out["throughput/mfu"] = tflops * 1e12 / peak
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
