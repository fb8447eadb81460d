"""Ahead-of-time compilation for a TPU topology, on a machine without one.

:func:`compile_for` compiles exactly the program(s) ``TrainLoop.run`` would
dispatch (the train program of K steps over a chunk ``[K, B, ...]``, with its
shardings and the state donated; and an :class:`~loopkit.Evaluator`'s program
when one is given) from abstract state and batch specs (``jax.ShapeDtypeStruct``
trees, no data), for a named TPU topology (through ``libtpu``'s compile-only
devices: ``pip install 'loopkit[tpu]'``) or for the local devices. It returns an
:class:`AotReport`: per-device bytes from XLA's memory analysis, the chip's HBM
and the headroom, FLOPs per step from XLA's cost analysis, and a roofline lower
bound on the step time at the chip's peak bf16 rate (with, beside it, XLA's
estimate of the HBM traffic at the chip's bandwidth, and the MFU: a measured step
time ``t`` gives ``compute bound / t``, the ``throughput/mfu`` that
:class:`~loopkit.observe.LoggingHook` logs on the chip).

What a report proves: the program compiles for that topology with those
shardings, and XLA's buffer assignment fits the chip's HBM. What it does not:
the speed. The step time is a lower bound (peak FLOP/s, peak bandwidth, no
communication time, no input pipeline), not a measurement.

Counting notes (checked in ``tests/test_aot.py``): XLA's cost analysis counts
a while loop's body once, whatever its trip count, so the FLOPs of the
K-step program are the FLOPs of one step (plus the small reductions of the
metrics after the loop), the same for every K; the numbers are per device
(the SPMD-partitioned program).

Example::

  report = loopkit.tools.aot.compile_for(loop, state_spec, batch_spec, topology="v5e:2x2")
  print(report)
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from loopkit._internal.checks import (
  MIN_SLOTS,
  check_data_axis,
  check_global_batch_size,
  data_axes,
  leaf_name,
)
from loopkit._internal.mesh import data_parallel_size, describe_data_axis, is_sharding_entry
from loopkit.core.flops import step_flops
from loopkit.core.program import MultiStepProgram, compiled_cost
from loopkit.data.assembly import chunk_buffers_in_flight
from loopkit.evaluation import Evaluator
from loopkit.tools.topology import Chip, GiB, chip_of, topology_devices


class ProgramDoesNotFitError(ValueError):
  """A compiled program needs more bytes per device than the chip's HBM."""


@dataclasses.dataclass(frozen=True)
class ProgramReport:
  """Memory and cost of one compiled program, per device.

  Bytes are XLA's ``memory_analysis()`` of the compiled SPMD program (one
  device's share); FLOPs and bytes accessed are its ``cost_analysis()``, in
  which a while loop's body counts once: for the K-step program that is one
  step. The train program's FLOPs are the step's jaxpr count instead where that is
  higher (an inner ``scan`` over layers, which XLA also counts once:
  :meth:`loopkit.core.MultiStepProgram.flops_per_step`).

  Attributes:
    name: ``"train"`` or ``"eval"``.
    iterations_per_loop: K; the chunk is ``[max(K, 2), B, ...]`` (K = 1 has one zero slot).
    global_batch_size: B (examples per step over all devices).
    per_device_batch: B / data-parallel size.
    argument_bytes: the state, the chunk and the step count.
    output_bytes: the new state and the call's metrics.
    alias_bytes: outputs that reuse donated argument buffers (the state).
    temp_bytes: temporaries (activations, gradients, the loop carry).
    generated_code_bytes: the executable's code.
    peak_bytes: ``argument + output - alias + temp`` (MaxText's
      ``train_compile`` total).
    chunk_bytes: one input chunk (part of ``argument_bytes``).
    prefetch_chunks: chunks the feeder holds on the device besides the
      running call's (the loop's ``prefetch``).
    used_bytes: ``peak_bytes + prefetch_chunks * chunk_bytes``.
    hbm_bytes: the chip's HBM (None off TPU unless given).
    headroom_bytes: ``hbm_bytes - used_bytes`` (negative: does not fit).
    flops_per_step: FLOPs of one step (one eval batch), per device (the train program's as
      :meth:`loopkit.core.MultiStepProgram.flops_per_step` counts them).
    bytes_accessed_per_step: HBM bytes read and written per step, per device
      (XLA's estimate).
    compute_bound_secs: ``flops_per_step / peak_bf16_flops``.
    memory_secs: ``bytes_accessed_per_step / hbm_bytes_per_sec``: XLA's
      estimate of the HBM traffic at peak bandwidth. Indicative, not a bound
      (the estimate can be above or below the real traffic); when it exceeds
      the compute bound, the step is likely memory-bound.
    step_secs: the roofline lower bound at the chip's peak bf16 rate,
      ``compute_bound_secs``; None without a chip.
    mfu_ceiling: the MFU (bf16) the program could reach if XLA's HBM traffic estimate is
      real: ``compute_bound_secs / max(compute_bound_secs, memory_secs)``, 1 when the compute
      bound is the longer (a program running at its compute bound has MFU 1 by definition);
      None without a chip. A measured step of ``t`` seconds has MFU
      ``compute_bound_secs / t`` (what :class:`~loopkit.observe.LoggingHook`'s
      ``throughput/mfu`` reports on the chip, from the same cost analysis and peak).
    examples_per_sec: ``global_batch_size / step_secs`` (an upper bound).
    compile_secs: wall time of ``lower().compile()`` on this machine.
    trace_count: times the step was traced for this program (1).
    executable: the ``jax.stages.Compiled``.
  """

  name: str
  iterations_per_loop: int
  global_batch_size: int
  per_device_batch: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  generated_code_bytes: int
  peak_bytes: int
  chunk_bytes: int
  prefetch_chunks: int
  used_bytes: int
  hbm_bytes: int | None
  headroom_bytes: int | None
  flops_per_step: float
  bytes_accessed_per_step: float
  compute_bound_secs: float | None
  memory_secs: float | None
  step_secs: float | None
  examples_per_sec: float | None
  mfu_ceiling: float | None
  compile_secs: float
  trace_count: int
  executable: Any = dataclasses.field(default=None, repr=False, compare=False)

  @property
  def device_chunk_bytes(self) -> int:
    """Input chunks a :class:`~loopkit.TrainLoop` holds on one device at once, in bytes:
    :func:`loopkit.data.assembly.chunk_buffers_in_flight` (``prefetch + 3``) x
    :attr:`chunk_bytes`, the figure a run checks against the device's memory (with the
    state) before its first step, and the tuner's ``device chunks`` column."""
    return chunk_buffers_in_flight(self.prefetch_chunks) * self.chunk_bytes


@dataclasses.dataclass(frozen=True)
class AotReport:
  """What :func:`compile_for` compiled, for which devices, and what it costs.

  Attributes:
    topology: the name asked for (``"local"`` for the local devices).
    chip: the :class:`Chip`, or None (CPU/GPU devices).
    num_devices: devices in the mesh (chips, for a TPU topology).
    num_processes: host processes of the slice (distinct ``process_index``).
    mesh_shape: the mesh's axis sizes by name.
    programs: ``{"train": ProgramReport, "eval": ProgramReport}`` (eval only
      when an evaluator was given), one executable each.
  """

  topology: str
  chip: Chip | None
  num_devices: int
  num_processes: int
  mesh_shape: dict[str, int]
  programs: dict[str, ProgramReport]

  @property
  def train(self) -> ProgramReport:
    return self.programs["train"]

  def to_dict(self) -> dict[str, Any]:
    """The report as JSON-ready data (without the executables)."""
    return {"topology": self.topology, "chip": None if self.chip is None else
            dataclasses.asdict(self.chip), "num_devices": self.num_devices,
            "num_processes": self.num_processes, "mesh_shape": self.mesh_shape,
            "programs": {k: {f.name: getattr(p, f.name) for f in dataclasses.fields(p)
                             if f.name != "executable"} for k, p in self.programs.items()}}

  def __str__(self) -> str:
    gib = _fmt_bytes
    chip = self.chip
    head = (f"AOT report: {self.topology}, {self.num_devices} devices"
            f" ({self.num_processes} host{'s' if self.num_processes > 1 else ''}), mesh "
            f"{self.mesh_shape}" + (f", chip {chip.name}: {chip.hbm_bytes / GiB:.1f} GiB HBM, "
                                    f"{chip.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16, "
                                    f"{chip.hbm_bytes_per_sec / 1e9:.0f} GB/s ({chip.source})"
                                    if chip else ", no chip numbers (not a known TPU)"))
    lines = [head, "per device:"]
    for p in self.programs.values():
      lines += [
          f"  {p.name}: K={p.iterations_per_loop}, batch {p.global_batch_size} "
          f"({p.per_device_batch} per device), compiled in {p.compile_secs:.1f} s",
          f"    arguments {gib(p.argument_bytes)} (chunk {gib(p.chunk_bytes)}), "
          f"temporaries {gib(p.temp_bytes)}, outputs {gib(p.output_bytes)}, "
          f"aliased {gib(p.alias_bytes)}, code {gib(p.generated_code_bytes)}",
          f"    used {gib(p.used_bytes)} (= arguments + outputs - aliased + temporaries"
          f" + {p.prefetch_chunks} prefetched chunks)" + (
              f" of HBM {gib(p.hbm_bytes)}: headroom {gib(p.headroom_bytes)}"
              if p.hbm_bytes is not None else ""),
          f"    {p.flops_per_step:.4g} FLOPs and {p.bytes_accessed_per_step:.4g} bytes accessed "
          f"per {'step' if p.name == 'train' else 'batch'}"]
      if p.step_secs is not None:
        unit = "step" if p.name == "train" else "batch"
        mem_rate = p.global_batch_size / p.memory_secs if p.memory_secs else float("inf")
        lines += [
            f"    roofline: >= {p.step_secs * 1e3:.4g} ms per {unit} at peak bf16, i.e. <= "
            f"{p.examples_per_sec:,.0f} examples/s (a bound, not a measurement)",
            f"    XLA's HBM traffic estimate at peak bandwidth: {(p.memory_secs or 0.0) * 1e3:.4g}"
            f" ms per {unit} (<= {mem_rate:,.0f} examples/s if that traffic is real)"]
        if p.mfu_ceiling is not None:
          lines.append(f"    MFU (bf16 peak): 100% at the compute bound; a measured {unit} of t ms "
                       f"runs at MFU {p.step_secs * 1e3:.4g} ms / t; at most "
                       f"{p.mfu_ceiling * 100:.3g}% if XLA's HBM traffic estimate is real")
    return "\n".join(lines)


def _fmt_bytes(b: int | None) -> str:
  if b is None:
    return "-"
  if abs(b) >= GiB:
    return f"{b / GiB:.3f} GiB"
  return f"{b / 2**20:.2f} MiB" if abs(b) >= 2**20 else f"{b} bytes"


def _spec(x: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def _onto(state: Any, mesh: Mesh) -> Any:
  """Abstract state on ``mesh``: a leaf's ``NamedSharding`` is carried over (same
  spec on the target mesh) when the mesh has its axes; other leaves are left
  without a sharding, which the program replicates (as ``run`` does)."""
  def leaf(x):
    sh = getattr(x, "sharding", None)
    if isinstance(sh, NamedSharding):
      axes = {a for part in sh.spec if part is not None
              for a in (part if isinstance(part, tuple) else (part,))}
      if axes <= set(mesh.axis_names):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=NamedSharding(mesh, sh.spec))
    return _spec(x)
  return jax.tree.map(leaf, state)


def _batch_size(batch: Any, what: str) -> int:
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not leaves:
    raise ValueError(f"the {what} batch spec has no leaves")
  sizes = {leaf_name(p): (np.shape(x)[0] if np.ndim(x) else None) for p, x in leaves}
  if len(set(sizes.values())) != 1 or None in sizes.values():
    raise ValueError(f"every leaf of the {what} batch spec needs the same leading batch "
                     f"dimension B (the global batch); got {sizes}")
  size = next(iter(sizes.values()))
  assert size is not None  # checked above
  return int(size)


def _chunk(batch: Any, k: int) -> Any:
  """The chunk spec a run feeds: ``max(K, MIN_SLOTS)`` slots (K = 1: a zero slot, feeding.py)."""
  slots = max(k, MIN_SLOTS)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((slots,) + tuple(np.shape(x)), x.dtype),
                      batch)


def _nbytes(tree: Any, devices: int) -> int:
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree)) // devices


def _report(name: str, lowered: Any, traced: Any, *, k: int, batch_size: int, dp: int,
            chunk_bytes: int, prefetch: int, chip: Chip | None,
            hbm_bytes: int | None) -> ProgramReport:
  t0 = time.perf_counter()
  compiled = lowered.compile()
  secs = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  cost = compiled_cost(compiled)
  arg, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
  alias, temp = mem.alias_size_in_bytes, mem.temp_size_in_bytes
  peak = arg + out - alias + temp
  used = peak + prefetch * chunk_bytes
  # XLA's count, or the step's jaxpr's where XLA counted an inner scan's body once (the train
  # program: MultiStepProgram.flops_per_step's rule)
  flops = step_flops(cost.get("flops"), getattr(traced, "step_jaxpr_flops", None),
                     getattr(traced, "step_jaxpr_flops_once", None)) or 0.0
  accessed = float(cost.get("bytes accessed", 0.0))
  compute = memory = rate = ceiling = None
  if chip is not None:
    compute = flops / chip.peak_bf16_flops
    memory = accessed / chip.hbm_bytes_per_sec
    rate = batch_size / compute if compute > 0 else None
    ceiling = compute / max(compute, memory) if compute > 0 else None
  return ProgramReport(
      name=name, iterations_per_loop=k, global_batch_size=batch_size,
      per_device_batch=batch_size // dp, argument_bytes=arg, output_bytes=out, alias_bytes=alias,
      temp_bytes=temp, generated_code_bytes=mem.generated_code_size_in_bytes, peak_bytes=peak,
      chunk_bytes=chunk_bytes, prefetch_chunks=prefetch, used_bytes=used, hbm_bytes=hbm_bytes,
      headroom_bytes=None if hbm_bytes is None else hbm_bytes - used, flops_per_step=flops,
      bytes_accessed_per_step=accessed, compute_bound_secs=compute, memory_secs=memory,
      step_secs=compute, examples_per_sec=rate, mfu_ceiling=ceiling, compile_secs=secs,
      trace_count=traced.trace_count, executable=compiled)


def _check_fits(p: ProgramReport, where: str) -> None:
  if p.headroom_bytes is not None and p.headroom_bytes < 0:
    g = _fmt_bytes
    raise ProgramDoesNotFitError(
        f"the {p.name} program does not fit {where}: it needs {g(p.used_bytes)} per device "
        f"(arguments {g(p.argument_bytes)} + outputs {g(p.output_bytes)} - aliased "
        f"{g(p.alias_bytes)} + temporaries {g(p.temp_bytes)} + {p.prefetch_chunks} prefetched "
        f"chunks of {g(p.chunk_bytes)}) but the device has {g(p.hbm_bytes)} of HBM: "
        f"{g(-p.headroom_bytes)} over, at K={p.iterations_per_loop} and batch "
        f"{p.global_batch_size} ({p.per_device_batch} per device); lower K, the batch or "
        f"the prefetch")


def compile_for(loop: Any, state: Any, batch: Any, *, topology: str | None = None,
                mesh: Mesh | None = None, evaluator: Evaluator | None = None,
                eval_batch: Any = None, eval_state: Any = None, prefetch: int | None = None,
                hbm_bytes: int | None = None, check_fits: bool = True,
                canonical_convs: bool | None = None) -> AotReport:
  """Compiles the program(s) ``loop.run`` would dispatch, for a TPU topology, without data.

  The train program is built by the same :class:`~loopkit.core.MultiStepProgram`
  code as the loop's (same train step, K, step style, data axis, step
  counter; chunk ``[K, B, ...]`` split over the data axis; the state's
  shardings pinned and the state donated), on a mesh over the target
  devices. With ``evaluator``, its program is compiled the same way (an
  :class:`~loopkit.Evaluator` with the same eval step, eval K and step style on
  the target mesh). Each program is traced and compiled once; the loop's own
  program is not touched (its ``compile_count()`` does not change).

  Args:
    loop: a :class:`~loopkit.TrainLoop` or a :class:`~loopkit.core.MultiStepProgram`.
    state: the train state: a pytree of ``jax.ShapeDtypeStruct`` (e.g.
      ``jax.eval_shape(init)``) or arrays. A leaf's ``NamedSharding`` is kept
      (same ``PartitionSpec`` on the target mesh); other leaves are replicated. The loop's
      ``state_shardings`` (their ``PartitionSpec`` on the target mesh) take precedence.
    batch: one step's global batch, leaves ``[B, ...]`` (``ShapeDtypeStruct``
      or arrays), as the source yields it on one process.
    topology: a TPU topology (``"v5e:2x2"``, ``"v4-32"``: see
      :func:`~loopkit.tools.topology.parse_topology`); None: the local devices.
    mesh: the target mesh, e.g. over :func:`topology_devices` (needed when
      the loop's mesh has more than one axis; ``topology`` then only names
      it); default: a 1-D mesh over the topology's (or local) devices named
      after the loop's data axis, with the loop's mesh axis type.
    evaluator: also compile this evaluator's program.
    eval_batch: one eval batch, leaves ``[B_eval, ...]`` (without the mask);
      required with ``evaluator``.
    eval_state: what ``eval_step`` receives, if not the train state.
    prefetch: chunks the feeder holds ahead on the device (default: the
      loop's ``prefetch``; 0 for a bare program), counted in ``used_bytes``.
    hbm_bytes: HBM per device to check against (default: the chip's).
    check_fits: raise when a program does not fit.
    canonical_convs: as in ``TrainLoop`` (default: on for CPU meshes only,
      what ``run`` would do on the target devices).

  Returns:
    An :class:`AotReport` (``print(report)`` gives a table).

  Raises:
    ValueError: unknown topology (the message lists the known ones); B not
      divisible by the target's data-parallel size; ragged batch specs; a
      multi-axis loop mesh without ``mesh``; ``evaluator`` without
      ``eval_batch``.
    ProgramDoesNotFitError: (a ``ValueError``) a program needs more than
      ``hbm_bytes`` per device; the message gives the numbers.
    ImportError: a TPU topology without libtpu installed.
  """
  program = loop.program if hasattr(loop, "program") else loop
  if not isinstance(program, MultiStepProgram):
    raise TypeError(f"compile_for needs a TrainLoop or MultiStepProgram, got {type(loop)}")
  if prefetch is None:
    prefetch = getattr(loop, "prefetch", 0)
  if evaluator is not None and eval_batch is None:
    raise ValueError("compile_for(evaluator=...) needs eval_batch, one eval batch's spec")
  mesh = _target_mesh(program, topology, mesh)
  dp = data_parallel_size(mesh, program.data_axis)
  chip = chip_of(mesh.devices.flat[0])
  hbm = hbm_bytes if hbm_bytes is not None else (chip.hbm_bytes if chip else None)
  where = f"on {topology or 'the local devices'}"

  given = program.given_state_shardings  # the same PartitionSpecs on the target mesh
  if given is not None:
    given = jax.tree.map(lambda g: g.spec if isinstance(g, NamedSharding) else g, given,
                         is_leaf=is_sharding_entry)
  target = MultiStepProgram(program.train_step, iterations_per_loop=program.iterations_per_loop,
                            mesh=mesh, data_axis=program.data_axis, style=program.style,
                            step_of=program.step_of, canonical_convs=canonical_convs,
                            state_shardings=given)
  b = _batch_size(batch, "train")
  check_global_batch_size(b, dp, data_axes=describe_data_axis(mesh, program.data_axis))
  chunk = _chunk(batch, program.iterations_per_loop)
  state_spec = _onto(state, mesh)
  programs = {"train": _report("train", target.lower(state_spec, chunk), target,
                               k=program.iterations_per_loop, batch_size=b, dp=dp,
                               chunk_bytes=_nbytes(chunk, dp), prefetch=prefetch, chip=chip,
                               hbm_bytes=hbm)}
  if check_fits:
    _check_fits(programs["train"], where)
  if evaluator is not None:
    # eval_step sees the train state as the loop placed it (EvalHook), unless told otherwise.
    estate = (_onto(eval_state, mesh) if eval_state is not None else jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        state_spec, target.state_shardings))
    programs["eval"] = _eval_report(evaluator, estate, eval_batch, mesh, dp=dp, chip=chip,
                                    hbm_bytes=hbm)
    if check_fits:
      _check_fits(programs["eval"], where)

  procs = len({d.process_index for d in mesh.devices.flat})
  return AotReport(topology=topology or "local", chip=chip, num_devices=mesh.devices.size,
                   num_processes=procs, mesh_shape=dict(mesh.shape), programs=programs)


def _target_mesh(program: MultiStepProgram, topology: str | None, mesh: Mesh | None) -> Mesh:
  """``mesh``, or a 1-D mesh over the topology's (or local) devices named after the
  program's data axis, with the program's mesh axis type.

  Raises:
    ValueError: no ``mesh`` for a multi-axis program mesh; a ``mesh`` without
      the data axis.
  """
  data_axis = program.data_axis
  if mesh is None:
    devices: Sequence[jax.Device] = (jax.devices() if topology is None
                                     else topology_devices(topology))
    if len(program.mesh.axis_names) != 1:
      raise ValueError(f"the loop's mesh has axes {dict(program.mesh.shape)}: pass mesh=..., "
                       "a mesh with the same axis names over "
                       "loopkit.tools.topology.topology_devices(topology)")
    # the loop's axis type (Auto for loopkit's default mesh, Explicit for jax.make_mesh's)
    mesh = jax.make_mesh((len(devices),), data_axes(data_axis), devices=list(devices),
                         axis_types=tuple(program.mesh.axis_types))
  check_data_axis(mesh, data_axis)
  return mesh


def _eval_report(evaluator: Evaluator, state: Any, eval_batch: Any, mesh: Mesh, *, dp: int,
                 chip: Chip | None, hbm_bytes: int | None) -> ProgramReport:
  """Compiles ``evaluator``'s program on ``mesh`` for ``state`` and one eval batch's spec
  (``dp``: the train program's data-parallel size, which the report divides by)."""
  be = _batch_size(eval_batch, "eval")
  ev = Evaluator(evaluator.eval_step, iterations_per_loop=evaluator.iterations_per_loop,
                 mesh=mesh, data_axis=evaluator.data_axis, step_style=evaluator.step_style,
                 global_batch_size=be, prefetch=evaluator.prefetch)
  k = ev.iterations_per_loop
  echunk = {"batch": _chunk(eval_batch, k),
            "mask": jax.ShapeDtypeStruct((max(k, MIN_SLOTS), be), np.bool_)}
  return _report("eval", ev.lower(state, echunk), ev, k=k, batch_size=be, dp=dp,
                 chunk_bytes=_nbytes(echunk, dp), prefetch=evaluator.prefetch, chip=chip,
                 hbm_bytes=hbm_bytes)
