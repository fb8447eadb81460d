"""Batches of in-memory arrays: :class:`ArraySource` (step-indexed, reshuffled every epoch,
resumed exactly at any step) and :func:`batch_arrays` (fixed-order batches, for evaluation).

Re-exported by :mod:`loopkit.data.sources` and :mod:`loopkit.data`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from loopkit._internal.checks import check_global_batch_size, process_of, process_rows
from loopkit.data.positions import check_step_position, step_position
from loopkit.data.shards import _num_examples

__all__ = ["ArraySource", "batch_arrays"]


def batch_arrays(arrays: Any, batch_size: int, *,
                 num_batches: int | None = None) -> Iterator[Any]:
  """Batches of host arrays in order, keeping the short last batch (for eval).

  Args:
    arrays: pytree of arrays ``[N, ...]``.
    batch_size: rows per batch (the process-local batch on multi-host).
    num_batches: if given, yield exactly this many batches, the extra ones
      empty (``[0, ...]``); the evaluator pads and masks them.

  Yields:
    Pytrees of numpy arrays ``[b, ...]``, ``b <= batch_size``.

  Raises:
    ValueError: ``num_batches`` too small to hold all N examples.
  """
  n = _num_examples(arrays)
  needed = math.ceil(n / batch_size)
  if num_batches is not None and num_batches < needed:
    raise ValueError(f"{n} examples need {needed} batches of {batch_size}, "
                     f"but num_batches={num_batches}")
  total = needed if num_batches is None else num_batches
  for start in range(0, total * batch_size, batch_size):
    yield jax.tree.map(lambda x, s=start: np.asarray(x[s:s + batch_size]), arrays)


class ArraySource:
  """A step-indexed source over in-memory arrays, reshuffled every epoch.

  Batch ``s`` (0-based global step) is the ``s % steps_per_epoch``-th slice of
  epoch ``s // steps_per_epoch``'s permutation, drawn from ``(seed, epoch)``
  with ``numpy.random.default_rng``. So the order is reproducible from the
  seed, differs per epoch, and a resume at any step (mid-epoch included)
  continues with exactly the batches an uninterrupted run would see: the
  position is the step itself, saved with the seed, B and N that make its batch
  (:meth:`position_at`) and refused at a resume by a source built otherwise
  (:meth:`check_position`). The last ``N % B`` examples of each epoch's
  permutation are dropped (a different subset each epoch).

  On multi-host every process passes the *same* arrays; all draw the same
  global permutation and each takes its ``B / P`` rows of every global batch
  (:func:`loopkit._internal.checks.process_rows`), so the global batches do not
  depend on the process count. The feeder places row ``r`` of a global batch on
  the same device for any process count, over one data axis or several.

  Args:
    arrays: pytree of numpy arrays ``[N, ...]`` (the whole dataset).
    global_batch_size: B, divisible by the process count.
    seed: int seed of the shuffle.
    shuffle: False keeps the original order every epoch.
    num_epochs: None for endless; else ``batch_at`` raises ``IndexError``
      from step ``num_epochs * steps_per_epoch`` on (the loop then stops).
    process_index, process_count: default to JAX's.

  Attributes:
    steps_per_epoch: ``N // B``.
    num_examples: N.

  Raises:
    ValueError: ``N < B``, B not divisible by the process count, leaves with
      different leading sizes.

  Thread-safe for reads (the permutation cache is swapped atomically);
  multi-host-safe.

  Example:
    >>> src = ArraySource({"x": np.arange(10)}, 4, seed=0)
    >>> src.steps_per_epoch
    2
    >>> sorted(np.concatenate([src.batch_at(0)["x"], src.batch_at(1)["x"]]).tolist()) == sorted(
    ...     src.epoch_permutation(0)[:8].tolist())
    True
  """

  def __init__(self, arrays: Any, global_batch_size: int, *, seed: int = 0,
               shuffle: bool = True, num_epochs: int | None = None,
               process_index: int | None = None, process_count: int | None = None):
    self.arrays = arrays
    self.num_examples = _num_examples(arrays)
    self._index, self._count = process_of(process_index, process_count)
    check_global_batch_size(global_batch_size, 1, process_count=self._count)
    if self.num_examples < global_batch_size:
      raise ValueError(f"{self.num_examples} examples are fewer than one batch of "
                       f"{global_batch_size}")
    self.global_batch_size = global_batch_size
    self.local_batch_size = global_batch_size // self._count
    self.seed = int(seed)
    self.shuffle = shuffle
    self.num_epochs = num_epochs
    self.steps_per_epoch = self.num_examples // global_batch_size
    self._cache: tuple[int, np.ndarray] | None = None

  def position_at(self, step: int) -> dict[str, int]:
    """The data position saved after ``step`` steps (the same on every process):
    ``{"array_step": step, "seed", "global_batch_size", "num_examples"}``."""
    return step_position("array_step", step, seed=self.seed,
                         global_batch_size=self.global_batch_size, num_examples=self.num_examples)

  def check_position(self, position: Any, step: int) -> None:
    """Checks a checkpoint's data position before a resume at ``step``
    (:func:`loopkit.data.positions.check_step_position`).

    Raises:
      ValueError: the position came from another pipeline, or from an ArraySource
        with another step, seed, global batch size or example count (a step's batch
        would be other examples); the message names both values. A bare step
        (loopkit 0.2's position) equal to ``step`` is taken, with a warning.
    """
    check_step_position(position, self.position_at(step), step=step, source="ArraySource",
                        accept_bare_step=True)

  def epoch_permutation(self, epoch: int) -> np.ndarray:
    """The order of example indices in ``epoch``: int64 ``[N]``."""
    cache = self._cache
    if cache is not None and cache[0] == epoch:
      return cache[1]
    if self.shuffle:
      perm = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_examples)
    else:
      perm = np.arange(self.num_examples)
    self._cache = (epoch, perm)
    return perm

  def indices_at(self, step: int) -> np.ndarray:
    """Example indices of this process's part of batch ``step``: int64 ``[B / P]``.

    Raises:
      IndexError: ``step < 0`` or past ``num_epochs``.
    """
    epoch, in_epoch = divmod(int(step), self.steps_per_epoch)
    if step < 0 or (self.num_epochs is not None and epoch >= self.num_epochs):
      raise IndexError(f"step {step} is outside the source's {self.num_epochs} epochs")
    lo, hi = process_rows(self.global_batch_size, self._index, self._count)
    start = in_epoch * self.global_batch_size
    return self.epoch_permutation(epoch)[start + lo:start + hi]

  def batch_at(self, step: int) -> Any:
    """The process-local batch for global step ``step`` (0-based): leaves ``[B / P, ...]``."""
    idx = self.indices_at(step)
    return jax.tree.map(lambda x: np.asarray(x)[idx], self.arrays)

  def chunk_at(self, step: int, num_steps: int) -> Any:
    """Batches ``step .. step + num_steps - 1`` stacked: leaves ``[n, B / P, ...]``.

    Equal to stacking ``batch_at`` of each step (across epoch ends too), but one
    gather per leaf instead of one per step: the feeder forms a chunk from it
    without a Python object per batch (``loopkit.data.feeding.ChunkFeeder``). ``n`` is
    ``num_steps``, or fewer where ``num_epochs`` ends first (0 past the end).

    Raises:
      IndexError: ``step < 0``.
    """
    idx = self._chunk_indices(step, num_steps)
    return jax.tree.map(lambda x: np.asarray(x)[idx], self.arrays)

  def _chunk_indices(self, step: int, num_steps: int) -> np.ndarray:
    """Example indices of :meth:`chunk_at`'s batches: int64 ``[n, B / P]``."""
    if step < 0:
      raise IndexError(f"step {step} is outside the source")
    end = step + num_steps
    if self.num_epochs is not None:
      end = max(step, min(end, self.num_epochs * self.steps_per_epoch))
    b = self.global_batch_size
    lo, hi = process_rows(b, self._index, self._count)
    parts = []
    s = step
    while s < end:  # one slice of an epoch's permutation per epoch touched (usually one)
      epoch, in_epoch = divmod(s, self.steps_per_epoch)
      count = min(end - s, self.steps_per_epoch - in_epoch)
      perm = self.epoch_permutation(epoch)[in_epoch * b:(in_epoch + count) * b]
      parts.append(perm.reshape(count, b)[:, lo:hi])
      s += count
    return (np.concatenate(parts) if len(parts) > 1 else parts[0] if parts
            else np.zeros((0, self.local_batch_size), np.int64))

  def _chunk_into(self, step: int, num_steps: int, out: list[np.ndarray]) -> int:
    """:meth:`chunk_at` written into ``out``: rows ``[:n]`` of each leaf, ``n`` returned.

    One ``np.take`` per leaf straight into the caller's buffer (the feeder's chunk
    leaf, already padded and aligned for placement), so the gathered bytes are copied
    once; ``np.take`` also copies whole rows, several times faster than fancy indexing
    on shuffled indices (MLP chunk of 100 x 32 rows: 215 against 740 us).

    Args:
      step: the global step of the first batch.
      num_steps: batches wanted.
      out: per leaf of :attr:`arrays` (in ``jax.tree.leaves`` order), a C-contiguous
        array ``[>= n, B / P, ...]`` of the leaf's dtype and trailing shape.

    Returns:
      ``n``, as :meth:`chunk_at` (fewer where ``num_epochs`` ends first).

    Raises:
      IndexError: ``step < 0``.
      ValueError: a buffer of the wrong shape or dtype (from ``np.take``).
    """
    idx = self._chunk_indices(step, num_steps)
    n = idx.shape[0]
    for x, buf in zip(jax.tree.leaves(self.arrays), out, strict=True):
      # mode="clip": no bounds buffering (the permutation's indices are all in range).
      np.take(np.asarray(x), idx, axis=0, out=buf[:n], mode="clip")
    return n
