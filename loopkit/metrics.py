"""Mergeable metric values, reduced on device in float32.

A train step returns ``metrics``: a dict whose values are either scalar arrays
or one of the mergeable values below. Inside a device call loopkit stacks the
per-step values into ``[K]`` traces and reduces them over the steps that ran
(and, for per-device steps, across the data axis) without ever accumulating in
a low-precision dtype: every value is cast to float32 first (case C12: a bf16
accumulator stalls at 256).

A plain scalar array is treated as ``Mean(value, 1)`` per step, so the value
reported for a call is the mean over its steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Mean", "Sum", "Last", "Max", "Metric", "as_metric", "reduce_steps",
           "reduce_devices", "compute", "merge", "to_json", "from_json"]


def _f32(x: jax.typing.ArrayLike) -> jax.Array:
  return jnp.asarray(x, dtype=jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mean:
  """A mean weighted by a count: ``total / count``.

  Attributes:
    total: float32 scalar, the weighted sum (e.g. sum of per-example losses).
    count: float32 scalar, the weight (e.g. number of examples).
  """

  total: jax.Array
  count: jax.Array

  @classmethod
  def of(cls, value: jax.typing.ArrayLike, count: jax.typing.ArrayLike = 1.0) -> Mean:
    """``Mean`` of ``value`` (a mean already) over ``count`` items."""
    return cls(_f32(value) * _f32(count), _f32(count))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sum:
  """A float32 sum over steps (and devices, for per-device steps)."""

  value: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Last:
  """The value at the last step of the call (device 0's for per-device steps)."""

  value: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Max:
  """The maximum over steps (and devices)."""

  value: jax.Array


Metric = Mean | Sum | Last | Max


def _is_metric(x: Any) -> bool:
  return isinstance(x, (Mean, Sum, Last, Max))


def as_metric(value: Any) -> Metric:
  """Casts a step's metric to a mergeable float32 value (scalars -> ``Mean``)."""
  if isinstance(value, Mean):
    return Mean(_f32(value.total), _f32(value.count))
  if isinstance(value, (Sum, Last, Max)):
    return type(value)(_f32(value.value))
  arr = jnp.asarray(value)
  if arr.ndim != 0:
    raise ValueError(f"metric values must be scalars, got shape {arr.shape}")
  return Mean(_f32(arr), jnp.ones((), jnp.float32))


def reduce_steps(traces: dict[str, Metric], num_steps: jax.Array) -> dict[str, Metric]:
  """Reduces stacked per-step metrics ``[K]`` over the first ``num_steps`` steps.

  Args:
    traces: dict of metrics whose leaves have shape ``[K]`` (float32).
    num_steps: int32 scalar, how many leading steps ran (1 <= num_steps <= K).

  Returns:
    dict of scalar float32 metrics. Steps at index >= num_steps are ignored.
  """
  out: dict[str, Metric] = {}
  for name, m in traces.items():
    k = jax.tree.leaves(m)[0].shape[0]
    mask = jnp.arange(k) < num_steps
    if isinstance(m, Mean):
      out[name] = Mean(jnp.sum(jnp.where(mask, m.total, 0.0)),
                       jnp.sum(jnp.where(mask, m.count, 0.0)))
    elif isinstance(m, Sum):
      out[name] = Sum(jnp.sum(jnp.where(mask, m.value, 0.0)))
    elif isinstance(m, Max):
      out[name] = Max(jnp.max(jnp.where(mask, m.value, -jnp.inf)))
    else:
      out[name] = Last(m.value[num_steps - 1])
  return out


def reduce_devices(metrics: dict[str, Metric], axis_name: str) -> dict[str, Metric]:
  """Reduces metrics across a mapped axis: sums and counts, never mean of means."""
  out: dict[str, Metric] = {}
  for name, m in metrics.items():
    if isinstance(m, Mean):
      out[name] = Mean(jax.lax.psum(m.total, axis_name), jax.lax.psum(m.count, axis_name))
    elif isinstance(m, Sum):
      out[name] = Sum(jax.lax.psum(m.value, axis_name))
    elif isinstance(m, Max):
      out[name] = Max(jax.lax.pmax(m.value, axis_name))
    else:
      first = jax.lax.axis_index(axis_name) == 0
      out[name] = Last(jax.lax.psum(jnp.where(first, m.value, 0.0), axis_name))
  return out


def merge(a: Metric, b: Metric) -> Metric:
  """Merges two host or device values of the same metric kind (``b`` is later)."""
  if type(a) is not type(b):
    raise TypeError(f"cannot merge {type(a).__name__} with {type(b).__name__}")
  if isinstance(a, Mean) and isinstance(b, Mean):
    return Mean(a.total + b.total, a.count + b.count)
  if isinstance(a, Sum) and isinstance(b, Sum):
    return Sum(a.value + b.value)
  if isinstance(a, Max) and isinstance(b, Max):
    return Max(np.maximum(a.value, b.value))  # type: ignore[arg-type]  # host numpy values
  return b


def compute(m: Metric) -> float:
  """The metric's value as a Python float (``nan`` for a ``Mean`` of count 0)."""
  if isinstance(m, Mean):
    count = float(m.count)
    return float(m.total) / count if count else float("nan")
  return float(m.value)


def compute_traces(m: Metric) -> np.ndarray:
  """Per-step values ``[n]`` (float32) of a stacked host metric."""
  if isinstance(m, Mean):
    with np.errstate(invalid="ignore", divide="ignore"):
      return np.asarray(m.total, np.float32) / np.asarray(m.count, np.float32)
  return np.asarray(m.value, np.float32)


_KINDS: dict[str, type] = {"Mean": Mean, "Sum": Sum, "Last": Last, "Max": Max}


def to_json(m: Metric) -> dict[str, Any]:
  """A host metric value as JSON (``{"kind": "Mean", "total": ..., "count": ...}``).

  Exact: every field is a float32 scalar, which a JSON (float64) number holds
  exactly; :func:`from_json` gives back the same bits. Used to checkpoint
  running accumulators (e.g. :class:`loopkit.LoggingHook`'s, case C42).
  """
  return {"kind": type(m).__name__,
          **{f.name: float(np.float32(getattr(m, f.name))) for f in dataclasses.fields(m)}}


def from_json(d: dict[str, Any]) -> Metric:
  """Inverse of :func:`to_json` (numpy float32 fields).

  Raises:
    ValueError: an unknown metric kind (naming it).
  """
  kind = _KINDS.get(d.get("kind", ""))
  if kind is None:
    raise ValueError(f"unknown metric kind {d.get('kind')!r}; known: {sorted(_KINDS)}")
  return kind(**{f.name: np.float32(d[f.name]) for f in dataclasses.fields(kind)})
