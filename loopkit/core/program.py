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

The step compiles alike for every K. A chunk of K = 1 has a size-1 slot axis, and XLA
folds a dynamic slice of a size-1 axis into a plain reshape: the batch becomes
loop-invariant, while-loop invariant code motion hoists the step's batch-only work out
of the loop (one-hot labels, the input's f32 conversion, the batch statistics of a
BatchNorm on the input) and the body left behind is fused differently, which in
float16/bfloat16 changes results in the last bits (a Flax ResNet-18
at K = 1 differed from K = 2, 3, 4, 13 and ``jax.pmap``, which agree bitwise). So the
body is compiled for at least ``MIN_SLOTS = 2`` slots: the feeder forms K = 1 chunks
with one zero slot on the host (``[2, B, ...]``; the slot is never run), the program
keeps a 2-slot metric trace and returns its first slot, and a ``[1, B, ...]`` chunk
given to the program directly is padded on the device (:func:`pad_slots`, a copy of one
batch per call). The K = 1 loop body is then the K = 2 body, instruction for instruction
(``tests/test_k_invariance.py`` compares the optimized HLO).
``lax.optimization_barrier`` around the step was not used: it stops the hoisting but
XLA:CPU expands barriers before fusion, so the slot slice still fused differently at
K = 1, and it cost a dispatch-bound step about 30% at K = 100
(``benchmarks/k1_slot_cost.py`` has the padding's cost).

The step compiles as a per-step ``jit`` does. XLA's while-loop invariant code motion moves what
does not change between iterations out of a loop body: the partition-index arithmetic of
sharded code, an ``iota`` mask, the broadcast cotangent of a mean loss. The body then reads them
as loop inputs where a per-step ``jit`` of the same step sees constants, and is simplified and
fused differently: a small sharded Transformer LM on a (2, 2, 2) mesh, batch on
``("data", "fsdp")``, ended 5 float32 steps with 17 of its 20 state leaves up to 1.34e-7 (jax
0.10.2) or 8.94e-8 (jax 0.12) from a per-step ``jit`` with the same shardings, every K alike
(``tests/test_sharded_exactness.py``; more models and meshes in docs/concepts.md, "Exactness on
sharded meshes"). The step loop's while instruction is therefore tagged to keep its body whole
(:func:`no_hoisting`, through ``jax.experimental.xla_metadata``); loops inside the step keep
the pass. Every K then gives the per-step ``jit``'s bits. The cost is recomputing those values
each step, as the per-step ``jit`` does: 4,096 FLOPs more and 14.5 KB fewer bytes per step of a
195 MFLOP sharded LM step, no time this CPU could resolve (``benchmarks/loop_hoisting_cost.py``).
Tried and not kept: ``with_sharding_constraint`` on the carry at the top and bottom of the body,
an ``optimization_barrier`` around the step, ``with_layout_constraint`` of the carry to the
default layouts: alone or together they left 53 or 54 of a 2-block LM's 56 leaves off.

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

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from loopkit import conv_layout, metrics as metrics_lib
from loopkit._internal.checks import (
  MIN_SLOTS,
  RecompileWarning,
  call_signature,
  check_data_axis,
  check_iterations_per_loop,
  check_not_deleted,
  check_step_style,
  default_step_of,
  leaf_name,
  signature_change,
  tree_mismatch,
)
from loopkit._internal.compat import lowering_count
from loopkit._internal.mesh import batch_sharding, is_cpu_mesh, pinned_state_shardings
from loopkit.core import flops as flops_lib

StepStyle = Literal["global", "per_device"]
FullCallLoop = Literal["auto", "traced", "static"]
FULL_CALL_LOOPS = ("auto", "traced", "static")


def resolve_full_call_loop(full_call_loop: str, mesh: Mesh) -> str:
  """``"traced"`` or ``"static"``: ``full_call_loop`` with ``"auto"`` decided for ``mesh``.

  ``"auto"`` is ``"static"`` where the mesh's devices are GPUs (XLA:GPU drives a loop with a
  traced trip count from the host: :class:`MultiStepProgram`), else ``"traced"``.

  Raises:
    ValueError: any other value, named.
  """
  if full_call_loop not in FULL_CALL_LOOPS:
    raise ValueError(f"full_call_loop={full_call_loop!r}; expected one of {FULL_CALL_LOOPS}")
  if full_call_loop != "auto":
    return full_call_loop
  platforms = {d.platform for d in mesh.devices.flat}
  return "static" if platforms and platforms <= {"gpu", "cuda", "rocm"} else "traced"

_set_xla_metadata: Callable[..., Any] | None
try:  # public, experimental (jax 0.10.2 and 0.12 have it); set_xla_metadata(x, **attrs) tags
  # the op that produces x
  from jax.experimental.xla_metadata import set_xla_metadata as _set_xla_metadata
except ImportError:  # pragma: no cover
  _set_xla_metadata = None



def pad_slots(chunk: Any) -> Any:
  """A traced chunk ``[K, ...]`` with zero slots appended up to ``MIN_SLOTS`` slots.

  For a ``fori_loop`` over a chunk's slots inside ``jit``: the loop body then
  never slices a size-1 slot axis, which XLA would fold away and compile the
  body differently for K = 1 (see the module docstring). The appended slots
  are never run (the trip count is at most K).

  Args:
    chunk: pytree of traced arrays with leading axis K (all leaves alike).

  Returns:
    The chunk with leading axis ``max(K, MIN_SLOTS)``.
  """
  def pad(x):
    extra = MIN_SLOTS - x.shape[0]
    if extra <= 0:
      return x
    return jnp.concatenate([x, jnp.zeros((extra,) + x.shape[1:], x.dtype)])
  return jax.tree.map(pad, chunk)


def run_slots(body: Callable[[Any, Any, Any], Any], chunk: Any, num_steps: Any,
              init: Any, *, trips: int | None = None) -> Any:
  """``carry = body(i, chunk[i], carry)`` for ``i < num_steps``: the loop of every loopkit program.

  A ``lax.fori_loop`` with a traced trip count over a chunk's slots (so every call length
  reuses one executable), the chunk padded to ``MIN_SLOTS`` slots first (:func:`pad_slots`) so
  that K = 1 compiles the body of K = 2, the loop tagged so that XLA keeps its body whole
  (:func:`no_hoisting`: the body compiles as a per-step ``jit``). The training program and the
  :class:`~loopkit.evaluation.Evaluator` both run their step through it.

  Args:
    body: ``(i, slot, carry) -> carry``; ``slot`` is the chunk's leaves at slot ``i``
      (``[B, ...]``).
    chunk: traced pytree of ``[K, B, ...]`` leaves.
    num_steps: traced int32 scalar, ``1 <= num_steps <= K``.
    init: the initial carry.
    trips: a static trip count (a Python int, ``1 <= trips <= K``) instead of ``num_steps``
      (then unused): the loop of a full call on GPU, which XLA:GPU runs without reading the
      loop predicate back to the host every step (:class:`MultiStepProgram`,
      ``full_call_loop``).

  Returns:
    The final carry.
  """
  chunk = pad_slots(chunk)

  def step(i, carry):
    return body(i, jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False),
                                chunk), carry)

  upper = num_steps if trips is None else trips
  return no_hoisting(jax.lax.fori_loop(0, upper, step, init))


# XLA's frontend attribute that turns off its while-loop invariant code motion for one loop
# (xla/service/while_loop_invariant_code_motion.cc reads it from the while instruction).
NO_HOISTING_ATTRIBUTE = "_xla_disable_loop_instr_hoisting"


def no_hoisting(loop_outputs: Any) -> Any:
  """The outputs of a ``lax.fori_loop``, its XLA while loop marked to keep its body whole.

  XLA's while-loop invariant code motion moves what does not change between iterations
  (constants, masks built from ``iota``, the partition-index arithmetic of sharded code, the
  broadcast cotangent of a mean) out of the loop body into the loop's carry. The body then reads
  those values as opaque loop inputs where a per-step ``jit`` of the same step sees constants,
  and XLA simplifies and fuses it differently, which changes float32 results in the last bits
  (see the module docstring, "The step compiles as a per-step jit does"). Tagging the while
  instruction with :data:`NO_HOISTING_ATTRIBUTE` (``jax.experimental.xla_metadata``, attached
  to the op that produces the outputs: the loop) turns the pass off for this loop only; the
  loops inside the user's step keep it.

  Args:
    loop_outputs: the pytree ``lax.fori_loop`` returned (traced).

  Returns:
    The same values (an identity), or ``loop_outputs`` itself where this JAX has no
    ``set_xla_metadata``.
  """
  if _set_xla_metadata is None:
    return loop_outputs
  return _set_xla_metadata(loop_outputs, **{NO_HOISTING_ATTRIBUTE: True})


def build_program(loop: Callable, *, mesh: Mesh, data_axis: str | tuple[str, ...],
                  style: StepStyle,
                  **jit_kwargs: Any) -> Any:
  """``jax.jit`` of ``loop(state, chunk, num_steps)``, the builder of every loopkit program.

  ``"global"`` style: ``jit(loop)``. ``"per_device"``: ``jit(shard_map(loop))`` with the state
  and ``num_steps`` replicated, the chunk ``[K, B, ...]`` split on ``data_axis`` (over the
  product of its axes for a tuple) and every output replicated (the loop reduces over the data
  axis itself).

  Args:
    loop: the traced function, usually a :func:`run_slots` over a step.
    mesh: the device mesh.
    data_axis: the mesh axis the batch is split over, or a tuple of them (checked:
      :func:`loopkit._internal.mesh.resolve_mesh`).
    style: ``"global"`` or ``"per_device"``.
    **jit_kwargs: passed to ``jax.jit`` (shardings, ``donate_argnums``).

  Returns:
    The ``jax.jit``-wrapped program.
  """
  fn = loop
  if style == "per_device":
    fn = jax.shard_map(loop, mesh=mesh,
                       in_specs=(P(), batch_sharding(mesh, data_axis).spec, P()),
                       out_specs=P(), check_vma=False)
  return jax.jit(fn, **jit_kwargs)


def as_loop_leaf(x: Any) -> Any:
  """A state leaf as the loop places it: a Python scalar (``TrainState.create``'s ``step=0``)
  becomes the strong array :func:`strong_typed` makes of it (``int`` -> int32, ``float`` ->
  float32); anything else (``jax.Array``, numpy arrays and scalars, ``jax.ShapeDtypeStruct``) is
  returned as it is. Lets code that reads leaves' shapes and dtypes (warm start, restore) take
  every state the loop takes."""
  if isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic):
    x = jnp.asarray(x)
    return jax.lax.convert_element_type(x, x.dtype)
  return x


def strong_typed(tree: Any) -> Any:
  """``tree`` with its weak-typed leaves made strong, same dtype and placement.

  A Python scalar or ``jnp.asarray(1.0)`` is a *weak-typed* float32; most
  steps return such a leaf strong (``jnp.float32`` arithmetic with a strong
  operand), and a jitted program is specialised on weak types, so a weak leaf
  in the state compiles the program a second time on the next call.

  Args:
    tree: a pytree of arrays and scalars.

  Returns:
    The pytree with every weak-typed leaf (Python scalars included) replaced
    by a strong array of the dtype JAX gives it (``jnp.asarray(1.0)`` ->
    float32); other leaves unchanged (the same objects).
  """
  def strong(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if x.weak_type else x
    x = as_loop_leaf(x)
    if getattr(x, "weak_type", False):
      return jax.lax.convert_element_type(x, x.dtype)
    return x
  return jax.tree.map(strong, tree)


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


@dataclasses.dataclass(frozen=True)
class CallOutput:
  """What one device call returns besides the state (all replicated, on device).

  The call's metrics are not reduced over its steps here: the host folds the traces in step
  order (:func:`loopkit.metrics.fold_steps`), so a reported value does not depend on where
  the calls were cut.

  Attributes:
    traces: the step's metrics per step, leaves ``[K]`` float32 (reduced over the devices in
      each step, for per-device steps); entries at index >= n hold zeros.
    nonfinite: int32 ``[M]``, per metric in ``sorted(traces)`` order, the 1-based index in
      the call of its first step with a NaN or infinite field, or 0
      (:func:`loopkit.metrics.first_nonfinite`; fetched with ``step`` at every call).
    step: int scalar, the state's step counter after the call.
  """

  traces: dict[str, metrics_lib.Metric]
  nonfinite: jax.Array
  step: jax.Array


jax.tree_util.register_dataclass(CallOutput, data_fields=["traces", "nonfinite", "step"],
                                 meta_fields=[])


def _describe_output(x: Any) -> str:
  """A short description of a traced step output: its type, and shape/dtype if an array."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"an array of shape {tuple(x.shape)} dtype {x.dtype}"
  if isinstance(x, dict):
    return f"a dict with keys {sorted(map(str, x))[:6]}"
  return f"a {type(x).__name__}"


def unpack_step_output(out: Any, state: Any) -> tuple[Any, dict]:
  """Checks what ``train_step`` returned: ``(new_state, metrics: dict)``.

  Raises:
    TypeError: naming what was returned and what is expected, for the first
      mistakes people make: the state alone, a 1-tuple, ``(state, loss)``
      with a bare loss, or ``(loss, state)`` in the wrong order.
  """
  expected = ("train_step must return (new_state, metrics) with metrics a dict of "
              "scalars, e.g. `return new_state, {'loss': loss}`")
  if not isinstance(out, tuple) or len(out) != 2:
    if isinstance(out, tuple):
      got = f"a tuple of {len(out)}: ({', '.join(_describe_output(x) for x in out[:4])})"
    elif jax.tree.structure(out) == jax.tree.structure(state):  # type: ignore[operator]
      got = "only a state (no metrics)"
    else:
      got = _describe_output(out)
    raise TypeError(f"{expected}; it returned {got}")
  new_state, metrics = out
  state_def = jax.tree.structure(state)
  if (jax.tree.structure(metrics) == state_def  # type: ignore[operator]
      and jax.tree.structure(new_state) != state_def):  # type: ignore[operator]
    raise TypeError(f"{expected}; the state and the metrics look swapped: its first element is "
                    f"{_describe_output(new_state)} and its second has the state's structure")
  if not isinstance(metrics, dict):
    hint = ""
    if hasattr(metrics, "shape") and not getattr(metrics, "shape", (1,)):
      hint = " (a bare scalar: wrap it, {'loss': loss})"
    raise TypeError(f"{expected}; its second element is {_describe_output(metrics)}{hint}")
  return new_state, metrics


def leaf_fingerprint(x: jax.Array) -> jax.Array:
  """Two uint32 words that summarise the bits of an array (any dtype, typed PRNG keys too).

  Word 0 is ``sum(u[i] * (2 i + 1))`` and word 1 ``sum((u[i] ^ (u[i] >> 15)) *
  (2654435761 i | 1))``, modulo 2**32, over the array's bits ``u`` as uint32
  (8- and 16-bit elements widened, 64-bit ones split in two words). Equal arrays
  give equal words; a change of any element changes word 0 unless it is a
  multiple of 2**32 apart in that weighted sum, and both words collide only by
  accident (the weights differ per position, so permutations are caught too).
  Traceable (used inside :meth:`MultiStepProgram.diverged_leaves`).
  """
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  width = jnp.dtype(x.dtype).itemsize
  u = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32,
                                       8: jnp.uint32}[width]).astype(jnp.uint32).reshape(-1)
  i = jax.lax.iota(jnp.uint32, u.size)
  w0 = i * jnp.uint32(2) + jnp.uint32(1)
  w1 = (i * jnp.uint32(2654435761)) | jnp.uint32(1)
  return jnp.stack([jnp.sum(u * w0, dtype=jnp.uint32),
                    jnp.sum((u ^ (u >> jnp.uint32(15))) * w1, dtype=jnp.uint32)])


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
      the device. Both executables run the same loop body (:func:`run_slots`), so results are
      bitwise equal either way on CPU (``tests/test_full_call_loop.py``); on a GPU, check with
      ``benchmarks/gpu_exactness.py``.

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
    (:func:`strong_typed`), the type the compiled loop returns, so the second
    call does not compile the program again. Leaves that are one and the same
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
    (:func:`leaf_fingerprint`, two uint32 words); one all-reduce (``pmax`` and
    ``pmin``) of those ``[leaves, 2]`` words compares them, so the cost is one
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
