"""Goodput: where the wall time of a training job went.

The loop already splits its wall time into buckets in ``ledger.seconds``
(host-clock readings at points the loop passes anyway, so measuring adds no
device synchronisation): ``compile`` (the first dispatch: trace + compile),
``dispatch``, ``device_wait`` (the host blocked fetching a call's outputs, one
call late), ``data_wait`` (the host waiting for the next input chunk), hook time
by the hook's ``time_bucket`` (``checkpoint``, ``eval``, or ``hooks``) and
``total``. The ledger is saved in checkpoints, so the buckets add up over
resumes. :class:`GoodputHook` adds *work lost to restarts*: steps trained past
the last checkpoint by an attempt that then died, and redone.

From those, :func:`summarize` gives::

  job time       = total + lost
  badput         = compile + data_wait + checkpoint + eval + lost
  productive     = job time - badput
                 = dispatch + device_wait + host gap (other hooks, loop bookkeeping)
  goodput        = productive / job time

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

from loopkit.hooks import Hook, LoopInfo
from loopkit.ledger import Ledger

__all__ = ["GoodputHook", "GoodputSummary", "summarize"]

log = logging.getLogger("loopkit")

BADPUT_BUCKETS = ("compile", "data_wait", "checkpoint", "eval")
_PRODUCTIVE_BUCKETS = ("dispatch", "device_wait")


@dataclasses.dataclass(frozen=True)
class GoodputSummary:
  """A split of the job's wall time (seconds) and the goodput fraction.

  Attributes:
    job_secs: ``total_secs + lost_secs``.
    total_secs: wall time inside ``TrainLoop.run`` over all resumes.
    compile_secs, data_wait_secs, checkpoint_secs, eval_secs, lost_secs: badput.
    dispatch_secs, device_wait_secs: productive time the loop dispatched or
      waited on the device.
    host_gap_secs: the rest of the productive time: other hooks (logging,
      progress) and the loop's own bookkeeping between calls.
    productive_secs: ``job_secs`` minus badput.
    goodput: ``productive_secs / job_secs`` in [0, 1] (nan for an empty job).
    steps: global step reached.
    lost_steps: steps redone after restarts.
  """

  job_secs: float
  total_secs: float
  compile_secs: float
  data_wait_secs: float
  checkpoint_secs: float
  eval_secs: float
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

  def table(self) -> str:
    """A plain-text table: bucket, seconds, share of the job time."""
    rows = [("productive", self.productive_secs), ("  device_wait", self.device_wait_secs),
            ("  dispatch", self.dispatch_secs), ("  host_gap", self.host_gap_secs),
            ("compile", self.compile_secs), ("data_wait", self.data_wait_secs),
            ("checkpoint", self.checkpoint_secs), ("eval", self.eval_secs),
            ("lost to restarts", self.lost_secs), ("job", self.job_secs)]
    job = self.job_secs
    lines = [f"goodput {100 * self.goodput:.1f}% at step {self.steps} "
             f"({self.lost_steps} steps redone after restarts)",
             f"{'bucket':<18}{'seconds':>12}{'share':>9}"]
    for name, secs in rows:
      share = f"{100 * secs / job:8.1f}%" if job > 0 else f"{'-':>9}"
      lines.append(f"{name:<18}{secs:>12.3f}{share}")
    return "\n".join(lines)


def summarize(ledger: Ledger) -> GoodputSummary:
  """Computes the goodput split from a ledger's time buckets.

  Args:
    ledger: the loop's :class:`~loopkit.ledger.Ledger` (``loop.ledger``), or one
      restored from a checkpoint.

  Returns:
    A :class:`GoodputSummary`; buckets never seen count 0. ``host_gap_secs`` is
    clamped at 0 (clock readings of separate buckets may overlap by
    microseconds).
  """
  sec = ledger.seconds
  get = lambda k: float(sec.get(k, 0.0))
  total, lost = get("total"), get("lost")
  job = total + lost
  badput = sum(get(k) for k in BADPUT_BUCKETS) + lost
  productive = max(job - badput, 0.0)
  host_gap = max(productive - sum(get(k) for k in _PRODUCTIVE_BUCKETS), 0.0)
  return GoodputSummary(
      job_secs=job, total_secs=total, compile_secs=get("compile"),
      data_wait_secs=get("data_wait"), checkpoint_secs=get("checkpoint"),
      eval_secs=get("eval"), lost_secs=lost, dispatch_secs=get("dispatch"),
      device_wait_secs=get("device_wait"), host_gap_secs=host_gap,
      productive_secs=productive, goodput=productive / job if job > 0 else float("nan"),
      steps=ledger.step, lost_steps=ledger.lost_steps)


class GoodputHook(Hook):
  """Writes the goodput split as metrics, detects lost work, and summarises at the end.

  Lost work: at every boundary process 0 records the step reached (the *high
  water mark*) in ``workdir/goodput.json`` (atomic rename; a few hundred
  bytes). When a later run starts below that mark (it restored an older
  checkpoint, or started over) the steps in between were trained and lost:
  they add to ``ledger.lost_steps``, and ``lost_steps * seconds per productive
  step`` (as measured by the attempt that lost them) to ``seconds["lost"]``.

  Args:
    writer: a :class:`~loopkit.writers.MetricWriter` for the ``goodput/*``
      scalars (see :meth:`GoodputSummary.as_scalars`), or None.
    workdir: where ``goodput.json`` lives (None: no lost-work accounting).
    every_steps, every_secs: when to write the scalars (default every 60 s
      of wall time, and at the end of every run).
    log_summary: log :meth:`GoodputSummary.table` at the end of every run.

  Attributes:
    summary: the :class:`GoodputSummary` at the end of the last run.

  Not thread-safe. Multi-host: every process keeps the same ledger; only
  process 0 reads and writes ``goodput.json`` (the lost-work counters are for
  reporting, which process 0 does).
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
    self._loop: Any = None  # the TrainLoop, set in on_run_start
    self._first = True

  @property
  def path(self) -> str | None:
    return None if self.workdir is None else os.path.join(self.workdir, self.FILENAME)

  def on_run_start(self, loop: Any, state: Any) -> None:
    del state
    self._loop = loop
    self._first = True

  def observe(self, info: LoopInfo) -> None:
    ledger = self._loop.ledger
    if self.path is None or jax.process_index() != 0:
      return
    if self._first:  # every on_run_start (a restore included) has run by now
      self._first = False
      self._account_restart(ledger, info.start_step)
    s = summarize(ledger)
    # info.end_step: the last step known complete (ledger.step may be a call ahead).
    trained = info.end_step + ledger.lost_steps
    record = {"step": info.end_step, "lost_steps": ledger.lost_steps,
              "lost_secs": s.lost_secs,
              "secs_per_step": s.productive_secs / trained if trained else 0.0}
    os.makedirs(self.workdir, exist_ok=True)
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(record, f)
    os.replace(tmp, self.path)

  def _account_restart(self, ledger: Ledger, start_step: int) -> None:
    try:
      with open(self.path) as f:
        prev = json.load(f)
    except FileNotFoundError:
      return
    if prev["step"] <= start_step:
      return  # nothing was trained past where this run starts
    redone = int(prev["step"]) - start_step
    # The record of the attempt that died is newer than the restored checkpoint.
    ledger.lost_steps = int(prev["lost_steps"]) + redone
    ledger.seconds["lost"] = float(prev["lost_secs"]) + redone * float(prev["secs_per_step"])
    log.warning("goodput: this run starts at step %d but an earlier attempt reached step %d; "
                "%d steps are redone (%d in all so far)", start_step, prev["step"], redone,
                ledger.lost_steps)

  def after_call(self, info: LoopInfo, state: Any) -> None:
    del state
    if self.writer is not None and not info.is_last:  # the last is written by on_run_end
      self.writer.write_scalars(info.end_step, summarize(self._loop.ledger).as_scalars())

  def on_run_end(self, loop: Any, state: Any) -> None:
    del state
    tick = getattr(loop, "_tick_total", None)
    if tick is not None:
      tick()  # bring the ledger's total up to now (hooks before this one included)
    self.summary = summarize(loop.ledger)
    if self.writer is not None:
      self.writer.write_scalars(loop.ledger.step, self.summary.as_scalars())
      self.writer.flush()
    if self.log_summary and jax.process_index() == 0:
      log.info("goodput summary:\n%s", self.summary.table())
