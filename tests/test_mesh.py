"""The default mesh (loopkit._internal.mesh): 1-D, data-parallel, one Auto axis, over the
devices given or all of them (8 fake CPU devices, see conftest.py)."""

import jax
import numpy as np
import pytest

import loopkit
from loopkit._internal.mesh import data_parallel_mesh, is_cpu_mesh, resolve_mesh


def test_data_parallel_mesh_over_all_devices_has_one_auto_axis():
  mesh = data_parallel_mesh()
  assert mesh.axis_names == ("data",) and mesh.shape == {"data": 8}
  assert list(mesh.devices.flat) == jax.devices()
  assert mesh.axis_types == (jax.sharding.AxisType.Auto,)
  assert loopkit.data_parallel_mesh is data_parallel_mesh  # the front door's name


def test_data_parallel_mesh_over_given_devices_and_axis_name():
  mesh = data_parallel_mesh("batch", devices=iter(jax.devices()[2:5]))
  assert mesh.axis_names == ("batch",) and mesh.shape == {"batch": 3}
  assert list(mesh.devices.flat) == jax.devices()[2:5]


def test_is_cpu_mesh():
  assert is_cpu_mesh(data_parallel_mesh(devices=jax.devices()[:1]))
  fake = type("FakeMesh", (), {"devices": np.array([type("D", (), {"platform": "tpu"})()])})
  assert not is_cpu_mesh(fake)


def test_resolve_mesh_defaults_to_all_devices_and_checks_the_axis():
  mesh, axis, size = resolve_mesh(None, "data")
  assert size == 8 and mesh.axis_names == ("data",) and axis == "data"
  mesh, axis, size = resolve_mesh(data_parallel_mesh("d", devices=jax.devices()[:2]), ("d",))
  assert size == 2 and mesh.shape == {"d": 2} and axis == "d"  # a 1-tuple is its one name
  with pytest.raises(ValueError, match=r"data_axis 'data' is not an axis of the mesh \('d',\)"):
    resolve_mesh(mesh, "data")
