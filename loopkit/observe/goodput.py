"""Goodput: where the wall time of a training job went.

The loop already splits its wall time into buckets in ``ledger.seconds``
(host-clock readings at points the loop passes anyway, so measuring adds no
device synchronisation): ``compile`` (the first dispatch: trace + compile),
``dispatch``, ``device_wait`` (the host blocked fetching a call's outputs, one
call late), ``data_wait`` (the host waiting for the next input chunk), hook time
by the hook's ``time_bucket`` (``checkpoint``, ``eval``, or ``hooks``),
``setup`` (a run's start before its first device call and its end after the
last call's hooks, outside the hooks' own buckets: placing the initial state,
opening the source, the generic hooks' ``on_run_start`` / ``on_run_end``,
closing the feeder) and ``total``. The ledger is saved in checkpoints, so the buckets add up over
resumes. A rewind (:mod:`loopkit.core.skips`) books the time it threw away in
``lost`` itself. :class:`GoodputHook` adds *work lost to restarts*: steps trained past
the last checkpoint by an attempt that then died, and redone; and keeps the
time an attempt spent after its last checkpoint at that step (an eval that runs
after the final save, the end of the run) when a later run resumes from it.

From those, :func:`summarize` gives::

  job time       = total + lost
  badput         = compile + data_wait + checkpoint + eval + setup + lost
  productive     = job time - badput
                 = dispatch + device_wait + host gap (other hooks between calls, loop
                   bookkeeping between calls)
  goodput        = productive / job time

So a run that trains nothing (a finished run run again: it restores and
evaluates) adds no productive time: its seconds are in ``checkpoint`` (the
restore), ``eval``, ``data_wait`` and ``setup``.

``device_wait`` is the host-side view of device compute: time the device was
provably busy while the host had nothing left to do. Device compute that
overlaps host work (hooks run one call late, the next chunk is prefetched) is
inside ``dispatch`` and ``host gap``; separating them exactly would need a
device sync per call, which loopkit does not add.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax

from loopkit.core.context import LedgerAdjustment, RunContext
from loopkit.core.hooks import Hook, LoopInfo
from loopkit.core.ledger import Bucket, Ledger, LedgerView
from loopkit.observe.writers import keep_rows_through, prints_to_console

__all__ = ["GoodputHook", "GoodputSummary", "summarize"]

log = logging.getLogger("loopkit")

BADPUT_BUCKETS = (Bucket.COMPILE, Bucket.DATA_WAIT, Bucket.CHECKPOINT, Bucket.EVAL, Bucket.SETUP)
_PRODUCTIVE_BUCKETS = (Bucket.DISPATCH, Bucket.DEVICE_WAIT)


@dataclasses.dataclass(frozen=True)
class GoodputSummary:
  """A split of the job's wall time (seconds) and the goodput fraction.

  Attributes:
    job_secs: ``total_secs + lost_secs``.
    total_secs: wall time inside ``TrainLoop.run`` over all resumes.
    compile_secs, data_wait_secs, checkpoint_secs, eval_secs, setup_secs,
      lost_secs: badput (``setup``: runs' starts and ends outside the calls
      and the hooks' own buckets, see the module docstring).
    dispatch_secs, device_wait_secs: productive time the loop dispatched or
      waited on the device.
    host_gap_secs: the rest of the productive time: other hooks (logging,
      progress) and the loop's own bookkeeping between calls.
    productive_secs: ``job_secs`` minus badput.
    goodput: ``productive_secs / job_secs`` in [0, 1] (nan for an empty job).
    steps: the global step the summary describes: the last step known complete
      when it was taken (the time buckets are read at that moment).
    lost_steps: steps redone after restarts.
  """

  job_secs: float
  total_secs: float
  compile_secs: float
  data_wait_secs: float
  checkpoint_secs: float
  eval_secs: float
  setup_secs: float
  lost_secs: float
  dispatch_secs: float
  device_wait_secs: float
  host_gap_secs: float
  productive_secs: float
  goodput: float
  steps: int
  lost_steps: int

  def as_scalars(self, prefix: str = "goodput/") -> dict[str, float]:
    """The summary as metric scalars named ``{prefix}{field}``."""
    return {f"{prefix}{k}": (float(v) if isinstance(v, float) else v)
            for k, v in dataclasses.asdict(self).items()}

  def headline(self) -> str:
    """One line: ``goodput 93.1% at step 14 (0 steps redone after restarts)``."""
    return (f"goodput {100 * self.goodput:.1f}% at step {self.steps} "
            f"({self.lost_steps} steps redone after restarts)")

  def table(self) -> str:
    """A plain-text table: bucket, seconds, share of the job time (under :meth:`headline`)."""
    rows = [("productive", self.productive_secs), ("  device_wait", self.device_wait_secs),
            ("  dispatch", self.dispatch_secs), ("  host_gap", self.host_gap_secs),
            ("compile", self.compile_secs), ("data_wait", self.data_wait_secs),
            ("checkpoint", self.checkpoint_secs), ("eval", self.eval_secs),
            ("setup", self.setup_secs), ("lost to restarts", self.lost_secs),
            ("job", self.job_secs)]
    job = self.job_secs
    lines = [self.headline(), f"{'bucket':<18}{'seconds':>12}{'share':>9}"]
    for name, secs in rows:
      share = f"{100 * secs / job:8.1f}%" if job > 0 else f"{'-':>9}"
      lines.append(f"{name:<18}{secs:>12.3f}{share}")
    return "\n".join(lines)


def summarize(ledger: Ledger | LedgerView, step: int | None = None) -> GoodputSummary:
  """Computes the goodput split from a ledger's time buckets.

  Args:
    ledger: the loop's :class:`~loopkit.core.ledger.Ledger` (``loop.ledger``, or a
      hook's ``ctx.ledger`` view), or one restored from a checkpoint.
    step: the step the summary describes (default ``ledger.step``). A hook that
      runs one call late passes ``info.end_step``: by then the loop has
      dispatched the next call and ``ledger.step`` counts its steps too.

  Returns:
    A :class:`GoodputSummary`; buckets never seen count 0. ``host_gap_secs`` is
    clamped at 0 (clock readings of separate buckets may overlap by
    microseconds).
  """
  sec = ledger.seconds
  get = lambda k: float(sec.get(k, 0.0))
  total, lost = get(Bucket.TOTAL), get(Bucket.LOST)
  job = total + lost
  badput = sum(get(k) for k in BADPUT_BUCKETS) + lost
  productive = max(job - badput, 0.0)
  host_gap = max(productive - sum(get(k) for k in _PRODUCTIVE_BUCKETS), 0.0)
  return GoodputSummary(
      job_secs=job, total_secs=total, compile_secs=get(Bucket.COMPILE),
      data_wait_secs=get(Bucket.DATA_WAIT), checkpoint_secs=get(Bucket.CHECKPOINT),
      eval_secs=get(Bucket.EVAL), setup_secs=get(Bucket.SETUP), lost_secs=lost,
      dispatch_secs=get(Bucket.DISPATCH),
      device_wait_secs=get(Bucket.DEVICE_WAIT), host_gap_secs=host_gap,
      productive_secs=productive, goodput=productive / job if job > 0 else float("nan"),
      steps=ledger.step if step is None else int(step), lost_steps=ledger.lost_steps)


class GoodputHook(Hook):
  """Writes the goodput split as metrics, detects lost work, and summarises at the end.

  Rows: the ``goodput/*`` scalars are written at the boundary's step, and
  describe the steps done up to it (``goodput/steps`` is that step, even though
  the hook runs one call late). At most one row is written per step, and rows
  move forward: a step that already has a row (written earlier in the run, or
  by an earlier attempt when ``workdir`` is set) gets none again, e.g. when a
  resumed run finds nothing left to train. Rows past the step a run continues
  from (a resume from an earlier checkpoint, a rewind) are dropped by the file
  writers (:func:`~loopkit.observe.writers.keep_rows_through`) and written again.

  Lost work: at every boundary process 0 records the step reached (the *high
  water mark*) in ``workdir/goodput.json`` (atomic rename; well under a
  kilobyte). When a later run starts below that mark (it restored an older
  checkpoint, or started over) the steps in between were trained and lost:
  they add to ``ledger.lost_steps``, and ``lost_steps * seconds per productive
  step`` (as measured by the attempt that lost them) to ``seconds["lost"]``:
  the hook returns this as a :class:`~loopkit.core.context.LedgerAdjustment` from
  :meth:`adjust_ledger`, once per run after every restore, and the loop
  applies it.

  Time after the last checkpoint: a checkpoint holds the ledger as it was when
  saved, so time spent later at that same step (an eval hook after the
  checkpoint hook, the end of the run) is not in it. The record also holds
  that time, per bucket; a run that restores that checkpoint (via
  :class:`~loopkit.checkpoint.CheckpointHook`; the loop hands this hook its
  :meth:`checkpoint_state` back by hook name) and starts at the step the
  record was written at adds it back.

  Args:
    writer: a :class:`~loopkit.observe.writers.MetricWriter` for the ``goodput/*``
      scalars (see :meth:`GoodputSummary.as_scalars`), or None.
    workdir: where ``goodput.json`` lives (None: no lost-work accounting, and
      the time after the last checkpoint is not carried over).
    every_steps, every_secs: when to write the scalars (default every 60 s
      of wall time, and at the end of every run).
    log_summary: log :meth:`GoodputSummary.table` at the end of every run; when the
      writer has just printed that end's ``goodput/*`` row on the console
      (:func:`~loopkit.observe.writers.prints_to_console`: ``create_default_writer``'s
      writer, a ``ConsoleWriter``), only its first line,
      :meth:`GoodputSummary.headline`, so the seconds are printed once.

  Attributes:
    summary: the :class:`GoodputSummary` at the end of the last run.

  Not thread-safe. Multi-host: every process keeps the same ledger; only
  process 0 reads and writes ``goodput.json`` (the lost-work counters and the
  time carried over are for reporting, which process 0 does).
  """

  needs_state = False
  FILENAME = "goodput.json"

  def __init__(self, writer: Any = None, *, workdir: str | os.PathLike | None = None,
               every_steps: int | None = None, every_secs: float | None = 60.0,
               log_summary: bool = True):
    if every_steps is not None:
      every_secs = None
    # The end of a run is written by on_run_end (after the last hooks' time).
    super().__init__(every_steps=every_steps, every_secs=every_secs, at_end=False)
    self.writer = writer
    self.workdir = None if workdir is None else os.fspath(workdir)
    self.log_summary = log_summary
    self.summary: GoodputSummary | None = None
    self._ctx: RunContext | None = None  # the run's read-only context, set in on_run_start
    self._row_step = -1  # step of the last goodput/* row written
    # {"step", "seconds"}: the ledger as the last checkpoint saved or restored holds it.
    self._saved: dict[str, Any] | None = None
    self._restored_step: int | None = None  # checkpoint restored for the coming run
    self._hangs_counted = 0  # records of workdir/watchdog.jsonl counted as lost time

  @property
  def path(self) -> str | None:
    return None if self.workdir is None else os.path.join(self.workdir, self.FILENAME)

  # -- checkpoint protocol (called by CheckpointHook) ---------------------------

  def checkpoint_state(self) -> dict[str, Any]:
    """Notes the ledger the checkpoint being saved holds.

    Returns:
      ``{"step": int, "seconds": {bucket: float}}`` (the ledger's step and
      time buckets now), or ``{}`` outside a run.
    """
    if self._ctx is None:
      return {}
    ledger = self._ctx.ledger
    self._saved = {"step": ledger.step, "seconds": dict(ledger.seconds)}
    return dict(self._saved)

  def restore_checkpoint_state(self, d: dict[str, Any]) -> None:
    """Notes that the coming run starts from a checkpoint holding ``d``'s ledger.

    Args:
      d: what :meth:`checkpoint_state` returned when the checkpoint was saved.
    """
    if "step" in d and "seconds" in d:
      self._saved = {"step": int(d["step"]),
                     "seconds": {k: float(v) for k, v in d["seconds"].items()}}
      self._restored_step = self._saved["step"]

  # -- hook protocol ------------------------------------------------------------

  def on_run_start(self, ctx: RunContext, state: Any) -> None:
    del state
    self._ctx = ctx

  def adjust_ledger(self, ctx: RunContext) -> LedgerAdjustment | None:
    """Reads the previous attempt's record and accounts for the restart.

    Called by the loop after every ``on_run_start`` (a restore by any hook included), and
    after every rewind: the steps a rewind threw away and their time are in the ledger
    already (:func:`loopkit.core.skips.rewound_ledger`), so only the record is brought
    back to the restored step. The ``goodput/*`` rows past the step the run continues
    from are dropped (``keep_rows_through``) and written again.

    Returns:
      The work lost to a restart (``lost_steps`` and ``seconds["lost"]``), or
      the time the previous attempt spent after the checkpoint this run
      restored; None when there is nothing to add (no record, another
      process than 0, no ``workdir``).
    """
    if self.writer is not None:  # the earlier rows up to the run's start stay
      keep_rows_through(self.writer, ctx.ledger.step)
    restored, self._restored_step = self._restored_step, None
    if self.path is None or jax.process_index() != 0:
      self._row_step = min(self._row_step, ctx.ledger.step)
      return None
    try:
      with open(self.path) as f:
        prev = json.load(f)
    except FileNotFoundError:
      return None
    start_step = ctx.ledger.step
    # the rows past the start were dropped (keep_rows_through): they are written again
    self._row_step = min(max(self._row_step, int(prev.get("row_step", -1))), start_step)
    hung = self._hung_secs(int(prev.get("hangs_counted", 0)))
    redone = int(prev["step"]) - start_step
    if redone > 0 and ctx.ledger.lost_steps >= int(prev["lost_steps"]) + redone:
      # A rewind in this process (loopkit.core.skips.rewound_ledger) counted those steps
      # and their time already; the record now says where the run continues.
      self._write_record(ctx.ledger, start_step)
      return LedgerAdjustment(add_seconds={Bucket.LOST: hung}) if hung else None
    if redone > 0:
      # The record of the attempt that died is newer than the restored checkpoint.
      lost_steps = int(prev["lost_steps"]) + redone
      log.warning("goodput: this run starts at step %d but an earlier attempt reached step "
                  "%d; %d steps are redone (%d in all so far)", start_step, prev["step"],
                  redone, lost_steps)
      return LedgerAdjustment(lost_steps=lost_steps, set_seconds={
          Bucket.LOST: float(prev["lost_secs"]) + redone * float(prev["secs_per_step"]) + hung})
    if prev["step"] == start_step == restored and prev.get("saved_step") == start_step:
      # The previous attempt ended at the checkpoint this run restored; its time after
      # that save (and its lost-work count, which goes with the "lost" seconds) is in
      # the record, not in the checkpoint.
      unsaved = {bucket: float(secs) for bucket, secs in prev.get("unsaved_secs", {}).items()}
      if hung:
        unsaved[Bucket.LOST] = unsaved.get(Bucket.LOST, 0.0) + hung
      return LedgerAdjustment(lost_steps=int(prev["lost_steps"]), add_seconds=unsaved)
    if hung:
      return LedgerAdjustment(add_seconds={Bucket.LOST: hung})
    return None

  def _hung_secs(self, counted: int) -> float:
    """Seconds an earlier attempt spent stuck before its watchdog ended it, not yet counted.

    Reads ``workdir/watchdog.jsonl`` (:class:`loopkit.observe.Watchdog` with the same
    ``workdir``): its records past the first ``counted`` are new; the longest of their
    ``elapsed_secs`` (one attempt died there; each of its processes may have written one)
    goes to ``seconds["lost"]``.
    """
    assert self.workdir is not None
    self._hangs_counted = counted
    try:
      with open(os.path.join(self.workdir, "watchdog.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
      return 0.0
    self._hangs_counted = len(records)
    new = records[counted:]
    if not new:
      return 0.0
    worst = max(new, key=lambda r: float(r["elapsed_secs"]))
    log.warning("goodput: an earlier attempt was stuck %.1f s in phase %r after step %d before "
                "its watchdog ended it (counted as lost time)", float(worst["elapsed_secs"]),
                worst["phase"], int(worst["step"]))
    return float(worst["elapsed_secs"])

  def after_each_call(self, info: LoopInfo) -> None:
    # info.end_step: the last step known complete (ledger.step may be a call ahead).
    self._write_record(self._view(), info.end_step)

  def on_trigger(self, info: LoopInfo, state: Any) -> None:
    del state
    if not info.is_last:  # the last is written by on_run_end
      ledger = self._view()
      if self._write_row(summarize(ledger, info.end_step)):
        self._write_record(ledger, info.end_step)

  def flush(self) -> None:
    """Flushes the writer (the loop calls it before each checkpoint save and when ``run``
    raises, so the ``goodput/*`` rows written so far are on disk)."""
    flush = getattr(self.writer, "flush", None)
    if flush is not None:
      flush()

  def on_run_end(self, ctx: RunContext, state: Any) -> None:
    del state
    ledger = ctx.ledger  # its total is current: the loop ticks it before each on_run_end
    self.summary = summarize(ledger)
    wrote = self._write_row(self.summary)
    if wrote and self.writer is not None:
      self.writer.flush()
    self._write_record(ledger, ledger.step)
    if self.log_summary and jax.process_index() == 0:
      if wrote and prints_to_console(self.writer):  # its seconds are on the console already
        log.info("%s", self.summary.headline())
      else:
        log.info("goodput summary:\n%s", self.summary.table())

  # -- internals ----------------------------------------------------------------

  def _view(self) -> LedgerView:
    if self._ctx is None:
      raise RuntimeError("GoodputHook: called outside a TrainLoop run (no on_run_start)")
    return self._ctx.ledger

  def _write_row(self, summary: GoodputSummary) -> bool:
    """Writes the ``goodput/*`` row at ``summary.steps`` unless that step has one."""
    if self.writer is None or summary.steps <= self._row_step:
      return False
    self.writer.write_scalars(summary.steps, summary.as_scalars())
    self._row_step = summary.steps
    return True

  def _unsaved(self, ledger: Ledger | LedgerView) -> tuple[int | None, dict[str, float]]:
    """(step of the last checkpoint saved or restored, time added to the ledger since)."""
    if self._saved is None:
      return None, {}
    saved = self._saved["seconds"]
    if any(ledger.seconds.get(k, 0.0) < v for k, v in saved.items()):
      return None, {}  # not the ledger that checkpoint holds
    return self._saved["step"], {k: v - saved.get(k, 0.0) for k, v in ledger.seconds.items()
                                 if v > saved.get(k, 0.0)}

  def _write_record(self, ledger: Ledger | LedgerView, step: int) -> None:
    """Writes ``goodput.json`` (process 0) for the boundary at ``step``."""
    path = self.path
    if path is None or jax.process_index() != 0:
      return
    s = summarize(ledger, step)
    trained = step + ledger.lost_steps
    saved_step, unsaved = self._unsaved(ledger)
    record = {"step": step, "lost_steps": ledger.lost_steps, "lost_secs": s.lost_secs,
              "secs_per_step": s.productive_secs / trained if trained else 0.0,
              "row_step": self._row_step, "saved_step": saved_step, "unsaved_secs": unsaved,
              "hangs_counted": self._hangs_counted}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(record, f)
    os.replace(tmp, path)
