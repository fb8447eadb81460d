"""A run's start and end: hooks' start and restores, the stop, the failure path.

Before the first call: every hook's ``on_run_start`` (applying restores), the
skip ranges in force and the feeder. After the last: the status, the
``at_end`` hooks still due and ``on_run_end`` (:func:`stop`); when the run
raises, the work kept and ``on_run_error`` (:func:`fail`).

Functions of the :class:`~loopkit.core.run.Run` they act on (the only writer of run state), called
from its conductor (:meth:`loopkit.core.run.Run.calls`) in order. Not thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from loopkit._internal.checks import check_concrete
from loopkit.core import boundary
from loopkit.core.context import Restore
from loopkit.core.hooks import (
  Hook,
  LoopInfo,
)
from loopkit.core.ledger import epoch_of
from loopkit.core.skips import (
  check_reopenable,
  covered,
  merge_ranges,
)
from loopkit.core.time_limit import TIME_LIMIT
from loopkit.data.feeding import ChunkFeeder

if TYPE_CHECKING:
  from loopkit.core.run import Run

log = logging.getLogger("loopkit")


RESUMABLE_STOPS = ("preempted", TIME_LIMIT)
"""Statuses of a run stopped to be resumed (a preemption, a ``max_time`` budget): at its
stop only the ``at_end`` hooks whose ``fires_at_preemption`` is true fire."""


class DataExhaustedWarning(UserWarning):
  """The batch iterator ran out before ``num_steps``; the run stopped at the last full step."""


def check_epoch_marks(hooks: Sequence[Hook], steps_per_epoch: int | None) -> None:
  """Every hook's marks are whole steps for ``steps_per_epoch``.

  Raises:
    ValueError: naming the hook, ``every_epochs`` and ``steps_per_epoch``.
  """
  for h in hooks:
    try:
      h.trigger.epoch_period(steps_per_epoch)
    except ValueError as e:
      raise ValueError(f"{type(h).__name__}: {e}") from None


def start(run: Run, state: Any, batches: Iterable) -> tuple[Any, ChunkFeeder]:
  """``on_run_start`` of every hook (applying restores), then the plan and the feeder.

  Args:
    state: the admitted initial state, at the ledger's step.
    batches: the source.

  Returns:
    ``(state, feeder)``.
  """
  state = start_hooks(run, state)
  check_concrete(state, "TrainLoop.run was given an abstract state and no hook restored it")
  settle_skips(run)
  for i in run.rewinders:
    check_reopenable(batches, run.names[i])
  step0 = run.ledger.step  # a restore's step, else the state's
  if step0 > run.target:  # after restores: a checkpoint past the target too
    log.warning("nothing to run: the state is at step %d and num_steps is %d", step0,
                run.target)
  elif step0 == run.target:  # a finished run run again (it only evaluates): not a mistake
    log.info("the run is already complete at step %d (num_steps=%d): nothing to train; "
             "its at_end hooks run once", step0, run.target)
  check_epoch_marks(run.hooks, run.steps_per_epoch)
  for h in run.hooks:
    h.trigger.start_clock()
  return state, run.open_feeder(batches, step0)


def start_hooks(run: Run, state: Any) -> Any:
  """Every hook's ``on_run_start`` (applying what it returns), then ``adjust_ledger``."""
  for i, h in enumerate(run.hooks):
    run.started = i + 1
    new = run.call_hook(i, h.on_run_start, run.contexts[i], state)
    if new is None:
      continue
    if isinstance(new, Restore):
      state = run.apply_restore(new, i)
    else:  # a state (e.g. a hook that edits the state before training)
      state = run.admit(new, i)
      step = int(jax.device_get(run.config.step_of(state)))
      if step != run.ledger.step:
        raise ValueError(
            f"{type(h).__name__}.on_run_start returned a state at step {step} but the "
            f"ledger is at step {run.ledger.step}: to restore, return "
            "loopkit.core.Restore(state, ledger, data_position)")
      run.state = state
  run.adjust_hooks()
  return state


def settle_skips(run: Run) -> None:
  """The skip ranges in force: the restored ledger's and those given to ``run``.

  Raises:
    ValueError: a given range that is not in the ledger's and starts at or before the
      data step the run is at (its first batches were trained on already).
  """
  ledger = run.ledger
  data_step = ledger.data_step
  for first, last in run.skip_steps:
    if first <= data_step and not covered(ledger.skip_steps, first, last):
      raise ValueError(
          f"skip_steps entry ({first}, {last}) starts at or before data step {data_step}, "
          f"where the run is (step {ledger.step} + {ledger.skipped_steps} skipped): "
          f"the batches of data steps {first}..{min(last, data_step)} were trained on "
          f"already. A skip range must start after data step {data_step} (rewind to an "
          "earlier checkpoint to skip those)")
  ledger.skip_steps = merge_ranges(ledger.skip_steps, run.skip_steps)


def stop(run: Run, state: Any) -> Any:
  """Sets the status, fires the ``at_end`` hooks still due, then ``on_run_end``."""
  if run.stop_reason is not None:
    run.status = run.stop_reason
    if run.status == TIME_LIMIT and run.time_limit is not None:
      decided = run.time_limit.decided_at  # the reading the stop was decided on
      log.info("max_time of %g s reached at step %d (%.1f s since run started): stopping "
               "there to be resumed", run.time_limit.seconds, run.ledger.step,
               run.time_limit.elapsed() if decided is None else decided)
  elif run.status is None:
    if run.ledger.step < run.target:  # invariant: "completed" means the target was reached
      raise RuntimeError(
          f"loopkit: the run ended at step {run.ledger.step} without reaching its target "
          f"step {run.target} and without a stop, preemption or end of data; this is a "
          "bug, please report it with the TrainLoop arguments")
    run.status = "completed"
  state = fire_at_end(run, state)
  for i, h in enumerate(run.hooks):
    run.tick_total()  # seconds["total"] is current for each on_run_end (a summary)
    new = run.call_hook(i, h.on_run_end, run.contexts[i], state)
    if new is not None:
      state = run.state = run.admit(new, i)
  if run.status == "completed" and run.last is None:  # a finished run run again: say so
    ran = [type(h).__name__ for h in run.hooks if h.trigger.at_end and not h.trigger.every_call]
    log.info("run complete at step %d: it was complete when it started, so nothing was "
             "trained%s", run.ledger.step,
             f"; its at_end hooks ran once ({', '.join(ran)})" if ran else "")
  return state


def fail(run: Run, error: BaseException) -> None:
  """When the run raises ``error``: keeps the work done, then ``on_run_error``.

  Keeps :attr:`state` for ``TrainLoop.last_state``: it is the
  state of the last completed boundary, the output of the latest dispatched
  call (or a hook's replacement of it), at the ledger's step, which no later
  call has consumed. It is not waited for here (an interrupt is not held up
  by the device): it is ready once that call finishes, and if the call itself
  failed, reading it raises the call's error. A state whose buffers were
  deleted (a call that failed while taking its donated input) is dropped:
  :attr:`state` becomes None.

  Then, for every hook whose ``on_run_start`` was called, the one that
  raised included, in hook order: its ``flush()`` if it has one (the rows
  its writer took before the error are on disk, as at a checkpoint save or
  ``on_run_end``), then its ``on_run_error`` (invariant 5: no save left in
  flight). Their own failures are logged; ``error`` propagates.
  """
  leaves = jax.tree.leaves(run.state)
  if any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
    run.state = None
  for i, h in enumerate(run.hooks[:run.started]):
    for method, args in (("flush", ()), ("on_run_error", (run.contexts[i], error))):
      fn = getattr(h, method, None)
      if not callable(fn):
        continue
      try:
        fn(*args)
      except Exception:  # pylint: disable=broad-except  # the run's own error propagates
        log.exception("%s.%s failed while the run raised %s", type(h).__name__, method,
                      type(error).__name__)


def warn_exhausted(run: Run, stacklevel: int) -> None:
  """Sets the status ``"data_exhausted"`` and warns; ``stacklevel`` points at the caller of
  ``TrainLoop.run``."""
  run.status = "data_exhausted"
  target, spe = run.target, run.steps_per_epoch
  asked = (f"num_epochs={run.num_epochs} (x steps_per_epoch={spe} = {target} steps)"
           if run.num_epochs is not None else f"num_steps={target}")
  warnings.warn(
      f"the batch iterator ran out at step {run.ledger.step} before {asked}; stopping after "
      "the last full step. The batches are read once, as one stream: for more epochs repeat "
      "them (itertools.chain.from_iterable(itertools.repeat(batches, n)), tf.data's "
      ".repeat(), or loopkit.ArraySource)", DataExhaustedWarning, stacklevel=stacklevel)


def fire_at_end(run: Run, state: Any) -> Any:
  """Fires the ``at_end`` hooks with a mark that did not fire on the run's last call.

  After an early stop, with the last call's info (``is_last=True``); after no
  call at all, once with an empty :class:`LoopInfo` at the current step (see
  :mod:`loopkit.core.hooks`: a preempted run still saves, a finished run re-run
  still evaluates once). After a preemption or a ``max_time`` stop
  (:data:`RESUMABLE_STOPS`) only the hooks whose ``fires_at_preemption`` is
  true (default) fire: such a stop is not the end of training, and a row
  written there would be one the uninterrupted run does not have
  (:class:`~loopkit.LoggingHook` and :class:`~loopkit.EvalHook` do not fire;
  their windows continue after the resume).
  """
  last = run.last
  preempted = run.status in RESUMABLE_STOPS
  due = [i for i, h in enumerate(run.hooks) if h.trigger.at_end and not h.trigger.every_call
         and (not preempted or getattr(h, "fires_at_preemption", True))]
  if last is None or run.last_info is None:
    if last is not None:  # no hooks: nothing fires
      return state
    step = run.ledger.step
    epoch, in_epoch = epoch_of(step, run.steps_per_epoch)
    info = LoopInfo(start_step=step, end_step=step, loop_index=run.ledger.loop_index - 1,
                    epoch=epoch, step_in_epoch=in_epoch,
                    examples_seen=run.ledger.examples_seen, metrics={}, metric_values={},
                    traces={}, is_last=True, data_position=run.data_position,
                    skipped_steps=run.ledger.skipped_steps)
  elif last.is_last:
    return state
  else:
    info = dataclasses.replace(run.last_info, is_last=True)
    due = [i for i in due if i not in last.firing]
  return boundary.fire(run, due, info, state)
