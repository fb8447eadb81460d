"""loopkit's console output: visible by default, on process 0 only.

loopkit logs through the Python logger ``"loopkit"``: :class:`~loopkit.LoggingHook`'s
metric lines, :class:`~loopkit.ConsoleWriter`, the goodput summary, warnings.
Python shows nothing below WARNING from a logger nobody configured, so a plain
script (no ``logging.basicConfig``, no ``absl.app.run``) would print none of
its metrics. Keras and CLU (through absl) print by default; so does loopkit:

* :func:`install_default_handler` (called when a :class:`~loopkit.TrainLoop`
  is built) gives the ``"loopkit"`` logger a handler that writes to stderr,
  INFO and above, **only while the application has configured no logging**: it
  stays silent as soon as the root logger has a handler (``basicConfig``,
  absl, a framework), which then shows loopkit's records itself, so nothing is
  printed twice.
* On multi-host runs processes other than 0 print only warnings and errors.
* INFO lines print as they are (``step 25: loss=0.0123, ...``); warnings and
  errors are prefixed ``loopkit WARNING:``.

To silence it: ``logging.getLogger("loopkit").setLevel(logging.WARNING)``, or
configure logging yourself. Thread-safe (Python logging is).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import IO, Any

import jax

__all__ = ["install_default_handler", "console_lines_above_bar"]

LOGGER_NAME = "loopkit"
# The level install_default_handler sets: lets INFO through like logging.INFO, and tells
# "loopkit set it" apart from a user's (or pytest caplog's) explicit setLevel(logging.INFO).
_DEFAULT_LEVEL = logging.INFO - 1


class _Formatter(logging.Formatter):
  def format(self, record: logging.LogRecord) -> str:
    message = record.getMessage()
    if record.levelno >= logging.WARNING:
      message = f"{LOGGER_NAME} {record.levelname}: {message}"
    if record.exc_info:
      message = f"{message}\n{self.formatException(record.exc_info)}"
    return message


class _DefaultHandler(logging.StreamHandler):
  """stderr, while nobody configured logging; INFO on process 0 only."""

  def __init__(self):
    super().__init__(stream=None)  # sys.stderr at emit time (pytest's capture swaps it)
    self.setFormatter(_Formatter())

  def emit(self, record: logging.LogRecord) -> None:
    if logging.getLogger().handlers:  # the application configured logging: it shows this
      return
    if record.levelno < logging.WARNING and _process_index() != 0:
      return
    self.stream = _bar_safe(sys.stderr)
    super().emit(record)


class _BarSafeStream:
  """A console stream whose writes go through ``tqdm.write``: the open bars are cleared,
  the text is written on its own line, the bars are redrawn below it."""

  def __init__(self, stream: IO[str], tqdm_class: Any):
    self.stream = stream
    self.tqdm_class = tqdm_class

  def write(self, text: str) -> None:
    self.tqdm_class.write(text, file=self.stream, end="")

  def flush(self) -> None:
    self.stream.flush()


_bar_class: Any = None  # the tqdm class while a progress bar is open


def _bar_safe(stream: IO[str]) -> Any:
  return stream if _bar_class is None else _BarSafeStream(stream, _bar_class)


@contextlib.contextmanager
def console_lines_above_bar(tqdm_class: Any) -> Iterator[None]:
  """While open, console log lines print above a tqdm bar instead of onto it.

  Covers loopkit's default handler and every ``StreamHandler`` on stdout or
  stderr of the root and ``"loopkit"`` loggers (their streams are wrapped to
  write through ``tqdm_class.write``). Unlike
  ``tqdm.contrib.logging.logging_redirect_tqdm`` it adds no handler, so a
  logger that printed nothing still prints nothing, and a handler keeps its
  own filters and level. Not re-entrant (an inner use is a no-op).

  Args:
    tqdm_class: the bar's class (``tqdm.auto.tqdm``).
  """
  global _bar_class
  if _bar_class is not None:
    yield
    return
  swapped = []
  for logger in (logging.getLogger(), logging.getLogger(LOGGER_NAME)):
    for h in logger.handlers:
      if (isinstance(h, logging.StreamHandler) and not isinstance(h, _DefaultHandler)
          and h.stream in (sys.stdout, sys.stderr)):
        swapped.append((h, h.stream))
        h.stream = _BarSafeStream(h.stream, tqdm_class)
  _bar_class = tqdm_class
  try:
    yield
  finally:
    _bar_class = None
    for h, stream in swapped:
      h.stream = stream


def _process_index() -> int:
  try:
    return jax.process_index()
  except Exception:  # noqa: BLE001  (a backend that failed to start: still print)
    return 0


class _AsIfUnset(logging.Filter):
  """While the application configured logging, keep what the root level would keep.

  The logger's INFO level is only for the default handler: an application
  that configured logging at WARNING must not start seeing loopkit's INFO
  lines through its own handlers. Inactive once someone else changes the level.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    root = logging.getLogger()
    if not root.handlers or logging.getLogger(LOGGER_NAME).level != _DEFAULT_LEVEL:
      return True
    return record.levelno >= root.getEffectiveLevel()


def install_default_handler() -> bool:
  """Makes loopkit's INFO lines visible in a script that configured no logging.

  Idempotent. Leaves the logger alone when it already has a handler or an
  explicit level (the user's choice).

  Returns:
    Whether the handler is installed now (or was already).
  """
  logger = logging.getLogger(LOGGER_NAME)
  if any(isinstance(h, _DefaultHandler) for h in logger.handlers):
    return True
  if logger.handlers or logger.level != logging.NOTSET:
    return False
  logger.addHandler(_DefaultHandler())
  logger.addFilter(_AsIfUnset())
  logger.setLevel(_DEFAULT_LEVEL)
  return True
