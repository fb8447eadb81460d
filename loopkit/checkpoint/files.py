"""The checkpoint directory: what counts as a checkpoint, and what loopkit may delete.

A step directory counts only if Orbax finalized it (``commit_success.txt``).
:func:`_tidy` removes only this hook's own unfinished writes and names, in
warnings, what it leaves alone. Used by
:mod:`loopkit.checkpoint`; not thread-safe.

**Deleting out of the step namespace first.** A recursive delete removes a
directory's contents before the directory, so a kill part-way through leaves a
``<step>`` directory that is partial or empty: neither a checkpoint nor
evidently loopkit's (an empty ``4`` looks like a user's folder, which is kept).
On a local disk every delete therefore first renames the directory into
``<directory>/.loopkit-trash/`` (one atomic ``rename``) and only then removes
it there: Orbax's retention deletes through its ``todelete_subdir`` option
(:func:`_todelete_subdir`), loopkit's own removals through :func:`_delete_via_trash`.
A kill leaves either the whole step or nothing under its name, plus a partial
trash that :func:`_tidy` or :func:`_empty_trash` removes. On ``gs://`` and
other remote paths (where a rename copies, and there are no empty
directories) deletes are direct, as Orbax's are; a partial step there holds
only loopkit's items and is removed by :func:`_tidy`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import threading
import time
from typing import Any

import jax

from loopkit._internal import compat
from loopkit._internal.extras import missing

try:
  import orbax.checkpoint as ocp
  from etils import epath
except ImportError as e:
  raise missing(e, "loopkit.checkpoint") from e

log = logging.getLogger("loopkit")

_COMMIT_FILE = "commit_success.txt"
_STEP_METADATA = "_CHECKPOINT_METADATA"  # Orbax's step metadata (written when a save starts)
_TMP_MARK = ".orbax-checkpoint-tmp"
_TRASH = ".loopkit-trash"  # where step directories go to be deleted (local disks)
_ITEMS = ("state", "ledger", "data", "hooks", "leaves")
# Written by a run that completed (status "completed"), after its last save committed; read by
# loopkit.tools.follower (the evaluation sidecar stops there). Kauldron's name for the same.
COMPLETE_MARKER = "TRAIN_COMPLETE"
# A name that looks like someone else's checkpoint: flax.training.checkpoints'
# "checkpoint_50", TensorFlow's "ckpt-100.index", an Orbax manager with a step prefix.
_FOREIGN_CHECKPOINT = re.compile(r"(checkpoint|ckpt)\D{0,3}\d+", re.IGNORECASE)


def _drain_writers(manager: ocp.CheckpointManager, timeout_s: float = 60.0) -> None:
  """After a failed save, waits (best effort) for that save's other writers.

  Orbax raises the first failing item's error while the other items' writes
  may still run; waiting for them keeps them from writing into a directory
  that is about to be removed or reused (:func:`loopkit._internal.compat.wait_for_orbax_writers`).
  """
  compat.wait_for_orbax_writers(manager, timeout_s)


_RACING = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.EBUSY)  # a writer still adds files


def _rmtree(p: epath.Path, attempts: int = 20) -> None:
  """Removes a directory, retrying while a stray writer still adds files."""
  for i in range(attempts):
    try:
      p.rmtree(missing_ok=True)
      return
    except OSError as e:
      if i == attempts - 1 or e.errno not in _RACING:  # e.g. read-only: retrying cannot help
        raise
      time.sleep(0.05 * (i + 1))


def _is_local(directory: epath.Path) -> bool:
  return "://" not in str(directory)


def _todelete_subdir(directory: epath.Path) -> str | None:
  """Orbax's ``todelete_subdir`` for ``directory``: the trash on a local disk, else None
  (Orbax ignores the option on GCS; a rename elsewhere may copy)."""
  return _TRASH if _is_local(directory) else None


def _delete_via_trash(directory: epath.Path, p: epath.Path) -> None:
  """Deletes ``p`` (an entry of ``directory``) so that a kill leaves nothing under its name:
  on a local disk renamed into the trash first, then the trash is removed (no save is in
  flight when loopkit deletes: nothing else is in it)."""
  if not _is_local(directory):
    _rmtree(p)
    return
  trash = directory / _TRASH
  _rmtree(trash / p.name)  # a leftover of the same name
  trash.mkdir(exist_ok=True)
  try:
    p.rename(trash / p.name)
  except FileNotFoundError:  # gone meanwhile
    pass
  finally:
    _rmtree(trash)


def _empty_trash(directory: epath.Path) -> None:
  """Removes ``directory``'s trash (Orbax's renamed retention deletes, or what a kill left
  of a delete), on process 0; a failure is logged (Orbax's next delete would then fail on a
  name left in the trash, and report it)."""
  trash = directory / _TRASH
  if jax.process_index() != 0 or not _is_local(directory) or not trash.exists():
    return
  try:
    _rmtree(trash)
  except OSError as e:
    log.warning("could not empty %s: %s", trash, e)


class _TrashEmptier:
  """Empties a directory's trash in a background thread (deleting a large checkpoint may take
  a while; Orbax's own deletes run in its background thread too). :meth:`join` before Orbax
  may rename into the trash again (the next save) and when the hook closes."""

  def __init__(self, directory: epath.Path):
    self.directory = directory
    self._thread: threading.Thread | None = None

  def start(self) -> None:
    self.join()
    if jax.process_index() != 0 or not (self.directory / _TRASH).exists():
      return
    self._thread = threading.Thread(target=_empty_trash, args=(self.directory,),
                                    name="loopkit-empty-trash", daemon=True)
    self._thread.start()

  def join(self) -> None:
    if self._thread is not None:
      self._thread.join()
      self._thread = None


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


def _tidy(directory: epath.Path, remove: bool = True) -> list[str]:
  """Removes this hook's unfinished saves; returns warnings about what loopkit does not read.

  Runs on process 0, then syncs the processes. Only :func:`_unfinished_write`
  entries and the trash (deletes a kill cut short) are deleted, and only if
  ``remove`` (process 0's decision: not while another live run holds the
  directory); digit-named folders that are not complete checkpoints and other
  programs' checkpoints are left in place, each kind named in one message.
  """
  messages = []
  if jax.process_index() == 0 and directory.exists():
    kept, foreign = [], []
    if remove:
      _empty_trash(directory)
    for p in sorted(directory.iterdir(), key=lambda q: q.name):
      name = p.name
      if _unfinished_write(p):
        if remove:
          log.warning("removing unfinished checkpoint directory %s", p)
          _delete_via_trash(directory, p)
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


_FAILED_SAVE_BARRIER_S = 60  # how long process 0 waits for the others before removing
_removals = 0  # failed saves handled in this process (keeps barrier keys unique)


def _remove_failed_save(directory: epath.Path, step: int,
                        barrier_s: float = _FAILED_SAVE_BARRIER_S) -> None:
  """Removes a failed save's unfinished directories, once no process writes into them.

  Called on every process after it drained its own writers
  (:func:`_drain_writers`). On several processes, process 0 first waits at a
  barrier (Orbax's ``multihost.get_barrier_sync_fn``, ``barrier_s`` seconds)
  for the others to get there; if one does not, the directories stay and the
  next run's start (:func:`_tidy`, which syncs all processes) removes them.
  """
  global _removals
  _removals += 1
  if jax.process_count() > 1:
    try:
      ocp.multihost.get_barrier_sync_fn()(
          key=f"loopkit_remove_failed_save_{step}_{_removals}", timeout_ms=int(barrier_s * 1000))
    except Exception as e:  # pylint: disable=broad-except  # a time-out: leave the directories
      log.warning("not removing the failed save of step %d in %s yet: not every process "
                  "finished with it within %g s (%s: %s); the next run's start removes it",
                  step, directory, barrier_s, type(e).__name__, e)
      return
  if jax.process_index() == 0:
    try:
      _remove_tmp_dirs(directory, step)
    except OSError as e:  # the save's own error is the one to raise
      log.warning("could not remove the failed save of step %d in %s: %s", step, directory, e)


def _remove_tmp_dirs(directory: epath.Path, step: int) -> None:
  """Removes the unfinished directories of one failed save (no collective)."""
  if not directory.exists():
    return
  for p in directory.iterdir():
    if _step_of_name(p.name) == step and _unfinished_write(p):
      log.warning("removing unfinished checkpoint directory %s", p)
      _delete_via_trash(directory, p)


# -- the completion marker ------------------------------------------------------


def _write_complete_marker(directory: epath.Path, step: int) -> None:
  """Process 0 writes ``COMPLETE_MARKER`` (``{"step": step, "status": "completed"}``).

  Written to a temporary name, then renamed into place (atomic on a local disk; one object
  write on GCS), so a reader sees all of it or nothing.
  """
  if jax.process_index() != 0:
    return
  tmp = directory / f".{COMPLETE_MARKER}.tmp-{os.getpid()}"
  tmp.write_text(json.dumps({"step": int(step), "status": "completed", "time": time.time()}))
  tmp.rename(directory / COMPLETE_MARKER)
  # debug: a first run prints only lines that say what happens to the user (C70)
  log.debug("training complete at step %d: wrote %s", step, directory / COMPLETE_MARKER)


def _clear_complete_marker(directory: epath.Path) -> None:
  """Process 0 removes ``COMPLETE_MARKER`` (a run starts: training is not complete until it
  ends so)."""
  if jax.process_index() == 0:
    (directory / COMPLETE_MARKER).unlink(missing_ok=True)


def _read_complete_marker(directory: epath.Path) -> dict[str, Any] | None:
  """The marker's record, or None if there is none (or it cannot be read yet)."""
  try:
    record = json.loads((directory / COMPLETE_MARKER).read_text())
  except (FileNotFoundError, ValueError):
    return None
  return record if isinstance(record, dict) else None
