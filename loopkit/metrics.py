"""Mergeable metric values, in float32, folded over steps in step order.

A train step returns ``metrics``: a dict whose values are either scalar arrays
or one of the mergeable values below. Every value is cast to float32 first, so
nothing accumulates in a low-precision dtype (a bf16 accumulator stalls at
256). Inside a device call each step's value is reduced over the
devices in that step (per-device steps only) and stored in ``[K]`` traces; the
host then *folds* the steps that ran in step order: ``s1.merge(s2).merge(s3)...``
(:func:`fold_steps`), and a :class:`loopkit.LoggingHook` row continues the same
fold over the calls since its last row.

Exactness: a row, and every value a hook sees, is a function of the
per-step values in step order only, never of where the device calls were cut,
so it is bitwise the same for every ``iterations_per_loop`` (K), as the
parameters are. No float32 sum spans a device call's steps in another order:
XLA's reduction of a ``[K]`` vector is not a left fold (XLA:CPU vectorises it
from K = 64), nor is ``np.sum`` (pairwise); ``np.add.accumulate`` is.

A plain scalar array is treated as ``Mean(value, 1)`` per step, so the value
reported for a call is the mean over its steps.

Every kind follows one small protocol (:class:`Metric`: ``reduce_devices``,
``merge``, ``compute``; optionally a vectorised ``fold_steps`` and
``compute_traces``), so a user's own kind works in the train step's metrics, is
reduced over the devices and the steps, and is logged by
:class:`loopkit.LoggingHook` like the built-in ones (``tests/test_metrics.py``,
``tests/test_exact_metrics.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Metric", "Mean", "Sum", "Last", "Max", "as_metric", "reduce_devices", "compute",
           "merge", "fold_steps", "first_nonfinite", "to_json", "from_json"]


def _f32(x: jax.typing.ArrayLike) -> jax.Array:
  return jnp.asarray(x, dtype=jnp.float32)


def _fold(ufunc: np.ufunc, steps: Any, init: Any) -> Any:  # host numpy, a field's value
  """``ufunc`` folded left over the float32 values ``steps`` ``[n]``, after ``init`` if given
  (a 0-d array that owns its memory): ``ufunc.accumulate`` is sequential (``np.add.reduce``,
  like XLA's reduce, is not)."""
  x = np.asarray(steps, np.float32)  # the fetched traces are float32 [n]: no copy
  if init is not None:
    x = np.concatenate((np.asarray(init, np.float32).reshape(1), x))
  return np.array(ufunc.accumulate(x)[-1])


_KINDS: dict[str, type] = {}


class Metric:
  """A mergeable metric value: the protocol every metric kind follows (after CLU's
  ``clu.metrics.Metric``).

  A metric is a frozen dataclass registered as a pytree
  (``@jax.tree_util.register_dataclass``) whose fields are float32 arrays, subclassing this
  class and implementing:

  * :meth:`reduce_devices`: -> the value over the devices of a mapped axis (traced, once per
    step; per-device steps only);
  * :meth:`merge`: two values of the same kind -> their combination, ``other`` later (host
    numpy values);
  * :meth:`compute`: -> the Python float that is logged.

  A train step may return any such value among its metrics, and loopkit reduces it over the
  devices, folds it over the steps and logs it, with no change to loopkit. Subclasses are
  registered by name for :func:`from_json` (``Mean``, ..., and ``module.QualName`` for
  others), so a checkpointed running value comes back as the same kind.

  Exactness: every value loopkit reports is the left fold of the per-step values
  in step order, ``merge(merge(s1, s2), s3)...`` (:meth:`fold_steps`), so it is the same for
  every ``iterations_per_loop``. For that, ``merge`` must be a pure function of its two
  values (no state, no clock) computed in float32 numpy on the host; a kind that overrides
  :meth:`fold_steps` (to vectorise it) must give the same bits as that fold. ``merge`` need
  not be associative: the fold's order is fixed.
  """

  def __init_subclass__(cls, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)
    builtin = cls.__module__ == __name__
    _KINDS[cls.__name__ if builtin else f"{cls.__module__}.{cls.__qualname__}"] = cls

  def reduce_devices(self, axis_name: str) -> Metric:
    """The value over the devices of the mapped axis ``axis_name`` (inside ``shard_map``)."""
    raise NotImplementedError(f"{type(self).__name__}.reduce_devices")

  def merge(self, other: Metric) -> Metric:
    """This value combined with ``other`` (the later one), on the host."""
    raise NotImplementedError(f"{type(self).__name__}.merge")

  def compute(self) -> float:
    """The value to log, a Python float."""
    raise NotImplementedError(f"{type(self).__name__}.compute")

  def fold_steps(self, init: Metric | None = None) -> Metric | None:
    """The per-step values of a value whose fields are stacked ``[n]``, folded in step order.

    ``init.merge(s[0]).merge(s[1])...merge(s[n - 1])`` (host), where ``s[i]`` is step ``i``'s
    value; without ``init``, ``s[0].merge(s[1])...``. Default: that loop over :meth:`merge`
    (one call per step); the built-in kinds vectorise it with ``np.ufunc.accumulate``, bitwise
    the same.

    Args:
      init: the value to continue from (e.g. a row's running value), or None.

    Returns:
      The folded value (float32 numpy fields); ``init`` when ``n == 0``.
    """
    leaves, treedef = jax.tree.flatten(self)
    leaves = [np.asarray(x) for x in leaves]
    acc = init
    for i in range(np.shape(leaves[0])[0] if leaves else 0):
      step = jax.tree.unflatten(treedef, [x[i] for x in leaves])
      acc = step if acc is None else merge(acc, step)
    return acc

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

  def reduce_devices(self, axis_name: str) -> Mean:  # sums and counts, never mean of means
    return Mean(jax.lax.psum(self.total, axis_name), jax.lax.psum(self.count, axis_name))

  def merge(self, other: Metric) -> Mean:
    assert isinstance(other, Mean)
    return Mean(self.total + other.total, self.count + other.count)

  def compute(self) -> float:
    count = float(self.count)
    return float(self.total) / count if count else float("nan")

  def fold_steps(self, init: Metric | None = None) -> Metric | None:
    if np.size(self.count) == 0:
      return init
    assert init is None or isinstance(init, Mean)
    return Mean(_fold(np.add, self.total, None if init is None else init.total),
                _fold(np.add, self.count, None if init is None else init.count))

  def compute_traces(self) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
      return np.asarray(self.total, np.float32) / np.asarray(self.count, np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sum(Metric):
  """A float32 sum over steps (and devices, for per-device steps)."""

  value: jax.Array

  def reduce_devices(self, axis_name: str) -> Sum:
    return Sum(jax.lax.psum(self.value, axis_name))

  def merge(self, other: Metric) -> Sum:
    assert isinstance(other, Sum)
    return Sum(self.value + other.value)

  def compute(self) -> float:
    return float(self.value)

  def fold_steps(self, init: Metric | None = None) -> Metric | None:
    if np.size(self.value) == 0:
      return init
    assert init is None or isinstance(init, Sum)
    return Sum(_fold(np.add, self.value, None if init is None else init.value))

  def compute_traces(self) -> np.ndarray:
    return np.asarray(self.value, np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Last(Metric):
  """The value at the last step of the call (device 0's for per-device steps)."""

  value: jax.Array

  def reduce_devices(self, axis_name: str) -> Last:
    first = jax.lax.axis_index(axis_name) == 0
    return Last(jax.lax.psum(jnp.where(first, self.value, 0.0), axis_name))

  def merge(self, other: Metric) -> Metric:
    return other

  def compute(self) -> float:
    return float(self.value)

  def fold_steps(self, init: Metric | None = None) -> Metric | None:
    if np.size(self.value) == 0:
      return init
    last: Any = np.array(np.asarray(self.value, np.float32)[-1])  # host numpy
    return Last(last)

  def compute_traces(self) -> np.ndarray:
    return np.asarray(self.value, np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Max(Metric):
  """The maximum over steps (and devices)."""

  value: jax.Array

  def reduce_devices(self, axis_name: str) -> Max:
    return Max(jax.lax.pmax(self.value, axis_name))

  def merge(self, other: Metric) -> Max:
    assert isinstance(other, Max)
    return Max(np.maximum(self.value, other.value))  # type: ignore[arg-type]  # host numpy

  def compute(self) -> float:
    return float(self.value)

  def fold_steps(self, init: Metric | None = None) -> Metric | None:
    if np.size(self.value) == 0:
      return init
    assert init is None or isinstance(init, Max)
    return Max(_fold(np.maximum, self.value, None if init is None else init.value))

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


def fold_steps(steps: Metric, init: Metric | None = None) -> Metric:
  """The per-step values ``steps`` (host, fields ``[n]``) folded in step order after ``init``.

  :meth:`Metric.fold_steps`: ``init.merge(s[0]).merge(s[1])...``, the one order in which
  loopkit combines steps (the same bits for every ``iterations_per_loop``).

  Raises:
    TypeError: ``init`` is of another kind than ``steps`` (names both).
    ValueError: no step (``n == 0``) and no ``init``.
  """
  if init is not None and type(init) is not type(steps):
    raise TypeError(f"cannot merge {type(init).__name__} with {type(steps).__name__}")
  out = steps.fold_steps(init)
  if out is None:
    raise ValueError(f"no step to fold: a {type(steps).__name__} with 0 steps and no init")
  return out


def first_nonfinite(traces: dict[str, Metric]) -> jax.Array:
  """For each metric, the first step whose value has a NaN or infinite field (traced).

  Args:
    traces: dict of metrics whose leaves are stacked per step ``[K]``; the slots of steps
      that did not run hold zeros (as the program's traces do).

  Returns:
    int32 ``[M]``, one entry per metric in ``sorted(traces)`` order: the 1-based index ``i``
    of the first step (slot ``i - 1``) at which any field of that metric is not finite, or 0
    if none is (so ``any()`` asks "was any metric non-finite").
  """
  firsts = []
  for name in sorted(traces):
    leaves = jax.tree.leaves(traces[name])
    bad = jnp.zeros(leaves[0].shape[:1], bool) if leaves else jnp.zeros((0,), bool)
    for x in leaves:
      bad = bad | ~jnp.isfinite(x)
    firsts.append(jnp.where(jnp.any(bad), jnp.argmax(bad) + 1, 0).astype(jnp.int32))
  return jnp.stack(firsts) if firsts else jnp.zeros((0,), jnp.int32)


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
  running accumulators (e.g. :class:`loopkit.LoggingHook`'s). A user's
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
