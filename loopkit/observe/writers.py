"""Metric writers behind one small protocol (``write_scalars`` / ``flush`` / ``close``).

Writers take *global steps* (optimizer updates) and a dict of scalars. The
richer methods of CLU's ``clu.metric_writers.MetricWriter`` (same names and
signatures: ``write_images``, ``write_histograms``, ``write_texts``,
``write_hparams``) are optional: every writer here has them, and
:class:`MultiWriter` / :class:`AsyncWriter` skip a wrapped writer that lacks
one. Concrete writers:

* :class:`TensorBoardWriter`: TensorBoard event files through ``tensorboardX``
  (no TensorFlow import);
* :class:`JsonlWriter`: one JSON object per line;
* :class:`ConsoleWriter`: Python ``logging`` lines (absl's handler shows them
  under ``absl.app``); a row wider than 100 characters is a short aligned table
  (:func:`format_row`);
* :class:`~loopkit.observe.MlflowWriter`, :class:`~loopkit.observe.WandbWriter`
  (:mod:`loopkit.observe.tracker_writers`): MLflow and Weights & Biases runs;
* :class:`MultiWriter` fans out to several; :class:`AsyncWriter` moves the
  writing to a background thread so the training loop never waits on disk.

This module holds the writers that combine others (:class:`MultiWriter`,
:class:`AsyncWriter`, :func:`create_default_writer`) and adapt foreign ones
(:func:`as_writer`); the text writers live in :mod:`loopkit.observe.text_writers`, the calls
a hook makes on any writer (:func:`keep_rows_through`, :func:`mark_run_outcome`,
:func:`prints_to_console`) in :mod:`loopkit.observe.writer_calls`. All are importable from here.

:func:`create_default_writer` combines them. :func:`as_writer` takes the writers
users already have: CLU's ``metric_writers`` as they are, Flax's
``tensorboard.SummaryWriter`` through :class:`FlaxSummaryWriter`; hooks that take
a ``writer`` call it. Only process 0 writes on
multi-host: on the other processes every writer is a no-op (decided at
construction from ``jax.process_index()``).

Durability and resumes: the file writers flush at most ``flush_secs`` after a
write (checked at each write) and at every :meth:`flush`;
:class:`~loopkit.LoggingHook` flushes its writer at each checkpoint save, so
the rows a checkpoint covers are on disk before a kill can lose them. When a
file writer opens a directory or file that already holds rows (a resumed run),
its first write at step ``s`` drops the old rows at steps ``>= s`` (JSONL:
rewritten atomically; TensorBoard: a ``purge_step``), so after a kill and a
resume every step appears once. The trackers (:class:`~loopkit.observe.MlflowWriter`,
:class:`~loopkit.observe.WandbWriter`), which cannot take a point back, keep the first point
of a step instead, and :func:`mark_run_outcome` tells them how a run ended
(docs/observability.md, "Every writer across a kill").

=================  ===========  ===========  =========  ====  ===========
method             TensorBoard  JSONL        console    Null  Multi/Async
=================  ===========  ===========  =========  ====  ===========
write_scalars      scalars      row          line       --    fan out
write_texts        text         row          line       --    fan out
write_images       images       skipped      skipped    --    fan out
write_histograms   histograms   skipped      skipped    --    fan out
write_hparams      hparams      hparams row  line       --    fan out
=================  ===========  ===========  =========  ====  ===========

("skipped" writes one DEBUG log record.)

Example:
  >>> import tempfile, loopkit
  >>> d = tempfile.mkdtemp()
  >>> w = loopkit.observe.create_default_writer(d, console=False)
  >>> w.write_scalars(10, {"loss": 0.5})
  >>> w.close()
  >>> open(d + "/metrics.jsonl").read()
  '{"step": 10, "loss": 0.5}\\n'
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from loopkit.observe.metric_writer import (
  MetricWriter,
  NullWriter,
  _is_writer_process,
  _to_python,
)
from loopkit.observe.tensorboard_writer import TensorBoardWriter
from loopkit.observe.text_writers import ConsoleWriter, JsonlWriter, format_row
from loopkit.observe.writer_calls import (
  OUTCOMES,  # noqa: F401  (re-exported)
  keep_rows_through,
  mark_run_outcome,
  prints_to_console,
)

__all__ = ["AsyncWriter", "ConsoleWriter", "FlaxSummaryWriter", "JsonlWriter", "MetricWriter",
           "MultiWriter", "NullWriter", "TensorBoardWriter", "as_writer", "create_default_writer",
           "format_row", "keep_rows_through", "mark_run_outcome", "prints_to_console"]

log = logging.getLogger("loopkit")


def _call_optional(writer: Any, method: str, *args: Any) -> None:
  """Calls ``writer.method(*args)``; a user writer without that method is skipped."""
  fn = getattr(writer, method, None)
  if fn is None:
    log.debug("%s has no %s; skipped", type(writer).__name__, method)
    return
  fn(*args)


class MultiWriter:
  """Writes to several writers in order.

  Args:
    writers: the writers. Those without an optional method
      (``write_images`` ...) are skipped for it.
  """

  def __init__(self, writers: Sequence[MetricWriter]):
    self.writers = list(writers)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    for w in self.writers:
      w.write_scalars(step, scalars)

  def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
    for w in self.writers:
      _call_optional(w, "write_texts", step, texts)

  def write_images(self, step: int, images: Mapping[str, Any]) -> None:
    for w in self.writers:
      _call_optional(w, "write_images", step, images)

  def write_histograms(self, step: int, arrays: Mapping[str, Any],
                       num_buckets: Mapping[str, int] | None = None) -> None:
    for w in self.writers:
      _call_optional(w, "write_histograms", step, arrays, num_buckets)

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    for w in self.writers:
      _call_optional(w, "write_hparams", hparams)

  def keep_through(self, step: int) -> None:
    """:func:`keep_rows_through` of each writer."""
    for w in self.writers:
      keep_rows_through(w, step)

  def mark_outcome(self, outcome: str) -> None:
    """The ``mark_outcome`` of each writer that has one (:func:`mark_run_outcome`)."""
    for w in self.writers:
      fn = getattr(w, "mark_outcome", None)
      if callable(fn):
        fn(outcome)

  def prints_to_console(self) -> bool:
    """Whether one of the writers prints its rows (:func:`prints_to_console`)."""
    return any(prints_to_console(w) for w in self.writers)

  def flush(self) -> None:
    for w in self.writers:
      w.flush()

  def close(self) -> None:
    for w in self.writers:
      w.close()


_STOP = object()


class AsyncWriter:
  """Runs another writer on a background thread; the write methods only enqueue.

  Values are converted (a ``jax.Array`` fetched) on the background thread, so
  the caller never waits on the device or the disk. ``flush`` waits until
  everything queued is written and flushed. An exception raised by the wrapped
  writer is re-raised in the caller at its next write / ``flush`` / ``close``.

  Args:
    writer: the writer to run in the background.
    max_queue: the most pending writes; beyond it a write blocks
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
          if kind == "flush":
            self.writer.flush()
          else:
            _call_optional(self.writer, kind, *args)
      except BaseException as e:  # re-raised in the producer
        self._error = e
      finally:
        self._queue.task_done()

  def _raise_pending(self) -> None:
    if self._error is not None:
      err, self._error = self._error, None
      raise RuntimeError(f"the background metric writer failed: {err!r}") from err

  def keep_through(self, step: int) -> None:
    """:func:`keep_rows_through` of the wrapped writer, in order with the queued writes."""
    self._put("keep_through", step)

  def mark_outcome(self, outcome: str) -> None:
    """The wrapped writer's ``mark_outcome`` (:func:`mark_run_outcome`), in order with the
    queued writes."""
    if callable(getattr(self.writer, "mark_outcome", None)):
      self._put("mark_outcome", outcome)

  def prints_to_console(self) -> bool:
    """Whether the wrapped writer prints its rows (:func:`prints_to_console`)."""
    return prints_to_console(self.writer)

  def _put(self, kind: str, *args: Any) -> None:
    self._raise_pending()
    if self._closed:
      raise RuntimeError(f"{kind} on a closed AsyncWriter")
    self._queue.put((kind, args))

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    self._put("write_scalars", int(step), dict(scalars))

  def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
    self._put("write_texts", int(step), dict(texts))

  def write_images(self, step: int, images: Mapping[str, Any]) -> None:
    self._put("write_images", int(step), dict(images))

  def write_histograms(self, step: int, arrays: Mapping[str, Any],
                       num_buckets: Mapping[str, int] | None = None) -> None:
    self._put("write_histograms", int(step), dict(arrays),
              None if num_buckets is None else dict(num_buckets))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    self._put("write_hparams", dict(hparams))

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
      "object with write_scalars(step, scalars) (loopkit.observe.writers, clu.metric_writers) or "
      "scalar(tag, value, step) (flax.metrics.tensorboard.SummaryWriter)")
