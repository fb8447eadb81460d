"""The writers that keep text: :class:`JsonlWriter` (one JSON object per line) and
:class:`ConsoleWriter` (Python ``logging`` lines, a wide row as a short table:
:func:`format_row`).

Both keep texts as rows and skip images and histograms (a DEBUG record). Re-exported by
:mod:`loopkit.observe.writers` and :mod:`loopkit.observe`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from loopkit.observe.metric_writer import (
  _hparam_value,
  _is_writer_process,
  _skip,
  _to_python,
)

__all__ = ["ConsoleWriter", "JsonlWriter", "format_row"]

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
  50 included. Rows without a step (hparams) are kept. A value at step ``S``
  itself whose name the file already holds at ``S`` is not written again (the
  first stays, as in the trackers: a finished run run again evaluates at its
  last step once more, and that row is in the file already).

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
    self._held: set[str] = set()  # the names the file held at step S when it was opened
    self._enabled = _is_writer_process()
    self._last_flush = clock()
    if self._enabled:
      os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)

  def keep_through(self, step: int) -> None:
    """Declares the run continues from a state at ``step``: before its next row with a step,
    the rows in the file at steps ``<= step`` are kept and the later ones dropped. Also in
    a later run of the same process (a rerun after an error, from a checkpoint before rows
    this writer wrote): those rows go, so each step is in the file once. The values the file
    holds at ``step`` itself are not written again (the first stays)."""
    self._keep_through = int(step)
    self._held = set()
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
      kept, dropped, self._held = [], 0, set()
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
          if isinstance(row, dict) and row.get("step") == self._keep_through:
            self._held.update(k for k in row if k != "step")
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
    if self._f is None or not self._checked:
      self._open(int(step))
    held = self._held if int(step) == self._keep_through else set()
    row = {"step": int(step)}
    row.update({k: _to_python(v) for k, v in scalars.items() if k not in held})
    if len(row) > 1 or not scalars:
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
