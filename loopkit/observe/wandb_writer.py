"""The Weights & Biases tracker behind the writer protocol: :class:`WandbWriter`, its run-id
and journal files, and the reading of an offline run's history it resumes.

The table of both trackers' methods is in :mod:`loopkit.observe.tracker_writers`, which
re-exports these names.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import struct
import sys
import uuid
from collections.abc import Mapping
from typing import Any

from loopkit._internal.extras import require
from loopkit.observe._run_ids import _read_id, _write_id
from loopkit.observe.metric_writer import _hparam_value, _is_writer_process, _to_python
from loopkit.observe.text_writers import (
  JsonlWriter,
  _TextOnly,  # texts as rows; images, histograms skipped
)

__all__ = ["ID_FILE", "JOURNAL_FILE", "WandbWriter"]

log = logging.getLogger("loopkit")


ID_FILE = "wandb-run-id"


JOURNAL_FILE = "wandb-rows.jsonl"


_WANDB_EXIT_CODE = {"completed": 0, "interrupted": 1, "failed": 1}


class WandbWriter(_TextOnly):
  """Writes rows to a Weights & Biases run: ``run.log(row, step=step)``.

  W&B's step is loopkit's global step, and a row's values are those JSONL writes (numbers,
  strings; W&B adds its own ``_step``, ``_runtime`` and ``_timestamp``). Keys are kept as
  they are (``eval/err`` is a chart ``err`` in the section ``eval``). Rows of one step from
  several hooks (the ``LoggingHook``'s and the ``EvalHook``'s) become one W&B history row.
  :meth:`write_hparams` updates ``run.config``.

  Which run: ``run`` (a ``wandb`` run), else ``wandb.run`` if ``wandb.init`` was called,
  else ``wandb.init(project=..., dir=..., mode=..., **init_kwargs)``, which this writer
  finishes at :meth:`close`. ``mode="offline"`` writes the run under ``dir/wandb/`` for
  ``wandb sync`` later. With ``dir`` given (and no ``id`` in ``init_kwargs``), the run's id
  is kept in ``dir/wandb-run-id`` and the run made with ``resume="allow"``, so a job
  restarted in the same workdir continues the same W&B run (online; offline, each process
  writes a new directory ``dir/wandb/offline-run-*-ID`` of the same run: ``wandb sync`` them
  oldest first). A run this writer makes uses a W&B service process of its own: a
  ``WANDB_SERVICE`` inherited from a parent that called ``wandb.init`` is dropped from this
  process's environment before (a killed run's id stays "in use" in a shared service).

  Durable up to the last checkpoint: W&B's service process keeps the run's log in memory
  (32 KiB blocks) and has no flush, so a killed process loses the rows it holds. With
  ``dir``, the writer also appends every row to ``dir/wandb-rows.jsonl`` (a
  :class:`~loopkit.observe.JsonlWriter`: :meth:`flush`, which the loop calls before each
  checkpoint save, makes it durable); a restarted writer sends the rows of that file that
  the run lacks (those after the last step W&B holds: the server's, online; the earlier
  offline directories', offline), up to the step the run continues from, before its own.

  Each step once: W&B steps only increase: it drops a row at a step below the run's current
  step. The writer sends no row at a step the run holds: after a kill and a resume from the
  checkpoint at ``S`` (or a second ``loop.run`` of the same process from an earlier
  checkpoint), the rows the first attempt's W&B run holds past ``S`` stay, and the resumed
  run's rows at those steps are not sent, with one WARNING per resume naming the steps.
  Those rows hold the same metric values (loopkit's rows are bitwise those of an
  uninterrupted run), except the host-clock ``throughput/*`` keys.

  How it ended: :meth:`close` finishes a run this writer made with ``exit_code`` 0 when
  training completed and 1 when it did not (a preemption, a time limit or a
  ``KeyboardInterrupt`` also ``run.mark_preempting()``), as the hooks told
  (:meth:`mark_outcome`), else 1 while an exception is being handled, else 0.

  Args:
    run: the run to write to (see above).
    project: the project of a new run.
    dir: the directory of a new run's files (``dir/wandb/``), of its id file and of the rows
      file ``wandb-rows.jsonl`` (created).
    mode: ``"online"``, ``"offline"`` or ``"disabled"`` (None: W&B's default, ``WANDB_MODE``).
    **init_kwargs: more arguments of ``wandb.init`` for a new run (``name``, ``config``,
      ``entity``, ``id``, ``resume``, ``tags``, ...).

  Raises:
    ImportError: ``wandb`` is not installed (``pip install 'loopkit[wandb]'``).
    RuntimeError: ``wandb.init`` found the run's id in use in a W&B service this process
      shares (the message says what to unset).

  Writes only on process 0 (elsewhere every method is a no-op and W&B is not imported).
  Not thread-safe (wrap in :class:`~loopkit.observe.AsyncWriter`).
  """

  def __init__(self, run: Any = None, *, project: str | None = None,
               dir: str | os.PathLike | None = None, mode: str | None = None,
               **init_kwargs: Any):
    self._enabled = _is_writer_process()
    self.run: Any = None
    self._owns_run = False
    self._last_step = -1  # the highest step sent to W&B by this writer
    self._held = -1  # rows at steps <= this are in W&B already: not sent again
    self._dropped: list[int] = []  # steps not sent since the last warning
    self._outcome: str | None = None
    self._journal: JsonlWriter | None = None
    self._replay: bool = False  # rows of the journal may be missing from W&B: send them
    self._keep_through: int | None = None
    if not self._enabled:
      return
    wandb = require("wandb", "loopkit.observe.WandbWriter")
    if run is None and wandb.run is not None:
      run = wandb.run
    if run is None:
      if dir is not None:
        os.makedirs(dir, exist_ok=True)
        if "id" not in init_kwargs:
          init_kwargs["id"] = _persisted_id(os.fspath(dir))
          init_kwargs.setdefault("resume", "allow")
      _own_service()
      try:
        run = wandb.init(project=project, dir=None if dir is None else os.fspath(dir),
                         mode=mode, **init_kwargs)
      except Exception as e:
        if "is in use" not in str(e) or not os.environ.get("WANDB_SERVICE"):
          raise
        raise RuntimeError(
            f"W&B run id {init_kwargs.get('id')!r} is in use in the W&B service this process "
            f"shares (WANDB_SERVICE={os.environ['WANDB_SERVICE']}, from a process that called "
            "wandb.init; a killed run's id stays in use there): unset WANDB_SERVICE before "
            "this process first uses wandb") from e
      self._owns_run = True
    self.run = run
    self._held = max(int(run.step) - 1, _offline_steps_held(run))  # 0 / -1: a new run
    if dir is not None:
      self._journal = JsonlWriter(os.path.join(os.fspath(dir), JOURNAL_FILE))
      self._replay = True

  def keep_through(self, step: int) -> None:
    """Declares the run continues from a state at ``step``: W&B keeps the rows it holds past
    it, so the rows this run writes again at those steps are not sent (one WARNING); the
    rows file keeps its rows up to ``step``, and those the W&B run lacks are sent first."""
    if not self._enabled:
      return
    if self._last_step > step:
      self._held = max(self._held, self._last_step)
    self._keep_through = int(step)
    if self._journal is not None:
      self._journal.keep_through(step)
    self._outcome = None

  def mark_outcome(self, outcome: str) -> None:
    """Records how training ended, for :meth:`close`: ``"completed"`` (exit code 0),
    ``"interrupted"`` (``run.mark_preempting()``, exit code 1) or ``"failed"`` (exit code 1)
    (:func:`~loopkit.observe.mark_run_outcome`).

    Raises:
      ValueError: another outcome (the message names it).
    """
    if outcome not in _WANDB_EXIT_CODE:
      raise ValueError(f"outcome {outcome!r} is not one of {tuple(_WANDB_EXIT_CODE)}")
    self._outcome = outcome

  def _report_dropped(self) -> None:
    if self._dropped:
      log.warning("W&B run %s already holds steps up to %d (its steps only increase): the rows "
                  "at steps %d..%d were not sent again; W&B keeps the earlier ones",
                  getattr(self.run, "id", "?"), max(self._held, self._last_step),
                  min(self._dropped), max(self._dropped))
      self._dropped = []

  def _send_missing(self, first_step: int) -> None:
    """Sends the rows of the rows file at steps after the last the run holds, up to the step
    the run continues from (``keep_through``; else before ``first_step``)."""
    self._replay = False
    assert self._journal is not None
    path = self._journal.path
    through = self._keep_through if self._keep_through is not None else first_step - 1
    if not os.path.exists(path):
      return
    sent, held = [], max(self._held, self._last_step)
    with open(path) as f:
      for line in f:
        try:
          row = json.loads(line)
        except ValueError:  # a line cut short by a kill
          continue
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, int) and held < step <= through:
          self.run.log({k: v for k, v in row.items() if k != "step"}, step=step)
          self._last_step = step
          sent.append(step)
    if sent:
      log.info("W&B run %s: sent the %d rows at steps %d..%d that it lacked (from %s)",
               self.run.id, len(sent), sent[0], sent[-1], path)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if not self._enabled:
      return
    step = int(step)
    row = {k: _to_python(v) for k, v in scalars.items()}
    if self._replay:
      self._send_missing(step)
    if self._journal is not None:
      self._journal.write_scalars(step, row)
    if step <= self._held or step < self._last_step:
      if not self._dropped or self._dropped[-1] != step:
        self._dropped.append(step)
      return
    self._report_dropped()
    self._last_step = step
    self.run.log(row, step=step)

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    if self._enabled:
      self.run.config.update({k: _hparam_value(v) for k, v in hparams.items()},
                             allow_val_change=True)

  def flush(self) -> None:
    """Makes the rows file durable (the rows the W&B run may lose to a kill, see the class
    docstring); reports rows not sent (a WARNING)."""
    if self._enabled:
      self._report_dropped()
      if self._journal is not None:
        self._journal.flush()

  def close(self) -> None:
    """Finishes the run (its last row committed, files closed) if this writer made it, with
    the exit code of the outcome told (:meth:`mark_outcome`; else 1 while an exception is
    being handled, else 0); closes the rows file."""
    if not self._enabled:
      return
    self._report_dropped()
    if self._journal is not None:
      self._journal.close()
    if self._owns_run and self.run is not None:
      outcome = self._outcome
      if outcome is None:
        error = sys.exc_info()[1]
        outcome = ("completed" if error is None else
                   "interrupted" if isinstance(error, KeyboardInterrupt) else "failed")
      if outcome == "interrupted":
        self.run.mark_preempting()
      self.run.finish(exit_code=_WANDB_EXIT_CODE[outcome])
      self._owns_run = False


def _own_service() -> None:
  """Drops an inherited ``WANDB_SERVICE`` (a parent's W&B service) from this process's
  environment when this process has not connected to a W&B service yet, so that
  ``wandb.init`` starts a service of this process's own."""
  token = os.environ.get("WANDB_SERVICE")
  if not token:
    return
  try:
    from wandb.sdk import wandb_setup
    setup = wandb_setup._singleton  # pylint: disable=protected-access
    connected = (setup is not None and getattr(setup, "_pid", None) == os.getpid()
                 and getattr(setup, "_connection", None) is not None)
  except (ImportError, AttributeError):
    return
  if not connected:
    del os.environ["WANDB_SERVICE"]
    log.info("WandbWriter: not using the W&B service of another process (WANDB_SERVICE=%s): "
             "this process starts its own", token)


def _offline_steps_held(run: Any) -> int:
  """The last history step of the run's earlier offline directories (-1: none, or not an
  offline run): their ``run-ID.wandb`` files, read as far as W&B wrote them."""
  try:
    offline, sync_dir, run_id = bool(run.offline), os.fspath(run.sync_dir), str(run.id)
  except (AttributeError, TypeError):
    return -1
  if not offline:
    return -1
  parent = os.path.dirname(sync_dir.rstrip(os.sep))
  held = -1
  for path in glob.glob(os.path.join(glob.escape(parent), f"offline-run-*-{run_id}",
                                     f"run-{run_id}.wandb")):
    if os.path.dirname(path) != sync_dir.rstrip(os.sep):
      held = max([held, *_history_steps(path)])
  return held


_BLOCK = 32768  # W&B's .wandb files: LevelDB log blocks (after a 7-byte header in the first)


def _history_steps(path: str) -> list[int]:
  """The steps of the history records of a W&B transaction log (``run-ID.wandb``): a
  7-byte header (``:W&B``, magic, version), then LevelDB log records in 32 KiB blocks
  (a 7-byte header each: crc32, length, type 1 full, 2 first, 3 middle, 4 last), each a
  ``wandb_internal_pb2.Record``. Stops at the first record cut short or unreadable."""
  from wandb.proto import wandb_internal_pb2
  with open(path, "rb") as f:
    data = f.read()
  if data[:4] != b":W&B":
    return []
  pos, buf, steps = 7, b"", []
  while pos + 7 <= len(data):
    if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
      pos += _BLOCK - pos % _BLOCK
      continue
    _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if kind == 0 or pos + 7 + n > len(data):  # the rest of the block is empty, or cut short
      if kind == 0 and n == 0:
        pos += _BLOCK - pos % _BLOCK
        continue
      break
    chunk = data[pos + 7:pos + 7 + n]
    buf = chunk if kind in (1, 2) else buf + chunk
    pos += 7 + n
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
      try:
        record.ParseFromString(buf)
      except Exception:  # pylint: disable=broad-except  # a damaged record: stop there
        break
      if record.WhichOneof("record_type") == "history":
        steps.append(int(record.history.step.num))
  return steps


def _persisted_id(directory: str) -> str:
  """The W&B run id kept in ``directory/wandb-run-id`` (a new one written there if none)."""
  path = os.path.join(directory, ID_FILE)
  run_id = _read_id(path)
  if run_id is None:
    run_id = uuid.uuid4().hex[:12]  # W&B ids: lowercase letters and digits
    _write_id(path, run_id)
  return run_id
