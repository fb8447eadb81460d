"""ResNet training and evaluation with ``loopkit.TrainLoop``: pure steps, hooks at boundaries.

The NNX model is split once into a static ``graphdef``, its parameters and its
BatchNorm statistics (plain nested dicts of arrays); the steps merge them back
inside the compiled program, so the train state is a plain pytree that loopkit
carries through ``iterations_per_loop`` steps per device call, donates, pins and
checkpoints.

Recipe (each value's source is in the configs): SGD with Nesterov momentum 0.9;
learning rate ``base_learning_rate * B / 256`` (linear scaling rule, Goyal et
al. 2017) with linear warmup then cosine decay to 0 (optax schedules);
cross-entropy with ``config.label_smoothing`` (0 in Flax's recipe,
``configs/imagenet_flax.py``); L2 weight decay on convolution and dense kernels
only (not on BatchNorm scales/biases or the dense bias).
"""

from __future__ import annotations

import contextlib
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
from flax import nnx

import loopkit
from examples.resnet50 import input_pipeline, models
from examples.resnet50.config_checks import FILE_FORMATS, file_format
from loopkit import evaluation
from loopkit.observe import goodput, progress, writers

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

  Args:
    config: ``base_learning_rate``, ``global_batch_size``, ``warmup_epochs``,
      ``num_epochs``.
    steps_per_epoch: optimizer steps per epoch.

  Returns:
    ``schedule(step) -> float32`` learning rate of the update applied at ``step``
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

  ``add_decayed_weights`` before SGD adds ``weight_decay * w`` to the gradient,
  i.e. the L2 penalty ``weight_decay / 2 * |w|^2`` of the references, applied to
  convolution and dense kernels only: BatchNorm scales/biases and the dense
  bias are 1-D and excluded.
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
    label_smoothing: weight moved from the true class to the uniform
      distribution (0.1: Szegedy et al. 2016, "Rethinking the Inception
      Architecture"; Goyal et al. 2017 do not use it, the MLPerf reference does).
    dtype: dtype the images are normalised to (the model's compute dtype).
    axis_name: None for the ``"global"`` step style (the step sees the global
      batch; BatchNorm statistics are global by construction); the data axis
      name for ``"per_device"`` (gradients are ``pmean``ed over it and BatchNorm
      must have been built with the same ``axis_name``).
    label_modulo: > 0: the step learns ``label % label_modulo`` (a relabelled
      task, e.g. the digits mod 5 for fine-tuning with a new 5-class head).

  Returns:
    ``train_step(state, batch) -> (state, metrics)``; ``batch`` =
    ``{"image": uint8 [B, S, S, 3], "label": int32 [B]}`` (the device's
    ``[B / D, ...]`` slice in per-device style). Metrics: ``loss`` (smoothed
    cross-entropy) and ``accuracy`` as :class:`loopkit.metrics.Mean` weighted by
    the batch size, ``learning_rate`` as :class:`loopkit.metrics.Last`.
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


def relabel(labels: jax.Array, label_modulo: int) -> jax.Array:
  """``labels % label_modulo`` if ``label_modulo`` > 0 (a relabelled task), else ``labels``."""
  return labels % label_modulo if label_modulo > 0 else labels


def make_eval_step(graphdef: nnx.GraphDef, *, dtype: Any = jnp.float32, label_modulo: int = 0
                   ) -> Callable[[TrainState, Batch], dict[str, jax.Array]]:
  """A pure eval step for :class:`loopkit.evaluation.Evaluator` (BatchNorm running stats).

  ``label_modulo`` > 0 evaluates on ``label % label_modulo``, as :func:`make_train_step`.

  Returns:
    ``eval_step(state, batch) -> {"accuracy": float32 [B], "loss": float32 [B]}``:
    per-example top-1 correctness and (unsmoothed) cross-entropy; the evaluator
    masks padding and sums exactly.
  """

  def eval_step(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
    model = nnx.merge(graphdef, state.params, state.batch_stats)
    logits = model(input_pipeline.normalize(batch["image"], dtype), train=False)
    labels = relabel(batch["label"], label_modulo)
    return {"accuracy": (jnp.argmax(logits, -1) == labels).astype(jnp.float32),
            "loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels)}

  return eval_step


# -- data -----------------------------------------------------------------------


def preprocessing(config: ml_collections.ConfigDict) -> input_pipeline.Preprocessing:
  """The :class:`~input_pipeline.Preprocessing` of ``config``."""
  return input_pipeline.Preprocessing(
      image_size=config.image_size, random_resized_crop=config.random_resized_crop,
      area_range=tuple(config.area_range), aspect_ratio_range=tuple(config.aspect_ratio_range),
      flip=config.flip, crop_fraction=config.crop_fraction,
      resize_method=config.resize_method)


def create_datasets(config: ml_collections.ConfigDict) -> tuple[Any, Any]:
  """This process's training and eval batches for ``config.dataset``.

  ``config.input_pipeline``: ``"tfdata"`` (TFRecords through
  ``builder.as_dataset``: :class:`~input_pipeline.TrainBatches`,
  :class:`~input_pipeline.EvalBatches`) or ``"grain"`` (ArrayRecord files
  through ``tfds.data_source`` and Grain, ``config.grain_workers`` worker
  processes: :func:`~input_pipeline.grain_train_source`,
  :class:`~input_pipeline.GrainEvalBatches`). ``sklearn_digits`` is generated
  into ``config.data_dir`` on first use, in the pipeline's file format; other
  datasets (``imagenet2012``) must already be prepared there (or be mocked with
  ``tfds.testing.mock_data``, tf.data only).

  Raises:
    ValueError: an unknown ``input_pipeline``, or a dataset built in the other
      file format (naming both).
  """
  import tensorflow_datasets as tfds

  fmt = file_format(config)
  kind = config.get("input_pipeline", "tfdata")
  if config.dataset == "sklearn_digits":
    from examples.resnet50 import digits_tfds
    builder = digits_tfds.ensure_prepared(config.data_dir or None, file_format=fmt)
  else:
    builder = tfds.builder(config.dataset, data_dir=config.data_dir or None)
  p = preprocessing(config)
  if kind == "grain":
    train = input_pipeline.grain_train_source(
        builder, split=config.train_split, global_batch_size=config.global_batch_size,
        preprocessing=p, seed=config.seed, worker_count=config.get("grain_workers", 0))
    evals = input_pipeline.GrainEvalBatches(
        builder, split=config.eval_split, global_batch_size=config.eval_batch_size,
        preprocessing=p)
    return train, evals
  fmt = getattr(builder.info.file_format, "value", builder.info.file_format)
  if not config.mock_data and fmt != FILE_FORMATS["tfdata"]:
    raise ValueError(f"input_pipeline='tfdata' reads TFRecord files, but the TFDS dataset "
                     f"{builder.name!r} in {builder.data_dir} was built as {fmt!r}: use "
                     "input_pipeline='grain' (ArrayRecord), or prepare it as TFRecords")
  train = input_pipeline.TrainBatches(
      builder, split=config.train_split,
      num_examples=input_pipeline.num_examples(builder, config.train_split,
                                               config.num_train_examples),
      global_batch_size=config.global_batch_size, preprocessing=p, seed=config.seed,
      shuffle_buffer=config.shuffle_buffer, read_once=config.mock_data)
  evals = input_pipeline.EvalBatches(
      builder, split=config.eval_split,
      num_examples=input_pipeline.num_examples(builder, config.eval_split,
                                               config.num_eval_examples),
      global_batch_size=config.eval_batch_size, preprocessing=p, read_once=config.mock_data)
  return train, evals


# -- host -----------------------------------------------------------------------


class ThroughputHook(loopkit.Hook):
  """Measures steady-state training examples/s: calls after the first, hook time excluded.

  From the second call's boundary to the last, ``examples / (wall time - time
  spent in hooks such as evaluation and checkpoints)``; the first call (with
  compilation) is excluded. Observes only (never needs the state). Measured on
  the host clock at boundaries one call late, like every stateless hook.

  Attributes:
    examples_per_sec: the last measurement (None before two calls).
  """

  needs_state = False
  _NOT_HOOKS = ("total", "compile", "dispatch", "device_wait", "data_wait", "lost")

  def __init__(self):
    super().__init__()
    self.examples_per_sec: float | None = None
    self._loop = None
    self._first: tuple[float, int, float] | None = None

  def _hook_secs(self) -> float:
    return sum(v for k, v in self._loop.ledger.seconds.items() if k not in self._NOT_HOOKS)

  def on_run_start(self, loop, state):
    del state
    self._loop = loop
    self._first = None

  def after_each_call(self, info: loopkit.LoopInfo) -> None:
    now = time.perf_counter()
    if self._first is None:
      self._first = (now, info.examples_seen, self._hook_secs())
      return
    t0, n0, h0 = self._first
    secs = (now - t0) - (self._hook_secs() - h0)
    if secs > 0:
      self.examples_per_sec = (info.examples_seen - n0) / secs


class RunStartLedgerHook(loopkit.Hook):
  """Copies the ledger's time buckets when the run starts, after any checkpoint restore.

  Placed after the checkpoint hook, it sees the restored ledger (whose buckets add up
  the earlier runs), so ``ledger.seconds - at_start`` is this run's share: e.g. the
  compile seconds a resume spent (less with the persistent compilation cache).
  """

  needs_state = False

  def __init__(self):
    super().__init__()
    self.at_start: dict[str, float] = {}

  def on_run_start(self, loop, state):
    del state
    self.at_start = dict(loop.ledger.seconds)


def _maybe_mock(config: ml_collections.ConfigDict):
  """``tfds.testing.mock_data`` when ``config.mock_data`` (smoke tests), else nothing."""
  if not config.get("mock_data", False):
    return contextlib.nullcontext()
  import tensorflow_datasets as tfds
  return tfds.testing.mock_data(num_examples=config.mock_num_examples)


def num_train_steps(config: ml_collections.ConfigDict, steps_per_epoch: int) -> int:
  """``config.num_train_steps`` if > 0, else ``num_epochs * steps_per_epoch``."""
  if config.num_train_steps > 0:
    return int(config.num_train_steps)
  return int(config.num_epochs * steps_per_epoch)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       extra_hooks: Sequence[loopkit.Hook] = ()) -> dict[str, Any]:
  """Trains the ResNet and evaluates it exactly on the eval split; resumes automatically.

  Writes to ``workdir`` (created if missing): ``checkpoints/`` (Orbax, when
  ``config.checkpoint_every_steps`` or ``checkpoint_every_epochs`` > 0; a
  rerun with the same workdir resumes from the latest one), TensorBoard event
  files and ``metrics.jsonl`` (train metrics every ``log_every_steps``, eval
  metrics ``eval/accuracy`` etc. every ``eval_every_epochs`` and at the end,
  ``goodput/*``), ``goodput.json`` and ``results.json`` (the returned summary,
  without the state).

  Args:
    config: the example's configuration (see ``configs/``).
    workdir: output directory.
    extra_hooks: more hooks (:class:`loopkit.Hook`), run after the example's
      own (e.g. the multi-host test's hook that waits at a step for a SIGTERM).

  Returns:
    Summary dict: ``eval_accuracy``, ``eval_loss``, ``eval_count`` (of the last
    evaluation; None for a run preempted before any, which stops without
    evaluating), ``step``,
    ``ledger`` (the final ledger as a dict), ``restored_step``,
    ``warm_started`` (what ``config.init_from`` gave, when the run started from it),
    ``steps_per_epoch``, ``iterations_per_loop``, ``device_calls``,
    ``compile_count``, ``compile_secs`` (this run's train compile, or cache load,
    from the ledger) and ``compile_secs_all_runs`` (over resumes),
    ``train_examples_per_sec`` (steady state),
    ``train_seconds``, ``status``, ``num_params``, paths, and ``state`` (the
    final :class:`TrainState`).

  Raises:
    ValueError: from loopkit, e.g. a global batch not divisible by the number
      of devices, or a checkpoint in ``workdir`` that does not match the model.
  """
  os.makedirs(workdir, exist_ok=True)
  with _maybe_mock(config):
    return _train_and_evaluate(config, workdir, tuple(extra_hooks))


def warm_start_of(config: ml_collections.ConfigDict) -> Any:
  """The run's warm start from ``config.init_from``, or None (``""``: from scratch).

  A :class:`loopkit.checkpoint.WarmStart` of the parameters and BatchNorm statistics
  (``params``, ``batch_stats``) of the latest checkpoint in ``config.init_from``
  (a loopkit checkpoint directory, e.g. the Quickstart's ``/tmp/resnet-cpu/checkpoints``,
  or one step of it), except the leaves ``config.init_exclude`` names (a pattern;
  ``"params/head"`` for a new head); the optimizer state and the step are the new
  run's (fresh, 0).
  """
  if not config.get("init_from", ""):
    return None
  from loopkit import checkpoint  # needs orbax-checkpoint
  exclude = config.get("init_exclude", "")
  return checkpoint.WarmStart(config.init_from, select=("params", "batch_stats"),
                              exclude=exclude or ())


def make_mesh(devices: list[jax.Device]) -> jax.sharding.Mesh:
  """The run's mesh: one ``"data"`` axis over ``devices`` (jax's default axis type)."""
  return jax.make_mesh((len(devices),), ("data",), devices=devices)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                        extra_hooks: tuple[loopkit.Hook, ...]) -> dict[str, Any]:
  mesh = make_mesh(jax.devices())
  per_device = config.step_style == "per_device"
  axis_name = "data" if per_device else None
  dtype = compute_dtype(config)

  train_batches, eval_batches = create_datasets(config)
  steps_per_epoch = train_batches.steps_per_epoch
  total_steps = num_train_steps(config, steps_per_epoch)
  schedule = learning_rate_schedule(config, steps_per_epoch)
  tx = create_optimizer(config, schedule)
  # Eager initialisation compiles one small program per weight shape: 8-48 s for ResNet-18 on
  # 2 shared CPU cores (47.5 s at a load average of 6), a wait before the loop's first line, so
  # it is announced.
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
  label_modulo = config.get("label_modulo", 0)
  evaluator = evaluation.Evaluator(make_eval_step(graphdef, dtype=dtype,
                                                  label_modulo=label_modulo),
                                   iterations_per_loop=config.eval_iterations_per_loop,
                                   mesh=mesh, step_style=config.step_style,
                                   global_batch_size=config.eval_batch_size)
  # eval_every_epochs = 0: no periodic evaluation (at_steps=() fires only at the end of the run).
  eval_when = ({"every_epochs": config.eval_every_epochs} if config.eval_every_epochs
               else {"at_steps": ()})
  eval_hook = evaluation.EvalHook(evaluator, eval_batches, num_batches=eval_batches.num_batches,
                                  writer=writer, prefix="eval", **eval_when)
  throughput = ThroughputHook()
  hooks: list[loopkit.Hook] = [
      loopkit.NanCheckHook(),
      loopkit.LoggingHook(writer, every_steps=config.log_every_steps),
      throughput,
  ]
  ckpt = None
  warm = warm_start_of(config)
  if config.checkpoint_every_steps or config.checkpoint_every_epochs:
    from loopkit import checkpoint  # needs orbax-checkpoint
    # A warm start applies only while the workdir has no checkpoint: a rerun resumes.
    ckpt = checkpoint.CheckpointHook(
        os.path.join(os.path.abspath(workdir), "checkpoints"),
        every_steps=config.checkpoint_every_steps or None,
        every_epochs=config.checkpoint_every_epochs or None,
        max_to_keep=config.max_checkpoints_to_keep, init_from=warm)
    hooks.append(ckpt)
  elif warm is not None:
    state = warm.apply(state)
  run_start = RunStartLedgerHook()
  hooks += [run_start, eval_hook,
            progress.ProgressHook(total_steps, log_every_secs=config.progress_every_secs,
                                  logger=logging.getLogger("loopkit")),
            goodput.GoodputHook(writer, workdir=workdir, log_summary=True), *extra_hooks]

  loop = loopkit.TrainLoop(
      make_train_step(graphdef, tx, schedule, num_classes=config.num_classes,
                      label_smoothing=config.label_smoothing, dtype=dtype,
                      axis_name=axis_name, label_modulo=label_modulo),
      iterations_per_loop=config.iterations_per_loop, hooks=hooks, mesh=mesh,
      step_style=config.step_style, steps_per_epoch=steps_per_epoch,
      global_batch_size=config.global_batch_size, prefetch=config.prefetch)
  t0 = time.perf_counter()
  state = loop.run(state, train_batches, num_steps=total_steps)
  eval_results = list(eval_hook.results)
  # A preempted run stops without evaluating (the resumed run evaluates where an
  # uninterrupted one does); a run that ends elsewhere is evaluated at its end.
  if loop.status != "preempted" and (
      not eval_results or eval_results[-1][0] != loop.ledger.step):  # nothing left to train
    result = evaluator.evaluate(state, eval_batches, num_batches=eval_batches.num_batches)
    evaluation.report(loop.ledger.step, result, writer=writer, prefix="eval")  # EvalHook's row
    eval_results.append((loop.ledger.step, result))
  train_seconds = time.perf_counter() - t0
  writer.close()
  if ckpt is not None:
    ckpt.close()

  final_step, final = eval_results[-1] if eval_results else (None, None)
  results = {
      "eval_accuracy": None if final is None else final.metrics["accuracy"],
      "eval_loss": None if final is None else final.metrics["loss"],
      "eval_count": None if final is None else final.num_examples, "eval_history": [
          (s, r.metrics["accuracy"]) for s, r in eval_results],
      "step": int(jax.device_get(state.step)), "eval_step": final_step,
      "ledger": loop.ledger.to_dict(),
      "restored_step": None if ckpt is None else ckpt.restored_step,
      "warm_started": None if ckpt is None else ckpt.warm_started,
      "steps_per_epoch": steps_per_epoch, "num_train_steps": total_steps,
      "global_batch_size": config.global_batch_size,
      "iterations_per_loop": config.iterations_per_loop,
      "device_calls": loop.ledger.loop_index, "num_devices": jax.device_count(),
      "compile_count": loop.program.compile_count(),
      "eval_compile_count": evaluator.compile_count(), "status": loop.status,
      # the train program's first dispatch (trace + compile, or a persistent-cache load)
      "compile_secs": round(loop.ledger.seconds.get("compile", 0.0)
                            - run_start.at_start.get("compile", 0.0), 3),
      "compile_secs_all_runs": round(loop.ledger.seconds.get("compile", 0.0), 3),
      "train_examples_per_sec": throughput.examples_per_sec,
      "train_seconds": round(train_seconds, 3), "num_params": num_params,
      "model": f"ResNet-{config.model.depth}", "workdir": os.path.abspath(workdir),
      "results_path": os.path.join(os.path.abspath(workdir), "results.json"),
  }
  if jax.process_index() == 0:
    with open(results["results_path"], "w") as f:
      json.dump(results, f, indent=2)
  results["state"] = state
  return results


# -- evaluation beside training -------------------------------------------------


def evaluate_beside(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """``config.eval_only``: evaluates each checkpoint of the training run in ``workdir`` once.

  Runs beside ``main.py`` training with the same ``--workdir`` and config (another process,
  another machine with the workdir shared): follows ``workdir/checkpoints`` with
  :class:`loopkit.tools.follower.CheckpointFollower`, evaluating each new checkpoint with the
  training run's evaluator and eval batches, and writes the rows (``eval/accuracy``,
  ``eval/loss``, ``eval/num_examples`` at the checkpoint's step, the rows EvalHook writes in
  the training run) to ``workdir/eval_only/metrics.jsonl`` and TensorBoard files there. It
  stops when the training run completes (``TRAIN_COMPLETE``), or after
  ``config.follow_timeout_secs`` without a new checkpoint (> 0). A rerun continues where it
  stopped (``workdir/eval_only/follow_progress.json``). The training run may then skip its own
  evaluations: ``--config.eval_every_epochs=0`` (only at the end).

  Returns:
    ``{"status": "complete" | "timed_out", "evaluated": [(step, accuracy, loss)],
    "skipped": [steps deleted before they were read], "rows_path": str}``.
  """
  from loopkit.tools.follower import follow  # needs orbax-checkpoint

  with _maybe_mock(config):
    mesh = make_mesh(jax.devices())
    axis_name = "data" if config.step_style == "per_device" else None
    dtype = compute_dtype(config)
    _, eval_batches = create_datasets(config)
    # The train state's structure, not its values (the optimizer's state does not depend on
    # the schedule's constants): nothing is allocated.
    tx = create_optimizer(config, learning_rate_schedule(config, 1))
    graphdef = nnx.split(nnx.eval_shape(lambda: create_model(config, axis_name=axis_name)))[0]
    like = jax.eval_shape(
        lambda: create_train_state(create_model(config, axis_name=axis_name), tx)[1])
    evaluator = evaluation.Evaluator(make_eval_step(graphdef, dtype=dtype),
                                     iterations_per_loop=config.eval_iterations_per_loop,
                                     mesh=mesh, step_style=config.step_style,
                                     global_batch_size=config.eval_batch_size)
    out = os.path.join(os.path.abspath(workdir), "eval_only")
    writer = writers.create_default_writer(out)
    try:
      follower = follow(
          os.path.join(os.path.abspath(workdir), "checkpoints"), like, evaluator,
          eval_batches, num_batches=eval_batches.num_batches, writer=writer, prefix="eval",
          progress_file=os.path.join(out, "follow_progress.json"),
          poll_secs=config.follow_poll_secs,
          timeout_secs=config.follow_timeout_secs or None)
    finally:
      writer.close()
  return {"status": follower.status,
          "evaluated": [(s, r.metrics["accuracy"], r.metrics["loss"])
                        for s, r in follower.results],
          "skipped": follower.skipped_steps, "rows_path": os.path.join(out, "metrics.jsonl")}


# -- ahead-of-time compilation --------------------------------------------------

# Split sizes for --compile_only without the dataset (TFDS imagenet2012 metadata).
KNOWN_SPLIT_SIZES = {("imagenet2012", "train"): 1_281_167,
                     ("imagenet2012", "validation"): 50_000}


def _split_size(config: ml_collections.ConfigDict, split: str, override: int) -> int:
  if override:
    return int(override)
  try:
    return KNOWN_SPLIT_SIZES[(config.dataset, split)]
  except KeyError:
    raise ValueError(f"--compile_only needs the size of {config.dataset}/{split}: set "
                     "config.num_train_examples / num_eval_examples") from None


def input_rate_lines(report: Any, measured: dict[str, Any] | None = None) -> list[str]:
  """What each host must deliver for the train program's compute bound, beside measured rates.

  Args:
    report: a :class:`loopkit.tools.aot.AotReport` (its ``"train"`` program's
      ``examples_per_sec``, the roofline upper bound, and ``num_processes``).
    measured: the JSON of ``benchmarks/input.py --out`` (``rows`` of
      ``{"pipeline", "images_per_s"}``, per process), or None.

  Returns:
    Report lines: the images/s per host the bound needs, then per measured
    pipeline its rate and the share of that need it covers.
  """
  train_program = report.programs.get("train")
  if train_program is None or train_program.examples_per_sec is None:
    return ["input: no chip numbers, so no images/s per host to compare with"]
  need = train_program.examples_per_sec / max(1, report.num_processes)
  lines = [f"input: the train program's compute bound needs >= {need:,.0f} images/s from each "
           f"of the {report.num_processes} host(s) (the roofline rate / hosts; a bound, not a "
           "measurement)"]
  if measured is None:
    lines.append("  measure what a host delivers with: python benchmarks/input.py --out "
                 "rates.json, then pass --input_rates=rates.json")
    return lines
  for row in measured.get("rows", []):
    rate = float(row["images_per_s"])
    lines.append(f"  measured {row['pipeline']}: {rate:,.0f} images/s per process, "
                 f"{rate / need:.1%} of the need (batch {measured.get('batch')}, "
                 f"{measured.get('cpu_count')} CPUs where measured)")
  return lines


def compile_only(config: ml_collections.ConfigDict, topology: str, *,
                 hbm_bytes: int | None = None, with_eval: bool = True) -> Any:
  """Compiles the run's train and eval programs for a topology; no data, no training.

  The same steps, K, batch shapes (``{"image": uint8 [B, S, S, 3], "label":
  int32 [B]}``), shardings and donation as :func:`train_and_evaluate`, from
  abstract state (``jax.eval_shape``), through :func:`loopkit.tools.aot.compile_for`.

  Args:
    config: the example's configuration.
    topology: a TPU topology (``"v5e:2x2"``, ``"v4-32"``, see
      :func:`loopkit.tools.topology.parse_topology`) or ``"local"`` (this machine's devices).
    hbm_bytes: HBM per device to check against instead of the chip's.
    with_eval: also compile the evaluator's program.

  Returns:
    The :class:`loopkit.tools.aot.AotReport`.

  Raises:
    ValueError: unknown topology, a batch the topology cannot split, or a
      program that does not fit (:class:`loopkit.tools.aot.ProgramDoesNotFitError`).
  """
  from loopkit.tools import aot, topology as topology_lib

  devices = jax.devices() if topology == "local" else topology_lib.topology_devices(topology)
  mesh = make_mesh(devices)
  num_processes = len({d.process_index for d in devices})
  # steps_per_epoch as input_pipeline.TrainBatches computes it on the target's processes
  # (it sets the learning-rate schedule's constants, not the program's shapes).
  n_train = _split_size(config, config.train_split, config.num_train_examples)
  smallest = input_pipeline.shard_size(n_train, num_processes - 1, num_processes)
  steps_per_epoch = max(1, smallest // (config.global_batch_size // num_processes))
  per_device = config.step_style == "per_device"
  axis_name = "data" if per_device else None
  dtype = compute_dtype(config)
  schedule = learning_rate_schedule(config, steps_per_epoch)
  tx = create_optimizer(config, schedule)
  graphdef = nnx.split(nnx.eval_shape(lambda: create_model(config, axis_name=axis_name)))[0]
  state = jax.eval_shape(lambda: create_train_state(create_model(config, axis_name=axis_name),
                                                    tx)[1])
  size = config.image_size

  def batch(b):
    return {"image": jax.ShapeDtypeStruct((b, size, size, 3), jnp.uint8),
            "label": jax.ShapeDtypeStruct((b,), jnp.int32)}

  label_modulo = config.get("label_modulo", 0)
  evaluator = evaluation.Evaluator(make_eval_step(graphdef, dtype=dtype,
                                                  label_modulo=label_modulo),
                                   iterations_per_loop=config.eval_iterations_per_loop,
                                   mesh=mesh, step_style=config.step_style,
                                   global_batch_size=config.eval_batch_size,
                                   prefetch=config.prefetch)
  program = loopkit.core.MultiStepProgram(
      make_train_step(graphdef, tx, schedule, num_classes=config.num_classes,
                      label_smoothing=config.label_smoothing, dtype=dtype, axis_name=axis_name,
                      label_modulo=label_modulo),
      iterations_per_loop=config.iterations_per_loop, mesh=mesh, style=config.step_style)
  return aot.compile_for(program, state, batch(config.global_batch_size), topology=topology,
                         mesh=mesh, evaluator=evaluator if with_eval else None,
                         eval_batch=batch(config.eval_batch_size), prefetch=config.prefetch,
                         hbm_bytes=hbm_bytes)
