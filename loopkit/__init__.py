"""loopkit: iterations_per_loop training loops for JAX.

K train steps per device call, events landing exactly on their steps, and
results that do not depend on K.

The names here are what a first loop, a checkpointed loop and an NNX loop
need. Everything else lives in its namespace:

* :mod:`loopkit.core`: the loop, the multi-step program, the planner, triggers,
  the ledger, the hook protocol and its run context;
* :mod:`loopkit.data`: sources, the chunk feeder, placement, device-resident data;
* :mod:`loopkit.checkpoint`: the Orbax checkpoint hook (needs ``loopkit[checkpoint]``);
* :mod:`loopkit.observe`: metric writers, logging, goodput, progress, profiling;
* :mod:`loopkit.evaluation`, :mod:`loopkit.metrics`, :mod:`loopkit.nnx`
  (needs ``loopkit[nnx]``), :mod:`loopkit.conv_layout`;
* :mod:`loopkit.training`: the trainer kit (early stopping, a lower rate on a plateau, an
  average of the parameters for evaluation, gradient / update / parameter norms);
* :mod:`loopkit.tools`: ahead-of-time compilation for a topology, the K tuner,
  testing helpers (fake devices, real multi-process runs).

A name loopkit 0.1 exported here and 0.2 moved (``loopkit.JsonlWriter``,
``loopkit.Ledger``, ``loopkit.writers``, ...) raises an AttributeError (an
ImportError for ``from loopkit import ...``) that names where it lives now.
"""

from loopkit import conv_layout, core, data, evaluation, metrics, observe, training
from loopkit._internal.logs import install_default_handler as _install_default_handler
from loopkit._internal.mesh import data_parallel_mesh
from loopkit.core.context import RunContext
from loopkit.core.hooks import (
  CallbackHook,
  Hook,
  LoopInfo,
  NanCheckHook,
  NonFiniteError,
  NonFiniteWarning,
)
from loopkit.core.loop import DataExhaustedWarning, TrainLoop
from loopkit.core.rng import step_key
from loopkit.core.triggers import Trigger
from loopkit.data.sources import ArraySource, TfDataSource
from loopkit.evaluation import EvalHook, EvalResult, Evaluator
from loopkit.observe.logging_hook import LoggingHook
from loopkit.observe.progress import ProgressHook

__version__ = "0.2.0"

# Every entry point (a TrainLoop, the follower and its command, the tuner, the AOT tool) imports
# this package first: a plain script or command prints loopkit's lines (loopkit._internal.logs).
_install_default_handler()

# Imported on first use. ``checkpoint`` imports Orbax (loopkit[checkpoint]), ``nnx`` Flax
# (loopkit[nnx]); ``tools`` holds `python -m` entry points (loopkit.tools.tune,
# loopkit.tools.testing), which warn when the package imported them already.
_LAZY_MODULES = ("checkpoint", "nnx", "tools")
_LAZY_NAMES = {"CheckpointHook": "checkpoint"}


def __getattr__(name):
  """The lazy namespaces and names; for loopkit 0.1's moved names, an error naming the new home."""
  from loopkit._internal.extras import require  # pylint: disable=g-import-not-at-top
  if name in _LAZY_NAMES:  # the ImportError names what was asked for: loopkit.CheckpointHook
    return getattr(require(f"loopkit.{_LAZY_NAMES[name]}", f"loopkit.{name}"), name)
  if name in _LAZY_MODULES:
    return require(f"loopkit.{name}", f"loopkit.{name}")
  from loopkit._internal.moved import moved_error  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  moved = moved_error(name, sys._getframe(1))  # pylint: disable=protected-access
  if moved is not None:
    raise moved
  raise AttributeError(f"module 'loopkit' has no attribute {name!r}")


__all__ = [
    "ArraySource",
    "CallbackHook",
    "CheckpointHook",
    "DataExhaustedWarning",
    "EvalHook",
    "EvalResult",
    "Evaluator",
    "Hook",
    "LoggingHook",
    "LoopInfo",
    "NanCheckHook",
    "NonFiniteError",
    "NonFiniteWarning",
    "ProgressHook",
    "RunContext",
    "TfDataSource",
    "TrainLoop",
    "Trigger",
    "checkpoint",
    "conv_layout",
    "core",
    "data",
    "data_parallel_mesh",
    "evaluation",
    "metrics",
    "nnx",
    "observe",
    "step_key",
    "tools",
    "training",
]
