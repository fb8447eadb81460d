"""Checkpoints with Orbax: exact resume, retention, asynchronous saves.

:class:`CheckpointHook` saves, as one Orbax Composite checkpoint per step, the
four things a run needs to continue exactly where it stopped, and a record of
the state's leaves:

====== ================================= ====================================
item   content                           Orbax args
====== ================================= ====================================
state  the train state (sharded arrays)  ``StandardSave`` / ``StandardRestore``
leaves each leaf's path, shape, dtype    ``JsonSave`` / ``JsonRestore``
       (and PRNG key impl)
ledger :class:`~loopkit.ledger.Ledger`   ``JsonSave`` / ``JsonRestore``
data   the data position (see below)     ``JsonSave`` / ``JsonRestore``
hooks  other hooks' ``checkpoint_state`` ``JsonSave`` / ``JsonRestore``
====== ================================= ====================================

**Leaf kinds.** Every leaf kind round-trips bitwise (case C28, tested in a
fresh process): typed PRNG keys (``jax.random.key``, any impl, also inside
Flax NNX ``nnx.Rngs``; Orbax stores their key data and impl and wraps them
back), bool, int8, uint32, int64/uint64 under x64, bfloat16, 0-d, zero-size
(Orbax refuses them: they are saved as None and re-made from the live state's
shape, dtype and sharding) and None leaves.

Step directories are named by the global step (= updates applied = the
state's step = the optimizer's count). Saves are asynchronous: the hook
returns once the arrays are copied off the device, so the next (donating)
call may start while files are written; a save first waits for the previous
one, and ``on_run_end`` waits for the last one. A failed asynchronous save
raises :class:`CheckpointError` at the next boundary (or at run end); the hook
stays usable and later saves work. When ``run`` ends by an exception (a hook
raised, say), :meth:`CheckpointHook.on_run_error` first lets the save in
flight commit (or removes it, if it failed), so nothing is written after
``run`` raised and a new hook on the directory resumes (case C33).

**Resume.** ``TrainLoop.run`` calls :meth:`CheckpointHook.on_run_start`, which
restores the latest complete checkpoint, if any (the checkpoint wins over the
state passed in, like TPUEstimator's ``model_dir``): the state is restored
into the live state's tree structure and shardings (so a run may resume on a
different number of devices, and the program is not recompiled), the loop's
ledger and data position are set, and hooks' states are handed back. A
checkpoint whose tree, shapes or dtypes differ from the live state raises
``ValueError`` naming the first differing leaf before anything changes.

**Complete or invisible.** A step directory counts only if Orbax finalized it
(it holds ``commit_success.txt``, written last in both of Orbax's atomicity
modes). When the hook opens a directory it deletes what is evidently its own
unfinished write (e.g. from a kill): ``<step>.orbax-checkpoint-tmp*`` (Orbax's
atomic-rename mode, used on local disks), or a ``<step>`` directory without
the commit file that holds nothing but loopkit's items and Orbax's
``_CHECKPOINT_METADATA`` (commit-file mode, used on GCS, writes in place; a
kill during a retention delete leaves part of a checkpoint). It never deletes
anything else (case C35): another digit-named folder (a user's ``5``, an older
Orbax's complete checkpoint without the commit file, an empty folder) is left
in place, not read, and a save at its step is skipped,
with a :class:`CheckpointWarning`; so are other programs' checkpoints, e.g.
``checkpoint_50`` from ``flax.training.checkpoints`` (case C41). Only one run
may write a directory.

**Data position.** The position stored is ``LoopInfo.data_position``: the
source's position after the last *consumed* chunk, never a prefetched one
(case C25). It is an int (a counted skip for plain iterables, or the next step
for ``batch_at(step)`` sources) or the iterator's own ``get_state()`` (Grain);
see :func:`loopkit.feeding.open_source`. States must be JSON-serialisable or
``bytes``. On several processes each process's position is gathered and saved.

**Retention.** ``max_to_keep`` keeps the newest N; ``keep_best`` additionally
keeps the best N by ``best_metric``. The newest checkpoint is always kept
(Orbax's own ``best_fn`` + ``max_to_keep`` may delete it, case C19).

Multi-host: every process runs the hook (Orbax coordinates the writes); the
directory must be shared. Not thread-safe.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
import re
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loopkit import compat
from loopkit.extras import missing

try:
  import orbax.checkpoint as ocp
  from etils import epath
  from orbax.checkpoint import checkpoint_managers as ocp_managers
except ImportError as e:
  raise missing(e, "loopkit.checkpoint") from e

from loopkit.hooks import Hook, LoopInfo
from loopkit.ledger import Ledger

log = logging.getLogger("loopkit")

__all__ = ["CheckpointError", "CheckpointHook", "CheckpointWarning", "RestoredCheckpoint"]

_COMMIT_FILE = "commit_success.txt"
_STEP_METADATA = "_CHECKPOINT_METADATA"  # Orbax's step metadata (written when a save starts)
_TMP_MARK = ".orbax-checkpoint-tmp"
_ITEMS = ("state", "ledger", "data", "hooks", "leaves")
# A name that looks like someone else's checkpoint: flax.training.checkpoints'
# "checkpoint_50", TensorFlow's "ckpt-100.index", an Orbax manager with a step prefix.
_FOREIGN_CHECKPOINT = re.compile(r"(checkpoint|ckpt)\D{0,3}\d+", re.IGNORECASE)


class CheckpointError(RuntimeError):
  """A checkpoint save failed (the message names the step and directory)."""


class CheckpointWarning(UserWarning):
  """The checkpoint directory holds files loopkit did not write and leaves alone."""


@dataclasses.dataclass(frozen=True)
class RestoredCheckpoint:
  """What :meth:`CheckpointHook.restore` read.

  Attributes:
    step: the checkpoint's step (updates applied).
    state: the train state, with the tree structure and shardings of ``like``.
    ledger: the saved :class:`~loopkit.ledger.Ledger`.
    data_position: this process's data position (int, iterator state or None).
    hook_states: ``{"<index>:<HookClass>": state}`` of the hooks that had one.
  """

  step: int
  state: Any
  ledger: Ledger
  data_position: Any
  hook_states: dict[str, Any]


class CheckpointHook(Hook):
  """Saves checkpoints at exact steps and resumes the run from the latest.

  Example:
    >>> ckpt = loopkit.CheckpointHook(workdir, every_steps=1000, max_to_keep=3)  # doctest: +SKIP
    >>> loop = loopkit.TrainLoop(step, iterations_per_loop=100, hooks=[ckpt])   # doctest: +SKIP
    >>> state = loop.run(state, batches, num_steps=10_000)  # resumes if killed  # doctest: +SKIP

  Args:
    directory: root directory (local path or any ``etils.epath`` path); created
      if missing. One step directory per checkpoint, named by the step.
    every_steps, every_epochs, at_steps, every_secs: when to save (see
      :class:`loopkit.triggers.Trigger`); the planner cuts device calls so step
      marks land exactly. The final step of a run, an early stop and a
      preemption are always saved; with none set, only those are.
    max_to_keep: keep the newest N checkpoints (None: keep all).
    best_metric: name of a metric in ``LoopInfo.metrics`` (the values of the
      call that ends at the saved step) used to rank checkpoints.
    best_mode: ``"min"`` (lower is better, e.g. a loss) or ``"max"``.
    keep_best: also keep the best N checkpoints by ``best_metric``; the newest
      ``max_to_keep`` (default 1 when ``keep_best`` is set) are kept too.
    async_save: write in background threads (Orbax async checkpointing).
    restore: restore the latest checkpoint at the start of each ``run``.

  Raises:
    ValueError: ``max_to_keep`` or ``keep_best`` < 1, ``keep_best`` without
      ``best_metric``, or ``best_mode`` not in ``("min", "max")``.

  Attributes:
    restored_step: step restored by the last ``on_run_start`` (None if none).
    saved_steps: steps this hook saved, in order (this process's view).
  """

  needs_state = True
  time_bucket = "checkpoint"

  def __init__(self, directory: str | epath.PathLike, *, every_steps: int | None = None,
               every_epochs: float | None = None, at_steps: Sequence[int] | None = None,
               every_secs: float | None = None, max_to_keep: int | None = None,
               best_metric: str | None = None, best_mode: str = "min",
               keep_best: int | None = None, async_save: bool = True, restore: bool = True):
    if every_steps is None and every_epochs is None and every_secs is None and at_steps is None:
      at_steps = ()  # no cadence: save only at the end of a run (and at a preemption)
    super().__init__(every_steps=every_steps, every_epochs=every_epochs, at_steps=at_steps,
                     every_secs=every_secs, at_end=True)
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
    if keep_best is not None:
      if keep_best < 1:
        raise ValueError(f"keep_best must be >= 1 or None, got {keep_best}")
      if best_metric is None:
        raise ValueError("keep_best needs best_metric (the metric that ranks checkpoints)")
    if best_mode not in ("min", "max"):
      raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    self.directory = epath.Path(directory)
    self.max_to_keep = max_to_keep
    self.best_metric = best_metric
    self.best_mode = best_mode
    self.keep_best = keep_best
    self.async_save = async_save
    self.restore_on_start = restore
    self.restored_step: int | None = None
    self.saved_steps: list[int] = []
    self._manager: ocp.CheckpointManager | None = None
    self._loop: Any = None
    self._in_flight: int | None = None
    self._warned: set[str] = set()

  # -- manager ---------------------------------------------------------------

  def _options(self) -> ocp.CheckpointManagerOptions:
    latest = ocp_managers.LatestN(
        n=self.max_to_keep if self.max_to_keep or not self.keep_best else 1)
    policies: list[Any] = [latest]
    if self.keep_best:
      policies.append(ocp_managers.BestN(
          get_metric_fn=self._metric_of, reverse=self.best_mode == "min", n=self.keep_best,
          keep_checkpoints_without_metrics=True))
    # A step is one Orbax committed: a digit-named directory holding commit_success.txt
    # (written last in both of Orbax's atomicity modes). By default Orbax takes *any*
    # digit-named directory on a local disk as a step (and would restore or delete a
    # user's folder "5"); validating with the commit-file class makes it look for the file.
    # Unfinished writes are removed by _tidy, not by Orbax's cleanup_tmp_directories
    # (which on GCS deletes every digit-named directory without the file).
    name_format = ocp.step.standard_name_format(
        temporary_path_cls=ocp.path.atomicity.CommitFileTemporaryPath)
    return ocp.CheckpointManagerOptions(
        enable_async_checkpointing=self.async_save,
        preservation_policy=ocp_managers.AnyPreservationPolicy(policies),
        best_fn=self._metric_of if self.best_metric else None,
        best_mode=self.best_mode, step_name_format=name_format,
        cleanup_tmp_directories=False, create=True)

  def _metric_of(self, metrics: dict[str, Any]) -> float:
    return float(metrics[self.best_metric])

  def _open(self) -> ocp.CheckpointManager:
    if self._manager is None:
      for message in _tidy(self.directory):
        if message not in self._warned:  # once per hook, not at every reopening
          self._warned.add(message)
          warnings.warn(message, CheckpointWarning, stacklevel=3)
      handlers: dict[str, Any] = {name: ocp.JsonCheckpointHandler() for name in _ITEMS}
      handlers["state"] = ocp.StandardCheckpointHandler()
      self._manager = ocp.CheckpointManager(self.directory, options=self._options(),
                                            item_handlers=handlers)
    return self._manager

  def close(self) -> None:
    """Waits for the last write (raising :class:`CheckpointError` if it failed)
    and releases the Orbax manager; the hook reopens it when used again."""
    if self._manager is None:
      return
    try:
      self.wait_until_finished()
    finally:
      manager, self._manager = self._manager, None
      try:
        manager.close()
      except Exception:  # pylint: disable=broad-except  # already reported above
        log.exception("closing the checkpoint manager failed")

  # -- queries ---------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints in the directory, ascending."""
    manager = self._open()
    manager.reload()
    return sorted(manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    """The best checkpoint by ``best_metric`` (the newest if no metric is set)."""
    manager = self._open()
    manager.reload()
    return manager.best_step()

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
      _drain_writers(self._manager)
      raise CheckpointError(f"asynchronous save of step {step} to {self.directory} failed: "
                            f"{type(e).__name__}: {e}") from e

  def _check_in_flight(self) -> None:
    """Raises a finished save's error without waiting for a running save."""
    if (self._manager is not None and self._in_flight is not None
        and not self._manager.is_saving_in_progress()):
      self.wait_until_finished()

  def save(self, step: int, state: Any, *, ledger: Ledger, data_position: Any = None,
           metrics: dict[str, float] | None = None) -> bool:
    """Starts saving one checkpoint (returns once the arrays are off the device).

    Args:
      step: the global step (updates applied); must equal ``ledger.step``.
      state: the train state pytree (``jax.Array`` leaves, any shardings).
      ledger: the host ledger at ``step``.
      data_position: the source position after the step's batch.
      metrics: values for ranking (needs ``best_metric`` among them when set).

    Returns:
      False if a checkpoint at ``step`` already exists (nothing written).

    Raises:
      CheckpointError: the previous asynchronous save failed, or this one
        could not start.
      ValueError: ``ledger.step != step`` or ``best_metric`` missing.
      TypeError: a data position or hook state that is not JSON-serialisable.
    """
    if ledger.step != step:
      raise ValueError(f"ledger step {ledger.step} != checkpoint step {step}")
    manager = self._open()
    self.wait_until_finished()
    if step in manager.all_steps():
      log.info("checkpoint %d already exists in %s", step, self.directory)
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
        hooks=ocp.args.JsonSave(self._hook_states()))
    try:
      manager.save(step, args=args, metrics=ranked, force=True)
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"saving step {step} to {self.directory} failed: "
                            f"{type(e).__name__}: {e}") from e
    self._in_flight = step
    self.saved_steps.append(step)
    return True

  def _hook_states(self) -> dict[str, Any]:
    states = {}
    for key, h in self._other_hooks():
      get = getattr(h, "checkpoint_state", None)
      if callable(get):
        value = get()
        _check_json(value, f"checkpoint_state() of hook {key}")
        states[key] = value
    return states

  def _other_hooks(self) -> list[tuple[str, Hook]]:
    hooks = getattr(self._loop, "hooks", ()) if self._loop is not None else ()
    return [(f"{i}:{type(h).__name__}", h) for i, h in enumerate(hooks) if h is not self]

  # -- restore ---------------------------------------------------------------

  def restore(self, like: Any, step: int | None = None) -> RestoredCheckpoint:
    """Reads a checkpoint into the structure and shardings of ``like``.

    Args:
      like: a state pytree whose leaves are ``jax.Array`` or
        ``jax.ShapeDtypeStruct`` (with ``sharding`` for where to put them);
        the restored state has exactly this tree structure (no list/tuple or
        namedtuple drift in optimizer states).
      step: the step to read (default: the latest).

    Returns:
      The :class:`RestoredCheckpoint`.

    Raises:
      FileNotFoundError: no (such) complete checkpoint.
      ValueError: the checkpoint's tree, shapes or dtypes differ from
        ``like`` (naming the first differing leaf), or its data positions were
        saved by a different number of processes.
    """
    manager = self._open()
    manager.reload()
    steps = manager.all_steps()
    if step is None:
      step = max(steps) if steps else None
    if step is None or step not in steps:
      raise FileNotFoundError(f"no complete checkpoint{'' if step is None else f' {step}'} "
                              f"in {self.directory} (found {sorted(steps)})")
    if (self.directory / str(step) / "leaves").exists():
      saved = _leaves_from_record(manager.restore(step, args=ocp.args.Composite(
          leaves=ocp.args.JsonRestore()))["leaves"])
    else:  # written before loopkit recorded its leaves: Orbax's metadata
      meta = manager.item_metadata(step)["state"]
      saved = _leaves_from_orbax(getattr(meta, "tree", meta))
    problem = _tree_difference(saved, like)
    if problem:
      raise ValueError(f"checkpoint {step} in {self.directory} does not match the train "
                       f"state: {problem}")
    abstract = jax.tree.map(lambda x: None if _is_empty(x) else _abstract(x), like)
    out = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), ledger=ocp.args.JsonRestore(),
        data=ocp.args.JsonRestore(), hooks=ocp.args.JsonRestore()))
    state = _into_structure(out["state"], like)
    ledger = Ledger.from_dict(out["ledger"])
    if ledger.step != step:
      raise ValueError(f"checkpoint {step} in {self.directory} holds a ledger at step "
                       f"{ledger.step}")
    return RestoredCheckpoint(step=step, state=state, ledger=ledger,
                              data_position=_decode_positions(out["data"]),
                              hook_states=dict(out["hooks"] or {}))

  # -- Hook protocol ---------------------------------------------------------

  def on_run_start(self, loop: Any, state: Any) -> Any | None:
    """Opens the directory and restores the latest checkpoint, if any."""
    self._loop = loop
    self.restored_step = None
    if self._manager is not None:  # a previous run ended by an exception
      try:
        self.close()
      except CheckpointError as e:
        log.warning("%s", e)
    self._open()
    if not self.restore_on_start or self.latest_step() is None:
      return None
    r = self.restore(state)
    steps_per_epoch = loop.ledger.steps_per_epoch if loop.ledger is not None else None
    r.ledger.steps_per_epoch = steps_per_epoch
    loop.ledger = r.ledger
    loop.data_position = r.data_position
    for key, h in self._other_hooks():
      put = getattr(h, "restore_checkpoint_state", None)
      if callable(put) and key in r.hook_states:
        put(r.hook_states[key])
    self.restored_step = r.step
    log.info("resumed from checkpoint %d in %s", r.step, self.directory)
    return r.state

  def observe(self, info: LoopInfo) -> None:
    """Raises the error of an asynchronous save that has failed meanwhile."""
    self._check_in_flight()

  def after_call(self, info: LoopInfo, state: Any) -> None:
    """Saves the state at ``info.end_step`` (asynchronously)."""
    ledger = self._loop.ledger if self._loop is not None else None
    if ledger is None or ledger.step != info.end_step:
      ledger = Ledger(step=info.end_step, examples_seen=info.examples_seen,
                      loop_index=info.loop_index + 1,
                      steps_per_epoch=getattr(self._loop, "steps_per_epoch", None))
    self._flush_other_hooks()  # the rows this checkpoint covers are on disk before it is
    self.save(info.end_step, state, ledger=ledger, data_position=info.data_position,
              metrics=info.metrics)
    return None

  def _flush_other_hooks(self) -> None:
    """Flushes every other hook that has ``flush()`` (their metric writers), so what a
    checkpoint covers is also on disk when the job is killed after it."""
    for _, h in self._other_hooks():
      flush = getattr(h, "flush", None)
      if callable(flush):
        flush()

  def on_run_end(self, loop: Any, state: Any) -> None:
    """Waits for the last write; raises :class:`CheckpointError` if it failed."""
    self.close()
    return None

  def on_run_error(self, loop: Any, error: BaseException) -> None:
    """The run ends by ``error``: lets the in-flight save commit, then releases the directory.

    If that save fails too, its failure is logged (``error`` is what ``run``
    raises) and its unfinished directory is removed, so that a new hook on the
    directory (in this process or another) resumes from the last committed step.
    Involves no collective (other processes may not be raising).
    """
    step = self._in_flight
    try:
      self.close()
    except CheckpointError as e:
      log.warning("while the run raised %s: %s", type(error).__name__, e)
      if step is not None and jax.process_index() == 0:
        _remove_tmp_dirs(self.directory, step)


# -- helpers -------------------------------------------------------------------


def _drain_writers(manager: ocp.CheckpointManager, timeout_s: float = 60.0) -> None:
  """After a failed save, waits (best effort) for that save's other writers.

  Orbax raises the first failing item's error while the other items' writes
  may still run; waiting for them keeps them from writing into a directory
  that is about to be removed or reused (:func:`loopkit.compat.wait_for_orbax_writers`).
  """
  compat.wait_for_orbax_writers(manager, timeout_s)


def _rmtree(p: epath.Path, attempts: int = 20) -> None:
  """Removes a directory, retrying while a stray writer still adds files."""
  for i in range(attempts):
    try:
      p.rmtree(missing_ok=True)
      return
    except OSError:
      if i == attempts - 1:
        raise
      time.sleep(0.05 * (i + 1))


def _step_of_name(name: str) -> int | None:
  """The step of a name loopkit's Orbax manager writes (``12`` or ``12.orbax-checkpoint-tmp-*``)."""
  base = name.split(_TMP_MARK, 1)[0]
  return int(base) if base.isdigit() else None


def _unfinished_write(p: epath.Path) -> bool:
  """Whether ``p`` (a step's directory or tmp directory) is this hook's unfinished write.

  The evidence: a tmp name (Orbax's atomic-rename mode, any local disk: the
  directory is renamed to ``<step>`` only once complete), or a ``<step>``
  directory without ``commit_success.txt`` that holds nothing but loopkit's
  items and Orbax's ``_CHECKPOINT_METADATA`` (Orbax's commit-file mode, used on
  GCS, writes in place; a kill during a retention delete leaves part of a
  checkpoint). A folder with anything else in it (a user's ``5``, an older
  Orbax's complete checkpoint of other items) or with nothing in it is not one.
  """
  if _step_of_name(p.name) is None or not p.is_dir():
    return False
  if _TMP_MARK in p.name:
    return True
  names = [c.name.split(_TMP_MARK, 1)[0] for c in p.iterdir()]
  return bool(names) and _COMMIT_FILE not in names and set(names) <= {_STEP_METADATA, *_ITEMS}


def _tidy(directory: epath.Path) -> list[str]:
  """Removes this hook's unfinished saves; returns warnings about what loopkit does not read.

  Runs on process 0, then syncs the processes. Only :func:`_unfinished_write`
  entries are deleted (case C21); digit-named folders that are not complete
  checkpoints (C35) and other programs' checkpoints (C41) are left in place,
  each kind named in one message.
  """
  messages = []
  if jax.process_index() == 0 and directory.exists():
    kept, foreign = [], []
    for p in sorted(directory.iterdir(), key=lambda q: q.name):
      name = p.name
      if _unfinished_write(p):
        log.warning("removing unfinished checkpoint directory %s", p)
        _rmtree(p)
      elif name.isdigit() and not (p / _COMMIT_FILE).exists():
        kept.append(name)
      elif _step_of_name(name) is None and _FOREIGN_CHECKPOINT.search(name):
        foreign.append(name)
    if kept:
      messages.append(
          f"loopkit: {directory} holds {', '.join(kept)}: named like loopkit checkpoints but "
          f"neither complete (no {_COMMIT_FILE}) nor an unfinished loopkit save; left in "
          "place, not read, and a save at that step is skipped")
    if foreign:
      messages.append(
          f"loopkit: {directory} holds checkpoints loopkit does not read: "
          f"{', '.join(foreign)} (e.g. from flax.training.checkpoints); the run does not "
          "resume from them. To start from such a state, restore it yourself and pass it "
          "to TrainLoop.run (docs/checkpointing.md, 'Starting from another checkpoint')")
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices("loopkit_checkpoint_remove_unfinished")
  return messages


def _remove_tmp_dirs(directory: epath.Path, step: int) -> None:
  """Removes the unfinished directories of one failed save (no collective)."""
  if not directory.exists():
    return
  for p in directory.iterdir():
    if _step_of_name(p.name) == step and _unfinished_write(p):
      log.warning("removing unfinished checkpoint directory %s", p)
      _rmtree(p)


# -- leaves ----------------------------------------------------------------------
#
# Orbax (>= 0.11) saves typed PRNG keys natively, as their uint32 key data plus
# the impl's name, and wraps them back on restore; its metadata then shows the
# key data's shape and dtype. It refuses zero-size arrays. loopkit therefore
# saves zero-size leaves as None (the live state gives their shape and dtype
# back) and writes its own JSON record of every leaf's logical shape and dtype
# (item "leaves"), which the mismatch check reads.


def _is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_empty(x: Any) -> bool:
  return math.prod(x.shape) == 0


def _storable(state: Any) -> Any:
  return jax.tree.map(lambda x: None if _is_empty(x) else x, state)


def _dtype_name(x: Any) -> str:
  return str(x.dtype) if _is_key(x) else str(np.dtype(x.dtype))


def _leaf_record(state: Any) -> dict[str, Any]:
  """``{"leaves": [{"path", "key", "shape", "dtype"[, "impl"]}, ...]}`` of a state."""
  leaves = []
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    entry = {"path": jax.tree_util.keystr(path) or "<root>", "key": list(_orbax_key(path)),
             "shape": list(x.shape), "dtype": _dtype_name(x)}
    if _is_key(x) and isinstance(x, jax.Array):
      entry["impl"] = str(jax.random.key_impl(x))
    leaves.append(entry)
  return {"leaves": leaves}


def _leaves_from_record(record: dict[str, Any]) -> dict[tuple[str, ...], dict[str, Any]]:
  return {tuple(e["key"]): {"shape": tuple(e["shape"]), "dtype": e["dtype"],
                            "impl": e.get("impl")} for e in record["leaves"]}


def _leaves_from_orbax(tree: Any) -> dict[tuple[str, ...], dict[str, Any]]:
  """The same from Orbax's metadata (checkpoints without the record): key data for keys."""
  return {key: {"shape": tuple(getattr(m, "shape", ()) or ()),
                "dtype": str(np.dtype(m.dtype)) if getattr(m, "dtype", None) is not None
                else None, "impl": None, "physical": True}
          for key, m in ocp.tree.to_flat_dict(tree).items() if m is not None}


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _orbax_key(path: tuple) -> tuple[str, ...]:
  """The flat key Orbax stores a leaf under (``ocp.tree.to_flat_dict``)."""
  out = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        out.append(str(getattr(k, attr)))
        break
    else:
      out.append(str(k))
  return tuple(out)


def _described(dtype: str | None, impl: str | None) -> str:
  return f"{dtype} (impl {impl})" if impl else str(dtype)


def _tree_difference(saved: dict[tuple[str, ...], dict[str, Any]], like: Any) -> str | None:
  """First difference between the saved leaves and a live state, or None."""
  seen = set()
  for path, x in jax.tree_util.tree_flatten_with_path(like)[0]:
    key = _orbax_key(path)
    name = jax.tree_util.keystr(path) or "<root>"
    if key not in saved:
      return f"leaf {name} of the train state is not in the checkpoint"
    seen.add(key)
    m = saved[key]
    shape, dtype = tuple(x.shape), _dtype_name(x)
    impl = str(jax.random.key_impl(x)) if _is_key(x) and isinstance(x, jax.Array) else None
    if m.get("physical") and _is_key(x):  # Orbax's metadata shows a key's data
      data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
      shape, dtype = tuple(data.shape), str(data.dtype)
    if m["shape"] != shape:
      return f"leaf {name} has shape {m['shape']} in the checkpoint, {shape} in the train state"
    if m["dtype"] is not None and m["dtype"] != dtype:
      return (f"leaf {name} has dtype {_described(m['dtype'], m.get('impl'))} in the "
              f"checkpoint, {_described(dtype, impl)} in the train state")
  for key in saved:
    if key not in seen:
      return f"the checkpoint has leaf {'.'.join(key)} that the train state lacks"
  return None


def _empty_like(x: Any) -> jax.Array:
  return jnp.zeros(x.shape, x.dtype, device=getattr(x, "sharding", None))


def _into_structure(restored: Any, like: Any) -> Any:
  """Puts restored leaves into exactly ``like``'s tree structure (zero-size ones anew)."""
  like_leaves = jax.tree_util.tree_flatten_with_path(like)[0]
  like_def = jax.tree.structure(like)
  if jax.tree.structure(restored) == like_def:  # type: ignore[operator]
    return restored
  flat = {_orbax_key(p): v for p, v in jax.tree_util.tree_flatten_with_path(restored)[0]}
  return jax.tree.unflatten(like_def, [_empty_like(x) if _is_empty(x) else flat[_orbax_key(p)]
                                       for p, x in like_leaves])


def _jsonable(x: Any) -> Any:
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return x


def _check_json(value: Any, what: str) -> None:
  try:
    json.dumps(value)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{what} is not JSON-serialisable: {e}") from None


def _encode_position(position: Any) -> dict[str, Any]:
  """One process's data position as JSON: ``{"kind": ..., "value": ...}``."""
  if position is None:
    return {"kind": "none"}
  if isinstance(position, (int, np.integer)) and not isinstance(position, bool):
    return {"kind": "int", "value": int(position)}
  if isinstance(position, (bytes, bytearray)):
    return {"kind": "bytes", "value": base64.b64encode(bytes(position)).decode("ascii")}
  value = _jsonable(position)
  _check_json(value, f"the data position ({type(position).__name__})")
  return {"kind": "json", "value": value}


def _decode_position(d: dict[str, Any]) -> Any:
  kind = d.get("kind")
  if kind == "none":
    return None
  if kind == "int":
    return int(d["value"])
  if kind == "bytes":
    return base64.b64decode(d["value"])
  if kind == "json":
    return d["value"]
  raise ValueError(f"unknown data position kind {kind!r} in checkpoint")


def _encode_positions(position: Any) -> dict[str, Any]:
  """Every process's position (one entry per process, in process order)."""
  mine = _encode_position(position)
  if jax.process_count() == 1:
    return {"per_process": [mine]}
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  raw = np.frombuffer(json.dumps(mine).encode(), np.uint8)
  lengths = multihost_utils.process_allgather(np.asarray(raw.size, np.int32))
  padded = np.zeros(int(np.max(lengths)), np.uint8)
  padded[:raw.size] = raw
  rows = np.asarray(multihost_utils.process_allgather(padded))
  return {"per_process": [json.loads(bytes(row[:n]).decode())
                          for row, n in zip(rows, np.asarray(lengths), strict=True)]}


def _decode_positions(d: dict[str, Any]) -> Any:
  per = d["per_process"]
  n, i = jax.process_count(), jax.process_index()
  if len(per) == n:
    return _decode_position(per[i])
  if all(p == per[0] for p in per):
    return _decode_position(per[0])
  raise ValueError(f"the checkpoint's data positions were saved by {len(per)} processes and "
                   f"differ; they cannot be given to {n} processes")
