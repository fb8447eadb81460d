"""The evaluation hook: :class:`EvalHook` runs an evaluator when its trigger fires.

:class:`EvalHook` runs an evaluator from a ``TrainLoop`` (an :class:`~loopkit.evaluation.Evaluator`)
or an ``NnxTrainLoop`` (a :class:`loopkit.nnx.NnxEvaluator`) every N steps or every epoch; a
value that is not an evaluator is refused when the hook is built (:class:`SupportsEvaluate`,
:class:`ForEvalHook`). :func:`report` logs one evaluation and writes its row, for the hook and
the evaluation sidecar (:mod:`loopkit.tools.follower`) alike. Not thread-safe.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from loopkit.core.hooks import Hook, LoopInfo, drop_after
from loopkit.core.ledger import Bucket
from loopkit.data.device_data import DeviceDataState
from loopkit.evaluation.evaluator import EvalResult
from loopkit.observe.writers import (
  as_writer,
  keep_rows_through,
  mark_run_outcome,
  prints_to_console,
)

log = logging.getLogger("loopkit")


def _default_state_fn(state: Any) -> Any:
  return state.train_state if isinstance(state, DeviceDataState) else state


class SupportsEvaluate(Protocol):
  """What :class:`EvalHook` calls: :class:`Evaluator`, or any object with this method."""

  def evaluate(self, state: Any, batches: Iterable, *,
               num_batches: int | None = None) -> EvalResult: ...


class ForEvalHook(Protocol):
  """An evaluator with its own calling convention tells :class:`EvalHook` how to run it.

  :class:`loopkit.nnx.NnxEvaluator` is one: its ``evaluate(batches, *, state=...)`` takes the
  batches first and a model state, not the loop's state.
  """

  def for_eval_hook(self) -> tuple[SupportsEvaluate, Callable[[Any], Any]]:
    """``(evaluator, state_fn)``: the object EvalHook calls at each firing, and the map from
    the train loop's state to the state that object evaluates (EvalHook's default
    ``state_fn``)."""
    ...


def _hook_evaluator(evaluator: Any) -> tuple[SupportsEvaluate, Callable[[Any], Any]]:
  """``(evaluator, default state_fn)`` for :class:`EvalHook`, checked when the hook is built.

  Asks an evaluator with ``for_eval_hook`` (:class:`ForEvalHook`) for the form EvalHook
  calls; checks that what EvalHook will call accepts ``evaluate(state, batches,
  num_batches=...)``, so a wrong kind fails here rather than at the first evaluation,
  after training up to it.

  Raises:
    TypeError: a function or a class instead of an evaluator object, or an object whose
      ``evaluate`` does not take ``(state, batches, *, num_batches=None)``; the message
      names it and the form that works.
  """
  adapt = getattr(evaluator, "for_eval_hook", None)
  if adapt is not None and not isinstance(evaluator, type):
    evaluator, state_fn = adapt()
  else:
    state_fn = _default_state_fn
  what = getattr(evaluator, "__name__", None) or type(evaluator).__qualname__
  if isinstance(evaluator, type):
    raise TypeError(
        f"EvalHook got the class {what}, not an evaluator: pass an instance, e.g. "
        "EvalHook(loopkit.Evaluator(eval_step), batches, ...) or "
        "EvalHook(loopkit.nnx.NnxEvaluator(eval_step, model, metrics), batches, ...)")
  evaluate = getattr(evaluator, "evaluate", None)
  if not callable(evaluate):
    if callable(evaluator):
      raise TypeError(
          f"EvalHook got the function {what}, not an evaluator: wrap an eval step that "
          "returns per-example values as EvalHook(loopkit.Evaluator(eval_step), batches, "
          "...) (a step returning batch means: loopkit.Evaluator("
          "loopkit.evaluation.per_example(eval_step))); an NNX step eval_step(model, "
          "metrics, batch): EvalHook(loopkit.nnx.NnxEvaluator(eval_step, model, metrics), "
          "batches, ...)")
    raise TypeError(f"EvalHook got a {type(evaluator).__qualname__}, which has no "
                    "evaluate(state, batches, *, num_batches=None) method: pass a "
                    "loopkit.Evaluator (or an object with that method)")
  try:
    signature = inspect.signature(evaluate)
  except (TypeError, ValueError):  # a builtin without a signature: trust it
    return evaluator, state_fn
  try:
    signature.bind(None, None, num_batches=None)
  except TypeError as e:
    raise TypeError(
        f"EvalHook calls evaluator.evaluate(state, batches, num_batches=...) at each firing, "
        f"which {type(evaluator).__qualname__}.evaluate{signature} does not accept ({e}): "
        "pass a loopkit.Evaluator, an object whose evaluate takes (state, batches, *, "
        "num_batches=None), or one with for_eval_hook() (loopkit.evaluation.ForEvalHook, as "
        "loopkit.nnx.NnxEvaluator has)") from None
  return evaluator, state_fn


class EvalHook(Hook):
  """Runs an :class:`Evaluator` from a ``TrainLoop`` when its trigger fires.

  Example:
    >>> hook = loopkit.EvalHook(loopkit.Evaluator(eval_step), test_batches,  # doctest: +SKIP
    ...                         every_epochs=1)
    >>> hook = loopkit.EvalHook(  # in an NnxTrainLoop's hooks  # doctest: +SKIP
    ...     loopkit.nnx.NnxEvaluator(eval_step, model, eval_metrics), test_batches,
    ...     every_epochs=1)

  Args:
    evaluator: the evaluator (compiled once, reused at every firing): an
      :class:`Evaluator`; a :class:`loopkit.nnx.NnxEvaluator` (it evaluates the
      ``"model"`` part of an :class:`~loopkit.nnx.NnxTrainLoop`'s state in inference
      mode); any object with ``evaluate(state, batches, *, num_batches=None)``
      returning an :class:`EvalResult`, or with ``for_eval_hook()``
      (:class:`ForEvalHook`).
    batches: a re-iterable (list, Grain ``DataLoader``, ``TfDataSource``) or a
      zero-argument callable returning a fresh iterable of eval batches.
    num_batches: passed to :meth:`Evaluator.evaluate` (multi-host).
    writer: optional metric writer (``write_scalars(step, scalars)``: loopkit's,
      CLU's ``metric_writers``; or Flax's ``tensorboard.SummaryWriter``, see
      :func:`loopkit.observe.writers.as_writer`); gets ``{prefix}/{metric}`` and
      ``{prefix}/num_examples``. Each evaluation is also logged to the ``loopkit``
      logger (``step N eval: name=value, ... (M examples)``) unless the writer prints its
      rows itself (:func:`loopkit.observe.writers.prints_to_console`: a ``ConsoleWriter``,
      ``create_default_writer(...)``, CLU's ``LoggingWriter`` while absl shows INFO lines),
      so it is printed once.
    prefix: name prefix for the written scalars.
    state_fn: maps the train state to the state ``eval_step`` takes (default:
      unwraps a :class:`~loopkit.data.device_data.DeviceDataState`; for an evaluator
      with ``for_eval_hook``, the map it gives, e.g. ``lambda s: s["model"]``).
    **trigger: ``every_steps``, ``every_epochs``, ``at_steps``,
      ``every_secs``, ``at_end`` (see :class:`loopkit.core.hooks.Hook`). ``at_end``
      evaluates at the end of training (the target reached, the data exhausted, a stop a
      hook requested), not at a preemption (SIGTERM / SIGINT,
      ``ctx.preemption.request()``): a preempted run is resumed, and its resumed run
      evaluates at the marks (and the end) an uninterrupted run evaluates at, so the
      evaluation rows of the two are the same (``fires_at_preemption`` is False).

  Attributes:
    evaluator: the evaluator given.
    results: ``[(step, EvalResult)]`` in firing order (at each run's start and after a
      rewind, those past the step it continues from are dropped, as the writer's rows).

  Raises:
    ValueError: ``batches`` is a one-shot iterator (it would be empty at the
      second firing).
    TypeError: ``writer`` is not a metric writer; ``evaluator`` is not one (a
      function, a class, or an object whose ``evaluate`` does not take
      ``(state, batches, *, num_batches=None)``): the message names the form that
      works. Raised here, when the hook is built, not at its first firing.

  Not thread-safe; on multi-host every process runs it (writes happen where
  the writer writes).
  """

  needs_state = True
  time_bucket = Bucket.EVAL  # goodput: evaluation time, not generic hook time
  fires_at_preemption = False  # the resumed run evaluates at the next mark, as without it

  def __init__(self, evaluator: SupportsEvaluate | ForEvalHook,
               batches: Iterable | Callable[[], Iterable], *, num_batches: int | None = None,
               writer: Any = None, prefix: str = "eval",
               state_fn: Callable[[Any], Any] | None = None, **trigger):
    super().__init__(**trigger)
    called, default_state_fn = _hook_evaluator(evaluator)
    if not callable(batches) and iter(batches) is batches:
      raise ValueError("EvalHook needs re-iterable eval batches (a list, a Grain loader) or "
                       "a callable returning a fresh iterable, not a one-shot iterator")
    self.evaluator = evaluator
    self._evaluate = called.evaluate
    self.batches = batches
    self.num_batches = num_batches
    self.writer = None if writer is None else as_writer(writer)
    self.prefix = prefix
    self.state_fn = state_fn if state_fn is not None else default_state_fn
    self.results: list[tuple[int, EvalResult]] = []

  def on_run_start(self, ctx: Any, state: Any) -> None:
    """Checks, before any step, that ``state_fn`` takes this loop's state.

    Raises:
      TypeError: ``state_fn`` raised on the run's initial state (e.g. an
        :class:`~loopkit.nnx.NnxEvaluator`'s ``s["model"]`` in a plain ``TrainLoop``),
        naming the error and ``state_fn=``.
    """
    del ctx
    try:
      self.state_fn(state)
    except Exception as e:  # pylint: disable=broad-except  # re-raised with the hook named
      raise TypeError(
          f"EvalHook({type(self.evaluator).__name__}): its state_fn cannot take this loop's "
          f"train state ({type(e).__name__}: {e}); an NnxEvaluator evaluates the 'model' part "
          "of an NnxTrainLoop's state: in another loop, pass state_fn= mapping the train "
          "state to the state the evaluator takes") from e
    return None

  def flush(self) -> None:
    """Flushes the writer (a :class:`~loopkit.checkpoint.CheckpointHook` calls this at
    each save, so the eval rows a checkpoint covers survive a kill)."""
    flush = getattr(self.writer, "flush", None)
    if flush is not None:
      flush()

  def on_run_end(self, ctx: Any, state: Any) -> None:
    """Tells the writer how the run ended (:func:`~loopkit.observe.writers.mark_run_outcome`:
    a tracker marks its run)."""
    del state
    if self.writer is not None:
      mark_run_outcome(self.writer, status=ctx.status)

  def on_run_error(self, ctx: Any, error: BaseException) -> None:
    """Tells the writer the run failed or was interrupted (``mark_run_outcome``)."""
    del ctx
    if self.writer is not None:
      mark_run_outcome(self.writer, error=error)

  def adjust_ledger(self, ctx: Any) -> None:
    """Tells the writer the step the run continues from (restores applied), so a resumed
    run's file writers keep the earlier eval rows up to it (``keep_rows_through``), and
    drops the :attr:`results` past it."""
    if self.writer is not None:
      keep_rows_through(self.writer, ctx.ledger.step)
    drop_after(self.results, ctx.ledger.step)

  def on_trigger(self, info: LoopInfo, state: Any) -> None:
    batches = self.batches() if callable(self.batches) else self.batches
    result = self._evaluate(self.state_fn(state), batches, num_batches=self.num_batches)
    self.results.append((info.end_step, result))
    report(info.end_step, result, writer=self.writer, prefix=self.prefix)
    return None


def report(step: int, result: EvalResult, *, writer: Any = None, prefix: str = "eval") -> None:
  """Logs one evaluation and writes its row, as :class:`EvalHook` does at each firing.

  The row at ``step`` holds ``{prefix}/{metric}`` for each metric and
  ``{prefix}/num_examples``. The ``loopkit`` logger gets ``step N eval: name=value, ...
  (M examples)`` unless the writer prints its rows itself
  (:func:`loopkit.observe.writers.prints_to_console`), so it is printed once. The evaluation
  sidecar (:mod:`loopkit.tools.follower`) writes its rows through this too, so they are
  the rows EvalHook writes.

  Args:
    step: the step of the evaluated state (updates applied).
    result: the :class:`EvalResult`.
    writer: a loopkit metric writer (already :func:`~loopkit.observe.writers.as_writer`),
      or None (log only).
    prefix: the scalars' name prefix.
  """
  if not prints_to_console(writer):  # else the writer prints the row: once
    log.info("step %d eval: %s (%d examples)", step,
             ", ".join(f"{k}={v:.6g}" for k, v in result.metrics.items()), result.num_examples)
  if writer is not None:
    scalars: dict[str, Any] = {f"{prefix}/{k}": v for k, v in result.metrics.items()}
    scalars[f"{prefix}/num_examples"] = result.num_examples
    writer.write_scalars(step, scalars)
