"""Mergeable metric values, reduced on device in float32.

A train step returns ``metrics``: a dict whose values are either scalar arrays
or one of the mergeable values below. Inside a device call loopkit stacks the
per-step values into ``[K]`` traces and reduces them over the steps that ran
(and, for per-device steps, across the data axis) without ever accumulating in
a low-precision dtype: every value is cast to float32 first (case C12: a bf16
accumulator stalls at 256).

A plain scalar array is treated as ``Mean(value, 1)`` per step, so the value
reported for a call is the mean over its steps.

Every kind follows one small protocol (:class:`Metric`: ``reduce_steps``,
``reduce_devices``, ``merge``, ``compute``), so a user's own kind works in the
train step's metrics, is reduced over the K steps and the devices, and is logged
by :class:`loopkit.LoggingHook` like the built-in ones (``tests/test_metrics.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Metric", "Mean", "Sum", "Last", "Max", "as_metric", "reduce_steps",
           "reduce_devices", "compute", "merge", "to_json", "from_json", "step_mask"]


def _f32(x: jax.typing.ArrayLike) -> jax.Array:
  return jnp.asarray(x, dtype=jnp.float32)


def step_mask(x: jax.Array, num_steps: jax.Array) -> jax.Array:
  """``bool [K]``: which of a stacked leaf ``x`` ``[K]``'s steps ran (``index < num_steps``)."""
  return jnp.arange(x.shape[0]) < num_steps


_KINDS: dict[str, type] = {}


class Metric:
  """A mergeable metric value: the protocol every metric kind follows (after CLU's
  ``clu.metrics.Metric``).

  A metric is a frozen dataclass registered as a pytree
  (``@jax.tree_util.register_dataclass``) whose fields are float32 arrays, subclassing this
  class and implementing:

  * :meth:`reduce_steps`: a value whose fields are stacked per step ``[K]`` -> the value of
    the steps that ran (traced, inside the device call);
  * :meth:`reduce_devices`: -> the value over the devices of a mapped axis (traced;
    per-device steps only);
  * :meth:`merge`: two values of the same kind -> their combination, ``other`` later (host
    numpy values, e.g. :class:`loopkit.LoggingHook`'s running value over calls);
  * :meth:`compute`: -> the Python float that is logged.

  A train step may return any such value among its metrics, and loopkit reduces it over the
  K steps of a call and the devices, and logs it, with no change to loopkit. Subclasses are
  registered by name for :func:`from_json` (``Mean``, ..., and ``module.QualName`` for
  others), so a checkpointed running value comes back as the same kind.
  """

  def __init_subclass__(cls, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)
    builtin = cls.__module__ == __name__
    _KINDS[cls.__name__ if builtin else f"{cls.__module__}.{cls.__qualname__}"] = cls

  def reduce_steps(self, num_steps: jax.Array) -> Metric:
    """The value over the first ``num_steps`` (traced int32) of the stacked steps ``[K]``."""
    raise NotImplementedError(f"{type(self).__name__}.reduce_steps")

  def reduce_devices(self, axis_name: str) -> Metric:
    """The value over the devices of the mapped axis ``axis_name`` (inside ``shard_map``)."""
    raise NotImplementedError(f"{type(self).__name__}.reduce_devices")

  def merge(self, other: Metric) -> Metric:
    """This value combined with ``other`` (the later one), on the host."""
    raise NotImplementedError(f"{type(self).__name__}.merge")

  def compute(self) -> float:
    """The value to log, a Python float."""
    raise NotImplementedError(f"{type(self).__name__}.compute")

  def compute_traces(self) -> np.ndarray:
    """Per-step values ``[n]`` (float32) of a value whose fields are stacked ``[n]`` (host).

    Default: :meth:`compute` of each step's slice.
    """
    leaves = jax.tree.leaves(self)
    n = np.shape(leaves[0])[0] if leaves else 0

    def at(i: int) -> float:  # slots past the call's length hold zeros: nan, not a warning
      with np.errstate(all="ignore"):
        try:
          return jax.tree.map(lambda x: np.asarray(x)[i], self).compute()
        except ZeroDivisionError:
          return float("nan")

    return np.asarray([at(i) for i in range(n)], np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mean(Metric):
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

  def reduce_steps(self, num_steps: jax.Array) -> Mean:
    mask = step_mask(self.total, num_steps)
    return Mean(jnp.sum(jnp.where(mask, self.total, 0.0)),
                jnp.sum(jnp.where(mask, self.count, 0.0)))

  def reduce_devices(self, axis_name: str) -> Mean:  # sums and counts, never mean of means
    return Mean(jax.lax.psum(self.total, axis_name), jax.lax.psum(self.count, axis_name))

  def merge(self, other: Metric) -> Mean:
    assert isinstance(other, Mean)
    return Mean(self.total + other.total, self.count + other.count)

  def compute(self) -> float:
    count = float(self.count)
    return float(self.total) / count if count else float("nan")

  def compute_traces(self) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
      return np.asarray(self.total, np.float32) / np.asarray(self.count, np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sum(Metric):
  """A float32 sum over steps (and devices, for per-device steps)."""

  value: jax.Array

  def reduce_steps(self, num_steps: jax.Array) -> Sum:
    return Sum(jnp.sum(jnp.where(step_mask(self.value, num_steps), self.value, 0.0)))

  def reduce_devices(self, axis_name: str) -> Sum:
    return Sum(jax.lax.psum(self.value, axis_name))

  def merge(self, other: Metric) -> Sum:
    assert isinstance(other, Sum)
    return Sum(self.value + other.value)

  def compute(self) -> float:
    return float(self.value)

  def compute_traces(self) -> np.ndarray:
    return np.asarray(self.value, np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Last(Metric):
  """The value at the last step of the call (device 0's for per-device steps)."""

  value: jax.Array

  def reduce_steps(self, num_steps: jax.Array) -> Last:
    return Last(self.value[num_steps - 1])

  def reduce_devices(self, axis_name: str) -> Last:
    first = jax.lax.axis_index(axis_name) == 0
    return Last(jax.lax.psum(jnp.where(first, self.value, 0.0), axis_name))

  def merge(self, other: Metric) -> Metric:
    return other

  def compute(self) -> float:
    return float(self.value)

  def compute_traces(self) -> np.ndarray:
    return np.asarray(self.value, np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Max(Metric):
  """The maximum over steps (and devices)."""

  value: jax.Array

  def reduce_steps(self, num_steps: jax.Array) -> Max:
    return Max(jnp.max(jnp.where(step_mask(self.value, num_steps), self.value, -jnp.inf)))

  def reduce_devices(self, axis_name: str) -> Max:
    return Max(jax.lax.pmax(self.value, axis_name))

  def merge(self, other: Metric) -> Max:
    assert isinstance(other, Max)
    return Max(np.maximum(self.value, other.value))  # type: ignore[arg-type]  # host numpy

  def compute(self) -> float:
    return float(self.value)

  def compute_traces(self) -> np.ndarray:
    return np.asarray(self.value, np.float32)


def as_metric(value: Any) -> Metric:
  """Casts a step's metric to a mergeable float32 value (scalars -> ``Mean``).

  Raises:
    ValueError: a value that is neither a :class:`Metric` nor a scalar (names its shape).
  """
  if isinstance(value, Metric):
    if jax.tree.leaves(value) == [value]:
      raise ValueError(f"metric kind {type(value).__qualname__} is not a pytree: decorate it "
                       "with @jax.tree_util.register_dataclass (see loopkit.metrics.Metric)")
    return jax.tree.map(_f32, value)
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
    dict of scalar float32 metrics (:meth:`Metric.reduce_steps`). Steps at index
    >= num_steps are ignored.
  """
  return {name: m.reduce_steps(num_steps) for name, m in traces.items()}


def reduce_devices(metrics: dict[str, Metric], axis_name: str) -> dict[str, Metric]:
  """Reduces metrics across a mapped axis (:meth:`Metric.reduce_devices`)."""
  return {name: m.reduce_devices(axis_name) for name, m in metrics.items()}


def merge(a: Metric, b: Metric) -> Metric:
  """Merges two host or device values of the same metric kind (``b`` is later).

  Raises:
    TypeError: ``a`` and ``b`` are of different kinds (names both).
  """
  if type(a) is not type(b):
    raise TypeError(f"cannot merge {type(a).__name__} with {type(b).__name__}")
  return a.merge(b)


def compute(m: Metric) -> float:
  """The metric's value as a Python float (``nan`` for a ``Mean`` of count 0)."""
  return m.compute()


def compute_traces(m: Metric) -> np.ndarray:
  """Per-step values ``[n]`` (float32) of a stacked host metric."""
  return m.compute_traces()


def _kind(m: Metric) -> str:
  t = type(m)
  return t.__name__ if t.__module__ == __name__ else f"{t.__module__}.{t.__qualname__}"


def to_json(m: Metric) -> dict[str, Any]:
  """A host metric value as JSON (``{"kind": "Mean", "total": ..., "count": ...}``).

  Exact: every field is a float32 scalar, which a JSON (float64) number holds
  exactly; :func:`from_json` gives back the same bits. Used to checkpoint
  running accumulators (e.g. :class:`loopkit.LoggingHook`'s, case C42). A user's
  metric kind is named ``module.QualName``.
  """
  fields = dataclasses.fields(m)  # type: ignore[arg-type]  # every kind is a dataclass
  return {"kind": _kind(m), **{f.name: float(np.float32(getattr(m, f.name))) for f in fields}}


def from_json(d: dict[str, Any]) -> Metric:
  """Inverse of :func:`to_json` (numpy float32 fields).

  Raises:
    ValueError: an unknown metric kind (naming it; a user's kind must be imported first).
  """
  kind = _KINDS.get(d.get("kind", ""))
  if kind is None:
    raise ValueError(f"unknown metric kind {d.get('kind')!r}; known: {sorted(_KINDS)}")
  return kind(**{f.name: np.float32(d[f.name]) for f in dataclasses.fields(kind)})
