"""The compiled multi-step program: up to K train steps in one device call.

One ``jax.jit`` program takes the state, a chunk of stacked batches ``[K, B, ...]``
(B = global batch, sharded on the data axis) and a run length ``n`` (int32
scalar, 1 <= n <= K), and runs ``n`` train steps in a ``lax.fori_loop`` whose
trip count is a traced value (an XLA while loop). Every call length therefore
reuses one executable: the planner can cut calls anywhere without a recompile.

Cost of the mechanism (documented, measured in ``benchmarks/``): a call of
``n < K`` steps computes only ``n`` steps, but its input chunk still has K slots,
so ``K - n`` batches of padding cross to the device for that call; calls are
only shorter than K at events, epoch ends and the tail. A dynamic trip count
also keeps XLA from unrolling the loop, which is why the step is compiled
identically for every K and final parameters are bitwise equal across K.

Two step styles:
  * ``"global"``: ``train_step`` sees global arrays (the batch sharded on the
    data axis); the program is ``jit(fori_loop(step))``.
  * ``"per_device"``: pmap style; ``train_step`` sees its device's slice
    ``[B / D, ...]`` and may use collectives over the data axis, e.g.
    ``lax.pmean(grads, "data")``; the program is
    ``jit(shard_map(fori_loop(step)))`` with the state replicated.

The state is donated and its shardings pinned (output shardings = input).
The user's step is traced exactly once per compilation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from loopkit import conv_layout, metrics as metrics_lib

StepStyle = Literal["global", "per_device"]


def tree_mismatch(expected: Any, got: Any, *, what: str,
                  check_sharding: bool = False) -> str | None:
  """Describes the first leaf where two pytrees differ, or None if they agree.

  Compares tree structure, then per leaf shape, dtype and (optionally) sharding;
  the message names the leaf path (``jax.tree_util.keystr``).
  """
  e_leaves, e_def = jax.tree_util.tree_flatten_with_path(expected)
  g_leaves, g_def = jax.tree_util.tree_flatten_with_path(got)
  if e_def != g_def:  # type: ignore[operator]  # PyTreeDef supports !=
    e_paths = [jax.tree_util.keystr(p) for p, _ in e_leaves]
    g_paths = [jax.tree_util.keystr(p) for p, _ in g_leaves]
    for a, b in zip(e_paths, g_paths):
      if a != b:
        return f"{what}: tree structure differs at leaf {a} (expected) vs {b} (got)"
    return (f"{what}: tree structure differs: expected {len(e_paths)} leaves, "
            f"got {len(g_paths)} ({e_def} vs {g_def})")
  for (path, e), (_, g) in zip(e_leaves, g_leaves):
    name = jax.tree_util.keystr(path) or "<root>"
    e_shape, g_shape = np.shape(e), np.shape(g)
    if e_shape != g_shape:
      return f"{what}: leaf {name} has shape {g_shape}, expected {e_shape}"
    e_dtype, g_dtype = _dtype(e), _dtype(g)
    if e_dtype != g_dtype:
      return f"{what}: leaf {name} has dtype {g_dtype}, expected {e_dtype}"
    if check_sharding:
      e_sh, g_sh = getattr(e, "sharding", None), getattr(g, "sharding", None)
      if e_sh is not None and g_sh is not None and not e_sh.is_equivalent_to(g_sh, len(e_shape)):
        return f"{what}: leaf {name} has sharding {g_sh}, expected {e_sh}"
  return None


def data_parallel_mesh(data_axis: str = "data", devices: Any = None) -> Mesh:
  """A 1-D mesh over ``devices`` (default: all devices) with one ``Auto`` axis.

  ``Auto`` (GSPMD propagation, as in the Flax examples) rather than jax's newer
  default ``Explicit`` axis type, so global-style steps written for ``jit``
  (gathers, scatters, reductions over the batch) work without ``reshard``.
  """
  devices = jax.devices() if devices is None else list(devices)
  return jax.make_mesh((len(devices),), (data_axis,), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,))


def is_cpu_mesh(mesh: Any) -> bool:
  """Whether ``mesh`` (a concrete ``Mesh``) is on CPU devices (XLA:CPU)."""
  return mesh.devices.flat[0].platform == "cpu"


def check_iterations_per_loop(k: Any) -> int:
  """Validates K, the steps (slots) per device call.

  Returns:
    ``k``.

  Raises:
    ValueError: ``k`` is not an int (bools are refused) or is < 1.
  """
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
    raise ValueError(f"iterations_per_loop must be an int >= 1, got {k!r}")
  if k < 1:
    raise ValueError(f"iterations_per_loop must be >= 1, got {k}")
  return int(k)


def check_step_style(style: Any) -> None:
  """Raises ValueError unless ``style`` is ``"global"`` or ``"per_device"``."""
  if style not in ("global", "per_device"):
    raise ValueError(f"step_style must be 'global' or 'per_device', got {style!r}")


def resolve_mesh(mesh: Mesh | None, data_axis: str) -> tuple[Mesh, int]:
  """The mesh to run on and its data-parallel size.

  Args:
    mesh: a mesh, or None for :func:`data_parallel_mesh` over all devices.
    data_axis: the mesh axis the batch is split over.

  Returns:
    ``(mesh, data_parallel_size)``: the size of ``data_axis``.

  Raises:
    ValueError: ``data_axis`` is not an axis of ``mesh``.
  """
  mesh = mesh if mesh is not None else data_parallel_mesh(data_axis)
  if data_axis not in mesh.axis_names:
    raise ValueError(f"data_axis {data_axis!r} is not an axis of the mesh {mesh.axis_names}")
  return mesh, mesh.shape[data_axis]


def check_global_batch_size(global_batch_size: int, data_parallel_size: int) -> None:
  """Raises ValueError unless the global batch splits evenly over the data-parallel size."""
  if global_batch_size < 1 or global_batch_size % data_parallel_size:
    raise ValueError(
        f"global batch size {global_batch_size} is not divisible by the data-parallel "
        f"size {data_parallel_size}")


def _dtype(x: Any) -> Any:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return np.asarray(x).dtype
  try:
    return np.dtype(dtype)
  except TypeError:  # an extended dtype, e.g. a new-style PRNG key's key<fry>
    return dtype


@dataclasses.dataclass(frozen=True)
class CallOutput:
  """What one device call returns besides the state (all replicated, on device).

  Attributes:
    metrics: dict of float32 scalar metrics reduced over the call's steps (and
      devices).
    traces: the same metrics per step, leaves ``[K]`` float32; entries at index
      >= n are meaningless.
    step: int scalar, the state's step counter after the call.
  """

  metrics: dict[str, metrics_lib.Metric]
  traces: dict[str, metrics_lib.Metric]
  step: jax.Array


jax.tree_util.register_dataclass(CallOutput, data_fields=["metrics", "traces", "step"],
                                 meta_fields=[])


def default_step_of(state: Any) -> jax.Array:
  """The step counter of a state: ``state.step`` or ``state["step"]``."""
  if hasattr(state, "step"):
    return state.step
  if isinstance(state, dict) and "step" in state:
    return state["step"]
  raise ValueError(
      "the train state has no step counter: give it a scalar int `step` field "
      "(attribute or dict key) or pass step_of=... to TrainLoop")


class MultiStepProgram:
  """Builds and runs the compiled multi-step program for one train step.

  Args:
    train_step: ``(state, batch) -> (state, metrics)``, pure.
    iterations_per_loop: K >= 1, slots per chunk.
    mesh: device mesh; the batch axis is sharded over ``data_axis``.
    data_axis: name of the data-parallel mesh axis.
    style: ``"global"`` or ``"per_device"`` (see module docstring).
    step_of: returns the state's scalar step counter.
    canonical_convs: rewrite the step's non-canonical convolutions (the
      gradient convolutions of conv layers) into canonical layout inside the
      loop body (:mod:`loopkit.conv_layout`): XLA:CPU otherwise runs them with
      a naive kernel in a loop body, 10-40x slower. None (default): only when
      the mesh's devices are CPUs.

  Not thread-safe; multi-host-safe (every process builds the same program).
  """

  def __init__(self, train_step: Callable, *, iterations_per_loop: int, mesh: Mesh,
               data_axis: str = "data", style: StepStyle = "global",
               step_of: Callable[[Any], jax.Array] = default_step_of,
               canonical_convs: bool | None = None):
    check_step_style(style)
    self.train_step = train_step
    self.k = check_iterations_per_loop(iterations_per_loop)
    self.mesh = mesh
    self.data_axis = data_axis
    self.style = style
    self.step_of = step_of
    if canonical_convs is None:
      canonical_convs = is_cpu_mesh(mesh)
    self.canonical_convs = bool(canonical_convs)
    self.trace_count = 0
    self._jitted = None
    self._replica_check: Callable[[Any], Any] | None = None
    self.state_shardings = None

  @property
  def batch_sharding(self) -> NamedSharding:
    """Sharding of a chunk leaf ``[K, B, ...]``: B split over the data axis."""
    return NamedSharding(self.mesh, P(None, self.data_axis))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def state_sharding_for(self, state: Any) -> Any:
    """Pinned shardings for a state: kept if already on this mesh, else replicated."""
    def pick(x):
      sh = getattr(x, "sharding", None)
      if (self.style == "global" and isinstance(sh, NamedSharding)
          and sh.mesh == self.mesh and getattr(x, "committed", True)):
        return sh
      return self.replicated
    return jax.tree.map(pick, state)

  # -- tracing ---------------------------------------------------------------

  def _loop(self, state, batches, num_steps):
    """The traced body: fori_loop over the step with a dynamic trip count."""
    self.trace_count += 1
    batch0 = jax.tree.map(lambda x: x[0], batches)

    def step_fn(s, b):
      new_s, m = self.train_step(s, b)
      if not isinstance(m, dict):
        raise TypeError(f"train_step must return (state, metrics: dict), got {type(m)}")
      out = {}
      for k, v in m.items():
        try:
          out[k] = metrics_lib.as_metric(v)
        except ValueError as e:
          raise ValueError(f"train_step metric {k!r}: {e}") from None
      return new_s, out

    closed, (out_state_shape, metric_shape) = jax.make_jaxpr(
        step_fn, return_shape=True)(state, batch0)
    problem = tree_mismatch(state, out_state_shape,
                            what="train_step returned a state unlike the one it received")
    if problem:
      raise ValueError(problem)
    run_step = (conv_layout.canonicalize_convs(closed) if self.canonical_convs
                else jax.extend.core.jaxpr_as_fun(closed))
    out_def = jax.tree.structure((out_state_shape, metric_shape))

    traces0 = jax.tree.map(lambda s: jnp.zeros((self.k,) + s.shape, s.dtype), metric_shape)

    def body(i, carry):
      s, traces = carry
      b = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), batches)
      flat = run_step(*jax.tree.leaves((s, b)))
      new_s, m = jax.tree.unflatten(out_def, flat)
      traces = jax.tree.map(lambda buf, v: buf.at[i].set(v), traces, m)
      return new_s, traces

    state, traces = jax.lax.fori_loop(0, num_steps, body, (state, traces0))
    if self.style == "per_device":
      traces = metrics_lib.reduce_devices(traces, self.data_axis)
    reduced = metrics_lib.reduce_steps(traces, num_steps)
    return state, CallOutput(metrics=reduced, traces=traces, step=self.step_of(state))

  def _build(self, state):
    self.state_shardings = self.state_sharding_for(state)
    if self.style == "per_device":
      fn = jax.shard_map(self._loop, mesh=self.mesh,
                         in_specs=(P(), P(None, self.data_axis), P()),
                         out_specs=(P(), P()), check_vma=False)
    else:
      fn = self._loop
    self._jitted = jax.jit(
        fn, donate_argnums=(0,),
        in_shardings=(self.state_shardings, self.batch_sharding, self.replicated),
        out_shardings=(self.state_shardings, self.replicated))

  def place_state(self, state: Any) -> Any:
    """Puts ``state`` on the mesh with the pinned shardings (explicit transfer).

    Leaves that are one and the same array get separate buffers (the state is
    donated, and a buffer can be donated once)."""
    if self._jitted is None:
      self._build(state)
    placed = jax.device_put(state, self.state_shardings)
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

  def __call__(self, state: Any, batches: Any, num_steps: jax.Array) -> tuple[Any, CallOutput]:
    """Runs ``num_steps`` steps (device int32 scalar) over ``batches`` ``[K, B, ...]``.

    Dispatches asynchronously; ``state`` is donated.
    """
    if self._jitted is None:
      self._build(state)
    assert self._jitted is not None
    return self._jitted(state, batches, num_steps)

  def diverged_leaves(self, state: Any) -> list[str]:
    """Paths of the state's leaves whose copies differ between devices on the data axis.

    For the ``"per_device"`` style, whose state is replicated: a step that
    forgets ``lax.pmean(grads, data_axis)`` trains each device's copy apart
    without any error. Compiled once (a ``pmax``/``pmin`` per leaf on the
    devices); blocks until ``state`` is ready. NaNs in the same places agree.

    Returns:
      ``jax.tree_util.keystr`` paths, in leaf order; empty when all agree.
    """
    if self._replica_check is None:
      axis = self.data_axis

      def differs(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
          x = jax.random.key_data(x)
        if x.dtype == jnp.bool_:
          x = x.astype(jnp.int8)
        parts = [x]
        if jnp.issubdtype(x.dtype, jnp.inexact):  # XLA's max/min all-reduce skips NaNs
          nan = jnp.isnan(x)
          parts = [jnp.where(nan, jnp.zeros_like(x), x), nan.astype(jnp.int8)]
        return jnp.logical_not(jnp.all(jnp.stack([
            jnp.all(jax.lax.pmax(p, axis) == jax.lax.pmin(p, axis)) for p in parts])))

      self._replica_check = jax.jit(jax.shard_map(
          lambda s: jax.tree.map(differs, s), mesh=self.mesh, in_specs=P(), out_specs=P(),
          check_vma=False))
    flags = jax.device_get(self._replica_check(state))
    return [jax.tree_util.keystr(path) or "<root>"
            for path, bad in jax.tree_util.tree_flatten_with_path(flags)[0] if bad]

  def lower(self, state: Any, batches: Any) -> jax.stages.Lowered:
    """Lowers the program a call would run, without running it (ahead of time).

    Args:
      state: the state pytree: arrays or ``jax.ShapeDtypeStruct`` (its shardings
        pinned as for a call: see :meth:`state_sharding_for`).
      batches: the chunk ``[K, B, ...]``: arrays or ``jax.ShapeDtypeStruct``.

    Returns:
      ``jax.stages.Lowered`` for ``(state, batches, num_steps: int32 scalar)``;
      ``.compile()`` builds the executable (:func:`loopkit.aot.compile_for`).
    """
    if self._jitted is None:
      self._build(state)
    assert self._jitted is not None
    return self._jitted.lower(state, batches, jax.ShapeDtypeStruct((), jnp.int32))

  def compile_count(self) -> int:
    """Number of executables compiled for this program (1 in a healthy run)."""
    return 0 if self._jitted is None else self._jitted._cache_size()
