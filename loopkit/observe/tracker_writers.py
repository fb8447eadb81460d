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

import logging
import os
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

from loopkit._internal.extras import require
from loopkit.observe.metric_writer import _hparam_value, _is_writer_process, _to_python
from loopkit.observe.writers import _TextOnly  # texts as rows; images, histograms skipped

__all__ = ["MlflowWriter", "WandbWriter", "mlflow_name"]

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


class MlflowWriter(_TextOnly):
  """Writes rows to an MLflow run through ``mlflow.MlflowClient`` (no global MLflow state).

  Each numeric scalar is a metric point ``(name, float(value), timestamp, step)``: one
  ``log_batch`` per row, at loopkit's global step, the value as JSONL writes it, as a
  Python float (ints such as ``examples_seen`` too; NaN and infinities kept). Names go
  through :func:`mlflow_name` (MLflow forbids ``@ [ ] ( ) ,`` and more: they become ``_``).
  String values and :meth:`write_texts` become text artifacts ``texts/NAME/step_N.txt``.
  :meth:`write_hparams` logs the run's params (``str`` of the value: MLflow params are
  strings, and set once: a second value for the same name is MLflow's error).

  Which run: ``run`` (an ``mlflow.entities.Run`` or a run id; e.g. to continue a run after
  a resume: ``MlflowWriter(run=writer.run_id)``), else the active run of
  ``mlflow.start_run()`` if there is one, else a new run in ``experiment`` (made if missing;
  None: MLflow's default experiment) named ``run_name``. The writer ends (``FINISHED``) only
  a run it created, at :meth:`close`.

  Resumes: MLflow keeps every point it is given and deletes none, so after a kill and a
  resume from the checkpoint at ``S`` the steps the killed run logged past ``S`` hold two
  points each (the killed run's and the resumed run's: equal, loopkit's metric rows being
  bitwise those of an uninterrupted run, except the host-clock ``throughput/*`` keys).
  ``metrics.jsonl`` holds each step once.

  Args:
    run: the run to write to (see above).
    experiment: the experiment of a new run (its name).
    run_name: the name of a new run.
    tracking_uri: MLflow's tracking URI (None: MLflow's default, ``MLFLOW_TRACKING_URI``);
      e.g. ``"file:///path/mlruns"`` (MLflow 3 wants ``MLFLOW_ALLOW_FILE_STORE=true`` for a
      file store), ``"sqlite:///mlflow.db"`` or a server's ``http://`` address.

  Raises:
    ImportError: MLflow is not installed (``pip install 'loopkit[mlflow]'``).
    ValueError (at a write): a name MLflow cannot take (:func:`mlflow_name`), or two keys of
      a run mapped to one name; the message names them.

  Writes only on process 0 (elsewhere every method is a no-op and MLflow is not imported).
  Not thread-safe (wrap in :class:`~loopkit.observe.AsyncWriter`).
  """

  def __init__(self, run: Any = None, *, experiment: str | None = None,
               run_name: str | None = None, tracking_uri: str | None = None):
    self._enabled = _is_writer_process()
    self.run_id: str | None = None
    self._owns_run = False
    self._names = _Names(mlflow_name)
    self._closed = False
    if not self._enabled:
      return
    mlflow = require("mlflow", "loopkit.observe.MlflowWriter")
    from mlflow.tracking import MlflowClient
    self.client = MlflowClient(tracking_uri)
    if run is None and experiment is None and mlflow.active_run() is not None:
      run = mlflow.active_run()
    if run is not None:
      self.run_id = run if isinstance(run, str) else run.info.run_id
      self.client.get_run(self.run_id)  # fails now if there is no such run
    else:
      experiment_id = "0"
      if experiment is not None:
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (found.experiment_id if found is not None
                         else self.client.create_experiment(experiment))
      self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
      self._owns_run = True

  @property
  def _run_id(self) -> str:
    """``run_id`` where writes are enabled (``__init__`` sets it there; None elsewhere)."""
    assert self.run_id is not None
    return self.run_id

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if not self._enabled:
      return
    from mlflow.entities import Metric
    stamp = int(time.time() * 1000)
    points, texts = [], {}
    for key, value in scalars.items():
      value = _to_python(value)
      if isinstance(value, str):
        texts[key] = value
      else:
        points.append(Metric(self._names(key), float(value), stamp, int(step)))
    if points:
      self.client.log_batch(self._run_id, metrics=points)
    if texts:
      self.write_texts(step, texts)

  def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
    if not self._enabled:
      return
    for key, text in texts.items():
      self.client.log_text(self._run_id, str(text), f"texts/{mlflow_name(key)}/step_{int(step)}.txt")

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    if not self._enabled:
      return
    from mlflow.entities import Param
    self.client.log_batch(self._run_id, params=[
        Param(self._names(k), str(_hparam_value(v))) for k, v in hparams.items()])

  def flush(self) -> None:
    """Nothing to do: every write reached the tracking store when it returned."""

  def close(self) -> None:
    """Ends the run (``FINISHED``) if this writer created it; later writes still go to it."""
    if self._enabled and self._owns_run and not self._closed:
      self.client.set_terminated(self._run_id)
    self._closed = True


ID_FILE = "wandb-run-id"


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
  ``wandb sync`` later.

  Resumes: W&B steps only increase: it drops a row at a step below the run's current step
  (with a warning in its debug log). With ``dir`` given (and no ``id`` in
  ``init_kwargs``), the run's id is kept in ``dir/wandb-run-id`` and the run made with
  ``resume="allow"``, so a job restarted in the same workdir continues the same W&B run
  (online; W&B's server knows its last step). The writer sends no row at a step below the
  run's step: after a kill and a resume from the checkpoint at ``S`` (or a second
  ``loop.run`` of the same process from an earlier checkpoint), the rows the killed run
  logged past ``S`` stay, and the resumed run's rows at those steps are dropped, with one
  WARNING per resume naming the steps. Those rows hold the same metric values (loopkit's
  rows are bitwise those of an uninterrupted run), except the host-clock ``throughput/*``
  keys. (An offline run is a new directory per process: W&B's ``resume`` needs its server.)

  Args:
    run: the run to write to (see above).
    project: the project of a new run.
    dir: the directory of a new run's files (``dir/wandb/``) and of its id file.
    mode: ``"online"``, ``"offline"`` or ``"disabled"`` (None: W&B's default, ``WANDB_MODE``).
    **init_kwargs: more arguments of ``wandb.init`` for a new run (``name``, ``config``,
      ``entity``, ``id``, ``resume``, ``tags``, ...).

  Raises:
    ImportError: ``wandb`` is not installed (``pip install 'loopkit[wandb]'``).

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
      run = wandb.init(project=project, dir=None if dir is None else os.fspath(dir), mode=mode,
                       **init_kwargs)
      self._owns_run = True
    self.run = run
    self._held = int(run.step) - 1  # a resumed run continues at its step (0: a new run)

  def keep_through(self, step: int) -> None:
    """Declares the run continues from a state at ``step``: W&B keeps the rows it holds past
    it, so the rows this run writes again at those steps are not sent (one WARNING)."""
    if self._last_step > step:
      self._held = max(self._held, self._last_step)

  def _report_dropped(self) -> None:
    if self._dropped:
      log.warning("W&B run %s already holds steps up to %d (its steps only increase): the rows "
                  "at steps %d..%d were not sent again; W&B keeps the earlier ones",
                  getattr(self.run, "id", "?"), max(self._held, self._last_step),
                  min(self._dropped), max(self._dropped))
      self._dropped = []

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if not self._enabled:
      return
    step = int(step)
    if step <= self._held or step < self._last_step:
      if not self._dropped or self._dropped[-1] != step:
        self._dropped.append(step)
      return
    self._report_dropped()
    self._last_step = step
    self.run.log({k: _to_python(v) for k, v in scalars.items()}, step=step)

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    if self._enabled:
      self.run.config.update({k: _hparam_value(v) for k, v in hparams.items()},
                             allow_val_change=True)

  def flush(self) -> None:
    """Reports rows not sent (a WARNING); W&B's service process writes the rest itself."""
    if self._enabled:
      self._report_dropped()

  def close(self) -> None:
    """Finishes the run (its last row committed, files closed) if this writer made it."""
    if not self._enabled:
      return
    self._report_dropped()
    if self._owns_run and self.run is not None:
      self.run.finish()
      self._owns_run = False


def _persisted_id(directory: str) -> str:
  """The W&B run id kept in ``directory/wandb-run-id`` (a new one written there if none)."""
  path = os.path.join(directory, ID_FILE)
  if os.path.exists(path):
    with open(path) as f:
      run_id = f.read().strip()
    if run_id:
      return run_id
  run_id = uuid.uuid4().hex[:12]  # W&B ids: lowercase letters and digits
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(run_id + "\n")
  os.replace(tmp, path)
  return run_id
