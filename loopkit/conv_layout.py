"""Convolutions in canonical layout inside the loop body (an XLA:CPU workaround).

On the CPU backend XLA runs a convolution fast (Eigen/oneDNN) only when its
operands are in the canonical layout ``[N, spatial..., C]`` x
``[spatial..., I, O]`` -> ``[N, spatial..., C]``. In a top-level program its
``ConvCanonicalization`` pass inserts the transposes that make any convolution
canonical, but inside a ``while`` body (loopkit's ``fori_loop``, or any
``lax.scan``) the two *gradient* convolutions JAX emits for a conv layer keep
their non-canonical dimension numbers (batch and feature swapped for the kernel
gradient, input and output features swapped for the input gradient) and fall
back to a naive loop nest, 10-100x slower (jax-ml/jax#12868,
"Convolution is significantly slower inside a loop body (CPU)"; figures in
docs/tuning.md).

:func:`canonicalize_convs` rewrites a traced step: every
``conv_general_dilated`` whose dimension numbers are not canonical becomes
transposes of its operands into canonical order (fenced with
``lax.optimization_barrier`` so that XLA cannot fold them back into the
convolution), a canonical convolution with the same strides, padding,
dilations, group counts, precision and element type, and a transpose of the
result back. Transposing is a pure relayout, and the canonical convolution is
the one XLA:CPU's ``ConvCanonicalization`` runs for a top-level convolution, so
the rewritten step gives bitwise the values of a per-step ``jit`` of the same
step (the naive in-loop kernel sums in another order: last-bit differences),
and the same for every K (every K runs this rewritten step). Not on an AVX-512 x86 CPU under
jax 0.12: there the rewritten step alone, in a plain ``jit``, differs from the step's ``jit`` in
the last bits (docs/concepts.md, "AVX-512 CPUs under jax 0.12"); every K still gives the same
bits.
:class:`~loopkit.core.program.MultiStepProgram` applies it when its mesh is on CPU
devices (``canonical_convs=None``, the default).

bfloat16: XLA:CPU has no bfloat16 convolution. Its ``FloatNormalization`` pass
computes one in float32 and rounds the result to bfloat16, except for users
that convert the result to float32: with ``--xla_allow_excess_precision``
(XLA's default) those get the float32 result unrounded. A bfloat16 conv layer
with float32 parameters is such a case: its kernel gradient is converted to
float32 straight away. A transpose back between the convolution and that
convert would round it (one ``nn.Conv(8, (3, 3), dtype=bfloat16)``, one SGD
step: 2.4e-5 off the per-step ``jit``), so a ``convert_element_type`` of a
rewritten convolution's result is applied to the canonical result and
transposed after (the two commute exactly): XLA then rounds exactly where it
rounds in the per-step program, with either setting of the flag.

Convolutions inside nested ``jax.jit`` calls are rewritten too (the call is
inlined); those inside other higher-order primitives (``scan``, ``cond``,
``remat``, ...) are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core
from jax import lax
from jax.sharding import PartitionSpec

from loopkit._internal import compat

_CALL_PRIMITIVES = ("pjit", "jit", "closed_call", "core_call")


def _canonical_specs(dn: lax.ConvDimensionNumbers) -> bool:
  n = len(dn.lhs_spec) - 2
  spatial = tuple(range(1, n + 1))
  return (tuple(dn.lhs_spec) == (0, n + 1) + spatial
          and tuple(dn.rhs_spec) == (n + 1, n) + tuple(range(n))
          and tuple(dn.out_spec) == (0, n + 1) + spatial)


def is_canonical(params: dict[str, Any]) -> bool:
  """Whether a ``conv_general_dilated`` equation's dimension numbers are canonical.

  Args:
    params: the equation's parameters (``eqn.params``).

  Returns:
    True for ``lhs [N, spatial..., C]``, ``rhs [spatial..., I, O]``,
    ``out [N, spatial..., C]`` (``"NHWC", "HWIO", "NHWC"`` in 2-D).
  """
  return _canonical_specs(params["dimension_numbers"])


def _with_canonical_sharding(params: dict[str, Any], key: str,
                             src: Sequence[int]) -> dict[str, Any]:
  """``params`` with the sharding ``params[key]`` (of the ``out_spec`` layout) in canonical
  order."""
  sharding = params.get(key)
  if sharding is None:
    return params
  spec = tuple(sharding.spec) + (None,) * (len(src) - len(sharding.spec))
  canonical_spec = [None] * len(src)
  for p, c in enumerate(src):
    canonical_spec[c] = spec[p]
  return {**params, key: sharding.update(spec=PartitionSpec(*canonical_spec))}


def _canonical_parts(lhs: jax.Array, rhs: jax.Array,
                     **params: Any) -> tuple[jax.Array, tuple[int, ...]]:
  """The canonical convolution ``[N, spatial..., C]`` and the permutation back to ``out_spec``."""
  dn = params["dimension_numbers"]
  n = len(dn.lhs_spec) - 2
  lhs_perm = (dn.lhs_spec[0], *dn.lhs_spec[2:], dn.lhs_spec[1])
  rhs_perm = (*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0])
  fence = lax.optimization_barrier
  lhs_c = fence(lax.transpose(lhs, lhs_perm))
  rhs_c = fence(lax.transpose(rhs, rhs_perm))
  spatial = tuple(range(1, n + 1))
  canonical = lax.ConvDimensionNumbers(
      lhs_spec=(0, n + 1) + spatial, rhs_spec=(n + 1, n) + tuple(range(n)),
      out_spec=(0, n + 1) + spatial)
  # The result is [N, spatial..., C]; position p of the wanted output holds its axis src[p].
  src = [0] * (n + 2)
  src[dn.out_spec[0]] = 0
  src[dn.out_spec[1]] = n + 1
  for i, p in enumerate(dn.out_spec[2:]):
    src[p] = 1 + i
  new_params = _with_canonical_sharding({**params, "dimension_numbers": canonical},
                                        "out_sharding", src)
  return lax.conv_general_dilated_p.bind(lhs_c, rhs_c, **new_params), tuple(src)


def canonical_conv(lhs: jax.Array, rhs: jax.Array, **params: Any) -> jax.Array:
  """``conv_general_dilated_p`` with the operands relaid out into canonical order.

  Args:
    lhs: the input, laid out as ``params["dimension_numbers"].lhs_spec`` says.
    rhs: the kernel, laid out as ``rhs_spec`` says.
    **params: the ``conv_general_dilated`` equation's parameters.

  Returns:
    The convolution, laid out as ``out_spec`` says: equal as a function to
    ``lax.conv_general_dilated_p.bind(lhs, rhs, **params)``.
  """
  out_c, src = _canonical_parts(lhs, rhs, **params)
  return lax.transpose(out_c, src)


def count_convs(jaxpr: Any) -> tuple[int, int]:
  """Counts the non-canonical convolutions a rewrite would and would not reach.

  Args:
    jaxpr: a ``jax.extend.core.Jaxpr`` (or ``ClosedJaxpr``).

  Returns:
    ``(rewritable, unreached)``: non-canonical ``conv_general_dilated``
    equations at top level or inside nested ``jit`` calls, and those inside
    other higher-order primitives.
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  done = left = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive is lax.conv_general_dilated_p:
      done += not is_canonical(eqn.params)
    elif eqn.primitive.name in _CALL_PRIMITIVES and "jaxpr" in eqn.params:
      inner_done, inner_left = count_convs(eqn.params["jaxpr"])
      done, left = done + inner_done, left + inner_left
    else:
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        left += sum(count_convs(sub))
  return done, left


# A rewritten convolution's result before its transpose back: (canonical result, permutation).
_Canonical = tuple[jax.Array, tuple[int, ...]]


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
          canonical_args: dict[int, _Canonical] | None = None
          ) -> tuple[list[Any], dict[int, _Canonical]]:
  """``eval_jaxpr`` with non-canonical convolutions rewritten and nested jits inlined.

  A ``convert_element_type`` of a rewritten convolution's result converts the canonical
  result and transposes after it (see the module docstring: XLA:CPU's bfloat16 excess
  precision). ``canonical_args`` gives, by position, the inputs that are rewritten
  convolutions' results (a nested jit's operands); the second return value does the same for
  the outputs.
  """
  env: dict[Any, Any] = {}
  canonical: dict[Any, _Canonical] = {}  # var -> its rewritten convolution's canonical result

  def read(v):
    return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

  def canonical_of(vs):
    return {i: canonical[v] for i, v in enumerate(vs)
            if not isinstance(v, jax.extend.core.Literal) and v in canonical}

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for i, (v, x) in enumerate(zip(jaxpr.invars, args)):
    env[v] = x
    if canonical_args and i in canonical_args:
      canonical[v] = canonical_args[i]
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    with compat.source_info_context(eqn), eqn.ctx.manager:
      if eqn.primitive is lax.conv_general_dilated_p and not is_canonical(eqn.params):
        out_c, src = _canonical_parts(*invals, **eqn.params)
        canonical[eqn.outvars[0]] = out_c, src
        outs = [lax.transpose(out_c, src)]
      elif eqn.primitive is lax.convert_element_type_p and canonical_of(eqn.invars):
        out_c, src = canonical_of(eqn.invars)[0]
        converted = lax.convert_element_type_p.bind(
            out_c, **_with_canonical_sharding(eqn.params, "sharding", src))
        outs = [lax.transpose(converted, src)]
      elif (eqn.primitive.name in _CALL_PRIMITIVES and "jaxpr" in eqn.params
            and (count_convs(eqn.params["jaxpr"])[0] or canonical_of(eqn.invars))):
        inner = eqn.params["jaxpr"]
        outs, inner_canonical = _eval(inner.jaxpr, inner.consts, invals,
                                      canonical_of(eqn.invars))
        canonical.update({eqn.outvars[i]: c for i, c in inner_canonical.items()})
      else:
        ans = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
        outs = list(ans) if eqn.primitive.multiple_results else [ans]
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [read(v) for v in jaxpr.outvars], canonical_of(jaxpr.outvars)


def canonicalize_convs(closed: Any) -> Callable[..., list[Any]]:
  """A function evaluating ``closed`` with its convolutions in canonical layout.

  Args:
    closed: a ``jax.extend.core.ClosedJaxpr`` (e.g. from ``jax.make_jaxpr``).

  Returns:
    ``f(*flat_args) -> flat_outputs`` like ``jax.extend.core.jaxpr_as_fun(closed)``;
    that function itself when ``closed`` has no convolution to rewrite.
  """
  if count_convs(closed.jaxpr)[0] == 0:
    return jax.extend.core.jaxpr_as_fun(closed)
  return lambda *args: _eval(closed.jaxpr, closed.consts, args)[0]


def with_canonical_convs(fn: Callable) -> Callable:
  """Wraps ``fn`` so that its convolutions run in canonical layout (see module doc).

  For functions run inside your own ``lax.scan`` / ``fori_loop`` on CPU (loopkit's
  program applies the rewrite itself). ``fn`` is traced on every call of the
  wrapper, so call it inside the traced loop body, not per step from Python.

  Args:
    fn: a function of pytrees of arrays returning a pytree of arrays.

  Returns:
    A function with the same signature and the same values.
  """
  def wrapped(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    flat = canonicalize_convs(closed)(*jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), flat)
  return wrapped
