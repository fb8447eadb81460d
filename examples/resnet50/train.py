"""ResNet training and evaluation with ``loopkit.TrainLoop``: pure steps, hooks at boundaries.

The NNX model is split once into a static ``graphdef``, its parameters and its BatchNorm
statistics (plain nested dicts of arrays); the steps merge them back inside the compiled
program, so the train state is a plain pytree that loopkit carries through
``iterations_per_loop`` steps per device call, donates, pins and checkpoints.

Recipe (each value's source is in ``configs/default.py``): SGD with Nesterov momentum 0.9;
learning rate ``base_learning_rate * B / 256`` (linear scaling rule, Goyal et al. 2017) with
linear warmup then cosine decay to 0; cross-entropy with ``config.label_smoothing``; L2 weight
decay on convolution and dense kernels only (not on BatchNorm scales/biases or the dense bias).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging as absl_logging
from etils import epath
from flax import nnx

import loopkit
from examples.resnet50 import input_pipeline, models
from loopkit.observe import goodput, writers

Batch = dict[str, jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  """The train state: a plain pytree, no callables inside.

  Attributes:
    step: int32 scalar, optimizer updates applied (= loopkit's ledger step).
    params: nested dict of float32 arrays (the model's ``nnx.Param``s).
    batch_stats: nested dict of float32 arrays (BatchNorm running mean/var).
    opt_state: the optax state for ``params``.
  """

  step: jax.Array
  params: Any
  batch_stats: Any
  opt_state: Any


# -- model and optimizer --------------------------------------------------------


def compute_dtype(config: ml_collections.ConfigDict) -> Any:
  """bfloat16 when ``config.half_precision`` else float32."""
  return jnp.bfloat16 if config.half_precision else jnp.float32


def create_model(config: ml_collections.ConfigDict, *, axis_name: str | None = None
                 ) -> models.ResNet:
  """The ResNet described by ``config.model`` (initialised from ``config.seed``).

  Args:
    config: needs ``model.depth``, ``model.num_filters``, ``num_classes``,
      ``half_precision``, ``seed``; optional ``model.bn_momentum`` (0.9),
      ``model.padding`` (``"symmetric"``) and ``model.kernel_init``
      (``"he_fan_out"``), see :class:`models.ResNet`.
    axis_name: BatchNorm's mapped axis for per-device steps (None: global).

  Raises:
    ValueError: an unknown ``model.depth``, ``model.padding`` or ``model.kernel_init``.
  """
  return models.ResNet(config.model.depth, num_classes=config.num_classes,
                       num_filters=config.model.num_filters, dtype=compute_dtype(config),
                       axis_name=axis_name,
                       bn_momentum=config.model.get("bn_momentum", 0.9),
                       padding=config.model.get("padding", "symmetric"),
                       kernel_init=config.model.get("kernel_init", "he_fan_out"),
                       rngs=nnx.Rngs(params=config.seed))


def learning_rate_schedule(config: ml_collections.ConfigDict,
                           steps_per_epoch: int) -> optax.Schedule:
  """Linear warmup from 0 to ``base_learning_rate * B / 256``, then cosine decay to 0.

  Returns:
    ``schedule(step) -> float32``: the learning rate of the update applied at ``step``
    (0-based count of updates done before it).
  """
  peak = config.base_learning_rate * config.global_batch_size / 256
  total = max(int(config.num_epochs * steps_per_epoch), 1)
  warmup = min(int(config.warmup_epochs * steps_per_epoch), total - 1)
  if warmup == 0:  # the same values; optax logs a line about a 0-step warmup
    return optax.cosine_decay_schedule(peak, decay_steps=total, alpha=0.0)
  return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak,
                                            warmup_steps=warmup, decay_steps=total,
                                            end_value=0.0)


def create_optimizer(config: ml_collections.ConfigDict,
                     schedule: optax.Schedule) -> optax.GradientTransformation:
  """L2 weight decay on kernels (``ndim > 1``) then SGD with Nesterov momentum.

  ``add_decayed_weights`` before SGD adds ``weight_decay * w`` to the gradient, i.e. the L2
  penalty ``weight_decay / 2 * |w|^2`` of the references, on convolution and dense kernels
  only: BatchNorm scales/biases and the dense bias are 1-D and excluded.
  """
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)
  return optax.chain(
      optax.add_decayed_weights(config.weight_decay, mask=decay_mask),
      optax.sgd(schedule, momentum=config.momentum, nesterov=config.nesterov))


def create_train_state(model: models.ResNet, tx: optax.GradientTransformation
                       ) -> tuple[nnx.GraphDef, TrainState]:
  """Splits ``model`` into its graph definition and a step-0 :class:`TrainState`."""
  graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
  params = nnx.to_pure_dict(params)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                     batch_stats=nnx.to_pure_dict(batch_stats), opt_state=tx.init(params))
  return graphdef, state


# -- pure steps -----------------------------------------------------------------


def relabel(labels: jax.Array, label_modulo: int) -> jax.Array:
  """``labels % label_modulo`` if ``label_modulo`` > 0 (a relabelled task), else ``labels``."""
  return labels % label_modulo if label_modulo > 0 else labels


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, *, num_classes: int, label_smoothing: float,
                    dtype: Any = jnp.float32, axis_name: str | None = None,
                    label_modulo: int = 0
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, Any]]]:
  """A pure train step for :class:`loopkit.TrainLoop`.

  Args:
    graphdef: the model's static graph (from :func:`create_train_state`).
    tx: the optimizer.
    schedule: the learning-rate schedule (reported per step as ``learning_rate``).
    num_classes: logits per example.
    label_smoothing: weight moved from the true class to the uniform distribution (0.1:
      Szegedy et al. 2016; the MLPerf reference).
    dtype: dtype the images are normalised to (the model's compute dtype).
    axis_name: None for the ``"global"`` step style (the step sees the global batch;
      BatchNorm statistics are global by construction); the data axis name for
      ``"per_device"`` (gradients are ``pmean``ed over it and BatchNorm must have been built
      with the same ``axis_name``).
    label_modulo: > 0: the step learns ``label % label_modulo`` (a relabelled task).

  Returns:
    ``train_step(state, batch) -> (state, metrics)``; ``batch`` = ``{"image": uint8
    [B, S, S, 3], "label": int32 [B]}`` (the device's ``[B / D, ...]`` slice in per-device
    style). Metrics: ``loss`` (smoothed cross-entropy) and ``accuracy`` as
    :class:`loopkit.metrics.Mean` weighted by the batch size, ``learning_rate`` as
    :class:`loopkit.metrics.Last`.
  """

  def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
    images = input_pipeline.normalize(batch["image"], dtype)
    labels = relabel(batch["label"], label_modulo)
    targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes), label_smoothing)

    def loss_fn(params):
      model = nnx.merge(graphdef, params, state.batch_stats)
      logits = model(images, train=True)
      new_stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
      loss = jnp.mean(optax.softmax_cross_entropy(logits, targets))
      return loss, (logits, new_stats)

    (loss, (logits, new_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params)
    if axis_name is not None:
      grads = jax.lax.pmean(grads, axis_name)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    n = jnp.float32(labels.shape[0])
    correct = jnp.sum(jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    metrics = {"loss": loopkit.metrics.Mean.of(loss, n),
               "accuracy": loopkit.metrics.Mean(correct, n),
               "learning_rate": loopkit.metrics.Last(schedule(state.step))}
    new_state = TrainState(step=state.step + 1, params=params, batch_stats=new_stats,
                           opt_state=opt_state)
    return new_state, metrics

  return train_step


def make_eval_step(graphdef: nnx.GraphDef, *, dtype: Any = jnp.float32, label_modulo: int = 0
                   ) -> Callable[[TrainState, Batch], dict[str, jax.Array]]:
  """A pure eval step for :class:`loopkit.Evaluator` (BatchNorm running statistics).

  Returns:
    ``eval_step(state, batch) -> {"accuracy": float32 [B], "loss": float32 [B]}``:
    per-example top-1 correctness and (unsmoothed) cross-entropy, on ``label %
    label_modulo`` when ``label_modulo`` > 0; the evaluator masks padding and sums exactly.
  """

  def eval_step(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
    model = nnx.merge(graphdef, state.params, state.batch_stats)
    logits = model(input_pipeline.normalize(batch["image"], dtype), train=False)
    labels = relabel(batch["label"], label_modulo)
    return {"accuracy": (jnp.argmax(logits, -1) == labels).astype(jnp.float32),
            "loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels)}

  return eval_step


# -- the run --------------------------------------------------------------------


def num_train_steps(config: ml_collections.ConfigDict, steps_per_epoch: int) -> int:
  """``config.num_train_steps`` if > 0, else ``num_epochs * steps_per_epoch``."""
  if config.num_train_steps > 0:
    return int(config.num_train_steps)
  return int(config.num_epochs * steps_per_epoch)


def warm_start_of(config: ml_collections.ConfigDict) -> Any:
  """The run's warm start from ``config.init_from``, or None (``""``: from scratch).

  A :class:`loopkit.checkpoint.WarmStart` of the parameters and BatchNorm statistics of the
  latest checkpoint in ``config.init_from`` (a loopkit checkpoint directory, or one step of
  it), except the leaves ``config.init_exclude`` names (``"params/head"`` for a new head);
  the optimizer state and the step are the new run's (fresh, 0).
  """
  if not config.get("init_from", ""):
    return None
  from loopkit import checkpoint  # needs orbax-checkpoint
  return checkpoint.WarmStart(config.init_from, select=("params", "batch_stats"),
                              exclude=config.get("init_exclude", "") or ())


def make_mesh(devices: Sequence[jax.Device]) -> jax.sharding.Mesh:
  """The run's mesh: one ``"data"`` axis over ``devices``."""
  return jax.make_mesh((len(devices),), ("data",), devices=list(devices))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       extra_hooks: Sequence[loopkit.Hook] = ()) -> dict[str, Any]:
  """Trains the ResNet and evaluates it exactly on the eval split; resumes automatically.

  Writes to ``workdir`` (created if missing): ``checkpoints/`` (Orbax, when
  ``config.checkpoint_every_steps`` or ``checkpoint_every_epochs`` > 0; a rerun with the same
  workdir resumes from the latest one: state, ledger, data position), TensorBoard event files
  and ``metrics.jsonl`` (train rows every ``log_every_steps`` with loopkit's ``throughput/*``,
  ``eval/accuracy``, ``eval/loss`` every ``eval_every_epochs`` and at the end, ``goodput/*``),
  ``goodput.json`` and ``results.json`` (the returned summary without the state).

  Args:
    config: the example's configuration (see ``configs/``).
    workdir: output directory.
    extra_hooks: more :class:`loopkit.Hook`\\ s, run after the example's own.

  Returns:
    ``eval_accuracy``, ``eval_loss``, ``eval_count`` (of the last evaluation; None for a run
    preempted before any: it stops without evaluating), ``eval_history`` (``[(step,
    accuracy)]``), ``step``, ``status``, ``restored_step``, ``warm_started``, ``ledger`` (a
    dict), ``steps_per_epoch``, ``num_train_steps``, ``global_batch_size``,
    ``iterations_per_loop``, ``device_calls``, ``num_devices``, ``compile_count``,
    ``eval_compile_count``, ``num_params``, ``model``, ``workdir``, and ``state`` (the final
    :class:`TrainState`).

  Raises:
    ValueError: from loopkit, e.g. a global batch not divisible by the number of devices, or
      a checkpoint in ``workdir`` that does not match the model.
  """
  if "://" not in workdir:  # a local path; gs://... stays as it is
    workdir = os.path.abspath(workdir)
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  with input_pipeline.mock_data_if_asked(config):
    return _train_and_evaluate(config, workdir, tuple(extra_hooks))


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                        extra_hooks: tuple[loopkit.Hook, ...]) -> dict[str, Any]:
  mesh = make_mesh(jax.devices())
  axis_name = "data" if config.step_style == "per_device" else None
  dtype = compute_dtype(config)
  label_modulo = config.get("label_modulo", 0)
  train_batches, eval_batches = input_pipeline.create_datasets(config)
  steps_per_epoch = train_batches.steps_per_epoch
  total_steps = num_train_steps(config, steps_per_epoch)
  schedule = learning_rate_schedule(config, steps_per_epoch)
  tx = create_optimizer(config, schedule)
  # Eager initialisation compiles one small program per weight shape (8-48 s for ResNet-18
  # on 2 shared CPU cores): a wait before the loop's first line, so it is announced.
  absl_logging.info("initialising the ResNet-%d parameters (seed %d)", config.model.depth,
                    config.seed)
  t0 = time.perf_counter()
  model = create_model(config, axis_name=axis_name)
  num_params = models.param_count(model)
  graphdef, state = create_train_state(model, tx)
  del model
  absl_logging.info("ResNet-%d: %s parameters, initialised in %.1f s", config.model.depth,
                    f"{num_params:,}", time.perf_counter() - t0)

  writer = writers.create_default_writer(workdir)
  evaluator = loopkit.Evaluator(make_eval_step(graphdef, dtype=dtype, label_modulo=label_modulo),
                                iterations_per_loop=config.eval_iterations_per_loop, mesh=mesh,
                                step_style=config.step_style,
                                global_batch_size=config.eval_batch_size)
  # Also at the end of training, not at a preemption (the resumed run evaluates there);
  # eval_every_epochs = 0: only at the end (no trigger at all would fire after every call).
  marks = ({"every_epochs": config.eval_every_epochs} if config.eval_every_epochs
           else {"at_steps": ()})
  eval_hook = loopkit.EvalHook(evaluator, eval_batches, num_batches=eval_batches.num_batches,
                               writer=writer, prefix="eval", at_end=True, **marks)
  hooks: list[loopkit.Hook] = [loopkit.NanCheckHook(),
                               loopkit.LoggingHook(writer, every_steps=config.log_every_steps)]
  ckpt, warm = None, warm_start_of(config)
  if config.checkpoint_every_steps or config.checkpoint_every_epochs:
    # A warm start applies only while the workdir has no checkpoint: a rerun resumes.
    ckpt = loopkit.CheckpointHook(os.path.join(workdir, "checkpoints"),
                                  every_steps=config.checkpoint_every_steps or None,
                                  every_epochs=config.checkpoint_every_epochs or None,
                                  max_to_keep=config.max_checkpoints_to_keep, init_from=warm)
    hooks.append(ckpt)
  elif warm is not None:
    state = warm.apply(state)
  hooks += [eval_hook,
            loopkit.ProgressHook(total_steps, log_every_secs=config.progress_every_secs,
                                 logger=logging.getLogger("loopkit")),
            goodput.GoodputHook(writer, workdir=workdir, log_summary=True), *extra_hooks]
  loop = loopkit.TrainLoop(
      make_train_step(graphdef, tx, schedule, num_classes=config.num_classes,
                      label_smoothing=config.label_smoothing, dtype=dtype,
                      axis_name=axis_name, label_modulo=label_modulo),
      iterations_per_loop=config.iterations_per_loop, hooks=hooks, mesh=mesh,
      step_style=config.step_style, steps_per_epoch=steps_per_epoch,
      global_batch_size=config.global_batch_size, prefetch=config.prefetch)
  state = loop.run(state, train_batches, num_steps=total_steps)
  writer.close()
  if ckpt is not None:
    ckpt.close()

  final = eval_hook.results[-1][1] if eval_hook.results else None
  results = {
      "eval_accuracy": None if final is None else final.metrics["accuracy"],
      "eval_loss": None if final is None else final.metrics["loss"],
      "eval_count": None if final is None else final.num_examples,
      "eval_history": [(s, r.metrics["accuracy"]) for s, r in eval_hook.results],
      "step": loop.ledger.step, "status": loop.status,
      "restored_step": None if ckpt is None else ckpt.restored_step,
      "warm_started": None if ckpt is None else ckpt.warm_started,
      "ledger": loop.ledger.to_dict(), "steps_per_epoch": steps_per_epoch,
      "num_train_steps": total_steps, "global_batch_size": config.global_batch_size,
      "iterations_per_loop": config.iterations_per_loop,
      "device_calls": loop.ledger.loop_index, "num_devices": jax.device_count(),
      "compile_count": loop.program.compile_count(),
      "eval_compile_count": evaluator.compile_count(), "num_params": num_params,
      "model": f"ResNet-{config.model.depth}", "workdir": workdir,
  }
  if jax.process_index() == 0:
    (epath.Path(workdir) / "results.json").write_text(json.dumps(results, indent=2))
  return dict(results, state=state)


def summary(config: ml_collections.ConfigDict, r: dict[str, Any], wall_secs: float
            ) -> list[str]:
  """The lines ``main.py`` prints for :func:`train_and_evaluate`'s results ``r``."""
  evaluated = (f"eval accuracy {r['eval_accuracy']:.4f} on {r['eval_count']} "
               f"{config.dataset}/{config.eval_split} examples" if r["eval_count"] is not None
               else "not evaluated (the same command resumes)")
  resumed = "" if r["restored_step"] is None else f", resumed from step {r['restored_step']}"
  lines = [f"{r['model']}: {evaluated} at step {r['step']} "
           f"({r['num_train_steps'] / r['steps_per_epoch']:.3g} epochs of "
           f"{r['steps_per_epoch']} steps, batch {r['global_batch_size']}, "
           f"iterations_per_loop={r['iterations_per_loop']}, {r['device_calls']} device calls, "
           f"{r['num_devices']} devices, {r['compile_count']} train compilation"
           f"{'' if r['compile_count'] == 1 else 's'}{resumed}); status {r['status']}; "
           f"{wall_secs:.1f} s wall"]
  if r["warm_started"]:
    lines.append(f"warm start (init_from): {r['warm_started'].removeprefix('warm start ')}")
  w = r["workdir"]
  return lines + [f"results (JSON):        {os.path.join(w, 'results.json')}",
                  f"metrics (JSONL, TB):   {os.path.join(w, 'metrics.jsonl')} "
                  f"(tensorboard --logdir {w})",
                  f"checkpoints (Orbax):   {os.path.join(w, 'checkpoints')}"]
