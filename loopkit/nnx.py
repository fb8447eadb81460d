"""Flax NNX: train and evaluate ``nnx.Module`` objects with in-place steps.

NNX steps mutate their arguments (as in Flax's ``examples/mnist``)::

    @nnx.jit
    def train_step(model, optimizer, metrics, batch, rngs):
      (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch, rngs)
      metrics.update(loss=loss, logits=logits, labels=batch["label"])
      optimizer.update(model, grads)

:class:`NnxTrainLoop` runs such a step as loopkit's pure multi-step program:
the objects are split once into a static ``graphdef`` and a state pytree
(``nnx.split``; the optimizer's ``step`` is the step counter), each step merges
them back (``nnx.merge``), calls the user's step and splits the mutated
objects again. After :meth:`NnxTrainLoop.run` the user's objects hold the
trained values (``nnx.update``). The state handed to the device is a copy of
the objects' arrays, so the donation of the state never deletes an array the
user's objects hold. If ``run`` raises, the objects take the state of the last
completed boundary (:attr:`loopkit.TrainLoop.last_state`): no work is lost,
and ``optimizer.step`` equals ``ledger.step``.

Arguments reach the step in the order of Flax's examples:
``train_step(model, optimizer, [metrics,] batch, *extra)`` (``extra``: e.g.
the ``nnx.Rngs`` of the MNIST example). The step may return None, a dict of
scalar metrics, or a scalar (logged as ``"loss"``). An ``nnx.MultiMetric``
passed as ``metrics`` is also logged per device call: each of its metrics
whose state is a ``total`` and a ``count`` (``nnx.metrics.Average``,
``Accuracy``) is reported as the exact mean over the call's steps.

:class:`NnxEvaluator` runs an NNX eval step ``eval_step(model, metrics,
batch)`` (batch means into an ``nnx.MultiMetric``) over a whole eval set with
:class:`loopkit.Evaluator`'s padding and masking: every example is evaluated
as its own batch of one (``jax.vmap``), its metric increments are summed with
padded rows masked out, and ``metrics.compute()`` then gives the exact
per-example mean. It evaluates in inference mode (the structure of
``model.eval()``, from a clone; the user's model keeps its mode) unless told
``eval_mode=False``.

Per-device style (``step_style="per_device"``): the step sees its device's
slice of the batch; it averages gradients itself (``jax.lax.pmean(grads,
data_axis)``, a tuple of axes too) and builds BatchNorm with ``axis_name=data_axis``. The
MultiMetric's increments are summed over the devices by the adapter (so every
device's copy of the state agrees), which is exact for ``total``/``count``
metrics (an ``Average`` of batch means then averages the devices' means,
exact for equal slices). ``nnx.Rngs`` keys are replicated: every device draws
the same dropout mask for its slice (fold in ``jax.lax.axis_index`` in the
step for independent masks).

One concept, the NNX adapter, in one module: the loop and the evaluator share the objects'
split into a pure state (``_pure``, ``_copy``) and the exact ``total``/``count`` sums of an
``nnx.MultiMetric`` (``_additive``).

Requires ``flax`` (``pip install loopkit[nnx]``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loopkit import metrics as metrics_lib
from loopkit._internal.extras import missing
from loopkit.core.loop import TrainLoop
from loopkit.core.run import StepCounterError
from loopkit.evaluation import EvalHook, EvalResult, Evaluator

try:
  from flax import nnx
except ImportError as e:
  raise missing(e, "loopkit.nnx") from e

__all__ = ["EvalModeWarning", "NnxEvaluator", "NnxTrainLoop"]

_NAMES = ("model", "optimizer", "metrics")

log = logging.getLogger("loopkit")


def _pure(objects: tuple) -> tuple[Any, dict]:
  """``(graphdef, state)``: the objects split, the state a dict of plain arrays."""
  graphdef, state = nnx.split(objects)
  return graphdef, nnx.to_pure_dict(state)


def _copy(tree: Any) -> Any:
  """New buffers for every array leaf (the loop donates what it is given)."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x,
                      tree)


def _additive(metrics: Any, what: str) -> dict[str, dict[str, Any]]:
  """The ``{name: {"total", "count"}}`` states of a MultiMetric's (or Metric's) parts.

  Raises:
    ValueError: a part whose state is not exactly a ``total`` and a ``count``.
  """
  state = nnx.to_pure_dict(nnx.state(metrics))
  parts = state if all(isinstance(v, dict) for v in state.values()) else {"": state}
  for name, s in parts.items():
    if set(s) != {"total", "count"}:
      raise ValueError(
          f"{what}: metric {name!r} has state {sorted(s)}; only metrics whose state is a "
          "'total' and a 'count' (nnx.metrics.Average, Accuracy) sum exactly over examples "
          "and devices")
  return parts


class EvalModeWarning(UserWarning):
  """An :class:`NnxTrainLoop` was built with its model in inference mode, as after
  ``model.eval()``: its train steps run with Dropout off and BatchNorm normalising by its
  running statistics (which it then does not update).

  A warning, not an error: training in inference mode can be meant (BatchNorm statistics
  frozen for fine-tuning, Dropout off on purpose), and Flax itself never refuses it. Silence
  it with ``warnings.filterwarnings("ignore", category=loopkit.nnx.EvalModeWarning)``.
  """


def _inference_mode(model: Any) -> list[str] | None:
  """The modules that put ``model`` in inference mode, when it looks like ``model.eval()``.

  ``model.eval()`` sets ``deterministic=True`` and ``use_running_average=True`` on every
  module that has them (``nnx.Dropout``, ``nnx.BatchNorm``, attention...). A model with at
  least one such module in inference mode and none in training mode is in that state; a mix
  (a BatchNorm built with ``use_running_average=True`` beside a Dropout in training mode) was
  built on purpose and is not reported.

  Returns:
    ``["dropout1 (Dropout.deterministic=True)", ...]``, or None.
  """
  inference, training = [], False
  for path, module in nnx.iter_modules(model):
    for attr in ("deterministic", "use_running_average"):
      value = getattr(module, attr, None)
      if not isinstance(value, bool):
        continue
      if value:
        name = "/".join(map(str, path)) or "<model>"
        inference.append(f"{name} ({type(module).__name__}.{attr}=True)")
      else:
        training = True
  return inference if inference and not training else None


def _step_counter_message(e: StepCounterError) -> str:
  """The NNX reading of a step counter that did not advance by one per step."""
  n, done = e.end_step - e.start_step, e.counter - e.start_step
  where = (f"optimizer.step is {e.counter} after device call {e.loop_index} (steps "
           f"{e.start_step + 1}..{e.end_step}, so {e.end_step} was expected)")
  fix = ("train_step must call optimizer.update(model, grads) exactly once per step "
         "(optimizer.step is the loop's step counter)")
  if done == 0:
    return f"{where}: train_step never called optimizer.update(model, grads); {fix}"
  if done > 0 and done % n == 0:
    return (f"{where}: train_step calls optimizer.update {done // n} times per step; {fix}; "
            "to accumulate gradients over microbatches, see "
            "loopkit.core.accumulation.accumulate or optax.MultiSteps")
  return f"{where}: optimizer.update advanced it by {done} over {n} steps; {fix}"


class NnxTrainLoop:
  """Trains NNX objects with an in-place step, K steps per device call.

  Example:
    >>> loop = loopkit.nnx.NnxTrainLoop(  # doctest: +SKIP
    ...     train_step, model, optimizer, metrics, extra=(rngs,), iterations_per_loop=100)
    >>> loop.run(train_ds.as_numpy_iterator(), num_steps=1000)  # doctest: +SKIP
    >>> metrics.compute()  # the objects hold the results  # doctest: +SKIP

  Args:
    train_step: ``(model, optimizer, [metrics,] batch, *extra) -> None | dict |
      scalar``, written in NNX's in-place style (``nnx.jit``-decorated or
      not). It must call ``optimizer.update(model, grads)`` exactly once.
    model: the ``nnx.Module``.
    optimizer: the ``nnx.Optimizer``; its ``step`` (uint32 scalar) is the
      loop's step counter.
    metrics: optional ``nnx.MultiMetric`` the step updates in place.
    extra: further graph objects passed after the batch (e.g. ``nnx.Rngs``).
    **loop_kwargs: :class:`loopkit.TrainLoop` arguments (``iterations_per_loop``,
      ``hooks``, ``mesh``, ``data_axis``, ``step_style``, ``steps_per_epoch``,
      ...). Hooks that take the state get the pure state (a dict
      ``{"model", "optimizer", "metrics", "extra"}`` of arrays, see
      :meth:`state`); :class:`loopkit.CheckpointHook` saves and restores it
      (typed keys of ``nnx.Rngs`` included). ``step_of`` defaults to the
      optimizer's ``step``. A model sharded over a mesh (``nnx.with_partitioning``, created
      under ``jax.set_mesh``) keeps its arrays' shardings, the optimizer's moments theirs: pass
      that ``mesh`` (``docs/sharded.md``); without it the run is refused, naming a leaf.

  Raises:
    ValueError: (at ``run``) the objects' structure changed since construction
      (e.g. ``model.eval()`` is in effect: call ``model.train()``); a
      ``per_device`` step with a metric that is not a total and a count.
    loopkit.core.StepCounterError: (at ``run``, a ValueError) ``optimizer.step``
      did not advance by one per step: the message says whether the step never
      calls ``optimizer.update`` or calls it several times per step.

  Warns:
    EvalModeWarning: the model is in inference mode, as after ``model.eval()``
      (every Dropout deterministic, every BatchNorm on running averages): call
      ``model.train()`` before building the loop.

  Attributes:
    loop: the underlying :class:`loopkit.TrainLoop`.
    graphdef: the objects' static structure the program was built for.

  Not thread-safe. Multi-host: every process runs the same loop.
  """

  def __init__(self, train_step: Callable, model: Any, optimizer: Any, metrics: Any = None,
               *, extra: Sequence[Any] = (), **loop_kwargs):
    inference = _inference_mode(model)
    if inference:
      warnings.warn(
          f"NnxTrainLoop: the model is in inference mode, as after model.eval(): "
          f"{', '.join(inference)}; its train steps would run with Dropout off and BatchNorm "
          "normalising by (and not updating) its running statistics. Call model.train() "
          "before building the NnxTrainLoop (the loop keeps the structure it was built with). "
          "To train in this mode on purpose (e.g. frozen BatchNorm statistics), silence this "
          "warning: warnings.filterwarnings('ignore', category=loopkit.nnx.EvalModeWarning)",
          EvalModeWarning, stacklevel=2)
    self.user_step = train_step
    self._default_step_of = "step_of" not in loop_kwargs
    self._has_metrics = metrics is not None
    self._names = _NAMES if self._has_metrics else _NAMES[:2]
    self._objects = (model, optimizer, *((metrics,) if self._has_metrics else ()), *extra)
    self._num_extra = len(extra)
    self.graphdef, _ = _pure(self._objects)
    style = loop_kwargs.get("step_style", "global")
    self._log_parts = {}
    if self._has_metrics:
      try:
        self._log_parts = _additive(metrics, "NnxTrainLoop")
      except ValueError:
        if style == "per_device":
          raise
    self._per_device = style == "per_device"
    loop_kwargs.setdefault("step_of", lambda s: s["optimizer"]["step"])
    self.loop = TrainLoop(self._pure_step, **loop_kwargs)
    self._axis = self.loop.program.data_axis  # checked: a name, or a tuple of names

  # -- state -----------------------------------------------------------------

  def _to_named(self, pure: dict) -> dict[str, Any]:
    n = len(self._names)
    named = {name: pure.get(i, {}) for i, name in enumerate(self._names)}
    named["extra"] = [pure.get(n + i, {}) for i in range(self._num_extra)]
    return named

  def _to_indexed(self, named: dict[str, Any]) -> dict[int, Any]:
    n = len(self._names)
    pure = {i: named[name] for i, name in enumerate(self._names)}
    pure.update({n + i: s for i, s in enumerate(named["extra"])})
    return pure

  def state(self) -> dict[str, Any]:
    """The objects' current state: ``{"model", "optimizer", "metrics", "extra"}``.

    Leaves are the objects' own arrays (not copies). Without a MultiMetric
    there is no ``"metrics"`` key; ``extra`` is a list, one entry per extra
    object (``{}`` when its variables belong to an earlier object, e.g. an
    ``nnx.Rngs`` the model holds).
    """
    graphdef, pure = _pure(self._objects)
    if graphdef != self.graphdef:
      raise ValueError(
          "the NNX objects' structure changed since the NnxTrainLoop was built (e.g. "
          "model.eval() is in effect, or a submodule or variable was added): call "
          "model.train() before run, or build a new loop for the new structure")
    return self._to_named(pure)

  def update(self, state: dict[str, Any]) -> None:
    """Writes a state (as from :meth:`state` or ``run``) into the user's objects."""
    nnx.update(self._objects, self._to_indexed(state))

  # -- traced ----------------------------------------------------------------

  def _pure_step(self, state: dict[str, Any], batch: Any) -> tuple[dict[str, Any], dict]:
    objects = nnx.merge(self.graphdef, self._to_indexed(state))
    n = len(self._names)
    out = self.user_step(*objects[:n], batch, *objects[n:])
    _, new = _pure(objects)
    new = self._to_named(new)
    logged = {}
    if self._log_parts:
      old_parts = state["metrics"] if "" not in self._log_parts else {"": state["metrics"]}
      new_parts = new["metrics"] if "" not in self._log_parts else {"": new["metrics"]}
      deltas = jax.tree.map(lambda a, b: a - b, new_parts, old_parts)
      if self._per_device:  # every device's copy must agree: sum the increments
        deltas = jax.lax.psum(deltas, self._axis)
        summed = jax.tree.map(lambda a, d: a + d, old_parts, deltas)
        new["metrics"] = summed if "" not in self._log_parts else summed[""]
      for name, d in deltas.items():
        logged[name or "metric"] = metrics_lib.Mean(jnp.asarray(d["total"], jnp.float32),
                                                    jnp.asarray(d["count"], jnp.float32))
    if out is None:
      out = {}
    elif not isinstance(out, dict):
      out = {"loss": out}
    logged.update(out)
    return new, logged

  # -- host ------------------------------------------------------------------

  def run(self, batches: Iterable, *, num_steps: int | None = None,
          num_epochs: int | None = None, skip_steps: Any = None,
          max_time: Any = None) -> dict[str, Any]:
    """Trains the objects to ``num_steps`` (or ``num_epochs``); updates them in place.

    Args:
      batches: as for :meth:`loopkit.TrainLoop.run`.
      num_steps: the global step (optimizer updates) to stop at.
      num_epochs: alternatively, the epoch count (needs ``steps_per_epoch``).
      skip_steps: data steps to pass over, as for :meth:`loopkit.TrainLoop.run`.
      max_time: a wall-clock budget for this run, as for :meth:`loopkit.TrainLoop.run`.

    Returns:
      The final state (``{"model", "optimizer", "metrics", "extra"}``), whose
      arrays the user's objects now hold.

    Raises:
      ValueError: see the class and :meth:`loopkit.TrainLoop.run`. Whatever
        ``run`` raises (also a hook's or the source's exception, a
        ``KeyboardInterrupt``), the objects then hold the state of the last
        completed boundary (:attr:`loopkit.TrainLoop.last_state`), at step
        ``ledger.step``; the latest device call is waited for first. They keep
        the values they had before ``run`` only if it raised before it took
        their state (bad arguments), or if the device call itself failed (an
        XLA runtime error: no later state is readable; logged).
    """
    state = _copy(self.state())
    before = self.loop.last_state
    try:
      state = self.loop.run(state, batches, num_steps=num_steps, num_epochs=num_epochs,
                            skip_steps=skip_steps, max_time=max_time)
    except StepCounterError as e:
      self._keep_work(before)
      if not self._default_step_of:
        raise
      raise StepCounterError(_step_counter_message(e), counter=e.counter,
                             start_step=e.start_step, end_step=e.end_step,
                             loop_index=e.loop_index) from e
    except BaseException:
      self._keep_work(before)
      raise
    self.update(state)
    return state

  def _keep_work(self, before: Any) -> None:
    """After ``run`` raised: the objects take the loop's last completed state.

    Args:
      before: ``loop.last_state`` before the run (still the same object if the
        run raised before it took the state).
    """
    kept, ledger = self.loop.last_state, self.loop.ledger
    if kept is None or kept is before or ledger is None:
      return
    try:
      jax.block_until_ready(kept)
    except Exception as e:  # pylint: disable=broad-except  # the run's own error propagates
      log.warning("NnxTrainLoop: the objects keep their values from before run: the state "
                  "at step %d is not readable (%s: %s)", ledger.step,
                  type(e).__name__, str(e).splitlines()[0] if str(e) else "")
      return
    self.update(kept)

  @property
  def ledger(self):
    """The loop's :class:`~loopkit.core.ledger.Ledger`."""
    return self.loop.ledger

  @property
  def status(self) -> str | None:
    """The last run's status (see :class:`loopkit.TrainLoop`)."""
    return self.loop.status

  @property
  def program(self):
    """The compiled :class:`~loopkit.core.program.MultiStepProgram`."""
    return self.loop.program


def _refuse_training_mode(model: Any) -> None:
  """Raises for a module that per-example evaluation in training mode gets wrong.

  Each example is evaluated as a batch of one: a BatchNorm with
  ``use_running_average=False`` normalises it by its own statistics, and a
  Dropout in training mode without ``rngs`` meets Flax's "no rngs" error in
  the eval step, which passes none.
  """
  for path, module in nnx.iter_modules(model):
    name = "/".join(map(str, path)) or "<model>"
    if getattr(module, "use_running_average", None) is False:
      why = f"{name} ({type(module).__name__}) normalises with batch statistics"
    elif (isinstance(module, nnx.Dropout) and module.deterministic is False and module.rate > 0
          and module.rngs is None):
      why = f"{name} (Dropout) is in training mode and has no rngs"
    else:
      continue
    raise ValueError(
        f"NnxEvaluator.evaluate(eval_mode=False) with the model in training mode: {why}, "
        "which evaluation one example at a time would get wrong; call model.eval() first, "
        "or evaluate with eval_mode=True (the default: a clone in inference mode, the "
        "model keeps its mode)")


class NnxEvaluator:
  """Evaluates an NNX model with an in-place eval step, exactly over all examples.

  Example:
    >>> ev = loopkit.nnx.NnxEvaluator(eval_step, model, metrics)  # doctest: +SKIP
    >>> ev.evaluate(test_ds.as_numpy_iterator())  # {"accuracy": ..., "loss": ...}  # doctest: +SKIP

  Args:
    eval_step: ``(model, metrics, batch) -> None``: updates ``metrics`` (an
      ``nnx.MultiMetric``) with batch means, as in Flax's examples. It gets the
      model in inference mode (the structure of ``model.eval()``, from a clone:
      the user's model keeps its mode) unless :meth:`evaluate` is given
      ``eval_mode=False``.
    model: the ``nnx.Module``.
    metrics: the ``nnx.MultiMetric``; after :meth:`evaluate` it holds the
      totals over the whole set (``metrics.compute()`` = the result).
    **evaluator_kwargs: :class:`loopkit.Evaluator` arguments
      (``iterations_per_loop``, ``mesh``, ``data_axis``, ``step_style``,
      ``global_batch_size``, ``prefetch``).

  Raises:
    ValueError: a metric whose state is not a ``total`` and a ``count``.

  Every example runs as a batch of one (``jax.vmap``), so the step must not
  mix examples (BatchNorm in training mode would); padding rows are masked out.
  Compiles once per model structure (inference mode, or with
  ``eval_mode=False`` the model's own). Not thread-safe.
  """

  def __init__(self, eval_step: Callable, model: Any, metrics: Any, **evaluator_kwargs):
    self.user_step = eval_step
    self.model = model
    self.metrics = metrics
    self._parts = _additive(metrics, "NnxEvaluator")
    self._zero = jax.tree.map(jnp.zeros_like, nnx.to_pure_dict(nnx.state(metrics)))
    self._graphdef = None
    self._eval_clone: Any = None
    self._evaluator: Evaluator | None = None
    self._kwargs = evaluator_kwargs

  def _per_example(self, state: Any, batch: Any) -> dict[str, jax.Array]:
    def one(example):
      model, metrics = nnx.merge(self._graphdef, {0: state, 1: self._zero})
      self.user_step(model, metrics, jax.tree.map(lambda x: x[None], example))
      inc = nnx.to_pure_dict(nnx.state(metrics))
      parts = inc if "" not in self._parts else {"": inc}
      return {f"{n}/{leaf}": jnp.asarray(v[leaf], jnp.float32)
              for n, v in parts.items() for leaf in ("total", "count")}
    return jax.vmap(one)(batch)

  def evaluate(self, batches: Iterable, *, state: Any = None, num_batches: int | None = None,
               eval_mode: bool = True) -> dict[str, Any]:
    """Evaluates the model (or ``state``, a model state) on every example once.

    Args:
      batches: iterable of batches ``[b, ...]`` (short ones are padded).
      state: the model's pure state (e.g. ``s["model"]`` of an
        :class:`NnxTrainLoop` state); default: the model object's current values.
      num_batches: see :meth:`loopkit.Evaluator.evaluate` (multi-host).
      eval_mode: True (default, as Flax's examples call ``model.eval()``
        before evaluating): inference mode, the structure of ``model.eval()``
        taken from a clone, so the user's model keeps its mode (``train()``
        or ``eval()``) and its values are what is evaluated. False: the model
        in the mode it is in (e.g. Monte Carlo dropout from a Dropout with
        its own ``rngs``).

    Returns:
      ``metrics.compute()`` of the user's MultiMetric, which now holds the
      totals over all real examples (its previous values are replaced).

    Raises:
      ValueError: with ``eval_mode=False``, a module in training mode that
        one-example-at-a-time evaluation would make wrong or fail (a
        BatchNorm using batch statistics, a Dropout without ``rngs``): the
        message names the module's path, ``model.eval()`` and
        ``eval_mode=True``.
    """
    model = self.model
    if eval_mode:
      structure = nnx.graphdef(self.model)
      if self._eval_clone is None or self._eval_clone[0] != structure:
        clone = nnx.clone(self.model)
        clone.eval()
        self._eval_clone = (structure, clone)
      model = self._eval_clone[1]
    else:
      _refuse_training_mode(self.model)
    graphdef, _ = _pure((model, self.metrics))
    if state is None:
      state = _pure((self.model, self.metrics))[1][0]
    if self._evaluator is None or graphdef != self._graphdef:
      self._graphdef = graphdef
      self._evaluator = Evaluator(self._per_example, **self._kwargs)
    self.last = self._evaluator.evaluate(state, batches, num_batches=num_batches)
    totals = self.last.totals
    new = jax.tree.map(lambda z: z, self._zero)
    parts = new if "" not in self._parts else {"": new}
    for n, v in parts.items():
      for leaf in ("total", "count"):
        v[leaf] = jnp.asarray(np.asarray(totals.get(f"{n}/{leaf}", 0.0)), v[leaf].dtype)
    nnx.update(self.metrics, new)
    return self.metrics.compute()

  __call__ = evaluate

  def compile_count(self) -> int:
    """Executables compiled for the current eval program (1 in a healthy run)."""
    return 0 if self._evaluator is None else self._evaluator.compile_count()

  def for_eval_hook(self) -> tuple[Any, Callable[[Any], Any]]:
    """How :class:`loopkit.EvalHook` runs this evaluator (:class:`loopkit.evaluation.ForEvalHook`).

    ``EvalHook(NnxEvaluator(...), batches, every_epochs=1)`` in an :class:`NnxTrainLoop`'s
    hooks evaluates, at each firing, the ``"model"`` part of the loop's state in inference
    mode (:meth:`evaluate` with ``eval_mode=True``), and records an
    :class:`~loopkit.evaluation.EvalResult` whose ``metrics`` are ``metrics.compute()``.

    Returns:
      ``(evaluator, state_fn)``: an object with ``evaluate(state, batches, *,
      num_batches=None) -> EvalResult``, and ``lambda s: s["model"]``.
    """
    return _HookForm(self), _model_part

  def hook(self, batches: Iterable | Callable[[], Iterable], *, num_batches: int | None = None,
           writer: Any = None, prefix: str = "eval", **trigger) -> EvalHook:
    """``loopkit.EvalHook(self, batches, ...)``: an eval hook for an :class:`NnxTrainLoop`.

    At each firing it evaluates the train state's model part in inference
    mode (the structure of ``model.eval()``, taken from a clone, so the
    user's model stays in training mode) and writes ``{prefix}/{metric}``.

    Args:
      batches: a re-iterable or a callable returning a fresh iterable.
      num_batches: as for :class:`loopkit.EvalHook`.
      writer: as for :class:`loopkit.EvalHook` (see :func:`loopkit.observe.as_writer`).
      prefix: as for :class:`loopkit.EvalHook`.
      **trigger: as for :class:`loopkit.EvalHook` (``every_steps``, ...).
    """
    return EvalHook(self, batches, num_batches=num_batches, writer=writer, prefix=prefix,
                    **trigger)


def _model_part(state: dict[str, Any]) -> Any:
  """The model's pure state in an :class:`NnxTrainLoop` state."""
  return state["model"]


class _HookForm:
  """An :class:`NnxEvaluator` in the form :class:`loopkit.EvalHook` calls."""

  def __init__(self, evaluator: NnxEvaluator):
    self.nnx_evaluator = evaluator

  def evaluate(self, state: Any, batches: Iterable, *,
               num_batches: int | None = None) -> EvalResult:
    ev = self.nnx_evaluator
    values = ev.evaluate(batches, state=state, num_batches=num_batches, eval_mode=True)
    last = ev.last
    return EvalResult({k: float(v) for k, v in values.items()}, last.totals,
                      last.num_examples, last.num_batches, last.num_calls)
