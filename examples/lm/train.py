"""Training and evaluation of the byte-level Transformer LM with ``loopkit.nnx.NnxTrainLoop``.

The model and its ``nnx.Optimizer`` are made on the ``("data", "fsdp", "tensor")`` mesh, each
parameter where its logical axes say (:func:`create_model`); the train step is written in NNX's
in-place style (``optimizer.update(model, grads)``), and ``NnxTrainLoop`` runs it K steps per
device call with the batch split over ``data_axis=("data", "fsdp")``, keeping every array's
sharding through calls, checkpoints and restores. After the run the objects hold the trained
values.

Recipe: AdamW (Loshchilov & Hutter 2019; ``b1 = 0.9``, ``b2 = 0.95``, weight decay on matrices
only), gradients clipped to global norm 1, learning rate linear warmup then cosine decay to a
tenth of the peak; next-byte cross-entropy.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

import loopkit
import loopkit.nnx
from examples.lm import input_pipeline, models
from loopkit.observe import writers

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # loopkit's data_axis: the batch is split over their product


def model_config(config: ml_collections.ConfigDict) -> models.ModelConfig:
  """The :class:`models.ModelConfig` of ``config.model``."""
  m = config.model
  return models.ModelConfig(num_layers=m.num_layers, d_model=m.d_model, num_heads=m.num_heads,
                            head_dim=m.head_dim, mlp_dim=m.mlp_dim,
                            dtype=jnp.bfloat16 if config.half_precision else jnp.float32,
                            remat=m.remat)


def make_mesh(config: ml_collections.ConfigDict,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The ``("data", "fsdp", "tensor")`` mesh of shape ``config.mesh_shape`` over ``devices``
  (default: all), with ``Auto`` axes (XLA propagates shardings, as in Flax's lm1b).

  Raises:
    ValueError: the shape's product is not the device count (naming both).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = tuple(int(s) for s in config.mesh_shape)
  if math.prod(shape) != len(devices):
    raise ValueError(f"config.mesh_shape={shape} needs {math.prod(shape)} devices, there are "
                     f"{len(devices)}")
  return jax.make_mesh(shape, MESH_AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup from 0 to ``learning_rate`` over ``warmup_steps``, then cosine decay to
  ``learning_rate / 10`` at ``num_train_steps``."""
  total = max(int(config.num_train_steps), 2)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate,
      warmup_steps=min(int(config.warmup_steps), total - 1), decay_steps=total,
      end_value=config.learning_rate / 10)


def create_model(config: ml_collections.ConfigDict) -> tuple[models.Transformer, nnx.Optimizer]:
  """The model and its AdamW optimizer.

  Called inside ``jax.set_mesh(mesh)`` and ``nnx.logical_axis_rules(models.LOGICAL_AXIS_RULES)``
  (as :func:`train_and_evaluate` does), every parameter is placed by the sharding its
  ``nnx.with_partitioning`` names give (Flax's eager sharding), each AdamW moment takes its
  parameter's, and scalars are replicated; inside ``nnx.eval_shape`` too, nothing allocated.
  """
  tx = optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2,
                  weight_decay=config.weight_decay,
                  mask=lambda params: jax.tree.map(lambda x: x.ndim > 1, params)))
  model = models.Transformer(model_config(config), rngs=nnx.Rngs(config.seed))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def _inputs_and_targets(tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``[B, L + 1]`` bytes -> inputs and targets, int32 ``[B, L]``."""
  tokens = tokens.astype(jnp.int32)
  return tokens[:, :-1], tokens[:, 1:]


def make_train_step(config: ml_collections.ConfigDict):
  """``train_step(model, optimizer, batch) -> metrics`` for :class:`loopkit.nnx.NnxTrainLoop`.

  ``batch = {"tokens": uint8 [B, L + 1]}``. Metrics: ``loss`` (mean next-byte cross-entropy,
  nats; the loop averages it over each call's steps) and ``learning_rate`` (the last step's).
  """
  schedule = learning_rate_schedule(config)

  def train_step(model: models.Transformer, optimizer: nnx.Optimizer,
                 batch: dict[str, jax.Array]) -> dict[str, Any]:
    inputs, targets = _inputs_and_targets(batch["tokens"])

    def loss_fn(model):
      logits = model(inputs)
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    learning_rate = schedule(optimizer.step[...])
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return {"loss": loss, "learning_rate": loopkit.metrics.Last(learning_rate)}

  return train_step


def eval_step(model: models.Transformer, metrics: nnx.MultiMetric,
              batch: dict[str, jax.Array]) -> None:
  """Adds a batch's next-byte cross-entropy and top-1 accuracy to ``metrics`` (every byte
  counts once: :class:`loopkit.nnx.NnxEvaluator` sums them exactly over the held-out set)."""
  inputs, targets = _inputs_and_targets(batch["tokens"])
  logits = model(inputs)
  metrics.update(loss=optax.softmax_cross_entropy_with_integer_labels(logits, targets),
                 logits=logits, labels=targets)


def create_evaluator(config: ml_collections.ConfigDict, model: models.Transformer,
                     mesh: Mesh) -> loopkit.nnx.NnxEvaluator:
  """Held-out ``loss`` (nats per byte) and ``accuracy`` over every byte of the eval set."""
  metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())
  return loopkit.nnx.NnxEvaluator(eval_step, model, metrics, mesh=mesh, data_axis=BATCH_AXES,
                                  iterations_per_loop=config.eval_iterations_per_loop,
                                  global_batch_size=config.eval_batch_size)


@nnx.jit(static_argnames=("num_bytes", "temperature", "top_k"))
def _sample(model, buffer, start, key, num_bytes, temperature, top_k):
  def next_byte(i, buffer):
    logits = model(buffer[None])[0, start + i - 1]
    if temperature == 0:
      return buffer.at[start + i].set(jnp.argmax(logits).astype(buffer.dtype))
    top_logits, top_bytes = jax.lax.top_k(logits, top_k)
    pick = jax.random.categorical(jax.random.fold_in(key, i), top_logits / temperature)
    return buffer.at[start + i].set(top_bytes[pick].astype(buffer.dtype))

  return jax.lax.fori_loop(0, num_bytes, next_byte, buffer)


def sample(model: models.Transformer, prompt: bytes, num_bytes: int, *, max_len: int,
           seed: int = 0, temperature: float = 0.0, top_k: int = 1) -> bytes:
  """The ``num_bytes`` bytes the model appends to ``prompt``, one at a time.

  Each byte is drawn from the model's next-byte distribution after the bytes before it,
  restricted to its ``top_k`` most likely bytes and divided by ``temperature`` (0: the most
  likely byte, greedy), with the key ``fold_in(PRNGKey(seed), i)`` for byte ``i``: the same
  arguments give the same bytes. The model reruns over the whole buffer of ``max_len`` bytes
  for each byte (no cache; the causal mask makes the bytes after the current one irrelevant).

  Raises:
    ValueError: ``prompt`` empty, or ``num_bytes`` not in ``[1, max_len)``.
  """
  if not prompt or not 0 < num_bytes < max_len:
    raise ValueError(f"need a prompt and 0 < num_bytes < {max_len}, got {prompt!r} and "
                     f"{num_bytes}")
  prompt = prompt[-(max_len - num_bytes):]
  buffer = np.zeros((max_len,), np.int32)
  buffer[:len(prompt)] = np.frombuffer(prompt, np.uint8)
  out = _sample(model, jnp.asarray(buffer), len(prompt), jax.random.PRNGKey(seed),
                num_bytes=num_bytes, temperature=float(temperature), top_k=int(top_k))
  return np.asarray(out)[len(prompt):len(prompt) + num_bytes].astype(np.uint8).tobytes()


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       extra_hooks: Sequence[loopkit.Hook] = ()) -> dict[str, Any]:
  """Trains the LM, evaluates it on held-out text, and samples a continuation of the prompt.

  Resumes from the latest checkpoint in ``workdir/checkpoints`` (state, ledger, data position).
  Writes ``metrics.jsonl`` and TensorBoard files in ``workdir``: train rows every
  ``log_every_steps`` (``loss``, ``learning_rate``, ``throughput/*``), ``eval/loss`` and
  ``eval/accuracy`` every ``eval_every_steps`` and at the end.

  Args:
    config: the example's configuration (``configs/``).
    workdir: output directory (created if missing).
    extra_hooks: more hooks, run after the example's own.

  Returns:
    ``step``, ``status``, ``restored_step``, ``eval`` (``{"loss", "accuracy", "perplexity"}``
    at the last evaluation, or None), ``eval_history`` (``[(step, loss)]``), ``sample``
    (str), ``num_params``, ``compile_count``, ``device_calls`` (since step 0),
    ``train_seconds`` (this run's, compilation, evaluations and checkpoints included),
    ``workdir``, and the trained ``model`` and ``optimizer``.
  """
  workdir = os.path.abspath(workdir)
  mesh = make_mesh(config)
  corpus = input_pipeline.load_corpus(config.data_dir or None,
                                      heldout_every=config.heldout_every)
  train_batches = input_pipeline.train_source(
      corpus, seq_len=config.seq_len, global_batch_size=config.global_batch_size,
      seed=config.seed, worker_count=config.grain_workers)
  eval_batches = input_pipeline.EvalBatches(
      corpus, seq_len=config.seq_len, num_windows=config.eval_windows,
      global_batch_size=config.eval_batch_size)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(models.LOGICAL_AXIS_RULES):
    model, optimizer = create_model(config)

  writer = writers.create_default_writer(workdir)
  # eval_every_steps = 0: only at the end (no trigger at all would fire after every call).
  marks = ({"every_steps": config.eval_every_steps} if config.eval_every_steps
           else {"at_steps": ()})
  eval_hook = create_evaluator(config, model, mesh).hook(
      eval_batches, writer=writer, at_end=True, **marks)
  hooks = [loopkit.LoggingHook(writer, every_steps=config.log_every_steps), eval_hook]
  ckpt = None
  if config.checkpoint_every_steps:
    ckpt = loopkit.CheckpointHook(os.path.join(workdir, "checkpoints"),
                                  every_steps=config.checkpoint_every_steps,
                                  max_to_keep=config.max_checkpoints_to_keep)
    hooks.append(ckpt)
  loop = loopkit.nnx.NnxTrainLoop(
      make_train_step(config), model, optimizer, iterations_per_loop=config.iterations_per_loop,
      hooks=[*hooks, *extra_hooks], mesh=mesh, data_axis=BATCH_AXES,
      steps_per_epoch=train_batches.steps_per_epoch, global_batch_size=config.global_batch_size)
  t0 = time.perf_counter()
  loop.run(train_batches, num_steps=config.num_train_steps)
  train_seconds = time.perf_counter() - t0
  writer.close()
  if ckpt is not None:
    ckpt.close()

  history = [(step, r.metrics) for step, r in eval_hook.results]
  final = None if not history else dict(history[-1][1],
                                        perplexity=math.exp(history[-1][1]["loss"]))
  text = b""
  if loop.status == "completed" and config.sample_bytes:
    text = sample(model, config.prompt.encode(), config.sample_bytes, max_len=config.seq_len,
                  seed=config.seed, temperature=config.temperature, top_k=config.top_k)
  return {
      "step": loop.ledger.step, "status": loop.status,
      "restored_step": None if ckpt is None else ckpt.restored_step,
      "eval": final, "eval_history": [(step, m["loss"]) for step, m in history],
      "sample": text.decode("utf-8", "replace"),
      "num_params": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
      "compile_count": loop.program.compile_count(), "device_calls": loop.ledger.loop_index,
      "train_seconds": train_seconds, "workdir": workdir, "model": model,
      "optimizer": optimizer,
  }


def summary(config: ml_collections.ConfigDict, results: dict[str, Any]) -> list[str]:
  """The lines ``main.py`` prints for ``train_and_evaluate``'s ``results``."""
  r, ev = results, results["eval"]
  held_out = ("not evaluated" if ev is None else
              f"held-out loss {ev['loss']:.4f} nats/byte, perplexity {ev['perplexity']:.3f}, "
              f"accuracy {ev['accuracy']:.4f} ({config.eval_windows} x {config.seq_len} bytes)")
  lines = [f"byte-level LM, {r['num_params']:,} parameters, mesh "
           f"{tuple(config.mesh_shape)}, K={config.iterations_per_loop}: step {r['step']} "
           f"({r['status']}), {held_out}",
           f"{r['device_calls']} device calls, {r['compile_count']} train compilation(s), "
           f"{r['train_seconds']:.1f} s of training (throughput: metrics.jsonl)"]
  if r["sample"]:
    lines.append(f"sample (temperature {config.temperature}, top-k {config.top_k}, seed "
                 f"{config.seed}): {config.prompt!r} + {r['sample']!r}")
  return lines
