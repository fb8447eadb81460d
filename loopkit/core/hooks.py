"""Hooks: host code that runs only at loop boundaries.

A hook sees a :class:`LoopInfo` (the call's step range, epoch, metrics already on
the host) and, if it asks for it, the train state. Hooks are called in the order
given, always in step order. Two entry points:

* :meth:`Hook.after_each_call` after *every* device call (cheap host bookkeeping; may
  run one loop late, after the next call was dispatched);
* :meth:`Hook.on_trigger` when the hook's :class:`~loopkit.core.triggers.Trigger`
  fires. The step-based marks of the trigger are landed on exactly by the
  planner. A hook with ``needs_state=True`` gets the state and may return a
  replacement (same structure, shapes, dtypes and shardings); the loop then
  synchronises at that boundary. Hooks with ``needs_state=False`` get
  ``state=None`` and never stall the next dispatch.

Early stop and preemption: when a run stops before its planned end
(``loop.request_stop(reason)``, or a SIGTERM/SIGINT that the processes agree on
at a boundary, see :mod:`loopkit.core.preemption`), the loop stops *before*
dispatching the next call; hooks whose trigger has ``at_end`` and that did not
fire on the last call then fire with that boundary's state and
``info.is_last=True`` (this is how a checkpoint lands off its cadence at a
preemption), then ``on_run_end`` runs and ``loop.status`` is the reason
(``"preempted"``). A ``run(..., max_time=...)`` budget that runs out stops the
run the same way, with ``"time limit"`` (:mod:`loopkit.core.time_limit`). A
preemption is not the end of training (the run resumes there), nor is a time
limit: there only the ``at_end`` hooks whose ``fires_at_preemption``
is true fire (the default, and :class:`~loopkit.checkpoint.CheckpointHook`);
hooks that write rows at their marks (:class:`~loopkit.LoggingHook`,
:class:`~loopkit.EvalHook`) set it False, so a preempted and resumed run writes
the rows of an uninterrupted one, and a window open at the preemption is saved
with the checkpoint and continued after the resume.

Every decision to fire is the same on every process: step marks are
deterministic, and the wall-clock part of a trigger (``every_secs``), stop
requests and preemption flags are agreed at each boundary
(:mod:`loopkit.core.agreement`). A run that makes no device call (stopped before the
first one, or started at its target) fires its ``at_end`` hooks that have a
mark once with an empty :class:`LoopInfo` (``num_steps == 0``, no metrics).

What a hook may touch (:mod:`loopkit.core.context`): it reads its
:class:`LoopInfo` and a read-only :class:`~loopkit.core.context.RunContext` (``ctx``,
given to ``on_run_start`` / ``on_run_end`` / ``on_run_error``), and *returns*
what it changes: a new state, a :class:`~loopkit.core.context.Restore` (state,
ledger and data position together) from ``on_run_start``, or a
:class:`~loopkit.core.context.LedgerAdjustment` from ``adjust_ledger``. It may ask
for a stop (``ctx.request_stop``, ``ctx.preemption.request()``); it may write
its own attributes and files. Only the run writes the ledger, the data
position, the status and the state.

A method the loop would never call is refused when the loop is built (and again
when ``run`` starts, for hooks added since): a public method of a hook's class
named like a hook method (``on_*``, ``after_*``, ``before_*``) that is not one of
:data:`HOOK_METHODS`, or named as loopkit 0.1's hook methods (``observe``, now
``after_each_call``; ``after_call``, now ``on_trigger``). The error names the
method and the nearest hook method (:func:`check_hooks`). A public method of the
hook's own that only looks like one is listed in the class's ``not_hook_methods``.

Hooks are not thread-safe; on multi-host every process runs every hook (a hook
that writes files should write on process 0 only).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from loopkit import metrics as metrics_lib
from loopkit.core.context import LedgerAdjustment, RunContext
from loopkit.core.ledger import Bucket
from loopkit.core.triggers import Trigger


@dataclasses.dataclass(frozen=True)
class CallRecord:
  """Where one device call leaves the run: its step range and the counters after it.

  The fields every record of a call has: the run's own
  (:class:`loopkit.core.run.Boundary`) and the hooks' (:class:`LoopInfo`).

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
    is_last: the last call of this ``run``.
    data_position: the source position after this call's last batch (what a
      checkpoint must store to resume with the next unconsumed batch).
    skipped_steps: data steps passed over without an update so far, this call's
      included (the ledger's after the call, :mod:`loopkit.core.skips`): the call's
      batches are data steps ``start_step + skipped_steps + 1 .. data_step``.
  """

  start_step: int
  end_step: int
  loop_index: int
  epoch: int
  step_in_epoch: int
  examples_seen: int
  is_last: bool = False
  data_position: Any = None
  skipped_steps: int = 0

  @property
  def num_steps(self) -> int:
    return self.end_step - self.start_step

  @property
  def data_step(self) -> int:
    """The data step of the call's last batch (batches given so far): ``end_step +
    skipped_steps``."""
    return self.end_step + self.skipped_steps


def record_fields(record: CallRecord) -> dict[str, Any]:
  """The :class:`CallRecord` fields of ``record`` (any subclass), by name."""
  return {f.name: getattr(record, f.name) for f in dataclasses.fields(CallRecord)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopInfo(CallRecord):
  """Record of one device call, on the host: a :class:`CallRecord` and the call's metrics.

  Built by the run (keyword arguments only past the :class:`CallRecord` fields).

  Attributes:
    metrics: metric values for the call (float): ``compute()`` of ``metric_values``.
    metric_values: the call's per-step values folded in step order (mergeable float32
      values, numpy scalars): ``fold_steps(step_values[name])``.
    traces: per-step values, float32 arrays ``[end_step - start_step]``.
    step_values: the per-step mergeable values, fields ``[end_step - start_step]``
      (float32 numpy). A value over several calls that must not depend on K continues
      the fold, ``fold_steps(info.step_values[name], running)``, as
      :class:`LoggingHook` does; merging ``metric_values`` across calls instead
      associates the sums by call, which changes the last bits with K.
  """

  metrics: dict[str, float]
  metric_values: dict[str, metrics_lib.Metric]
  traces: dict[str, np.ndarray]
  step_values: dict[str, metrics_lib.Metric] = dataclasses.field(default_factory=dict)


class Hook:
  """Base class of hooks.

  Args:
    every_steps, every_epochs, at_steps, every_secs, at_end: the hook's
      trigger (see :class:`loopkit.core.triggers.Trigger`); none set = every call.
      ``at_end`` also covers early stops, and preemption when
      ``fires_at_preemption`` (module docstring).

  A hook whose own state must survive a resume may define
  ``checkpoint_state() -> dict`` (JSON-serialisable) and
  ``restore_checkpoint_state(d: dict)``; :class:`loopkit.checkpoint.CheckpointHook`
  saves it with each checkpoint, keyed by the hook's stable name
  (``hook_name``, default the class name, ``#2``... for repeats; see
  :func:`loopkit.core.hook_state.hook_names`), and the loop hands it back on a restore.
  A hook with ``flush()`` is flushed by the loop before a checkpoint is saved and,
  when ``run`` raises, before its ``on_run_error``. A hook with ``rewind_request(info)`` and
  ``rewind(ctx, request, like)`` may rewind the run to an earlier checkpoint and skip data
  (:mod:`loopkit.core.skips`, :class:`loopkit.checkpoint.LossSpikeHook`).

  Attributes:
    needs_state: the hook reads the state in ``on_trigger`` (the loop then
      synchronises at its boundaries).
    time_bucket: the ledger bucket its time goes to (:class:`~loopkit.core.ledger.Bucket`;
      the default ``hooks`` becomes ``setup`` before a run's first call and after its last).
    hook_name: stable name for its saved state (None: the class name).
    fires_at_preemption: whether ``at_end`` also fires at a preemption's boundary,
      and at a ``max_time`` stop's (``"time limit"``: also resumed later)
      (True: e.g. a checkpoint, which must land there). False for a hook whose
      firings are rows at its marks: the run resumes from the preemption and
      the hook fires at its next mark, as without the preemption.
    not_hook_methods: names of public methods of the subclass that look like hook
      methods (``on_*``, ``after_*``, ``before_*``, ``observe``, ``after_call``)
      but are its own, which the loop does not call; any other such method is
      refused when the loop is built (:func:`check_hooks`).
  """

  needs_state: bool = True
  time_bucket: str = Bucket.HOOKS
  hook_name: str | None = None
  fires_at_preemption: bool = True
  not_hook_methods: tuple[str, ...] = ()

  def __init__(self, *, every_steps: int | None = None, every_epochs: float | None = None,
               at_steps: Sequence[int] | None = None, every_secs: float | None = None,
               at_end: bool = True):
    self.trigger = Trigger(every_steps=every_steps, every_epochs=every_epochs,
                           at_steps=at_steps, every_secs=every_secs, at_end=at_end)

  def on_run_start(self, ctx: RunContext, state: Any) -> Any | None:
    """Called once per ``run`` before the first call, in hook order.

    Args:
      ctx: the run's read-only :class:`~loopkit.core.context.RunContext`
        (``ctx.ledger`` is at the state's step, or at a restore by an earlier hook).
      state: the state the run starts from.

    Returns:
      None; a replacement state at the same step; or a
      :class:`~loopkit.core.context.Restore` (state, ledger and data position
      together, e.g. from a checkpoint), which the loop applies.
    """

  def adjust_ledger(self, ctx: RunContext) -> LedgerAdjustment | None:
    """Called once per ``run`` after every ``on_run_start`` (restores applied), and again
    after every rewind (:mod:`loopkit.core.skips`): the run continues from
    ``ctx.ledger.step``. A hook that keeps rows (a writer:
    :func:`~loopkit.observe.writers.keep_rows_through`) or per-step entries
    (:func:`drop_after`) drops those past that step here, so after a resume and after a
    rewind it holds what a run that never went past it holds.

    Returns:
      None or a :class:`~loopkit.core.context.LedgerAdjustment` for the loop to
      apply (e.g. :class:`~loopkit.observe.goodput.GoodputHook`'s work lost to restarts).
    """
    del ctx
    return None

  def after_each_call(self, info: LoopInfo) -> None:
    """Called after every device call, in step order."""

  def on_trigger(self, info: LoopInfo, state: Any) -> Any | None:
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
    something), not the hooks after it, which never started; a hook with
    ``flush()`` is flushed just before. For cleanup that must finish before
    the error reaches the caller, e.g. waiting for a background write
    (:class:`~loopkit.checkpoint.CheckpointHook` waits for its in-flight save
    and releases its directory), closing a progress bar, stopping a profiler
    trace. ``on_run_end`` is not called then; the loop keeps the work done in
    ``loop.last_state``.
    Exceptions raised here are logged, not raised: ``run`` raises ``error``.

    Args:
      ctx: the run's :class:`~loopkit.core.context.RunContext`.
      error: the exception that ends the run (any ``BaseException``, e.g. a
        ``KeyboardInterrupt``).
    """


# Every method the loop calls on a hook (the last five only if the hook has them; the
# rewind pair: loopkit.core.skips).
HOOK_METHODS = ("on_run_start", "adjust_ledger", "after_each_call", "on_trigger", "on_run_end",
                "on_run_error", "flush", "checkpoint_state", "restore_checkpoint_state",
                "rewind_request", "rewind")
# loopkit 0.1's hook methods, by the name the loop calls now.
RENAMED_HOOK_METHODS = {"observe": "after_each_call", "after_call": "on_trigger"}
_SIGNATURES = {"after_each_call": "after_each_call(info)",
               "on_trigger": "on_trigger(info, state)"}
_HOOK_LIKE = ("on_", "after_", "before_")
_REQUIRED = ("trigger", "needs_state", "on_run_start", "after_each_call", "on_trigger",
             "on_run_end")


def drop_after(rows: list[Any], step: int) -> int:
  """Drops the entries past global step ``step`` from the end of ``rows``, in place.

  What a hook keeping per-step entries (``records``, ``results``, a ``history``) does in
  its ``adjust_ledger(ctx)`` with ``ctx.ledger.step``: after a resume or a rewind to an
  earlier step it then holds what a run that never went past that step holds.

  Args:
    rows: entries in step order, each a sequence whose first item is its step (int).
    step: the step the run continues from.

  Returns:
    How many entries were dropped.

  Example:
    >>> rows = [(10, "a"), (20, "b"), (22, "c")]
    >>> drop_after(rows, 20), rows
    (1, [(10, 'a'), (20, 'b')])
  """
  n = len(rows)
  while rows and rows[-1][0] > step:
    rows.pop()
  return n - len(rows)


def check_hooks(hooks: Sequence[Any]) -> None:
  """Checks that the loop can call every hook, and would call each method that looks like a hook
  method.

  Run by :class:`loopkit.TrainLoop` when it is built and when ``run`` starts.

  Raises:
    TypeError: a hook without the :class:`Hook` attributes; a public method of a
      hook's class (or a base class other than :class:`Hook`) whose name looks like a
      hook method (``on_*``, ``after_*``, ``before_*``) but is not one of
      :data:`HOOK_METHODS`, or is one of loopkit 0.1's (``observe``,
      ``after_call``), and is not in the class's ``not_hook_methods``: the message
      names the class, the method and the nearest hook method.
  """
  for h in hooks:
    missing = [a for a in _REQUIRED if not hasattr(h, a)]
    if missing:
      raise TypeError(f"hook {h!r} lacks {', '.join(missing)}: subclass loopkit.Hook "
                      "(or wrap a function in loopkit.CallbackHook)")
    problem = _never_called(type(h))
    if problem:
      raise TypeError(problem)


def _never_called(cls: type) -> str | None:
  """The refusal for the first method of ``cls`` the loop would never call, or None."""
  own = set()
  for klass in cls.__mro__:
    own.update(klass.__dict__.get("not_hook_methods", ()))
  for klass in cls.__mro__:
    if klass in (Hook, object):
      continue
    for name, value in klass.__dict__.items():
      if (name.startswith("_") or name in HOOK_METHODS or name in own
          or not (inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod)))):
        continue
      if name not in RENAMED_HOOK_METHODS and not name.startswith(_HOOK_LIKE):
        continue
      where = cls.__qualname__
      if klass is not cls:
        where += f" (from {klass.__qualname__})"
      now = RENAMED_HOOK_METHODS.get(name)
      if now is not None:
        why = (f"{name}() is loopkit 0.1's name: since 0.2 the loop calls "
               f"{_SIGNATURES[now]} instead")
      else:
        near = difflib.get_close_matches(name, HOOK_METHODS, n=1, cutoff=0.0)
        why = f"it is not a hook method (the nearest is {near[0]})"
      return (f"hook {where} defines {name}(), which the loop never calls: {why}. Rename it "
              f"(the hook methods: {', '.join(HOOK_METHODS)}; loopkit 0.1's observe(info) "
              "is after_each_call(info), its after_call(info, state) is on_trigger(info, "
              "state)), or, if it is a method of the hook's own that the loop is not meant "
              f"to call, list it in {cls.__qualname__}.not_hook_methods")
  return None


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

  def on_trigger(self, info, state):
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

  def after_each_call(self, info: LoopInfo) -> None:
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
