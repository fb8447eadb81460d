"""A 2-D convolution whose gradients are canonical convolutions (an XLA:CPU workaround).

On the CPU backend, XLA computes a convolution's gradients well in a top-level
program, but inside a loop body (loopkit runs its K steps in a
``lax.fori_loop``) the two gradient convolutions keep non-canonical dimension
orders (batch and feature swapped for the kernel gradient, input/output
features swapped for the input gradient) and fall back to a naive kernel: a
ResNet step runs 3-4x slower inside the loop than as a single jitted step,
and a single 3x3 convolution's gradient over 40x slower (jax-ml/jax#12868,
"Convolution is significantly slower inside a loop body (CPU)"; measured here
with jax 0.10.2).

:func:`conv_general_dilated` has the same signature as
``jax.lax.conv_general_dilated`` and the same values, bit for bit on this CPU.
For the NHWC/HWIO, undilated, ungrouped convolutions of the ResNet it
defines its gradients itself (``jax.custom_vjp``) as convolutions in the
canonical ``NHWC, HWIO -> NHWC`` order, with explicit transposes fenced off by
``lax.optimization_barrier`` so that XLA cannot fold them back into the
convolution; everything else goes to ``lax.conv_general_dilated``. Pass it as
``nnx.Conv(..., conv_general_dilated=...)`` (``models.ResNet(loop_friendly_conv=True)``).
Only the CPU configurations use it; accelerators compile the plain
convolution well inside loops.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

_NHWC = ("NHWC", "HWIO", "NHWC")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv(x: jax.Array, w: jax.Array, strides: tuple[int, int],
          padding: tuple[tuple[int, int], tuple[int, int]]) -> jax.Array:
  return lax.conv_general_dilated(x, w, strides, padding, dimension_numbers=_NHWC)


def _conv_fwd(x, w, strides, padding):
  return _conv(x, w, strides, padding), (x, w)


def _conv_bwd(strides, padding, residuals, dy):
  x, w = residuals
  kh, kw = w.shape[:2]
  h, wd = x.shape[1:3]
  ho, wo = dy.shape[1:3]
  (plh, _), (plw, _) = padding
  sh, sw = strides
  fence = lax.optimization_barrier
  # Kernel gradient dW[a, b, i, o] = sum_{n, y, x} x[n, y*s + a - p, x*s + b - p, i] dy[n, y, x, o]:
  # a canonical convolution of x as [Cin, H, W, N] ("batch" Cin, "features" N) with dy
  # as an [Ho, Wo, N, Cout] kernel dilated by the stride.
  xt = fence(jnp.transpose(x, (3, 1, 2, 0)))
  dyt = fence(jnp.transpose(dy, (1, 2, 0, 3)).astype(x.dtype))
  dwt = lax.conv_general_dilated(
      xt, dyt, (1, 1),
      ((plh, kh + (ho - 1) * sh - h - plh), (plw, kw + (wo - 1) * sw - wd - plw)),
      rhs_dilation=(sh, sw), dimension_numbers=_NHWC,
      out_sharding=_kernel_grad_sharding(w))  # [Cin, kh, kw, Cout]
  dw = jnp.transpose(dwt, (1, 2, 0, 3)).astype(w.dtype)
  # Input gradient: the transposed convolution, i.e. dy dilated by the stride convolved with
  # the spatially flipped kernel with input/output features swapped ([kh, kw, Cout, Cin]).
  wt = fence(jnp.transpose(jnp.flip(w, (0, 1)), (0, 1, 3, 2)).astype(dy.dtype))
  dx = lax.conv_general_dilated(
      dy, wt, (1, 1),
      ((kh - 1 - plh, h - 1 - (ho - 1) * sh + plh), (kw - 1 - plw, wd - 1 - (wo - 1) * sw + plw)),
      lhs_dilation=(sh, sw), dimension_numbers=_NHWC)
  return dx.astype(x.dtype), dw


_conv.defvjp(_conv_fwd, _conv_bwd)


def _kernel_grad_sharding(w: jax.Array) -> NamedSharding | None:
  """Sharding of the ``[Cin, kh, kw, Cout]`` kernel gradient under explicit sharding.

  With explicit mesh axes (``jax.make_mesh``'s default) the kernel-gradient
  convolution contracts over the batch, which is sharded, so JAX needs its
  output sharding: that of the kernel ``[kh, kw, Cin, Cout]``, permuted (the
  partial sums are then all-reduced, as in the plain convolution's gradient).
  None without explicit axes.
  """
  sharding = getattr(jax.typeof(w), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
    return None
  spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
  return NamedSharding(mesh, P(spec[2], spec[0], spec[1], spec[3]))


def _is_nhwc(dimension_numbers: Any) -> bool:
  if dimension_numbers is None:
    return False
  if isinstance(dimension_numbers, lax.ConvDimensionNumbers):
    return (tuple(dimension_numbers.lhs_spec) == (0, 3, 1, 2)
            and tuple(dimension_numbers.rhs_spec) == (3, 2, 0, 1)
            and tuple(dimension_numbers.out_spec) == (0, 3, 1, 2))
  return tuple(dimension_numbers) == _NHWC


def conv_general_dilated(lhs: jax.Array, rhs: jax.Array, window_strides: Sequence[int],
                         padding: Any, lhs_dilation: Sequence[int] | None = None,
                         rhs_dilation: Sequence[int] | None = None,
                         dimension_numbers: Any = None, feature_group_count: int = 1,
                         batch_group_count: int = 1, precision: Any = None,
                         preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
  """``lax.conv_general_dilated`` with loop-friendly gradients for plain NHWC convolutions.

  Args:
    lhs: ``[N, H, W, Cin]`` input.
    rhs: ``[kh, kw, Cin, Cout]`` kernel.
    window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
      feature_group_count, batch_group_count, precision,
      preferred_element_type: as in ``jax.lax.conv_general_dilated``.
    **kwargs: passed to ``lax.conv_general_dilated`` on the fallback path
      (e.g. ``out_sharding=None`` from Flax).

  Returns:
    ``[N, Ho, Wo, Cout]``, equal to ``lax.conv_general_dilated``'s result.
  """
  plain = (lhs.ndim == 4 and _is_nhwc(dimension_numbers) and feature_group_count == 1
           and batch_group_count == 1 and not isinstance(padding, str)
           and all(d == 1 for d in (lhs_dilation or (1, 1)))
           and all(d == 1 for d in (rhs_dilation or (1, 1)))
           and precision is None and preferred_element_type is None
           and kwargs.get("out_sharding") is None)
  if not plain:
    return lax.conv_general_dilated(
        lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count, batch_group_count=batch_group_count,
        precision=precision, preferred_element_type=preferred_element_type, **kwargs)
  pads = tuple((int(lo), int(hi)) for lo, hi in padding)
  return _conv(lhs, rhs, tuple(int(s) for s in window_strides), pads)
