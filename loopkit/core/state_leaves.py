"""A train state's leaves as the loop takes them: their types and a fingerprint of their bits.

:func:`as_loop_leaf` and :func:`strong_typed` give a state's leaves the types the compiled program
returns (a Python scalar or weak-typed leaf becomes a strong array), so that the program compiles
once and code that reads leaves' shapes and dtypes (warm start, restore) takes every state the loop
takes; :func:`leaf_fingerprint` reduces a leaf's bits to two words, to compare the copies of a
replicated state (:meth:`loopkit.core.program.MultiStepProgram.diverged_leaves`). Pure functions;
thread-safe.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def as_loop_leaf(x: Any) -> Any:
  """A state leaf as the loop places it: a Python scalar (``TrainState.create``'s ``step=0``)
  becomes the strong array :func:`strong_typed` makes of it (``int`` -> int32, ``float`` ->
  float32); anything else (``jax.Array``, numpy arrays and scalars, ``jax.ShapeDtypeStruct``) is
  returned as it is. Lets code that reads leaves' shapes and dtypes (warm start, restore) take
  every state the loop takes."""
  if isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic):
    x = jnp.asarray(x)
    return jax.lax.convert_element_type(x, x.dtype)
  return x


def strong_typed(tree: Any) -> Any:
  """``tree`` with its weak-typed leaves made strong, same dtype and placement.

  A Python scalar or ``jnp.asarray(1.0)`` is a *weak-typed* float32; most
  steps return such a leaf strong (``jnp.float32`` arithmetic with a strong
  operand), and a jitted program is specialised on weak types, so a weak leaf
  in the state compiles the program a second time on the next call.

  Args:
    tree: a pytree of arrays and scalars.

  Returns:
    The pytree with every weak-typed leaf (Python scalars included) replaced
    by a strong array of the dtype JAX gives it (``jnp.asarray(1.0)`` ->
    float32); other leaves unchanged (the same objects).
  """
  def strong(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if x.weak_type else x
    x = as_loop_leaf(x)
    if getattr(x, "weak_type", False):
      return jax.lax.convert_element_type(x, x.dtype)
    return x
  return jax.tree.map(strong, tree)


def leaf_fingerprint(x: jax.Array) -> jax.Array:
  """Two uint32 words that summarise the bits of an array (any dtype, typed PRNG keys too).

  Word 0 is ``sum(u[i] * (2 i + 1))`` and word 1 ``sum((u[i] ^ (u[i] >> 15)) *
  (2654435761 i | 1))``, modulo 2**32, over the array's bits ``u`` as uint32
  (8- and 16-bit elements widened, 64-bit ones split in two words). Equal arrays
  give equal words; a change of any element changes word 0 unless it is a
  multiple of 2**32 apart in that weighted sum, and both words collide only by
  accident (the weights differ per position, so permutations are caught too).
  Traceable (used inside :meth:`MultiStepProgram.diverged_leaves`).
  """
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  width = jnp.dtype(x.dtype).itemsize
  u = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32,
                                       8: jnp.uint32}[width]).astype(jnp.uint32).reshape(-1)
  i = jax.lax.iota(jnp.uint32, u.size)
  w0 = i * jnp.uint32(2) + jnp.uint32(1)
  w1 = (i * jnp.uint32(2654435761)) | jnp.uint32(1)
  return jnp.stack([jnp.sum(u * w0, dtype=jnp.uint32),
                    jnp.sum((u ^ (u >> jnp.uint32(15))) * w1, dtype=jnp.uint32)])
