"""Evaluation beside training: a sidecar that evaluates every new checkpoint once.

A training run saves checkpoints (:class:`~loopkit.checkpoint.CheckpointHook`); a second
process (or job) follows its directory with :class:`CheckpointFollower` and evaluates each
new checkpoint once, in step order, with the evaluators and rows of
:class:`~loopkit.EvalHook`: the row of checkpoint N is written at step N
(``{prefix}/{metric}``, ``{prefix}/num_examples``), and holds the same values, bitwise, as the
row EvalHook writes at step N in the training run, when the evaluator runs on the same devices
(the checkpoint restores the state bitwise; the evaluation is exact and deterministic). The
training run does not wait for it.

* **What counts.** Only steps Orbax committed (``CheckpointHook.all_steps``): a save in
  progress (``<step>.orbax-checkpoint-tmp*``, or a step directory without
  ``commit_success.txt``) is not a step yet. The follower only reads: it deletes nothing
  and takes no lock.
* **Retention under it.** A checkpoint that the training run's ``max_to_keep`` deletes
  between the listing and the restore (the follower lags behind) is logged and skipped; one
  deleted before any listing saw it is never known.
* **The end.** A training run that completes (``loop.status == "completed"``) writes
  ``TRAIN_COMPLETE`` in the directory after its last save committed (each run's start removes
  it). The follower reads the marker *before* each listing, so once it has seen the marker the
  listing holds the last checkpoint: it evaluates what is new and stops. A preempted or failed
  run writes no marker (its restart continues); ``timeout_secs`` bounds the wait for the next
  checkpoint. Start the follower with the training run or after its start: a finished run's
  marker stays until the next run's restore succeeded.
* **Its own restarts.** With ``progress_file``, the steps evaluated (and skipped) are kept in
  a small JSON file, written after each row is flushed; a restarted follower continues after
  them, and tells its writer (:func:`~loopkit.observe.writers.keep_rows_through`) so a row
  written before a kill but not recorded is written once, not twice.

Command line: ``python -m loopkit.tools.follow module:function --directory D --output_dir O``
(:mod:`loopkit.tools.follow`).

Multi-host: every process runs the follower; the marker, the listing, the progress and the
decision to skip a deleted step are taken on process 0 and shared (one small
``process_allgather`` each), so every process evaluates the same steps. Not thread-safe.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
from jax.sharding import Mesh

from loopkit._internal.mesh import pinned_state_shardings
from loopkit.checkpoint.files import COMPLETE_MARKER, _read_complete_marker
from loopkit.checkpoint.hook import CheckpointHook
from loopkit.checkpoint.items import _allgather_json
from loopkit.core.state_leaves import as_loop_leaf
from loopkit.evaluation.evaluator import EvalResult
from loopkit.evaluation.hook import ForEvalHook, SupportsEvaluate, _hook_evaluator, report
from loopkit.observe.writers import as_writer, keep_rows_through

log = logging.getLogger("loopkit")

__all__ = ["COMPLETE_MARKER", "CheckpointFollower", "follow"]

_DELETION_GRACE_S = 5.0  # a failed restore of a step still listed this long after is raised


class _Reader(CheckpointHook):
  """A checkpoint hook that only reads: it never removes unfinished saves (they may be the
  training run's saves in progress) and never takes the directory's lock."""

  def _may_remove_unfinished(self) -> bool:
    return False


def _agreed(value: Any) -> Any:
  """Process 0's ``value`` on every process (a collective on several processes)."""
  return _allgather_json(value)[0]


class CheckpointFollower:
  """Follows a checkpoint directory and evaluates each new checkpoint once, in step order.

  Example:
    >>> follower = loopkit.tools.follower.CheckpointFollower(  # doctest: +SKIP
    ...     workdir + "/checkpoints", init_state, loopkit.Evaluator(eval_step), test_batches,
    ...     writer=loopkit.observe.create_default_writer(workdir + "/follow"),
    ...     progress_file=workdir + "/follow/progress.json")
    >>> follower.run()  # until the training run writes TRAIN_COMPLETE  # doctest: +SKIP

  Args:
    directory: the training run's checkpoint directory (``CheckpointHook``'s; local path or
      any ``etils.epath`` path). It may not exist yet.
    like: a state pytree with the train state's structure whose leaves are ``jax.Array`` or
      ``jax.ShapeDtypeStruct`` (with ``sharding``: where the restored leaves go), as for
      :meth:`CheckpointHook.restore`; e.g. the initial state, or ``jax.eval_shape`` of it.
    evaluator: what :class:`~loopkit.EvalHook` takes: a :class:`~loopkit.Evaluator`, a
      :class:`loopkit.nnx.NnxEvaluator`, an object with ``evaluate(state, batches, *,
      num_batches=None)`` or with ``for_eval_hook()``. Compiled once, reused for every
      checkpoint.
    batches: a re-iterable of eval batches or a zero-argument callable returning one.
    num_batches: passed to ``evaluate`` (multi-host).
    writer: metric writer for the rows (as EvalHook's; None: log lines only).
    prefix: the rows' name prefix (EvalHook's ``prefix``).
    state_fn: maps the restored train state to the state the evaluator takes (default: as
      EvalHook's).
    mesh: where the checkpoint's leaves go, as a ``TrainLoop`` on this mesh places the train
      state (:func:`loopkit._internal.mesh.pinned_state_shardings`): a leaf of ``like`` with
      a ``NamedSharding`` keeps it, an unsharded one (e.g. a fresh ``init()`` on one
      device) is replicated. Default: the evaluator's ``mesh`` (a :class:`~loopkit.Evaluator`
      has one); None there too: ``like``'s own shardings. The same mesh and shardings as the
      training run give its rows bitwise.
    progress_file: a JSON file (in the follower's own output directory) that remembers the
      steps evaluated and skipped across restarts of the follower; None: no memory.
    poll_secs: seconds between listings of the directory.
    timeout_secs: stop (``status == "timed_out"``) when no new checkpoint appeared and no
      marker was written for this many seconds; None: wait until the marker.

  Attributes:
    results: ``[(step, EvalResult)]`` evaluated by this follower, in step order.
    skipped_steps: steps deleted before they could be restored, in order.
    done_through: the last step evaluated or skipped, across restarts (-1: none).
    status: None while following; ``"complete"`` (the marker seen and every checkpoint up
      to it evaluated) or ``"timed_out"`` after :meth:`run`.

  Raises:
    TypeError: ``evaluator`` is not one, or ``writer`` not a writer (as for EvalHook).
    ValueError: ``batches`` is a one-shot iterator; ``poll_secs`` <= 0; the progress file
      records another checkpoint directory (naming both).

  Not thread-safe.
  """

  def __init__(self, directory: Any, like: Any, evaluator: SupportsEvaluate | ForEvalHook,
               batches: Iterable | Callable[[], Iterable], *, num_batches: int | None = None,
               writer: Any = None, prefix: str = "eval",
               state_fn: Callable[[Any], Any] | None = None,
               mesh: Mesh | None = None, progress_file: str | os.PathLike | None = None,
               poll_secs: float = 10.0, timeout_secs: float | None = None):
    called, default_state_fn = _hook_evaluator(evaluator)
    if not callable(batches) and iter(batches) is batches:
      raise ValueError("CheckpointFollower needs re-iterable eval batches (a list, a Grain "
                       "loader) or a callable returning a fresh iterable, not a one-shot "
                       "iterator: it evaluates every checkpoint on them")
    if poll_secs <= 0:
      raise ValueError(f"poll_secs must be > 0, got {poll_secs}")
    self._reader = _Reader(directory, restore=False)
    self.directory = self._reader.directory
    like = jax.tree.map(as_loop_leaf, like)  # a Python scalar (TrainState's step=0) as the loop's
    mesh = mesh if mesh is not None else getattr(called, "mesh", None)
    if mesh is not None:  # the train loop's placement (one door): the training run's layout
      shardings = pinned_state_shardings(
          like, mesh, replicated_only=getattr(called, "step_style", "global") == "per_device")
      like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          like, shardings)
    self.like = like
    self.evaluator = evaluator
    self._evaluate = called.evaluate
    self.batches = batches
    self.num_batches = num_batches
    self.writer = None if writer is None else as_writer(writer)
    self.prefix = prefix
    self.state_fn = state_fn if state_fn is not None else default_state_fn
    self.progress_file = None if progress_file is None else os.fspath(progress_file)
    self.poll_secs = float(poll_secs)
    self.timeout_secs = timeout_secs
    self.results: list[tuple[int, EvalResult]] = []
    self.skipped_steps: list[int] = []
    self.status: str | None = None
    self._evaluated: list[int] = []  # across restarts (the progress file's)
    self._skipped: list[int] = []
    self.done_through = -1
    self._load_progress()

  # -- progress ---------------------------------------------------------------

  def _load_progress(self) -> None:
    record = None
    if self.progress_file is not None and os.path.exists(self.progress_file):
      with open(self.progress_file) as f:
        record = json.load(f)
    record = _agreed(record)
    if record is None:
      return
    if record.get("directory") != str(self.directory):
      raise ValueError(
          f"the progress file {self.progress_file} records checkpoints of "
          f"{record.get('directory')}, not of {self.directory}: give this follower its own "
          "output directory (or remove the file to evaluate every checkpoint again)")
    self._evaluated = [int(s) for s in record.get("evaluated", [])]
    self._skipped = [int(s) for s in record.get("skipped", [])]
    self.done_through = max(self._evaluated + self._skipped, default=-1)
    if self.writer is not None:  # a row written after the last record is written again, once
      keep_rows_through(self.writer, self.done_through)
    log.info("follower: continuing after step %d (%d checkpoints evaluated, %d skipped, "
             "recorded in %s)", self.done_through, len(self._evaluated), len(self._skipped),
             self.progress_file)

  def _save_progress(self) -> None:
    if self.progress_file is None or jax.process_index() != 0:
      return
    record = {"directory": str(self.directory), "evaluated": self._evaluated,
              "skipped": self._skipped}
    os.makedirs(os.path.dirname(os.path.abspath(self.progress_file)), exist_ok=True)
    tmp = f"{self.progress_file}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
      json.dump(record, f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.progress_file)

  # -- one pass ---------------------------------------------------------------

  def poll(self) -> list[tuple[int, EvalResult]]:
    """Lists the directory once and evaluates every new checkpoint, in step order.

    Returns:
      ``[(step, EvalResult)]`` of this pass (also appended to :attr:`results`).

    Raises:
      ValueError: a checkpoint does not match ``like`` (naming every differing leaf).
      Exception: a restore that failed while its checkpoint stayed in the directory (not a
        deletion), as the restore raised it.
    """
    steps = self._list()
    out = []
    for step in steps:
      if step <= self.done_through:
        continue
      restored = self._restore(step)
      if restored is None:
        self.skipped_steps.append(step)
        self._skipped.append(step)
      else:
        batches = self.batches() if callable(self.batches) else self.batches
        result = self._evaluate(self.state_fn(restored.state), batches,
                                num_batches=self.num_batches)
        report(step, result, writer=self.writer, prefix=self.prefix)
        if self.writer is not None:
          self.writer.flush()  # the row is on disk before the progress says so
        self.results.append((step, result))
        self._evaluated.append(step)
        out.append((step, result))
      self.done_through = step
      self._save_progress()
    return out

  def _list(self) -> list[int]:
    return _agreed(self._reader.all_steps() if self.directory.exists() else [])

  def _restore(self, step: int) -> Any:
    """The checkpoint at ``step``, or None if it was deleted before it could be read."""
    try:
      restored, error = self._reader.restore(self.like, step=step), None
    except Exception as e:  # pylint: disable=broad-except  # a deletion, or raised below
      restored, error = None, e
    failed = _allgather_json(None if error is None else f"{type(error).__name__}: {error}")
    if not any(failed):
      return restored
    deadline = time.monotonic() + _DELETION_GRACE_S
    while True:  # retention deletes file by file: the step may stay listed for a moment
      if step not in self._list():
        log.warning("follower: checkpoint %d in %s was deleted before it was evaluated (the "
                    "training run's retention, max_to_keep, removed it); skipped", step,
                    self.directory)
        return None
      if _agreed(time.monotonic() >= deadline):
        break
      time.sleep(0.2)
    if error is not None:
      raise error
    raise RuntimeError(f"restoring checkpoint {step} in {self.directory} failed on another "
                       f"process: {next(f for f in failed if f)}")

  # -- until the end ----------------------------------------------------------

  def run(self) -> list[tuple[int, EvalResult]]:
    """Follows the directory until the training run completes (or ``timeout_secs``).

    Each round reads the marker, then lists and evaluates what is new (:meth:`poll`); after
    the round that began with the marker present it stops with ``status == "complete"``.
    Otherwise it sleeps ``poll_secs``; with ``timeout_secs``, it stops with ``status ==
    "timed_out"`` (a warning) once that long passed without a new checkpoint.

    Returns:
      :attr:`results`, every ``(step, EvalResult)`` this follower evaluated.

    Raises:
      As :meth:`poll`.
    """
    log.info("follower: evaluating the checkpoints in %s as they appear (every %g s; stops at "
             "%s)", self.directory, self.poll_secs, COMPLETE_MARKER)
    last_news = time.monotonic()
    while True:
      marker = _agreed(_read_complete_marker(self.directory))
      before = self.done_through
      self.poll()
      if marker is not None:
        self.status = "complete"
        log.info("follower: training complete at step %s (%s); %d checkpoints evaluated, "
                 "%d skipped", marker.get("step"), COMPLETE_MARKER, len(self._evaluated),
                 len(self._skipped))
        break
      now = time.monotonic()
      if self.done_through != before:
        last_news = now
      elif self.timeout_secs is not None and _agreed(now - last_news >= self.timeout_secs):
        self.status = "timed_out"
        log.warning("follower: no new checkpoint in %s for %g s and no %s: stopped waiting "
                    "(evaluated through step %d)", self.directory, self.timeout_secs,
                    COMPLETE_MARKER, self.done_through)
        break
      time.sleep(self.poll_secs)
    if self.writer is not None:
      self.writer.flush()
    self._reader.close()
    return self.results


def follow(directory: Any, like: Any, evaluator: SupportsEvaluate | ForEvalHook,
           batches: Iterable | Callable[[], Iterable], **kwargs: Any) -> CheckpointFollower:
  """Runs a :class:`CheckpointFollower` until the training run completes; returns it.

  Arguments as for :class:`CheckpointFollower`; read ``.results``, ``.skipped_steps`` and
  ``.status`` from the returned follower.
  """
  follower = CheckpointFollower(directory, like, evaluator, batches, **kwargs)
  follower.run()
  return follower
