"""loopkit's console output: visible by default, on process 0 only.

loopkit logs through the Python logger ``"loopkit"``: :class:`~loopkit.LoggingHook`'s
metric rows, :class:`~loopkit.observe.ConsoleWriter`, evaluation results, "resumed from
checkpoint N", the goodput summary, warnings. Python shows nothing below WARNING
from a logger nobody configured, so a plain script (no ``logging.basicConfig``,
no ``absl.app.run``) would print none of its metrics. Keras and CLU (through
absl) print by default; so does loopkit:

* :func:`install_default_handler` (called when a :class:`~loopkit.TrainLoop`
  is built) gives the ``"loopkit"`` logger a handler that writes to stderr,
  INFO and above, **while the application has configured no logging**.
* absl's stand-in does not count as configuration. absl's first log call
  (``absl.logging.info`` and friends; Orbax and CLU make them at import or at
  their first save or write) runs a bare ``logging.basicConfig()`` when the
  root logger has no handler: a stderr handler at the root's default level,
  WARNING, which would hide every INFO line. While the root logger holds only
  that handler (made after ``absl.logging`` was imported) or absl's
  ``ABSLHandler``, at WARNING, and absl's flags are not parsed, loopkit's
  records go to loopkit's handler alone (not also to the stand-in), so each
  prints once, as in a script without absl.
* Anything else is the application's configuration, and wins: a root handler
  of its own or a root level (``basicConfig(level=..., format=...)``,
  ``absl.app.run``, which parses the flags and puts ``ABSLHandler`` on the
  root at ``--verbosity``), a handler on the ``"loopkit"`` logger. loopkit's
  handler then stays silent and the application's handlers show loopkit's
  records at the application's root level, once. A level set on the
  ``"loopkit"`` logger (``setLevel(logging.WARNING)`` to silence it) is obeyed
  in every case.
* On multi-host runs processes other than 0 print only warnings and errors.
* INFO lines print as they are (``step 25: loss=0.0123, ...``); warnings and
  errors are prefixed ``loopkit WARNING:``.

One case cannot be told from absl's stand-in: an application that calls
``logging.basicConfig(level=logging.WARNING)`` with the default format *after*
absl was imported (by Orbax, optax, CLU...) leaves the same state, and sees
loopkit's INFO lines; it silences them with
``logging.getLogger("loopkit").setLevel(logging.WARNING)`` (or configures
logging before those imports, or with a format of its own).
Thread-safe (Python logging is).
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
    if not _unconfigured():  # the application configured logging: its handlers show this
      return
    if record.levelno < logging.WARNING and _process_index() != 0:
      return
    self.stream = _bar_safe(sys.stderr)
    super().emit(record)


def _absl_flags_parsed() -> bool | None:
  """Whether absl's flags are parsed (``absl.app.run`` did it); None: absl is not imported,
  or its ``FLAGS`` object could not answer."""
  flags = sys.modules.get("absl.flags")
  try:
    return None if flags is None else bool(flags.FLAGS.is_parsed())
  except Exception:  # noqa: BLE001  (an absl without is_parsed: count it as configured)
    return None


def _probe_record() -> logging.LogRecord:
  return logging.LogRecord("loopkit", logging.INFO, __file__, 1, "probe", (), None)


def _is_bare_basic_config(handler: logging.Handler) -> bool:
  """Whether ``handler`` is what ``logging.basicConfig()`` without arguments adds."""
  if (type(handler) is not logging.StreamHandler or handler.level != logging.NOTSET
      or handler.filters or handler.formatter is None
      or handler.stream not in (sys.stderr, sys.__stderr__)):
    return False
  record = _probe_record()
  return handler.format(record) == logging.Formatter(logging.BASIC_FORMAT).format(record)


def _is_absl_handler(handler: logging.Handler) -> bool:
  absl_handler = getattr(sys.modules.get("absl.logging"), "ABSLHandler", None)
  return isinstance(absl_handler, type) and isinstance(handler, absl_handler)


def _made_after_absl(handler: logging.Handler) -> bool:
  """Whether ``handler`` was made after ``absl.logging`` was imported.

  absl makes its ``ABSLHandler`` when ``absl.logging`` is imported, so a bare
  basicConfig handler made before it is the application's, not absl's stand-in.
  Python keeps every handler in creation order in ``logging._handlerList``
  (private, used by ``logging.shutdown``); without it (another Python), the
  answer is whether loopkit saw the root without a handler earlier in this
  process (absl's stand-in then came later, at a save or a write).
  """
  refs = getattr(logging, "_handlerList", None)
  get_absl_handler = getattr(sys.modules.get("absl.logging"), "get_absl_handler", None)
  try:
    order = [ref() for ref in list(refs)]  # type: ignore[arg-type]  # None: caught below
    return order.index(get_absl_handler()) < order.index(handler)  # type: ignore[misc]
  except Exception:  # noqa: BLE001  (no such list, or absl's handler not in it)
    return _root_seen_empty


_root_seen_empty = False  # loopkit saw the root logger without a handler in this process


def _absl_stand_in(root: logging.Logger) -> bool:
  """Whether the root logger's handlers are only what absl installs by itself.

  Before its flags are parsed, absl's first log call runs ``logging.basicConfig()``
  when the root has no handler (absl.logging.log); ``use_absl_handler()`` adds
  ``ABSLHandler``. Neither sets a level: the root keeps WARNING.
  """
  return (bool(root.handlers) and root.level == logging.WARNING
          and "absl.logging" in sys.modules and _absl_flags_parsed() is False
          and all(_is_absl_handler(h) or (_is_bare_basic_config(h) and _made_after_absl(h))
                  for h in root.handlers))


def _unconfigured() -> bool:
  """Whether loopkit's handler is the one to show loopkit's records: the ``"loopkit"``
  logger has no other handler and the root has none (or only absl's stand-in)."""
  global _root_seen_empty
  logger = logging.getLogger(LOGGER_NAME)
  if not all(isinstance(h, _DefaultHandler) for h in logger.handlers):
    return False
  root = logging.getLogger()
  if not root.handlers:
    _root_seen_empty = True
    return True
  return _absl_stand_in(root)


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


class _Route(logging.Filter):
  """Sends each record to the one place that shows it (see the module docstring).

  Nobody configured logging: loopkit's handler shows it (the root has no
  handler). Only absl's stand-in on the root: loopkit's handler shows it, and
  it does not go on to the stand-in, which would print it a second time (or
  hide its INFO). The application configured logging: its handlers show it;
  while the logger's level is still the one loopkit set, records below the
  root's level are dropped, as they would be without loopkit's level.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    logger = logging.getLogger(LOGGER_NAME)
    root = logging.getLogger()
    if not root.handlers:
      return True
    if _unconfigured():  # absl's stand-in: loopkit's handler only
      for h in logger.handlers:
        h.handle(record)
      return False
    if logger.level != _DEFAULT_LEVEL:  # the application chose loopkit's level
      return True
    return record.levelno >= root.getEffectiveLevel()


def install_default_handler() -> bool:
  """Makes loopkit's INFO lines visible in a script that configured no logging.

  Idempotent. Leaves the logger alone when it already has a handler or an
  explicit level (the user's choice).

  Returns:
    Whether the handler is installed now (or was already).
  """
  _unconfigured()  # notes a root without handlers (see _made_after_absl)
  logger = logging.getLogger(LOGGER_NAME)
  if any(isinstance(h, _DefaultHandler) for h in logger.handlers):
    return True
  if logger.handlers or logger.level != logging.NOTSET:
    return False
  logger.addHandler(_DefaultHandler())
  logger.addFilter(_Route())
  logger.setLevel(_DEFAULT_LEVEL)
  return True
