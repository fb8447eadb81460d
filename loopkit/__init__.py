"""loopkit: iterations_per_loop training loops for JAX.

K train steps per device call, events landing exactly on their steps, and
results that do not depend on K.
"""

from loopkit import aot, conv_layout, goodput, metrics
from loopkit.accumulation import accumulate
from loopkit.checks import BatchLayoutWarning
from loopkit.context import LedgerAdjustment, Restore, RunContext
from loopkit.device_data import DeviceDataset, DeviceDataState
from loopkit.evaluation import EvalHook, EvalResult, Evaluator, evaluate, per_example
from loopkit.goodput import GoodputHook, GoodputSummary
from loopkit.hooks import (
  CallbackHook,
  Hook,
  LoggingHook,
  LoopInfo,
  NanCheckHook,
  NonFiniteError,
  NonFiniteWarning,
)
from loopkit.ledger import Bucket, Ledger
from loopkit.loop import DataExhaustedWarning, TrainLoop
from loopkit.planner import TimeBasedK, next_call_length, plan_calls
from loopkit.preemption import PreemptionWatcher
from loopkit.profiler import ProfilerHook
from loopkit.program import MultiStepProgram, data_parallel_mesh
from loopkit.progress import ProgressHook
from loopkit.rng import step_key
from loopkit.sources import (
  ArraySource,
  TfDataSource,
  batch_arrays,
  eval_batches_per_process,
  grain_shard_for_process,
  grain_shard_options,
  process_shard_bounds,
  shard_for_process,
  steps_per_epoch_of,
  tfds_split_for_process,
)
from loopkit.triggers import Trigger
from loopkit.writers import (
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
)

__version__ = "0.1.0"

_LAZY = {  # need the optional orbax-checkpoint (pip install loopkit[checkpoint]; loopkit.extras)
    "CheckpointError": "loopkit.checkpoint", "CheckpointHook": "loopkit.checkpoint",
    "CheckpointWarning": "loopkit.checkpoint", "RestoredCheckpoint": "loopkit.checkpoint",
}


def __getattr__(name):
  if name in _LAZY:
    from loopkit.extras import require  # pylint: disable=g-import-not-at-top
    return getattr(require(_LAZY[name], f"loopkit.{name}"), name)
  if name == "nnx":  # needs flax (pip install loopkit[nnx])
    from loopkit.extras import require  # pylint: disable=g-import-not-at-top
    return require("loopkit.nnx", "loopkit.nnx")
  if name in ("testing", "tune"):  # imported on first use: testing imports pytest if present;
    # tune runs as `python -m loopkit.tune`, which warns if the package imported it already
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module(f"loopkit.{name}")
  raise AttributeError(f"module 'loopkit' has no attribute {name!r}")

__all__ = [
    "CheckpointError", "CheckpointHook", "CheckpointWarning", "PreemptionWatcher",
    "RestoredCheckpoint",
    "BatchLayoutWarning", "CallbackHook", "DataExhaustedWarning", "Hook", "JsonlWriter",
    "Ledger", "LoggingHook",
    "LoopInfo", "MetricWriter", "MultiStepProgram", "NanCheckHook", "NonFiniteError",
    "NonFiniteWarning",
    "data_parallel_mesh",
    "TrainLoop", "Trigger", "metrics", "next_call_length", "plan_calls", "step_key",
    "accumulate", "AsyncWriter", "ConsoleWriter", "FlaxSummaryWriter", "as_writer", "per_example",
    "steps_per_epoch_of", "GoodputHook", "GoodputSummary", "MultiWriter", "NullWriter",
    "ProfilerHook", "ProgressHook", "TensorBoardWriter", "TimeBasedK", "create_default_writer",
    "aot", "conv_layout", "goodput", "nnx", "tune",
    "ArraySource", "DeviceDataState", "DeviceDataset", "EvalHook", "EvalResult", "Evaluator",
    "TfDataSource", "batch_arrays", "eval_batches_per_process", "evaluate",
    "grain_shard_for_process", "grain_shard_options", "process_shard_bounds",
    "shard_for_process", "tfds_split_for_process",
    "Bucket", "LedgerAdjustment", "Restore", "RunContext",
]
