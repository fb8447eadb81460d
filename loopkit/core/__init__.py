"""The core: the loop, its run, the multi-step program and the host's accounting.

:class:`TrainLoop` builds a :class:`MultiStepProgram` (one compiled program that
runs K steps), plans the calls (:func:`plan_calls`, :class:`TimeBasedK`) so that
every :class:`Trigger` mark is a call boundary, keeps the :class:`Ledger`, agrees
every host-local decision across processes, and calls the :class:`Hook` protocol
with a read-only :class:`RunContext` and a :class:`LoopInfo` per call.

Imports only :mod:`loopkit.data`, :mod:`loopkit.metrics`,
:mod:`loopkit.conv_layout` and ``loopkit._internal``.
"""

from loopkit._internal.mesh import data_parallel_mesh
from loopkit._internal.recompile import RecompileWarning
from loopkit.core.accumulation import accumulate
from loopkit.core.context import LedgerAdjustment, Restore, RunContext
from loopkit.core.hooks import (
    CallbackHook,
    Hook,
    LoopInfo,
    NanCheckHook,
    NonFiniteError,
    NonFiniteWarning,
)
from loopkit.core.ledger import Bucket, Ledger
from loopkit.core.loop import DataExhaustedWarning, TrainLoop
from loopkit.core.planner import TimeBasedK, plan_calls
from loopkit.core.preemption import PreemptionWatcher
from loopkit.core.program import MultiStepProgram
from loopkit.core.rng import step_key
from loopkit.core.run import StepCounterError
from loopkit.core.skips import RewindRequest
from loopkit.core.time_limit import TimeLimit
from loopkit.core.triggers import Trigger

__all__ = [
    "Bucket",
    "CallbackHook",
    "DataExhaustedWarning",
    "Hook",
    "Ledger",
    "LedgerAdjustment",
    "LoopInfo",
    "MultiStepProgram",
    "NanCheckHook",
    "NonFiniteError",
    "NonFiniteWarning",
    "PreemptionWatcher",
    "RecompileWarning",
    "Restore",
    "RewindRequest",
    "RunContext",
    "StepCounterError",
    "TimeBasedK",
    "TimeLimit",
    "TrainLoop",
    "Trigger",
    "accumulate",
    "data_parallel_mesh",
    "plan_calls",
    "step_key",
]
