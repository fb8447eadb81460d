"""One ``TrainLoop.run``: the run object, the only writer of run state.

A :class:`Run` lives for one call of :meth:`loopkit.TrainLoop.run`. It takes the
loop's :class:`RunConfig` (not the loop), owns the ledger, the data position,
the status, the stop reason, the preemption watcher's use and the per-run
bookkeeping (the train state's spec, the replica check, the hooks' names and
contexts). This module is the conductor (:meth:`Run.execute`, :meth:`Run.calls`), the
ledger's writes and the doors of a state (:meth:`Run.admit`, :meth:`Run.apply_restore`);
the run's steps are functions of the run in rooms of their own, which a batch's call
enters in order:

* :mod:`loopkit.core.start_end`: before the first call, every hook's ``on_run_start``
  (restores applied), the skip ranges and the feeder; after the last, the status, the
  ``at_end`` hooks still due and ``on_run_end`` (:func:`~loopkit.core.start_end.stop`),
  or, when the run raises, the work kept and ``on_run_error``;
* :mod:`loopkit.core.calls`: the feeder's next chunk, then one device call over it
  (:func:`~loopkit.core.calls.dispatch`: the ledger advanced, a
  :class:`~loopkit.core.boundary.Boundary` recorded);
* :mod:`loopkit.core.boundary`: the processes' agreement before each dispatch
  (:func:`~loopkit.core.boundary.agree`), and after it the call's outputs fetched (one
  ``device_get``, one call late unless a firing hook needs the state), a
  :class:`~loopkit.core.hooks.LoopInfo` built, hooks see it and fire
  (:func:`~loopkit.core.boundary.finish_call`);
* :mod:`loopkit.core.rewind`: a hook with ``rewind_request`` may ask, at a call's boundary,
  to go back to an earlier checkpoint and skip data (:mod:`loopkit.core.skips`); agreed
  across processes, the run applies the hook's restore, drops the call dispatched meanwhile
  and opens the source again at the restored position (a resume inside the process).

The rooms import each other without a circle (calls imports boundary, and start_end for the
end-of-data warning; boundary imports rewind; start_end imports boundary) and this module
only under ``TYPE_CHECKING``.

Hooks read a :class:`~loopkit.core.context.RunContext` and return what they change
(:mod:`loopkit.core.context`); only this module applies it. Not thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax

from loopkit._internal.checks import check_concrete, check_not_nnx_objects, tree_mismatch
from loopkit._internal.mesh import is_cpu_mesh
from loopkit.core import boundary, calls, start_end
from loopkit.core.boundary import Boundary, StepCounterError as StepCounterError
from loopkit.core.context import LedgerAdjustment, Restore, RunContext
from loopkit.core.hook_state import collect_hook_states, give_hook_states, hook_names
from loopkit.core.hooks import (
  Hook,
  LoopInfo,
  check_hooks,
)
from loopkit.core.ledger import Bucket, Ledger, LedgerView
from loopkit.core.planner import TimeBasedK, plan_calls
from loopkit.core.preemption import PreemptionWatcher
from loopkit.core.program import MultiStepProgram
from loopkit.core.skips import (
  SkipRanges,
  cut_steps,
)
from loopkit.core.start_end import (
  RESUMABLE_STOPS as RESUMABLE_STOPS,
  DataExhaustedWarning as DataExhaustedWarning,
  check_epoch_marks as check_epoch_marks,
)
from loopkit.core.time_limit import TimeLimit
from loopkit.core.triggers import Trigger
from loopkit.data.feeding import ChunkFeeder
from loopkit.data.sources import open_source

log = logging.getLogger("loopkit")


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
    chunk_assembly: where the feeder forms chunks (:mod:`loopkit.data.assembly`).
  """

  program: MultiStepProgram
  iterations_per_loop: int
  time_based_k: TimeBasedK | None
  mesh: Any
  data_parallel_size: int
  prefetch: int
  step_of: Callable[[Any], Any]
  global_batch_size: int | None
  chunk_assembly: str = "auto"


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
      hands back when ``run`` raises (:func:`loopkit.core.start_end.fail`).
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

  def now(self) -> float:
    """``time.perf_counter()``: the clock of every room of the run (a test's fake
    clock replaces this module's ``time``)."""
    return time.perf_counter()

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

  def adjust_hooks(self) -> None:
    """Every hook's ``adjust_ledger(ctx)``, applying the
    :class:`~loopkit.core.context.LedgerAdjustment` it returns: the one call that tells the
    hooks the step the run continues from (``ctx.ledger.step``, restores applied), at the
    start of every run and after every rewind (:func:`loopkit.core.rewind.rewind`), so rows,
    records and
    histories past it go the same way after a resume and after a rewind."""
    for i, h in enumerate(self.hooks):
      adjust = getattr(h, "adjust_ledger", None)
      if adjust is not None:
        change = self.call_hook(i, adjust, self.contexts[i])
        if change is not None:
          if not isinstance(change, LedgerAdjustment):
            raise TypeError(f"{type(h).__name__}.adjust_ledger returned {change!r}, not a "
                            "loopkit.core.LedgerAdjustment or None")
          change.apply_to(self.ledger)

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
                       skips=ledger.skip_steps, first_data_step=ledger.data_step,
                       assembly=config.chunk_assembly)

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

  def execute(self, state: Any, batches: Iterable) -> Any:
    """Runs to the target (or a stop); returns the final state.

    If it raises, :attr:`state` is the work kept and the hooks whose
    ``on_run_start`` was called get ``on_run_error`` (:func:`loopkit.core.start_end.fail`).
    """
    self.state = state
    self.batches = batches
    try:
      state, self.feeder = start_end.start(self, state, batches)
    except BaseException as error:
      self.tick_total()
      start_end.fail(self, error)
      raise
    self.state_position = self.data_position
    returning = False  # False while an exception propagates: close without waiting
    try:
      self.preemption.install()
      state = self.call_until_done(state)
      self.tick_total()  # the calls' time up to their last hook
      self.phase = "end"
      state = start_end.stop(self, state)
      returning = True
    except BaseException as error:
      self.data_position = self.state_position  # the position of the state kept
      start_end.fail(self, error)
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

    After a rewind (:func:`loopkit.core.rewind.rewind`) the feeder is closed and opened again
    at the restored
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
      chunk = calls.next_chunk(self, feeder)
      if chunk is None:
        break
      stop, time_due = boundary.agree(self)  # one agreement per call, all processes alike
      if stop is not None:  # stop before dispatching: at_end hooks fire
        self.stop_reason = stop  # with this boundary's state (see stop)
        break
      if chunk.interrupted:  # only when this process's flag is set, so the stop is agreed
        raise RuntimeError("loopkit: a chunk was abandoned without a preemption")
      state, b = calls.dispatch(self, state, chunk, time_due)
      if pending is not None:  # one call late: the next call is already dispatched
        restored = boundary.finish_call(self, pending, None)
        if self.rewound:  # call b ran on from the state the rewind threw away
          return restored
      pending = b
      if b.firing and any(self.hooks[i].needs_state for i in b.firing):  # before the next
        # call donates it
        state = boundary.finish_call(self, b, state)
        pending = None
        if self.rewound:
          return state
      if chunk.exhausted:
        start_end.warn_exhausted(self, stacklevel=5)
        break
      if b.is_last:
        break
    if pending is not None:  # the run's last boundary
      state = boundary.finish_call(self, pending, state)
    return state

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
    the pinned shardings, until a hook's restore gives it values
    (:func:`loopkit.core.start_end.start`).

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

