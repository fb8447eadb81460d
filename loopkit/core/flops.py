"""FLOPs of one step counted from its jaxpr, for steps with inner loops XLA counts once.

XLA's cost analysis (``compiled.cost_analysis()``) counts a while loop's body once, whatever its
trip count. loopkit relies on that for its own K loop (the body is one step), but a model whose
layers run in a ``lax.scan`` (``nnx.scan`` over stacked layers, MaxText's ``scan_layers=True``)
is then counted as if it had one layer: an LM with scanned layers was reported about 20x low.

:func:`jaxpr_flops` counts the matrix FLOPs of a jaxpr instead, where every loop's trip count is
known: ``dot_general`` (``2 x output elements x contracted size``) and ``conv_general_dilated``
(``2 x output elements x kernel spatial size x input features per group``), a ``scan`` body
times its ``length``, a ``cond`` as its costliest branch, and the bodies of ``pjit``,
``custom_jvp``/``custom_vjp``, ``remat`` and ``shard_map`` (times the devices it maps over)
recursed. A ``while`` loop whose body has matrix FLOPs has an unknown trip count: the count is
None. Elementwise work is not counted.

:func:`step_flops` combines the two: XLA's figure (which includes the elementwise work) unless
the jaxpr's matrix FLOPs exceed it, which happens only where XLA counted an inner loop's body
once; then XLA's figure plus the matrix FLOPs of the inner loops' other trips (the jaxpr's count
less its count with every loop body once).
"""

from __future__ import annotations

import math
from typing import Any

import jax.extend.core as jex

__all__ = ["jaxpr_flops", "step_flops"]

# the param of `cond` (and `switch`) holding its branches: one of them runs
_BRANCHES = "branches"


def _dot_flops(eqn: Any) -> float:
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs = eqn.invars[0].aval.shape
  out = eqn.outvars[0].aval.shape
  return 2.0 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract)


def _conv_flops(eqn: Any) -> float:
  rhs = eqn.invars[1].aval.shape
  out = eqn.outvars[0].aval.shape
  rhs_spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, spatial...)
  # each output element: kernel spatial x (input features / groups) multiply-adds
  return 2.0 * math.prod(out) * math.prod(rhs) / rhs[rhs_spec[0]]


def _sub_jaxprs(value: Any) -> list[Any]:
  if isinstance(value, (jex.ClosedJaxpr, jex.Jaxpr)):
    return [value]
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in _sub_jaxprs(v)]
  return []


def _shard_map_devices(params: dict) -> int:
  """How many devices a ``shard_map`` body runs on (its body's shapes are one device's)."""
  mesh = params.get("mesh")
  shape = dict(getattr(mesh, "shape", {}) or {})
  manual = params.get("manual_axes")
  axes = shape if manual is None else [a for a in manual if a in shape]
  return math.prod(shape[a] for a in axes) if shape else 1


def jaxpr_flops(jaxpr: Any, *, loops_once: bool = False) -> float | None:
  """Matrix FLOPs of one run of ``jaxpr`` (``dot_general`` and ``conv_general_dilated``).

  Args:
    jaxpr: a ``jax.extend.core.ClosedJaxpr`` or ``Jaxpr`` (e.g. ``jax.make_jaxpr(f)(*args)``),
      on the shapes its arguments have there (global shapes for a ``jit`` step, one device's
      for a ``shard_map`` body).
    loops_once: count every ``scan`` body once, as XLA's cost analysis counts a loop's body.

  Returns:
    FLOPs (a float, >= 0): inner ``scan`` bodies times their ``length``, a ``cond`` as its
    costliest branch, ``shard_map`` bodies times the devices they map over; None where a
    ``while`` loop (a trip count unknown when tracing) contains matrix FLOPs.
  """
  inner = jaxpr.jaxpr if isinstance(jaxpr, jex.ClosedJaxpr) else jaxpr
  total = 0.0
  for eqn in inner.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      total += _dot_flops(eqn)
      continue
    if name == "conv_general_dilated":
      total += _conv_flops(eqn)
      continue
    if _BRANCHES in eqn.params:  # cond / switch: the costliest branch
      counts = [jaxpr_flops(b, loops_once=loops_once) for b in eqn.params[_BRANCHES]]
      if any(c is None for c in counts):
        return None
      total += max([c for c in counts if c is not None], default=0.0)
      continue
    subs = [j for v in eqn.params.values() for j in _sub_jaxprs(v)]
    if not subs:
      continue
    counts = [jaxpr_flops(j, loops_once=loops_once) for j in subs]
    if any(c is None for c in counts):
      return None
    sub = sum(c for c in counts if c is not None)
    if name == "while":
      if sub > 0:
        return None  # trip count unknown
      continue
    if name == "scan" and not loops_once:
      sub *= int(eqn.params["length"])
    elif name == "shard_map":
      sub *= _shard_map_devices(eqn.params)
    total += sub
  return total


def step_flops(xla_flops: float | None, jaxpr_count: float | None,
               jaxpr_loops_once: float | None = None) -> float | None:
  """FLOPs of one step on one device: XLA's, plus what XLA missed of inner loops.

  Args:
    xla_flops: XLA's cost-analysis FLOPs of the step (per device; inner loop bodies counted
      once), or None.
    jaxpr_count: :func:`jaxpr_flops` of the step, per device (a global count divided by the
      devices the step is split over), or None.
    jaxpr_loops_once: the same with ``loops_once=True`` (XLA's way), or None: taken as 0.

  Returns:
    ``xla_flops`` where it is at least ``jaxpr_count`` (no inner loop, or XLA unrolled it);
    else XLA's count plus the matrix FLOPs of the inner loops' other trips,
    ``xla_flops + jaxpr_count - jaxpr_loops_once`` (the elementwise work inside an inner loop
    stays counted once), at least ``jaxpr_count``; None where neither count is positive.
  """
  xla = xla_flops if xla_flops is not None and xla_flops > 0 else None
  own = jaxpr_count if jaxpr_count is not None and jaxpr_count > 0 else None
  if own is None or (xla is not None and xla >= own):
    return None if xla is None else float(xla)
  if xla is None:
    return float(own)
  return float(max(own, xla + own - (jaxpr_loops_once or 0.0)))
