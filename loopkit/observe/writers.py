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

import json
import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from loopkit._internal.compat import clu_wrapped_writers
from loopkit.observe.metric_writer import (
  MetricWriter,
  NullWriter,
  _hparam_value,
  _is_writer_process,
  _skip,
  _to_python,
)
from loopkit.observe.tensorboard_writer import TensorBoardWriter

__all__ = ["AsyncWriter", "ConsoleWriter", "FlaxSummaryWriter", "JsonlWriter", "MetricWriter",
           "MultiWriter", "NullWriter", "TensorBoardWriter", "as_writer", "create_default_writer",
           "format_row", "keep_rows_through", "mark_run_outcome", "prints_to_console"]

log = logging.getLogger("loopkit")


class _TextOnly:
  """Texts as scalar rows; images and histograms skipped (a DEBUG record), for writers
  that keep only text (JSONL, console)."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    raise NotImplementedError

  def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
    self.write_scalars(step, {k: str(v) for k, v in texts.items()})

  def write_images(self, step: int, images: Mapping[str, Any]) -> None:
    _skip(self, "images", step, images)

  def write_histograms(self, step: int, arrays: Mapping[str, Any],
                       num_buckets: Mapping[str, int] | None = None) -> None:
    del num_buckets
    _skip(self, "histograms", step, arrays)


class JsonlWriter(_TextOnly):
  """Appends one JSON object per line: ``{"step": int, name: value, ...}``.

  Non-finite floats are written as ``NaN`` / ``Infinity`` (Python's ``json``
  extension), so a NaN loss is recorded rather than dropped. Texts are rows
  like scalars (string values); hparams are one row ``{"hparams": {...}}``
  (no step); images and histograms are skipped (a DEBUG log record).

  Resumes: the file is opened at the first write. If it already holds rows,
  the first row written first drops every old row past the run's start (and a
  line cut short by a kill): at steps ``> S`` after :meth:`keep_through`
  ``(S)`` (the loop's hooks call it with the step the run continues from,
  restores applied, at the start of every run: :func:`keep_rows_through`; a
  second run of the same process with this writer is trimmed the same way),
  else at steps ``>= s``, the first row's step. The file is rewritten to a
  temporary file and moved into place with ``os.replace`` (atomic), so after
  a kill at step 75 and a resume
  from a checkpoint at 50, the file holds each logged step once, the rows at
  50 included. Rows without a step (hparams) are kept.

  Args:
    path: the ``.jsonl`` file (parent directories are created).
    flush_secs: a write flushes the file when the last flush is at least this
      old (seconds; 0 flushes at every write). :meth:`flush` always flushes.
    clock: monotonic clock in seconds (inject a fake one in tests).

  Writes only on process 0. Not thread-safe (wrap in :class:`AsyncWriter` to
  write from a background thread).
  """

  def __init__(self, path: str | os.PathLike, *, flush_secs: float = 10.0,
               clock: Callable[[], float] = time.monotonic):
    self.path = os.fspath(path)
    self.flush_secs = flush_secs
    self.clock = clock
    self._f: TextIO | None = None
    self._checked = False  # the old rows were checked against the first stepped row
    self._keep_through: int | None = None  # keep_through(S): old rows at steps <= S stay
    self._enabled = _is_writer_process()
    self._last_flush = clock()
    if self._enabled:
      os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)

  def keep_through(self, step: int) -> None:
    """Declares the run continues from a state at ``step``: before its next row with a step,
    the rows in the file at steps ``<= step`` are kept and the later ones dropped. Also in
    a later run of the same process (a rerun after an error, from a checkpoint before rows
    this writer wrote): those rows go, so each step is in the file once."""
    self._keep_through = int(step)
    self._checked = False

  def _open(self, first_step: int | None) -> None:
    """Opens the file for appending; at the first row with a step, drops the old rows past
    the run's start first (closing and reopening the file if it was open)."""
    if first_step is not None:
      self._checked = True
      if self._f is not None:
        self._f.close()
        self._f = None
    if first_step is not None and os.path.exists(self.path) and os.path.getsize(self.path):
      if self._keep_through is not None:
        first_step = self._keep_through + 1
      kept, dropped = [], 0
      with open(self.path) as f:
        for line in f:
          try:
            row = json.loads(line)
          except ValueError:  # a line cut short by a kill
            dropped += 1
            continue
          if isinstance(row, dict) and isinstance(row.get("step"), int) and (
              row["step"] >= first_step):
            dropped += 1
            continue
          kept.append(line if line.endswith("\n") else line + "\n")
      if dropped:
        tmp = f"{self.path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
          f.writelines(kept)
          f.flush()
          os.fsync(f.fileno())
        os.replace(tmp, self.path)
        log.info("%s: dropped %d rows at steps >= %d (written again by this run)",
                 self.path, dropped, first_step)
    self._f = open(self.path, "a")

  def _write_row(self, row: dict[str, Any]) -> None:
    if self._f is None or (not self._checked and "step" in row):
      self._open(row.get("step"))
    assert self._f is not None  # opened above
    self._f.write(json.dumps(row) + "\n")
    if self.clock() - self._last_flush >= self.flush_secs:
      self.flush()

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if "step" in scalars:
      raise ValueError("a scalar named 'step' would overwrite the row's step field; "
                       "rename the metric")
    if not self._enabled:
      return
    row = {"step": int(step)}
    row.update({k: _to_python(v) for k, v in scalars.items()})
    self._write_row(row)

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    if self._enabled:
      self._write_row({"hparams": {k: _hparam_value(v) for k, v in hparams.items()}})

  def flush(self) -> None:
    self._last_flush = self.clock()
    if self._f is not None:
      self._f.flush()

  def close(self) -> None:
    if self._f is not None:
      self._f.close()
      self._f = None


def _console_value(value: Any) -> str:
  v = _to_python(value)
  return f"{v:.6g}" if isinstance(v, float) and math.isfinite(v) else str(v)


def format_row(step: int, scalars: Mapping[str, Any], line_width: int | None = 100) -> str:
  """A row as :class:`ConsoleWriter` prints it: one line, or a short aligned table.

  A row whose one-line form ``step N: name=value, ...`` fits in ``line_width``
  characters (or any row when ``line_width`` is None or 0) is that line. A
  wider row is a table: the first line is ``step N:`` and the names without a
  ``/`` (``name=value, ...``, if they fit; else they form a table of their own);
  then the names with one are grouped by their part up to the first ``/``
  (``throughput/``, ``goodput/``), a group per block of lines: the group in a
  left column, then cells ``name  value`` of one width per group, as many per
  line as fit in ``line_width``, in the row's order. Values are ``.6g`` for
  finite floats, else ``str``.

  Args:
    step: the row's step.
    scalars: the row (numpy / JAX scalars are converted).
    line_width: the widest line wanted, in characters.

  Returns:
    The text, its lines separated by newlines (none at the end).

  Example:
    >>> print(format_row(7, {"loss": 0.5, "goodput/job_secs": 12.0, "goodput/steps": 7,
    ...                      "goodput/goodput": 0.75}, line_width=40))
    step 7: loss=0.5
      goodput/ job_secs    12
               steps        7
               goodput   0.75
  """
  values = {k: _console_value(v) for k, v in scalars.items()}
  line = f"step {int(step)}: " + ", ".join(f"{k}={v}" for k, v in values.items())
  if not line_width or len(line) <= line_width:
    return line
  groups: dict[str, list[tuple[str, str]]] = {}
  for k, v in values.items():
    label, sep, name = k.partition("/")
    groups.setdefault(label + sep if sep else "", []).append((name if sep else k, v))
  lines = [f"step {int(step)}:"]
  plain = groups.pop("", [])
  head = ", ".join(f"{k}={v}" for k, v in plain)
  if plain and len(lines[0]) + 1 + len(head) <= line_width:
    lines[0] += " " + head
  elif plain:
    groups = {"": plain, **groups}
  label_width = max((len(label) for label in groups), default=0)
  for label, cells in groups.items():
    name_width = max(len(n) for n, _ in cells)
    value_width = max(len(v) for _, v in cells)
    cell_width = name_width + 2 + value_width
    column = label_width + 1 if label_width else 0  # the groups' column, if any
    per_line = max(1, (line_width - 2 - column + 3) // (cell_width + 3))
    for i in range(0, len(cells), per_line):
      left = f"{label if i == 0 else '':<{label_width}} " if column else ""
      text = "   ".join(f"{n:<{name_width}}  {v:>{value_width}}"
                        for n, v in cells[i:i + per_line])
      lines.append(f"  {left}{text}".rstrip())
  return "\n".join(lines)


class ConsoleWriter(_TextOnly):
  """Logs ``step N: name=value, ...`` lines to a Python logger.

  A row wider than ``line_width`` (e.g. a ``goodput/*`` row of 15 keys, or a
  training row with its ``throughput/*`` keys) is logged as one record of a
  few aligned lines instead, its keys grouped by their prefix
  (:func:`format_row`); the file writers keep every key as it is. Texts are
  rows like scalars, hparams one ``hparams: name=value, ...`` line; images and
  histograms are skipped (a DEBUG log record).

  Args:
    logger: the logger (default ``logging.getLogger("loopkit")``; under
      ``absl.app`` its handler prints these lines like ``absl.logging.info``).
    level: the logging level (default INFO).
    line_width: rows wider than this many characters are printed as a table
      (:func:`format_row`); None or 0: always one line.

  Logs only on process 0. Thread-safe (Python logging is).
  """

  def __init__(self, logger: logging.Logger | None = None, *, level: int = logging.INFO,
               line_width: int | None = 100):
    self.logger = logger if logger is not None else log
    self.level = level
    self.line_width = line_width
    self._enabled = _is_writer_process()

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if not self._enabled:
      return
    self.logger.log(self.level, "%s", format_row(step, scalars, self.line_width))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    if self._enabled:
      self.logger.log(self.level, "hparams: %s",
                      ", ".join(f"{k}={_hparam_value(v)}" for k, v in hparams.items()))

  def prints_to_console(self) -> bool:
    """Whether a row written now is printed: on process 0, while its logger takes its level
    (:func:`prints_to_console`)."""
    return self._enabled and self.logger.isEnabledFor(self.level)

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass


def keep_rows_through(writer: Any, step: int) -> None:
  """Tells ``writer`` the run continues from a state at ``step`` (restores applied).

  A file writer that finds rows of an earlier run (:class:`JsonlWriter`,
  :class:`~loopkit.observe.TensorBoardWriter`) then keeps those at steps ``<= step``
  and drops, or hides, the later ones, which the killed run wrote past its
  checkpoint. :class:`MultiWriter` and :class:`AsyncWriter` pass it on; a writer
  without ``keep_through`` is left alone. :class:`~loopkit.LoggingHook`,
  :class:`~loopkit.EvalHook` and :class:`~loopkit.observe.GoodputHook` call it
  from ``adjust_ledger``, before they write.
  """
  fn = getattr(writer, "keep_through", None)
  if callable(fn):
    fn(int(step))


OUTCOMES = ("completed", "interrupted", "failed")


def mark_run_outcome(writer: Any, *, status: str | None = None,
                     error: BaseException | None = None) -> str:
  """Tells ``writer`` how a ``run`` of the loop ended, so a tracker marks its run.

  The outcome is ``"completed"`` (training ended: ``loop.status`` ``"completed"``,
  ``"data_exhausted"``, ``"stopped"``, ``"early stopped"``...), ``"interrupted"`` (a
  preemption or a time limit, which a resume continues, or a ``KeyboardInterrupt``) or
  ``"failed"`` (any other exception). A writer with ``mark_outcome(outcome)`` takes it
  (:class:`~loopkit.observe.MlflowWriter`: ``FINISHED`` / ``KILLED`` / ``FAILED``;
  :class:`~loopkit.observe.WandbWriter`: the exit code of ``run.finish``);
  :class:`MultiWriter` and :class:`AsyncWriter` pass it on; other writers are left alone.
  :class:`~loopkit.LoggingHook` and :class:`~loopkit.EvalHook` call it from ``on_run_end``
  (with ``ctx.status``) and ``on_run_error`` (with the error).

  Args:
    writer: a metric writer, or None.
    status: the run's status (``ctx.status``), when it returned.
    error: the exception that ended it, when it raised.

  Returns:
    The outcome.
  """
  if error is not None:
    outcome = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
  else:
    from loopkit.core.run import RESUMABLE_STOPS  # pylint: disable=g-import-not-at-top
    outcome = "interrupted" if status in RESUMABLE_STOPS else "completed"
  fn = getattr(writer, "mark_outcome", None)
  if callable(fn):
    fn(outcome)
  return outcome


def prints_to_console(writer: Any) -> bool:
  """Whether a row written to ``writer`` now is also printed on the console.

  A hook that writes rows to a writer and also logs them (:class:`~loopkit.LoggingHook`,
  :class:`~loopkit.EvalHook`, :class:`~loopkit.observe.GoodputHook`'s summary) asks this
  before each row and logs its own line only when the answer is no, so each row is printed
  once, whatever the writer. Asked at every row, as the logging set-up may change after the
  writer is made (``absl.app.run`` turns absl's INFO lines on).

  * A writer with a ``prints_to_console()`` method answers itself: :class:`ConsoleWriter`
    (on process 0, while its logger takes its level); :class:`MultiWriter` and
    :class:`AsyncWriter` (any writer they wrap; so :func:`create_default_writer`'s writer
    with ``console=True``). A writer of your own that prints its rows can say so the same way.
  * CLU's ``LoggingWriter`` logs through absl: it prints while absl's logger takes INFO
    records and a handler shows them (after ``absl.app.run`` parsed the flags, or a
    ``logging.basicConfig(level=logging.INFO)``; not before, when absl shows only
    warnings). CLU's ``MultiWriter``, ``AsyncMultiWriter`` (``create_default_writer``) and
    ``AsyncWriter`` print when a writer they wrap does.
  * Any other writer (JSONL, TensorBoard, Flax's ``SummaryWriter``, None): no.

  Args:
    writer: a metric writer, or None.

  Returns:
    True when the row reaches the console through the writer.
  """
  if writer is None:
    return False
  own = getattr(writer, "prints_to_console", None)
  if callable(own):
    return bool(own())
  if _is_clu_logging_writer(writer):
    return _shows(logging.getLogger("absl"), logging.INFO)
  inner = clu_wrapped_writers(writer)
  return inner is not None and any(prints_to_console(w) for w in inner)


def _is_clu_logging_writer(writer: Any) -> bool:
  """Whether ``writer`` is CLU's ``LoggingWriter`` (its module is loaded if it is one: CLU is
  never imported here)."""
  module = sys.modules.get("clu.metric_writers.logging_writer")
  cls = getattr(module, "LoggingWriter", None)
  return isinstance(cls, type) and isinstance(writer, cls)


def _shows(logger: logging.Logger, level: int) -> bool:
  """Whether a record of ``level`` logged to ``logger`` now reaches a handler that takes it."""
  if not logger.isEnabledFor(level):
    return False
  current: logging.Logger | None = logger
  while current is not None:
    if any(h.level <= level for h in current.handlers):
      return True
    if not current.propagate:
      return False
    current = current.parent
  return logging.lastResort is not None and logging.lastResort.level <= level


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
