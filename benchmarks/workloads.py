"""Benchmark workloads: one model, one data set and one optimizer per workload.

Every system in :mod:`benchmarks.systems` trains the same workload: the same
Flax module (the Keras twin gets the same layers and a copy of the same initial
weights), the same ``[S, B, ...]`` batches in the same order and the same SGD.

Workloads:
  * ``mlp``: dispatch-bound. ``x`` float32 ``[32, 64]`` -> Dense(64) -> relu ->
    Dense(10); integer labels ``[32]``. A step is about 15 us of device time on
    this CPU (a second hidden layer would make it about 25 us), several times
    less than one per-step dispatch from Python, so the steps per device call
    decide the speed.
  * ``cnn``: a small CNN on 32x32x3 images, batch 32: Conv(16, 3x3) -> relu ->
    avg_pool 2 -> Conv(32, 3x3) -> relu -> avg_pool 2 -> Dense(64) -> relu ->
    Dense(10). Compute-bound on CPU (about a millisecond per step).

The train state is a plain pytree ``{"params", "opt", "step"}`` (no static
callables inside), as loopkit's style guide asks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

BATCH = 32
NUM_CLASSES = 10
LEARNING_RATE = 0.01


class MLP(nn.Module):
  """Dense(64) -> relu -> Dense(10); input ``[B, 64]`` float32."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64)(x))
    return nn.Dense(NUM_CLASSES)(x)


class CNN(nn.Module):
  """Two 3x3 convs with average pooling and two dense layers; input ``[B, 32, 32, 3]``."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(16, (3, 3))(x))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = nn.relu(nn.Conv(32, (3, 3))(x))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(64)(x))
    return nn.Dense(NUM_CLASSES)(x)


# One Keras layer of a workload's twin: (``keras.layers`` class name, its arguments), and the
# Flax submodule whose ``kernel`` and ``bias`` it takes (None: a layer without weights).
KerasLayer = tuple[str, dict[str, Any], str | None]


@dataclasses.dataclass(frozen=True)
class Workload:
  """A model, its input shape and the run length used by the benchmark.

  Attributes:
    name: ``"mlp"`` or ``"cnn"``.
    module: the Flax module.
    input_shape: one example's shape (no batch axis).
    num_steps: S, steps per timed run (the same for every system).
    keras_layers: the Keras twin, layer by layer after its ``keras.Input``
      (:func:`make_keras_model`).
  """

  name: str
  module: nn.Module
  input_shape: tuple[int, ...]
  num_steps: int
  keras_layers: tuple[KerasLayer, ...] = ()


_RELU = {"activation": "relu"}
_SAME_RELU = {"padding": "same", "activation": "relu"}
# Every workload, with its default S.
WORKLOADS = {w.name: w for w in (
    Workload("mlp", MLP(), (64,), 10_000, keras_layers=(
        ("Dense", {"units": 64, **_RELU}, "Dense_0"),
        ("Dense", {"units": NUM_CLASSES}, "Dense_1"))),
    Workload("cnn", CNN(), (32, 32, 3), 300, keras_layers=(
        ("Conv2D", {"filters": 16, "kernel_size": 3, **_SAME_RELU}, "Conv_0"),
        ("AveragePooling2D", {"pool_size": 2}, None),
        ("Conv2D", {"filters": 32, "kernel_size": 3, **_SAME_RELU}, "Conv_1"),
        ("AveragePooling2D", {"pool_size": 2}, None),
        ("Flatten", {}, None),
        ("Dense", {"units": 64, **_RELU}, "Dense_0"),
        ("Dense", {"units": NUM_CLASSES}, "Dense_1"))),
)}


def get(name: str, num_steps: int | None = None) -> Workload:
  """The workload called ``name`` (``"mlp"`` or ``"cnn"``), optionally with S overridden.

  Raises:
    ValueError: ``name`` is not a key of :data:`WORKLOADS`.
  """
  if name not in WORKLOADS:
    raise ValueError(f"unknown workload {name!r}; expected 'mlp' or 'cnn'")
  w = WORKLOADS[name]
  return dataclasses.replace(w, num_steps=num_steps) if num_steps else w


def make_data(w: Workload, num_steps: int | None = None, seed: int = 0) -> dict[str, np.ndarray]:
  """Synthetic data: ``{"x": float32 [S, B, *input_shape], "y": int32 [S, B]}``.

  Labels come from a fixed random linear teacher on the flattened input, so the
  loss actually falls.
  """
  s = num_steps or w.num_steps
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((s, BATCH) + w.input_shape, dtype=np.float32)
  teacher = rng.standard_normal((int(np.prod(w.input_shape)), NUM_CLASSES)).astype(np.float32)
  y = np.argmax(x.reshape(s, BATCH, -1) @ teacher, axis=-1).astype(np.int32)
  return {"x": x, "y": y}


def batch_list(data: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
  """The data as a list of S batches ``{"x": [B, ...], "y": [B]}`` (views, no copies)."""
  return [{"x": data["x"][i], "y": data["y"][i]} for i in range(data["x"].shape[0])]


def array_source(data: dict[str, np.ndarray]) -> Any:
  """The data as a ``loopkit.ArraySource`` serving the same S batches in the same order
  (``shuffle=False``): leaves ``[S * B, ...]``, global batch B."""
  import loopkit  # noqa: PLC0415  (the workloads themselves do not need loopkit)

  return loopkit.ArraySource({name: v.reshape((-1,) + v.shape[2:]) for name, v in data.items()},
                             BATCH, shuffle=False)


def pad_slots(chunk: dict[str, np.ndarray], slots: int) -> dict[str, np.ndarray]:
  """A chunk ``[n, B, ...]`` with zero slots appended up to ``slots``, as loopkit's feeder
  forms a K = 1 chunk (``[2, B, ...]``, ``loopkit.core.program.MIN_SLOTS``)."""
  return {name: np.concatenate([v, np.zeros((max(0, slots - len(v)),) + v.shape[1:], v.dtype)])
          for name, v in chunk.items()}


def tx() -> optax.GradientTransformation:
  """The optimizer every system uses: plain SGD, learning rate 0.01."""
  return optax.sgd(LEARNING_RATE)


def init_params(w: Workload, seed: int = 0) -> Any:
  """Initial parameters of ``w.module`` (Flax default initialisers, PRNG key ``seed``)."""
  return w.module.init(jax.random.key(seed), jnp.zeros((1,) + w.input_shape, jnp.float32))


def init_state(w: Workload, seed: int = 0) -> dict[str, Any]:
  """The train state ``{"params", "opt", "step": int32 scalar}`` on the host."""
  params = jax.device_get(init_params(w, seed))
  return {"params": params, "opt": tx().init(params), "step": np.zeros((), np.int32)}


def loss_fn(w: Workload, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
  """Mean softmax cross-entropy of ``batch`` (float32 scalar)."""
  logits = w.module.apply(params, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_train_step(w: Workload, axis_name: str | None = None) -> Callable:
  """``train_step(state, batch) -> (state, {"loss": scalar})``.

  Args:
    w: the workload.
    axis_name: if given, gradients and loss are ``pmean``-ed over this mapped
      axis (per-device / pmap style); otherwise the step sees global arrays.
  """
  opt = tx()

  def train_step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(w, p, batch))(state["params"])
    if axis_name is not None:
      grads = jax.lax.pmean(grads, axis_name)
      loss = jax.lax.pmean(loss, axis_name)
    updates, opt_state = opt.update(grads, state["opt"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "opt": opt_state,
             "step": state["step"] + 1}, {"loss": loss})

  return train_step


def make_keras_model(w: Workload, params: Any):
  """The Keras 3 twin of ``w.module`` with ``params`` copied in, compiled with SGD(0.01).

  Needs ``KERAS_BACKEND=jax`` set before Keras is first imported.
  """
  import keras  # noqa: PLC0415  (imported only where KERAS_BACKEND is set)

  model = keras.Sequential([keras.Input(w.input_shape)] + [
      getattr(keras.layers, cls)(**kwargs) for cls, kwargs, _ in w.keras_layers])
  p = params["params"]
  weighted = [layer for layer in model.layers if layer.weights]
  names = [name for _, _, name in w.keras_layers if name is not None]
  for layer, name in zip(weighted, names, strict=True):
    layer.set_weights([np.asarray(p[name]["kernel"]), np.asarray(p[name]["bias"])])
  model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=100)
  return model
