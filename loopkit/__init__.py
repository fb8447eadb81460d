"""loopkit: iterations_per_loop training loops for JAX.

K train steps per device call, events landing exactly on their steps, and
results that do not depend on K.
"""

from loopkit import metrics
from loopkit.hooks import CallbackHook, Hook, LoggingHook, LoopInfo, NanCheckHook, NonFiniteError
from loopkit.ledger import Ledger
from loopkit.loop import DataExhaustedWarning, TrainLoop
from loopkit.planner import next_call_length, plan_calls
from loopkit.program import MultiStepProgram
from loopkit.rng import step_key
from loopkit.triggers import Trigger
from loopkit.writers import JsonlWriter, MetricWriter

__version__ = "0.1.0"

__all__ = [
    "CallbackHook", "DataExhaustedWarning", "Hook", "JsonlWriter", "Ledger", "LoggingHook",
    "LoopInfo", "MetricWriter", "MultiStepProgram", "NanCheckHook", "NonFiniteError",
    "TrainLoop", "Trigger", "metrics", "next_call_length", "plan_calls", "step_key",
]
