"""Hooks that act when an evaluation metric stops improving: early stopping, a smaller rate.

Both watch one metric of an :class:`~loopkit.EvalHook`'s evaluations (its
:attr:`~loopkit.EvalHook.results`) and fire with that hook, on its trigger (the same
:class:`~loopkit.core.triggers.Trigger` object, so they fire at exactly its boundaries). Put
them *after* their ``EvalHook`` in ``hooks`` (hooks fire in list order; one placed before it
raises at its first firing, naming the fix).

An evaluation *improves* on the best one so far when its value is lower than
``best - min_delta`` (``mode="min"``) or higher than ``best + min_delta`` (``"max"``), as in
Keras's ``EarlyStopping`` and ``ReduceLROnPlateau``; the first finite value always improves and
a NaN never does. Evaluations are exact and the same for every ``iterations_per_loop`` (K)
(:mod:`loopkit.evaluation`), so the steps these hooks act at are too.

* :class:`EarlyStopping` stops the run at the evaluation that is the ``patience``-th in a row
  without improvement (``loop.status == "early stopped"``), and can hand back the state of the
  best evaluation.
* :class:`ReduceLROnPlateau` multiplies a learning rate held in the state (an
  ``optax.inject_hyperparams`` optimizer state) by ``factor`` after ``patience`` evaluations
  without improvement; the new rate is a state leaf of the same shape and dtype, so the train
  program is not compiled again.

Multi-host: an evaluation's metrics are the same on every process (the evaluator sums over
all of them), so every process takes the same decision; a stop goes through the loop's
agreement at the next boundary like any requested stop (:mod:`loopkit.core.agreement`).
Their counters are saved with each checkpoint (``checkpoint_state``), so a preempted and
resumed run stops (or lowers its rate) at the step the uninterrupted run does. Not
thread-safe.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loopkit.core.context import RunContext
from loopkit.core.hooks import Hook, LoopInfo, drop_after

__all__ = ["EARLY_STOPPED", "EarlyStopping", "ReduceLROnPlateau"]

log = logging.getLogger("loopkit")

EARLY_STOPPED = "early stopped"
"""The status of a run stopped by :class:`EarlyStopping`."""

_END_OF_TRAINING = (EARLY_STOPPED, "completed", "data_exhausted")


class _Watch:
  """The best value of one metric so far and the evaluations since it (host numbers)."""

  def __init__(self, owner: str, eval_hook: Any, metric: str, mode: str, min_delta: float,
               patience: int):
    if mode not in ("min", "max"):
      raise ValueError(f"{owner}: mode must be 'min' or 'max', got {mode!r}")
    if isinstance(patience, bool) or not isinstance(patience, (int, np.integer)) or patience < 1:
      raise ValueError(f"{owner}: patience must be an int >= 1 (evaluations without "
                       f"improvement), got {patience!r}")
    if not (isinstance(min_delta, (int, float)) and min_delta >= 0):
      raise ValueError(f"{owner}: min_delta must be a number >= 0, got {min_delta!r}")
    if not isinstance(getattr(eval_hook, "results", None), list) or not hasattr(
        eval_hook, "trigger"):
      raise TypeError(f"{owner} watches an EvalHook's evaluations: pass the loopkit.EvalHook "
                      f"(also in the loop's hooks, before it), got {eval_hook!r}")
    self.owner, self.eval_hook, self.metric = owner, eval_hook, metric
    self.mode, self.min_delta, self.patience = mode, float(min_delta), int(patience)
    self.best: float | None = None
    self.best_step: int | None = None
    self.wait = 0
    self.last_step = -1  # the step of the last evaluation judged

  def improves(self, value: float) -> bool:
    if math.isnan(value):
      return False
    if self.best is None:
      return True
    if self.mode == "min":
      return value < self.best - self.min_delta
    return value > self.best + self.min_delta

  def new_value(self, info: LoopInfo) -> float | None:
    """The watched metric of the evaluation at ``info.end_step``; None if already judged.

    Raises:
      RuntimeError: the EvalHook has no evaluation at this step (it comes after this hook
        in ``hooks``, or is not among them).
      KeyError: the evaluation has no such metric (naming the ones it has).
    """
    results = self.eval_hook.results
    if not results or results[-1][0] != info.end_step:
      raise RuntimeError(
          f"{self.owner} fired at step {info.end_step} but its EvalHook has no evaluation "
          f"there: put the EvalHook in the loop's hooks before the {self.owner}")
    step, result = results[-1]
    if step <= self.last_step:  # a finished run run again evaluates its last step again
      return None
    if self.metric not in result.metrics:
      raise KeyError(f"{self.owner}: the evaluation at step {step} has no metric "
                     f"{self.metric!r} (it has {sorted(result.metrics)})")
    self.last_step = step
    return float(result.metrics[self.metric])

  def judge(self, value: float, step: int) -> bool:
    """Records one evaluation; True if it improved (wait back to 0), else wait + 1."""
    if self.improves(value):
      self.best, self.best_step, self.wait = value, step, 0
      return True
    self.wait += 1
    return False

  def rewound(self, step: int) -> bool:
    """Forgets every judgement when a run starts before the last evaluation judged (a fresh
    state, or a checkpoint that holds no state of this hook); True if it did."""
    if step >= self.last_step:
      return False
    self.best, self.best_step, self.wait, self.last_step = None, None, 0, -1
    return True

  def to_dict(self) -> dict[str, Any]:
    best = self.best
    return {"best": best, "best_step": self.best_step, "wait": self.wait,
            "last_step": self.last_step}

  def load(self, d: dict[str, Any]) -> None:
    self.best = None if d.get("best") is None else float(d["best"])
    self.best_step = d.get("best_step")
    self.wait = int(d.get("wait", 0))
    self.last_step = int(d.get("last_step", -1))


class EarlyStopping(Hook):
  """Stops the run when an evaluation metric has not improved for ``patience`` evaluations.

  Example:
    >>> evals = loopkit.EvalHook(evaluator, eval_batches, every_steps=100)  # doctest: +SKIP
    >>> stop = loopkit.training.EarlyStopping(evals, "loss", patience=3)    # doctest: +SKIP
    >>> loop = loopkit.TrainLoop(step, iterations_per_loop=50,              # doctest: +SKIP
    ...                          hooks=[evals, stop, ckpt])

  Fires with ``eval_hook`` (its trigger), judges its evaluation of that step and, at the
  ``patience``-th evaluation in a row that does not improve on the best, asks the run to stop
  there (``ctx.request_stop("early stopped")``): the run dispatches no further call, the
  ``at_end`` hooks that did not fire at that boundary fire (a
  :class:`~loopkit.checkpoint.CheckpointHook` saves the step), and ``loop.status == "early
  stopped"``. At the run's last boundary (its target) it does not ask: the run completes.

  Args:
    eval_hook: the :class:`~loopkit.EvalHook` whose evaluations it watches; it must be in the
      loop's ``hooks`` before this hook.
    metric: the name of a metric of those evaluations (``EvalResult.metrics``, e.g.
      ``"loss"``; not the writer's ``eval/`` prefixed name).
    mode: ``"min"`` (lower is better, a loss) or ``"max"`` (an accuracy).
    patience: evaluations in a row without improvement after which the run stops (int >= 1;
      1: at the first one that does not improve).
    min_delta: how much a value must beat the best by to count as an improvement (>= 0, in the
      metric's units).
    restore_best: at the end of training (``"early stopped"``, ``"completed"``,
      ``"data_exhausted"``; not at a preemption or a ``max_time`` stop, after which the run is
      resumed), ``on_run_end`` returns the state of the best evaluation, so ``loop.run``
      returns it (its step counter is that evaluation's step; ``loop.ledger.step`` stays where
      training stopped, as does the checkpoint saved there, which is what a later run resumes
      from). The best state is kept as a copy on the devices (one more state in device memory,
      the same shardings), taken at each improving evaluation. After a resume the copy holds
      only evaluations since it; when the best evaluation came before, the state is read from
      ``checkpoint`` at that step if it has one, else the run's own state is kept (logged).
    checkpoint: a :class:`~loopkit.checkpoint.CheckpointHook` to read the best state from
      after a resume (see ``restore_best``).
    hook_name: stable name for its saved state (default ``"EarlyStopping"``).

  Raises:
    ValueError: ``mode`` not ``"min"``/``"max"``, ``patience`` < 1, ``min_delta`` < 0.
    TypeError: ``eval_hook`` is not an EvalHook (no ``results`` list).
    RuntimeError: (when it fires) the EvalHook did not evaluate at that step: it comes after
      this hook in ``hooks``, or is not in them.
    KeyError: (when it fires) the evaluation has no metric ``metric`` (naming the ones it has).

  The properties :attr:`best`, :attr:`best_step` and :attr:`wait` read the watch.

  Attributes:
    stopped_step: the step at which it stopped the run, or None. It is saved with each
      checkpoint: a run resumed from the checkpoint of an early-stopped run stops again at
      its first boundary (training ended there); use a new hook with another ``hook_name``
      to train on. A run that starts before the last evaluation this hook judged (a fresh
      state, with no saved counters of this hook) counts afresh.
    history: ``[(step, value, improved)]`` of the evaluations judged by this object; a run
      that continues from an earlier step (a rewind, a rerun from an earlier checkpoint)
      drops those past it, so it holds each step once.

  Not thread-safe. Multi-host: every process judges the same values (module docstring).
  """

  fires_at_preemption = False  # its EvalHook's boundaries (which do not fire at a preemption)

  def __init__(self, eval_hook: Any, metric: str, *, mode: str = "min", patience: int = 1,
               min_delta: float = 0.0, restore_best: bool = False, checkpoint: Any = None,
               hook_name: str | None = None):
    super().__init__()
    self._watch = _Watch("EarlyStopping", eval_hook, metric, mode, min_delta, patience)
    self.trigger = eval_hook.trigger  # the same object: fires exactly when the EvalHook does
    self.eval_hook = eval_hook
    self.metric = metric
    self.restore_best = bool(restore_best)
    self.needs_state = self.restore_best  # the state only to copy the best one
    self.checkpoint = checkpoint
    self.hook_name = hook_name
    self.stopped_step: int | None = None
    self.history: list[tuple[int, float, bool]] = []
    self._best_state: Any = None
    self._best_state_step: int | None = None
    self._ctx: RunContext | None = None

  @property
  def best(self) -> float | None:
    """The best value so far (None before any finite one)."""
    return self._watch.best

  @property
  def best_step(self) -> int | None:
    """The step of the best evaluation (None before it)."""
    return self._watch.best_step

  @property
  def wait(self) -> int:
    """Evaluations judged since the best one."""
    return self._watch.wait

  def on_run_start(self, ctx: RunContext, state: Any) -> None:
    self._ctx = ctx
    return None

  def adjust_ledger(self, ctx: RunContext) -> None:
    """A run that continues an early-stopped one (its state restored) stops at once; a run
    that starts before the last evaluation judged (a fresh state, no saved counters of this
    hook) starts counting afresh. :attr:`history` past the step the run continues from goes
    (a rewind, a rerun from an earlier checkpoint: those evaluations are judged again)."""
    drop_after(self.history, ctx.ledger.step)
    if self._watch.rewound(ctx.ledger.step):
      self.stopped_step, self._best_state, self._best_state_step = None, None, None
    if self.stopped_step is not None and ctx.ledger.step >= self.stopped_step:
      log.info("early stopping: this run continues from step %d, where training stopped "
               "early (at step %d): it stops there", ctx.ledger.step, self.stopped_step)
      ctx.request_stop(EARLY_STOPPED)
    return None

  def on_trigger(self, info: LoopInfo, state: Any) -> None:
    value = self._watch.new_value(info)
    if value is None:
      return None
    step = info.end_step
    improved = self._watch.judge(value, step)
    self.history.append((step, value, improved))
    if improved and self.restore_best:
      self._best_state = jax.tree.map(jnp.copy, state)
      self._best_state_step = step
    ctx = self._ctx
    if (self._watch.wait >= self._watch.patience and self.stopped_step is None
        and ctx is not None and step < ctx.target_step):
      self.stopped_step = step
      log.info("early stopping at step %d: %s=%.6g has not improved on %.6g (step %s) for %d "
               "evaluation(s)", step, self.metric, value,
               float("nan") if self._watch.best is None else self._watch.best,
               self._watch.best_step, self._watch.wait)
      ctx.request_stop(EARLY_STOPPED)
    return None

  def on_run_end(self, ctx: RunContext, state: Any) -> Any:
    """With ``restore_best``, at the end of training: the best evaluation's state (or None)."""
    best_step = self._watch.best_step
    if (not self.restore_best or ctx.status not in _END_OF_TRAINING or best_step is None
        or best_step == ctx.ledger.step):
      return None
    if self._best_state_step == best_step:
      log.info("early stopping: returning the state of step %d (the best %s, %.6g)",
               best_step, self.metric, self._watch.best)
      return self._best_state
    ckpt = self.checkpoint
    if ckpt is not None and best_step in ckpt.all_steps():
      log.info("early stopping: returning the state of step %d (the best %s), read from %s",
               best_step, self.metric, ckpt.directory)
      return ckpt.restore(state, step=best_step).state
    log.warning("early stopping: the best %s was at step %d, before this run resumed, and no "
                "checkpoint of that step was given (checkpoint=): returning the state of step "
                "%d", self.metric, best_step, ctx.ledger.step)
    return None

  def checkpoint_state(self) -> dict[str, Any]:
    return {**self._watch.to_dict(), "stopped_step": self.stopped_step}

  def restore_checkpoint_state(self, d: dict[str, Any]) -> None:
    self._watch.load(d)
    self.stopped_step = d.get("stopped_step")
    self._best_state = None
    self._best_state_step = None


def _hyperparams(x: Any) -> dict[str, Any] | None:
  """The ``hyperparams`` of an ``optax.inject_hyperparams`` state, or None for any other node:
  the state itself (a NamedTuple with a ``hyperparams`` dict), or its pure-dict form (an
  ``NnxTrainLoop`` state: ``{"count", "hyperparams", ...}``; an ``inner_state`` without
  arrays, as plain SGD's, is left out of it)."""
  if isinstance(x, tuple) and hasattr(x, "_replace"):
    found = getattr(x, "hyperparams", None)
    return found if isinstance(found, dict) else None
  if isinstance(x, dict) and "count" in x and isinstance(x.get("hyperparams"), dict):
    return x["hyperparams"]
  return None


def _is_inject_state(x: Any) -> bool:
  return _hyperparams(x) is not None


class ReduceLROnPlateau(Hook):
  """Lowers a learning rate held in the state when an evaluation metric stops improving.

  The rate lives in the state, in an ``optax.inject_hyperparams`` optimizer state
  (``tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)``; also inside an
  ``nnx.Optimizer`` of an :class:`~loopkit.nnx.NnxTrainLoop`): it is a float32 leaf
  ``opt_state.hyperparams["learning_rate"]`` that the compiled step reads, is saved with the
  state in every checkpoint, and is the same after a resume. After the ``patience``-th
  evaluation in a row that does not improve, this hook returns the state with that leaf
  multiplied by ``factor`` (not below ``min_lr``); the loop places it like any state a hook
  returns, with the same shape, dtype and sharding, so the train program is not compiled again.
  Then ``cooldown`` evaluations pass before it counts again (Keras's ``ReduceLROnPlateau``).

  Args:
    eval_hook: the :class:`~loopkit.EvalHook` whose evaluations it watches (before this hook
      in ``hooks``).
    metric: the name of a metric of those evaluations.
    mode: ``"min"`` or ``"max"``.
    factor: the rate is multiplied by this (0 < factor < 1).
    patience: evaluations in a row without improvement before the rate is lowered (>= 1).
    min_delta: the margin an improvement must beat the best by (>= 0).
    cooldown: evaluations after a reduction during which none counts (>= 0).
    min_lr: the rate is not lowered below this.
    hyperparam: the name of the hyperparameter in ``hyperparams`` (default
      ``"learning_rate"``).
    hook_name: stable name for its saved state.

  Raises:
    ValueError: bad ``mode``, ``patience``, ``min_delta``, ``factor`` or ``cooldown``; at
      ``run`` start, a state without exactly one ``inject_hyperparams`` state holding
      ``hyperparam`` (naming what it found).

  Attributes:
    reductions: ``[(step, old_lr, new_lr)]`` made by this object; a run that continues from
      an earlier step (a rewind, a rerun from an earlier checkpoint) drops those past it.

  Not thread-safe. Multi-host: every process takes the same decision (module docstring).
  """

  fires_at_preemption = False

  def __init__(self, eval_hook: Any, metric: str, *, mode: str = "min", factor: float = 0.1,
               patience: int = 1, min_delta: float = 0.0, cooldown: int = 0,
               min_lr: float = 0.0, hyperparam: str = "learning_rate",
               hook_name: str | None = None):
    super().__init__()
    self._watch = _Watch("ReduceLROnPlateau", eval_hook, metric, mode, min_delta, patience)
    if not (isinstance(factor, (int, float)) and 0 < factor < 1):
      raise ValueError(f"ReduceLROnPlateau: factor must be in (0, 1), got {factor!r}")
    if isinstance(cooldown, bool) or not isinstance(cooldown, int) or cooldown < 0:
      raise ValueError(f"ReduceLROnPlateau: cooldown must be an int >= 0, got {cooldown!r}")
    self.trigger = eval_hook.trigger
    self.eval_hook = eval_hook
    self.metric = metric
    self.factor, self.cooldown, self.min_lr = float(factor), cooldown, float(min_lr)
    self.hyperparam = hyperparam
    self.hook_name = hook_name
    self.cooldown_left = 0
    self.reductions: list[tuple[int, float, float]] = []

  def _lr_nodes(self, state: Any) -> list[dict[str, Any]]:
    """The ``hyperparams`` dicts in ``state`` that hold :attr:`hyperparam`."""
    found = [_hyperparams(x) for x in jax.tree.leaves(state, is_leaf=_is_inject_state)]
    return [h for h in found if h is not None and self.hyperparam in h]

  def on_run_start(self, ctx: RunContext, state: Any) -> None:
    """Checks that the state holds the rate (one ``inject_hyperparams`` state with it)."""
    nodes = self._lr_nodes(state)
    if len(nodes) != 1:
      raise ValueError(
          f"ReduceLROnPlateau needs the learning rate in the state: exactly one "
          f"optax.inject_hyperparams optimizer state with hyperparams[{self.hyperparam!r}] "
          f"(tx = optax.inject_hyperparams(optax.adam)(learning_rate=...)); the state has "
          f"{len(nodes)}")
    return None

  def adjust_ledger(self, ctx: RunContext) -> None:
    """A run that starts before the last evaluation judged (a fresh state, no saved counters
    of this hook) starts counting afresh; :attr:`reductions` past the step the run continues
    from go (a rewind, a rerun from an earlier checkpoint)."""
    drop_after(self.reductions, ctx.ledger.step)
    if self._watch.rewound(ctx.ledger.step):
      self.cooldown_left = 0
    return None

  def on_trigger(self, info: LoopInfo, state: Any) -> Any:
    value = self._watch.new_value(info)
    if value is None:
      return None
    w = self._watch
    if self.cooldown_left > 0:
      self.cooldown_left -= 1
      w.wait = 0
    if w.improves(value):
      w.best, w.best_step, w.wait = value, info.end_step, 0
      return None
    if self.cooldown_left > 0:
      return None
    w.wait += 1
    if w.wait < w.patience:
      return None
    leaf = self._lr_nodes(state)[0][self.hyperparam]
    old = np.asarray(jax.device_get(leaf))
    new = np.maximum(old * np.asarray(self.factor, old.dtype),
                     np.asarray(self.min_lr, old.dtype)).astype(old.dtype)
    w.wait = 0
    if not new < old:
      return None
    self.cooldown_left = self.cooldown
    self.reductions.append((info.end_step, float(old), float(new)))
    log.info("step %d: %s=%.6g has not improved on %.6g for %d evaluation(s): %s %.6g -> "
             "%.6g", info.end_step, self.metric, value, w.best, w.patience, self.hyperparam,
             float(old), float(new))
    name = self.hyperparam

    def lowered(x: Any) -> Any:
      hyperparams = _hyperparams(x)
      if hyperparams is None or name not in hyperparams:
        return x
      if isinstance(x, dict):
        return {**x, "hyperparams": {**hyperparams, name: new}}
      return x._replace(hyperparams={**hyperparams, name: new})
    return jax.tree.map(lowered, state, is_leaf=_is_inject_state)

  def checkpoint_state(self) -> dict[str, Any]:
    return {**self._watch.to_dict(), "cooldown_left": self.cooldown_left}

  def restore_checkpoint_state(self, d: dict[str, Any]) -> None:
    self._watch.load(d)
    self.cooldown_left = int(d.get("cooldown_left", 0))
