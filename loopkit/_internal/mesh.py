"""The device mesh a run uses (a 1-D data-parallel mesh by default), and the state's place on it.

Used by :mod:`loopkit.core.program`, :mod:`loopkit.evaluation` and the feeder.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from loopkit._internal.checks import (
  check_data_axis,
  check_global_batch_size,
  data_axes,
  device_axis_leaf,
  leaf_name,
  process_rows,
)

log = logging.getLogger("loopkit")


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


def resolve_mesh(mesh: Mesh | None,
                 data_axis: str | tuple[str, ...]) -> tuple[Mesh, str | tuple[str, ...], int]:
  """The mesh to run on, its checked data axis and its data-parallel size.

  Args:
    mesh: a mesh, or None for :func:`data_parallel_mesh` over all devices.
    data_axis: the mesh axis the batch is split over, or a tuple of them (the major first).

  Returns:
    ``(mesh, axis, data_parallel_size)``: ``axis`` as ``PartitionSpec`` and collectives take
    it (:func:`loopkit._internal.checks.check_data_axis`: a str for one axis, else a tuple),
    and the product of its axes' sizes.

  Raises:
    TypeError: ``data_axis`` is neither a str nor a sequence of str.
    ValueError: ``data_axis`` names no axis, an axis that ``mesh`` does not have, an axis twice,
      or several axes without a ``mesh``.
  """
  if mesh is None:
    names = [data_axis] if isinstance(data_axis, str) else data_axis
    if isinstance(names, (tuple, list)) and len(names) > 1:
      raise ValueError(f"data_axis={tuple(names)!r} names several mesh axes but no mesh was "
                       "given: pass the mesh that has them, mesh=jax.make_mesh(...)")
    one = isinstance(names, (tuple, list)) and len(names) == 1 and isinstance(names[0], str)
    mesh = data_parallel_mesh(names[0] if one else "data")  # else check_data_axis says why
  axis = check_data_axis(mesh, data_axis)
  return mesh, axis, data_parallel_size(mesh, axis)


def data_parallel_size(mesh: Any, data_axis: str | tuple[str, ...]) -> int:
  """D, the number of slices of the batch: the product of the data axes' sizes on ``mesh``."""
  return math.prod(mesh.shape[a] for a in data_axes(data_axis))


def describe_data_axis(mesh: Any, data_axis: str | tuple[str, ...]) -> str:
  """Words for an error about D over several axes, e.g. `` (the product of the sizes of the
  mesh axes ('data', 'fsdp'): 2 x 2)``; empty for one axis."""
  axes = data_axes(data_axis)
  if len(axes) == 1:
    return ""
  sizes = " x ".join(str(mesh.shape[a]) for a in axes)
  return f" (the product of the sizes of the mesh axes {axes!r}: {sizes})"


def batch_sharding(mesh: Mesh, data_axis: str | tuple[str, ...], *,
                   batch_dim: int = 1) -> NamedSharding:
  """The sharding of a batch leaf: dimension ``batch_dim`` split over the data axis (or axes,
  the first one major, as ``PartitionSpec`` splits a dimension over a tuple), the others whole
  (replicated over the remaining mesh axes).

  Args:
    mesh: the mesh.
    data_axis: a checked data axis (:func:`resolve_mesh`).
    batch_dim: 1 for a chunk ``[K, B, ...]``, 0 for a batch ``[B, ...]``.
  """
  return NamedSharding(mesh, P(*([None] * batch_dim), data_axis))


def check_batch_on_mesh(global_batch_size: int, sharding: NamedSharding, *, batch_dim: int = 1,
                        process_count: int | None = None,
                        process_of: Callable[[Any], int] | None = None) -> None:
  """The check of a global batch against the sharding that places it (feeder and evaluator).

  B must divide by the data-parallel size D (the product of the sizes of the axes that split
  dimension ``batch_dim``) and by the process count P. On several processes, each process feeds
  rows ``[p * B / P, (p + 1) * B / P)`` of every global batch
  (:func:`loopkit._internal.checks.process_rows`) and places them on its devices
  (``jax.make_array_from_process_local_data``), which hold the rows the mesh gives them: the
  batch is in the sources' global order only where the mesh gives each process its own rows.
  A mesh that gives every process B / P rows, but others (its devices are not in process order
  along the data axes: :func:`jax.make_mesh` puts them in order on CPU and GPU hosts), still
  trains, with the rows of a global batch on other devices than on one process: a warning says
  so once. A mesh whose data axes do not split the batch over the processes (a process's
  devices hold more than B / P rows, or rows another process holds too) is refused.

  Args:
    global_batch_size: B.
    sharding: the ``NamedSharding`` of a batch leaf (:func:`batch_sharding`).
    batch_dim: the batch dimension in ``sharding``'s spec.
    process_count: P (default ``jax.process_count()``).
    process_of: the process of a mesh device (default ``device.process_index``; tests pass
      another to lay out one process's devices as several).

  Raises:
    ValueError: B < 1, B not divisible by D (naming the axes and their sizes when D is a
      product) or by P; on several processes, a mesh whose data axes do not split the batch
      over the processes (naming the process, the rows its devices hold and the rows it feeds).
  """
  mesh, axis = sharding.mesh, sharding.spec[batch_dim]
  count = jax.process_count() if process_count is None else process_count
  check_global_batch_size(global_batch_size, data_parallel_size(mesh, axis),
                          process_count=count, data_axes=describe_data_axis(mesh, axis))
  if count == 1 or getattr(mesh, "devices", None) is None:  # an AbstractMesh has no processes
    return
  rows = mesh_process_rows(mesh, axis, global_batch_size, process_of=process_of)
  b = global_batch_size
  problem, permuted = None, []
  for p in range(count):
    want = process_rows(b, p, count)
    have = rows.get(p, [])
    if have == [want]:
      continue
    held = sum(stop - start for start, stop in have)
    others = [q for q, r in sorted(rows.items()) if q != p and _overlap(r, have)]
    # every row is on some device: all P hold B / P rows exactly when they split the batch
    if held != want[1] - want[0] or set(rows) - set(range(count)):
      problem = (p, have, want, others)
      break
    permuted.append((p, have, want))
  where = (f"the global batch of {b} is split over the mesh axes {data_axes(axis)!r} of "
           f"{describe_mesh(mesh)}")
  if problem is not None:
    p, have, want, others = problem
    shared = (f", rows that process {others[0]}'s devices hold too" if others else "")
    raise ValueError(
        f"{where}, which puts process {p}'s devices on rows {_ranges(have)}{shared}; but on "
        f"{count} processes each process feeds its own B / P = {b // count} rows, process {p} "
        f"rows {_ranges([want])}: every mesh axis whose devices span processes must be among "
        "the data axes (data_axis=(...)), so that each process's devices hold its rows alone")
  if permuted:
    p, have, want = permuted[0]
    log.warning(
        "%s, which puts process %d's devices on rows %s, not on the rows %s it feeds: the "
        "processes' devices are not in process order along the data axes, so each global "
        "batch is placed in another row order than on one process (training is unaffected; "
        "results are not bitwise those of another process count). Build the mesh with each "
        "process's devices together, in process order, along the data axes",
        where, p, _ranges(have), _ranges([want]))


def mesh_process_rows(mesh: Any, data_axis: str | tuple[str, ...], global_batch_size: int, *,
                      process_of: Callable[[Any], int] | None = None
                      ) -> dict[int, list[tuple[int, int]]]:
  """The rows of a global batch ``[B, ...]`` split over ``data_axis`` that each process's devices
  hold, as JAX places them (``NamedSharding.devices_indices_map``).

  Returns:
    ``{process: [(start, stop), ...]}``: sorted, adjacent ranges merged.
  """
  of = process_of or (lambda d: d.process_index)
  index_map = NamedSharding(mesh, P(data_axis)).devices_indices_map((global_batch_size,))
  held: dict[int, set[tuple[int, int]]] = {}
  for device, index in index_map.items():
    start, stop, _ = index[0].indices(global_batch_size)
    held.setdefault(int(of(device)), set()).add((start, stop))
  merged: dict[int, list[tuple[int, int]]] = {}
  for p, ranges in held.items():
    out: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
      if out and out[-1][1] == start:
        out[-1] = (out[-1][0], stop)
      else:
        out.append((start, stop))
    merged[p] = out
  return merged


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
  return any(s0 < e1 and s1 < e0 for s0, e0 in a for s1, e1 in b)


def _ranges(ranges: list[tuple[int, int]]) -> str:
  return " and ".join(f"[{start}, {stop})" for start, stop in ranges)


def describe_mesh(mesh: Any) -> str:
  """A mesh in a few words: its axis sizes and its devices' ids, e.g.
  ``{'data': 2, 'fsdp': 2, 'tensor': 2} over devices 0-7``."""
  ids = getattr(mesh, "device_ids", None)
  if ids is None:  # an AbstractMesh: no devices
    return f"{dict(mesh.shape)}"
  flat = [int(i) for i in np.asarray(ids).flat]
  if len(flat) > 1 and flat == list(range(flat[0], flat[0] + len(flat))):
    where = f"{flat[0]}-{flat[-1]}"
  else:
    where = ", ".join(map(str, flat[:8])) + (f", ... ({len(flat)} devices)" if len(flat) > 8
                                             else "")
  return f"{dict(mesh.shape)} over devices {where}"


def same_layout(a: Any, b: Any) -> bool:
  """Whether two meshes place alike: the same axis names and sizes over the same devices in the
  same order (their axis types may differ)."""
  if a == b:
    return True
  ids_a, ids_b = getattr(a, "device_ids", None), getattr(b, "device_ids", None)
  return (tuple(a.axis_names) == tuple(b.axis_names) and dict(a.shape) == dict(b.shape)
          and ids_a is not None and ids_b is not None and np.array_equal(ids_a, ids_b))


def pinned_state_shardings(state: Any, mesh: Mesh, *, given: Any = None,
                           replicated_only: bool = False) -> Any:
  """The sharding each state leaf keeps on ``mesh`` in the compiled program (invariant 7).

  A leaf's sharding is the one ``given`` names for it, else its own: a leaf with a
  ``NamedSharding`` on ``mesh`` (or on a mesh that places alike, :func:`same_layout`) keeps it,
  its ``PartitionSpec`` unchanged (also where the mesh's axes of that spec have size 1, so the
  leaf is whole on every device: ``P("fsdp", "tensor")`` on a ``(8, 1, 1)`` mesh stays so); a
  leaf without a sharding, or whose sharding is fully replicated on another mesh (a
  single-device array, a replicated array on other devices), is replicated on ``mesh``: nothing
  of its layout is lost. Any other leaf would lose its sharding to replication, silently; it is
  refused.

  Args:
    state: the state pytree: arrays (``jax.Array``, numpy, scalars) or
      ``jax.ShapeDtypeStruct``.
    mesh: the loop's mesh.
    given: the shardings the user gave (``TrainLoop(state_shardings=...)``), or None: a pytree
      with the structure of ``state`` or a prefix of it, whose leaves are ``PartitionSpec``
      (on ``mesh``), ``NamedSharding`` (on ``mesh``, or a mesh that places alike) or None (the
      leaf's own sharding, as without ``given``); a leaf of a prefix applies to every state
      leaf below it.
    replicated_only: the program keeps the whole state replicated
      (``step_style="per_device"``): a sharded leaf is refused even on ``mesh``.

  Returns:
    A pytree of ``NamedSharding`` on ``mesh``, the structure of ``state``.

  Raises:
    ValueError: a leaf sharded on another mesh (other devices, axis names or
      sizes), sharded by a non-``NamedSharding`` layout (e.g. a device axis from
      ``flax.jax_utils.replicate``), or sharded at all under ``replicated_only``.
      The message names the first such leaf (its path and ``PartitionSpec``), its
      mesh and the loop's mesh, how many leaves are affected, the state's meshes
      when its sharded leaves are on more than one, and ``mesh=``. Also: ``given``
      whose structure is not a prefix of the state's (naming the first path that differs),
      a given ``NamedSharding`` on another mesh, a ``PartitionSpec`` naming an axis ``mesh``
      lacks, or a sharding that does not divide a leaf's dimension on ``mesh`` (naming the
      leaf, its shape, the spec, the dimension and the mesh axes' sizes).
    TypeError: a leaf of ``given`` that is neither a ``PartitionSpec``, a ``NamedSharding``
      nor None (naming it).
  """
  replicated = NamedSharding(mesh, P())
  lost: list[tuple[str, Any, Any]] = []  # (path, leaf, sharding) of the refused leaves
  sharded_meshes: dict[Any, str] = {}  # mesh of sharded leaves -> its first leaf's path
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  wanted = given_per_leaf(state, given)

  def pick(path: Any, x: Any, want: Any) -> Any:
    name = leaf_name(path)
    if want is not None:
      chosen = _given_sharding(name, want, mesh)
      if replicated_only and not chosen.is_fully_replicated:
        lost.append((name, x, chosen))
        return replicated
      return _divides(name, x, chosen)
    sh = getattr(x, "sharding", None)
    if sh is None:
      return replicated
    if isinstance(sh, NamedSharding) and not sh.is_fully_replicated:
      sharded_meshes.setdefault(sh.mesh, name)
    if isinstance(sh, NamedSharding) and same_layout(sh.mesh, mesh) and not replicated_only:
      return _divides(name, x, sh if sh.mesh == mesh
                      else NamedSharding(mesh, sh.spec, memory_kind=sh.memory_kind))
    if sh.is_fully_replicated:
      return replicated
    lost.append((name, x, sh))
    return replicated

  shardings = [pick(path, x, want) for (path, x), want in zip(leaves, wanted, strict=True)]
  if lost:
    raise ValueError(_lost_sharding_message(lost, mesh, sharded_meshes, replicated_only,
                                            len(leaves)))
  return jax.tree.unflatten(treedef, shardings)


def is_sharding_entry(x: Any) -> bool:
  """Whether ``x`` is a leaf of a ``state_shardings`` pytree (a sharding, a spec or None)."""
  return x is None or isinstance(x, (P, jax.sharding.Sharding))


def given_per_leaf(state: Any, given: Any) -> list[Any]:
  """The entry of ``given`` (a pytree of shardings with the structure of ``state`` or a prefix
  of it: :func:`pinned_state_shardings`) that applies to each leaf of ``state``, in leaf order.

  Raises:
    ValueError: ``given``'s structure is not a prefix of the state's; the message names the
      first path of ``given`` that the state lacks, or the first state leaf ``given`` does not
      reach.
  """
  state_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  if given is None:
    return [None] * len(state_paths)
  entries = jax.tree_util.tree_flatten_with_path(given, is_leaf=is_sharding_entry)[0]
  try:
    nested = jax.tree.map(lambda entry, sub: jax.tree.map(lambda _: _Entry(entry), sub),
                          given, state, is_leaf=is_sharding_entry)
    out = [e.value for e in jax.tree.leaves(nested, is_leaf=lambda e: isinstance(e, _Entry))]
    if len(out) == len(state_paths):
      return out
  except (ValueError, TypeError, KeyError):
    pass
  where = "the state's structure"
  for path, _ in entries:  # a path of given that no state leaf lies under
    if not any(p[:len(path)] == path for p in state_paths):
      where = (f"state_shardings has an entry at {leaf_name(path)}, "
               "which is not a subtree of the state")
      break
  else:
    given_paths = [path for path, _ in entries]
    for p in state_paths:
      if not any(p[:len(g)] == g for g in given_paths):
        where = (f"state leaf {leaf_name(p)} has no entry in "
                 "state_shardings")
        break
  raise ValueError(
      f"state_shardings must have the state's tree structure, or a prefix of it (one entry "
      f"for a whole subtree), with a PartitionSpec, a NamedSharding or None at each of its "
      f"leaves: {where} (state: {jax.tree.structure(state)}; state_shardings: "
      f"{jax.tree.structure(given, is_leaf=is_sharding_entry)})")


class _Entry:
  """A leaf of ``state_shardings`` copied onto each state leaf below it (not a pytree node)."""

  def __init__(self, value: Any):
    self.value = value


def _given_sharding(name: str, want: Any, mesh: Mesh) -> NamedSharding:
  """The ``NamedSharding`` on ``mesh`` that ``state_shardings`` gives the leaf ``name``.

  Raises:
    ValueError: a ``PartitionSpec`` naming an axis ``mesh`` lacks; a ``NamedSharding`` on a
      mesh that does not place as ``mesh`` does.
    TypeError: neither a ``PartitionSpec`` nor a ``NamedSharding``.
  """
  if isinstance(want, P):
    missing = [a for a in _spec_axes(want) if a not in mesh.axis_names]
    if missing:
      raise ValueError(
          f"state_shardings gives state leaf {name} the PartitionSpec {want}, which names "
          f"{'the axis' if len(missing) == 1 else 'the axes'} "
          f"{', '.join(map(repr, missing))} that the loop's mesh {describe_mesh(mesh)} lacks")
    return NamedSharding(mesh, want)
  if isinstance(want, NamedSharding):
    if not same_layout(want.mesh, mesh):
      raise ValueError(
          f"state_shardings gives state leaf {name} the sharding {want.spec} on the mesh "
          f"{describe_mesh(want.mesh)}, but the loop's mesh is {describe_mesh(mesh)}: give "
          "shardings on the loop's mesh, or PartitionSpecs (placed on the loop's mesh)")
    return want if want.mesh == mesh else NamedSharding(mesh, want.spec,
                                                        memory_kind=want.memory_kind)
  raise TypeError(f"state_shardings gives state leaf {name} {want!r} ({type(want).__name__}): "
                  "each entry must be a PartitionSpec, a NamedSharding or None")


def _spec_axes(spec: Any) -> list[str]:
  """The mesh axis names a ``PartitionSpec`` uses, in order."""
  out: list[str] = []
  for part in spec:
    if part is None or part is P.UNCONSTRAINED:
      continue
    out.extend(part if isinstance(part, tuple) else (part,))
  return out


def _divides(name: str, x: Any, sharding: NamedSharding) -> NamedSharding:
  """``sharding``, after checking that it splits each dimension of the leaf ``x`` evenly.

  Raises:
    ValueError: the spec has more entries than ``x`` has dimensions, or splits a dimension over
      mesh axes whose sizes' product does not divide it (naming the leaf, its shape, the spec,
      the dimension and the axes' sizes).
  """
  shape, spec, mesh = tuple(np.shape(x)), sharding.spec, sharding.mesh
  where = (f"state leaf {name} (shape {shape}) cannot be sharded as {spec} on the mesh "
           f"{describe_mesh(mesh)}")
  if len(spec) > len(shape):
    raise ValueError(f"{where}: the spec has {len(spec)} entries for its {len(shape)} "
                     "dimensions")
  for dim, part in enumerate(spec):
    if part is None or part is P.UNCONSTRAINED:
      continue
    axes = part if isinstance(part, tuple) else (part,)
    parts = math.prod(mesh.shape[a] for a in axes)
    if shape[dim] % parts:
      sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
      raise ValueError(
          f"{where}: its dimension {dim} (size {shape[dim]}) would be split over {sizes} = "
          f"{parts} devices, which does not divide it. Shard that leaf over other axes on this "
          "mesh (state_shardings=, or the logical axis rules that make its sharding), or pick "
          "a mesh whose axes divide it")
  return sharding


def _lost_sharding_message(lost: list[tuple[str, Any, Any]], mesh: Mesh,
                           sharded_meshes: dict[Any, str], replicated_only: bool,
                           num_leaves: int) -> str:
  """The error of :func:`pinned_state_shardings`, for its first refused leaf."""
  name, x, sh = lost[0]
  shape = tuple(np.shape(x))
  default = len(mesh.axis_names) == 1 and mesh == data_parallel_mesh(mesh.axis_names[0])
  loop_mesh = f"the loop's mesh is {describe_mesh(mesh)}" + (
      " (the default of a TrainLoop built without mesh=)" if default else "")
  count = f"{len(lost)} of {num_leaves} state leaves would lose their sharding"
  if isinstance(sh, NamedSharding):
    where = (f"state leaf {name} (shape {shape}) is sharded as {sh.spec} on the mesh "
             f"{describe_mesh(sh.mesh)}")
  else:
    where = f"state leaf {name} (shape {shape}) has the sharding {sh}, not a NamedSharding"
  if replicated_only and isinstance(sh, NamedSharding) and same_layout(sh.mesh, mesh):
    return (f"{where}, but step_style='per_device' keeps the state replicated on every device "
            f"(each device's step sees the whole state), so the loop would replicate it ({count})"
            ": use step_style='global' for a sharded state (the step then sees global arrays "
            "and XLA partitions it), or replicate those leaves yourself")
  msg = f"{where}, but {loop_mesh}: the loop would replicate it ({count})"
  others = [f"{path} on {describe_mesh(m)}" for m, path in sharded_meshes.items()]
  if len(others) > 1:
    return (f"{msg}. The state's sharded leaves are on {len(others)} meshes ({'; '.join(others)})"
            ": put every leaf on one mesh and build the loop with it, TrainLoop(..., mesh=...)")
  if device_axis_leaf(x):
    msg += (". Its leading axis is a device axis, one slice per device: this looks like a state "
            "replicated for pmap (flax.jax_utils.replicate); pass the unreplicated state "
            "(jax_utils.unreplicate, or jax.tree.map(lambda x: x[0], state)): loopkit places "
            "it itself")
    return msg
  return (f"{msg}. Build the loop on the state's mesh: TrainLoop(..., mesh=<that mesh>, "
          "data_axis=<its axis the batch is split over>); or, to move the state onto the "
          "loop's mesh, say where each leaf goes: TrainLoop(..., state_shardings=<a pytree of "
          "PartitionSpecs>)")
