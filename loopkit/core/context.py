"""What a hook reads and what it may return: the one contract between the loop and its hooks.

A hook never writes the loop's state. It reads

* a :class:`~loopkit.core.hooks.LoopInfo` per device call (host values), and
* a :class:`RunContext` in ``on_run_start`` / ``on_run_end`` / ``on_run_error``
  (and kept, if the hook likes, for the rest of the run): a read-only view of
  the run (its ledger, target step, status, data position) with two requests
  the loop acts on at a boundary (:meth:`RunContext.request_stop`, and
  ``ctx.preemption.request()``),

and *returns* what it changes; the run (:mod:`loopkit.core.run`) applies it:

=================================== =====================================================
a hook returns                      the loop
=================================== =====================================================
a state (``on_trigger``,            checks it against the train state (structure,
``on_run_start``, ``on_run_end``)   shapes, dtypes) and places it (one door)
:class:`Restore` (``on_run_start``) takes its state, ledger and data position together and
                                    hands each hook its saved state by the hook's name
:class:`LedgerAdjustment`           applies it to the ledger once, after every
(``adjust_ledger``)                 ``on_run_start`` (e.g. work lost to restarts)
=================================== =====================================================

Hooks' own state in checkpoints is keyed by a stable *hook name*
(:mod:`loopkit.core.hook_state`). Not thread-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from loopkit.core.ledger import Ledger, LedgerView

if TYPE_CHECKING:
  from loopkit.core.preemption import PreemptionWatcher

__all__ = ["LedgerAdjustment", "Restore", "RunContext"]


@dataclasses.dataclass(frozen=True)
class Restore:
  """A restore, returned by ``on_run_start``: state, ledger and data position together.

  Attributes:
    state: the train state to continue from (checked and placed like any state).
    ledger: the :class:`~loopkit.core.ledger.Ledger` at the state's step (its
      ``steps_per_epoch`` is replaced by the loop's).
    data_position: the source position to continue from (see
      :func:`loopkit.data.sources.open_source`), or None for the source's start.
    hook_states: ``{hook name: state}`` to hand to the hooks'
      ``restore_checkpoint_state`` (names from
      :func:`loopkit.core.hook_state.hook_names`; keys of checkpoints written before
      hook names, ``"<index>:<Class>"``, are matched too:
      :func:`loopkit.core.hook_state.match_hook_states`).
  """

  state: Any
  ledger: Ledger
  data_position: Any = None
  hook_states: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class LedgerAdjustment:
  """Accounting a hook adds to the ledger, returned by ``adjust_ledger(ctx)``.

  Attributes:
    lost_steps: the new ``ledger.lost_steps`` (None: unchanged).
    set_seconds: ``{bucket: seconds}`` that replace buckets.
    add_seconds: ``{bucket: seconds}`` added to buckets.
  """

  lost_steps: int | None = None
  set_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
  add_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)

  def apply_to(self, ledger: Ledger) -> None:
    """Applies the adjustment (called by the run only)."""
    if self.lost_steps is not None:
      ledger.lost_steps = int(self.lost_steps)
    for bucket, secs in self.set_seconds.items():
      ledger.seconds[bucket] = float(secs)
    for bucket, secs in self.add_seconds.items():
      ledger.add_time(bucket, float(secs))


class RunContext:
  """A hook's read-only view of the run (what ``on_run_start`` etc. get instead of the loop).

  One per hook and run. Reads are live (the ledger as it is now); assigning any
  attribute raises ``AttributeError`` naming what to return instead.

  Attributes:
    ledger: a :class:`~loopkit.core.ledger.LedgerView` of the run's ledger.
    status: the run's status (None until it ends; see ``TrainLoop.status``).
    target_step: the global step this run ends at.
    steps_per_epoch: the loop's steps per epoch, or None.
    data_position: the source position after the last consumed call.
    preemption: the run's :class:`~loopkit.core.preemption.PreemptionWatcher`
      (``ctx.preemption.request()`` preempts at the next boundary).
    mesh, data_parallel_size, iterations_per_loop, time_based_k: the loop's.
    flops_per_step: FLOPs of one train step on one device, from XLA's cost analysis of the
      executable the run dispatches (:meth:`~loopkit.core.MultiStepProgram.flops_per_step`;
      read after the first call, it compiles nothing), or None (before the first call, or
      where XLA reports none).
    hook_name: this hook's stable name (:func:`loopkit.core.hook_state.hook_names`).
    step_of: the loop's function that reads a state's step counter (``TrainLoop(step_of=)``).
  """

  __slots__ = ("_run", "_index", "_states")
  _run: Any  # the loopkit.core.run.Run
  _index: int
  _states: Callable[[int], dict[str, Any]] | None

  def __init__(self, run: Any, index: int,
               states: Callable[[int], dict[str, Any]] | None = None):
    object.__setattr__(self, "_run", run)
    object.__setattr__(self, "_index", index)
    object.__setattr__(self, "_states", states)

  @property
  def ledger(self) -> LedgerView:
    return self._run.ledger_view

  @property
  def status(self) -> str | None:
    return self._run.status

  @property
  def target_step(self) -> int:
    return self._run.target

  @property
  def steps_per_epoch(self) -> int | None:
    return self._run.steps_per_epoch

  @property
  def data_position(self) -> Any:
    return self._run.data_position

  @property
  def preemption(self) -> PreemptionWatcher:
    return self._run.preemption

  @property
  def mesh(self) -> Any:
    return self._run.config.mesh

  @property
  def data_parallel_size(self) -> int:
    return self._run.config.data_parallel_size

  @property
  def iterations_per_loop(self) -> int:
    return self._run.config.iterations_per_loop

  @property
  def time_based_k(self) -> Any:
    return self._run.config.time_based_k

  @property
  def flops_per_step(self) -> float | None:
    return self._run.program.flops_per_step()

  @property
  def step_of(self) -> Callable[[Any], Any]:
    return self._run.config.step_of

  @property
  def hook_name(self) -> str:
    return self._run.names[self._index]

  def request_stop(self, reason: str = "stopped") -> None:
    """Asks the loop to stop at the next boundary (agreed across processes)."""
    self._run.request_stop(reason)

  def hook_states(self) -> dict[str, Any]:
    """The other hooks' states for a checkpoint, by hook name (for checkpoint hooks).

    The loop first flushes every other hook that has ``flush()`` (their metric
    writers: the rows a checkpoint covers are on disk before it is), then
    collects every other hook's ``checkpoint_state()``.

    Raises:
      TypeError: a ``checkpoint_state()`` that is not JSON-serialisable.
    """
    if self._states is None:
      return {}
    return self._states(self._index)

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError(
        f"hooks may not set {name!r} on the run: the run context is read-only. Return what "
        "changes instead: a new state, a loopkit.core.Restore(state, ledger, data_position) from "
        "on_run_start, or a loopkit.core.LedgerAdjustment from adjust_ledger (docs/concepts.md)")

  def __repr__(self) -> str:
    return f"RunContext(hook={self.hook_name!r}, step={self.ledger.step})"
