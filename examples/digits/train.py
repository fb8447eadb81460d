"""Training and evaluation of the digits MLP with ``loopkit.TrainLoop``.

The NNX model is split once into a static ``graphdef`` and its parameters (a
plain nested dict of arrays); the train step merges them back inside the
compiled program, so the train state is a plain pytree that loopkit can carry
through ``iterations_per_loop`` steps per device call, donate and pin.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

import loopkit
import loopkit.data.sources
import loopkit.evaluation
from examples.digits import input_pipeline, models

Batch = dict[str, jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  """The train state: a plain pytree, no callables inside.

  Attributes:
    step: int32 scalar, optimizer updates applied (= loopkit's ledger step).
    params: nested dict of float32 arrays (``nnx.to_pure_dict`` of the model).
    opt_state: the optax state for ``params``.
    rng: uint32 ``[2]`` base PRNG key; step ``s`` uses ``fold_in(rng, s)``.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array


def create_model(config: ml_collections.ConfigDict) -> models.MLP:
  """The MLP described by ``config`` (initialised from ``config.seed``)."""
  return models.MLP(tuple(config.hidden_sizes), dropout_rate=config.dropout_rate,
                    rngs=nnx.Rngs(params=config.seed))


def create_optimizer(config: ml_collections.ConfigDict,
                     total_steps: int) -> optax.GradientTransformation:
  """AdamW with a cosine decay of the learning rate to 0 over ``total_steps`` steps."""
  schedule = optax.cosine_decay_schedule(config.learning_rate, decay_steps=total_steps)
  return optax.adamw(schedule, weight_decay=config.weight_decay)


def create_train_state(config: ml_collections.ConfigDict, model: models.MLP,
                       tx: optax.GradientTransformation) -> tuple[nnx.GraphDef, TrainState]:
  """Splits ``model`` into its graph definition and a step-0 :class:`TrainState`."""
  graphdef, variables = nnx.split(model)
  params = nnx.to_pure_dict(variables)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                     rng=jax.random.PRNGKey(config.seed))
  return graphdef, state


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Per-example softmax cross-entropy, float32 ``[B]`` (logits ``[B, C]``, labels int ``[B]``)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, Any]]]:
  """A pure global-array train step for :class:`loopkit.TrainLoop`.

  Args:
    graphdef: the model's static graph (from :func:`create_train_state`).
    tx: the optimizer.

  Returns:
    ``train_step(state, batch) -> (state, metrics)`` with ``batch`` =
    ``{"image": float32 [B, 64], "label": int32 [B]}`` (B global) and metrics
    ``loss`` and ``accuracy`` as :class:`loopkit.metrics.Mean` weighted by B,
    so loopkit's per-call and per-log values are exact means over examples.
  """

  def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
    dropout_key = loopkit.step_key(state.rng, state.step)

    def loss_fn(params):
      model = nnx.merge(graphdef, params)
      logits = model(batch["image"], dropout_key=dropout_key)
      return jnp.mean(cross_entropy(logits, batch["label"])), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    n = jnp.float32(batch["label"].shape[0])
    correct = jnp.sum(jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
    metrics = {"loss": loopkit.metrics.Mean.of(loss, n),
               "accuracy": loopkit.metrics.Mean(correct, n)}
    new_state = dataclasses.replace(state, step=state.step + 1, params=params,
                                    opt_state=opt_state)
    return new_state, metrics

  return train_step


def make_eval_step(graphdef: nnx.GraphDef) -> Callable[[TrainState, Batch], dict[str, jax.Array]]:
  """A pure eval step for :class:`loopkit.evaluation.Evaluator`: per-example values.

  Args:
    graphdef: the model's static graph.

  Returns:
    ``eval_step(state, batch) -> {"accuracy": float32 [B] (1.0 if correct),
    "loss": float32 [B] cross-entropy}``; loopkit masks padded rows and sums,
    so ``accuracy`` comes out as (correct examples) / (all examples).
  """

  def eval_step(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
    logits = nnx.merge(graphdef, state.params)(batch["image"])
    return {"accuracy": (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32),
            "loss": cross_entropy(logits, batch["label"])}

  return eval_step


def eval_batches(split: input_pipeline.Split, batch_size: int) -> Callable[[], Any]:
  """A callable giving a fresh pass over ``split`` in batches (short last batch kept)."""
  arrays = {"image": split.images, "label": split.labels}
  return lambda: loopkit.data.sources.batch_arrays(arrays, batch_size)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains the MLP on the digits and evaluates it on the held-out test split.

  Writes to ``workdir``:
    * ``metrics.jsonl``: one JSON object per line; training rows
      (``{"step", "loss", "accuracy", "epoch", "examples_seen"}``) every
      ``config.log_every_epochs`` epochs and test rows (``{"step",
      "test/accuracy", "test/loss", "test/num_examples"}``) every
      ``config.eval_every_epochs`` epochs and at the end. The file is
      replaced at the start (the example does not resume).
    * ``results.json``: the final summary returned by this function.

  Args:
    config: the example's configuration (see ``configs/default.py``).
    workdir: output directory (created if missing).

  Returns:
    Summary dict: ``test_accuracy``, ``test_correct``, ``test_count``, ``step``,
    ``epochs``, ``steps_per_epoch``, ``iterations_per_loop``, ``device_calls``,
    ``num_devices``, ``compile_count`` (train program), ``eval_compile_count``,
    ``train_seconds``, paths of the outputs, and ``state`` (the final
    :class:`TrainState`; not written to ``results.json``).

  Raises:
    ValueError: from loopkit, e.g. a global batch not divisible by the number of
      devices.
  """
  os.makedirs(workdir, exist_ok=True)
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  results_path = os.path.join(workdir, "results.json")
  if os.path.exists(metrics_path) and jax.process_index() == 0:
    os.remove(metrics_path)

  train_split, test_split = input_pipeline.load_splits(test_size=config.test_size,
                                                       split_seed=config.split_seed)
  batches = input_pipeline.TrainBatches(train_split, batch_size=config.global_batch_size,
                                        seed=config.seed)
  steps_per_epoch = batches.steps_per_epoch
  total_steps = config.num_epochs * steps_per_epoch
  tx = create_optimizer(config, total_steps)
  graphdef, state = create_train_state(config, create_model(config), tx)

  writer = loopkit.observe.JsonlWriter(metrics_path)
  # An Auto axis (GSPMD propagation): with jax 0.12's Explicit default axis type the
  # cross-entropy gather over the data-sharded batch fails (ShardingTypeError: "Use
  # `.at[...].set(out_sharding=)`", measured on jax 0.12.0.1).
  mesh = loopkit.data_parallel_mesh("data")
  evaluator = loopkit.evaluation.Evaluator(
      make_eval_step(graphdef), iterations_per_loop=config.eval_iterations_per_loop, mesh=mesh,
      global_batch_size=config.eval_batch_size)
  test_batches = eval_batches(test_split, config.eval_batch_size)

  hooks = [
      loopkit.NanCheckHook(),
      loopkit.LoggingHook(writer, every_epochs=config.log_every_epochs),
      loopkit.evaluation.EvalHook(evaluator, test_batches, writer=writer, prefix="test",
                                  every_epochs=config.eval_every_epochs),
  ]
  loop = loopkit.TrainLoop(make_train_step(graphdef, tx),
                           iterations_per_loop=config.iterations_per_loop, hooks=hooks,
                           mesh=mesh, steps_per_epoch=steps_per_epoch,
                           global_batch_size=config.global_batch_size)
  t0 = time.perf_counter()
  state = loop.run(state, batches, num_epochs=config.num_epochs)
  final = evaluator.evaluate(state, test_batches())
  train_seconds = time.perf_counter() - t0
  writer.close()
  # Per-example 0/1 values summed exactly (integers < 2**24 in float32, float64 on the host).
  correct = round(final.totals["accuracy"])

  results = {
      "test_accuracy": correct / final.num_examples, "test_correct": correct,
      "test_count": final.num_examples, "test_loss": final.metrics["loss"],
      "step": int(jax.device_get(state.step)), "ledger_step": loop.ledger.step,
      "epochs": config.num_epochs, "steps_per_epoch": steps_per_epoch,
      "global_batch_size": config.global_batch_size,
      "iterations_per_loop": config.iterations_per_loop,
      "device_calls": loop.ledger.loop_index, "num_devices": jax.device_count(),
      "compile_count": loop.program.compile_count(),
      "eval_compile_count": evaluator.compile_count(), "status": loop.status,
      "train_seconds": round(train_seconds, 3),
      "ledger_seconds": {k: round(v, 3) for k, v in loop.ledger.seconds.items()},
      "metrics_path": metrics_path, "results_path": results_path,
  }
  if jax.process_index() == 0:
    with open(results_path, "w") as f:
      json.dump(results, f, indent=2)
  results["state"] = state
  return results
