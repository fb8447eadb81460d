"""TrainLoop: K train steps per device call, host accounting and hooks at boundaries.

The loop owns the ledger, the planner, the compiled program and the hooks; it
does no array math. Per device call it dispatches the program, advances the
ledger, and (one call late, unless a hook needs the state now) fetches the
call's reduced metrics and ``[K]`` traces with one ``jax.device_get``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from loopkit import metrics as metrics_lib
from loopkit.boundary import agree
from loopkit.feeding import ChunkFeeder, open_source, warn_if_pmap_layout
from loopkit.hooks import Hook, LoopInfo
from loopkit.ledger import Ledger
from loopkit.logs import install_default_handler
from loopkit.planner import TimeBasedK, parse_duration, plan_calls
from loopkit.preemption import DEFAULT_SIGNALS, PreemptionWatcher
from loopkit.program import (
  MultiStepProgram,
  StepStyle,
  check_global_batch_size,
  check_iterations_per_loop,
  default_step_of,
  is_cpu_mesh,
  resolve_mesh,
  tree_mismatch,
)
from loopkit.sources import steps_per_epoch_of

log = logging.getLogger("loopkit")

GPU_WHILE_FLAG = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"


def _warn_gpu_while_dispatch(mesh: Mesh) -> None:
  """On GPU, says once how to keep dispatch asynchronous.

  The program's loop has a traced trip count; without XLA command buffers for
  while loops, the GPU runtime evaluates its condition on the host, so a
  dispatch returns only when the call has finished (measured on an H200: 2.96 s
  of a 3.24 s run spent in dispatch, 0.08 s with the flag). The prefetch
  thread still hides input work; the flag restores host/device overlap.
  """
  platforms = {d.platform for d in mesh.devices.flat}
  if "gpu" in platforms or "cuda" in platforms or "rocm" in platforms:
    if "+WHILE" not in os.environ.get("XLA_FLAGS", ""):
      log.warning("loopkit on GPU: set XLA_FLAGS=%s before JAX starts so device calls "
                  "dispatch asynchronously (see docs/tuning.md)", GPU_WHILE_FLAG)


def _warn_logging_after_checkpoint(hooks: Sequence[Hook]) -> None:
  """Warns when a LoggingHook comes after a checkpoint hook in ``hooks``.

  Hooks fire in list order; a checkpoint saves every hook's ``checkpoint_state``
  when it runs. A LoggingHook after it, firing at the same boundary, is saved
  with the running average *before* its row, so a resumed run's first row would
  average again steps that the row already covered.
  """
  seen_checkpoint = None
  for h in hooks:
    if getattr(h, "time_bucket", None) == "checkpoint" and seen_checkpoint is None:
      seen_checkpoint = h
    elif seen_checkpoint is not None and type(h).__name__ == "LoggingHook":
      warnings.warn(
          f"hooks: LoggingHook comes after {type(seen_checkpoint).__name__}; at a step where "
          "both fire, the checkpoint would hold the running average before the row is "
          "written and a resumed run would average those steps again: put the LoggingHook "
          "before the checkpoint hook", UserWarning, stacklevel=3)
      return


def _fetch(tree: Any, copy_async: bool) -> Any:
  """``jax.device_get`` of a pytree of fully addressable ``jax.Array``, cheaper on CPU.

  Args:
    tree: pytree of ``jax.Array``.
    copy_async: start every leaf's host copy before reading any (what
      ``jax.device_get`` does: it overlaps the transfers on accelerators, but
      costs about 10-30 us per leaf on CPU devices, whose buffers the host
      reads directly).

  Returns:
    The same pytree with numpy arrays that own their memory (host copies).
  """
  leaves, treedef = jax.tree.flatten(tree)
  if copy_async:
    for x in leaves:
      x.copy_to_host_async()
  # np.array, not np.asarray: on CPU devices asarray is a view that keeps the
  # device buffer alive for as long as a hook keeps the value (case C37).
  return jax.tree.unflatten(treedef, [np.array(x) for x in leaves])


class DataExhaustedWarning(UserWarning):
  """The batch iterator ran out before ``num_steps``; the run stopped at the last full step."""


@dataclasses.dataclass
class _Pending:
  start: int
  end: int
  loop_index: int
  epoch: int
  step_in_epoch: int
  examples_seen: int
  out: Any
  firing: list[Hook]
  is_last: bool
  position: Any


class TrainLoop:
  """Runs ``iterations_per_loop`` train steps per device call.

  Example:
    >>> loop = loopkit.TrainLoop(train_step, iterations_per_loop=100)  # doctest: +SKIP
    >>> state = loop.run(state, batches, num_steps=1000)                # doctest: +SKIP

  Args:
    train_step: ``(state, batch) -> (state, metrics)``, pure. ``state`` is a
      pytree with a scalar int step counter (``state.step`` / ``state["step"]``,
      or ``step_of``) that the step increments by one; ``metrics`` is a dict of
      scalar arrays or :mod:`loopkit.metrics` values.
    iterations_per_loop: K, the most steps per device call (int >= 1); or a
      duration ``"30s"`` / ``"5m"`` / ``"1h"`` (TPUEstimator's form) or a
      :class:`~loopkit.planner.TimeBasedK`: steps per call are then chosen to
      take about that long, from the measured step time, with one compiled
      program of ``max_iterations_per_loop`` slots.
    max_iterations_per_loop: slot count for a duration ``iterations_per_loop``
      (default 100; calls shorter than it transfer padding batches).
    hooks: :class:`loopkit.hooks.Hook` objects, called in order at boundaries.
    mesh: device mesh (default: 1-D mesh ``("data",)`` over all devices).
    data_axis: name of the mesh axis the batch is split over.
    step_style: ``"global"`` (the step sees global arrays) or ``"per_device"``
      (pmap style: the step sees its device's slice and uses collectives over
      ``data_axis``).
    steps_per_epoch: steps in one epoch; calls never cross an epoch end.
      ``"auto"``: the length of the source given to each ``run`` (one epoch;
      :func:`loopkit.sources.steps_per_epoch_of`: ``len``, tf.data
      cardinality, ``ArraySource.steps_per_epoch``).
    global_batch_size: if given, checked now against the data-parallel size.
    prefetch: chunks prepared ahead by a background thread (0 = none).
    step_of: returns the state's step counter (default ``state.step``).
    preemption_signals: signals that stop the run at the next boundary with
      ``status == "preempted"`` (default SIGTERM, SIGINT; ``()`` for none); see
      :mod:`loopkit.preemption`. Caught only while ``run`` runs, in the main thread.
    canonical_convs: relay out the step's convolution gradients for XLA:CPU's
      fast kernels inside the loop body (:mod:`loopkit.conv_layout`); None
      (default) = on when the mesh is on CPU devices.

  Raises:
    ValueError: K < 1 or not an int or duration; a duration K on several
      processes; ``max_iterations_per_loop`` with an int K;
      ``global_batch_size`` not divisible by the data-parallel size;
      ``steps_per_epoch`` < 1; a hook's ``every_epochs`` that is not a
      whole number of steps (or, at ``run``, without ``steps_per_epoch``).

  Attributes:
    ledger: the :class:`~loopkit.ledger.Ledger` (after ``run`` starts).
    status: ``"completed"``, ``"data_exhausted"``, ``"preempted"`` or ``"stopped"``
      (or the reason given to :meth:`request_stop`) after ``run``.
    preemption: the run's :class:`~loopkit.preemption.PreemptionWatcher`
      (``loop.preemption.request()`` preempts as a signal would, also before
      ``run``); after ``run`` it still tells what stopped the run
      (``signal_received``), and the next ``run`` starts with a fresh one.
    program: the :class:`~loopkit.program.MultiStepProgram`.
    iterations_per_loop: the compiled slot count K (the cap, for time-based K).
    time_based_k: the :class:`~loopkit.planner.TimeBasedK`, or None.
    target_step: the global step the current ``run`` ends at.
    data_position: source position after the last consumed chunk.

  Not thread-safe. Multi-host: every process runs the same loop.
  """

  def __init__(self, train_step: Callable, *, iterations_per_loop: int | str | TimeBasedK,
               max_iterations_per_loop: int | None = None,
               hooks: Sequence[Hook] = (), mesh: Mesh | None = None,
               data_axis: str = "data", step_style: StepStyle = "global",
               steps_per_epoch: int | str | None = None, global_batch_size: int | None = None,
               prefetch: int = 2, step_of: Callable[[Any], Any] = default_step_of,
               preemption_signals: Sequence[int] = DEFAULT_SIGNALS,
               canonical_convs: bool | None = None):
    self.time_based_k: TimeBasedK | None = None
    if isinstance(iterations_per_loop, str):
      iterations_per_loop = TimeBasedK(
          parse_duration(iterations_per_loop),
          max_iterations_per_loop=100 if max_iterations_per_loop is None
          else max_iterations_per_loop)
    elif max_iterations_per_loop is not None:
      raise ValueError("max_iterations_per_loop is only for a duration iterations_per_loop "
                       f"such as '30s', got iterations_per_loop={iterations_per_loop!r}")
    if isinstance(iterations_per_loop, TimeBasedK):
      if jax.process_count() > 1:  # a host-local decision the boundary agreement cannot carry
        raise ValueError(
            f"iterations_per_loop={iterations_per_loop!r} chooses call lengths from this "
            f"process's clock, ahead of time (the feeder plans prefetched calls), so "
            f"{jax.process_count()} processes would run calls of different lengths and "
            "their collectives would not match: pass an int K on several processes (measure "
            "one with `python -m loopkit.tune` on one process)")
      self.time_based_k = iterations_per_loop
      iterations_per_loop = iterations_per_loop.max_iterations_per_loop
    iterations_per_loop = check_iterations_per_loop(iterations_per_loop)
    self._auto_steps_per_epoch = steps_per_epoch == "auto"  # from the source, at each run
    if self._auto_steps_per_epoch:
      steps_per_epoch = None
    elif steps_per_epoch is not None and steps_per_epoch < 1:
      raise ValueError(f"steps_per_epoch must be >= 1 or 'auto', got {steps_per_epoch!r}")
    self.mesh, self.data_parallel_size = resolve_mesh(mesh, data_axis)
    if global_batch_size is not None:
      check_global_batch_size(global_batch_size, self.data_parallel_size)
    self.iterations_per_loop = iterations_per_loop
    self.hooks = list(hooks)
    for h in self.hooks:
      missing = [a for a in ("trigger", "needs_state", "on_run_start", "observe", "after_call",
                             "on_run_end") if not hasattr(h, a)]
      if missing:
        raise TypeError(f"hook {h!r} lacks {', '.join(missing)}: subclass loopkit.Hook "
                        "(or wrap a function in loopkit.CallbackHook)")
    _warn_logging_after_checkpoint(self.hooks)
    self.steps_per_epoch = steps_per_epoch
    if steps_per_epoch is not None:
      self._check_triggers()
    self.prefetch = prefetch
    self.step_of = step_of
    self.program = MultiStepProgram(train_step, iterations_per_loop=iterations_per_loop,
                                    mesh=self.mesh, data_axis=data_axis, style=step_style,
                                    step_of=step_of, canonical_convs=canonical_convs)
    install_default_handler()  # a plain script shows loopkit's lines (loopkit.logs)
    _warn_gpu_while_dispatch(self.mesh)
    self.ledger: Ledger | None = None
    self.status: str | None = None
    self.data_position: Any = None
    self._stop_reason: str | None = None
    self.preemption_signals = tuple(preemption_signals)
    self.preemption = PreemptionWatcher(self.preemption_signals)
    self._preemption_used = False
    self._global_batch_size = global_batch_size
    self.target_step: int | None = None
    self._t_mark = 0.0
    self._replicas_checked_at: int | None = None  # step of the last replica check

  # -- public ----------------------------------------------------------------

  def request_stop(self, reason: str = "stopped") -> None:
    """Asks the loop to stop at the next boundary (callable from hooks)."""
    self._stop_reason = reason

  def run(self, state: Any, batches: Iterable, *, num_steps: int | None = None,
          num_epochs: int | None = None) -> Any:
    """Trains until global step ``num_steps`` (or ``num_epochs * steps_per_epoch``).

    Args:
      state: the train state pytree (donated to the device calls).
      batches: iterable of batches, pytrees of numpy arrays ``[B, ...]`` (the
        process-local part on multi-host), at least as many as steps to run.
      num_steps: the global step to stop at (absolute, like TPUEstimator's
        ``max_steps``: a state restored at step 10 asked for 15 runs 5 steps).
      num_epochs: alternatively, the epoch count to stop at (needs
        ``steps_per_epoch``).

    Returns:
      The final state, whose step equals ``self.ledger.step``.

    Raises:
      ValueError: bad arguments, batch shape/dtype changes (naming the leaf),
        a step that changes the state's structure/shape/dtype, a step counter
        that does not advance by one per step.

    Warns:
      DataExhaustedWarning: ``batches`` ran out; the run stops after the last
      full step, hooks see only steps that ran, ``status == "data_exhausted"``.
    """
    if self._auto_steps_per_epoch:
      self.steps_per_epoch = steps_per_epoch_of(batches)
    target = self._target(num_steps, num_epochs)
    self.target_step = target
    self._num_epochs = num_epochs
    self._t_mark = time.perf_counter()
    if self.time_based_k is not None:
      self.time_based_k.start()
    self._state_spec = None
    self._replicas_checked_at = None
    if self._preemption_used:  # a request made since the last run (or before the first) counts
      self.preemption = PreemptionWatcher(self.preemption_signals)
      self._preemption_used = False
    state = self._admit(state, None)
    counter = self.step_of(state)
    if np.shape(counter) != () or not np.issubdtype(counter.dtype, np.integer):
      replicated = np.ndim(counter) == 1 and np.shape(counter)[0] in (
          self.data_parallel_size, jax.local_device_count())
      raise ValueError(f"the state's step counter must be a scalar integer array, got shape "
                       f"{np.shape(counter)} dtype {counter.dtype}" + (
                           "; this looks like a state replicated for pmap (flax.jax_utils."
                           "replicate): pass the unreplicated state (jax_utils.unreplicate, "
                           "or jax.tree.map(lambda x: x[0], state)), loopkit replicates it "
                           "itself" if replicated else ""))
    step0 = int(jax.device_get(counter))
    if step0 >= target:
      log.warning("nothing to run: the state is at step %d and num_steps is %d", step0, target)
    if self.ledger is None or self.ledger.step != step0:
      self.ledger = Ledger(step=step0, steps_per_epoch=self.steps_per_epoch)
    self.ledger.steps_per_epoch = self.steps_per_epoch
    self.status = None
    self._stop_reason = None
    self.data_position = None
    for h in self.hooks:
      with self._timed(h):
        new = h.on_run_start(self, state)
      if new is not None:  # e.g. a checkpoint hook restored the state
        state = self._admit(new, h)
        restored_step = int(jax.device_get(self.step_of(state)))
        if self.ledger.step != restored_step:
          raise ValueError(
              f"{type(h).__name__} restored a state at step {restored_step} but left the "
              f"ledger at step {self.ledger.step}")
        step0 = restored_step
    self._check_triggers()
    for h in self.hooks:
      h.trigger.start_clock()
    source, start_position = open_source(batches, self.data_position, step0)
    if self.data_position is None:  # the position of a boundary before any call
      get_state = getattr(source, "get_state", None)
      self.data_position = get_state() if callable(get_state) else start_position
    plan = plan_calls(step0, iterations_per_loop=self.time_based_k or self.iterations_per_loop,
                      num_steps=target,
                      steps_per_epoch=self.steps_per_epoch,
                      triggers=[h.trigger for h in self.hooks])
    # A preemption abandons the chunk being formed (feeding.py): the loop then
    # stops at this boundary after the same agreement as any other.
    feeder = ChunkFeeder(source, plan, iterations_per_loop=self.iterations_per_loop,
                         batch_sharding=self.program.batch_sharding,
                         replicated=self.program.replicated,
                         data_parallel_size=self.data_parallel_size, prefetch=self.prefetch,
                         start_position=start_position, first_step=step0,
                         interrupt=self.preemption.event)
    pending: _Pending | None = None  # the last dispatched call, not yet finished
    last: tuple[LoopInfo, set[int]] | None = None
    self._copy_async = not is_cpu_mesh(self.mesh)  # see _fetch
    returning = False  # False while an exception propagates: close without waiting
    checked_layout = False
    try:
      self.preemption.install()
      while True:
        if self._stop_reason is not None and jax.process_count() == 1:
          break  # a hook asked to stop: no need to form (or wait for) another chunk
        t0 = time.perf_counter()
        chunk = feeder.next()
        self.ledger.add_time("data_wait", time.perf_counter() - t0)
        if chunk is None or (chunk.length == 0 and not chunk.interrupted):
          if chunk is not None:
            self._warn_exhausted(target)
          break
        if not checked_layout and not chunk.interrupted:
          checked_layout = True
          warn_if_pmap_layout(chunk.batches, self.data_parallel_size)
        if self._global_batch_size is None and not chunk.interrupted:
          self._global_batch_size = chunk.global_batch_size
          if self.ledger.examples_seen == 0:
            self.ledger.examples_seen = self.ledger.step * chunk.global_batch_size
        stop, time_due = self._agree()  # one agreement per call, all processes alike
        if stop is not None:  # stop before dispatching: at_end hooks fire
          self._stop_reason = stop  # with this boundary's state (_fire_at_end)
          break
        if chunk.interrupted:  # only when this process's flag is set, so the stop is agreed
          raise RuntimeError("loopkit: a chunk was abandoned without a preemption")
        start = self.ledger.step
        t0 = time.perf_counter()
        first_call = self.program.compile_count() == 0
        state, out = self.program(state, chunk.batches, chunk.num_steps)
        self.ledger.add_time("compile" if first_call else "dispatch", time.perf_counter() - t0)
        self.ledger.advance(chunk.length, chunk.global_batch_size)
        end = self.ledger.step
        if first_call:
          self._check_replicas(state, f"after the first device call (steps {start + 1}..{end})")
        is_last = end >= target or chunk.exhausted
        if pending is not None:  # one call late: the next call is already dispatched
          last, _ = self._finish(pending, None)
        epoch, in_epoch = self._epoch_of(end)
        pending = _Pending(start, end, self.ledger.loop_index - 1, epoch, in_epoch,
                           self.ledger.examples_seen, out,
                           self._firing(start, end, is_last, time_due), is_last, chunk.position)
        if any(h.needs_state for h in pending.firing):  # before the next call donates it
          last, state = self._finish(pending, state)
          pending = None
        if chunk.exhausted:
          self._warn_exhausted(target)
          break
        if is_last:
          break
      if pending is not None:  # the run's last boundary
        last, state = self._finish(pending, state)
      if self._stop_reason is not None:
        self.status = self._stop_reason
      elif self.status is None:
        if self.ledger.step < target:  # invariant: "completed" means the target was reached
          raise RuntimeError(
              f"loopkit: the run ended at step {self.ledger.step} without reaching its target "
              f"step {target} and without a stop, preemption or end of data; this is a bug, "
              "please report it with the TrainLoop arguments")
        self.status = "completed"
      state = self._fire_at_end(last, state)
      for h in self.hooks:
        with self._timed(h):
          new = h.on_run_end(self, state)
        if new is not None:
          state = self._admit(new, h)
      returning = True
    except BaseException as error:  # invariant 5: no save left in flight (Hook.on_run_error)
      for h in self.hooks:
        try:
          getattr(h, "on_run_error", lambda loop, e: None)(self, error)
        except Exception:  # pylint: disable=broad-except  # the run's own error propagates
          log.exception("%s.on_run_error failed", type(h).__name__)
      raise
    finally:
      self.preemption.uninstall()
      self._preemption_used = True  # kept for reading (signal_received); the next run renews it
      feeder.close(wait_secs=None if returning else 0.0)
      self._tick_total()
    return state

  # -- internals -------------------------------------------------------------

  def _tick_total(self) -> None:
    """Adds the wall time since the last tick to ``seconds["total"]`` (kept current
    at every boundary, so a checkpoint saved by a hook includes it)."""
    now = time.perf_counter()
    self.ledger.add_time("total", now - self._t_mark)
    self._t_mark = now

  @contextlib.contextmanager
  def _timed(self, hook: Hook):
    """Adds the hook's time to its ledger bucket (``hook.time_bucket``, default
    ``"hooks"``; e.g. ``"checkpoint"``, ``"eval"``) for the goodput summary."""
    t0 = time.perf_counter()
    try:
      yield
    finally:
      self.ledger.add_time(getattr(hook, "time_bucket", "hooks"), time.perf_counter() - t0)

  def _target(self, num_steps: int | None, num_epochs: int | None) -> int:
    if (num_steps is None) == (num_epochs is None):
      raise ValueError("pass exactly one of num_steps or num_epochs")
    name, value = ("num_epochs", num_epochs) if num_epochs is not None else ("num_steps", num_steps)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
      raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if num_epochs is not None:
      if self.steps_per_epoch is None:
        raise ValueError("num_epochs needs steps_per_epoch")
      return int(num_epochs) * self.steps_per_epoch
    return int(num_steps)

  def _warn_exhausted(self, target: int) -> None:
    self.status = "data_exhausted"
    asked = (f"num_epochs={self._num_epochs} (x steps_per_epoch={self.steps_per_epoch} = "
             f"{target} steps)" if self._num_epochs is not None else f"num_steps={target}")
    warnings.warn(
        f"the batch iterator ran out at step {self.ledger.step} before {asked}; stopping after "
        "the last full step. The batches are read once, as one stream: for more epochs repeat "
        "them (itertools.chain.from_iterable(itertools.repeat(batches, n)), tf.data's "
        ".repeat(), or loopkit.ArraySource)", DataExhaustedWarning, stacklevel=3)

  def _check_triggers(self) -> None:
    """Every hook's marks are whole steps for this loop's ``steps_per_epoch`` (case C31).

    Raises:
      ValueError: naming the hook, ``every_epochs`` and ``steps_per_epoch``.
    """
    for h in self.hooks:
      try:
        h.trigger.epoch_period(self.steps_per_epoch)
      except ValueError as e:
        raise ValueError(f"{type(h).__name__}: {e}") from None

  def _epoch_of(self, end: int) -> tuple[int, int]:
    """(0-based epoch, steps done in it) of the call that ends at global step ``end``."""
    if not self.steps_per_epoch:
      return 0, end
    epoch = max(end - 1, 0) // self.steps_per_epoch
    return epoch, end - epoch * self.steps_per_epoch

  def _agree(self) -> tuple[str | None, dict[int, bool]]:
    """Takes every host-local decision of one boundary, agreed across processes.

    Called once before each dispatch. This process's preemption flag, a stop
    requested by a hook, and each ``every_secs`` trigger's clock go into one
    :func:`loopkit.boundary.agree`, so every process stops at the same boundary
    and fires the same hooks. A time mark read here counts for the call about
    to be dispatched: an ``every_secs`` hook fires at the end of the first call
    that starts at least ``every_secs`` after its last firing.

    Returns:
      ``(stop, time_due)``: the stop reason (``"preempted"``, the requested
      one, or ``"stopped"`` when another process requested a stop) or None to
      go on; and ``{id(hook): bool}`` for the hooks with ``every_secs``.
    """
    timed = [h for h in self.hooks if h.trigger.every_secs is not None]
    agreed = agree([self.preemption.requested, self._stop_reason is not None]
                   + [h.trigger.time_due() for h in timed])
    time_due = {id(h): d for h, d in zip(timed, agreed[2:])}
    if agreed[1]:
      return self._stop_reason or "stopped", time_due
    return ("preempted" if agreed[0] else None), time_due

  def _firing(self, start: int, end: int, is_last: bool, time_due: dict[int, bool]) -> list[Hook]:
    """The hooks that fire after the call ``(start, end]``; records their firing."""
    firing = [h for h in self.hooks
              if h.trigger.should_fire(start, end, steps_per_epoch=self.steps_per_epoch,
                                       is_last=is_last, time_due=time_due.get(id(h), False))]
    for h in firing:
      h.trigger.fired()
    return firing

  def _check_replicas(self, state: Any, when: str) -> None:
    """For per-device steps: every device's copy of the state must agree (case C34).

    Runs after the first call and whenever the state is handed to hooks (to be
    saved or evaluated), at most once per step.
    """
    if (self.program.style != "per_device" or self.data_parallel_size == 1
        or self._replicas_checked_at == self.ledger.step):
      return
    t0 = time.perf_counter()
    jax.block_until_ready(state)  # the call's own device time is device_wait, not the check's
    t1 = time.perf_counter()
    self.ledger.add_time("device_wait", t1 - t0)
    diverged = self.program.diverged_leaves(state)
    # The first check of a run includes compiling the check program.
    self.ledger.add_time("compile" if self._replicas_checked_at is None else "replica_check",
                         time.perf_counter() - t1)
    self._replicas_checked_at = self.ledger.step
    if diverged:
      axis = self.program.data_axis
      raise ValueError(
          f"{when} the devices' copies of "
          f"state leaves {', '.join(diverged[:5])}{' ...' if len(diverged) > 5 else ''} "
          f"differ across the {axis!r} axis: a step_style='per_device' train_step must keep "
          f"the state identical on every device, e.g. average gradients with "
          f"jax.lax.pmean(grads, {axis!r}) before the update (and BatchNorm statistics with "
          f"axis_name={axis!r})")

  def _finish(self, p: _Pending, state: Any) -> tuple[tuple[LoopInfo, set[int]] | None, Any]:
    """Fetches a call's outputs (one device_get) and runs its hooks.

    Returns ((info, ids of hooks fired), state possibly replaced by a hook);
    (None, state) without hooks (no info is built).
    """
    t0 = time.perf_counter()
    if not self.hooks:  # nobody reads the metrics: fetch only the step counter
      out_step = np.asarray(p.out.step)
    else:
      out = _fetch(p.out, self._copy_async)
      out_step = out.step
    self.ledger.add_time("device_wait", time.perf_counter() - t0)
    if int(out_step) != p.end:
      raise ValueError(
          f"the state's step counter is {int(out_step)} after device call {p.loop_index} "
          f"(steps {p.start + 1}..{p.end}); train_step must increment it by exactly 1 per "
          f"step, and it must equal the loop's step {p.end}")
    if not self.hooks:  # no LoopInfo to build: no hook observes, fires or fires at the end
      self.data_position = p.position
      self._tick_total()
      if self.time_based_k is not None:
        self.time_based_k.record(p.end)
      return None, state
    n = p.end - p.start
    traces = {k: metrics_lib.compute_traces(v)[:n] for k, v in out.traces.items()}
    info = LoopInfo(start_step=p.start, end_step=p.end, loop_index=p.loop_index,
                    epoch=p.epoch, step_in_epoch=p.step_in_epoch,
                    examples_seen=p.examples_seen,
                    metrics={k: metrics_lib.compute(v) for k, v in out.metrics.items()},
                    metric_values=dict(out.metrics), traces=traces, is_last=p.is_last,
                    data_position=p.position)
    self.data_position = p.position
    self._tick_total()
    for h in self.hooks:  # self._timed inlined: every hook, every call
      t0 = time.perf_counter()
      try:
        h.observe(info)
      finally:
        self.ledger.add_time(getattr(h, "time_bucket", "hooks"), time.perf_counter() - t0)
    if state is not None and any(h.needs_state for h in p.firing):
      self._check_replicas(state, f"at step {p.end}, before the state goes to "
                           f"{', '.join(type(h).__name__ for h in p.firing if h.needs_state)},")
    fired = set()
    for h in p.firing:
      with self._timed(h):
        new = h.after_call(info, state if h.needs_state else None)
      fired.add(id(h))
      if new is not None and h.needs_state:
        state = self._admit(new, h)
    if self.time_based_k is not None:
      self.time_based_k.record(p.end)
    return (info, fired), state

  def _fire_at_end(self, last: tuple[LoopInfo, set[int]] | None, state: Any) -> Any:
    """At the end of a run, fires the ``at_end`` hooks that did not fire on its last call.

    After an early stop (a stop request or a preemption) that is every ``at_end``
    hook with a mark that did not fire on the last call. A run that made no
    call (stopped before its first one, or already at its target) fires every
    ``at_end`` hook with a mark once with an empty :class:`LoopInfo`
    (``num_steps == 0``, no metrics) at the current step, so e.g. a preempted
    run still saves and re-running a finished run still evaluates once. Hooks
    without marks (every call) do not fire for an empty boundary.
    """
    if last is None:
      step = self.ledger.step
      epoch, in_epoch = self._epoch_of(step)
      info = LoopInfo(start_step=step, end_step=step, loop_index=self.ledger.loop_index - 1,
                      epoch=epoch, step_in_epoch=in_epoch,
                      examples_seen=self.ledger.examples_seen, metrics={}, metric_values={},
                      traces={}, is_last=True, data_position=self.data_position)
      hooks = [h for h in self.hooks if h.trigger.at_end and not h.trigger.every_call]
    elif last[0].is_last:
      return state
    else:
      info = dataclasses.replace(last[0], is_last=True)
      hooks = [h for h in self.hooks
               if h.trigger.at_end and not h.trigger.every_call and id(h) not in last[1]]
    if any(h.needs_state for h in hooks):
      self._check_replicas(state, f"at step {info.end_step}, before the state goes to "
                           f"{', '.join(type(h).__name__ for h in hooks if h.needs_state)},")
    for h in hooks:
      with self._timed(h):
        new = h.after_call(info, state if h.needs_state else None)
      if new is not None and h.needs_state:
        state = self._admit(new, h)
    return state

  def _admit(self, state: Any, hook: Hook | None) -> Any:
    """The one way a state enters the compiled program (case C29).

    The run's initial state, a hook's replacement (``after_call``), a restore
    (``on_run_start``) and an ``on_run_end`` replacement all pass here: checked
    against the train state (structure, shapes, dtypes, naming the leaf), then
    placed with the program's pinned shardings and de-duplicated buffers
    (:meth:`MultiStepProgram.place_state`).

    Args:
      state: the state pytree.
      hook: the hook that returned it, or None for the initial state (which
        becomes the train state the others are checked against).

    Raises:
      ValueError: a replacement unlike the train state.
    """
    if hook is not None:
      problem = tree_mismatch(self._state_spec, state, what=(
          f"{type(hook).__name__} returned a state unlike the train state"))
      if problem:
        raise ValueError(problem)
    placed = self.program.place_state(state)
    if hook is None:
      self._state_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), placed)
    return placed
