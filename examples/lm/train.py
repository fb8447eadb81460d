"""Training and evaluation of the byte-level Transformer LM with ``loopkit.TrainLoop``.

The NNX model is split once into a static ``graphdef`` and its parameters (a plain dict of
arrays); the steps merge them back inside the compiled program, so the train state is a plain
pytree (:class:`TrainState`). The state is created by one compiled program whose outputs carry
the parameters' shardings (:func:`create_train_state`): each leaf is a ``NamedSharding`` on the
``("data", "fsdp", "tensor")`` mesh, and loopkit keeps those shardings through every device
call, checkpoint and restore. The batch is split over ``data_axis=("data", "fsdp")``.

Recipe: AdamW (Loshchilov & Hutter 2019; ``b1 = 0.9``, ``b2 = 0.95``, weight decay on matrices
only, as GPT-3 and most LM codebases), gradients clipped to global norm 1, learning rate linear
warmup then cosine decay to a tenth of the peak; next-byte cross-entropy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging as absl_logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import loopkit
from examples.lm import input_pipeline, models
from loopkit import evaluation
from loopkit.observe import goodput, progress, writers

Batch = dict[str, jax.Array]
MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # loopkit's data_axis: the batch is split over their product


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  """The train state: a plain pytree, no callables inside.

  Attributes:
    step: int32 scalar, optimizer updates applied (= loopkit's ledger step).
    params: ``{name: float32 array}``, the model's ``nnx.Param`` s, each sharded by its logical
      axes (:data:`models.LOGICAL_AXIS_RULES`).
    opt_state: the optax state; its moment estimates carry their parameter's sharding.
  """

  step: jax.Array
  params: Any
  opt_state: Any


# -- configuration -> objects ----------------------------------------------------------------


def model_config(config: ml_collections.ConfigDict) -> models.ModelConfig:
  """The :class:`models.ModelConfig` of ``config.model`` (``max_len = config.seq_len``)."""
  m = config.model
  return models.ModelConfig(num_layers=m.num_layers, d_model=m.d_model, num_heads=m.num_heads,
                            head_dim=m.head_dim, mlp_dim=m.mlp_dim, max_len=config.seq_len,
                            dtype=jnp.bfloat16 if config.half_precision else jnp.float32,
                            remat=m.remat, scan_layers=m.get("scan_layers", False))


def make_mesh(config: ml_collections.ConfigDict,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The ``("data", "fsdp", "tensor")`` mesh of shape ``config.mesh_shape`` over ``devices``
  (default: all), ``Auto`` axes (XLA's sharding propagation, as Flax's lm1b and MaxText).

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


def create_optimizer(config: ml_collections.ConfigDict,
                     schedule: optax.Schedule) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW with weight decay on matrices (``ndim > 1``) only."""
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.adamw(schedule, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay,
                  mask=decay_mask))


def state_shardings(config: ml_collections.ConfigDict, mesh: Mesh,
                    tx: optax.GradientTransformation) -> tuple[nnx.GraphDef, Any, TrainState]:
  """The model's graph, the abstract train state and its shardings, without allocating.

  Returns:
    ``(graphdef, abstract_state, shardings)``: ``abstract_state`` a :class:`TrainState` of
    ``jax.ShapeDtypeStruct`` carrying the shardings; ``shardings`` the same tree of
    ``NamedSharding``: the parameters' from their logical axes, each AdamW moment its
    parameter's (``optax.tree_map_params``), every other leaf (the step, Adam's count)
    replicated.
  """
  abstract = models.abstract_model(model_config(config), seed=config.seed, mesh=mesh)
  graphdef, params = nnx.split(abstract, nnx.Param)
  params = nnx.to_pure_dict(params)
  param_sh = models.param_shardings(abstract, mesh)
  replicated = NamedSharding(mesh, P())
  opt_abstract = jax.eval_shape(tx.init, params)
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, opt_abstract, param_sh,
                                 transform_non_params=lambda _: replicated)
  shardings = TrainState(step=replicated, params=param_sh, opt_state=opt_sh)
  abstract_state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                              opt_state=opt_abstract)
  abstract_state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, shardings)
  return graphdef, abstract_state, shardings


def create_train_state(config: ml_collections.ConfigDict, mesh: Mesh,
                       tx: optax.GradientTransformation) -> tuple[nnx.GraphDef, TrainState]:
  """The step-0 state, made by one compiled program straight into its shardings.

  Returns:
    ``(graphdef, state)``; every leaf of ``state`` a ``jax.Array`` with its ``NamedSharding``
    on ``mesh`` (:func:`state_shardings`).
  """
  graphdef, _, shardings = state_shardings(config, mesh, tx)
  cfg = model_config(config)

  def init() -> TrainState:
    with nnx.use_eager_sharding(False):  # the jit's out_shardings place the leaves
      model = models.Transformer(cfg, rngs=nnx.Rngs(params=config.seed), mesh=mesh)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  return graphdef, jax.jit(init, out_shardings=shardings)()


# -- pure steps ------------------------------------------------------------------------------


def _split_tokens(tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``[B, L + 1]`` bytes -> inputs and targets, int32 ``[B, L]``."""
  tokens = tokens.astype(jnp.int32)
  return tokens[:, :-1], tokens[:, 1:]


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    schedule: optax.Schedule
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, Any]]]:
  """A pure train step for :class:`loopkit.TrainLoop` (global style: XLA partitions it).

  Returns:
    ``train_step(state, batch) -> (state, metrics)``; ``batch = {"tokens": uint8 [B, L + 1]}``.
    Metrics: ``loss`` (mean next-byte cross-entropy, nats) as :class:`loopkit.metrics.Mean`
    weighted by the token count, ``learning_rate`` and ``grad_norm`` (before clipping) as
    :class:`loopkit.metrics.Last`.
  """

  def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
    inputs, targets = _split_tokens(batch["tokens"])

    def loss_fn(params):
      logits = nnx.merge(graphdef, params)(inputs)
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loopkit.metrics.Mean.of(loss, jnp.float32(targets.size)),
               "learning_rate": loopkit.metrics.Last(schedule(state.step)),
               "grad_norm": loopkit.metrics.Last(optax.tree.norm(grads))}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def make_eval_step(graphdef: nnx.GraphDef) -> Callable[[TrainState, Batch], dict[str, jax.Array]]:
  """A pure eval step for :class:`loopkit.Evaluator`.

  Returns:
    ``eval_step(state, batch) -> {"loss": float32 [B], "accuracy": float32 [B]}``: each
    sequence's mean next-byte cross-entropy (nats) and next-byte top-1 accuracy. Every sequence
    has the same length, so the evaluator's exact mean over sequences is the mean over bytes.
  """

  def eval_step(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
    inputs, targets = _split_tokens(batch["tokens"])
    logits = nnx.merge(graphdef, state.params)(inputs)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return {"loss": jnp.mean(nll, axis=-1),
            "accuracy": jnp.mean((jnp.argmax(logits, -1) == targets).astype(jnp.float32), -1)}

  return eval_step


class PerplexityEvaluator:
  """A :class:`loopkit.Evaluator` whose results also carry ``perplexity`` and ``bits_per_byte``.

  ``perplexity = exp(loss)``, ``bits_per_byte = loss / ln 2`` of the exact mean loss over the
  held-out bytes (computed on the host from the evaluator's result). Usable wherever an
  evaluator is (:class:`loopkit.EvalHook` takes any object with this ``evaluate``).
  """

  def __init__(self, evaluator: loopkit.Evaluator):
    self.evaluator = evaluator

  def evaluate(self, state: Any, batches: Any, *,
               num_batches: int | None = None) -> evaluation.EvalResult:
    r = self.evaluator.evaluate(state, batches, num_batches=num_batches)
    metrics = dict(r.metrics)
    metrics["perplexity"] = math.exp(metrics["loss"])
    metrics["bits_per_byte"] = metrics["loss"] / math.log(2)
    return dataclasses.replace(r, metrics=metrics)

  def compile_count(self) -> int:
    return self.evaluator.compile_count()


def make_generate(graphdef: nnx.GraphDef) -> Callable[..., jax.Array]:
  """Greedy decoding: ``generate(params, buffer, start, num) -> buffer``, one compiled program.

  ``buffer`` int32 ``[max_len]`` (at most the model's ``max_len``) holds the prompt in ``[:start]``; position ``start + i``
  becomes the argmax of the model's next-byte logits after the bytes before it, for
  ``i < num`` (``start + num <= max_len``). Each new byte reruns the model over the whole
  buffer (no cache: the causal mask makes the bytes after the current one irrelevant).
  """

  @jax.jit
  def generate(params, buffer, start, num):
    model = nnx.merge(graphdef, params)

    def body(i, buf):
      logits = model(buf[None], shard_activations=False)[0]
      nxt = jnp.argmax(logits[start + i - 1]).astype(jnp.int32)
      return buf.at[start + i].set(nxt)

    return jax.lax.fori_loop(0, num, body, buffer)

  return generate


def continue_text(generate: Callable[..., jax.Array], params: Any, prompt: bytes,
                  num_bytes: int, max_len: int) -> bytes:
  """The ``num_bytes`` bytes greedy decoding appends to ``prompt`` (its last
  ``max_len - num_bytes`` bytes, if longer).

  Raises:
    ValueError: ``prompt`` empty or ``num_bytes`` not in ``[1, max_len)``.
  """
  if not prompt or not 0 < num_bytes < max_len:
    raise ValueError(f"need a prompt and 0 < num_bytes < {max_len}, got {prompt!r} and "
                     f"{num_bytes}")
  prompt = prompt[-(max_len - num_bytes):]
  buffer = np.zeros((max_len,), np.int32)
  buffer[:len(prompt)] = np.frombuffer(prompt, np.uint8)
  out = np.asarray(generate(params, jnp.asarray(buffer), len(prompt), num_bytes))
  return bytes(out[len(prompt):len(prompt) + num_bytes].astype(np.uint8).tolist())


# -- host ------------------------------------------------------------------------------------


class ThroughputHook(loopkit.Hook):
  """Steady-state training throughput: from the first call's boundary to the last, hooks'
  time (evaluation, checkpoints) excluded, so the first call's compilation is not counted.

  Attributes:
    examples_per_sec: the last measurement (None before two calls).
  """

  needs_state = False
  _NOT_HOOKS = ("total", "compile", "dispatch", "device_wait", "data_wait", "lost")

  def __init__(self):
    super().__init__()
    self.examples_per_sec: float | None = None
    self._loop: Any = None
    self._first: tuple[float, int, float] | None = None

  def _hook_secs(self) -> float:
    return sum(v for k, v in self._loop.ledger.seconds.items() if k not in self._NOT_HOOKS)

  def on_run_start(self, loop, state):
    del state
    self._loop, self._first = loop, None

  def after_each_call(self, info: loopkit.LoopInfo) -> None:
    now = time.perf_counter()
    if self._first is None:
      self._first = (now, info.examples_seen, self._hook_secs())
      return
    t0, n0, h0 = self._first
    secs = (now - t0) - (self._hook_secs() - h0)
    if secs > 0:
      self.examples_per_sec = (info.examples_seen - n0) / secs


@dataclasses.dataclass
class Setup:
  """What a run is built from (``build``): the pieces tests use alone too."""

  config: ml_collections.ConfigDict
  mesh: Mesh
  corpus: input_pipeline.Corpus
  schedule: optax.Schedule
  tx: optax.GradientTransformation
  graphdef: nnx.GraphDef
  state: TrainState
  train_batches: loopkit.data.GrainSource
  eval_batches: input_pipeline.EvalBatches
  evaluator: PerplexityEvaluator


def build(config: ml_collections.ConfigDict, mesh: Mesh | None = None) -> Setup:
  """Reads the corpus, makes the step-0 state on the mesh, the sources and the evaluator."""
  mesh = mesh if mesh is not None else make_mesh(config)
  corpus = input_pipeline.load_corpus(config.data_dir or None,
                                      heldout_every=config.heldout_every)
  schedule = learning_rate_schedule(config)
  tx = create_optimizer(config, schedule)
  graphdef, state = create_train_state(config, mesh, tx)
  train_batches = input_pipeline.train_source(
      corpus, seq_len=config.seq_len, global_batch_size=config.global_batch_size,
      seed=config.seed, worker_count=config.grain_workers)
  eval_batches = input_pipeline.EvalBatches(
      corpus, seq_len=config.seq_len, num_windows=config.eval_windows,
      global_batch_size=config.eval_batch_size)
  evaluator = PerplexityEvaluator(loopkit.Evaluator(
      make_eval_step(graphdef), iterations_per_loop=config.eval_iterations_per_loop, mesh=mesh,
      data_axis=BATCH_AXES, global_batch_size=config.eval_batch_size))
  return Setup(config=config, mesh=mesh, corpus=corpus, schedule=schedule, tx=tx,
               graphdef=graphdef, state=state, train_batches=train_batches,
               eval_batches=eval_batches, evaluator=evaluator)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       extra_hooks: Sequence[loopkit.Hook] = ()) -> dict[str, Any]:
  """Trains the LM, evaluates held-out perplexity, and continues the prompt greedily.

  Resumes from the latest checkpoint in ``workdir/checkpoints`` (state, ledger, data position);
  without one, starts from ``config.init_from``'s params if set (a warm start).
  Writes ``metrics.jsonl`` and TensorBoard files (train rows every ``log_every_steps``,
  ``eval/loss``, ``eval/perplexity``, ``eval/bits_per_byte``, ``eval/accuracy`` every
  ``eval_every_steps`` and at the end), ``goodput.json`` and ``results.json`` in ``workdir``.

  Args:
    config: the example's configuration (``configs/``).
    workdir: output directory (created if missing).
    extra_hooks: more hooks, run after the example's own.

  Returns:
    Summary dict: ``eval_perplexity``, ``eval_loss``, ``eval_bits_per_byte``,
    ``eval_accuracy``, ``eval_history`` (``[(step, perplexity)]``), ``step``, ``status``,
    ``restored_step``, ``warm_started`` (what ``config.init_from`` gave, or None),
    ``num_params``, ``tokens_per_sec`` (steady state), ``compile_count``,
    ``device_calls``, ``prompt``/``continuation`` (str), the corpus facts, paths, and
    ``state`` (the final :class:`TrainState`, not in ``results.json``).
  """
  os.makedirs(workdir, exist_ok=True)
  workdir = os.path.abspath(workdir)
  cfg = model_config(config)
  mesh = make_mesh(config)
  absl_logging.info("reading the corpus and initialising the %s-parameter model on mesh %s",
                    f"{models.param_count(cfg):,}", dict(mesh.shape))
  t0 = time.perf_counter()
  s = build(config, mesh)
  absl_logging.info(
      "corpus %s: %d training files (%s bytes), %d held-out files (%s bytes), sha256 %s; "
      "initialised in %.1f s", s.corpus.root, len(s.corpus.train_files),
      f"{len(s.corpus.train_text):,}", len(s.corpus.heldout_files),
      f"{len(s.corpus.heldout_text):,}", s.corpus.digest, time.perf_counter() - t0)

  writer = writers.create_default_writer(workdir)
  eval_hook = evaluation.EvalHook(s.evaluator, s.eval_batches,
                                  writer=writer, prefix="eval",
                                  every_steps=config.eval_every_steps or None, at_end=True)
  throughput = ThroughputHook()
  hooks: list[loopkit.Hook] = [loopkit.NanCheckHook(),
                               loopkit.LoggingHook(writer, every_steps=config.log_every_steps),
                               throughput]
  ckpt = None
  if config.checkpoint_every_steps:
    from loopkit import checkpoint  # needs orbax-checkpoint
    # config.init_from: another run's params (fresh AdamW, step 0) while the workdir has no
    # checkpoint of its own; read onto this run's mesh and shardings.
    ckpt = checkpoint.CheckpointHook(os.path.join(workdir, "checkpoints"),
                                     every_steps=config.checkpoint_every_steps,
                                     max_to_keep=config.max_checkpoints_to_keep,
                                     init_from=config.get("init_from", "") or None)
    hooks.append(ckpt)
  hooks += [eval_hook,
            progress.ProgressHook(config.num_train_steps,
                                  log_every_secs=config.progress_every_secs,
                                  logger=logging.getLogger("loopkit")),
            goodput.GoodputHook(writer, workdir=workdir, log_summary=True), *extra_hooks]
  loop = loopkit.TrainLoop(
      make_train_step(s.graphdef, s.tx, s.schedule),
      iterations_per_loop=config.iterations_per_loop, hooks=hooks, mesh=s.mesh,
      data_axis=BATCH_AXES, steps_per_epoch=s.train_batches.steps_per_epoch,
      global_batch_size=config.global_batch_size, prefetch=config.prefetch)
  t0 = time.perf_counter()
  state = loop.run(s.state, s.train_batches, num_steps=config.num_train_steps)
  train_seconds = time.perf_counter() - t0
  eval_results = list(eval_hook.results)
  if loop.status != "preempted" and (not eval_results or eval_results[-1][0] != loop.ledger.step):
    result = s.evaluator.evaluate(state, s.eval_batches)  # nothing was left to train
    eval_results.append((loop.ledger.step, result))
  continuation = b""
  if loop.status != "preempted" and config.generate_bytes:
    generate = make_generate(s.graphdef)
    continuation = continue_text(generate, state.params, config.prompt.encode(),
                                 config.generate_bytes, config.seq_len)
  writer.close()
  if ckpt is not None:
    ckpt.close()

  final_step, final = eval_results[-1] if eval_results else (None, None)
  rate = throughput.examples_per_sec
  results = {
      "eval_perplexity": None if final is None else final.metrics["perplexity"],
      "eval_loss": None if final is None else final.metrics["loss"],
      "eval_bits_per_byte": None if final is None else final.metrics["bits_per_byte"],
      "eval_accuracy": None if final is None else final.metrics["accuracy"],
      "eval_count": None if final is None else final.num_examples,
      "eval_step": final_step,
      "eval_history": [(st, r.metrics["perplexity"]) for st, r in eval_results],
      "step": int(jax.device_get(state.step)), "status": loop.status,
      "restored_step": None if ckpt is None else ckpt.restored_step,
      "warm_started": None if ckpt is None else ckpt.warm_started,
      "num_params": models.param_count(cfg), "seq_len": config.seq_len,
      "global_batch_size": config.global_batch_size,
      "iterations_per_loop": config.iterations_per_loop,
      "device_calls": loop.ledger.loop_index, "compile_count": loop.program.compile_count(),
      "eval_compile_count": s.evaluator.compile_count(),
      "mesh_shape": dict(s.mesh.shape), "num_devices": s.mesh.devices.size,
      "tokens_per_sec": None if rate is None else rate * config.seq_len,
      "train_seconds": round(train_seconds, 3),
      "prompt": config.prompt, "continuation": continuation.decode("utf-8", "replace"),
      "corpus": {"root": s.corpus.root, "train_files": len(s.corpus.train_files),
                 "heldout_files": len(s.corpus.heldout_files),
                 "train_bytes": int(len(s.corpus.train_text)),
                 "heldout_bytes": int(len(s.corpus.heldout_text)), "sha256": s.corpus.digest},
      "ledger": loop.ledger.to_dict(), "workdir": workdir,
      "results_path": os.path.join(workdir, "results.json"),
  }
  if jax.process_index() == 0:
    with open(results["results_path"], "w") as f:
      json.dump(results, f, indent=2)
  results["state"] = state
  return results


# -- evaluation beside training ---------------------------------------------------------------


def evaluate_beside(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """``config.eval_only``: evaluates each checkpoint of the training run in ``workdir`` once.

  Runs beside ``main.py`` training with the same ``--workdir`` and config: follows
  ``workdir/checkpoints`` with :class:`loopkit.tools.follower.CheckpointFollower`, restores
  each new checkpoint onto the mesh with the training state's shardings (from their logical axes,
  nothing allocated until a restore), evaluates it with the training run's evaluator and
  held-out windows, and writes the rows (``eval/loss``, ``eval/perplexity``,
  ``eval/bits_per_byte``, ``eval/accuracy``, ``eval/num_examples`` at the checkpoint's step:
  the rows EvalHook writes in the training run) to ``workdir/eval_only/metrics.jsonl`` and
  TensorBoard files there. It stops when the training run completes (``TRAIN_COMPLETE``), or
  after ``config.follow_timeout_secs`` without a new checkpoint (> 0); a rerun continues where
  it stopped (``workdir/eval_only/follow_progress.json``).

  Returns:
    ``{"status": "complete" | "timed_out", "evaluated": [(step, perplexity)],
    "skipped": [steps deleted before they were read], "rows_path": str}``.
  """
  from loopkit.tools.follower import follow  # needs orbax-checkpoint

  workdir = os.path.abspath(workdir)
  mesh = make_mesh(config)
  corpus = input_pipeline.load_corpus(config.data_dir or None,
                                      heldout_every=config.heldout_every)
  graphdef, like, _ = state_shardings(config, mesh,
                                      create_optimizer(config, learning_rate_schedule(config)))
  evaluator = PerplexityEvaluator(loopkit.Evaluator(
      make_eval_step(graphdef), iterations_per_loop=config.eval_iterations_per_loop, mesh=mesh,
      data_axis=BATCH_AXES, global_batch_size=config.eval_batch_size))
  eval_batches = input_pipeline.EvalBatches(
      corpus, seq_len=config.seq_len, num_windows=config.eval_windows,
      global_batch_size=config.eval_batch_size)
  out = os.path.join(workdir, "eval_only")
  writer = writers.create_default_writer(out)
  try:
    follower = follow(
        os.path.join(workdir, "checkpoints"), like, evaluator, eval_batches, writer=writer,
        prefix="eval", progress_file=os.path.join(out, "follow_progress.json"),
        poll_secs=config.follow_poll_secs, timeout_secs=config.follow_timeout_secs or None)
  finally:
    writer.close()
  return {"status": follower.status,
          "evaluated": [(s, r.metrics["perplexity"]) for s, r in follower.results],
          "skipped": follower.skipped_steps, "rows_path": os.path.join(out, "metrics.jsonl")}


# -- ahead-of-time compilation ---------------------------------------------------------------


def flops_lines(config: ml_collections.ConfigDict, report: Any) -> list[str]:
  """The train program's FLOPs as loopkit counts them beside the model's, by hand, per device.

  Args:
    config: the example's configuration.
    report: the :class:`loopkit.tools.aot.AotReport` of :func:`compile_only`.

  Returns:
    Report lines: the hand count (:func:`models.train_flops_per_step`, with and without
    ``remat``'s extra forward pass) per device, loopkit's count (``flops_per_step``: XLA's,
    with scanned layers' matrix FLOPs counted for every layer) and their ratio, and the compute
    bound of the hand count at the chip's peak.
  """
  cfg = model_config(config)
  devices = report.num_devices
  hand = models.train_flops_per_step(cfg, config.global_batch_size, config.seq_len) / devices
  model = models.train_flops_per_step(dataclasses.replace(cfg, remat=False),
                                      config.global_batch_size, config.seq_len) / devices
  xla = report.train.flops_per_step
  # loopkit's count: XLA's, plus the matrix FLOPs of scanned layers XLA counts once
  lines = [f"train FLOPs per step per device: loopkit {xla:.4g}; by hand {hand:.4g} (ratio "
           f"loopkit / hand {xla / hand:.3f}), of which model FLOPs (6 N T + attention, no remat) "
           f"{model:.4g}"]
  if report.chip is not None:
    peak = report.chip.peak_bf16_flops
    lines.append(f"  by hand at peak bf16: >= {hand / peak * 1e3:.4g} ms per step; a step of t ms "
                 f"runs at MFU {model / peak * 1e3:.4g} ms / t (model FLOPs)")
  return lines


def compile_only(config: ml_collections.ConfigDict, topology: str, *,
                 with_eval: bool = True, hbm_bytes: int | None = None) -> Any:
  """Compiles the run's train (and eval) program for a TPU topology; no data, no training.

  The same steps, K, shardings (the ``config.mesh_shape`` mesh over the topology's chips,
  parameters by their logical axes, the batch over ``("data", "fsdp")``) and donation as
  :func:`train_and_evaluate`, from the abstract state (:func:`state_shardings`), through
  :func:`loopkit.tools.aot.compile_for`.

  Args:
    config: the example's configuration.
    topology: a TPU topology (``"v5p:2x2x4"``, ``"v5e:4x8"``...) or ``"local"`` (this
      machine's devices).
    with_eval: also compile the evaluator's program.
    hbm_bytes: HBM per device to check against instead of the chip's.

  Returns:
    The :class:`loopkit.tools.aot.AotReport`.
  """
  from loopkit.tools import aot, topology as topology_lib

  devices = jax.devices() if topology == "local" else topology_lib.topology_devices(topology)
  mesh = make_mesh(config, devices)
  schedule = learning_rate_schedule(config)
  tx = create_optimizer(config, schedule)
  graphdef, abstract_state, _ = state_shardings(config, mesh, tx)

  def batch(b):
    return {"tokens": jax.ShapeDtypeStruct((b, config.seq_len + 1), jnp.uint8)}

  program = loopkit.core.MultiStepProgram(
      make_train_step(graphdef, tx, schedule), iterations_per_loop=config.iterations_per_loop,
      mesh=mesh, data_axis=BATCH_AXES)
  evaluator = loopkit.Evaluator(make_eval_step(graphdef),
                                iterations_per_loop=config.eval_iterations_per_loop, mesh=mesh,
                                data_axis=BATCH_AXES, global_batch_size=config.eval_batch_size,
                                prefetch=config.prefetch)
  return aot.compile_for(program, abstract_state, batch(config.global_batch_size),
                         topology=topology, mesh=mesh,
                         evaluator=evaluator if with_eval else None,
                         eval_batch=batch(config.eval_batch_size), prefetch=config.prefetch,
                         hbm_bytes=hbm_bytes)
