"""TrainLoop: K train steps per device call, host accounting and hooks at boundaries.

The loop holds the configuration: the compiled program, the hooks, the mesh
and the planner's inputs; it does no array math. Each ``run`` is a
:class:`loopkit.core.run.Run`, the only writer of run state (ledger, data position,
status): per device call it dispatches the program, advances the ledger, and
(one call late, unless a hook needs the state now) fetches the call's reduced
metrics and ``[K]`` traces with one ``jax.device_get``. Hooks get a read-only
:class:`loopkit.core.context.RunContext` and return what they change.
"""

from __future__ import annotations

import datetime
import logging
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from loopkit._internal.checks import default_step_of
from loopkit._internal.mesh import check_batch_on_mesh, resolve_mesh
from loopkit.core.hook_state import hook_names
from loopkit.core.hooks import Hook, check_hooks
from loopkit.core.ledger import Bucket, Ledger
from loopkit.core.planner import TimeBasedK, parse_duration
from loopkit.core.preemption import DEFAULT_SIGNALS, PreemptionWatcher
from loopkit.core.program import FullCallLoop, MultiStepProgram, StepStyle
from loopkit.core.run import DataExhaustedWarning, Run, RunConfig, check_epoch_marks
from loopkit.core.skips import check_skip_steps
from loopkit.core.time_limit import TimeLimit, as_time_limit
from loopkit.data.assembly import ChunkAssembly, resolve_chunk_assembly
from loopkit.data.sources import check_epoch_length, steps_per_epoch_of

__all__ = ["DataExhaustedWarning", "TrainLoop"]

log = logging.getLogger("loopkit")

GPU_DETERMINISM_FLAG = "--xla_gpu_deterministic_ops=true"
_GPU_WARNED: list[bool] = []


def _warn_gpu_determinism(mesh: Mesh) -> None:
  """On GPU, says once that K-invariance needs XLA's deterministic ops, unless the user chose.

  Measured on one H200 (jax 0.11.2, ``benchmarks/RESULTS_gpu.md``): without
  :data:`GPU_DETERMINISM_FLAG` the ResNet example's step ends on different bits when the same
  executable runs twice (cuDNN's convolution kernels), and the LM example's ends on different bits
  in another process; with it both are bitwise equal at K = 10, 3, 1 and across processes, and a
  ResNet-50 step takes about 40% longer. ``XLA_FLAGS`` that name the flag at all (``=true`` or
  ``=false``) silence the warning: the user has chosen.
  """
  platforms = {d.platform for d in mesh.devices.flat}
  if platforms & {"gpu", "cuda", "rocm"}:
    if "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", "") and not _GPU_WARNED:
      _GPU_WARNED.append(True)  # once per process
      log.warning("loopkit on GPU: the final state is the same for every K and across a resume "
                  "only with XLA_FLAGS=%s set before JAX starts (slower: see docs/tuning.md); "
                  "set it to =false to keep XLA's faster nondeterministic kernels and silence "
                  "this", GPU_DETERMINISM_FLAG)


def _warn_logging_after_checkpoint(hooks: Sequence[Hook]) -> None:
  """Warns when a LoggingHook comes after a checkpoint hook in ``hooks``.

  Hooks fire in list order; a checkpoint saves every hook's ``checkpoint_state``
  when it runs. A LoggingHook after it, firing at the same boundary, is saved
  with the running average *before* its row, so a resumed run's first row would
  average again steps that the row already covered.
  """
  seen_checkpoint = None
  for h in hooks:
    if getattr(h, "time_bucket", None) == Bucket.CHECKPOINT and seen_checkpoint is None:
      seen_checkpoint = h
    elif seen_checkpoint is not None and type(h).__name__ == "LoggingHook":
      warnings.warn(
          f"hooks: LoggingHook comes after {type(seen_checkpoint).__name__}; at a step where "
          "both fire, the checkpoint would hold the running average before the row is "
          "written and a resumed run would average those steps again: put the LoggingHook "
          "before the checkpoint hook", UserWarning, stacklevel=4)
      return


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
      :class:`~loopkit.core.planner.TimeBasedK`: steps per call are then chosen to
      take about that long, from the measured step time, with one compiled
      program of ``max_iterations_per_loop`` slots.
    max_iterations_per_loop: slot count for a duration ``iterations_per_loop``
      (default 100; calls shorter than it transfer padding batches).
    hooks: :class:`loopkit.core.hooks.Hook` objects, called in order at boundaries.
    mesh: device mesh (default: 1-D mesh ``("data",)`` over all devices). A state
      leaf with a ``NamedSharding`` on it keeps its sharding (its ``PartitionSpec``
      unchanged); unsharded leaves, and leaves fully replicated on other devices, are
      replicated on it. A leaf sharded on another mesh (a model-parallel state built on a
      ``("data", "fsdp", "tensor")`` mesh, with this argument left out) is refused at
      ``run``, before any step: pass that mesh here (or ``state_shardings=`` to move it).
    state_shardings: the state's shardings, where they are not the arrays' own (default
      None: every leaf's own): a pytree with the state's tree structure, or a prefix of it
      (``{"params": specs, "opt": opt_specs, "step": P()}``), whose leaves are
      ``PartitionSpec`` (placed on ``mesh``), ``NamedSharding`` (on ``mesh``) or None (that
      leaf's own sharding). What ``jax.jit(train_step, in_shardings=(state_sharding, ...))``
      was given fits, e.g. Flax linen's ``nn.logical_to_mesh_sharding(...)`` output. The state
      given to ``run``, and a checkpoint that :class:`~loopkit.CheckpointHook` restores, are
      placed there; with ``PartitionSpec`` entries the same argument puts the state on any mesh
      that has those axes (restoring a checkpoint onto another mesh shape). A sharding that
      does not divide a leaf's dimension on ``mesh`` is refused at ``run``, naming the leaf.
    data_axis: the mesh axis the batch is split over (default ``"data"``), or a tuple of mesh
      axes, the major one first (``("data", "fsdp")``: the batch split over their product, as
      ``PartitionSpec(("data", "fsdp"))`` splits it; FSDP training, MaxText's default). The
      global batch must divide by the product of their sizes.
    step_style: ``"global"`` (the step sees global arrays) or ``"per_device"``
      (pmap style: the step sees its device's slice and uses collectives over
      ``data_axis``).
    steps_per_epoch: steps in one epoch; calls never cross an epoch end.
      ``"auto"``: the length of the source given to each ``run`` (one epoch;
      :func:`loopkit.data.sources.steps_per_epoch_of`: ``len``, tf.data
      cardinality, ``ArraySource.steps_per_epoch``). A source that declares its own
      epoch (``ArraySource``, ``GrainSource``, ``DeviceDataset``) and an int here that
      differs from it is refused at ``run``
      (:func:`loopkit.data.sources.check_epoch_length`).
    global_batch_size: if given, checked now against the data-parallel size, and
      at ``run`` against the first batch: every leaf must be ``[B, ...]``
      (``[B / processes, ...]`` on multi-host), else a ValueError names the leaf
      and its shape (pmap layout ``[devices, B / devices, ...]``,
      ``prefetch_to_device`` output) before any step. Without it the batch size
      is the first batch's: a first batch already on the devices with a leading
      device axis (``prefetch_to_device`` output) is still refused, since the
      arrays say so; a numpy batch that looks like pmap layout only warns.
    prefetch: chunks prepared ahead by a background thread (0 = none).
    step_of: returns the state's step counter (default ``state.step``).
    preemption_signals: signals that stop the run at the next boundary with
      ``status == "preempted"`` (default SIGTERM, SIGINT; ``()`` for none); see
      :mod:`loopkit.core.preemption`. Caught only while ``run`` runs, in the main thread.
    canonical_convs: relay out the step's convolution gradients for XLA:CPU's
      fast kernels inside the loop body (:mod:`loopkit.conv_layout`); None
      (default) = on when the mesh is on CPU devices.
    chunk_assembly: where a chunk ``[K, B, ...]`` is formed: ``"device"`` (each batch placed
      on the mesh as it comes, in the prefetch thread, and the chunk assembled there: no host
      array of the chunk's size), ``"host"`` (stacked in one host buffer, one transfer; on CPU
      devices the buffer is aliased, not copied) or ``"auto"`` (default): ``"device"`` on
      accelerators, ``"host"`` on CPU meshes (:mod:`loopkit.data.assembly`). Results are the
      same either way. On devices that report their memory (GPU, TPU), a K whose chunks in
      flight (``prefetch + 3``) and the state do not fit is refused before the first step.
    full_call_loop: ``"static"``: full calls (K steps) run a second executable whose step loop
      has a static trip count, compiled with the first before any step; ``"traced"``: every
      call runs the one executable with a traced trip count; ``"auto"`` (default):
      ``"static"`` on GPUs, where XLA runs a traced-count loop from the host (one predicate
      read back per step, and a call that returns only when finished), ``"traced"`` elsewhere
      (:class:`~loopkit.core.program.MultiStepProgram`). Results are the same either way
      (bitwise on CPU, ``tests/test_assembly.py``); :meth:`program`'s ``compile_count()`` is 2
      with ``"static"``.

  Raises:
    TypeError: a hook without the :class:`~loopkit.core.hooks.Hook` methods, or
      with a public method the loop would never call (loopkit 0.1's ``observe`` /
      ``after_call``, a misspelt ``on_run_started``; see
      :func:`~loopkit.core.hooks.check_hooks`); also at ``run`` for hooks added to
      :attr:`hooks` since.
    ValueError: K < 1 or not an int or duration; a ``chunk_assembly`` or ``full_call_loop``
      not among its values; a duration K on several
      processes; ``max_iterations_per_loop`` with an int K;
      ``global_batch_size`` not divisible by the data-parallel size (the
      product of the data axes' sizes; the message names them); a ``data_axis``
      that is not an axis of ``mesh`` (or a tuple naming one twice, or several
      axes without ``mesh``); (at ``run``) ``state_shardings`` unlike the state, naming an
      axis ``mesh`` lacks or not dividing a leaf (naming the leaf);
      ``steps_per_epoch`` < 1; a hook's ``every_epochs`` that is not a
      whole number of steps (or, at ``run``, without ``steps_per_epoch``).

  Attributes:
    hooks: the hooks, in order.
    steps_per_epoch: steps in one epoch (for ``"auto"``: the last ``run``'s source), or None.
    target_step: the global step the current ``run`` ends at.

  Read-only properties: the configuration (:attr:`program`,
  :attr:`iterations_per_loop`, :attr:`time_based_k`, :attr:`mesh`, ...) and the
  current (or last) run's :attr:`status`, :attr:`stop_reason`,
  :attr:`preemption`, :attr:`ledger`, :attr:`data_position` and
  :attr:`last_state`.

  A ``run`` that raises keeps the work done: :attr:`last_state` is then the
  state at its last completed boundary, at step ``ledger.step`` (the state
  given to ``run`` was donated).

  Not thread-safe. Multi-host: every process runs the same loop.
  """

  def __init__(self, train_step: Callable, *, iterations_per_loop: int | str | TimeBasedK,
               max_iterations_per_loop: int | None = None,
               hooks: Sequence[Hook] = (), mesh: Mesh | None = None,
               data_axis: str | tuple[str, ...] = "data", step_style: StepStyle = "global",
               steps_per_epoch: int | str | None = None, global_batch_size: int | None = None,
               prefetch: int = 2, step_of: Callable[[Any], Any] = default_step_of,
               preemption_signals: Sequence[int] = DEFAULT_SIGNALS,
               canonical_convs: bool | None = None, state_shardings: Any = None,
               chunk_assembly: ChunkAssembly = "auto", full_call_loop: FullCallLoop = "auto"):
    slots, time_based_k = _slots_and_time_based_k(iterations_per_loop, max_iterations_per_loop)
    mesh, data_axis, data_parallel_size = resolve_mesh(mesh, data_axis)
    program = MultiStepProgram(train_step, iterations_per_loop=slots,  # checks the slot count
                               mesh=mesh, data_axis=data_axis, style=step_style,
                               step_of=step_of, canonical_convs=canonical_convs,
                               state_shardings=state_shardings, full_call_loop=full_call_loop)
    resolve_chunk_assembly(chunk_assembly, program.batch_sharding)  # checks the value now
    self._auto_steps_per_epoch = steps_per_epoch == "auto"  # from the source, at each run
    self.steps_per_epoch: int | None = _fixed_steps_per_epoch(steps_per_epoch)
    if global_batch_size is not None:
      check_batch_on_mesh(global_batch_size, program.batch_sharding, process_count=1)
    self.hooks = _checked_hooks(hooks)
    if self.steps_per_epoch is not None:
      check_epoch_marks(self.hooks, self.steps_per_epoch)
    self._config = RunConfig(program=program, iterations_per_loop=program.iterations_per_loop,
                             time_based_k=time_based_k, mesh=mesh,
                             data_parallel_size=data_parallel_size, prefetch=prefetch,
                             step_of=step_of, global_batch_size=global_batch_size,
                             chunk_assembly=chunk_assembly)
    _warn_gpu_determinism(mesh)
    self._run: Run | None = None  # the current (or last) run: the only writer of run state
    self.preemption_signals = tuple(preemption_signals)
    self._preemption = PreemptionWatcher(self.preemption_signals)  # the next (or current) run's
    self.target_step: int | None = None

  # -- public ----------------------------------------------------------------

  def request_stop(self, reason: str = "stopped") -> None:
    """Asks the loop to stop at the next boundary (hooks: ``ctx.request_stop``).

    A request, not a state change: the run stops at the next boundary, after
    the processes agreed on it (:mod:`loopkit.core.agreement`). Outside a run
    it has no effect (each run starts without a stop request).
    """
    if self._run is not None:
      self._run.request_stop(reason)

  def run(self, state: Any, batches: Iterable, *, num_steps: int | None = None,
          num_epochs: int | None = None, skip_steps: Sequence[tuple[int, int]] | None = None,
          max_time: float | str | datetime.timedelta | TimeLimit | None = None) -> Any:
    """Trains until global step ``num_steps`` (or ``num_epochs * steps_per_epoch``).

    Args:
      state: the train state pytree (donated to the device calls); or an abstract one, whose
        leaves are ``jax.ShapeDtypeStruct`` (``jax.eval_shape(init)``; the shardings their own
        or ``state_shardings``), where a hook restores every leaf (a
        :class:`~loopkit.checkpoint.CheckpointHook` resuming, or its ``init_from`` reading
        every leaf): only the restored arrays are allocated, onto the pinned shardings.
      batches: iterable of batches, pytrees of numpy arrays ``[B, ...]`` (the
        process-local part on multi-host), at least as many as steps to run.
      num_steps: the global step to stop at (absolute, like TPUEstimator's
        ``max_steps``: a state restored at step 10 asked for 15 runs 5 steps).
      num_epochs: alternatively, the epoch count to stop at (needs
        ``steps_per_epoch``).
      skip_steps: data steps to pass over, ``[(first, last), ...]`` (1-based batch
        indices in the source's order, inclusive; :mod:`loopkit.core.skips`): their batches
        are drawn and dropped (or stepped over, for a ``batch_at`` source) and no update is
        applied for them; ``num_steps`` still counts updates. Joined with the ranges the
        restored checkpoint's ledger holds (``ledger.skip_steps``), which a resume keeps.
      max_time: a wall-clock budget for this ``run`` (seconds, ``"4h"``, a
        ``datetime.timedelta`` or a :class:`~loopkit.core.time_limit.TimeLimit`),
        counted from now: the run stops at the first boundary at or past it,
        agreed across processes, as at a preemption (a
        :class:`~loopkit.checkpoint.CheckpointHook` saves there), with
        ``status == "time limit"`` (:mod:`loopkit.core.time_limit`). None: no budget.

    Returns:
      The final state, whose step equals ``self.ledger.step``.

    Raises:
      TypeError: a state that is (or holds) a Flax NNX object (``nnx.Module``,
        ``nnx.Optimizer``...), before it is donated: the message names
        :class:`loopkit.nnx.NnxTrainLoop`.
      ValueError: an abstract state that no hook restored (naming its abstract leaves),
        once the hooks' ``on_run_start`` ran and before any step; bad arguments (a
        ``skip_steps`` entry that is not a pair of ints
        ``1 <= first <= last``, or out of order or overlapping, naming it; after a restore,
        one that starts at or before the data step the run is at); a source whose own
        epoch is not
        ``steps_per_epoch`` steps (naming both); a state leaf sharded on another
        mesh than the loop's, which would lose its sharding (naming the leaf, both
        meshes and ``mesh=``); a sharding (the leaf's own, or from ``state_shardings``) that
        does not divide a leaf's dimension on the mesh (naming the leaf, the spec and the
        axes' sizes); batch shape/dtype changes (naming the leaf),
        a step that changes the state's structure/shape/dtype; a step counter
        that does not advance by one per step
        (:class:`~loopkit.core.StepCounterError`). Whatever ``run`` raises (also a
        hook's or the source's exception, a ``KeyboardInterrupt``), the work
        done is kept: :attr:`last_state` is the state at the last completed
        boundary, at step ``self.ledger.step``.

    Warns:
      DataExhaustedWarning: ``batches`` ran out; the run stops after the last
      full step, hooks see only steps that ran, ``status == "data_exhausted"``.
    """
    time_limit = as_time_limit(max_time)
    if time_limit is not None:
      time_limit.start()
    if self._auto_steps_per_epoch:
      self.steps_per_epoch = steps_per_epoch_of(batches)
    check_epoch_length(batches, self.steps_per_epoch)
    target = self._target(num_steps, num_epochs)
    skips = check_skip_steps(skip_steps)
    self.target_step = target
    config = self._config
    if config.time_based_k is not None:
      config.time_based_k.start()
    last = self._run
    if last is not None and last.preemption_spent and last.preemption is self._preemption:
      # the last run spent it (still readable until now): this run starts unflagged
      self._preemption = PreemptionWatcher(self.preemption_signals)
    prior = self.ledger
    run = Run(config, self.hooks, steps_per_epoch=self.steps_per_epoch, target=target,
              num_epochs=num_epochs, preemption=self._preemption, skip_steps=skips,
              time_limit=time_limit)
    state = run.admit(state, None)
    step0 = _initial_step(config.step_of(state), config.data_parallel_size)
    fresh = (prior is None or last is None or prior.step != step0
             or isinstance(config.step_of(state), jax.ShapeDtypeStruct))
    ledger = Ledger(step=step0) if fresh or prior is None else prior
    ledger.steps_per_epoch = self.steps_per_epoch
    # examples_seen = step0 x B at the first chunk, also when the last run of
    # this loop ended before its first chunk
    run.set_ledger(ledger, examples_unknown=step0 > 0 and (
        fresh or last is None or last.examples_unknown))
    self._run = run
    return run.execute(state, batches)

  # -- read-only views of the configuration and of the current run -----------

  @property
  def program(self) -> MultiStepProgram:
    """The :class:`~loopkit.core.program.MultiStepProgram`."""
    return self._config.program

  @property
  def iterations_per_loop(self) -> int:
    """The compiled slot count K (the cap, for time-based K)."""
    return self._config.iterations_per_loop

  @property
  def time_based_k(self) -> TimeBasedK | None:
    """The :class:`~loopkit.core.planner.TimeBasedK`, or None."""
    return self._config.time_based_k

  @property
  def mesh(self) -> Mesh:
    """The device mesh."""
    return self._config.mesh

  @property
  def data_parallel_size(self) -> int:
    """Slices of the batch: the size of the data axis (the product of the sizes, for a tuple)."""
    return self._config.data_parallel_size

  @property
  def prefetch(self) -> int:
    """Chunks prepared ahead by the feeder's thread."""
    return self._config.prefetch

  @property
  def step_of(self) -> Callable[[Any], Any]:
    """Returns the state's step counter."""
    return self._config.step_of

  @property
  def status(self) -> str | None:
    """The last run's status: ``"completed"``, ``"data_exhausted"``, ``"preempted"``,
    ``"time limit"`` (``max_time``), ``"stopped"`` or the reason given to
    :meth:`request_stop` (``"early stopped"``:
    :class:`~loopkit.training.plateau.EarlyStopping`); None before any run and while a
    run runs."""
    return self._run.status if self._run is not None else None

  @property
  def stop_reason(self) -> str | None:
    """The stop requested (or agreed) in the current (or last) run, or None."""
    return self._run.stop_reason if self._run is not None else None

  @property
  def preemption(self) -> PreemptionWatcher:
    """The :class:`~loopkit.core.preemption.PreemptionWatcher` of the current (or next) run.

    ``loop.preemption.request()`` preempts as a signal would, also before
    ``run``; after ``run`` it still tells what stopped the run
    (``signal_received``), and the next ``run`` starts with a fresh one.
    """
    return self._preemption

  @property
  def ledger(self) -> Ledger | None:
    """The current (or last) run's :class:`~loopkit.core.ledger.Ledger`; None before any run.

    Written only by the run; read it, do not change it.
    """
    return self._run.ledger if self._run is not None else None

  @property
  def data_position(self) -> Any:
    """Source position after the last consumed chunk of the current (or last) run.

    After ``run`` raised: the position after the last batch :attr:`last_state` has seen.
    """
    return self._run.data_position if self._run is not None else None

  @property
  def last_state(self) -> Any:
    """The state at the last completed boundary of the last run; None before any run.

    After ``run`` returned: the state it returned. After ``run`` raised (a
    batch of the wrong shape, a hook's or the source's exception, a
    ``KeyboardInterrupt``), the state to continue from, since the state given
    to ``run`` was donated: the output of the latest device call (or a hook's
    replacement of it), whose step equals ``self.ledger.step``; no later call
    consumed it, so its arrays are live (``loop.run(loop.last_state, ...)``
    goes on). The run does not wait for that call when it raises: the arrays
    are ready once it finishes. Exceptions:

    * the device call itself failed (an XLA runtime error, e.g. out of
      memory): the state is that call's output, or depends on it, and reading
      it raises the call's error; there is no earlier state, each call's input
      having been donated to it;
    * ``run`` raised before it took the state (its arguments, or a state it
      refuses): this property, :attr:`ledger` and :attr:`data_position` are
      still the previous run's, and the state given is intact (not donated);
    * None when the error deleted the state's buffers (a call that failed
      while taking its donated input).

    Read it, do not change it; it belongs to the run until the next ``run``.
    """
    return self._run.state if self._run is not None else None

  # -- internals -------------------------------------------------------------

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
    assert num_steps is not None
    return int(num_steps)


def _slots_and_time_based_k(iterations_per_loop: int | str | TimeBasedK,
                            max_iterations_per_loop: int | None) -> tuple[Any, TimeBasedK | None]:
  """The compiled slot count (unchecked: the program checks it) and the time-based K, if any.

  Raises:
    ValueError: ``max_iterations_per_loop`` with an int K; a duration K on
      several processes.
  """
  if isinstance(iterations_per_loop, str):
    iterations_per_loop = TimeBasedK(
        parse_duration(iterations_per_loop),
        max_iterations_per_loop=100 if max_iterations_per_loop is None
        else max_iterations_per_loop)
  elif max_iterations_per_loop is not None:
    raise ValueError("max_iterations_per_loop is only for a duration iterations_per_loop "
                     f"such as '30s', got iterations_per_loop={iterations_per_loop!r}")
  if not isinstance(iterations_per_loop, TimeBasedK):
    return iterations_per_loop, None
  if jax.process_count() > 1:  # a host-local decision the processes' agreement cannot carry
    raise ValueError(
        f"iterations_per_loop={iterations_per_loop!r} chooses call lengths from this "
        f"process's clock, ahead of time (the feeder plans prefetched calls), so "
        f"{jax.process_count()} processes would run calls of different lengths and "
        "their collectives would not match: pass an int K on several processes (measure "
        "one with `python -m loopkit.tools.tune` on one process)")
  return iterations_per_loop.max_iterations_per_loop, iterations_per_loop


def _fixed_steps_per_epoch(steps_per_epoch: int | str | None) -> int | None:
  """``steps_per_epoch`` checked; None for ``"auto"`` (taken from the source at each run).

  Raises:
    ValueError: not ``"auto"``, None or an int >= 1.
  """
  if steps_per_epoch == "auto":
    return None
  if steps_per_epoch is not None and (isinstance(steps_per_epoch, str) or steps_per_epoch < 1):
    raise ValueError(f"steps_per_epoch must be >= 1 or 'auto', got {steps_per_epoch!r}")
  assert not isinstance(steps_per_epoch, str)
  return steps_per_epoch


def _checked_hooks(hooks: Sequence[Hook]) -> list[Hook]:
  """``hooks`` as a list, after checking them (:func:`~loopkit.core.hooks.check_hooks`) and that
  their names are unique.

  Raises:
    TypeError: a hook without the :class:`~loopkit.core.hooks.Hook` methods, or with a
      method the loop would never call (named, with the nearest hook method).
    ValueError: a ``hook_name`` given twice.
  """
  hooks = list(hooks)
  check_hooks(hooks)
  _warn_logging_after_checkpoint(hooks)
  hook_names(hooks)  # raises now for a hook_name given twice
  return hooks


def _initial_step(counter: Any, data_parallel_size: int) -> int:
  """The step of a run's initial state, from its step counter (0 for an abstract one, which
  a restore replaces before any step).

  Raises:
    ValueError: the counter is not a scalar integer array (naming a state
      replicated for pmap).
  """
  if np.shape(counter) != () or not np.issubdtype(counter.dtype, np.integer):
    replicated = np.ndim(counter) == 1 and np.shape(counter)[0] in (
        data_parallel_size, jax.local_device_count())
    raise ValueError(f"the state's step counter must be a scalar integer array, got shape "
                     f"{np.shape(counter)} dtype {counter.dtype}" + (
                         "; this looks like a state replicated for pmap (flax.jax_utils."
                         "replicate): pass the unreplicated state (jax_utils.unreplicate, "
                         "or jax.tree.map(lambda x: x[0], state)), loopkit replicates it "
                         "itself" if replicated else ""))
  if isinstance(counter, jax.ShapeDtypeStruct):  # an abstract state: a restore gives the step
    return 0
  return int(jax.device_get(counter))  # "nothing to run" is told after restores (Run.start)
