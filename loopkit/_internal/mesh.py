"""The device mesh a run uses (a 1-D data-parallel mesh by default), and the state's place on it.

Used by :mod:`loopkit.core.program`, :mod:`loopkit.evaluation` and the feeder.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from loopkit._internal.checks import check_data_axis, device_axis_leaf


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
  check_data_axis(mesh, data_axis)
  return mesh, mesh.shape[data_axis]


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


def pinned_state_shardings(state: Any, mesh: Mesh, *, replicated_only: bool = False) -> Any:
  """The sharding each state leaf keeps on ``mesh`` in the compiled program (invariant 7).

  A leaf with a ``NamedSharding`` on ``mesh`` (or on a mesh that places alike,
  :func:`same_layout`) keeps it; a leaf without a sharding, or whose sharding is
  fully replicated (a single-device array, a replicated array on any mesh), is
  replicated on ``mesh``: nothing of its layout is lost. Any other leaf would
  lose its sharding to replication, silently; it is refused.

  Args:
    state: the state pytree: arrays (``jax.Array``, numpy, scalars) or
      ``jax.ShapeDtypeStruct``.
    mesh: the loop's mesh.
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
      when its sharded leaves are on more than one, and ``mesh=``.
  """
  replicated = NamedSharding(mesh, P())
  lost: list[tuple[str, Any, Any]] = []  # (path, leaf, sharding) of the refused leaves
  sharded_meshes: dict[Any, str] = {}  # mesh of sharded leaves -> its first leaf's path

  def pick(path: Any, x: Any) -> Any:
    sh = getattr(x, "sharding", None)
    if sh is None or sh.is_fully_replicated:
      return replicated
    name = jax.tree_util.keystr(path) or "<root>"
    if isinstance(sh, NamedSharding):
      sharded_meshes.setdefault(sh.mesh, name)
      if same_layout(sh.mesh, mesh) and not replicated_only:
        return sh if sh.mesh == mesh else NamedSharding(mesh, sh.spec, memory_kind=sh.memory_kind)
    lost.append((name, x, sh))
    return replicated

  shardings = jax.tree_util.tree_map_with_path(pick, state)
  if lost:
    raise ValueError(_lost_sharding_message(lost, mesh, sharded_meshes, replicated_only,
                                            len(jax.tree.leaves(state))))
  return shardings


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
          "data_axis=<its axis the batch is split over>)")
