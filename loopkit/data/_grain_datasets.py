"""The two Grain ``MapDataset`` layers behind :class:`loopkit.data.grain_source.GrainSource`.

Imported only by that module, when a source is built (it imports grain). They
live at module level so that Grain's worker processes (started with
``spawn``) can unpickle them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain


class GlobalOrder(grain.MapDataset):
  """Global flat index ``t = s * B + r`` (step s, row r) -> the shuffled record.

  ``t`` is in epoch ``e = t // (S * B)`` (S = steps per epoch) at place
  ``q = t % (S * B)``; the element is ``parent[e * N + q]`` of a parent of N
  records whose index ``e * N + q`` is epoch e's place q (Grain's
  ``MapDataset.shuffle`` draws epoch e's permutation from ``seed + e``; an
  unshuffled source wraps the index modulo N). The last ``N - S * B`` places of
  each epoch's order are never used (the epoch's remainder is dropped).

  Thread-safe (no state); picklable.
  """

  def __init__(self, parent: grain.MapDataset, *, num_records: int, steps_per_epoch: int,
               global_batch_size: int, length: int):
    super().__init__(parent)
    self._n = num_records
    self._per_epoch = steps_per_epoch * global_batch_size
    self._length = length

  def __len__(self) -> int:
    return self._length

  def __str__(self) -> str:
    return "loopkit.GlobalOrder"

  def _parent_index(self, t: int) -> int:
    epoch, place = divmod(int(t), self._per_epoch)
    return epoch * self._n + place

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    return self._parent[self._parent_index(index)]

  def _getitems(self, indices: Sequence[int]) -> Sequence[Any]:
    return self._parent._getitems([self._parent_index(t) for t in indices])  # noqa: SLF001


class ProcessRows(grain.MapDataset):
  """This process's rows of every global batch, in step order.

  Element ``k`` (step ``s = k // b``, local row ``j = k % b``, ``b = B / P``)
  is ``parent[s * B + first_row + j]``: process p owns the contiguous rows
  ``[first_row, first_row + b)`` of each global batch (``first_row = p * b``:
  :func:`loopkit._internal.checks.process_rows`), so row r of global batch s
  holds the same example whatever the process count.

  Thread-safe (no state); picklable.
  """

  def __init__(self, parent: grain.MapDataset, *, global_batch_size: int,
               first_row: int, local_batch_size: int):
    super().__init__(parent)
    self._big = global_batch_size
    self._b = local_batch_size
    self._offset = first_row
    self._length = len(parent) // global_batch_size * local_batch_size

  def __len__(self) -> int:
    return self._length

  def __str__(self) -> str:
    return "loopkit.ProcessRows"

  def _parent_index(self, k: int) -> int:
    step, row = divmod(int(k), self._b)
    return step * self._big + self._offset + row

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    return self._parent[self._parent_index(index)]

  def _getitems(self, indices: Sequence[int]) -> Sequence[Any]:
    return self._parent._getitems([self._parent_index(k) for k in indices])  # noqa: SLF001
