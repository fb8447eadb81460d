"""Chunks assembled on the devices, batch by batch, and the device memory they take.

Where the feeder forms a chunk ``[K, B, ...]`` decides what a device call costs the host
(:class:`loopkit.data.feeding.ChunkFeeder`, ``assembly``):

* ``"host"``: the K batches are copied into one host buffer ``[K, B, ...]`` that is then
  placed in one transfer. On CPU devices the placed buffer is the host buffer itself (XLA:CPU
  aliases an aligned numpy array: :func:`loopkit.data.placement.empty_host_buffer`), so this
  is one copy in all.
* ``"device"``: each batch is placed on the mesh as it comes (``[B, ...]``, split on the data
  axes), in the feeder's thread while the previous call runs, and written into slot ``i`` of
  a chunk buffer made on the devices (:class:`DeviceAssembler`: one small compiled program
  that zero-fills a buffer, one that writes a placed batch into a slot, the buffer donated so
  the write happens in place). No host array of the chunk's size is made. On a GPU a K = 26
  chunk of ResNet-50 uint8 images (1.0 GB) cost 0.39 s of ``np.stack`` and 0.60 s for its
  one ``device_put``, where 26 ``device_put`` calls of the separate batches took 0.034 s and
  a ``jnp.stack`` of them on the device 0.006 s (one H200, jax 0.11.2,
  ``benchmarks/RESULTS_gpu.md``).

``"auto"`` (:func:`resolve_chunk_assembly`) is ``"device"`` on accelerators and ``"host"`` on
CPU meshes, where the aliased host buffer is the cheaper path (``benchmarks/run.py``). The
chunk's values, its sharding and so the program's results are the same either way
(``tests/test_assembly.py``, bitwise).

Device memory: a run holds up to :func:`chunk_buffers_in_flight` chunks on the devices at
once; :func:`check_chunk_memory` refuses a K whose chunks and state do not fit the device's
memory before the first step (:func:`device_memory_limit`: the first device's
``memory_stats()["bytes_limit"]``; CPU devices report none and are not checked).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from loopkit._internal.mesh import is_cpu_mesh

ChunkAssembly = Literal["auto", "host", "device"]
CHUNK_ASSEMBLIES = ("auto", "host", "device")


def resolve_chunk_assembly(assembly: str, sharding: NamedSharding) -> str:
  """``"host"`` or ``"device"``: ``assembly`` with ``"auto"`` decided for the chunk's mesh.

  Args:
    assembly: ``"auto"``, ``"host"`` or ``"device"`` (see the module docstring).
    sharding: the chunk's sharding ``[K, B, ...]``.

  Raises:
    ValueError: any other ``assembly``, named.
  """
  if assembly not in CHUNK_ASSEMBLIES:
    raise ValueError(f"chunk_assembly={assembly!r}; expected one of {CHUNK_ASSEMBLIES}")
  if assembly != "auto":
    return assembly
  return "host" if is_cpu_mesh(sharding.mesh) else "device"


def chunk_buffers_in_flight(prefetch: int) -> int:
  """Chunks a run holds on the devices at most: ``prefetch + 3``.

  One chunk for the running call, one for the call dispatched behind it (the loop fetches a
  call's outputs one call late), ``prefetch`` formed chunks waiting in the feeder's queue and
  the one the feeder is forming (in ``"device"`` assembly; in ``"host"`` assembly it is placed
  only once formed and waits in the producer's hand for a free queue slot).
  """
  return prefetch + 3


def chunk_device_bytes(batch_spec: Sequence[tuple[tuple[int, ...], Any]], slots: int,
                       sharding: NamedSharding, process_count: int = 1) -> int:
  """Bytes of one chunk on one device.

  Args:
    batch_spec: ``(shape, dtype)`` of every leaf of one process's batch ``[B_local, ...]``.
    slots: the chunk's slot count ``max(K, 2)``.
    sharding: the chunk's sharding ``[K, B, ...]`` (B split on the data axes).
    process_count: processes feeding the batch (B = B_local x processes).

  Returns:
    The sum over leaves of the per-device shard ``[slots, B / D, ...]`` times the item size.
  """
  total = 0
  for shape, dtype in batch_spec:
    global_shape = (slots, shape[0] * process_count) + tuple(shape[1:])
    total += math.prod(sharding.shard_shape(global_shape)) * np.dtype(dtype).itemsize
  return total


def device_memory_limit(device: Any) -> int | None:
  """The bytes ``device`` can hold (``memory_stats()["bytes_limit"]``), or None where the
  device does not say (CPU devices)."""
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001  (a backend without memory stats)
    return None
  if not stats:
    return None
  limit = stats.get("bytes_limit")
  return int(limit) if limit else None


def state_device_bytes(state: Any, device: Any) -> int:
  """Bytes of ``state``'s shards on ``device``: for every ``jax.Array`` leaf whose sharding
  covers the device, its shard shape (``sharding.shard_shape``) times the item size; other
  leaves count 0. Reads shardings only (no shard is touched)."""
  total = 0
  for x in jax.tree.leaves(state):
    sharding = getattr(x, "sharding", None)
    if isinstance(x, jax.Array) and sharding is not None and device in sharding.device_set:
      total += math.prod(sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
  return total


def check_chunk_memory(*, iterations_per_loop: int, chunk_bytes: int, prefetch: int,
                       state: Any, device: Any) -> None:
  """Refuses chunks that do not fit beside the state in ``device``'s memory.

  Args:
    iterations_per_loop: K (for the message).
    chunk_bytes: one chunk on one device (:func:`chunk_device_bytes`).
    prefetch: the feeder's prefetch (:func:`chunk_buffers_in_flight`).
    state: the placed state (its bytes on ``device``: :func:`state_device_bytes`).
    device: the device (:func:`device_memory_limit`; not checked where it reports none).

  Raises:
    ValueError: ``buffers x chunk_bytes + state_bytes`` exceeds the device's limit; the
      message gives every number and what to lower. Activations and gradients come on top
      (``loopkit.tools.aot`` reports them ahead of time).
  """
  limit = device_memory_limit(device)
  if limit is None:
    return
  state_bytes = state_device_bytes(state, device)
  buffers = chunk_buffers_in_flight(prefetch)
  need = buffers * chunk_bytes + state_bytes
  if need > limit:
    raise ValueError(
        f"iterations_per_loop={iterations_per_loop}: the input chunks do not fit in the memory "
        f"of {device}: {buffers} chunks in flight (prefetch={prefetch} + 3) x "
        f"{_gib(chunk_bytes)} per chunk on each device + {_gib(state_bytes)} of state = "
        f"{_gib(need)} > {_gib(limit)} (its bytes_limit). Lower iterations_per_loop or "
        "prefetch (loopkit.tools.aot reports the program's own memory too)")


def _gib(b: int) -> str:
  if b >= 2**28:
    return f"{b / 2**30:.2f} GiB"
  return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b} bytes"


class DeviceAssembler:
  """Forms chunks ``[slots, B, ...]`` on the mesh from batches placed one at a time.

  Args:
    sharding: the chunk's sharding ``[K, B, ...]`` (B split on the data axes).
    batch_spec: ``(shape, dtype)`` of every leaf of one process's batch ``[B_local, ...]``.
    slots: slots per chunk ``max(K, 2)``.

  The two programs (zero fill; write a batch into a slot, the chunk donated) compile at the
  first chunk, in the feeder's thread, before the first device call is dispatched. Not
  thread-safe (the feeder's producer thread only).
  """

  def __init__(self, sharding: NamedSharding, batch_spec: Sequence[tuple[tuple[int, ...], Any]],
               slots: int):
    self._processes = jax.process_count()
    self._sharding = sharding
    self._batch_sharding = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    self._replicated = NamedSharding(sharding.mesh, P())
    self._spec = list(batch_spec)
    shapes = [(slots, s[0] * self._processes) + tuple(s[1:]) for s, _ in self._spec]
    # the dtype a placed batch gets (float64 is float32 without jax_enable_x64, as the host
    # path's device_put makes it)
    dtypes = [jax.dtypes.canonicalize_dtype(d) for _, d in self._spec]
    shardings = [sharding] * len(shapes)

    def zeros():
      return [jax.numpy.zeros(s, d) for s, d in zip(shapes, dtypes)]

    def write(chunk, batch, i):
      return [jax.lax.dynamic_update_index_in_dim(c, b, i, 0) for c, b in zip(chunk, batch)]

    self._zeros = jax.jit(zeros, out_shardings=shardings)
    self._write = jax.jit(write, donate_argnums=(0,), out_shardings=shardings,
                          in_shardings=(shardings, [self._batch_sharding] * len(shapes),
                                        self._replicated))
    self._slot_index: dict[int, jax.Array] = {}

  def place(self, leaves: list[np.ndarray]) -> list[jax.Array]:
    """One batch's leaves ``[B_local, ...]`` placed on the mesh, B split on the data axes."""
    if self._processes == 1:
      return jax.device_put(leaves, self._batch_sharding)
    return [jax.make_array_from_process_local_data(
        self._batch_sharding, a, (a.shape[0] * self._processes,) + a.shape[1:]) for a in leaves]

  def empty(self) -> list[jax.Array]:
    """A zero chunk (every slot zeros; slots past a call's length are never computed on)."""
    return self._zeros()

  def write(self, chunk: list[jax.Array], batch: list[jax.Array], i: int) -> list[jax.Array]:
    """``chunk`` with slot ``i`` set to the placed ``batch`` (``chunk`` is donated)."""
    index = self._slot_index.get(i)
    if index is None:  # not device_put: see feeding.ChunkFeeder._num_steps
      value = np.int32(i)
      index = self._slot_index[i] = jax.make_array_from_callback((), self._replicated,
                                                                 lambda _: value)
    return self._write(chunk, batch, index)
