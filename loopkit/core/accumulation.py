"""Gradient accumulation: M microbatches per optimizer update, inside one train step.

A train step that accumulates stays one step for loopkit: the step counter, the
ledger, ``num_steps``, hooks and checkpoints all count optimizer updates, and
the data source yields one global batch ``[B, ...]`` per update (B = M x the
microbatch). :func:`accumulate` runs a function over the batch's M
microbatches with ``lax.scan`` (one microbatch's activations live at a time)
and returns the mean of its outputs::

    def train_step(state, batch):          # batch leaves [B, ...]
      def grads_of(micro):                  # micro leaves [B / M, ...]
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], micro)
        return grads, {"loss": loss}
      grads, metrics = loopkit.core.accumulate(grads_of, batch, num_microbatches=4)
      updates, opt = tx.update(grads, state["opt"], state["params"])
      ...

For a loss that is a mean over the batch's examples, the mean of the M
microbatch gradients is the full batch's gradient (equal microbatch sizes), up
to float rounding: the sums are taken in another order.

``optax.MultiSteps`` accumulates across *train steps* instead: every call of
the step is one microbatch and only every k-th applies the update. With
loopkit, the step counter then counts microbatches (``num_steps``,
``every_steps`` and checkpoint labels are in microbatches, and an update
happens at step multiples of k, which the planner lands on when hooks use
multiples of k); ``opt_state.gradient_step`` counts the updates. Prefer
:func:`accumulate` when the ledger should count optimizer updates (as T5X and
MaxText report steps); use ``MultiSteps`` when a microbatch alone must be
the unit the source yields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from loopkit._internal.checks import leaf_name

__all__ = ["accumulate"]


def accumulate(fn: Callable[[Any], Any], batch: Any, num_microbatches: int) -> Any:
  """The mean of ``fn(microbatch)`` over the batch's ``num_microbatches`` microbatches.

  Args:
    fn: ``microbatch -> pytree`` of arrays (e.g. ``(grads, metrics)``); pure.
    batch: pytree of arrays ``[B, ...]`` (B divisible by ``num_microbatches``);
      microbatch m holds rows ``[m * B / M, (m + 1) * B / M)``.
    num_microbatches: M >= 1. M = 1 calls ``fn(batch)`` directly.

  Returns:
    ``fn``'s output structure, each leaf the mean over microbatches; floating
    leaves are summed in at least float32 and cast back to their dtype,
    integer leaves get the floor of the mean.

  Raises:
    ValueError: M < 1, or a leaf's batch size is not divisible by M (names
      the leaf).
  """
  if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or (
      num_microbatches < 1):
    raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
  m = num_microbatches
  if m == 1:
    return fn(batch)

  def split(path, x):
    if jnp.ndim(x) == 0 or x.shape[0] % m:
      raise ValueError(f"batch leaf {leaf_name(path)} has shape {jnp.shape(x)}: its "
                       f"batch size is not divisible by num_microbatches={m}")
    return x.reshape((m, x.shape[0] // m) + x.shape[1:])

  micro = jax.tree_util.tree_map_with_path(split, batch)
  shapes = jax.eval_shape(fn, jax.tree.map(lambda x: x[0], micro))

  def acc_dtype(s):
    return jnp.promote_types(s.dtype, jnp.float32) if jnp.issubdtype(s.dtype,
                                                                     jnp.inexact) else s.dtype

  def body(total, mb):
    out = fn(mb)
    return jax.tree.map(lambda t, o: t + o.astype(t.dtype), total, out), None

  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, acc_dtype(s)), shapes)
  total, _ = jax.lax.scan(body, zeros, micro)
  return jax.tree.map(lambda t, s: (t / m).astype(s.dtype) if jnp.issubdtype(s.dtype, jnp.inexact)
                      else t // m, total, shapes)
