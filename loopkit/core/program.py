"""The compiled multi-step program: up to K train steps in one device call.

One ``jax.jit`` program takes the state, a chunk of stacked batches ``[K, B, ...]``
(B = global batch, sharded on the data axis, or over the product of several: ``data_axis=
("data", "fsdp")``) and a run length ``n`` (int32
scalar, 1 <= n <= K), and runs ``n`` train steps in a ``lax.fori_loop`` whose
trip count is a traced value (an XLA while loop). Every call length therefore
reuses one executable: the planner can cut calls anywhere without a recompile.

Cost of the mechanism (documented, measured in ``benchmarks/``): a call of
``n < K`` steps computes only ``n`` steps, but its input chunk still has K slots,
so ``K - n`` batches of padding cross to the device for that call; calls are
only shorter than K at events, epoch ends and the tail. A dynamic trip count
also keeps XLA from unrolling the loop, which (with the slot padding below)
is why the step is compiled identically for every K and final parameters are
bitwise equal across K.

Two step styles:
  * ``"global"``: ``train_step`` sees global arrays (the batch sharded on the
    data axis); the program is ``jit(fori_loop(step))``.
  * ``"per_device"``: pmap style; ``train_step`` sees its device's slice
    ``[B / D, ...]`` and may use collectives over the data axis, e.g.
    ``lax.pmean(grads, "data")`` (``lax.pmean(grads, ("data", "fsdp"))`` for a tuple: D is
    the product of its axes' sizes); the program is
    ``jit(shard_map(fori_loop(step)))`` with the state replicated.

The loop itself is :mod:`loopkit.core.slot_loop` (:func:`~loopkit.core.slot_loop.run_slots`);
its docstring says why the step compiles alike for every K (a K = 1 chunk is padded to
``MIN_SLOTS = 2`` slots) and as a per-step ``jit`` does (the loop's body is kept whole).
A state's leaves are made strong-typed before they are placed
(:mod:`loopkit.core.state_leaves`), so that the program compiles once.

The state is donated and its shardings pinned (output shardings = input).
The user's step is traced exactly once per compilation.

FLOPs per step (:meth:`MultiStepProgram.flops_per_step`, for MFU) come from XLA's cost analysis of
the executable the calls run, not from a model formula (plus, where XLA counted an inner ``scan``
over layers once, the matrix FLOPs of its other trips, from the step's jaxpr:
:mod:`loopkit.core.flops`). XLA counts a while loop's body once (the trip count is a traced value,
unknown to it), so the program's FLOPs are those of one step plus the reductions of the ``[K]``
metric traces after the loop, a few FLOPs per slot. Measured (``tests/test_mfu.py``'s MLP on the
8-device CPU mesh, jax 0.10.2): 963093, 963117, 963135 and 963153 FLOPs for K = 1, 2, 3, 4, 5.0%
above the analytic count of its matmuls on one device's slice of the batch (the rest is the ReLU,
the loss and the update). The counts are per device (the SPMD-partitioned program), as in
:mod:`loopkit.tools.aot`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from loopkit import conv_layout, metrics as metrics_lib
from loopkit._internal.checks import (
  MIN_SLOTS,
  check_data_axis,
  check_iterations_per_loop,
  check_not_deleted,
  check_step_style,
  default_step_of,
  leaf_name,
  tree_mismatch,
)
from loopkit._internal.compat import lowering_count
from loopkit._internal.mesh import batch_sharding, is_cpu_mesh, pinned_state_shardings
from loopkit._internal.recompile import RecompileWarning, call_signature, signature_change
from loopkit.core import flops as flops_lib

# The step loop and the state's leaves have modules of their own; their names stay importable
# from here, where they were defined before (``from loopkit.core.program import run_slots``).
from loopkit.core.slot_loop import (  # noqa: F401 (re-exported)
  FULL_CALL_LOOPS,
  NO_HOISTING_ATTRIBUTE,
  FullCallLoop,
  StepStyle,
  build_program,
  no_hoisting,
  pad_slots,
  resolve_full_call_loop,
  run_slots,
)
from loopkit.core.state_leaves import (  # noqa: F401 (re-exported)
  as_loop_leaf,
  leaf_fingerprint,
  strong_typed,
)
from loopkit.core.step_output import CallOutput, unpack_step_output


def _put(state: Any, shardings: Any) -> Any:
  """``jax.device_put(state, shardings)``; an abstract leaf becomes an abstract leaf with its
  sharding (nothing allocated)."""
  leaves, treedef = jax.tree.flatten(state)
  targets = treedef.flatten_up_to(shardings)  # type: ignore[attr-defined]
  concrete = [i for i, x in enumerate(leaves) if not isinstance(x, jax.ShapeDtypeStruct)]
  if len(concrete) == len(leaves):
    return jax.device_put(state, shardings)
  put = jax.device_put([leaves[i] for i in concrete], [targets[i] for i in concrete])
  out = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
         for x, s in zip(leaves, targets, strict=True)]
  for i, x in zip(concrete, put, strict=True):
    out[i] = x
  return jax.tree.unflatten(treedef, out)


def compiled_cost(compiled: jax.stages.Compiled) -> dict[str, float]:
  """``compiled.cost_analysis()`` as one dict (some JAX releases return a list of one dict per
  computation, the first being the program's), ``{}`` where XLA gives none."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  return dict(cost or {})


def _abstract(x: Any) -> Any:
  """A ``ShapeDtypeStruct`` with ``x``'s shape, dtype, weak type and sharding (metadata only:
  a donated array will do)."""
  sharding = getattr(x, "sharding", None)
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=bool(getattr(x, "weak_type", False)),
                              sharding=sharding if isinstance(sharding, jax.sharding.Sharding)
                              else None)


class MultiStepProgram:
  """Builds and runs the compiled multi-step program for one train step.

  Args:
    train_step: ``(state, batch) -> (state, metrics)``, pure.
    iterations_per_loop: K >= 1, slots per chunk.
    mesh: device mesh; the batch axis is sharded over ``data_axis``.
    data_axis: the data-parallel mesh axis, or a tuple of them (the batch split over their
      product, the first one major); the per-device style's collectives run over it.
    style: ``"global"`` or ``"per_device"`` (see module docstring).
    step_of: returns the state's scalar step counter.
    canonical_convs: rewrite the step's non-canonical convolutions (the
      gradient convolutions of conv layers) into canonical layout inside the
      loop body (:mod:`loopkit.conv_layout`): XLA:CPU otherwise runs them with
      a naive kernel in a loop body, 10-40x slower. None (default): only when
      the mesh's devices are CPUs.
    state_shardings: the state's shardings where they are not the arrays' own: a pytree with
      the state's structure or a prefix of it, of ``PartitionSpec`` / ``NamedSharding`` (on
      ``mesh``) / None (the leaf's own); see
      :func:`loopkit._internal.mesh.pinned_state_shardings`. Checked against the state when
      the program is built (its first call, :meth:`place_state` or :meth:`lower`).
    full_call_loop: how a full call (``length == K``, see :meth:`__call__`) runs its steps:
      ``"traced"``, the one program's loop with a traced trip count (every call length, one
      executable); ``"static"``, a second executable whose loop runs exactly K trips (a static
      trip count), compiled beside the first one at the first call, before any step runs;
      ``"auto"`` (default): ``"static"`` on GPUs, ``"traced"`` elsewhere. Why: XLA:GPU runs a
      while loop with a traced trip count from the host, reading its predicate back every trip,
      so the call returns only once the device has finished (benchmarks/RESULTS_gpu.md, one
      H200: 33.8 ms to return a 34.0 ms call, about 18 us a trip; a static trip count returned in
      0.7 ms), and the next call cannot be queued behind it. TPU and CPU run the traced loop on
      the device. Both executables run the same loop body
      (:func:`~loopkit.core.slot_loop.run_slots`), so results are bitwise equal either way on CPU
      (``tests/test_full_call_loop.py``); on a GPU, check with ``benchmarks/gpu_exactness.py``.

  Attributes:
    state_shardings: the pinned ``NamedSharding`` of every state leaf (the structure of the
      state), once the program is built; None before.
    given_state_shardings: the ``state_shardings`` argument, as given.
    step_jaxpr_flops: matrix FLOPs of one step on one device counted from its jaxpr when it
      was traced (:func:`loopkit.core.flops.jaxpr_flops`; for the ``"global"`` style the
      global count over the mesh's devices), or None before the trace or where a while loop
      in the step hides its trip count.
    step_jaxpr_flops_once: the same with every inner ``scan`` body counted once (as XLA counts
      it).
    static_full_calls: whether full calls run the static-trip executable (``full_call_loop``
      resolved for this mesh).

  Raises:
    ValueError: a ``full_call_loop`` other than ``"auto"``, ``"traced"`` or ``"static"``.

  Not thread-safe; multi-host-safe (every process builds the same program).
  """

  def __init__(self, train_step: Callable, *, iterations_per_loop: int, mesh: Mesh,
               data_axis: str | tuple[str, ...] = "data", style: StepStyle = "global",
               step_of: Callable[[Any], jax.Array] = default_step_of,
               canonical_convs: bool | None = None, state_shardings: Any = None,
               full_call_loop: FullCallLoop = "auto"):
    check_step_style(style)
    self.static_full_calls = resolve_full_call_loop(full_call_loop, mesh) == "static"
    self.train_step = train_step
    self.iterations_per_loop = check_iterations_per_loop(iterations_per_loop)
    self.mesh = mesh
    self.data_axis = check_data_axis(mesh, data_axis)
    self.style = style
    self.step_of = step_of
    if canonical_convs is None:
      canonical_convs = is_cpu_mesh(mesh)
    self.canonical_convs = bool(canonical_convs)
    self.trace_count = 0
    self._jitted = None
    self._jitted_full: Any = None  # the static-trip program (static_full_calls)
    self._replica_check: Callable[[Any], Any] | None = None
    self._first_signature: list[tuple[str, tuple]] | None = None
    self._compiles = 0  # calls that compiled (lowering_count)
    self.state_shardings: Any = None
    self.given_state_shardings = state_shardings
    # abstract arguments of the last call that compiled, and its executable's cost analysis
    self._compiled_args: tuple[Any, Any, Any] | None = None
    self._cost: dict[str, float] | None = None
    self.step_jaxpr_flops: float | None = None
    self.step_jaxpr_flops_once: float | None = None

  @property
  def batch_sharding(self) -> NamedSharding:
    """Sharding of a chunk leaf ``[K, B, ...]``: B split over the data axis (or axes)."""
    return batch_sharding(self.mesh, self.data_axis)

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def state_sharding_for(self, state: Any) -> Any:
    """Pinned shardings for a state: the one ``state_shardings`` gives a leaf, else the leaf's
    ``NamedSharding`` on this mesh; an unsharded leaf, or one fully replicated on other devices,
    is replicated (:func:`loopkit._internal.mesh.pinned_state_shardings`).

    Raises:
      ValueError: a leaf sharded on another mesh or by another kind of sharding, or
        (``"per_device"`` style, whose state is replicated) sharded at all: it would
        lose its sharding. The message names the leaf, both meshes and ``mesh=``. Also a
        ``state_shardings`` unlike the state, or a sharding that does not divide a leaf's
        dimension on this mesh (naming the leaf, the spec and the axes' sizes).
      TypeError: a ``state_shardings`` entry of another kind (naming it).
    """
    return pinned_state_shardings(state, self.mesh, given=self.given_state_shardings,
                                  replicated_only=self.style == "per_device")

  # -- tracing ---------------------------------------------------------------

  def _loop(self, state, batches, num_steps):
    """The traced body: fori_loop over the step with a dynamic trip count."""
    return self._steps(state, batches, num_steps, None)

  def _full_loop(self, state, batches, num_steps):
    """The traced body of a full call: fori_loop over the step, K trips (static)."""
    del num_steps  # K, always
    return self._steps(state, batches, None, self.iterations_per_loop)

  def _steps(self, state, batches, num_steps, trips):
    """``num_steps`` (traced) or ``trips`` (static) steps of the train step over ``batches``."""
    self.trace_count += 1
    batch0 = jax.tree.map(lambda x: x[0], batches)

    def step_fn(s, b):
      new_s, m = unpack_step_output(self.train_step(s, b), state)
      out = {}
      for k, v in m.items():
        try:
          out[k] = metrics_lib.as_metric(v)
        except ValueError as e:
          raise ValueError(f"train_step metric {k!r}: {e}") from None
      return new_s, out

    try:
      closed, (out_state_shape, metric_shape) = jax.make_jaxpr(
          step_fn, return_shape=True)(state, batch0)
    except NameError as e:  # a collective over an axis that is not the data axis
      if "unbound axis name" not in str(e):
        raise
      raise NameError(f"{e}\nloopkit: the train step uses a collective over an axis the "
                      f"program does not map; its data axis is {self.data_axis!r} "
                      f"(style {self.style!r}): pass data_axis=<the step's axis name> "
                      "(e.g. 'batch' for Flax's pmap examples) and step_style='per_device', "
                      "with a mesh that has that axis") from e
    problem = tree_mismatch(state, out_state_shape,
                            what="train_step returned a state unlike the one it received")
    if problem:
      raise ValueError(problem)
    # a global step's jaxpr has global shapes: one device's share (a per-device step's are its own)
    share = self.mesh.size if self.style == "global" else 1
    try:
      counts = [flops_lib.jaxpr_flops(closed, loops_once=once) for once in (False, True)]
    except (KeyError, AttributeError, TypeError, ValueError):  # a primitive's params unlike
      counts = [None, None]  # those counted: XLA's count alone (the step must run regardless)
    self.step_jaxpr_flops, self.step_jaxpr_flops_once = (
        None if c is None else c / share for c in counts)
    run_step = (conv_layout.canonicalize_convs(closed) if self.canonical_convs
                else jax.extend.core.jaxpr_as_fun(closed))
    out_def = jax.tree.structure((out_state_shape, metric_shape))

    # See the module docstring: K = 1 compiles as K = 2.
    slots = max(self.iterations_per_loop, MIN_SLOTS)
    traces0 = jax.tree.map(lambda s: jnp.zeros((slots,) + s.shape, s.dtype), metric_shape)

    def body(i, b, carry):
      s, traces = carry
      flat = run_step(*jax.tree.leaves((s, b)))
      new_s, m = jax.tree.unflatten(out_def, flat)
      if self.style == "per_device":  # in the step: the same reduction for every K
        m = metrics_lib.reduce_devices(m, self.data_axis)
      traces = jax.tree.map(lambda buf, v: buf.at[i].set(v), traces, m)
      return new_s, traces

    state, traces = run_slots(body, batches, num_steps, (state, traces0), trips=trips)
    traces = jax.tree.map(lambda t: t[:self.iterations_per_loop], traces)
    return state, CallOutput(traces=traces,
                             nonfinite=metrics_lib.first_nonfinite(traces),
                             step=self.step_of(state))

  def _build(self, state):
    self.state_shardings = self.state_sharding_for(state)
    kwargs = dict(mesh=self.mesh, data_axis=self.data_axis, style=self.style,
                  donate_argnums=(0,),
                  in_shardings=(self.state_shardings, self.batch_sharding, self.replicated),
                  out_shardings=(self.state_shardings, self.replicated))
    self._jitted = build_program(self._loop, **kwargs)
    if self.static_full_calls:
      self._jitted_full = build_program(self._full_loop, **kwargs)

  def place_state(self, state: Any) -> Any:
    """Puts ``state`` on the mesh with the pinned shardings (explicit transfer).

    Weak-typed leaves (from Python scalars: ``jnp.asarray(1.0)``, Flax's
    ``DynamicScale()`` defaults) become strong arrays of the same dtype
    (:func:`~loopkit.core.state_leaves.strong_typed`), the type the compiled loop returns, so
    the second call does not compile the program again. Leaves that are one and the same
    array get separate buffers (the state is donated, and a buffer can be
    donated once).

    An abstract leaf (``jax.ShapeDtypeStruct``, e.g. of ``jax.eval_shape(init)``) allocates
    nothing: it stays abstract, with its pinned sharding, for a checkpoint to fill
    (:meth:`loopkit.checkpoint.CheckpointHook.restore` reads into it).

    Raises:
      ValueError: a leaf of ``state`` is a deleted (donated) array, naming every such leaf
        (:func:`loopkit._internal.checks.check_not_deleted`)."""
    check_not_deleted(state)
    state = strong_typed(state)
    if self._jitted is None:
      self._build(state)
    placed = _put(state, self.state_shardings)
    # A leaf that is the same array as an earlier one ({"params": p, "ema": p}) would be
    # donated twice, which XLA refuses: give it a buffer of its own.
    leaves, treedef = jax.tree.flatten(placed)
    seen: set[int] = set()
    for i, x in enumerate(leaves):
      if isinstance(x, jax.Array):
        if id(x) in seen:
          leaves[i] = jax.device_put(x, x.sharding, may_alias=False)
        seen.add(id(x))
    return jax.tree.unflatten(treedef, leaves)

  def __call__(self, state: Any, batches: Any, num_steps: jax.Array,
               length: int | None = None) -> tuple[Any, CallOutput]:
    """Runs ``num_steps`` steps (device int32 scalar) over ``batches`` ``[K, B, ...]``.

    Dispatches asynchronously; ``state`` is donated.

    Args:
      state: the state pytree (donated).
      batches: the chunk, leaves ``[max(K, 2), B, ...]``.
      num_steps: int32 scalar on the mesh (replicated), ``1 <= num_steps <= K``.
      length: ``num_steps`` as a Python int, where the caller knows it: a full call
        (``length == K``) then runs the static-trip executable when
        :attr:`static_full_calls`; None runs the traced-trip one.

    Warns:
      RecompileWarning: this call compiled the program again (a run should
        compile once); names every state/batch leaf whose shape, dtype, weak
        type or sharding differs from the first call's.
    """
    if self._jitted is None:
      self._build(state)
    assert self._jitted is not None
    if self._jitted_full is not None and self._first_signature is None:
      self._compile_both(state, batches, num_steps)
    jitted = self._jitted
    if self._jitted_full is not None and length == self.iterations_per_loop:
      jitted = self._jitted_full
    lowered = lowering_count()
    out = jitted(state, batches, num_steps)
    if lowering_count() > lowered:  # read from the (donated) arrays' metadata
      self._compiles += 1
      self._compiled_args = jax.tree.map(_abstract, (state, batches, num_steps))
      self._cost = None
      signature = call_signature(state, batches, num_steps)
      if self._first_signature is None:
        self._first_signature = signature
      else:
        warnings.warn(RecompileWarning(
            f"the train program was compiled again (compilation {self._compiles}): "
            f"{signature_change(self._first_signature, signature)}"), stacklevel=2)
    return out

  def _compile_both(self, state: Any, batches: Any, num_steps: Any) -> None:
    """Compiles the traced-trip and the static-trip executables, before the first call runs.

    ``jit(...).lower(...).compile()`` fills ``jit``'s own caches, so the calls that follow
    compile nothing (``tests/test_full_call_loop.py`` counts lowerings). Counted as two
    compilations (:meth:`compile_count`).
    """
    assert self._jitted is not None and self._jitted_full is not None
    for jitted in (self._jitted, self._jitted_full):
      jitted.lower(state, batches, num_steps).compile()
      self._compiles += 1
    self._compiled_args = jax.tree.map(_abstract, (state, batches, num_steps))
    self._cost = None
    self._first_signature = call_signature(state, batches, num_steps)

  def diverged_leaves(self, state: Any) -> list[str]:
    """Paths of the state's leaves whose copies differ between devices on the data axis.

    For the ``"per_device"`` style, whose state is replicated: a step that
    forgets ``lax.pmean(grads, data_axis)`` trains each device's copy apart
    without any error. Each device reduces every leaf's bits to a fingerprint
    (:func:`~loopkit.core.state_leaves.leaf_fingerprint`, two uint32 words); one all-reduce
    (``pmax`` and ``pmin``) of those ``[leaves, 2]`` words compares them, so the cost is one
    read of the state per device, not an all-reduce of the whole state.
    Compiled once; blocks until ``state`` is ready. Bitwise comparison: NaNs
    with the same bits agree.

    Returns:
      the leaves' one names (:func:`~loopkit._internal.checks.leaf_name`), in leaf order;
      empty when all agree.
    """
    if self._replica_check is None:
      axis = self.data_axis

      def differs(s):
        prints = jnp.stack([leaf_fingerprint(x) for x in jax.tree.leaves(s)])  # [L, 2]
        bad = jnp.any(jax.lax.pmax(prints, axis) != jax.lax.pmin(prints, axis), axis=1)
        return jax.tree.unflatten(jax.tree.structure(s), list(bad))

      self._replica_check = jax.jit(jax.shard_map(
          differs, mesh=self.mesh, in_specs=P(), out_specs=P(), check_vma=False))
    flags = jax.device_get(self._replica_check(state))
    return [leaf_name(path)
            for path, bad in jax.tree_util.tree_flatten_with_path(flags)[0] if bad]

  def lower(self, state: Any, batches: Any) -> jax.stages.Lowered:
    """Lowers the program a call would run, without running it (ahead of time).

    Args:
      state: the state pytree: arrays or ``jax.ShapeDtypeStruct`` (its shardings
        pinned as for a call: see :meth:`state_sharding_for`).
      batches: the chunk ``[K, B, ...]``: arrays or ``jax.ShapeDtypeStruct``.

    Returns:
      ``jax.stages.Lowered`` for ``(state, batches, num_steps: int32 scalar)``;
      ``.compile()`` builds the executable (:func:`loopkit.tools.aot.compile_for`).
    """
    if self._jitted is None:
      self._build(state)
    assert self._jitted is not None
    return self._jitted.lower(state, batches, jax.ShapeDtypeStruct((), jnp.int32))

  def cost_analysis(self) -> dict[str, float] | None:
    """XLA's cost analysis of the executable the calls run (the last one that compiled).

    The executable is not compiled again: lowering the program for the abstract arguments of
    the call that compiled it finds JAX's cached lowering and executable (no trace, no lowering,
    no backend compile: ``tests/test_mfu.py`` counts them). Where JAX would lower the program
    again to answer (a cache miss), nothing is compiled and None is returned.

    Returns:
      ``{"flops": ..., "bytes accessed": ..., ...}`` per device (the SPMD-partitioned program;
      a while loop's body counted once: see the module docstring), or None before the first
      call or on a cache miss. Cached until the program compiles again.
    """
    if self._cost is None:
      compiled = self.compiled()
      if compiled is not None:
        self._cost = compiled_cost(compiled)
    return self._cost

  def compiled(self) -> jax.stages.Compiled | None:
    """The executable the last compiling call built, without compiling it again.

    Found the way :meth:`cost_analysis` finds it (JAX's cached lowering and executable for that
    call's abstract arguments). ``compiled().as_text()`` is XLA's optimized HLO of the whole
    program: on GPU it shows whether the step loop runs inside a command buffer (a CUDA graph,
    ``benchmarks/gpu_exactness.py``).

    Returns:
      The ``jax.stages.Compiled``, or None before the first call or on a cache miss (where JAX
      would lower the program again).
    """
    if self._compiled_args is None or self._jitted is None:
      return None
    before = lowering_count()
    lowered = self._jitted.lower(*self._compiled_args)
    if lowering_count() > before:  # not the cached lowering: compiling would compile again
      self._compiled_args = None
      return None
    return lowered.compile()

  def flops_per_step(self) -> float | None:
    """FLOPs of one train step on one device: XLA's count, corrected for inner loops.

    XLA's count is :meth:`cost_analysis`'s ``"flops"``: the body of the step loop counts once,
    so it is one step's FLOPs for every K (plus the few FLOPs of the metric reductions after the
    loop), elementwise work included. But XLA counts every while loop's body once, so a step
    whose layers run in a ``lax.scan`` (``nnx.scan`` over stacked layers) would count one layer.
    The step's jaxpr is therefore counted too, when it is traced
    (:func:`loopkit.core.flops.jaxpr_flops`: ``dot_general`` and convolution FLOPs, inner
    ``scan`` bodies times their length; for the ``"global"`` style, on global shapes divided by
    the mesh's devices: :attr:`step_jaxpr_flops`); where it exceeds XLA's,
    :func:`loopkit.core.flops.step_flops` adds the matrix FLOPs of the inner loops' other trips
    to XLA's count. For the step style ``"per_device"`` and for sharded states alike, it is what
    one device computes.

    Returns:
      FLOPs (a float), or None before the first call, on a cache miss (see
      :meth:`cost_analysis`) or where neither count is positive.
    """
    cost = self.cost_analysis()
    if cost is None:
      return None
    return flops_lib.step_flops(cost.get("flops"), self.step_jaxpr_flops,
                                self.step_jaxpr_flops_once)

  def compile_count(self) -> int:
    """Number of times a call compiled this program (1 in a healthy run; 2 with
    :attr:`static_full_calls`, both at the first call).

    Counted from JAX's lowering events during this program's calls
    (:func:`loopkit._internal.compat.lowering_count`), not from ``jit``'s dispatch cache, which
    can hold
    two entries for one executable (seen with typed PRNG keys in the state).
    """
    return self._compiles
