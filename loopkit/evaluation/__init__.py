"""Exact evaluation and the hook that runs it during training (the public home of both).

:class:`Evaluator` (:mod:`loopkit.evaluation.evaluator`) evaluates per-example eval steps
exactly: up to K eval batches per device call, padded and masked, the same bits for every K;
:func:`evaluate` and :func:`per_example` go with it. :class:`EvalHook`
(:mod:`loopkit.evaluation.hook`) runs an evaluator from a train loop when its trigger fires;
:func:`report` logs and writes one evaluation's row.
"""

from loopkit.evaluation.evaluator import EvalResult, Evaluator, evaluate, per_example
from loopkit.evaluation.hook import EvalHook, ForEvalHook, SupportsEvaluate, report

__all__ = [
    "EvalHook",
    "EvalResult",
    "Evaluator",
    "ForEvalHook",
    "SupportsEvaluate",
    "evaluate",
    "per_example",
    "report",
]
