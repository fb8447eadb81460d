"""The step loop every loopkit program runs: a ``lax.fori_loop`` over a chunk's slots.

:func:`run_slots` runs a step over the slots of a chunk ``[K, B, ...]`` with a traced trip count
(every call length reuses one executable) or, for a full call on GPU, a static one
(:func:`resolve_full_call_loop`); :func:`build_program` wraps such a loop in ``jax.jit`` (in
``shard_map`` first for the ``"per_device"`` style). The train program
(:class:`loopkit.core.program.MultiStepProgram`) and the :class:`~loopkit.evaluation.Evaluator`
both run their step through it. Pure JAX, no state; thread-safe.

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

"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from loopkit._internal.checks import MIN_SLOTS
from loopkit._internal.mesh import batch_sharding

StepStyle = Literal["global", "per_device"]
FullCallLoop = Literal["auto", "traced", "static"]
FULL_CALL_LOOPS = ("auto", "traced", "static")


def resolve_full_call_loop(full_call_loop: str, mesh: Mesh) -> str:
  """``"traced"`` or ``"static"``: ``full_call_loop`` with ``"auto"`` decided for ``mesh``.

  ``"auto"`` is ``"static"`` where the mesh's devices are GPUs (XLA:GPU drives a loop with a
  traced trip count from the host: :class:`~loopkit.core.program.MultiStepProgram`), else
  ``"traced"``.

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
