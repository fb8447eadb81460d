"""A call's boundary: the processes' agreement, the outputs fetched, hooks fired.

Before each dispatch one agreement takes every host-local decision
(:func:`agree`); after it, the call's outputs are fetched once, one call late
(:func:`finish_call`), a :class:`~loopkit.core.hooks.LoopInfo` is built and the
hooks see it and fire. A rewind asked for at a boundary goes to
:mod:`loopkit.core.rewind`.

Functions of the :class:`~loopkit.core.run.Run` they act on (the only writer of run state), called
from its conductor (:meth:`loopkit.core.run.Run.calls`) in order. Not thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from loopkit import metrics as metrics_lib
from loopkit.core import rewind
from loopkit.core.agreement import agree_with_reason
from loopkit.core.hooks import (
  CallRecord,
  LoopInfo,
  NonFiniteWarning,
  record_fields,
)
from loopkit.core.ledger import Bucket
from loopkit.core.time_limit import TIME_LIMIT

if TYPE_CHECKING:
  from loopkit.core.run import Run

log = logging.getLogger("loopkit")


class StepCounterError(ValueError):
  """The state's step counter did not advance by exactly one per step in a device call.

  Attributes:
    counter: the counter after the call.
    start_step: the loop's step before the call (the counter's value then).
    end_step: the loop's step after the call.
    loop_index: the call's index.
  """

  def __init__(self, message: str, *, counter: int, start_step: int, end_step: int,
               loop_index: int):
    super().__init__(message)
    self.counter = counter
    self.start_step = start_step
    self.end_step = end_step
    self.loop_index = loop_index


def _fetch(tree: Any, copy_async: bool) -> Any:
  """``jax.device_get`` of a pytree of ``jax.Array``: numpy copies that own their memory.

  ``copy_async`` starts every leaf's host copy before reading any (as
  ``jax.device_get``: it overlaps transfers on accelerators, but costs about
  10-30 us per leaf on CPU devices, whose buffers the host reads directly).
  """
  leaves, treedef = jax.tree.flatten(tree)
  if copy_async:
    for x in leaves:
      x.copy_to_host_async()
  # np.array, not np.asarray: on CPU devices asarray is a view that keeps the
  # device buffer alive for as long as a hook keeps the value.
  return jax.tree.unflatten(treedef, [np.array(x) for x in leaves])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Boundary(CallRecord):
  """The end of one device call, as the run records it: a
  :class:`~loopkit.core.hooks.CallRecord` (``is_last``: the run's planned last
  call, target reached or data exhausted) and what the run still has to do.

  Attributes:
    out: the call's device outputs (state step, reduced metrics, traces), not
      fetched until :func:`finish_call`.
    firing: indices (into the loop's hooks) of the hooks whose trigger fired.
  """

  out: Any
  firing: list[int]


def finish_call(run: Run, b: Boundary, state: Any) -> Any:
  """Fetches a call's outputs (one device_get) and runs its hooks.

  Args:
    b: the call's :class:`Boundary`.
    state: the state after the call when a firing hook needs it, else None.

  Returns:
    The state, possibly replaced by a hook.
  """
  hooks, ledger, watchdog = run.hooks, run.ledger, run.watchdog
  if watchdog is not None:
    watchdog.enter_phase("device_call", b.start_step)
  t0 = run.now()
  if not hooks:  # nobody reads the metrics: only the step counter and the non-finite flags
    if run.copy_async:  # (as _fetch, without its tree walk: a few us per call)
      b.out.step.copy_to_host_async()
      b.out.nonfinite.copy_to_host_async()
    out_step, nonfinite = np.asarray(b.out.step), np.asarray(b.out.nonfinite)
  else:
    out = _fetch(b.out, run.copy_async)
    out_step, nonfinite = out.step, out.nonfinite
  ledger.add_time(Bucket.DEVICE_WAIT, run.now() - t0)
  if watchdog is not None:
    watchdog.leave_phase()
  if int(out_step) != b.end_step:
    raise StepCounterError(
        f"the state's step counter is {int(out_step)} after device call {b.loop_index} "
        f"(steps {b.start_step + 1}..{b.end_step}); train_step must increment it by exactly "
        f"1 per step, and it must equal the loop's step {b.end_step}",
        counter=int(out_step), start_step=b.start_step, end_step=b.end_step,
        loop_index=b.loop_index)
  run.data_position = b.data_position
  run.tick_total()
  run.last, run.last_info = b, None
  time_based_k = run.config.time_based_k
  if not hooks:  # no LoopInfo to build: no hook observes, fires or fires at the end
    warn_nonfinite(run, b, nonfinite)
    if time_based_k is not None:
      time_based_k.record(b.end_step)
    return state
  info = run.last_info = loop_info(run, b, out)
  buckets = run.buckets
  if watchdog is not None:
    watchdog.enter_phase(Bucket.HOOKS, b.end_step)
  for i, h in enumerate(hooks):  # call_hook inlined: every hook, every call
    t0 = run.now()
    try:
      h.after_each_call(info)
    finally:
      ledger.add_time(buckets[i], run.now() - t0)
  if watchdog is not None:
    watchdog.leave_phase()
  warn_nonfinite(run, b, nonfinite)  # after after_each_call: a NanCheckHook raises first
  if run.rewinders:  # before any hook fires here: a checkpoint must not save this state
    request = rewind.agreed_rewind(run, info)
    if request is not None:
      return rewind.rewind(run, *request)
  state = fire(run, b.firing, info, state)
  if time_based_k is not None:
    time_based_k.record(b.end_step)
  return state


def loop_info(run: Run, b: Boundary, out: Any) -> LoopInfo:
  """The hooks' :class:`~loopkit.core.hooks.LoopInfo` of call ``b``, from its fetched
  outputs ``out``."""
  n = b.num_steps
  steps = (out.traces if n == run.config.iterations_per_loop else  # the call's steps, [n]
           {k: jax.tree.map(lambda x: x[:n], v) for k, v in out.traces.items()})
  values = {k: metrics_lib.fold_steps(v) for k, v in steps.items()}  # in step order
  return LoopInfo(**record_fields(b),
                  metrics={k: metrics_lib.compute(v) for k, v in values.items()},
                  metric_values=values,
                  traces={k: metrics_lib.compute_traces(v) for k, v in steps.items()},
                  step_values=steps)


def fire(run: Run, firing: list[int], info: LoopInfo, state: Any) -> Any:
  """Calls ``on_trigger`` of the hooks ``firing``; admits the states they return."""
  readers = [type(run.hooks[i]).__name__ for i in firing if run.hooks[i].needs_state]
  if state is not None and readers:
    run.check_replicas(state, f"at step {info.end_step}, before the state goes to "
                        f"{', '.join(readers)},")
  for i in firing:
    h = run.hooks[i]
    new = run.call_hook(i, h.on_trigger, info, state if h.needs_state else None)
    if new is not None and h.needs_state:
      state = run.state = run.admit(new, i)
  return state


def warn_nonfinite(run: Run, b: Boundary, nonfinite: np.ndarray) -> None:
  """Warns, once per run, naming the first step whose metric had a NaN or Inf.

  Args:
    b: the call's boundary.
    nonfinite: its fetched :attr:`~loopkit.core.step_output.CallOutput.nonfinite` (int32 ``[M]``).
  """
  if run.nonfinite_step is not None or not any(nonfinite.tobytes()):
    return  # all zeros: every metric finite (cheaper than nonfinite.any() for a few bytes)
  first = int(nonfinite[nonfinite > 0].min())
  names = [repr(k) for k, i in zip(sorted(b.out.traces), nonfinite.tolist()) if i == first]
  run.nonfinite_step = b.start_step + first
  warnings.warn(NonFiniteWarning(
      f"metric{'s' * (len(names) > 1)} {', '.join(names)} "
      f"{'are' if len(names) > 1 else 'is'} NaN or infinite at step {run.nonfinite_step}, the "
      f"first such step of this run (device call {b.loop_index} ran steps "
      f"{b.start_step + 1}..{b.end_step}); training goes on and the state may hold NaNs: add "
      "loopkit.NanCheckHook() to stop there"), stacklevel=6)


def agree(run: Run) -> tuple[str | None, dict[int, bool]]:
  """Takes every host-local decision of one boundary, agreed across processes.

  Once before each dispatch: this process's preemption flag, its ``max_time``
  budget (:class:`~loopkit.core.time_limit.TimeLimit`), a requested stop (its
  reason) and each ``every_secs`` clock go into one
  :func:`loopkit.core.agreement.agree_with_reason`. A time mark read here counts for
  the call about to be dispatched.

  Returns:
    ``(stop, time_due)``: the stop reason, the same on every process (a
    requested one: the lowest-index requesting process's reason,
    :func:`loopkit.core.agreement.agree_with_reason`; else ``"preempted"``, else
    ``"time limit"``) or None to go on; and ``{hook index: bool}`` for the hooks
    with ``every_secs``.
  """
  timed = run.timed
  over = run.time_limit is not None and run.time_limit.expired()
  if run.single_process:  # agree_with_reason's answer on one process: the local one
    preempted = run.preemption.requested
    time_due = each_timed_hook(run,
        {i: bool(run.hooks[i].trigger.time_due()) for i in timed}) if timed else {}
    if run.stop_reason is not None:
      return run.stop_reason, time_due
    return ("preempted" if preempted else TIME_LIMIT if over else None), time_due
  watchdog = run.watchdog
  if watchdog is not None:
    watchdog.enter_phase("agreement", run.ledger.step)
  agreed, reason = agree_with_reason(
      [run.preemption.requested, over] + [run.hooks[i].trigger.time_due() for i in timed],
      run.stop_reason)
  if watchdog is not None:
    watchdog.leave_phase()
  time_due = each_timed_hook(run, dict(zip(timed, agreed[2:])))
  if reason is not None:
    return reason, time_due
  return ("preempted" if agreed[0] else TIME_LIMIT if agreed[1] else None), time_due


def each_timed_hook(run: Run, due: dict[int, bool]) -> dict[int, bool]:
  """``{hook index: due}`` for every hook with ``every_secs``, from the answers ``due`` of
  the first hook of each trigger object."""
  return {i: due[j] for i, j in run.timed_same.items()}


def firing(run: Run, start: int, end: int, is_last: bool, time_due: dict[int, bool]) -> list[int]:
  """The hooks that fire after the call ``(start, end]``; records their firing."""
  if not run.hooks:
    return []
  spe = run.steps_per_epoch
  firing = [i for i, h in enumerate(run.hooks)
            if h.trigger.should_fire(start, end, steps_per_epoch=spe, is_last=is_last,
                                     time_due=time_due.get(i, False))]
  for i in firing:
    run.hooks[i].trigger.fired()
  return firing
