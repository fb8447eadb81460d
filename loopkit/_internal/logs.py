"""loopkit's console output: visible by default, on process 0 only.

loopkit logs through the Python logger ``"loopkit"``: :class:`~loopkit.LoggingHook`'s
metric rows, :class:`~loopkit.observe.ConsoleWriter`, evaluation results, "resumed from
checkpoint N", the goodput summary, warnings. Python shows nothing below WARNING
from a logger nobody configured, so a plain script (no ``logging.basicConfig``,
no ``absl.app.run``) would print none of its metrics. Keras and CLU (through
absl) print by default; so does loopkit:

* :func:`install_default_handler` (called when the ``loopkit`` package is
  imported, so every entry point prints alike: a :class:`~loopkit.TrainLoop`, the
  evaluation follower and ``python -m loopkit.tools.follow``, the K tuner, the AOT
  tool) gives the ``"loopkit"`` logger a handler that writes to stderr,
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
import threading
from collections.abc import Iterable, Iterator
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
    self.stream = sys.stderr  # while a bar is open, its stand-in (console_lines_above_bar)
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
      or _real_stream(handler.stream) not in (_real_stream(sys.stderr), sys.__stderr__)):
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


class _AboveBar:
  """A console stream (``sys.stderr``, ``sys.stdout``) while a tqdm bar is open.

  Each complete line is written with the bars on ``bar_file`` cleared first and redrawn
  after (tqdm's ``external_write_mode``), so it lands on its own line above them. A partial
  line (``print`` writes the text, then the newline) waits for its end: a bar redrawn after
  it would overwrite it. After :meth:`release` (the bar closed) writes go straight through.
  Every other attribute (``fileno``, ``isatty``, ``encoding``...) is the stream's.
  Thread-safe.
  """

  def __init__(self, stream: IO[str], tqdm_class: Any, bar_file: IO[str]):
    self.stream = stream
    self._tqdm_class = tqdm_class
    self._bar_file = bar_file
    self._pending = ""
    self._open = True
    self._lock = threading.RLock()

  def write(self, text: str) -> int:
    with self._lock:
      if not self._open:
        return self.stream.write(text)
      lines, newline, self._pending = (self._pending + text).rpartition("\n")
      if newline:
        with self._tqdm_class.external_write_mode(file=self._bar_file):
          self.stream.write(lines + newline)
          self.stream.flush()
    return len(text)

  def writelines(self, lines: Iterable[str]) -> None:
    for line in lines:
      self.write(line)

  def flush(self) -> None:
    self.stream.flush()  # a partial line stays pending (see the class docstring)

  def release(self) -> None:
    """Writes the pending partial line; later writes go straight to the stream."""
    with self._lock:
      self._open = False
      pending, self._pending = self._pending, ""
      if pending:
        self.stream.write(pending)
        self.stream.flush()

  def __getattr__(self, name: str) -> Any:
    return getattr(self.stream, name)


def _real_stream(stream: Any) -> Any:
  """``stream``, or the console stream an :class:`_AboveBar` stands in for."""
  return stream.stream if isinstance(stream, _AboveBar) else stream


def _console_stream_handlers() -> list[logging.StreamHandler]:
  """Every ``StreamHandler`` a record can reach: those of the root and of every logger made so
  far, and absl's ``PythonHandler`` behind its ``ABSLHandler``; loopkit's default handler
  aside (it takes ``sys.stderr`` at each record)."""
  loggers = [logging.getLogger()] + [
      lg for lg in list(logging.Logger.manager.loggerDict.values())
      if isinstance(lg, logging.Logger)]
  found: dict[int, logging.StreamHandler] = {}
  for lg in loggers:
    for h in list(lg.handlers):
      if _is_absl_handler(h):
        h = getattr(h, "python_handler", h)
      if isinstance(h, logging.StreamHandler) and not isinstance(h, _DefaultHandler):
        found[id(h)] = h
  return list(found.values())


_above: dict[int, _AboveBar] | None = None  # id(console stream) -> stand-in, while a bar is open


@contextlib.contextmanager
def console_lines_above_bar(tqdm_class: Any, bar_file: IO[str]) -> Iterator[None]:
  """While open, console lines print on their own line above a tqdm bar instead of onto it.

  ``sys.stdout`` and ``sys.stderr`` are replaced by stand-ins (:class:`_AboveBar`) that write
  each line with the bars on ``bar_file`` cleared first and redrawn after, and so is the
  stream of every logging ``StreamHandler`` that writes to them (the root's, any logger's,
  absl's). That covers loopkit's own lines whichever handler shows them (loopkit's default
  handler, absl's stand-in, ``basicConfig``, ``absl.app.run``), other libraries' log lines,
  ``print`` and ``warnings``; a handler made while the bar is open (absl's stand-in at
  Orbax's first save) takes the stand-in of ``sys.stderr`` and is covered too. Nothing is
  added or removed: a logger that printed nothing still prints nothing, a handler keeps its
  filters, level and format, and the logging configuration reads the same (the checks in
  this module see through the stand-ins). On exit every stand-in is put back to its stream.
  Not re-entrant (an inner use is a no-op).

  Args:
    tqdm_class: the bar's class (``tqdm.auto.tqdm``).
    bar_file: the stream the bar draws on.
  """
  global _above
  if _above is not None:
    yield
    return
  above: dict[int, _AboveBar] = {}
  consoles = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
              if s is not None}

  def stand_in(stream: Any) -> Any:
    if id(stream) not in consoles:
      return stream
    if id(stream) not in above:
      above[id(stream)] = _AboveBar(stream, tqdm_class, bar_file)
    return above[id(stream)]

  saved = (sys.stdout, sys.stderr)
  sys.stdout, sys.stderr = stand_in(sys.stdout), stand_in(sys.stderr)
  for h in _console_stream_handlers():
    h.setStream(stand_in(h.stream))
  _above = above
  try:
    yield
  finally:
    _above = None
    mine = {id(s) for s in above.values()}
    if id(sys.stdout) in mine:
      sys.stdout = saved[0]
    if id(sys.stderr) in mine:
      sys.stderr = saved[1]
    for h in _console_stream_handlers():
      if id(h.stream) in mine:
        h.setStream(_real_stream(h.stream))
    for s in above.values():
      s.release()


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
