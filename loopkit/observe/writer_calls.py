"""The calls a hook makes on any writer, whatever it is (loopkit's, CLU's, a user's):
:func:`keep_rows_through` (a resume's rows), :func:`mark_run_outcome` (how a run ended) and
:func:`prints_to_console` (whether a row is printed through the writer).

Each asks the writer for an optional method and leaves a writer without it alone.
Re-exported by :mod:`loopkit.observe.writers`.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from loopkit._internal.compat import clu_wrapped_writers

__all__ = ["OUTCOMES", "keep_rows_through", "mark_run_outcome", "prints_to_console"]


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
