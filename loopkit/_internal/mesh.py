"""The device mesh a run uses: a 1-D data-parallel mesh by default.

Used by :mod:`loopkit.core.program`, :mod:`loopkit.evaluation` and the feeder.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from loopkit._internal.checks import check_data_axis


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
