"""Per-process shards on multi-host: which examples each process reads.

:func:`process_shard_bounds`, :func:`shard_for_process`, :func:`tfds_split_for_process` and
:func:`grain_shard_for_process` split N examples the same way (contiguous, disjoint,
complete, sizes differing by at most one); :func:`grain_shard_options` is for a Grain
``DataLoader``; :func:`eval_batches_per_process` is the batch count every process runs in an
evaluation. Re-exported by :mod:`loopkit.data.sources` and :mod:`loopkit.data`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from loopkit._internal.checks import check_global_batch_size, process_of
from loopkit._internal.extras import require

__all__ = ["eval_batches_per_process", "grain_shard_for_process", "grain_shard_options",
           "process_shard_bounds", "shard_for_process", "tfds_split_for_process"]


def process_shard_bounds(num_examples: int, process_index: int | None = None,
                         process_count: int | None = None) -> tuple[int, int]:
  """The contiguous range of examples a process reads.

  The same split as Grain's ``even_split`` and TFDS ``even_splits``
  (``drop_remainder=False``): the first ``num_examples % process_count``
  processes get one example more.

  Args:
    num_examples: N >= 0, examples in the whole dataset.
    process_index: this process (default ``jax.process_index()``).
    process_count: P (default ``jax.process_count()``).

  Returns:
    ``(start, stop)``: the process reads examples ``start <= i < stop``.

  Raises:
    ValueError: ``num_examples < 0`` or ``process_index`` not in ``[0, P)``.

  Example:
    >>> [process_shard_bounds(10, p, 4) for p in range(4)]
    [(0, 3), (3, 6), (6, 8), (8, 10)]
  """
  index, count = process_of(process_index, process_count)
  if num_examples < 0:
    raise ValueError(f"num_examples must be >= 0, got {num_examples}")
  base, extra = divmod(int(num_examples), count)
  start = index * base + min(index, extra)
  return start, start + base + (1 if index < extra else 0)


def shard_for_process(arrays: Any, process_index: int | None = None,
                      process_count: int | None = None) -> Any:
  """This process's slice (:func:`process_shard_bounds`) of a pytree of arrays.

  Args:
    arrays: pytree of arrays ``[N, ...]`` sharing the leading axis.
    process_index, process_count: as in :func:`process_shard_bounds`.

  Returns:
    The same pytree with leaves ``[stop - start, ...]`` (views, not copies).

  Raises:
    ValueError: leaves with different leading sizes.
  """
  n = _num_examples(arrays)
  start, stop = process_shard_bounds(n, process_index, process_count)
  return jax.tree.map(lambda x: x[start:stop], arrays)


def tfds_split_for_process(split: str, *, process_index: int | None = None,
                           process_count: int | None = None) -> Any:
  """The TFDS sub-split this process reads (``tfds.split_for_jax_process``).

  Args:
    split: a TFDS split string, e.g. ``"train"`` or ``"train[:90%]"``.
    process_index, process_count: default to JAX's.

  Returns:
    A split for ``tfds.load(split=...)``, sized like :func:`process_shard_bounds`.
  """
  tfds = require("tensorflow_datasets", "loopkit.data.tfds_split_for_process")  # heavy: on use

  index, count = process_of(process_index, process_count)
  return tfds.split_for_jax_process(split, process_index=index, process_count=count,
                                    drop_remainder=False)


def grain_shard_options(*, process_index: int | None = None, process_count: int | None = None,
                        drop_remainder: bool = False) -> Any:
  """Grain shard options for this process (``grain.sharding.ShardByJaxProcess``).

  Args:
    process_index, process_count: default to JAX's; give both to simulate
      processes in a single-process test.
    drop_remainder: drop the ``N % P`` extra examples so every shard is equal
      (training); keep them for evaluation (default).

  Returns:
    ``grain.sharding.ShardOptions`` for a sampler or ``MapDataset`` slicing.
  """
  grain = require("grain", "loopkit.data.grain_shard_options")  # heavy: on use

  if process_index is None and process_count is None:
    return grain.sharding.ShardByJaxProcess(drop_remainder=drop_remainder)
  index, count = process_of(process_index, process_count)
  return grain.sharding.ShardOptions(shard_index=index, shard_count=count,
                                     drop_remainder=drop_remainder)


def grain_shard_for_process(dataset: Any, *, process_index: int | None = None,
                            process_count: int | None = None) -> Any:
  """This process's contiguous slice of a Grain ``MapDataset`` (every example kept).

  Use it for evaluation: a Grain ``DataLoader`` sharded with
  ``ShardByJaxProcess`` yields ``N // P`` records per process even with
  ``drop_remainder=False`` (grain 0.2.18: 10 records over 4 processes give
  2 each, losing 2), while this slice gives ``[3, 3, 2, 2]``.

  Args:
    dataset: a ``grain.MapDataset`` (random access, known length).
    process_index, process_count: default to JAX's.

  Returns:
    ``dataset[start:stop]`` with bounds from :func:`process_shard_bounds`.
  """
  start, stop = process_shard_bounds(len(dataset), process_index, process_count)
  return dataset[start:stop]


def eval_batches_per_process(num_examples: int, global_batch_size: int,
                             process_count: int | None = None) -> int:
  """Eval batches every process must run so that all run the same number.

  With shards from :func:`process_shard_bounds` the largest shard has
  ``ceil(N / P)`` examples and each process feeds ``B / P`` per batch, so
  every process runs ``ceil(ceil(N / P) / (B / P))`` batches; shorter shards
  end with padded, fully masked batches.

  Args:
    num_examples: N, examples in the whole eval set.
    global_batch_size: B, divisible by the process count.
    process_count: P (default ``jax.process_count()``).

  Returns:
    The batch count (int >= 0).

  Raises:
    ValueError: B not divisible by P, or B < 1.
  """
  _, count = process_of(0, process_count)
  check_global_batch_size(global_batch_size, 1, process_count=count)
  return math.ceil(math.ceil(num_examples / count) / (global_batch_size // count))


def _num_examples(arrays: Any) -> int:
  sizes = {np.shape(x)[0] for x in jax.tree.leaves(arrays)}
  if len(sizes) != 1:
    raise ValueError(f"all arrays need the same leading (example) size, got {sorted(sizes)}")
  return sizes.pop()
