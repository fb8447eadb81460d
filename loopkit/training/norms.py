"""Gradient, update and parameter norms as opt-in step metrics.

Norms are per-step metrics like the loss: computed inside the train step (traced, float32),
returned among its metrics, and reported by :class:`~loopkit.LoggingHook` as the mean over a
row's steps (a plain scalar metric, :mod:`loopkit.metrics`). Every value is a function of one
step's arrays, so the rows are bitwise the same for every ``iterations_per_loop`` (K).

Two ways in:

* :func:`norms` inside your step, for the gradients (only the step sees them)::

    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    metrics = {"loss": loss, **loopkit.training.norms.norms(grads=grads, updates=updates)}

* :func:`with_norms` around an existing step, for what can be read from its states: the norm
  of the parameters after the step and of the change the step made to them.

:func:`global_norm` is ``sqrt`` of the sum of squares of every leaf, in float32, the leaves'
sums added in leaf order (``optax.global_norm``'s formula; the same bits for float32 trees).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["global_norm", "norms", "with_norms"]


def global_norm(tree: Any) -> jax.Array:
  """The L2 norm of all the leaves of ``tree`` together.

  Args:
    tree: a pytree of arrays (any float dtype; complex leaves count ``|x|^2``).

  Returns:
    A float32 scalar: ``sqrt(sum over leaves of sum(|x|^2))``, each leaf's squares summed in
    float32, the leaves' sums added left to right. 0 for a tree without leaves.
  """
  total = jnp.zeros((), jnp.float32)
  for x in jax.tree.leaves(tree):
    x = jnp.asarray(x)
    sq = (x.real ** 2 + x.imag ** 2) if jnp.iscomplexobj(x) else x ** 2
    total = total + jnp.sum(sq.astype(jnp.float32))
  return jnp.sqrt(total)


def norms(*, grads: Any = None, updates: Any = None, params: Any = None) -> dict[str, jax.Array]:
  """Step metrics ``grad_norm``, ``update_norm`` and ``param_norm`` for the trees given.

  Call it inside a train step and merge its dict into the step's metrics.

  Args:
    grads: the gradients (after any all-reduce), or None.
    updates: the optimizer's updates (what ``optax.apply_updates`` adds), or None.
    params: the parameters (usually after the update), or None.

  Returns:
    ``{"grad_norm": ..., "update_norm": ..., "param_norm": ...}`` for the trees given (float32
    scalars, :func:`global_norm`).
  """
  out = {}
  for name, tree in (("grad_norm", grads), ("update_norm", updates), ("param_norm", params)):
    if tree is not None:
      out[name] = global_norm(tree)
  return out


def _getter(params: str | Callable[[Any], Any]) -> Callable[[Any], Any]:
  if callable(params):
    return params
  if isinstance(params, str):
    name = params

    def get(state: Any) -> Any:
      return state[name] if isinstance(state, dict) else getattr(state, name)
    return get
  raise TypeError(f"with_norms: params must be a key/attribute name or a function of the "
                  f"state, got {params!r}")


def with_norms(train_step: Callable, *, params: str | Callable[[Any], Any] = "params",
               update_norm: bool = True, param_norm: bool = True) -> Callable:
  """Wraps ``train_step`` so that its metrics also hold parameter and update norms.

  Example:
    >>> loop = loopkit.TrainLoop(loopkit.training.norms.with_norms(train_step),  # doctest: +SKIP
    ...                          iterations_per_loop=100)

  Args:
    train_step: ``(state, batch) -> (state, metrics)`` with ``metrics`` a dict.
    params: where the parameters are in the state: a key (dict states) or attribute name
      (``TrainState.params``), or a function ``state -> params``.
    update_norm: add ``update_norm``, the norm of ``new_params - old_params`` (the change the
      step applied, as stored, in float32).
    param_norm: add ``param_norm``, the norm of the parameters after the step.

  Returns:
    The wrapped step. For ``grad_norm`` (which only the step sees) call :func:`norms` inside
    the step.

  Raises:
    TypeError: ``params`` neither a name nor a function.
    ValueError: (when traced) the step's metrics already hold one of the names added.
  """
  get = _getter(params)

  def step(state, batch):
    old = get(state)
    new_state, metrics = train_step(state, batch)
    new = get(new_state)
    added = {}
    if update_norm:
      added["update_norm"] = global_norm(jax.tree.map(
          lambda a, b: a.astype(jnp.float32) - b.astype(jnp.float32), new, old))
    if param_norm:
      added["param_norm"] = global_norm(new)
    clash = sorted(set(added) & set(metrics))
    if clash:
      raise ValueError(f"with_norms: the train step's metrics already hold {clash}; pass "
                       f"{', '.join(f'{c}=False' for c in clash)}")
    return new_state, {**metrics, **added}
  return step
