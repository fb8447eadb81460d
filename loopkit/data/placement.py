"""Host buffers for chunks and their transfer to the devices (used by :mod:`loopkit.data.feeding`).

Three per-call costs of placing a chunk ``[K, B, ...]`` on one process, kept apart from
the feeding logic: the buffer (:func:`empty_host_buffer`: aligned on CPU devices so
XLA:CPU uses it in place), the transfer (:class:`Placer`: ``jax.device_put``'s
Python checks hoisted out of the per-call path), and whether to transfer at all
before the call (:func:`call_places_numpy`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from loopkit._internal import compat
from loopkit._internal.mesh import is_cpu_mesh

ALIGN_BYTES = 64  # host buffers this aligned are aliased by XLA:CPU, not copied
ALIGN_MIN_BYTES = 1 << 16  # below this a copy costs less than aligning


def empty_host_buffer(shape: tuple[int, ...], dtype: Any, *, aligned: bool) -> np.ndarray:
  """An uninitialised numpy array, a fresh buffer for every call.

  With ``aligned`` (the chunk goes to CPU devices) one of at least ``ALIGN_MIN_BYTES``
  is ``ALIGN_BYTES``-aligned, so placing it aliases the buffer instead of copying it
  (XLA:CPU aliases only aligned host buffers; the feeder never writes a placed leaf
  again). Buffers are not reused: a pool that rewrote a buffer once its reference
  count said it was free corrupted batches (labels of a TFDS source differed at
  steps 6-8 in 2 of 12 runs of ``tests/test_sources.py``, 0 of 8 without the pool).

  Args:
    shape: the array's shape, e.g. ``[K, B, ...]``.
    dtype: its dtype.
    aligned: align large buffers (for CPU devices).
  """
  nbytes = math.prod(shape) * np.dtype(dtype).itemsize
  if not aligned or nbytes < ALIGN_MIN_BYTES:
    return np.empty(shape, dtype)
  buf = np.empty(nbytes + ALIGN_BYTES, np.uint8)
  offset = -buf.__array_interface__["data"][0] % ALIGN_BYTES
  return buf[offset:offset + nbytes].view(dtype).reshape(shape)


def call_places_numpy(sharding: NamedSharding) -> bool:
  """Whether a chunk for ``sharding`` goes to a jitted call as numpy, placed by the call.

  True on one process whose mesh is CPU devices only, when this thread's
  host-to-device transfer guard allows implicit transfers (the default). A
  jitted call whose ``in_shardings`` pin the chunk's sharding then transfers
  a numpy leaf itself, in C++ inside the dispatch, with the same values and
  layout as ``jax.device_put``; placing first costs about 100 us more per call
  on this CPU (``Placer`` then a dispatch with just-placed arrays: 165 us of
  process CPU against 64 us for the call with numpy, 2 leaves ``[2, 32, 64]``
  float32 and ``[2, 32]`` int32, jax 0.10.2, ``benchmarks/host_profile.py``
  for the per-call effect). Not on accelerators (a prefetch thread's
  ``device_put`` overlaps the copy with the running call there), not on
  several processes (a call takes only global arrays there), not on a mesh with
  an ``Explicit`` axis (:func:`_all_axes_auto`), and not under a
  ``jax.transfer_guard`` that refuses or logs implicit transfers. With ``Auto``
  axes the traced step and the compiled program are the same either way, so the
  results are bitwise equal (``tests/test_loop.py``).

  The caller's jitted function must pin the chunk's sharding in
  ``in_shardings``: without it a numpy argument is placed on one device.
  """
  mesh = sharding.mesh
  return (jax.process_count() == 1 and is_cpu_mesh(mesh) and _all_axes_auto(mesh)
          and compat.host_to_device_guard() in (None, "allow"))


def _all_axes_auto(mesh: Any) -> bool:
  """Every mesh axis is ``AxisType.Auto`` (``loopkit.data_parallel_mesh``'s).

  On an ``Explicit`` axis (``jax.make_mesh``'s default since jax 0.7) a placed
  array's type carries its sharding into the trace and a numpy argument's does
  not, so the step would be traced differently (a ``shard_map`` inside it refuses the
  input: ``tests/test_device_data.py``); there the chunk is placed first.
  """
  types = getattr(mesh, "axis_types", None)
  return types is not None and all(t == jax.sharding.AxisType.Auto for t in types)


class Placer:
  """``jax.device_put(arrays, sharding)`` for same-shaped chunks on one process, hoisted.

  ``jax.device_put`` spends about 35 us of Python per leaf (abstractify, checks,
  aval updates) around the one transfer call that moves the data
  (``pxla.batched_device_put``, private: :data:`loopkit._internal.compat.batched_device_put`, None
  where this JAX has none). Every chunk's leaves have the same shapes,
  dtypes and sharding, so the first chunk goes through ``jax.device_put`` and
  fixes each leaf's aval, devices and shard indices; later chunks call the
  transfer directly. The second chunk is also placed by ``jax.device_put`` and
  compared (aval, sharding, bytes); any difference, an unexpected dtype
  conversion or an error falls back to ``jax.device_put`` for good.

  Args:
    sharding: the sharding of every leaf ``[K, B, ...]``.

  Not thread-safe (one producer thread).
  """

  def __init__(self, sharding: NamedSharding):
    self._sharding = sharding
    self._fast = compat.batched_device_put is not None
    self._leaves: list[tuple[Any, list, list]] | None = None  # (aval, devices, indices)
    self._checked = False

  def __call__(self, arrays: list[np.ndarray]) -> list[jax.Array]:
    if self._fast and self._leaves is not None:
      try:
        put = compat.batched_device_put
        assert put is not None
        placed = [put(aval, self._sharding, [a[i] for i in indices], devices)
                  for a, (aval, devices, indices) in zip(arrays, self._leaves)]
      except Exception:  # noqa: BLE001  (internal API changed: the public path)
        self._fast = False
      else:
        if self._checked:
          return placed
        self._checked = True
        ref = jax.device_put(arrays, self._sharding)
        if all(p.aval == r.aval and p.sharding == r.sharding
               and np.asarray(p).tobytes() == np.asarray(r).tobytes()
               for p, r in zip(placed, ref)):
          return placed
        self._fast = False
        return ref
    placed = jax.device_put(arrays, self._sharding)
    if self._fast and self._leaves is None:
      try:
        devices = compat.addressable_devices(self._sharding)
        self._leaves = []
        for a, p in zip(arrays, placed):
          index_map = self._sharding.addressable_devices_indices_map(a.shape)
          self._leaves.append((p.aval, devices, [index_map[d] for d in devices]))
          if p.dtype != a.dtype:  # jax.device_put converted it (e.g. float64 without x64)
            self._fast = False
      except Exception:  # noqa: BLE001
        self._fast = False
    return placed
