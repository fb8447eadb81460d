"""A checkpoint directory as one Orbax manager sees it: its options, its steps, a restore.

:class:`CheckpointDirectory` is the reading half of :class:`~loopkit.checkpoint.CheckpointHook`
(its base class): the Orbax ``CheckpointManager`` a hook opens on its directory, with the
options that make only committed steps count and retention go through the trash
(:mod:`loopkit.checkpoint.files`); the directory's steps, listed afresh beside a run that prunes
them; and :meth:`CheckpointDirectory.restore`, which reads one checkpoint into the structure and
shardings of a live state after checking its leaves against it. The hook adds the saves, the
directory's lock and the hook protocol (:mod:`loopkit.checkpoint.hook`). Not thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import jax

from loopkit._internal.checks import leaf_key
from loopkit._internal.extras import missing

try:
  import orbax.checkpoint as ocp
  from etils import epath
except ImportError as e:
  raise missing(e, "loopkit.checkpoint") from e

from loopkit.checkpoint.files import _ITEMS, _tidy, _todelete_subdir
from loopkit.checkpoint.items import (
  _abstract,
  _decode_positions,
  _into_structure,
  _is_empty,
  _leaves_from_orbax,
  _leaves_from_record,
  _tree_differences,
)
from loopkit.checkpoint.lock import DirectoryLock, describe, holder_of, stale_reason
from loopkit.checkpoint.tiers import preservation_policy
from loopkit.checkpoint.warm import _SHOWN, _exclusion
from loopkit.core.ledger import Ledger
from loopkit.core.state_leaves import as_loop_leaf

log = logging.getLogger("loopkit")


# Listings of a directory that a live run prunes (CheckpointHook._reload): one step deleted
# while listed costs one more; a run deleting 8 steps in the same moment is far past normal.
_LIST_ATTEMPTS = 8


class CheckpointWarning(UserWarning):
  """The checkpoint directory holds files loopkit did not write and leaves alone."""


@dataclasses.dataclass(frozen=True)
class RestoredCheckpoint:
  """What :meth:`CheckpointHook.restore` read.

  Attributes:
    step: the checkpoint's step (updates applied).
    state: the train state, with the tree structure and shardings of ``like``.
    ledger: the saved :class:`~loopkit.core.ledger.Ledger`.
    data_position: this process's data position (int, iterator state or None).
    hook_states: ``{hook name: state}`` of the other hooks that had one
      (:func:`loopkit.core.hook_state.hook_names`; ``"<index>:<HookClass>"`` in
      checkpoints written before hook names).
  """

  step: int
  state: Any
  ledger: Ledger
  data_position: Any
  hook_states: dict[str, Any]


def _changed_model(step: int, directory: Any, problems: list[tuple[tuple[str, ...], bool, str]],
                   like: Any) -> str:
  """Why checkpoint ``step`` cannot be restored into ``like``: every differing leaf by its one
  name, and the ``init_from`` that starts the changed model from the checkpoint instead."""
  n = len(problems)
  lines = [f"checkpoint {step} in {directory} does not match the train state in {n} "
           f"lea{'f' if n == 1 else 'ves'}:"]
  lines += [f"  {what}" for _, _, what in problems[:_SHOWN]]
  if n > _SHOWN:
    lines.append(f"  ... and {n - _SHOWN} more")
  live = [leaf_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(like)[0]]
  if any(k[:1] == ("params",) for k in live):  # WarmStart's default select: exclude what changed
    changed = [key for key, in_state, _ in problems if in_state and key[:1] == ("params",)]
    exclude = f", exclude={_exclusion(changed)}" if changed else ""
    warm = f"WarmStart('{directory}'{exclude})"
  else:
    warm = f"WarmStart('{directory}', select=..., exclude=...)"
  lines.append(f"To start a changed model from it (fine-tuning), give the run a new directory "
               f"with init_from=loopkit.checkpoint.{warm} (docs/checkpointing.md, Warm start)")
  return "\n".join(lines)


class CheckpointDirectory:
  """A checkpoint directory read through one Orbax manager: its options, steps and restore.

  The base of :class:`~loopkit.checkpoint.CheckpointHook`, whose ``__init__`` sets the
  attributes below (checked there) and which adds the saves and the hook protocol.

  Attributes:
    directory: the absolute checkpoint directory (an ``epath.Path``).
    max_to_keep, best_metric, best_mode, keep_best, keep_every_steps, keep_steps, async_save:
      the retention and writing options (see :class:`~loopkit.checkpoint.CheckpointHook`).
  """

  directory: epath.Path
  max_to_keep: int | None
  best_metric: str | None
  best_mode: str
  keep_best: int | None
  keep_every_steps: int | None
  keep_steps: tuple[int, ...]
  async_save: bool
  _lock: DirectoryLock
  _manager: ocp.CheckpointManager | None
  _warned: set[str]

  # -- manager ---------------------------------------------------------------

  def _options(self) -> ocp.CheckpointManagerOptions:
    ranked_or_tiered = self.keep_best or self.keep_every_steps or self.keep_steps
    policy = preservation_policy(
        max_to_keep=self.max_to_keep or (1 if ranked_or_tiered else None),
        keep_every_steps=self.keep_every_steps, keep_steps=self.keep_steps,
        keep_best=self.keep_best, best_metric_fn=self._metric_of, best_mode=self.best_mode)
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
        preservation_policy=policy,
        # Retention renames a step into the trash before deleting it (a kill leaves no
        # partial step); loopkit empties the trash once the save is done (files.py).
        todelete_subdir=_todelete_subdir(self.directory),
        best_fn=self._metric_of if self.best_metric else None,
        best_mode=self.best_mode, step_name_format=name_format,
        cleanup_tmp_directories=False, create=True,
        # The step directory is made inside save(), so a directory that became unwritable
        # fails there at once; made in the background, its failure is only seen after
        # Orbax's 300 s signal time-outs.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False))

  def _metric_of(self, metrics: dict[str, Any]) -> float:
    assert self.best_metric is not None  # only called with one
    return float(metrics[self.best_metric])

  def _open(self) -> ocp.CheckpointManager:
    if self._manager is None:
      for message in _tidy(self.directory, remove=self._may_remove_unfinished()):
        if message not in self._warned:  # once per hook, not at every reopening
          self._warned.add(message)
          warnings.warn(message, CheckpointWarning, stacklevel=3)
      handlers: dict[str, Any] = {name: ocp.JsonCheckpointHandler() for name in _ITEMS}
      handlers["state"] = ocp.StandardCheckpointHandler()
      self._manager = ocp.CheckpointManager(self.directory, options=self._options(),
                                            item_handlers=handlers)
    return self._manager

  def _may_remove_unfinished(self) -> bool:
    """Whether unfinished saves are this hook's to remove: not while another live run
    holds the directory's lock (they may be its saves in progress)."""
    if self._lock.held or jax.process_index() != 0:
      return True
    holder = holder_of(self.directory)
    if holder is None or stale_reason(holder, self._lock.stale_after_s) is not None:
      return True
    log.info("not removing unfinished saves in %s: it is in use by %s", self.directory,
             describe(holder))
    return False

  # -- queries ---------------------------------------------------------------

  def _reload(self) -> Any:
    """The Orbax manager with the directory listed afresh.

    A reader beside a live training run (an evaluation sidecar, a warm start) can list a step
    that the run's retention deletes before Orbax reads that step's metrics; Orbax then raises
    (``ValueError: No step path found``, or ``FileNotFoundError``), in ``reload`` or in the
    manager's constructor, and keeps its last listing (or makes no manager).
    The listing is taken again, up to ``_LIST_ATTEMPTS`` times; a step that is gone is not in
    the next one. The last attempt's error is raised as Orbax raised it.
    """
    for _ in range(_LIST_ATTEMPTS - 1):
      try:
        return self._list_once()
      except (ValueError, FileNotFoundError) as e:
        log.debug("listing %s again: a step went away while it was listed (%s)",
                  self.directory, e)
    return self._list_once()

  def _list_once(self) -> Any:
    if self._manager is None:
      return self._open()  # a new manager lists the directory as it is made
    self._manager.reload()
    return self._manager

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints in the directory, ascending."""
    return sorted(self._reload().all_steps())

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    """The best checkpoint by ``best_metric`` (the newest if no metric is set)."""
    return self._reload().best_step()

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
        ``like`` (naming every differing leaf, and the ``init_from`` that
        warm-starts a changed model from it), or its data positions were saved by a different
        number of processes.
    """
    like = jax.tree.map(as_loop_leaf, like)  # a Python scalar (TrainState's step=0) as the loop's
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
    problems = _tree_differences(saved, like)
    if problems:
      raise ValueError(_changed_model(step, self.directory, problems, like))
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
