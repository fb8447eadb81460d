"""Watching a run: metric writers, the logging hook, goodput, progress, profiling.

Writers share one protocol (:class:`MetricWriter`: ``write_scalars`` and
friends) and accept CLU's and Flax's writers through :func:`as_writer`.
:class:`LoggingHook` writes metric rows (with TFLOP/s per device and MFU against the
chip peaks of :mod:`loopkit.observe.peaks`), :class:`GoodputHook` splits the job's wall
time, :class:`ProgressHook` draws one progress frame per loop boundary,
:class:`ProfilerHook` captures a JAX profile over chosen steps, :class:`Watchdog` ends a
process stuck in one phase of the run (a hang or a straggler) with its stacks.
:class:`MlflowWriter` and :class:`WandbWriter` send the same rows to MLflow and Weights &
Biases (optional extras).

Imports :mod:`loopkit.core`, :mod:`loopkit.metrics` and ``loopkit._internal`` only.
"""

from loopkit.observe.goodput import GoodputHook, GoodputSummary
from loopkit.observe.logging_hook import LoggingHook
from loopkit.observe.profiler import ProfilerHook
from loopkit.observe.progress import ProgressHook
from loopkit.observe.tracker_writers import MlflowWriter, WandbWriter
from loopkit.observe.watchdog import Watchdog
from loopkit.observe.writers import (
  AsyncWriter,
  ConsoleWriter,
  FlaxSummaryWriter,
  JsonlWriter,
  MetricWriter,
  MultiWriter,
  NullWriter,
  TensorBoardWriter,
  as_writer,
  create_default_writer,
  format_row,
  keep_rows_through,
  mark_run_outcome,
  prints_to_console,
)

__all__ = [
    "AsyncWriter",
    "ConsoleWriter",
    "FlaxSummaryWriter",
    "GoodputHook",
    "GoodputSummary",
    "JsonlWriter",
    "LoggingHook",
    "MetricWriter",
    "MlflowWriter",
    "MultiWriter",
    "NullWriter",
    "ProfilerHook",
    "ProgressHook",
    "TensorBoardWriter",
    "WandbWriter",
    "Watchdog",
    "as_writer",
    "create_default_writer",
    "format_row",
    "keep_rows_through",
    "mark_run_outcome",
    "prints_to_console",
]
