"""Loss spikes: rewind to the last checkpoint and skip the data that led to the spike.

:class:`LossSpikeHook` watches a metric's per-step values (the ``[K]`` traces, so the same
steps are seen for every K). A step is a *spike* when its value is NaN or infinite, or when
it exceeds ``factor`` times the median of the last ``window`` values before it (spikes are
not added to the window). At the call where it sees one, the hook asks the run for a rewind
(:class:`~loopkit.core.skips.RewindRequest`), the processes agree on it
(:mod:`loopkit.core.agreement`), no hook fires at that boundary (no checkpoint of the spiked
state is written), and the hook restores its :class:`~loopkit.checkpoint.CheckpointHook`'s
newest checkpoint before the spike. The run goes on from there with the data steps from the
one after that checkpoint through the spike's data step plus ``margin`` skipped
(``ledger.skip_steps``, saved with every later checkpoint), exactly as a run started with
``skip_steps=[(first, last)]`` would (:mod:`loopkit.core.skips`): the run calls every hook's
``adjust_ledger`` after the restore, as a resumed run does at its start, so the rows, records
and histories of the thrown-away steps go, and their time is goodput's ``lost``. The rewind is
logged in one line (the spike's step, the restored step, the range skipped).

A run stopped between a rewind and its next checkpoint resumes from the checkpoint before
the spike without the new range, meets the spike again and takes the same decision.

Not thread-safe; multi-host-safe (every process runs the hook; the decision is agreed).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from loopkit.checkpoint.hook import CheckpointHook
from loopkit.core.context import Restore, RunContext
from loopkit.core.hooks import Hook, LoopInfo
from loopkit.core.skips import RewindRequest

log = logging.getLogger("loopkit")

__all__ = ["LossSpikeError", "LossSpikeHook"]


class LossSpikeError(FloatingPointError):
  """A loss spike the hook cannot rewind from (no checkpoint before it, or too many
  rewinds in one run); the message names the step, the value and the median."""


class LossSpikeHook(Hook):
  """Rewinds the run to the last checkpoint at a loss spike and skips the data around it.

  Example:
    >>> ckpt = loopkit.CheckpointHook(workdir, every_steps=100)  # doctest: +SKIP
    >>> spikes = loopkit.checkpoint.LossSpikeHook(ckpt, factor=3.0, window=50,  # doctest: +SKIP
    ...                                           margin=20)
    >>> loop = loopkit.TrainLoop(step, iterations_per_loop=100,  # doctest: +SKIP
    ...                          hooks=[ckpt, spikes])

  Args:
    checkpoint: the loop's :class:`~loopkit.checkpoint.CheckpointHook` (the hook restores
      its newest checkpoint before the spike).
    metric: the metric to watch (a name in ``LoopInfo.traces``; default ``"loss"``).
    factor: a step is a spike when its value exceeds ``factor`` times the median of the
      ``window`` values before it (float > 1; for metrics that stay positive, as losses do).
    window: how many past step values the median is taken over (int >= 1); no step is a
      spike by this rule until ``window`` values were seen (NaN and Inf always are).
    margin: data steps skipped after the spike's (int >= 0): the range skipped is from the
      restored checkpoint's data step + 1 through the spike's data step + ``margin``.
    max_rewinds: rewinds allowed in one ``run`` (int >= 1); the next spike raises
      :class:`LossSpikeError`.

  Raises:
    ValueError: a bad argument, naming it; TypeError: ``checkpoint`` not a
      ``CheckpointHook``.

  Attributes:
    history: the last ``window`` values (float), saved with each checkpoint.
    rewinds: one dict per rewind this hook made (this process's view): ``step`` and
      ``data_step`` of the spike, ``value``, ``median``, ``restored_step``.
  """

  needs_state = False
  fires_at_preemption = False

  def __init__(self, checkpoint: CheckpointHook, *, metric: str = "loss", factor: float = 3.0,
               window: int = 20, margin: int = 0, max_rewinds: int = 10):
    super().__init__(at_steps=(), at_end=False)  # never fires: it asks for rewinds
    if not isinstance(checkpoint, CheckpointHook):
      raise TypeError(f"checkpoint must be the loop's loopkit.CheckpointHook, got {checkpoint!r}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
      raise ValueError(f"factor must be a number > 1, got {factor!r}")
    for name, value, low in (("window", window, 1), ("margin", margin, 0),
                             ("max_rewinds", max_rewinds, 1)):
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    self.checkpoint = checkpoint
    self.metric = metric
    self.factor = float(factor)
    self.window = window
    self.margin = margin
    self.max_rewinds = max_rewinds
    self.history: list[float] = []
    self.rewinds: list[dict[str, Any]] = []
    self._spike: dict[str, Any] | None = None
    self._run_rewinds = 0

  def on_run_start(self, ctx: RunContext, state: Any) -> None:
    self._run_rewinds = 0
    self._spike = None
    return None

  def checkpoint_state(self) -> dict[str, Any]:
    """The window of past values (floats, exact in JSON)."""
    return {"history": list(self.history)}

  def restore_checkpoint_state(self, d: dict[str, Any]) -> None:
    self.history = [float(v) for v in d.get("history", [])][-self.window:]

  def _median(self) -> float | None:
    if len(self.history) < self.window:
      return None
    return float(np.median(np.asarray(self.history[-self.window:], np.float64)))

  def rewind_request(self, info: LoopInfo) -> RewindRequest | None:
    """Looks for a spike in the call's step values; asks for a rewind at the first one.

    Raises:
      KeyError: the call has no metric ``metric`` (naming the ones it has).
      LossSpikeError: a spike after ``max_rewinds`` rewinds in this run.
    """
    if info.num_steps == 0:
      return None
    if self.metric not in info.traces:
      raise KeyError(f"LossSpikeHook watches metric {self.metric!r}, but the step returns "
                     f"{sorted(info.traces)}: pass metric=<one of them>")
    values = np.asarray(info.traces[self.metric], np.float64)
    first_data_step = info.data_step - info.num_steps + 1
    for j, value in enumerate(values.tolist()):
      median = self._median()
      if math.isfinite(value) and (median is None or value <= self.factor * median):
        self.history.append(value)
        del self.history[:-self.window]
        continue
      step, data_step = info.start_step + j + 1, first_data_step + j
      what = (f"{self.metric} {value:.6g} at step {step} (data step {data_step}) "
              + (f"> {self.factor:g} x the median {median:.6g} of the last {self.window} steps"
                 if median is not None and math.isfinite(value) else "is not finite"))
      if self._run_rewinds >= self.max_rewinds:
        raise LossSpikeError(f"{what}, after {self._run_rewinds} rewinds in this run "
                             f"(max_rewinds={self.max_rewinds}): the run does not recover")
      self._spike = {"step": step, "data_step": data_step, "value": value, "median": median}
      return RewindRequest(before_step=step, skip_through=data_step + self.margin,
                           reason=what)
    return None

  def rewind(self, ctx: RunContext, request: RewindRequest, like: Any) -> Restore:
    """Restores the newest checkpoint before ``request.before_step`` (waits for a save in
    flight first) and this hook's window saved with it.

    Args:
      ctx: the run's context.
      request: the agreed request (this process's, or another process's on multi-host).
      like: the live state (the tree structure and shardings to restore into).

    Raises:
      LossSpikeError: no checkpoint before the spike.
    """
    ckpt = self.checkpoint
    ckpt.wait_until_finished()
    steps = [s for s in ckpt.all_steps() if s < request.before_step]
    if not steps:
      raise LossSpikeError(f"{request.reason}, and {ckpt.directory} holds no checkpoint "
                           f"before step {request.before_step} to rewind to: save earlier "
                           "(CheckpointHook(every_steps=...)) or raise factor")
    r = ckpt.restore(like, step=steps[-1])
    self.history = []
    own = r.hook_states.get(ctx.hook_name)
    if own is not None:
      self.restore_checkpoint_state(own)
    self._run_rewinds += 1
    spike = self._spike or {}
    self.rewinds.append({**spike, "restored_step": r.step})
    return Restore(state=r.state, ledger=r.ledger, data_position=r.data_position,
                   hook_states=r.hook_states)

