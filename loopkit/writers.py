"""Metric writers behind one small protocol (``write_scalars`` / ``flush`` / ``close``).

Writers take *global steps* (optimizer updates) and a dict of scalars. Concrete
writers:

* :class:`TensorBoardWriter`: TensorBoard event files through ``tensorboardX``
  (no TensorFlow import);
* :class:`JsonlWriter`: one JSON object per line;
* :class:`ConsoleWriter`: Python ``logging`` lines (absl's handler shows them
  under ``absl.app``);
* :class:`MultiWriter` fans out to several; :class:`AsyncWriter` moves the
  writing to a background thread so the training loop never waits on disk.

:func:`create_default_writer` combines them. :func:`as_writer` takes the writers
users already have: CLU's ``metric_writers`` as they are, Flax's
``tensorboard.SummaryWriter`` through :class:`FlaxSummaryWriter`; hooks that take
a ``writer`` call it. Only process 0 writes on
multi-host: on the other processes every writer is a no-op (decided at
construction from ``jax.process_index()``).

Example:
  >>> import tempfile, loopkit
  >>> d = tempfile.mkdtemp()
  >>> w = loopkit.create_default_writer(d, console=False)
  >>> w.write_scalars(10, {"loss": 0.5})
  >>> w.close()
  >>> open(d + "/metrics.jsonl").read()
  '{"step": 10, "loss": 0.5}\\n'
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from loopkit.extras import require

__all__ = ["AsyncWriter", "ConsoleWriter", "FlaxSummaryWriter", "JsonlWriter", "MetricWriter",
           "MultiWriter", "NullWriter", "TensorBoardWriter", "as_writer", "create_default_writer"]

log = logging.getLogger("loopkit")


class MetricWriter(Protocol):
  """What a metric writer provides. Steps are global steps (optimizer updates)."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Writes ``scalars`` (name -> number; numpy/JAX scalars allowed) at ``step``."""
    ...

  def flush(self) -> None:
    """Makes everything written so far durable (on disk / emitted)."""
    ...

  def close(self) -> None:
    """Flushes and releases resources; later writes are errors or no-ops."""
    ...


def _is_writer_process() -> bool:
  return jax.process_index() == 0


def _to_python(value: Any) -> Any:
  """A JSON-friendly Python scalar: numpy / JAX scalars become int, float or bool."""
  if isinstance(value, (bool, int, float, str)) or value is None:
    return value
  arr = np.asarray(value)  # a jax.Array is fetched here (on the writer's thread)
  if arr.ndim != 0:
    raise ValueError(f"metric writers take scalars, got an array of shape {arr.shape}")
  return arr.item()


class NullWriter:
  """Discards everything (the writer of processes other than 0)."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    del step, scalars

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass


class JsonlWriter:
  """Appends one JSON object per line: ``{"step": int, name: value, ...}``.

  Non-finite floats are written as ``NaN`` / ``Infinity`` (Python's ``json``
  extension), so a NaN loss is recorded rather than dropped.

  Args:
    path: the ``.jsonl`` file (parent directories are created).

  Writes only on process 0. Not thread-safe (wrap in :class:`AsyncWriter` to
  write from a background thread).
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    self._f = None
    if _is_writer_process():
      os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
      self._f = open(self.path, "a")

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if "step" in scalars:
      raise ValueError("a scalar named 'step' would overwrite the row's step field; "
                       "rename the metric")
    if self._f is None:
      return
    row = {"step": int(step)}
    row.update({k: _to_python(v) for k, v in scalars.items()})
    self._f.write(json.dumps(row) + "\n")

  def flush(self) -> None:
    if self._f is not None:
      self._f.flush()

  def close(self) -> None:
    if self._f is not None:
      self._f.close()
      self._f = None


class TensorBoardWriter:
  """TensorBoard event files via ``tensorboardX`` (no TensorFlow needed).

  Each scalar becomes a ``simple_value`` summary (stored as float32) tagged with
  its name, at the given global step; string values become text summaries.

  Args:
    logdir: directory for the ``events.out.tfevents.*`` file (created).
    flush_secs: how often tensorboardX flushes on its own (seconds).

  Raises:
    ImportError: if ``tensorboardX`` is not installed (``pip install 'loopkit[observability]'``).

  Writes only on process 0. Not thread-safe (wrap in :class:`AsyncWriter`).
  """

  def __init__(self, logdir: str | os.PathLike, *, flush_secs: float = 30.0):
    self.logdir = os.fspath(logdir)
    self._w = None
    if _is_writer_process():
      SummaryWriter = require("tensorboardX", "loopkit.TensorBoardWriter").SummaryWriter
      self._w = SummaryWriter(self.logdir, flush_secs=flush_secs)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if self._w is None:
      return
    for name, value in scalars.items():
      value = _to_python(value)
      if isinstance(value, str):
        self._w.add_text(name, value, global_step=int(step))
      else:
        self._w.add_scalar(name, float(value), global_step=int(step))

  def flush(self) -> None:
    if self._w is not None:
      self._w.flush()

  def close(self) -> None:
    if self._w is not None:
      self._w.close()
      self._w = None


class ConsoleWriter:
  """Logs ``step N: name=value, ...`` lines to a Python logger.

  Args:
    logger: the logger (default ``logging.getLogger("loopkit")``; under
      ``absl.app`` its handler prints these lines like ``absl.logging.info``).
    level: the logging level (default INFO).

  Logs only on process 0. Thread-safe (Python logging is).
  """

  def __init__(self, logger: logging.Logger | None = None, *, level: int = logging.INFO):
    self.logger = logger if logger is not None else log
    self.level = level
    self._enabled = _is_writer_process()

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if not self._enabled:
      return
    parts = []
    for k, v in scalars.items():
      v = _to_python(v)
      parts.append(f"{k}={v:.6g}" if isinstance(v, float) and math.isfinite(v) else f"{k}={v}")
    self.logger.log(self.level, "step %d: %s", int(step), ", ".join(parts))

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass


class MultiWriter:
  """Writes to several writers in order.

  Args:
    writers: the writers.
  """

  def __init__(self, writers: Sequence[MetricWriter]):
    self.writers = list(writers)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    for w in self.writers:
      w.write_scalars(step, scalars)

  def flush(self) -> None:
    for w in self.writers:
      w.flush()

  def close(self) -> None:
    for w in self.writers:
      w.close()


_STOP = object()


class AsyncWriter:
  """Runs another writer on a background thread; ``write_scalars`` only enqueues.

  Values are converted (a ``jax.Array`` fetched) on the background thread, so
  the caller never waits on the device or the disk. ``flush`` waits until
  everything queued is written and flushed. An exception raised by the wrapped
  writer is re-raised in the caller at its next ``write_scalars`` / ``flush``
  / ``close``.

  Args:
    writer: the writer to run in the background.
    max_queue: the most pending writes; beyond it ``write_scalars`` blocks
      (back-pressure instead of unbounded memory).

  Thread-safe for one or more producer threads.
  """

  def __init__(self, writer: MetricWriter, *, max_queue: int = 1000):
    self.writer = writer
    self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
    self._error: BaseException | None = None
    self._closed = False
    self._thread = threading.Thread(target=self._work, daemon=True, name="loopkit-writer")
    self._thread.start()

  def _work(self) -> None:
    while True:
      item = self._queue.get()
      try:
        if item is _STOP:
          return
        if self._error is None:
          kind, args = item
          if kind == "scalars":
            self.writer.write_scalars(*args)
          else:
            self.writer.flush()
      except BaseException as e:  # re-raised in the producer
        self._error = e
      finally:
        self._queue.task_done()

  def _raise_pending(self) -> None:
    if self._error is not None:
      err, self._error = self._error, None
      raise RuntimeError(f"the background metric writer failed: {err!r}") from err

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    self._raise_pending()
    if self._closed:
      raise RuntimeError("write_scalars on a closed AsyncWriter")
    self._queue.put(("scalars", (int(step), dict(scalars))))

  def flush(self) -> None:
    if self._closed:
      return
    self._queue.put(("flush", ()))
    self._queue.join()
    self._raise_pending()

  def close(self) -> None:
    if self._closed:
      return
    try:
      self.flush()
    finally:
      self._closed = True
      self._queue.put(_STOP)
      self._thread.join()
      self.writer.close()


def create_default_writer(logdir: str | os.PathLike | None, *, asynchronous: bool = True,
                          tensorboard: bool = True, jsonl: bool = True,
                          console: bool = True) -> MetricWriter:
  """The usual writer: TensorBoard + JSON lines under ``logdir`` + console lines.

  Args:
    logdir: directory for ``events.out.tfevents.*`` and ``metrics.jsonl``
      (None: console only).
    asynchronous: write the files on a background thread (:class:`AsyncWriter`).
    tensorboard: include a :class:`TensorBoardWriter`.
    jsonl: include a :class:`JsonlWriter` at ``logdir/metrics.jsonl``.
    console: include a :class:`ConsoleWriter` (synchronous: log lines keep
      their order with the rest of the program's logging).

  Returns:
    A writer; a :class:`NullWriter` on processes other than 0.
  """
  if not _is_writer_process():
    return NullWriter()
  files: list[MetricWriter] = []
  if logdir is not None:
    if tensorboard:
      files.append(TensorBoardWriter(logdir))
    if jsonl:
      files.append(JsonlWriter(os.path.join(os.fspath(logdir), "metrics.jsonl")))
  writers: list[MetricWriter] = []
  if files:
    writers.append(AsyncWriter(MultiWriter(files)) if asynchronous else MultiWriter(files))
  if console:
    writers.append(ConsoleWriter())
  return writers[0] if len(writers) == 1 else MultiWriter(writers)


class FlaxSummaryWriter:
  """Adapts Flax's ``flax.metrics.tensorboard.SummaryWriter`` to :class:`MetricWriter`.

  Flax's writer (the one Flax's examples make) writes one tag at a time:
  ``writer.scalar(tag, value, step)``; this calls it once per scalar.

  Args:
    writer: the Flax ``SummaryWriter`` (or any object with ``scalar(tag,
      value, step)``, and optionally ``flush()`` and ``close()``).

  Thread-safety and multi-host behaviour are the wrapped writer's (Flax's
  writes on every process that makes one: make it on process 0 only).
  """

  def __init__(self, writer: Any):
    self.writer = writer

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    for tag, value in scalars.items():
      self.writer.scalar(tag, _to_python(value), int(step))

  def flush(self) -> None:
    if hasattr(self.writer, "flush"):
      self.writer.flush()

  def close(self) -> None:
    if hasattr(self.writer, "close"):
      self.writer.close()


def as_writer(writer: Any) -> MetricWriter:
  """The :class:`MetricWriter` for a writer users already have.

  * anything with ``write_scalars(step, scalars)``: returned as it is. This
    covers loopkit's writers and CLU's ``clu.metric_writers`` (whose
    ``MetricWriter`` interface is ``write_scalars(step, scalars)``,
    ``write_images``, ..., ``flush()``, ``close()``: e.g. the writer of
    ``metric_writers.create_default_writer(workdir)``, as in Flax's linen
    examples);
  * Flax's ``flax.metrics.tensorboard.SummaryWriter`` (``scalar(tag, value,
    step)``, as in Flax's NNX examples): wrapped in :class:`FlaxSummaryWriter`.

  Raises:
    TypeError: neither shape; the message names the object's type.
  """
  if callable(getattr(writer, "write_scalars", None)):
    return writer
  if callable(getattr(writer, "scalar", None)):
    return FlaxSummaryWriter(writer)
  raise TypeError(
      f"{type(writer).__module__}.{type(writer).__qualname__} is not a metric writer: give an "
      "object with write_scalars(step, scalars) (loopkit.writers, clu.metric_writers) or "
      "scalar(tag, value, step) (flax.metrics.tensorboard.SummaryWriter)")
