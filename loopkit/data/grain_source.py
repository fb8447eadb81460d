"""A step-indexed source over a Grain random-access dataset: O(1) resume, one global order.

:class:`GrainSource` reads any random-access data source (a
``grain.sources.ArrayRecordDataSource``, ``tfds.data_source(...)``, a
``grain.MapDataset``, anything with ``len`` and ``[i]``) so that the global
batch of step ``s`` is a pure function of ``(seed, s)`` and the dataset:

* **Order (Grain's).** Global row ``r`` of step ``s`` is flat index
  ``t = s * B + r``; with ``S = N // B`` steps per epoch it is place
  ``t % (S * B)`` of epoch ``t // (S * B)``'s order, Grain's
  ``MapDataset.shuffle(seed)`` (epoch e draws its permutation from
  ``seed + e``). Each epoch's last ``N % B`` places are dropped.
* **Transforms (Grain's).** ``transform`` (e.g. ``lambda ds:
  ds.map(decode).random_map(augment, seed=1)``) is applied to that globally
  ordered dataset, so a ``random_map``'s randomness is keyed by ``t``: the
  same crop of the same example at the same step whatever the process or
  worker count.
* **Rows (loopkit's).** Process ``p`` of ``P`` reads only rows
  ``[p * B / P, (p + 1) * B / P)`` of each global batch
  (:func:`loopkit._internal.checks.process_rows`), and the feeder places them
  there (``jax.make_array_from_process_local_data``; the mesh must give each
  process's devices its rows, :func:`loopkit._internal.mesh.check_batch_on_mesh`),
  so row ``r`` lands on the same device position for any process count, with
  the batch on one data axis or on several (``data_axis=("data", "fsdp")``).
* **Position (loopkit's).** The saved data position is
  ``{"grain_step": s, ...}``: a resume at step ``s`` reads the records of the
  steps from ``s`` on and none before (O(1) in ``s``).
* **Chunks.** ``chunk_at(step, n)`` returns the ``n`` batches stacked,
  ``[n, B / P, ...]``, read in one Grain batched read (``worker_count=0``) or
  from a Grain iterator (``to_iter_dataset`` with ``read_threads`` threads,
  then ``mp_prefetch`` over ``worker_count`` worker processes, one batch per
  worker message), which decode and augment in parallel. The worker count is
  not part of the order: a resume with another count sees the same batches.

Why not ``grain.experimental.ElasticIterator`` (grain 0.2.18)? It keeps the
same O(1) state (``global_next_index``) and reshards on any process count, but
gives process ``p`` the strided records ``t = next + p + P * j``, so row
``j`` of process p's batch is global row ``p + P * j`` when P > 1 and row
``p * B / P + j`` is another example: the examples of a global batch stay
the same, their device positions (and the per-device reduction order) move
with P. It is also an iterator (``next``), not indexed by step. The layers
here are the same idea with contiguous rows, indexed by step.

Imports grain when a source is built.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np

from loopkit._internal.checks import check_global_batch_size, process_of, process_rows
from loopkit._internal.extras import require
from loopkit.data._worker_exit import exit_with_parent
from loopkit.data.positions import check_step_position, step_position

_UNBOUNDED_EPOCHS = 2**31  # "endless": a finite Grain length (index arithmetic stays int64)
_POSITION_KEY = "grain_step"


def _stack(batches: list[Any]) -> Any:
  return jax.tree.map(lambda *xs: np.stack(xs), *batches)


class GrainSource:
  """A Grain random-access dataset as a step-indexed, chunk-forming source.

  Args:
    data: the records: a ``grain.MapDataset`` or a random-access data source
      (``len(data)``, ``data[i]``; e.g. ``grain.sources.ArrayRecordDataSource``,
      ``tfds.data_source(name, split=...)``). Every process passes the same one.
    global_batch_size: B, divisible by the process count.
    seed: seed of Grain's shuffle, in ``[0, 2**32)``.
    shuffle: False reads the records in order every epoch.
    num_epochs: None for endless; else the source ends after
      ``num_epochs * steps_per_epoch`` steps (``batch_at`` raises ``IndexError``).
    transform: ``MapDataset -> MapDataset``, one element out per element in
      (``map``, ``random_map``; no ``filter``, no ``batch``), applied to the
      globally ordered records; a batch's leaves are the stacked elements.
    batch_transform: ``batch -> batch`` on stacked elements ``[m, ...]``, row by
      row (output row i depends only on input row i; ``m`` is any count), run
      once per read instead of once per record: e.g. one ``tf.function``
      decoding a batch of images, with per-example seeds that ``transform``
      drew. Picklable for worker processes.
    worker_count: Grain worker processes (``mp_prefetch``); 0 reads in the
      calling thread (the feeder's prefetch thread).
    worker_buffer_size: batches each worker prepares ahead
      (``MultiprocessingOptions.per_worker_buffer_size``).
    read_threads: threads reading whole batches in each worker (in the
      calling process when ``worker_count=0``); > 1 pays off where the
      transform releases the GIL (TF or PIL image ops).
    read_options: ``grain.ReadOptions`` of each reader (default:
      ``read_threads`` threads, a buffer of ``max(read_threads,
      worker_buffer_size)`` batches); overrides ``read_threads``.
    process_index, process_count: default to JAX's.

  Attributes:
    num_records: N.
    steps_per_epoch: ``N // B``.
    global_batch_size, local_batch_size: B and ``B / P``.

  Raises:
    ValueError: B not divisible by the process count (naming both), N < B, a
      seed outside ``[0, 2**32)``, ``worker_count < 0``.

  Not thread-safe: one feeder reads it at a time (with workers it keeps one
  Grain iterator, re-opened where a read does not continue the last one).
  Multi-host-safe: every process computes the same order and reads its rows.
  ``close()`` stops the worker processes; the feeder calls it when a run ends
  (garbage collection does too), and the next read starts them again. A worker also exits by
  itself within a moment of this process's death, however it died (``SIGKILL`` included:
  :func:`loopkit.data._worker_exit.exit_with_parent`).

  Example:
    >>> src = GrainSource([{"x": np.float32(i)} for i in range(10)], 4, seed=0)
    >>> src.steps_per_epoch, src.chunk_at(0, 2)["x"].shape
    (2, (2, 4))
  """

  def __init__(self, data: Any, global_batch_size: int, *, seed: int = 0,
               shuffle: bool = True, num_epochs: int | None = None, transform: Any = None,
               batch_transform: Any = None,
               worker_count: int = 0, worker_buffer_size: int = 1, read_threads: int = 1,
               read_options: Any = None, process_index: int | None = None,
               process_count: int | None = None):
    grain = require("grain", "loopkit.data.GrainSource")  # heavy: on use
    from loopkit.data import _grain_datasets  # noqa: PLC0415 (imports grain)

    self._index, self._count = process_of(process_index, process_count)
    check_global_batch_size(global_batch_size, 1, process_count=self._count)
    self.num_records = len(data)
    if self.num_records < global_batch_size:
      raise ValueError(f"{self.num_records} records are fewer than one global batch of "
                       f"{global_batch_size}")
    if not 0 <= int(seed) < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    if worker_count < 0 or read_threads < 1:
      raise ValueError(f"worker_count must be >= 0 and read_threads >= 1, got {worker_count} "
                       f"and {read_threads}")
    self.global_batch_size = int(global_batch_size)
    self.local_batch_size = self.global_batch_size // self._count
    self.seed = int(seed)
    self.shuffle = shuffle
    self.num_epochs = num_epochs
    self.steps_per_epoch = self.num_records // self.global_batch_size
    self.worker_count = int(worker_count)
    self._worker_buffer_size = int(worker_buffer_size)
    self._read_options = read_options or grain.ReadOptions(
        num_threads=read_threads, prefetch_buffer_size=max(read_threads, worker_buffer_size))
    # The exact path (reads exactly the rows asked for) unless workers or threads read ahead.
    self._direct = worker_count == 0 and read_threads == 1 and read_options is None
    epochs = _UNBOUNDED_EPOCHS if num_epochs is None else int(num_epochs)
    self._total_steps = epochs * self.steps_per_epoch
    self._grain = grain
    self._layers = _grain_datasets

    base = data if isinstance(data, grain.MapDataset) else grain.MapDataset.source(data)
    self._rows = self._process_rows(base, transform)
    self._batch_transform = batch_transform
    self._iter: Any = None
    self._iter_step = -1
    self._lock = threading.Lock()

  def _process_rows(self, base: Any, transform: Any) -> Any:
    """``base`` in the global order, transformed, then this process's rows (a MapDataset)."""
    ordered = base.shuffle(self.seed) if self.shuffle else base
    ordered = self._layers.GlobalOrder(
        ordered, num_records=self.num_records, steps_per_epoch=self.steps_per_epoch,
        global_batch_size=self.global_batch_size,
        length=self._total_steps * self.global_batch_size)
    if transform is not None:
      ordered = transform(ordered)
      if len(ordered) != self._total_steps * self.global_batch_size:
        raise ValueError(f"transform must keep one element per record (a map or random_map); "
                         f"it changed the length from {self._total_steps * self.global_batch_size}"
                         f" to {len(ordered)}")
    lo, hi = process_rows(self.global_batch_size, self._index, self._count)
    return self._layers.ProcessRows(ordered, global_batch_size=self.global_batch_size,
                                    first_row=lo, local_batch_size=hi - lo)

  def record_indices_at(self, step: int) -> np.ndarray:
    """Record indices (into ``data``) of this process's rows at ``step``: int64 ``[B / P]``.

    The same Grain pipeline over ``grain.MapDataset.range(N)`` (no record is read).
    """
    self._check_step(step)
    ids = self._process_rows(self._grain.MapDataset.range(self.num_records), None)
    b = self.local_batch_size
    return np.asarray([ids[k] for k in range(step * b, (step + 1) * b)], np.int64)

  def _check_step(self, step: int) -> None:
    if step < 0 or step >= self._total_steps:
      raise IndexError(f"step {step} is outside the source's {self.num_epochs} epochs "
                       f"of {self.steps_per_epoch} steps")

  def batch_at(self, step: int) -> Any:
    """This process's batch of global step ``step`` (0-based): leaves ``[B / P, ...]``.

    Raises:
      IndexError: ``step < 0`` or past ``num_epochs``.
    """
    self._check_step(step)
    return jax.tree.map(lambda x: x[0], self.chunk_at(step, 1))

  def chunk_at(self, step: int, num_steps: int) -> Any:
    """Batches ``step .. step + num_steps - 1`` stacked: leaves ``[n, B / P, ...]``.

    ``n`` is ``num_steps``, or fewer where ``num_epochs`` ends first (0 past
    the end). Reads exactly the records of those rows (``worker_count=0``,
    ``read_threads=1``), or continues a Grain iterator (worker processes and/or
    threads, which read up to their buffers ahead), re-opening it at ``step`` when the last read did
    not end there.

    Raises:
      IndexError: ``step < 0``.
    """
    if step < 0:
      raise IndexError(f"step {step} is outside the source")
    count = max(0, min(step + num_steps, self._total_steps) - step)
    if count == 0:  # past the end: the leaves of step 0's batch, [0, B / P, ...]
      return jax.tree.map(lambda x: x[:0], self.chunk_at(0, 1))
    b = self.local_batch_size
    if self._direct:
      flat = self._rows[step * b:(step + count) * b].batch(count * b)[0]
      if self._batch_transform is not None:
        flat = self._batch_transform(flat)
      return jax.tree.map(lambda x: x.reshape((count, b) + x.shape[1:]), flat)
    with self._lock:
      if self._iter is None or self._iter_step != step:
        self._open(step)
      batches = [next(self._iter) for _ in range(count)]
      self._iter_step = step + count
    return _stack(batches)

  def _open(self, step: int) -> None:
    self._close_iter()
    grain = self._grain
    from absl import flags  # noqa: PLC0415 (grain's dependency)

    if not flags.FLAGS.is_parsed():  # mp_prefetch reads grain's absl flags (their defaults)
      flags.FLAGS.mark_as_parsed()
    ds = self._rows.batch(self.local_batch_size)[step:self._total_steps]
    if self._batch_transform is not None:
      ds = ds.map(self._batch_transform)
    ds = ds.to_iter_dataset(read_options=self._read_options)
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=self.worker_count, per_worker_buffer_size=self._worker_buffer_size),
        worker_init_fn=exit_with_parent)  # a worker outlives no parent, however it died
    self._iter = iter(ds)
    self._iter_step = step

  def _close_iter(self) -> None:
    it, self._iter = self._iter, None
    if it is not None and callable(getattr(it, "close", None)):
      it.close()

  def close(self) -> None:
    """Stops the worker processes (if any); a later read starts them again."""
    with self._lock:
      self._close_iter()

  def __enter__(self) -> GrainSource:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  # The feeder may place chunk_at's leaves as they are: new arrays nothing else holds.
  chunks_are_fresh = True

  def position_at(self, step: int) -> dict[str, int]:
    """The data position saved after ``step`` steps (the same on every process):
    ``{"grain_step": step, "seed", "global_batch_size", "num_records"}``."""
    return step_position(_POSITION_KEY, step, seed=self.seed,
                         global_batch_size=self.global_batch_size, num_records=self.num_records)

  def check_position(self, position: Any, step: int) -> None:
    """Checks a checkpoint's data position before a resume at ``step``
    (:func:`loopkit.data.positions.check_step_position`).

    Raises:
      ValueError: the position came from another pipeline (a ``tf.data``
        batch count, an iterator state, another step-indexed source's position),
        or from a GrainSource with another step, seed, global batch size or
        record count; the message names both values.
    """
    check_step_position(position, self.position_at(step), step=step, source="GrainSource")

  def __repr__(self) -> str:
    return (f"GrainSource(num_records={self.num_records}, global_batch_size="
            f"{self.global_batch_size}, seed={self.seed}, workers={self.worker_count})")
