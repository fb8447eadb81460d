"""A device-resident dataset: the whole (small) dataset lives on the devices.

For datasets that fit in device memory (MNIST, CIFAR, tabular sets) the host
need not move examples at all. :class:`DeviceDataset` puts the arrays on every
device once; the training loop then feeds only tiny *index batches* (two int32
numbers per example: the epoch and the position in the epoch) and the compiled
step gathers the examples by index on device::

    ds = DeviceDataset({"image": x, "label": y}, 128, mesh=mesh, seed=0)
    loop = TrainLoop(ds.wrap_step(train_step), iterations_per_loop=100, mesh=mesh,
                     steps_per_epoch=ds.steps_per_epoch)
    wstate = loop.run(ds.attach(state), ds, num_epochs=10)
    state = wstate.train_state

Why the data rides in the state: a jitted function that *closes over* a large
array embeds it in the program as a constant (JAX 0.10 with default flags:
a 200 MB array gave a 400 MB HLO and a 7 s compile), so the arrays must be an
argument. :meth:`DeviceDataset.attach` wraps the train state in a
:class:`DeviceDataState` ``(train_state, data)``; the state is donated, so the
data buffers are aliased from call to call, never copied. One compilation per
run, like any state. A checkpoint of the wrapped state also stores the data.

Shuffling: epoch ``e`` visits the examples in the order of a pseudo-random
permutation drawn from ``(seed, e)``: a 6-round balanced Feistel network over
the next power of four >= N, cycle-walked into ``[0, N)`` (expected < 4
walks per index). It is evaluated per example on device in O(1), with no
O(N log N) sort per step, and bit-identically on the host by
:meth:`DeviceDataset.epoch_permutation` (numpy) for tests and debugging. The
position of a batch is its global step, so the order is reproducible from the
seed, differs per epoch, and is identical after a mid-epoch resume. The last
``N % B`` positions of each epoch are dropped (a different subset each epoch).

Memory: every device holds the whole dataset (replicated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from loopkit._internal.checks import check_global_batch_size, check_step_style, default_step_of
from loopkit._internal.mesh import resolve_mesh
from loopkit.data.positions import check_step_position, step_position

_ROUNDS = 6


def _fmix32(h, xp):
  """MurmurHash3's 32-bit finalizer on uint32 arrays (wrapping arithmetic)."""
  h = h ^ (h >> xp.uint32(16))
  h = h * xp.uint32(0x85EBCA6B)
  h = h ^ (h >> xp.uint32(13))
  h = h * xp.uint32(0xC2B2AE35)
  return h ^ (h >> xp.uint32(16))


def _seed32(seed: int) -> int:
  """Folds a Python int seed of any size into 32 bits."""
  seed = int(seed)
  if seed < 0:
    raise ValueError(f"seed must be >= 0, got {seed}")
  out = np.uint32(0x5851F42D)
  while True:
    out = _fmix32(np.array([out ^ np.uint32(seed & 0xFFFFFFFF)], np.uint32), np)[0]
    seed >>= 32
    if not seed:
      return int(out)


def _permute(position, epoch, *, n: int, seed32: int, xp):
  """Feistel permutation of ``[0, n)`` keyed by (seed, epoch), elementwise.

  Args:
    position: int array ``[...]`` of positions in ``[0, n)``.
    epoch: int array broadcastable to ``position``.
    n: domain size (static).
    seed32: 32-bit seed (static).
    xp: ``numpy`` or ``jax.numpy``.

  Returns:
    uint32 array of example indices, a bijection of ``[0, n)`` per epoch.
  """
  bits = max(2, (n - 1).bit_length())
  half = (bits + 1) // 2
  mask = xp.uint32((1 << half) - 1)
  u = lambda v: xp.asarray(v).astype(xp.uint32)
  e = _fmix32(u(epoch) * xp.uint32(0x9E3779B1) ^ xp.uint32(seed32), xp)
  keys = [_fmix32(e ^ xp.uint32((0x85EBCA77 * (i + 1)) & 0xFFFFFFFF), xp)
          for i in range(_ROUNDS)]

  def feistel(x):
    left, right = x >> xp.uint32(half), x & mask
    for k in keys:
      left, right = right, left ^ (_fmix32(right ^ k, xp) & mask)
    return (left << xp.uint32(half)) | right

  x = feistel(u(position))
  if xp is np:
    while np.any(x >= n):
      x = np.where(x >= n, feistel(x), x)
    return x
  return jax.lax.while_loop(lambda x: jnp.any(x >= n),
                            lambda x: jnp.where(x >= n, feistel(x), x), x)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceDataState:
  """A train state with the device-resident dataset riding along.

  Attributes:
    train_state: the user's train state pytree.
    data: the dataset, a pytree of ``jax.Array`` ``[N, ...]``, replicated on
      the mesh.

  ``step`` forwards to the train state's step counter, so ``TrainLoop``'s
  default ``step_of`` works unchanged.
  """

  train_state: Any
  data: Any

  @property
  def step(self) -> jax.Array:
    """The train state's step counter (``state.step`` / ``state["step"]``)."""
    return default_step_of(self.train_state)


class DeviceDataset:
  """A dataset held on the devices, batches gathered by index inside the step.

  The object is also the step-indexed source for ``TrainLoop.run``:
  ``batch_at(step)`` returns the index batch for a global step.

  Args:
    arrays: pytree of numpy arrays ``[N, ...]`` (on multi-host: the same
      arrays on every process).
    global_batch_size: B, divisible by the data-parallel size; N >= B.
    mesh: the training mesh.
    data_axis: the mesh axis the batch is split over.
    seed: shuffle seed, an int >= 0.
    shuffle: False visits the examples in order every epoch.
    num_epochs: None for endless; else ``batch_at`` ends the source after
      ``num_epochs`` epochs.
    step_style: the ``TrainLoop``'s ``step_style`` (``"global"`` gathers in a
      ``shard_map`` over the data axis; ``"per_device"`` gathers the device's
      slice directly).

  Attributes:
    steps_per_epoch: ``N // B``.
    num_examples: N.

  Raises:
    ValueError: N < B, B not divisible by the data-parallel size or the
      process count, leaves with different leading sizes, unknown
      ``data_axis`` or ``step_style``, negative seed.

  Multi-host-safe; not thread-safe for :meth:`attach` (call it once).
  """

  def __init__(self, arrays: Any, global_batch_size: int, *, mesh: Mesh,
               data_axis: str = "data", seed: int = 0, shuffle: bool = True,
               num_epochs: int | None = None,
               step_style: Literal["global", "per_device"] = "global"):
    resolve_mesh(mesh, data_axis)
    check_step_style(step_style)
    sizes = {np.shape(x)[0] for x in jax.tree.leaves(arrays)}
    if len(sizes) != 1:
      raise ValueError(f"all arrays need the same leading (example) size, got {sorted(sizes)}")
    self.num_examples = sizes.pop()
    dp = mesh.shape[data_axis]
    check_global_batch_size(global_batch_size, dp, process_count=jax.process_count())
    if self.num_examples < global_batch_size:
      raise ValueError(f"{self.num_examples} examples are fewer than one batch of "
                       f"{global_batch_size}")
    if self.num_examples >= 2**31:
      raise ValueError(f"{self.num_examples} examples do not fit int32 positions")
    self.arrays = arrays
    self.global_batch_size = global_batch_size
    self.local_batch_size = global_batch_size // jax.process_count()
    self.mesh = mesh
    self.data_axis = data_axis
    self.seed = seed
    self._seed32 = _seed32(seed)
    self.shuffle = shuffle
    self.num_epochs = num_epochs
    self.step_style = step_style
    self.steps_per_epoch = self.num_examples // global_batch_size

  # -- host side ---------------------------------------------------------------

  def attach(self, train_state: Any) -> DeviceDataState:
    """Puts the dataset on the mesh (replicated) next to ``train_state``.

    Args:
      train_state: the train state pytree.

    Returns:
      ``DeviceDataState(train_state, data)``, data leaves ``jax.Array``
      ``[N, ...]`` with a replicated ``NamedSharding`` on ``mesh``.
    """
    sharding = NamedSharding(self.mesh, P())
    data = jax.tree.map(lambda x: jax.make_array_from_process_local_data(
        sharding, np.asarray(x), np.shape(x)), self.arrays)
    return DeviceDataState(train_state, data)

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """The index batch for global step ``step`` (this process's part).

    Returns:
      ``{"epoch": int32 [B / P], "position": int32 [B / P]}``: the epoch and the
      positions ``in_epoch * B + j`` in that epoch's permutation.

    Raises:
      IndexError: ``step < 0`` or past ``num_epochs`` (ends the source).
    """
    epoch, in_epoch = divmod(int(step), self.steps_per_epoch)
    if step < 0 or (self.num_epochs is not None and epoch >= self.num_epochs):
      raise IndexError(f"step {step} is outside the dataset's {self.num_epochs} epochs")
    start = in_epoch * self.global_batch_size + jax.process_index() * self.local_batch_size
    position = np.arange(start, start + self.local_batch_size, dtype=np.int32)
    return {"epoch": np.full_like(position, epoch), "position": position}

  def position_at(self, step: int) -> dict[str, int]:
    """The data position saved after ``step`` steps (the same on every process):
    ``{"device_data_step": step, "seed", "global_batch_size", "num_examples"}``."""
    return step_position("device_data_step", step, seed=self.seed,
                         global_batch_size=self.global_batch_size, num_examples=self.num_examples)

  def check_position(self, position: Any, step: int) -> None:
    """Checks a checkpoint's data position before a resume at ``step``
    (:func:`loopkit.data.positions.check_step_position`).

    Raises:
      ValueError: the position came from another pipeline, or from a DeviceDataset
        with another step, seed, global batch size or example count (a step's
        index batch would gather other examples); the message names both values.
        A bare step (loopkit 0.2's position) equal to ``step`` is taken, with a
        warning.
    """
    check_step_position(position, self.position_at(step), step=step, source="DeviceDataset",
                        accept_bare_step=True)

  def epoch_permutation(self, epoch: int) -> np.ndarray:
    """Host reference: example indices in visiting order for ``epoch``, int64 ``[N]``."""
    position = np.arange(self.num_examples)
    if not self.shuffle:
      return position
    return _permute(position, np.full_like(position, epoch), n=self.num_examples,
                    seed32=self._seed32, xp=np).astype(np.int64)

  def example_indices(self, step: int) -> np.ndarray:
    """Host reference: the example indices of the global batch at ``step``, int64 ``[B]``."""
    epoch, in_epoch = divmod(int(step), self.steps_per_epoch)
    b = self.global_batch_size
    return self.epoch_permutation(epoch)[in_epoch * b:(in_epoch + 1) * b]

  # -- traced side --------------------------------------------------------------

  def _local_gather(self, data: Any, index: dict[str, jax.Array]) -> Any:
    position = index["position"]
    if self.shuffle:
      example = _permute(position, index["epoch"], n=self.num_examples,
                         seed32=self._seed32, xp=jnp).astype(jnp.int32)
    else:
      example = position
    return jax.tree.map(lambda x: jnp.take(x, example, axis=0, mode="clip"), data)

  def gather(self, data: Any, index: dict[str, jax.Array]) -> Any:
    """Gathers one batch on device (call inside the compiled step).

    Args:
      data: ``DeviceDataState.data``, leaves ``[N, ...]``.
      index: one index batch, ``{"epoch", "position"}`` int32 ``[B]`` (global
        style, sharded on the data axis) or ``[B / D]`` (per-device style).

    Returns:
      The batch, leaves ``[B, ...]`` (or ``[B / D, ...]``) with the data's dtypes.
    """
    if self.step_style == "per_device":
      return self._local_gather(data, index)
    spec = P(self.data_axis)
    return jax.shard_map(
        self._local_gather, mesh=self.mesh,
        in_specs=(jax.tree.map(lambda _: P(), data), jax.tree.map(lambda _: spec, index)),
        out_specs=jax.tree.map(lambda _: spec, data))(data, index)

  def wrap_step(self, train_step: Callable) -> Callable:
    """Turns ``train_step(state, batch)`` into a step on ``DeviceDataState``.

    Args:
      train_step: ``(state, batch) -> (state, metrics)``, pure; sees the
        gathered batch exactly as it would see a host-fed one.

    Returns:
      ``(DeviceDataState, index_batch) -> (DeviceDataState, metrics)``, for
      ``TrainLoop`` with this dataset as the batch source.
    """

    def step(wstate: DeviceDataState, index: dict[str, jax.Array]):
      batch = self.gather(wstate.data, index)
      new_state, metrics = train_step(wstate.train_state, batch)
      return DeviceDataState(new_state, wstate.data), metrics

    return step
