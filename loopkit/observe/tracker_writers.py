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

This module holds :class:`MlflowWriter`; :class:`WandbWriter` lives in
:mod:`loopkit.observe.wandb_writer` and is importable from here.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Mapping
from typing import Any

from loopkit._internal.extras import require
from loopkit.observe._run_ids import _read_id, _write_id
from loopkit.observe.metric_writer import _hparam_value, _is_writer_process, _to_python
from loopkit.observe.text_writers import _TextOnly  # texts as rows; images, histograms skipped
from loopkit.observe.wandb_writer import (
  ID_FILE,  # noqa: F401  (re-exported)
  JOURNAL_FILE,  # noqa: F401  (re-exported)
  WandbWriter,
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
      if self._dropped and step > self._dropped[-1]:  # past the steps held: one warning
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
