"""Per-step random keys that do not depend on iterations_per_loop or resumes."""

from __future__ import annotations

import jax


def step_key(key: jax.Array, step: jax.typing.ArrayLike, *,
             axis_name: str | None = None) -> jax.Array:
  """A key for one train step: ``fold_in(key, step)`` (and the device index).

  Derived only from the base key and the global step, so the randomness of
  step ``s`` is the same whatever K is and wherever calls are cut or resumed.

  Args:
    key: base PRNG key (typed or raw uint32 ``[2]``), usually kept in the state.
    step: int scalar, the global step of the update (e.g. ``state.step``).
    axis_name: in a per-device step, the data axis name; the device index
      (``lax.axis_index``) is folded in so devices draw different numbers.

  Returns:
    A key of the same kind as ``key``.
  """
  key = jax.random.fold_in(key, step)
  if axis_name is not None:
    key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
  return key
