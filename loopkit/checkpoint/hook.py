"""Checkpoints with Orbax: exact resume, retention, asynchronous saves.

:class:`CheckpointHook` saves, as one Orbax Composite checkpoint per step, the
four things a run needs to continue exactly where it stopped, and a record of
the state's leaves:

====== ======================================= ====================================
item   content                                 Orbax args
====== ======================================= ====================================
state  the train state (sharded arrays)        ``StandardSave`` / ``StandardRestore``
leaves each leaf's path, shape, dtype          ``JsonSave`` / ``JsonRestore``
       (and PRNG key impl)
ledger :class:`~loopkit.core.ledger.Ledger`    ``JsonSave`` / ``JsonRestore``
data   the data position (see below)           ``JsonSave`` / ``JsonRestore``
hooks  other hooks' ``checkpoint_state``       ``JsonSave`` / ``JsonRestore``
       by hook name
====== ======================================= ====================================

**Leaf kinds.** Every leaf kind round-trips bitwise (tested in a fresh
process, ``tests/test_leaf_kinds.py``): typed PRNG keys (``jax.random.key``, any impl, also inside
Flax NNX ``nnx.Rngs``; Orbax stores their key data and impl and wraps them
back), bool, int8, uint32, int64/uint64 under x64, bfloat16, 0-d, zero-size
(Orbax refuses them: they are saved as None and re-made from the live state's
shape, dtype and sharding) and None leaves.

Step directories are named by the global step (= updates applied = the
state's step = the optimizer's count). Saves are asynchronous: the hook
returns once the arrays are copied off the device, so the next (donating)
call may start while files are written; a save first waits for the previous
one, and ``on_run_end`` waits for the last one. A failed asynchronous save
raises :class:`CheckpointError` at the next boundary (or at run end) and its
partial directory is removed; the hook stays usable and later saves work.
When ``run`` ends by an exception (a hook raised, say),
:meth:`CheckpointHook.on_run_error` first lets the save in
flight commit (or removes it, if it failed), so nothing is written after
``run`` raised and a new hook on the directory resumes.

**Resume.** ``TrainLoop.run`` calls :meth:`CheckpointHook.on_run_start`, which
restores the latest complete checkpoint, if any (the checkpoint wins over the
state passed in, like TPUEstimator's ``model_dir``): the state is restored
into the live state's tree structure and shardings (so a run may resume on a
different number of devices, and the program is not recompiled; the state given
to ``run`` may be abstract, ``jax.eval_shape(init)``: only the restored arrays are
allocated) and returned
with its ledger, data position and hooks' states as one
:class:`~loopkit.core.context.Restore`; the loop applies it and hands each hook its
state by name (checkpoints keyed ``"<index>:<Class>"``, written before hook
names, still restore: see :func:`loopkit.core.hook_state.match_hook_states`). A
checkpoint whose tree, shapes or dtypes differ from the live state raises
``ValueError`` naming every differing leaf (``params/head/bias``: the syntax of warm-start
patterns) before anything changes.

**Warm start.** With ``init_from`` (a :class:`~loopkit.checkpoint.warm.WarmStart`) and no
checkpoint of its own to resume from, ``on_run_start`` returns the state with chosen leaves
of another checkpoint (:func:`loopkit.checkpoint.warm.warm_start`); once the run has saved,
a restart resumes from its own checkpoints.

**Complete or invisible.** A step directory counts only if Orbax finalized it
(it holds ``commit_success.txt``, written last in both of Orbax's atomicity
modes). When the hook opens a directory it deletes what is evidently its own
unfinished write (e.g. from a kill): ``<step>.orbax-checkpoint-tmp*`` (Orbax's
atomic-rename mode, used on local disks), or a ``<step>`` directory without
the commit file that holds nothing but loopkit's items and Orbax's
``_CHECKPOINT_METADATA`` (commit-file mode, used on GCS, writes in place; a
kill during a retention delete leaves part of a checkpoint). It never deletes
anything else: another digit-named folder (a user's ``5``, an older
Orbax's complete checkpoint without the commit file, an empty folder) is left
in place, not read, and a save at its step is skipped,
with a :class:`CheckpointWarning`; so are other programs' checkpoints, e.g.
``checkpoint_50`` from ``flax.training.checkpoints``. Only one run
may write a directory: ``on_run_start`` refuses an unwritable directory and one
whose lock another live run holds, before any step
(:mod:`loopkit.checkpoint.lock`); a failed save removes its
partial directory.

**Data position.** The position stored is ``LoopInfo.data_position``: the
source's position after the last *consumed* chunk, never a prefetched one.
It is an int (a counted skip for plain iterables, or the next step
for ``batch_at(step)`` sources) or the iterator's own ``get_state()`` (Grain);
see :func:`loopkit.data.sources.open_source`. States must be JSON-serialisable or
``bytes``. On several processes each process's position is gathered and saved.

**Retention.** ``max_to_keep`` keeps the newest N; ``keep_best`` additionally
keeps the best N by ``best_metric``. The newest checkpoint is always kept
(Orbax's own ``best_fn`` + ``max_to_keep`` may delete it). Two tiers
(:mod:`loopkit.checkpoint.tiers`): ``keep_every_steps`` / ``keep_steps`` add
permanent checkpoints, saved at those steps and never deleted, beside the
temporary ones of the cadence (the newest ``max_to_keep``, default 1 then).
A retention delete first renames the step out of the step namespace
(:mod:`loopkit.checkpoint.files`), so a kill during it leaves no partial step.

**Completion.** A run that reaches its target (status ``"completed"``) writes
``TRAIN_COMPLETE`` in the directory once its last save committed; each run's
start removes it. An evaluation sidecar (:mod:`loopkit.tools.follower`)
stops there.

Multi-host: every process runs the hook (Orbax coordinates the writes); the
directory must be shared. Not thread-safe.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from loopkit._internal.extras import missing

try:
  import orbax.checkpoint as ocp
  from etils import epath
except ImportError as e:
  raise missing(e, "loopkit.checkpoint") from e

from loopkit.checkpoint.directory import CheckpointDirectory, CheckpointWarning, RestoredCheckpoint
from loopkit.checkpoint.files import (
  _COMMIT_FILE,
  _clear_complete_marker,
  _drain_writers,
  _TrashEmptier,
  _empty_trash,
  _remove_failed_save,
  _TMP_MARK,
  _write_complete_marker,
)
from loopkit.checkpoint.items import _encode_positions, _leaf_record, _storable
from loopkit.checkpoint.lock import DirectoryLock, claim
from loopkit.checkpoint.tiers import check_permanent, with_permanent_marks
from loopkit.checkpoint.warm import WarmStart
from loopkit.core.context import Restore, RunContext
from loopkit.core.hooks import Hook, LoopInfo
from loopkit.core.ledger import Bucket, Ledger

log = logging.getLogger("loopkit")

__all__ = ["CheckpointError", "CheckpointHook", "CheckpointWarning", "RestoredCheckpoint"]

class CheckpointError(RuntimeError):
  """A checkpoint save failed (the message names the step and directory), or the
  directory cannot be used at run start (unwritable, or in use by another run)."""


class CheckpointHook(Hook, CheckpointDirectory):
  """Saves checkpoints at exact steps and resumes the run from the latest.

  Example:
    >>> ckpt = loopkit.CheckpointHook(workdir, every_steps=1000, max_to_keep=3)  # doctest: +SKIP
    >>> loop = loopkit.TrainLoop(step, iterations_per_loop=100, hooks=[ckpt])   # doctest: +SKIP
    >>> state = loop.run(state, batches, num_steps=10_000)  # resumes if killed  # doctest: +SKIP

  Args:
    directory: root directory (local path or any ``etils.epath`` path); created
      if missing. One step directory per checkpoint, named by the step. A
      relative local path (or one starting with ``~``) is resolved here, at
      construction, against the current working directory: ``self.directory``
      is absolute (Orbax needs it so) and a later ``os.chdir`` does not move it.
    every_steps, every_epochs, at_steps, every_secs: when to save (see
      :class:`loopkit.core.triggers.Trigger`); the planner cuts device calls so step
      marks land exactly. The final step of a run, an early stop and a
      preemption are always saved; with none set, only those are. With a
      permanent tier these saves are the temporary tier.
    max_to_keep: keep the newest N checkpoints (None: keep all; 1 when
      ``keep_best``, ``keep_every_steps`` or ``keep_steps`` is set). Counted
      over both tiers, as Orbax's ``max_to_keep`` with ``keep_period``.
    keep_every_steps: permanent tier: also save at every multiple of this
      many steps (int > 0) and never delete those checkpoints.
    keep_steps: permanent tier: also save at these steps (ints > 0) and
      never delete those checkpoints.
    best_metric: name of a metric in ``LoopInfo.metrics`` (the values of the
      call that ends at the saved step) used to rank checkpoints.
    best_mode: ``"min"`` (lower is better, e.g. a loss) or ``"max"``.
    keep_best: also keep the best N checkpoints by ``best_metric``; the newest
      ``max_to_keep`` (default 1 when ``keep_best`` is set) are kept too.
    async_save: write in background threads (Orbax async checkpointing).
    restore: restore the latest checkpoint at the start of each ``run``.
    init_from: a warm start (:class:`~loopkit.checkpoint.warm.WarmStart`, or a
      checkpoint path for ``WarmStart(path)``: its ``params``), applied at
      ``run`` start only when the run does not resume from ``directory``'s own
      checkpoint (none there yet, or ``restore=False``): a warm-started run
      that is killed resumes from its own checkpoints, not from the source.
      The ledger starts at the warm-started state's step (the step of the
      state passed to ``run``, unless the warm start reads the step counter).

  Raises:
    ValueError: ``max_to_keep`` or ``keep_best`` < 1, ``keep_best`` without
      ``best_metric``, ``best_mode`` not in ``("min", "max")``, or a
      ``keep_every_steps`` or ``keep_steps`` entry that is not a whole number
      of steps > 0 (naming the value).
    TypeError: ``init_from`` neither a path nor a ``WarmStart``.
    FileNotFoundError: ``init_from``'s source path does not exist while ``directory``
      holds no checkpoint to resume from (``restore=True``).

  At ``run`` start (:meth:`on_run_start`), before any step, the hook raises
  :class:`CheckpointError` naming the directory if it is not writable (and
  why), or if another live run holds its lock (naming that run's host, pid and
  start time); see :mod:`loopkit.checkpoint.lock`.

  Attributes:
    directory: the absolute checkpoint directory (an ``epath.Path``).
    restored_step: step restored by the last ``on_run_start`` (None if none).
    warm_started: what the last ``on_run_start`` read from ``init_from`` (a
      line naming the source, step and leaves read and kept), or None.
    saved_steps: steps this hook saved, in order (this process's view).
    keep_every_steps, keep_steps: the permanent tier (None and ``()`` if none;
      ``keep_steps`` sorted).
  """

  needs_state = True
  time_bucket = Bucket.CHECKPOINT

  def __init__(self, directory: str | epath.PathLike, *, every_steps: int | None = None,
               every_epochs: float | None = None, at_steps: Sequence[int] | None = None,
               every_secs: float | None = None, max_to_keep: int | None = None,
               best_metric: str | None = None, best_mode: str = "min",
               keep_best: int | None = None, async_save: bool = True, restore: bool = True,
               keep_every_steps: int | None = None, keep_steps: Sequence[int] | None = None,
               init_from: str | os.PathLike | WarmStart | None = None):
    if every_steps is None and every_epochs is None and every_secs is None and at_steps is None:
      at_steps = ()  # no cadence: save only at the end of a run (and at a preemption)
    super().__init__(every_steps=every_steps, every_epochs=every_epochs, at_steps=at_steps,
                     every_secs=every_secs, at_end=True)
    self.keep_every_steps, self.keep_steps = check_permanent(keep_every_steps, keep_steps)
    self.trigger = with_permanent_marks(self.trigger, self.keep_every_steps, self.keep_steps)
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
    if keep_best is not None:
      if keep_best < 1:
        raise ValueError(f"keep_best must be >= 1 or None, got {keep_best}")
      if best_metric is None:
        raise ValueError("keep_best needs best_metric (the metric that ranks checkpoints)")
    if best_mode not in ("min", "max"):
      raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    path = epath.Path(directory)
    if "://" not in str(path) and not path.is_absolute():  # resolved once, here
      path = epath.Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    self.directory = path
    self._lock = DirectoryLock(self.directory)
    self._trash = _TrashEmptier(self.directory)
    self.max_to_keep = max_to_keep
    self.best_metric = best_metric
    self.best_mode = best_mode
    self.keep_best = keep_best
    self.async_save = async_save
    self.restore_on_start = restore
    self.restored_step: int | None = None
    self.saved_steps: list[int] = []
    # How an error about init_from writes the argument it suggests: the hook's own argument.
    self._init_from_written = "..."
    if init_from is not None and not isinstance(init_from, WarmStart):
      if not isinstance(init_from, (str, os.PathLike)):
        raise TypeError(f"init_from takes a checkpoint path or a loopkit.checkpoint.WarmStart, "
                        f"got {type(init_from).__name__}")
      self._init_from_written = repr(os.fspath(init_from))
      init_from = WarmStart(init_from)
    self.init_from: WarmStart | None = init_from
    self._check_init_from_source()
    self.warm_started: str | None = None
    self._manager: ocp.CheckpointManager | None = None
    self._ctx: RunContext | None = None
    self._in_flight: int | None = None
    self._warned: set[str] = set()

  def _check_init_from_source(self) -> None:
    """Refuses, when the hook is built, an ``init_from`` path that does not exist while this
    directory holds no checkpoint to resume from (a run would find it only at its start)."""
    source = self.init_from.source if self.init_from is not None else None
    if not isinstance(source, (str, os.PathLike)):
      return
    path = epath.Path(source)
    if "://" not in str(path):
      path = epath.Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    if path.exists():
      return
    own = self.restore_on_start and self.directory.exists() and any(
        p.name.isdigit() and _TMP_MARK not in p.name for p in self.directory.iterdir())
    if not own:
      instead = (f", and {self.directory} holds no checkpoint to resume from instead"
                 if self.restore_on_start else "")
      raise FileNotFoundError(f"CheckpointHook(init_from=...): the warm-start source {path} "
                              f"does not exist{instead}")

  def _spell_init_from(self, argument: str) -> str:
    """An argument a warm-start error suggests, as this hook takes it (``init_from=``)."""
    return f"init_from=loopkit.checkpoint.WarmStart({self._init_from_written}, {argument})"

  def close(self) -> None:
    """Waits for the last write (raising :class:`CheckpointError` if it failed)
    and releases the Orbax manager; the hook reopens it when used again."""
    if self._manager is None:
      return
    try:
      self.wait_until_finished()
    finally:
      self._trash.join()
      manager, self._manager = self._manager, None
      try:
        manager.close()
      except Exception:  # pylint: disable=broad-except  # already reported above
        log.exception("closing the checkpoint manager failed")

  # -- save ------------------------------------------------------------------

  def wait_until_finished(self) -> None:
    """Blocks until the last asynchronous save is written.

    Raises:
      CheckpointError: that save failed (its step directory stays unfinished
        and is removed when the directory is next opened).
    """
    if self._manager is None or self._in_flight is None:
      return
    step, self._in_flight = self._in_flight, None
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      self._discard(step)
      raise CheckpointError(f"asynchronous save of step {step} to {self.directory} failed: "
                            f"{type(e).__name__}: {e}") from e
    self._trash.start()  # removes the steps this save's retention deleted

  def _discard(self, step: int) -> None:
    """After a failed save: waits for its writers, then removes its unfinished directory."""
    assert self._manager is not None
    _drain_writers(self._manager)
    _remove_failed_save(self.directory, step)

  def _check_in_flight(self) -> None:
    """Raises a finished save's error without waiting for a running save."""
    if (self._manager is not None and self._in_flight is not None
        and not self._manager.is_saving_in_progress()):
      self.wait_until_finished()

  def save(self, step: int, state: Any, *, ledger: Ledger, data_position: Any = None,
           metrics: dict[str, float] | None = None,
           hook_states: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None
           ) -> bool:
    """Starts saving one checkpoint (returns once the arrays are off the device).

    Args:
      step: the global step (updates applied); must equal ``ledger.step``.
      state: the train state pytree (``jax.Array`` leaves, any shardings).
      ledger: the host ledger at ``step``.
      data_position: the source position after the step's batch.
      metrics: values for ranking (needs ``best_metric`` among them when set).
      hook_states: ``{hook name: JSON-serialisable state}`` of other hooks, or
        a function returning it, called only when the save is written (inside
        a run, ``RunContext.hook_states``: a skipped save collects nothing).

    Returns:
      False if a checkpoint at ``step`` already exists (nothing written).

    Raises:
      CheckpointError: the previous asynchronous save failed, or this one
        could not start.
      ValueError: ``ledger.step != step`` or ``best_metric`` missing.
      TypeError: a data position that is not JSON-serialisable.
    """
    if ledger.step != step:
      raise ValueError(f"ledger step {ledger.step} != checkpoint step {step}")
    manager = self._open()
    self.wait_until_finished()
    self._trash.join()
    _empty_trash(self.directory)  # Orbax's renames into the trash need the names free
    if step in manager.all_steps():  # e.g. a finished run run again: at_end saves its last step
      log.info("checkpoint %d in %s is already saved (%s): not written again", step,
               self.directory, "this run resumed from it" if step == self.restored_step else
               "an earlier run wrote it")
      return False
    if (self.directory / str(step)).exists():  # a folder loopkit did not write (see _tidy)
      warnings.warn(f"loopkit: not saving step {step}: {self.directory / str(step)} exists "
                    f"and is not a loopkit checkpoint (no {_COMMIT_FILE}); it is left as it is",
                    CheckpointWarning, stacklevel=2)
      return False
    ranked = None
    if self.best_metric is not None:
      if not metrics or self.best_metric not in metrics:
        raise ValueError(f"best_metric {self.best_metric!r} is not among the metrics "
                         f"{sorted(metrics or {})}")
      ranked = {self.best_metric: float(metrics[self.best_metric])}
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(_storable(state)),
        leaves=ocp.args.JsonSave(_leaf_record(state)),
        ledger=ocp.args.JsonSave(ledger.to_dict()),
        data=ocp.args.JsonSave(_encode_positions(data_position)),
        hooks=ocp.args.JsonSave(dict((hook_states() if callable(hook_states)
                                      else hook_states) or {})))
    log.info("saving checkpoint %d in %s", step, self.directory)  # the first takes seconds
    try:
      manager.save(step, args=args, metrics=ranked, force=True)
    except Exception as e:  # pylint: disable=broad-except
      self._discard(step)
      raise CheckpointError(f"saving step {step} to {self.directory} failed: "
                            f"{type(e).__name__}: {e}") from e
    self._in_flight = step
    self.saved_steps.append(step)
    return True

  # -- Hook protocol ---------------------------------------------------------

  def on_run_start(self, ctx: RunContext, state: Any) -> Restore | Any:
    """Claims the directory, opens it; returns the latest checkpoint, if any, as a Restore.

    Returns:
      None (no checkpoint, or ``restore=False``) or a
      :class:`~loopkit.core.context.Restore` of the state, ledger, data position
      and other hooks' states, which the loop applies. Without a checkpoint
      to resume from, with ``init_from``: the warm-started state (a Restore
      with a ledger at its step if it read the step counter).

    Raises:
      CheckpointError: the directory is not writable, or another live run
        holds it (on every process alike: see :func:`loopkit.checkpoint.lock.claim`).
    """
    self._ctx = ctx
    self.restored_step = None
    if self._manager is not None:  # a previous run ended by an exception
      try:
        self.close()
      except CheckpointError as e:
        log.warning("%s", e)
    problem = claim(self.directory, self._lock)
    if problem is not None:
      raise CheckpointError(problem)
    log.info("checkpoints in %s", self.directory)
    try:
      restore = self._resume(state)
      _clear_complete_marker(self.directory)  # this run trains on: not complete until it says so
      return restore
    except BaseException:
      self._lock.release()
      raise

  def _resume(self, state: Any) -> Restore | Any:
    self._open()
    self.warm_started = None
    if not self.restore_on_start or self.latest_step() is None:
      return None if self.init_from is None else self._warm_start(state)
    r = self.restore(state)
    self.restored_step = r.step
    log.info("resumed from checkpoint %d in %s", r.step, self.directory)
    return Restore(state=r.state, ledger=r.ledger, data_position=r.data_position,
                   hook_states=r.hook_states)

  def _warm_start(self, state: Any) -> Restore | Any:
    """``init_from`` applied to ``state``; a Restore with a new ledger if it read the step."""
    assert self.init_from is not None and self._ctx is not None
    new, self.warm_started = self.init_from.run(state, spell=self._spell_init_from)
    step = int(jax.device_get(self._ctx.step_of(new)))
    if step == self._ctx.ledger.step:
      return new
    return Restore(state=new, ledger=Ledger(step=step, steps_per_epoch=self._ctx.steps_per_epoch))

  def after_each_call(self, info: LoopInfo) -> None:
    """Raises the error of an asynchronous save that has failed meanwhile."""
    self._check_in_flight()

  def on_trigger(self, info: LoopInfo, state: Any) -> None:
    """Saves the state at ``info.end_step`` (asynchronously).

    The ledger saved is the run's (read through the context); the other hooks'
    states come from ``ctx.hook_states()``, for which the loop first flushes
    every other hook with ``flush()`` (the rows this checkpoint covers are on
    disk before it is).
    """
    ctx = self._ctx
    ledger = ctx.ledger.copy() if ctx is not None else None
    if ledger is None or ledger.step != info.end_step:
      ledger = Ledger(step=info.end_step, examples_seen=info.examples_seen,
                      loop_index=info.loop_index + 1,
                      steps_per_epoch=ctx.steps_per_epoch if ctx is not None else None,
                      skipped_steps=info.skipped_steps)
    self.save(info.end_step, state, ledger=ledger, data_position=info.data_position,
              metrics=info.metrics, hook_states=ctx.hook_states if ctx is not None else None)
    return None

  def on_run_end(self, ctx: RunContext, state: Any) -> None:
    """Waits for the last write (raises :class:`CheckpointError` if it failed); releases
    the directory's lock.

    A run that completed (``ctx.status == "completed"``: its target reached) then writes the
    marker ``TRAIN_COMPLETE`` (``{"step": N, "status": "completed"}``) in the directory,
    where an evaluation sidecar (:mod:`loopkit.tools.follower`) stops; a preempted,
    stopped or failed run writes none, and the next run's start removes an old one.
    """
    try:
      self.close()
      if ctx.status == "completed":
        _write_complete_marker(self.directory, ctx.ledger.step)
    finally:
      self._lock.release()
    return None

  def on_run_error(self, ctx: RunContext, error: BaseException) -> None:
    """The run ends by ``error``: lets the in-flight save commit, then releases the directory.

    If that save fails too, its failure is logged (``error`` is what ``run``
    raises) and its unfinished directory is removed (on several processes once
    every process got there, or at the next run's start: see
    :func:`loopkit.checkpoint.files._remove_failed_save`), so that a new hook on
    the directory (in this process or another) resumes from the last committed
    step. Then the directory's lock is released.
    """
    try:
      self.close()
    except CheckpointError as e:
      log.warning("while the run raised %s: %s", type(error).__name__, e)
    finally:
      self._lock.release()
