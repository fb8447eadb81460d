"""A fast local checkpoint tier beside the persistent one: frequent saves to each host's disk.

At pod scale a save to persistent storage (GCS, a shared file system) takes tens of seconds
to minutes, so runs save rarely and lose up to a whole interval at each preemption.
:class:`LocalCheckpointHook` adds a second, frequent tier: every process writes the shards
it holds (with the ledger, the data positions and the hooks' states) to its own local
directory (a RAM disk or a local SSD), while the :class:`~loopkit.checkpoint.CheckpointHook`
it is given keeps writing the rare persistent checkpoints. A restart resumes from the
newest complete state of either tier, the same step on every process, bitwise the state an
uninterrupted run has there (invariant 1 of docs/concepts.md), whatever K.

**Which manager.** Each process's local tier is an Orbax ``CheckpointManager`` on its own
directory (``<local_directory>/process_<i>``, active process set ``{i}``, no primary host: no
barrier with the other processes). It holds the bytes of this process's shards (each distinct
shard once, in leaf and index order) as this process's row of a global ``[P, n]`` uint32
array (:mod:`loopkit.checkpoint.shard_words`), written through Orbax's ``ArrayHandler``
without a primary host or replica choice (as the emergency manager writes its local
checkpoints), and the record of the leaves and the
layout, the ledger, the data positions of every process and the hooks' states as JSON.
Orbax's ``orbax.checkpoint.experimental.emergency.CheckpointManager``
(0.12.8) was read and not used, because it cannot keep loopkit's resume contract:
with one replica slice (any mesh whose first axis is 1, a 1-D mesh) it makes no local tier at
all; it saves locally only on the processes outside the primary slice; it takes a single
item, ``state`` (no ledger, data position or hook states in the local tier), assumes a
state replicated across slices and raises ``NotImplementedError`` for ``delete``,
``metrics`` and ``item_metadata``. Its ``ReplicatorCheckpointManager`` writes only to local
storage and relies on an external replicator service (GKE's multi-tier checkpointing
driver) to copy steps between hosts and to backup storage; no such service runs on CPU
processes here, so it would be a local manager without replication.

**Host loss.** A process whose local directory is gone (a replaced host), or whose copy does
not fit the live state's layout, resumes from a peer's local copy when that peer holds
exactly the shards it needs (the state, or the part of it this process holds, is replicated
across processes, as in data parallelism over hosts): the peer's bytes travel by one
broadcast (:func:`jax.experimental.multihost_utils.broadcast_one_to_all`, of uint32 words:
a bitwise copy). Shards that only the lost host held are nowhere else (the tier does not
copy shards to peers at save time), so then every process resumes from the persistent tier.
Each process logs which source it used and :attr:`LocalCheckpointHook.restored_from` says
it (``"local"``, ``"peer"``, ``"persistent"`` or None).

**Complete or invisible.** A local step counts only once Orbax committed it
(``commit_success.txt``), and only if every process can read its part of it (its own copy
or a peer's): a kill while the processes' writes are in flight leaves the step on some
processes only, and the restart takes an older step, complete everywhere (the local tier
keeps ``max_to_keep`` = 2 steps by default for this). The choice is taken once, from every
process's listing gathered by one collective, so all processes agree. Local steps newer
than the step resumed from are deleted.

Multi-host-safe (every process runs the hook at the same boundaries); not thread-safe.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import numpy as np

from loopkit._internal.extras import missing

try:
  import orbax.checkpoint as ocp
  from etils import epath
except ImportError as e:
  raise missing(e, "loopkit.checkpoint") from e

from loopkit.checkpoint.files import _COMMIT_FILE
from loopkit.checkpoint.hook import CheckpointError, CheckpointHook
from loopkit.checkpoint.items import (
  _allgather_json,
  _decode_positions,
  _encode_positions,
  _leaf_record,
)
from loopkit.checkpoint.shard_words import (
  _as_row,
  _check_leaves,
  _fingerprint,
  _layout,
  _pack,
  _unpack,
  _word_counts,
  _words_restore,
)
from loopkit.core.context import Restore, RunContext
from loopkit.core.hooks import Hook, LoopInfo
from loopkit.core.ledger import Bucket, Ledger
from loopkit.core.triggers import Trigger

log = logging.getLogger("loopkit")

__all__ = ["LocalCheckpointHook", "TwoTierTrigger"]

_LOCAL_ITEMS = ("words", "record", "ledger", "data", "hooks")


class TwoTierTrigger(Trigger):
  """The local tier's :class:`~loopkit.core.triggers.Trigger` (its own fields) that also fires
  at the persistent hook's step marks (``persistent``), and tells the planner so."""

  def __init__(self, persistent: Trigger, **local: Any):
    super().__init__(**local)
    self.persistent = persistent

  def next_step(self, step: int, steps_per_epoch: int | None = None) -> int | None:
    marks = [m for m in (super().next_step(step, steps_per_epoch),
                         self.persistent.next_step(step, steps_per_epoch)) if m is not None]
    return min(marks) if marks else None

  def crossed(self, start: int, end: int, steps_per_epoch: int | None = None) -> bool:
    return (super().crossed(start, end, steps_per_epoch)
            or self.persistent.crossed(start, end, steps_per_epoch))


class LocalCheckpointHook(Hook):
  """Frequent checkpoints to each host's local disk beside a persistent :class:`CheckpointHook`.

  Put this hook in the loop's hooks *instead of* ``persistent`` (it drives it): it saves to
  the local tier at its own cadence and calls ``persistent`` at that hook's step marks, at the
  end of a run, at an early stop and at a preemption. A step saved persistently is not also
  saved locally.

  Example:
    >>> tiers = loopkit.checkpoint.LocalCheckpointHook(  # doctest: +SKIP
    ...     "/mnt/ramdisk/ckpt", loopkit.CheckpointHook("gs://b/run", every_steps=1000),
    ...     every_steps=100)
    >>> loop = loopkit.TrainLoop(step, iterations_per_loop=50, hooks=[tiers])  # doctest: +SKIP

  Args:
    local_directory: this host's local root (a RAM disk or local SSD path; relative paths
      are resolved now); process ``i`` writes ``<local_directory>/process_<i>``.
    persistent: the persistent tier, a :class:`~loopkit.checkpoint.CheckpointHook` with a
      step cadence (``every_steps``, ``every_epochs``, ``at_steps``, ``keep_every_steps``,
      ``keep_steps``), not in the loop's hooks itself.
    every_steps, every_secs: the local cadence (steps > 0 and/or seconds > 0; at least one).
    max_to_keep: local steps kept per process (>= 2 by default, so that a kill during a save
      leaves a step that every process completed).
    async_save: write local steps in a background thread (Orbax async checkpointing).
    restore: resume at ``run`` start from the newest complete state of either tier.

  Raises:
    ValueError: no local cadence, ``max_to_keep`` < 1, or ``persistent`` with
      ``every_secs`` (one wall-clock answer is agreed per hook and boundary: give the
      persistent tier steps).
    TypeError: ``persistent`` is not a ``CheckpointHook``.

  Attributes:
    local_directory: this process's local directory (an ``epath.Path``).
    persistent: the persistent hook.
    restored_step: the step resumed from by the last ``on_run_start`` (None if none).
    restored_from: ``"local"`` (this process's copy), ``"peer"`` (another process's copy),
      ``"persistent"`` or None.
    saved_steps: steps saved locally by this hook, in order (this process's view).
  """

  needs_state = True
  time_bucket = Bucket.CHECKPOINT

  def __init__(self, local_directory: str | os.PathLike, persistent: CheckpointHook, *,
               every_steps: int | None = None, every_secs: float | None = None,
               max_to_keep: int = 2, async_save: bool = True, restore: bool = True):
    if not isinstance(persistent, CheckpointHook):
      raise TypeError(f"persistent must be a loopkit.CheckpointHook, got "
                      f"{type(persistent).__name__}")
    if persistent.trigger.every_secs is not None:
      raise ValueError(f"the persistent hook has every_secs={persistent.trigger.every_secs!r}; "
                       "with a local tier give the persistent tier a step cadence (every_steps)")
    if every_steps is None and every_secs is None:
      raise ValueError("LocalCheckpointHook needs a local cadence: every_steps or every_secs")
    if max_to_keep is None or max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep!r}")
    super().__init__()
    self.trigger = TwoTierTrigger(persistent.trigger, every_steps=every_steps,
                                  every_secs=every_secs, at_end=True)
    self.persistent = persistent
    root = os.path.abspath(os.path.expanduser(os.fspath(local_directory)))
    self.local_root = epath.Path(root)
    self.max_to_keep = max_to_keep
    self.async_save = async_save
    self.restore_on_start = restore
    self.restored_step: int | None = None
    self.restored_from: str | None = None
    self.saved_steps: list[int] = []
    self._manager: Any = None
    self._ctx: RunContext | None = None

  @property
  def local_directory(self) -> epath.Path:
    return self.local_root / f"process_{jax.process_index()}"

  # -- the local manager -------------------------------------------------------

  def _open(self) -> Any:
    if self._manager is None:
      me = jax.process_index()
      name_format = ocp.step.standard_name_format(
          temporary_path_cls=ocp.path.atomicity.CommitFileTemporaryPath)
      # Every process writes its own directory alone: no primary host, no barrier with the
      # others. Orbax's handlers take this from their own options (their default writes on
      # process 0 only), and its numpy handler writes on process 0 whatever they say, so the
      # bytes go as a jax.Array on a local device through an ArrayHandler without a primary
      # host (as Orbax's emergency manager builds its local handler).
      alone = ocp.options.MultiprocessingOptions(
          primary_host=None, active_processes={me}, barrier_sync_key_prefix=f"loopkit_local_{me}")
      options = ocp.CheckpointManagerOptions(
          max_to_keep=self.max_to_keep, enable_async_checkpointing=self.async_save,
          step_name_format=name_format, create=False, cleanup_tmp_directories=True,
          multiprocessing_options=alone,
          async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
      self.local_directory.mkdir(parents=True, exist_ok=True)  # Orbax: not with a process set
      handlers: dict[str, Any] = {name: ocp.JsonCheckpointHandler(multiprocessing_options=alone)
                                  for name in _LOCAL_ITEMS}
      registry = ocp.type_handlers.create_type_handler_registry(
          (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None,
                                                     use_replica_parallel=False)))
      handlers["words"] = ocp.PyTreeCheckpointHandler(  # raw bytes: nothing to compress
          use_ocdbt=True, use_zarr3=True, use_compression=False, multiprocessing_options=alone,
          type_handler_registry=registry)
      self._manager = ocp.CheckpointManager(self.local_directory, options=options,
                                            item_handlers=handlers)
    return self._manager

  def local_steps(self) -> list[int]:
    """This process's complete local steps, ascending (committed: ``commit_success.txt``)."""
    d = self.local_directory
    if not d.exists():
      return []
    return sorted(s for p in d.iterdir() if p.name.isdigit()
                  and (p / _COMMIT_FILE).exists() and (s := int(p.name)) >= 0)

  def wait_until_finished(self) -> None:
    """Blocks until the last local save is written (and the persistent one).

    Raises:
      CheckpointError: a local save failed (naming the directory).
    """
    if self._manager is not None:
      try:
        self._manager.wait_until_finished()
      except Exception as e:  # pylint: disable=broad-except
        raise CheckpointError(f"a local save to {self.local_directory} failed: "
                              f"{type(e).__name__}: {e}") from e
    self.persistent.wait_until_finished()

  def close(self) -> None:
    """Waits for the last writes and releases the local manager (reopened when used)."""
    try:
      self.wait_until_finished()
    finally:
      manager, self._manager = self._manager, None
      if manager is not None:
        manager.close()

  # -- save --------------------------------------------------------------------

  def save_local(self, step: int, state: Any, *, ledger: Ledger, data_position: Any = None,
                 hook_states: Any = None) -> bool:
    """Saves this process's shards of ``state`` (and the run's records) as local step ``step``.

    Every process must call it at the same steps (the data positions are gathered).

    Args:
      step: the global step; must equal ``ledger.step``.
      state: the train state (``jax.Array`` leaves).
      ledger: the ledger at ``step``.
      data_position: this process's source position after the step's batch.
      hook_states: ``{hook name: state}`` of other hooks, or a function returning it.

    Returns:
      False if this process already holds local step ``step`` (nothing written).

    Raises:
      ValueError: ``ledger.step != step``.
      TypeError: a leaf that is not a ``jax.Array`` (naming it).
      CheckpointError: the previous local save failed.
    """
    if ledger.step != step:
      raise ValueError(f"ledger step {ledger.step} != checkpoint step {step}")
    positions = _encode_positions(data_position)  # a collective: before any early return
    hooks = dict((hook_states() if callable(hook_states) else hook_states) or {})
    manager = self._open()
    self.wait_until_finished()
    if step in manager.all_steps():
      return False
    counts = _word_counts(state)  # every process's, so that all rows have one length
    words, layout = _pack(state, max(counts))
    record = {"leaves": _leaf_record(state), "layout": layout,
              "fingerprint": _fingerprint(state, layout),
              "nbytes": 4 * counts[jax.process_index()]}
    args = ocp.args.Composite(
        words=ocp.args.PyTreeSave({"w": _as_row(words)}),
        record=ocp.args.JsonSave(record),
        ledger=ocp.args.JsonSave(ledger.to_dict()), data=ocp.args.JsonSave(positions),
        hooks=ocp.args.JsonSave(hooks))
    manager.save(step, args=args, force=True)
    self.saved_steps.append(step)
    return True

  # -- Hook protocol -------------------------------------------------------------

  def on_run_start(self, ctx: RunContext, state: Any) -> Restore | Any:
    """Resumes from the newest complete state of either tier, agreed by every process.

    Returns:
      A :class:`~loopkit.core.context.Restore` from the local tier (this process's copy or
      a peer's), or what ``persistent.on_run_start`` returns (its newest checkpoint, a warm
      start, or None).

    Raises:
      TypeError: a state leaf that is not a ``jax.Array`` (naming it).
      CheckpointError: as :meth:`CheckpointHook.on_run_start`.
    """
    self._ctx = ctx
    self.restored_step, self.restored_from = None, None
    _check_leaves(state)
    if self._manager is not None:
      self.close()
    self._open()
    choice = self._choose(state) if self.restore_on_start else None
    if choice is None:
      out = self.persistent.on_run_start(ctx, state)
      if self.persistent.restored_step is not None:
        self.restored_step, self.restored_from = self.persistent.restored_step, "persistent"
        log.info("resumed from the persistent tier: step %d in %s (no newer local step that "
                 "every process can read)", self.restored_step, self.persistent.directory)
      self._drop_local_after(self.restored_step)
      return out
    step, sources, words_of = choice
    # The persistent hook claims its directory but restores nothing: the local step is newer.
    keep = self.persistent.restore_on_start, self.persistent.init_from
    self.persistent.restore_on_start, self.persistent.init_from = False, None
    try:
      self.persistent.on_run_start(ctx, state)
    finally:
      self.persistent.restore_on_start, self.persistent.init_from = keep
    restored = self._restore_local(state, step, sources, words_of)
    self._drop_local_after(step)
    return restored

  def _choose(self, state: Any) -> tuple[int, list[int], dict[int, int]] | None:
    """The local step to resume from and each process's source, or None (persistent).

    One collective: every process's complete local steps with their layouts' fingerprints
    and sizes, its need (the live state's fingerprint) and the persistent tier's newest step.
    """
    me = jax.process_index()
    mine = {}
    for s in self.local_steps():
      try:
        rec = json.loads((self.local_directory / str(s) / "record" / "metadata").read_text())
      except (OSError, ValueError):
        continue  # not readable: not a step this process offers
      mine[str(s)] = [rec["fingerprint"], rec["nbytes"]]
    need = _fingerprint(state, _layout(state))
    newest = _newest_persistent(self.persistent.directory) if me == 0 else None
    views = _allgather_json({"steps": mine, "need": need, "persistent": newest})
    plan = _plan(views)
    if plan is None and me == 0 and any(v["steps"] for v in views):
      log.info("local tier: no step that every process can read for this state's layout is "
               "as new as the persistent tier's newest (%s)", views[0]["persistent"])
    return plan

  def _restore_local(self, state: Any, step: int, sources: list[int],
                     words_of: dict[int, int]) -> Restore:
    me = jax.process_index()
    own = sources[me] == me
    out = None
    if own:
      words, out = self.read_local(step)
    lent = sorted({s for i, s in enumerate(sources) if s != i})
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    for q in lent:  # one broadcast per lending process, every process takes part
      n = words_of[q] // 4
      mine = (words if me == q else np.zeros(n, np.uint32))
      got = np.asarray(multihost_utils.broadcast_one_to_all(mine, is_source=me == q))
      if sources[me] == q:
        words = got
    records = _allgather_json(None if out is None else
                              {k: out[k] for k in ("ledger", "data", "hooks")})
    rec = records[me] if own else records[sources[me]]
    new = _unpack(words, state)
    ledger = Ledger.from_dict(rec["ledger"])
    self.restored_step = step
    self.restored_from = "local" if own else "peer"
    if own:
      log.info("resumed from the local tier: step %d in %s", step, self.local_directory)
    else:
      log.info("resumed from process %d's local copy of step %d (%s has no usable copy)",
               sources[me], step, self.local_directory)
    return Restore(state=new, ledger=ledger, data_position=_decode_positions(rec["data"]),
                   hook_states=dict(rec["hooks"] or {}))

  def read_local(self, step: int) -> tuple[np.ndarray, dict[str, Any]]:
    """This process's local step ``step``: its words (uint32) and its JSON items
    (``record``, ``ledger``, ``data``, ``hooks``)."""
    out = self._open().restore(step, args=ocp.args.Composite(
        words=_words_restore(), record=ocp.args.JsonRestore(), ledger=ocp.args.JsonRestore(),
        data=ocp.args.JsonRestore(), hooks=ocp.args.JsonRestore()))
    words = np.asarray(out["words"]["w"].addressable_data(0))[0]
    words = words[:out["record"]["nbytes"] // 4]
    return words, {k: out[k] for k in ("record", "ledger", "data", "hooks")}

  def _drop_local_after(self, step: int | None) -> None:
    """Deletes this process's local steps newer than the resumed step (a future abandoned)."""
    manager = self._open()
    for s in manager.all_steps():
      if step is None or s > step:
        manager.delete(s)

  def after_each_call(self, info: LoopInfo) -> None:
    """Raises the error of a persistent save that failed meanwhile."""
    self.persistent.after_each_call(info)

  def on_trigger(self, info: LoopInfo, state: Any) -> None:
    """Saves ``info.end_step``: persistently at the persistent hook's marks and at a run's
    last boundary, else locally."""
    ctx = self._ctx
    spe = ctx.steps_per_epoch if ctx is not None else None
    if info.is_last or self.persistent.trigger.crossed(info.start_step, info.end_step, spe):
      self.persistent.on_trigger(info, state)
      return None
    ledger = ctx.ledger.copy() if ctx is not None else None
    if ledger is None or ledger.step != info.end_step:
      ledger = Ledger(step=info.end_step, examples_seen=info.examples_seen,
                      loop_index=info.loop_index + 1, steps_per_epoch=spe,
                      skipped_steps=info.skipped_steps)
    self.save_local(info.end_step, state, ledger=ledger, data_position=info.data_position,
                    hook_states=ctx.hook_states if ctx is not None else None)
    return None

  def on_run_end(self, ctx: RunContext, state: Any) -> None:
    """Waits for the last local write, then ends the persistent hook's run."""
    try:
      self.close()
    finally:
      self.persistent.on_run_end(ctx, state)

  def on_run_error(self, ctx: RunContext, error: BaseException) -> None:
    """Lets the local write in flight finish (a failure is logged), then the persistent one."""
    try:
      self.close()
    except CheckpointError as e:
      log.warning("while the run raised %s: %s", type(error).__name__, e)
    finally:
      self.persistent.on_run_error(ctx, error)


def _plan(views: list[dict[str, Any]]) -> tuple[int, list[int], dict[int, int]] | None:
  """The local step to resume from, each process's source and the sources' sizes, or None.

  Args:
    views: per process (in process order) ``{"steps": {step: [fingerprint, nbytes]},
      "need": fingerprint, "persistent": newest persistent step or None}`` (process 0's
      ``persistent`` counts: the persistent directory is shared).

  Returns:
    ``(step, sources, nbytes_of)``: the newest local step at least as new as the persistent
    tier's newest that every process can read, from its own copy when that fits its need (its
    source is itself), else from the lowest-index process whose copy does; ``nbytes_of`` maps
    each source to its copy's size in bytes. None when there is no such step.
  """
  persistent = views[0]["persistent"]
  steps = sorted({int(s) for v in views for s in v["steps"]}, reverse=True)
  for step in steps:
    if persistent is not None and step < persistent:
      return None
    copies = [v["steps"].get(str(step), [None, 0]) for v in views]
    sources = []
    for p, v in enumerate(views):
      fits = [q for q, c in enumerate(copies) if c[0] == v["need"]]
      sources.append(p if p in fits else fits[0] if fits else -1)
    if all(q >= 0 for q in sources):
      return step, sources, {q: copies[q][1] for q in set(sources)}
  return None


def _newest_persistent(directory: epath.Path) -> int | None:
  """The persistent tier's newest committed step (digit-named, ``commit_success.txt``)."""
  if not directory.exists():
    return None
  steps = [s for p in directory.iterdir() if p.name.isdigit()
           and (p / _COMMIT_FILE).exists() and (s := int(p.name)) >= 0]
  return max(steps) if steps else None
