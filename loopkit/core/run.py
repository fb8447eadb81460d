"""One ``TrainLoop.run``: the run object, the only writer of run state.

A :class:`Run` lives for one call of :meth:`loopkit.TrainLoop.run`. It takes the
loop's :class:`RunConfig` (not the loop), owns the ledger, the data position,
the status, the stop reason, the preemption watcher's use and the per-run
bookkeeping (the train state's spec, the replica check, the hooks' names and
contexts), and goes through three named steps:

* :meth:`Run.dispatch`: the processes' agreement (:mod:`loopkit.core.agreement`)
  already taken, one device call, the ledger advanced, a :class:`Boundary`
  recorded;
* :meth:`Run.finish_call`: the call's outputs fetched (one ``device_get``, one
  call late unless a firing hook needs the state), a
  :class:`~loopkit.core.hooks.LoopInfo` built, hooks see it and fire;
* :meth:`Run.stop`: the status, the ``at_end`` hooks that did not fire on the
  last call, ``on_run_end``.

A hook with ``rewind_request`` may ask, at a call's boundary, to go back to an earlier
checkpoint and skip data (:mod:`loopkit.core.skips`); agreed across processes, the run
applies the hook's restore (:meth:`Run.rewind`), drops the call dispatched meanwhile and
opens the source again at the restored position.

Hooks read a :class:`~loopkit.core.context.RunContext` and return what they change
(:mod:`loopkit.core.context`); only this module applies it. Not thread-safe.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from loopkit import metrics as metrics_lib
from loopkit._internal.checks import (
  check_concrete,
  check_not_nnx_objects,
  tree_mismatch,
  warn_if_pmap_layout,
)
from loopkit._internal.mesh import is_cpu_mesh
from loopkit.core.agreement import agree_with_reason
from loopkit.core.context import LedgerAdjustment, Restore, RunContext
from loopkit.core.hook_state import collect_hook_states, give_hook_states, hook_names
from loopkit.core.hooks import (
  CallRecord,
  Hook,
  LoopInfo,
  NonFiniteWarning,
  check_hooks,
  record_fields,
)
from loopkit.core.ledger import Bucket, Ledger, LedgerView, epoch_of
from loopkit.core.planner import TimeBasedK, plan_calls
from loopkit.core.preemption import PreemptionWatcher
from loopkit.core.program import MultiStepProgram
from loopkit.core.skips import (
  RewindRequest,
  SkipRanges,
  check_reopenable,
  covered,
  cut_steps,
  merge_ranges,
)
from loopkit.core.time_limit import TIME_LIMIT, TimeLimit
from loopkit.core.triggers import Trigger
from loopkit.data.feeding import Chunk, ChunkFeeder
from loopkit.data.sources import open_source

log = logging.getLogger("loopkit")

RESUMABLE_STOPS = ("preempted", TIME_LIMIT)
"""Statuses of a run stopped to be resumed (a preemption, a ``max_time`` budget): at its
stop only the ``at_end`` hooks whose ``fires_at_preemption`` is true fire."""


class DataExhaustedWarning(UserWarning):
  """The batch iterator ran out before ``num_steps``; the run stopped at the last full step."""


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
      fetched until :meth:`Run.finish_call`.
    firing: indices (into the loop's hooks) of the hooks whose trigger fired.
  """

  out: Any
  firing: list[int]


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """What a :class:`Run` needs of its loop, fixed when the loop is built.

  Attributes:
    program: the compiled :class:`~loopkit.core.program.MultiStepProgram`.
    iterations_per_loop: the compiled slot count K (the cap, for time-based K).
    time_based_k: the :class:`~loopkit.core.planner.TimeBasedK`, or None.
    mesh: the device mesh.
    data_parallel_size: slices of the batch (the product of the data axes' sizes).
    prefetch: chunks prepared ahead by the feeder's thread.
    step_of: returns the state's step counter.
    global_batch_size: the batch size to check the first batch against, or None.
  """

  program: MultiStepProgram
  iterations_per_loop: int
  time_based_k: TimeBasedK | None
  mesh: Any
  data_parallel_size: int
  prefetch: int
  step_of: Callable[[Any], Any]
  global_batch_size: int | None


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


class Run:
  """One run of a :class:`~loopkit.core.loop.TrainLoop` (created by ``TrainLoop.run``).

  Args:
    config: the loop's :class:`RunConfig`.
    hooks: the loop's hooks, in order.
    steps_per_epoch: steps in one epoch for this run, or None.
    target: the global step to end at.
    num_epochs: the ``num_epochs`` asked for (for messages), or None.
    preemption: the :class:`~loopkit.core.preemption.PreemptionWatcher` this
      run installs (see :attr:`preemption_spent`).
    skip_steps: skip ranges given to ``run`` (checked,
      :func:`loopkit.core.skips.check_skip_steps`), joined at the start with the
      restored ledger's.
    time_limit: the run's started :class:`~loopkit.core.time_limit.TimeLimit`, or None.

  Attributes:
    ledger: the run's :class:`~loopkit.core.ledger.Ledger` (written only here;
      set by :meth:`set_ledger` once the state's step is known).
    ledger_view: its read-only view, for hooks.
    data_position: source position after the last consumed call.
    state: the latest state (the output of the latest dispatched call, or a
      hook's replacement), at the ledger's step; what ``TrainLoop.last_state``
      hands back when ``run`` raises (:meth:`fail`).
    status: None until the run ends; then ``"completed"``, ``"data_exhausted"``
      or the stop reason.
    stop_reason: the reason of a requested (or agreed) stop, or None.
    preemption_spent: whether :meth:`execute` has installed and released the
      watcher (it still tells ``signal_received``; the next run gets a fresh one).
    names: the hooks' stable names (:func:`loopkit.core.hook_state.hook_names`).
    started: how many hooks' ``on_run_start`` were called (they get
      ``on_run_error``).
    feeder: the current :class:`~loopkit.data.feeding.ChunkFeeder` (a new one after a
      rewind).
    rewound: a rewind was applied and the feeder is to be opened again (while
      :meth:`call_until_done` handles it).
  """

  def __init__(self, config: RunConfig, hooks: list[Hook], *, steps_per_epoch: int | None,
               target: int, num_epochs: int | None, preemption: PreemptionWatcher,
               skip_steps: SkipRanges = (), time_limit: TimeLimit | None = None):
    self.config = config
    self.time_limit = time_limit
    self.program = config.program
    self.hooks = hooks
    self.steps_per_epoch = steps_per_epoch
    self.preemption = preemption
    self.preemption_spent = False
    self.status: str | None = None
    self.stop_reason: str | None = None
    check_hooks(self.hooks)  # hooks added to loop.hooks since the loop was built
    self.names = hook_names(self.hooks)
    self.buckets = [getattr(h, "time_bucket", Bucket.HOOKS) for h in self.hooks]
    self.contexts = [RunContext(self, i, self._hook_states) for i in range(len(self.hooks))]
    self.ledger = Ledger()
    self.ledger_view = LedgerView(self.ledger)
    self.target = target
    self.num_epochs = num_epochs
    self.data_position: Any = None
    self.state: Any = None
    self.state_position: Any = None  # the source position after self.state's last batch
    self.started = 0
    self.last: Boundary | None = None  # the last boundary whose hooks ran
    self.last_info: LoopInfo | None = None  # its LoopInfo (None without hooks)
    self.state_spec: Any = None
    # A ledger made from the state's step alone (no checkpoint, not the loop's last
    # ledger): its examples_seen is taken at the first chunk, as step x the chunk's
    # global batch, whatever the loop's constructor arguments or earlier runs.
    self.examples_unknown = False
    self.replicas_checked_at: int | None = None
    self.checked_layout = False  # the first chunk's layout (next_chunk)
    self.copy_async = not is_cpu_mesh(config.mesh)  # see _fetch
    self.nonfinite_step: int | None = None  # the run's first step with a NaN/Inf metric
    # The hooks with every_secs, by trigger: hooks that share one Trigger object (an
    # EarlyStopping fires on its EvalHook's) read its clock once per boundary, so they fire
    # together.
    timed = [i for i, h in enumerate(hooks) if h.trigger.every_secs is not None]
    self.timed = [i for i in timed if not any(hooks[j].trigger is hooks[i].trigger
                                              for j in timed if j < i)]
    self.timed_same = {i: next(j for j in self.timed if hooks[j].trigger is hooks[i].trigger)
                       for i in timed}  # each timed hook -> the first hook with its trigger
    self.single_process = jax.process_count() == 1
    # A hook that watches the run's phases (loopkit.observe.Watchdog): told each phase the
    # run enters and leaves (enter_phase(name, step) / leave_phase()).
    self.watchdog: Any = next((h for h in hooks if callable(getattr(h, "enter_phase", None))),
                              None)
    self.skip_steps = skip_steps
    # Hooks that may rewind the run (loopkit.core.skips): asked at every boundary.
    self.rewinders = [i for i, h in enumerate(hooks)
                      if callable(getattr(h, "rewind_request", None))]
    self.rewound = False  # set by rewind(); call_until_done then re-opens the feeder
    self.batches: Any = None
    self.feeder: ChunkFeeder | None = None
    self.t_mark = time.perf_counter()
    # "start" until the first dispatch, "calls" until the last call's hooks ran, then "end".
    # Outside "calls" the wall time goes to its buckets and the rest to Bucket.SETUP, so a
    # run that trains nothing adds no productive time (add_time, tick_total).
    self.phase = "start"
    self.pending: dict[str, float] = {}  # "start": the time for the ledger of the first tick
    self.bucketed = 0.0  # outside "calls": seconds add_time gave to buckets since the last tick

  # -- ledger writes --------------------------------------------------------

  def set_ledger(self, ledger: Ledger, *, examples_unknown: bool = False) -> None:
    """Makes ``ledger`` the run's; ``examples_unknown``: its ``examples_seen`` is
    taken at the first chunk (a ledger made from the state's step alone)."""
    self.ledger = ledger
    self.ledger_view = LedgerView(ledger)
    self.examples_unknown = examples_unknown

  def request_stop(self, reason: str = "stopped") -> None:
    """Asks the run to stop at the next boundary, after the processes agreed on it."""
    self.stop_reason = reason

  def add_time(self, bucket: str, secs: float) -> None:
    """Adds ``secs`` of this run's wall time to ``bucket`` of the ledger.

    Outside the calls (before the first dispatch, after the last call's hooks)
    the generic ``hooks`` bucket is :attr:`Bucket.SETUP` (a logging or progress
    hook's start and end are no training), and so is ``device_wait`` in a run
    that dispatched no call; before the first dispatch the time
    waits for the ledger the hooks' restores leave (:meth:`tick_total` adds it).
    """
    if self.phase == "calls":
      self.ledger.add_time(bucket, secs)
      return
    if bucket == Bucket.HOOKS or (bucket == Bucket.DEVICE_WAIT and self.last is None):
      bucket = Bucket.SETUP  # (waiting on a restored state, not on training, in a run of no call)
    self.bucketed += secs
    if self.phase == "start":
      self.pending[bucket] = self.pending.get(bucket, 0.0) + secs
    else:
      self.ledger.add_time(bucket, secs)

  def tick_total(self) -> None:
    """Adds the wall time since the last tick to ``seconds["total"]`` (kept current
    at every boundary and before every ``on_run_end``, so a checkpoint saved by
    a hook, or a summary at the end, includes it).

    Outside the calls it also adds the time waiting in :meth:`add_time` and
    gives the rest of the interval, which no bucket took (placing the initial
    state, opening the source, closing the feeder, the loop's bookkeeping), to
    :attr:`Bucket.SETUP`.
    """
    now = time.perf_counter()
    elapsed = now - self.t_mark
    self.ledger.add_time(Bucket.TOTAL, elapsed)
    self.t_mark = now
    if self.phase == "calls":
      return
    for bucket, secs in self.pending.items():
      self.ledger.add_time(bucket, secs)
    self.ledger.add_time(Bucket.SETUP, max(elapsed - self.bucketed, 0.0))
    self.pending, self.bucketed = {}, 0.0

  def call_hook(self, i: int, fn: Any, *args: Any) -> Any:
    """Calls ``fn(*args)`` for hook ``i`` and adds its time to the hook's bucket."""
    watchdog = self.watchdog
    if watchdog is not None:  # at the boundary the hooks see (the ledger may be a call ahead)
      last = self.last
      watchdog.enter_phase(self.buckets[i], last.end_step if last is not None
                           and self.phase == "calls" else self.ledger.step)
    t0 = time.perf_counter()
    try:
      return fn(*args)
    finally:
      self.add_time(self.buckets[i], time.perf_counter() - t0)
      if watchdog is not None:
        watchdog.leave_phase()

  # -- start ----------------------------------------------------------------

  def start(self, state: Any, batches: Iterable) -> tuple[Any, ChunkFeeder]:
    """``on_run_start`` of every hook (applying restores), then the plan and the feeder.

    Args:
      state: the admitted initial state, at the ledger's step.
      batches: the source.

    Returns:
      ``(state, feeder)``.
    """
    state = self.start_hooks(state)
    check_concrete(state, "TrainLoop.run was given an abstract state and no hook restored it")
    self.settle_skips()
    for i in self.rewinders:
      check_reopenable(batches, self.names[i])
    step0 = self.ledger.step  # a restore's step, else the state's
    if step0 > self.target:  # after restores: a checkpoint past the target too
      log.warning("nothing to run: the state is at step %d and num_steps is %d", step0,
                  self.target)
    elif step0 == self.target:  # a finished run run again (it only evaluates): not a mistake
      log.info("nothing to train: the state is already at num_steps=%d; the at_end hooks "
               "run once", step0)
    check_epoch_marks(self.hooks, self.steps_per_epoch)
    for h in self.hooks:
      h.trigger.start_clock()
    return state, self.open_feeder(batches, step0)

  def start_hooks(self, state: Any) -> Any:
    """Every hook's ``on_run_start`` (applying what it returns), then ``adjust_ledger``."""
    for i, h in enumerate(self.hooks):
      self.started = i + 1
      new = self.call_hook(i, h.on_run_start, self.contexts[i], state)
      if new is None:
        continue
      if isinstance(new, Restore):
        state = self.apply_restore(new, i)
      else:  # a state (e.g. a hook that edits the state before training)
        state = self.admit(new, i)
        step = int(jax.device_get(self.config.step_of(state)))
        if step != self.ledger.step:
          raise ValueError(
              f"{type(h).__name__}.on_run_start returned a state at step {step} but the "
              f"ledger is at step {self.ledger.step}: to restore, return "
              "loopkit.core.Restore(state, ledger, data_position)")
        self.state = state
    for i, h in enumerate(self.hooks):
      adjust = getattr(h, "adjust_ledger", None)
      if adjust is not None:
        change = self.call_hook(i, adjust, self.contexts[i])
        if change is not None:
          if not isinstance(change, LedgerAdjustment):
            raise TypeError(f"{type(h).__name__}.adjust_ledger returned {change!r}, not a "
                            "loopkit.core.LedgerAdjustment or None")
          change.apply_to(self.ledger)
    return state

  def settle_skips(self) -> None:
    """The skip ranges in force: the restored ledger's and those given to ``run``.

    Raises:
      ValueError: a given range that is not in the ledger's and starts at or before the
        data step the run is at (its first batches were trained on already).
    """
    ledger = self.ledger
    data_step = ledger.data_step
    for first, last in self.skip_steps:
      if first <= data_step and not covered(ledger.skip_steps, first, last):
        raise ValueError(
            f"skip_steps entry ({first}, {last}) starts at or before data step {data_step}, "
            f"where the run is (step {ledger.step} + {ledger.skipped_steps} skipped): "
            f"the batches of data steps {first}..{min(last, data_step)} were trained on "
            f"already. A skip range must start after data step {data_step} (rewind to an "
            "earlier checkpoint to skip those)")
    ledger.skip_steps = merge_ranges(ledger.skip_steps, self.skip_steps)

  def open_feeder(self, batches: Iterable, step0: int) -> ChunkFeeder:
    """Opens the source at the run's data position and plans the calls from ``step0``.

    With skip ranges the source opens at the ledger's data step, and the plan also ends
    calls where a range starts (:func:`loopkit.core.skips.cut_steps`).
    """
    config = self.config
    ledger = self.ledger
    source, start_position = open_source(batches, self.data_position, ledger.data_step)
    if self.data_position is None:  # the position of a boundary before any call
      get_state = getattr(source, "get_state", None)
      self.data_position = get_state() if callable(get_state) else start_position
    triggers = [h.trigger for h in self.hooks]
    cuts = cut_steps(ledger.skip_steps, step0, ledger.data_step)
    if cuts:
      triggers.append(Trigger(at_steps=cuts, at_end=False))
    plan = plan_calls(step0, iterations_per_loop=config.time_based_k or config.iterations_per_loop,
                      num_steps=self.target, steps_per_epoch=self.steps_per_epoch,
                      triggers=triggers)
    # A preemption abandons the chunk being formed (feeding.py): the loop then
    # stops at this boundary after the same agreement as any other.
    return ChunkFeeder(source, plan, iterations_per_loop=config.iterations_per_loop,
                       batch_sharding=self.program.batch_sharding,
                       replicated=self.program.replicated,
                       prefetch=config.prefetch,
                       start_position=start_position, first_step=step0,
                       interrupt=self.preemption.event,
                       global_batch_size=config.global_batch_size,
                       call_places=True,  # the program pins batch_sharding
                       skips=ledger.skip_steps, first_data_step=ledger.data_step)

  def apply_restore(self, r: Restore, i: int) -> Any:
    """Takes a hook's :class:`~loopkit.core.context.Restore`: state, ledger, position, hook
    states."""
    h = self.hooks[i]
    state = self.admit(r.state, i)
    step = int(jax.device_get(self.config.step_of(state)))
    if not isinstance(r.ledger, Ledger) or r.ledger.step != step:
      got = r.ledger.step if isinstance(r.ledger, Ledger) else repr(r.ledger)
      raise ValueError(f"{type(h).__name__} restored a state at step {step} with a ledger at "
                       f"step {got}: a Restore's ledger must be a loopkit.core.Ledger at the "
                       "state's step")
    ledger = r.ledger.copy()
    ledger.steps_per_epoch = self.steps_per_epoch
    self.set_ledger(ledger)
    self.state, self.data_position = state, r.data_position
    unmatched = give_hook_states(r.hook_states, self.hooks, self.names, i)
    if unmatched:
      log.warning("%s: the restored hook states %s match no hook of this loop (hooks: %s); "
                  "they are not restored", type(h).__name__, ", ".join(sorted(unmatched)),
                  ", ".join(self.names))
    return state

  def _hook_states(self, caller: int) -> dict[str, Any]:
    """For ``ctx.hook_states()``: flushes the other hooks, collects their states by name."""
    return collect_hook_states(self.hooks, self.names, caller)

  # -- the run --------------------------------------------------------------

  def execute(self, state: Any, batches: Iterable) -> Any:
    """Runs to the target (or a stop); returns the final state.

    If it raises, :attr:`state` is the work kept and the hooks whose
    ``on_run_start`` was called get ``on_run_error`` (:meth:`fail`).
    """
    self.state = state
    self.batches = batches
    try:
      state, self.feeder = self.start(state, batches)
    except BaseException as error:
      self.tick_total()
      self.fail(error)
      raise
    self.state_position = self.data_position
    returning = False  # False while an exception propagates: close without waiting
    try:
      self.preemption.install()
      state = self.call_until_done(state)
      self.tick_total()  # the calls' time up to their last hook
      self.phase = "end"
      state = self.stop(state)
      returning = True
    except BaseException as error:
      self.data_position = self.state_position  # the position of the state kept
      self.fail(error)
      raise
    finally:
      self.preemption.uninstall()
      self.preemption_spent = True  # kept for reading (signal_received); the next run renews it
      assert self.feeder is not None
      self.feeder.close(wait_secs=None if returning else 0.0)
      self.tick_total()
    return state

  def call_until_done(self, state: Any) -> Any:
    """Dispatches device calls until the target, a stop or the end of data; finishes each.

    After a rewind (:meth:`rewind`) the feeder is closed and opened again at the restored
    position, and the calls go on from the restored step.

    Returns:
      The state after the last call's hooks.
    """
    while True:
      state = self.calls(state)
      if not self.rewound:
        return state
      self.rewound = False
      assert self.feeder is not None
      self.feeder.close()
      self.feeder = self.open_feeder(self.batches, self.ledger.step)

  def calls(self, state: Any) -> Any:
    """:meth:`call_until_done` up to the end, or up to a rewind (then :attr:`rewound`)."""
    feeder = self.feeder
    assert feeder is not None
    pending: Boundary | None = None  # the last dispatched call, not yet finished
    while True:
      if self.stop_reason is not None and jax.process_count() == 1:
        break  # a hook asked to stop: no need to form (or wait for) another chunk
      chunk = self.next_chunk(feeder)
      if chunk is None:
        break
      stop, time_due = self.agree()  # one agreement per call, all processes alike
      if stop is not None:  # stop before dispatching: at_end hooks fire
        self.stop_reason = stop  # with this boundary's state (see stop)
        break
      if chunk.interrupted:  # only when this process's flag is set, so the stop is agreed
        raise RuntimeError("loopkit: a chunk was abandoned without a preemption")
      state, b = self.dispatch(state, chunk, time_due)
      if pending is not None:  # one call late: the next call is already dispatched
        restored = self.finish_call(pending, None)
        if self.rewound:  # call b ran on from the state the rewind threw away
          return restored
      pending = b
      if b.firing and any(self.hooks[i].needs_state for i in b.firing):  # before the next
        # call donates it
        state = self.finish_call(b, state)
        pending = None
        if self.rewound:
          return state
      if chunk.exhausted:
        self.warn_exhausted(stacklevel=5)
        break
      if b.is_last:
        break
    if pending is not None:  # the run's last boundary
      state = self.finish_call(pending, state)
    return state

  def next_chunk(self, feeder: ChunkFeeder) -> Chunk | None:
    """The feeder's next chunk (its wait timed as data wait), or None when the data ran out.

    The first chunk that was not interrupted settles an unknown ``examples_seen``
    and, without a ``global_batch_size`` (else the feeder checked the batch),
    warns about a pmap-looking layout.
    """
    watchdog = self.watchdog
    if watchdog is not None:
      watchdog.enter_phase("data", self.ledger.step)
    t0 = time.perf_counter()
    chunk = feeder.next()
    self.add_time(Bucket.DATA_WAIT, time.perf_counter() - t0)
    if watchdog is not None:
      watchdog.leave_phase()
    if chunk is None or (chunk.length == 0 and not chunk.interrupted):
      if chunk is not None:
        self.warn_exhausted(stacklevel=6)
      return None
    if not self.checked_layout and not chunk.interrupted:
      self.checked_layout = True
      if self.config.global_batch_size is None:
        warn_if_pmap_layout(chunk.batches, self.config.data_parallel_size)
    if self.examples_unknown and not chunk.interrupted:
      self.examples_unknown = False
      self.ledger.examples_seen = self.ledger.step * chunk.global_batch_size
    return chunk

  def dispatch(self, state: Any, chunk: Chunk, time_due: dict[int, bool]) -> tuple[Any, Boundary]:
    """Dispatches one device call over ``chunk`` and records its :class:`Boundary`."""
    if self.phase == "start":  # the run's start ends at its first dispatch
      self.tick_total()
      self.phase = "calls"
    ledger, program = self.ledger, self.program
    start = ledger.step
    t0 = time.perf_counter()
    first_call = program.compile_count() == 0
    watchdog = self.watchdog
    if watchdog is not None:
      if first_call:
        watchdog.enter_phase("compile", start)
      else:
        watchdog.enter_phase("device_call", start, "dispatch")
    state, out = program(state, chunk.batches, chunk.num_steps)
    if watchdog is not None:
      watchdog.leave_phase()
    self.state, self.state_position = state, chunk.position  # its input was donated
    ledger.add_time(Bucket.COMPILE if first_call else Bucket.DISPATCH, time.perf_counter() - t0)
    ledger.advance(chunk.length, chunk.global_batch_size)
    ledger.skipped_steps += chunk.skipped
    end = ledger.step
    if first_call:
      self.check_replicas(state, f"after the first device call (steps {start + 1}..{end})")
    is_last = end >= self.target or chunk.exhausted
    epoch, in_epoch = epoch_of(end, self.steps_per_epoch)
    return state, Boundary(start_step=start, end_step=end, loop_index=ledger.loop_index - 1,
                           epoch=epoch, step_in_epoch=in_epoch,
                           examples_seen=ledger.examples_seen, is_last=is_last,
                           data_position=chunk.position, skipped_steps=ledger.skipped_steps,
                           out=out,
                           firing=self.firing(start, end, is_last, time_due))

  def finish_call(self, b: Boundary, state: Any) -> Any:
    """Fetches a call's outputs (one device_get) and runs its hooks.

    Args:
      b: the call's :class:`Boundary`.
      state: the state after the call when a firing hook needs it, else None.

    Returns:
      The state, possibly replaced by a hook.
    """
    hooks, ledger, watchdog = self.hooks, self.ledger, self.watchdog
    if watchdog is not None:
      watchdog.enter_phase("device_call", b.start_step)
    t0 = time.perf_counter()
    if not hooks:  # nobody reads the metrics: only the step counter and the non-finite flags
      if self.copy_async:  # (as _fetch, without its tree walk: a few us per call)
        b.out.step.copy_to_host_async()
        b.out.nonfinite.copy_to_host_async()
      out_step, nonfinite = np.asarray(b.out.step), np.asarray(b.out.nonfinite)
    else:
      out = _fetch(b.out, self.copy_async)
      out_step, nonfinite = out.step, out.nonfinite
    ledger.add_time(Bucket.DEVICE_WAIT, time.perf_counter() - t0)
    if watchdog is not None:
      watchdog.leave_phase()
    if int(out_step) != b.end_step:
      raise StepCounterError(
          f"the state's step counter is {int(out_step)} after device call {b.loop_index} "
          f"(steps {b.start_step + 1}..{b.end_step}); train_step must increment it by exactly "
          f"1 per step, and it must equal the loop's step {b.end_step}",
          counter=int(out_step), start_step=b.start_step, end_step=b.end_step,
          loop_index=b.loop_index)
    self.data_position = b.data_position
    self.tick_total()
    self.last, self.last_info = b, None
    time_based_k = self.config.time_based_k
    if not hooks:  # no LoopInfo to build: no hook observes, fires or fires at the end
      self.warn_nonfinite(b, nonfinite)
      if time_based_k is not None:
        time_based_k.record(b.end_step)
      return state
    info = self.last_info = self.loop_info(b, out)
    buckets = self.buckets
    if watchdog is not None:
      watchdog.enter_phase(Bucket.HOOKS, b.end_step)
    for i, h in enumerate(hooks):  # call_hook inlined: every hook, every call
      t0 = time.perf_counter()
      try:
        h.after_each_call(info)
      finally:
        ledger.add_time(buckets[i], time.perf_counter() - t0)
    if watchdog is not None:
      watchdog.leave_phase()
    self.warn_nonfinite(b, nonfinite)  # after after_each_call: a NanCheckHook raises first
    if self.rewinders:  # before any hook fires here: a checkpoint must not save this state
      request = self.agreed_rewind(info)
      if request is not None:
        return self.rewind(*request)
    state = self.fire(b.firing, info, state)
    if time_based_k is not None:
      time_based_k.record(b.end_step)
    return state

  def agreed_rewind(self, info: LoopInfo) -> tuple[int, RewindRequest] | None:
    """Asks every hook that may rewind (``rewind_request(info)``); the first request, agreed.

    On several processes the request goes through one agreement
    (:func:`loopkit.core.agreement.agree_with_reason`, the request as its reason), so every
    process rewinds at the same boundary in the same way: the lowest-index process's
    request, if any process made one.

    Returns:
      ``(hook index, request)`` or None.
    """
    local: tuple[int, RewindRequest] | None = None
    for i in self.rewinders:
      request = self.call_hook(i, getattr(self.hooks[i], "rewind_request"), info)
      if request is None:
        continue
      if not isinstance(request, RewindRequest):
        raise TypeError(f"{self.names[i]}.rewind_request returned {request!r}, not a "
                        "loopkit.core.skips.RewindRequest or None")
      if local is None:
        local = (i, request)
    if self.single_process:
      return local
    text = None if local is None else json.dumps([local[0], dataclasses.asdict(local[1])])
    _, text = agree_with_reason([local is not None], text)
    if text is None:
      return None
    index, fields = json.loads(text)
    return int(index), RewindRequest(**fields)

  def rewind(self, i: int, request: RewindRequest) -> Any:
    """Applies an agreed rewind: hook ``i``'s restore, a new skip range, the accounting.

    The hook's ``rewind(ctx, request, like)`` returns a
    :class:`~loopkit.core.context.Restore` at a step below ``request.before_step``; it is
    applied as a restore at the start (state, ledger, data position, the other hooks'
    states), then the skip range from the restored data step + 1 through
    ``request.skip_through`` joins the ranges in force (with those of the ledger before
    the rewind). Wall time does not rewind (the ledger keeps its ``seconds``); the steps
    thrown away add to ``lost_steps``. No hook fires at this boundary, and the call
    dispatched after it is dropped with the state it produces.

    Returns:
      The restored state (:attr:`rewound` is then True).

    Raises:
      TypeError: the hook returned no Restore.
      ValueError: a Restore at or after ``request.before_step``, or a ``skip_through``
        before the restored data step.
    """
    name = self.names[i]
    before = self.ledger.copy()
    restore = self.call_hook(i, getattr(self.hooks[i], "rewind"), self.contexts[i], request,
                             self.state)
    if not isinstance(restore, Restore):
      raise TypeError(f"{name}.rewind returned {restore!r}, not a loopkit.core.Restore")
    if not isinstance(restore.ledger, Ledger) or restore.ledger.step >= request.before_step:
      got = restore.ledger.step if isinstance(restore.ledger, Ledger) else restore.ledger
      raise ValueError(f"{name}.rewind restored step {got}, not a step before "
                       f"{request.before_step} (the request's before_step)")
    state = self.apply_restore(restore, i)
    ledger = self.ledger
    first = ledger.data_step + 1
    if request.skip_through < first:
      raise ValueError(f"{name} asked to skip through data step {request.skip_through}, "
                       f"before data step {first}, the first after the restored step "
                       f"{ledger.step}")
    ledger.skip_steps = merge_ranges(ledger.skip_steps, before.skip_steps,
                                     [(first, request.skip_through)])
    ledger.seconds = before.seconds
    ledger.lost_steps = before.lost_steps + max(before.step - ledger.step, 0)
    log.warning("%s: %s; rewound from step %d to step %d and skipping data steps %d..%d "
                "(skip_steps now %s)", name, request.reason, before.step, ledger.step, first,
                request.skip_through, list(ledger.skip_steps))
    self.state_position = self.data_position
    self.last = self.last_info = None
    self.status = None  # a data_exhausted warned on the thrown-away calls no longer holds
    if self.config.time_based_k is not None:
      self.config.time_based_k.start()
    self.rewound = True
    return state

  def loop_info(self, b: Boundary, out: Any) -> LoopInfo:
    """The hooks' :class:`~loopkit.core.hooks.LoopInfo` of call ``b``, from its fetched
    outputs ``out``."""
    n = b.num_steps
    steps = (out.traces if n == self.config.iterations_per_loop else  # the call's steps, [n]
             {k: jax.tree.map(lambda x: x[:n], v) for k, v in out.traces.items()})
    values = {k: metrics_lib.fold_steps(v) for k, v in steps.items()}  # in step order
    return LoopInfo(**record_fields(b),
                    metrics={k: metrics_lib.compute(v) for k, v in values.items()},
                    metric_values=values,
                    traces={k: metrics_lib.compute_traces(v) for k, v in steps.items()},
                    step_values=steps)

  def fire(self, firing: list[int], info: LoopInfo, state: Any) -> Any:
    """Calls ``on_trigger`` of the hooks ``firing``; admits the states they return."""
    readers = [type(self.hooks[i]).__name__ for i in firing if self.hooks[i].needs_state]
    if state is not None and readers:
      self.check_replicas(state, f"at step {info.end_step}, before the state goes to "
                          f"{', '.join(readers)},")
    for i in firing:
      h = self.hooks[i]
      new = self.call_hook(i, h.on_trigger, info, state if h.needs_state else None)
      if new is not None and h.needs_state:
        state = self.state = self.admit(new, i)
    return state

  def stop(self, state: Any) -> Any:
    """Sets the status, fires the ``at_end`` hooks still due, then ``on_run_end``."""
    if self.stop_reason is not None:
      self.status = self.stop_reason
      if self.status == TIME_LIMIT and self.time_limit is not None:
        decided = self.time_limit.decided_at  # the reading the stop was decided on
        log.info("max_time of %g s reached at step %d (%.1f s since run started): stopping "
                 "there to be resumed", self.time_limit.seconds, self.ledger.step,
                 self.time_limit.elapsed() if decided is None else decided)
    elif self.status is None:
      if self.ledger.step < self.target:  # invariant: "completed" means the target was reached
        raise RuntimeError(
            f"loopkit: the run ended at step {self.ledger.step} without reaching its target "
            f"step {self.target} and without a stop, preemption or end of data; this is a "
            "bug, please report it with the TrainLoop arguments")
      self.status = "completed"
    state = self.fire_at_end(state)
    for i, h in enumerate(self.hooks):
      self.tick_total()  # seconds["total"] is current for each on_run_end (a summary)
      new = self.call_hook(i, h.on_run_end, self.contexts[i], state)
      if new is not None:
        state = self.state = self.admit(new, i)
    return state

  # -- errors ----------------------------------------------------------------

  def fail(self, error: BaseException) -> None:
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
    leaves = jax.tree.leaves(self.state)
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
      self.state = None
    for i, h in enumerate(self.hooks[:self.started]):
      for method, args in (("flush", ()), ("on_run_error", (self.contexts[i], error))):
        fn = getattr(h, method, None)
        if not callable(fn):
          continue
        try:
          fn(*args)
        except Exception:  # pylint: disable=broad-except  # the run's own error propagates
          log.exception("%s.%s failed while the run raised %s", type(h).__name__, method,
                        type(error).__name__)

  # -- boundary helpers ----------------------------------------------------

  def warn_exhausted(self, stacklevel: int) -> None:
    """Sets the status ``"data_exhausted"`` and warns; ``stacklevel`` points at the caller of
    ``TrainLoop.run``."""
    self.status = "data_exhausted"
    target, spe = self.target, self.steps_per_epoch
    asked = (f"num_epochs={self.num_epochs} (x steps_per_epoch={spe} = {target} steps)"
             if self.num_epochs is not None else f"num_steps={target}")
    warnings.warn(
        f"the batch iterator ran out at step {self.ledger.step} before {asked}; stopping after "
        "the last full step. The batches are read once, as one stream: for more epochs repeat "
        "them (itertools.chain.from_iterable(itertools.repeat(batches, n)), tf.data's "
        ".repeat(), or loopkit.ArraySource)", DataExhaustedWarning, stacklevel=stacklevel)

  def warn_nonfinite(self, b: Boundary, nonfinite: np.ndarray) -> None:
    """Warns, once per run, naming the first step whose metric had a NaN or Inf.

    Args:
      b: the call's boundary.
      nonfinite: its fetched :attr:`~loopkit.core.program.CallOutput.nonfinite` (int32 ``[M]``).
    """
    if self.nonfinite_step is not None or not any(nonfinite.tobytes()):
      return  # all zeros: every metric finite (cheaper than nonfinite.any() for a few bytes)
    first = int(nonfinite[nonfinite > 0].min())
    names = [repr(k) for k, i in zip(sorted(b.out.traces), nonfinite.tolist()) if i == first]
    self.nonfinite_step = b.start_step + first
    warnings.warn(NonFiniteWarning(
        f"metric{'s' * (len(names) > 1)} {', '.join(names)} "
        f"{'are' if len(names) > 1 else 'is'} NaN or infinite at step {self.nonfinite_step}, the "
        f"first such step of this run (device call {b.loop_index} ran steps "
        f"{b.start_step + 1}..{b.end_step}); training goes on and the state may hold NaNs: add "
        "loopkit.NanCheckHook() to stop there"), stacklevel=6)

  def agree(self) -> tuple[str | None, dict[int, bool]]:
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
    timed = self.timed
    over = self.time_limit is not None and self.time_limit.expired()
    if self.single_process:  # agree_with_reason's answer on one process: the local one
      preempted = self.preemption.requested
      time_due = self.each_timed_hook(
          {i: bool(self.hooks[i].trigger.time_due()) for i in timed}) if timed else {}
      if self.stop_reason is not None:
        return self.stop_reason, time_due
      return ("preempted" if preempted else TIME_LIMIT if over else None), time_due
    watchdog = self.watchdog
    if watchdog is not None:
      watchdog.enter_phase("agreement", self.ledger.step)
    agreed, reason = agree_with_reason(
        [self.preemption.requested, over] + [self.hooks[i].trigger.time_due() for i in timed],
        self.stop_reason)
    if watchdog is not None:
      watchdog.leave_phase()
    time_due = self.each_timed_hook(dict(zip(timed, agreed[2:])))
    if reason is not None:
      return reason, time_due
    return ("preempted" if agreed[0] else TIME_LIMIT if agreed[1] else None), time_due

  def each_timed_hook(self, due: dict[int, bool]) -> dict[int, bool]:
    """``{hook index: due}`` for every hook with ``every_secs``, from the answers ``due`` of
    the first hook of each trigger object."""
    return {i: due[j] for i, j in self.timed_same.items()}

  def firing(self, start: int, end: int, is_last: bool, time_due: dict[int, bool]) -> list[int]:
    """The hooks that fire after the call ``(start, end]``; records their firing."""
    if not self.hooks:
      return []
    spe = self.steps_per_epoch
    firing = [i for i, h in enumerate(self.hooks)
              if h.trigger.should_fire(start, end, steps_per_epoch=spe, is_last=is_last,
                                       time_due=time_due.get(i, False))]
    for i in firing:
      self.hooks[i].trigger.fired()
    return firing

  def fire_at_end(self, state: Any) -> Any:
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
    last = self.last
    preempted = self.status in RESUMABLE_STOPS
    due = [i for i, h in enumerate(self.hooks) if h.trigger.at_end and not h.trigger.every_call
           and (not preempted or getattr(h, "fires_at_preemption", True))]
    if last is None or self.last_info is None:
      if last is not None:  # no hooks: nothing fires
        return state
      step = self.ledger.step
      epoch, in_epoch = epoch_of(step, self.steps_per_epoch)
      info = LoopInfo(start_step=step, end_step=step, loop_index=self.ledger.loop_index - 1,
                      epoch=epoch, step_in_epoch=in_epoch,
                      examples_seen=self.ledger.examples_seen, metrics={}, metric_values={},
                      traces={}, is_last=True, data_position=self.data_position,
                      skipped_steps=self.ledger.skipped_steps)
    elif last.is_last:
      return state
    else:
      info = dataclasses.replace(self.last_info, is_last=True)
      due = [i for i in due if i not in last.firing]
    return self.fire(due, info, state)

  def check_replicas(self, state: Any, when: str) -> None:
    """For per-device steps: every device's copy of the state must agree.

    Runs after the first call and whenever the state is handed to hooks (to be
    saved or evaluated), at most once per step.
    """
    program = self.program
    if (program.style != "per_device" or self.config.data_parallel_size == 1
        or self.replicas_checked_at == self.ledger.step):
      return
    t0 = time.perf_counter()
    jax.block_until_ready(state)  # the call's own device time is device_wait, not the check's
    t1 = time.perf_counter()
    self.add_time(Bucket.DEVICE_WAIT, t1 - t0)
    diverged = program.diverged_leaves(state)
    # The first check of a run includes compiling the check program.
    self.add_time(Bucket.COMPILE if self.replicas_checked_at is None
                  else Bucket.REPLICA_CHECK, time.perf_counter() - t1)
    self.replicas_checked_at = self.ledger.step
    if diverged:
      axis = program.data_axis
      across = f"the {axis!r} axis" if isinstance(axis, str) else f"the axes {axis!r}"
      raise ValueError(
          f"{when} the devices' copies of "
          f"state leaves {', '.join(diverged[:5])}{' ...' if len(diverged) > 5 else ''} "
          f"differ across {across}: a step_style='per_device' train_step must keep "
          f"the state identical on every device, e.g. average gradients with "
          f"jax.lax.pmean(grads, {axis!r}) before the update (and BatchNorm statistics with "
          f"axis_name={axis!r})")

  def admit(self, state: Any, hook: int | None) -> Any:
    """The one way a state enters the compiled program.

    The run's initial state, a hook's replacement (``on_trigger``), a restore
    (``on_run_start``) and an ``on_run_end`` replacement all pass here: checked
    against the train state (structure, shapes, dtypes, naming the leaf), then
    placed with the program's pinned shardings and de-duplicated buffers
    (:meth:`MultiStepProgram.place_state`).

    Args:
      state: the state pytree.
      hook: index of the hook that returned it, or None for the initial state
        (which becomes the train state the others are checked against).

    The initial state may be abstract (``jax.ShapeDtypeStruct`` leaves): it stays so, with
    the pinned shardings, until a hook's restore gives it values (:meth:`start`).

    Raises:
      TypeError: an initial state holding Flax NNX objects (names
        :class:`loopkit.nnx.NnxTrainLoop`).
      ValueError: a replacement unlike the train state, or with abstract leaves.
    """
    if hook is None:
      check_not_nnx_objects(state)
    else:
      name = type(self.hooks[hook]).__name__
      problem = tree_mismatch(self.state_spec, state, what=(
          f"{name} returned a state unlike the train state"))
      if problem:
        raise ValueError(problem)
      check_concrete(state, f"{name} returned a state without values")
    placed = self.program.place_state(state)
    if hook is None:
      self.state_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), placed)
    return placed

