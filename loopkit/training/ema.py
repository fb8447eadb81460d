"""An exponential moving average (EMA) of the parameters, kept in the state, for evaluation.

The average is part of the train state (``state["ema"]``), updated by the train step after the
optimizer's update, so it is saved in every checkpoint, restored with the state and, like the
parameters, bitwise the same for every ``iterations_per_loop`` (K) and across kills and
resumes::

    def train_step(state, batch):
      ...
      params = optax.apply_updates(state["params"], updates)
      ema = loopkit.training.ema.update(state["ema"], params, decay=0.999)
      return {**state, "params": params, "ema": ema, ...}, metrics

    state = {"params": params, "ema": loopkit.training.ema.init(params), ...}

For evaluation, :func:`swapped` maps the train state to one whose parameters are the average
(Keras's ``SwapEMAWeights``, Levanter's model averaging), as an :class:`~loopkit.EvalHook`'s
``state_fn``; the state itself is not changed. Two EvalHooks (``prefix="eval"`` and
``prefix="eval_ema"``) evaluate both.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from loopkit.data.device_data import DeviceDataState

__all__ = ["init", "swapped", "update"]


def init(params: Any) -> Any:
  """The average's starting value: a copy of ``params`` (same dtypes and shardings)."""
  return jax.tree.map(jnp.copy, params)


def update(ema: Any, params: Any, decay: jax.typing.ArrayLike) -> Any:
  """One EMA step: ``decay * ema + (1 - decay) * params``, leaf by leaf.

  Args:
    ema: the average (a pytree like ``params``).
    params: the parameters after this step's update.
    decay: the weight of the old average, a float in [0, 1) or a traced scalar (e.g. from a
      schedule of the step); 0.999 averages over about the last 1000 steps.

  Returns:
    The new average, each leaf in its own dtype (computed in float32 for float16 / bfloat16
    leaves).
  """
  def one(e, p):
    dtype = jnp.promote_types(e.dtype, jnp.float32)
    d = jnp.asarray(decay, dtype)
    return (d * e.astype(dtype) + (1 - d) * p.astype(dtype)).astype(e.dtype)
  return jax.tree.map(one, ema, params)


def swapped(params: str = "params", ema: str = "ema") -> Any:
  """A ``state_fn`` for :class:`~loopkit.EvalHook` that evaluates the average.

  Example:
    >>> hook = loopkit.EvalHook(evaluator, batches, every_steps=100,   # doctest: +SKIP
    ...                         prefix="eval_ema", state_fn=loopkit.training.ema.swapped())

  Args:
    params: the key (dict states) or attribute (``TrainState``, NamedTuples) of the
      parameters.
    ema: the key or attribute of their average.

  Returns:
    ``state -> state`` with ``params`` replaced by ``ema`` (a
    :class:`~loopkit.data.device_data.DeviceDataState` is unwrapped first), by
    ``{**state, params: state[ema]}`` for a dict, ``state.replace(...)`` for a Flax struct
    dataclass, ``state._replace(...)`` for a NamedTuple.

  Raises:
    TypeError: (when called) a state without those keys or attributes, naming them.
  """
  def state_fn(state: Any) -> Any:
    if isinstance(state, DeviceDataState):
      state = state.train_state
    try:
      if isinstance(state, dict):
        return {**state, params: state[ema]}
      average = getattr(state, ema)
      getattr(state, params)
    except (KeyError, AttributeError) as e:
      raise TypeError(f"loopkit.training.ema.swapped: the state has no {params!r} and {ema!r} "
                      f"({type(e).__name__}: {e}); give the names of the parameters and of "
                      "their average in the state") from None
    for method in ("replace", "_replace"):
      fn = getattr(state, method, None)
      if callable(fn):
        return fn(**{params: average})
    raise TypeError(f"loopkit.training.ema.swapped: cannot replace {params!r} in a "
                    f"{type(state).__name__} (a dict, a Flax struct dataclass or a NamedTuple "
                    "is needed)")
  return state_fn
