"""What a train step returns and what one device call returns: the program's outputs.

:func:`unpack_step_output` checks a traced ``train_step``'s return value, ``(new_state,
metrics)``, and names the usual mistakes; :class:`CallOutput` is what one call of the compiled
program (:class:`loopkit.core.program.MultiStepProgram`) returns besides the state. Pure;
thread-safe.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from loopkit import metrics as metrics_lib


@dataclasses.dataclass(frozen=True)
class CallOutput:
  """What one device call returns besides the state (all replicated, on device).

  The call's metrics are not reduced over its steps here: the host folds the traces in step
  order (:func:`loopkit.metrics.fold_steps`), so a reported value does not depend on where
  the calls were cut.

  Attributes:
    traces: the step's metrics per step, leaves ``[K]`` float32 (reduced over the devices in
      each step, for per-device steps); entries at index >= n hold zeros.
    nonfinite: int32 ``[M]``, per metric in ``sorted(traces)`` order, the 1-based index in
      the call of its first step with a NaN or infinite field, or 0
      (:func:`loopkit.metrics.first_nonfinite`; fetched with ``step`` at every call).
    step: int scalar, the state's step counter after the call.
  """

  traces: dict[str, metrics_lib.Metric]
  nonfinite: jax.Array
  step: jax.Array


jax.tree_util.register_dataclass(CallOutput, data_fields=["traces", "nonfinite", "step"],
                                 meta_fields=[])


def _describe_output(x: Any) -> str:
  """A short description of a traced step output: its type, and shape/dtype if an array."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"an array of shape {tuple(x.shape)} dtype {x.dtype}"
  if isinstance(x, dict):
    return f"a dict with keys {sorted(map(str, x))[:6]}"
  return f"a {type(x).__name__}"


def unpack_step_output(out: Any, state: Any) -> tuple[Any, dict]:
  """Checks what ``train_step`` returned: ``(new_state, metrics: dict)``.

  Raises:
    TypeError: naming what was returned and what is expected, for the first
      mistakes people make: the state alone, a 1-tuple, ``(state, loss)``
      with a bare loss, or ``(loss, state)`` in the wrong order.
  """
  expected = ("train_step must return (new_state, metrics) with metrics a dict of "
              "scalars, e.g. `return new_state, {'loss': loss}`")
  if not isinstance(out, tuple) or len(out) != 2:
    if isinstance(out, tuple):
      got = f"a tuple of {len(out)}: ({', '.join(_describe_output(x) for x in out[:4])})"
    elif jax.tree.structure(out) == jax.tree.structure(state):  # type: ignore[operator]
      got = "only a state (no metrics)"
    else:
      got = _describe_output(out)
    raise TypeError(f"{expected}; it returned {got}")
  new_state, metrics = out
  state_def = jax.tree.structure(state)
  if (jax.tree.structure(metrics) == state_def  # type: ignore[operator]
      and jax.tree.structure(new_state) != state_def):  # type: ignore[operator]
    raise TypeError(f"{expected}; the state and the metrics look swapped: its first element is "
                    f"{_describe_output(new_state)} and its second has the state's structure")
  if not isinstance(metrics, dict):
    hint = ""
    if hasattr(metrics, "shape") and not getattr(metrics, "shape", (1,)):
      hint = " (a bare scalar: wrap it, {'loss': loss})"
    raise TypeError(f"{expected}; its second element is {_describe_output(metrics)}{hint}")
  return new_state, metrics
