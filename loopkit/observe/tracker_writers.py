"""Experiment trackers behind the writer protocol: MLflow and Weights & Biases.

Both take loopkit's rows as :class:`~loopkit.observe.JsonlWriter` writes them: the same global
steps, the same keys (MLflow: characters it forbids mapped, below), the same values as floats,
and hparams as the run's params / config. They work wherever a writer does (``LoggingHook``,
``EvalHook``, ``GoodputHook``, :class:`~loopkit.observe.MultiWriter` beside the JSONL and
TensorBoard writers, :class:`~loopkit.observe.AsyncWriter`).

=================  ==========================  =====================================
method             :class:`MlflowWriter`       :class:`WandbWriter`
=================  ==========================  =====================================
write_scalars      metrics (strings: text)     ``run.log(row, step=step)``
write_texts        ``texts/NAME/step_N.txt``   ``run.log`` (string values)
write_images       skipped                     skipped
write_histograms   skipped                     skipped
write_hparams      params (strings)            ``run.config.update``
=================  ==========================  =====================================

("skipped" writes one DEBUG log record.) The packages are optional extras, imported when a
writer is made: ``pip install 'loopkit[mlflow]'`` (``mlflow-skinny``, or a full ``mlflow``) and
``pip install 'loopkit[wandb]'``.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import struct
import sys
import time
import uuid
from collections.abc import Mapping
from typing import Any

from loopkit._internal.extras import require
from loopkit.observe.metric_writer import _hparam_value, _is_writer_process, _to_python
from loopkit.observe.text_writers import (
  JsonlWriter,
  _TextOnly,  # texts as rows; images, histograms skipped
)

__all__ = ["MlflowWriter", "WandbWriter", "mlflow_name"]

MLFLOW_ID_FILE = "mlflow-run-id"

log = logging.getLogger("loopkit")

_MLFLOW_FORBIDDEN = re.compile(r"[^\w\-. :/]")  # MLflow's names: \w, - . space : /
_MLFLOW_MAX_NAME = 250  # MLflow's longest metric / param name


def mlflow_name(name: str) -> str:
  """The MLflow metric / param name of loopkit key ``name``.

  MLflow names hold only alphanumerics, ``_``, ``-``, ``.``, space, ``:`` and ``/``; every
  other character becomes ``_`` (``"acc@1"`` -> ``"acc_1"``, ``"loss[0]"`` -> ``"loss_0_"``).
  loopkit's own keys (``loss``, ``eval/err``, ``throughput/steps_per_sec``, ``goodput/*``,
  ``per_step/*``) are kept as they are.

  Raises:
    ValueError: the name is longer than 250 characters, or is not a normalised path
      (``"a//b"``, ``"/a"``, ``"a/"``, ``"."``, ``"../a"``), which MLflow refuses.
  """
  out = _MLFLOW_FORBIDDEN.sub("_", name)
  if len(out) > _MLFLOW_MAX_NAME:
    raise ValueError(f"metric name {name!r} is {len(out)} characters long; MLflow takes at "
                     f"most {_MLFLOW_MAX_NAME}")
  if not out or out == "." or out.startswith(("/", "./", "../")) or out.endswith("/") or (
      "//" in out or "/./" in out or "/../" in out or out.endswith(("/.", "/.."))):
    raise ValueError(f"metric name {name!r} is not a plain path (MLflow stores names as files: "
                     "no empty parts, '.', '..', leading or trailing '/'); rename the metric")
  return out


class _Names:
  """Maps keys through a name function and refuses two keys that meet on one name."""

  def __init__(self, fn: Any):
    self.fn = fn
    self.seen: dict[str, str] = {}  # tracker name -> key

  def __call__(self, key: str) -> str:
    name = self.fn(key)
    first = self.seen.setdefault(name, key)
    if first != key:
      raise ValueError(f"metric names {first!r} and {key!r} are both {name!r} in MLflow "
                       "(characters it forbids become '_'); rename one of them")
    return name


_MLFLOW_STATUS = {"completed": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}


class MlflowWriter(_TextOnly):
  """Writes rows to an MLflow run through ``mlflow.MlflowClient`` (no global MLflow state).

  Each numeric scalar is a metric point ``(name, float(value), timestamp, step)``: one
  ``log_batch`` per row, at loopkit's global step, the value as JSONL writes it, as a
  Python float (ints such as ``examples_seen`` too; NaN and infinities kept). Names go
  through :func:`mlflow_name` (MLflow forbids ``@ [ ] ( ) ,`` and more: they become ``_``).
  String values and :meth:`write_texts` become text artifacts ``texts/NAME/step_N.txt``.
  :meth:`write_hparams` logs the run's params (``str`` of the value: MLflow params are
  strings, and set once: a second value for the same name is MLflow's error).

  Which run: ``run`` (an ``mlflow.entities.Run`` or a run id), else, with ``dir``, the run
  whose id ``dir/mlflow-run-id`` keeps (a restarted job continues its run), else (without
  ``dir`` and ``experiment``) the active run of ``mlflow.start_run()`` if there is one, else a new
  run in ``experiment`` (made if missing; None: MLflow's default experiment) named
  ``run_name``, whose id is then kept in ``dir/mlflow-run-id``. One training run is one MLflow
  run across kills and restarts when every process is given the same ``dir`` (the workdir
  beside the checkpoints).

  Each step once: MLflow keeps every point it is given and deletes none, so the writer sends
  no point at a step its metric already holds. A continued run's metrics are read back when
  the writer is made (their last steps); after a kill and a resume from the checkpoint at
  ``S``, or a second ``loop.run`` of the same process from an earlier checkpoint, the points
  the first attempt logged past ``S`` stay and the resumed run's points at those steps are
  not sent (one WARNING per resume naming them). They hold the same values (loopkit's rows
  are bitwise those of an uninterrupted run), except the host-clock ``throughput/*`` keys.

  Status: the run is ``RUNNING`` while the loop runs (a continued run is set ``RUNNING``
  again), then ``FINISHED`` when training ends, ``KILLED`` at a preemption, a time limit or a
  ``KeyboardInterrupt`` (the resume continues it) and ``FAILED`` when ``run`` raises: the
  :class:`~loopkit.LoggingHook` and :class:`~loopkit.EvalHook` writing to it tell it
  (:meth:`mark_outcome`), at once. :meth:`close` ends it too: with the outcome told, else
  ``FAILED`` if an exception is being handled (``close`` in a ``finally``; ``KILLED`` for a
  ``KeyboardInterrupt``), else ``FINISHED``. This holds for a run the writer made or continued
  and one given as ``run``; the active run of ``mlflow.start_run()`` is left to its ``with``
  block.

  Every write has reached the tracking store when it returns: :meth:`flush` has nothing to
  make durable.

  Args:
    run: the run to write to (see above).
    experiment: the experiment of a new run (its name).
    run_name: the name of a new run.
    tracking_uri: MLflow's tracking URI (None: MLflow's default, ``MLFLOW_TRACKING_URI``);
      e.g. ``"file:///path/mlruns"`` (MLflow 3 wants ``MLFLOW_ALLOW_FILE_STORE=true`` for a
      file store), ``"sqlite:///mlflow.db"`` or a server's ``http://`` address.
    dir: the directory of the id file ``mlflow-run-id`` (created; e.g. the workdir).

  Raises:
    ImportError: MLflow is not installed (``pip install 'loopkit[mlflow]'``).
    mlflow.exceptions.MlflowException: ``run`` names no run of the tracking store.
    ValueError (at a write): a name MLflow cannot take (:func:`mlflow_name`), or two keys of
      a run mapped to one name; the message names them.

  Writes only on process 0 (elsewhere every method is a no-op and MLflow is not imported).
  Not thread-safe (wrap in :class:`~loopkit.observe.AsyncWriter`).
  """

  def __init__(self, run: Any = None, *, experiment: str | None = None,
               run_name: str | None = None, tracking_uri: str | None = None,
               dir: str | os.PathLike | None = None):
    self._enabled = _is_writer_process()
    self.run_id: str | None = None
    self._ends_run = False  # this writer sets the run's end status
    self._names = _Names(mlflow_name)
    self._closed = False
    self._outcome: str | None = None  # told by mark_outcome since the run (re)started
    self._held: dict[str, int] = {}  # metric name -> the last step the run holds
    self._dropped: list[int] = []  # steps not sent since the last warning
    if not self._enabled:
      return
    mlflow = require("mlflow", "loopkit.observe.MlflowWriter")
    from mlflow.tracking import MlflowClient
    self.client = MlflowClient(tracking_uri)
    id_path = None if dir is None else os.path.join(os.fspath(dir), MLFLOW_ID_FILE)
    if run is None and id_path is not None:
      kept = _read_id(id_path)
      if kept is not None and self._exists(kept):
        run = kept
      elif kept is not None:
        log.warning("%s names MLflow run %s, which %s does not hold: starting a new run",
                    id_path, kept, self.client.tracking_uri)
    active = mlflow.active_run()
    if run is None and experiment is None and id_path is None and active is not None:
      run = active
    if run is not None:
      self.run_id = run if isinstance(run, str) else run.info.run_id
      found = self.client.get_run(self.run_id)  # fails now if there is no such run
      self._ends_run = active is None or active.info.run_id != self.run_id
      self._held = self._last_steps(found)
      if self._ends_run and found.info.status != "RUNNING":
        self.client.update_run(self.run_id, status="RUNNING")
    else:
      experiment_id = "0"
      if experiment is not None:
        named = self.client.get_experiment_by_name(experiment)
        experiment_id = (named.experiment_id if named is not None
                         else self.client.create_experiment(experiment))
      self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
      self._ends_run = True
    if id_path is not None:
      _write_id(id_path, self.run_id)

  def _exists(self, run_id: str) -> bool:
    """Whether the tracking store holds run ``run_id`` (not deleted)."""
    from mlflow.exceptions import MlflowException
    try:
      return self.client.get_run(run_id).info.lifecycle_stage == "active"
    except MlflowException:
      return False

  def _last_steps(self, run: Any) -> dict[str, int]:
    """{metric name: the last step it holds} of a run (one history read per metric)."""
    return {name: max((m.step for m in self.client.get_metric_history(run.info.run_id, name)),
                      default=-1)
            for name in run.data.metrics}

  @property
  def _run_id(self) -> str:
    """``run_id`` where writes are enabled (``__init__`` sets it there; None elsewhere)."""
    assert self.run_id is not None
    return self.run_id

  def keep_through(self, step: int) -> None:
    """Declares a run of the loop starts from a state at ``step``: the run is ``RUNNING``
    again if an earlier run of the loop marked it ended (:meth:`mark_outcome`). The points
    past ``step`` that MLflow holds stay; the rows written again there are not sent."""
    del step
    if self._enabled and self._outcome is not None:
      self._outcome = None
      if self._ends_run:
        self.client.update_run(self._run_id, status="RUNNING")

  def mark_outcome(self, outcome: str) -> None:
    """Ends the run as training did: ``"completed"`` -> ``FINISHED``, ``"interrupted"`` ->
    ``KILLED``, ``"failed"`` -> ``FAILED`` (:func:`~loopkit.observe.mark_run_outcome`); a
    later run of the loop sets it ``RUNNING`` again (:meth:`keep_through`).

    Raises:
      ValueError: another outcome (the message names it).
    """
    if outcome not in _MLFLOW_STATUS:
      raise ValueError(f"outcome {outcome!r} is not one of {tuple(_MLFLOW_STATUS)}")
    if not self._enabled:
      return
    self._report_dropped()
    if self._ends_run and outcome != self._outcome:
      self.client.set_terminated(self._run_id, _MLFLOW_STATUS[outcome])
    self._outcome = outcome

  def _report_dropped(self) -> None:
    if self._dropped:
      log.warning("MLflow run %s already holds these metrics up to step %d: the points at "
                  "steps %d..%d were not logged again; MLflow keeps the earlier ones",
                  self.run_id, max(self._held.values()), min(self._dropped),
                  max(self._dropped))
      self._dropped = []

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if not self._enabled:
      return
    from mlflow.entities import Metric
    stamp = int(time.time() * 1000)
    step = int(step)
    points, texts = [], {}
    for key, value in scalars.items():
      value = _to_python(value)
      if isinstance(value, str):
        texts[key] = value
        continue
      name = self._names(key)
      if step <= self._held.get(name, -1):
        if not self._dropped or self._dropped[-1] != step:
          self._dropped.append(step)
        continue
      points.append(Metric(name, float(value), stamp, step))
    if points:
      self._report_dropped()
      self.client.log_batch(self._run_id, metrics=points)
      for m in points:
        self._held[m.key] = step
    if texts:
      self.write_texts(step, texts)

  def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
    """Text artifacts ``texts/NAME/step_N.txt`` (a step written again overwrites its file)."""
    if not self._enabled:
      return
    for key, text in texts.items():
      self.client.log_text(self._run_id, str(text),
                           f"texts/{mlflow_name(key)}/step_{int(step)}.txt")

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    if not self._enabled:
      return
    from mlflow.entities import Param
    self.client.log_batch(self._run_id, params=[
        Param(self._names(k), str(_hparam_value(v))) for k, v in hparams.items()])

  def flush(self) -> None:
    """Reports points not sent (a WARNING); every write reached the tracking store when it
    returned."""
    if self._enabled:
      self._report_dropped()

  def close(self) -> None:
    """Ends the run if this writer sets its status (see the class docstring): with the
    outcome a hook told, else ``FAILED`` while an exception is being handled, else
    ``FINISHED``. Later writes still go to the run."""
    if self._enabled and not self._closed:
      self._report_dropped()
      if self._ends_run and self._outcome is None:
        error = sys.exc_info()[1]
        self.mark_outcome("completed" if error is None else
                          "interrupted" if isinstance(error, KeyboardInterrupt) else "failed")
    self._closed = True


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


def _read_id(path: str) -> str | None:
  """The run id kept in file ``path``, or None (no file, or empty)."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    run_id = f.read().strip()
  return run_id or None


def _write_id(path: str, run_id: str) -> None:
  """Keeps ``run_id`` in file ``path`` (written to a temporary file, moved into place)."""
  if _read_id(path) == run_id:
    return
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(run_id + "\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _persisted_id(directory: str) -> str:
  """The W&B run id kept in ``directory/wandb-run-id`` (a new one written there if none)."""
  path = os.path.join(directory, ID_FILE)
  run_id = _read_id(path)
  if run_id is None:
    run_id = uuid.uuid4().hex[:12]  # W&B ids: lowercase letters and digits
    _write_id(path, run_id)
  return run_id
