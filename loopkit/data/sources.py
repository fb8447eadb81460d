"""Batch sources for the loop and the evaluator, and per-process shards.

Every source yields *batches*: pytrees of numpy arrays with a leading batch
axis (the global batch on one process, the process-local part on multi-host).
How each kind is resumed at a saved position (see
:func:`loopkit.data.sources.open_source`):

========================================  ==========================================
source                                    saved position / resume
========================================  ==========================================
plain iterable (list, re-iterable)        batch count; counted skip on a fresh
                                          ``iter()`` (reads skipped batches once)
Grain ``DataLoader`` / ``IterDataset``    the iterator's ``get_state()``;
                                          ``set_state`` (no batches re-read)
:class:`TfDataSource` (tf.data, TFDS)     ``{"tf_batches": n}``; ``Dataset.skip(n)``
step-indexed (``batch_at(step)``)         the global step, or ``position_at(step)``
:class:`ArraySource`                      ``{"array_step": s, "seed", "global_batch_size",
                                          "num_examples"}``; checked (``check_position``,
                                          :mod:`loopkit.data.positions`), then step s
:class:`~loopkit.data.GrainSource`        ``{"grain_step": s, ...}``; checked, then
(Grain random access, ArrayRecord)        step s (no record re-read)
:class:`~loopkit.data.DeviceDataset`      ``{"device_data_step": s, ...}``; checked, then s
========================================  ==========================================

Grain loaders and datasets need no adapter: pass them to ``TrainLoop.run``
as they are. For exact resumes a source must replay the same sequence when
re-opened (fixed seeds; tf.data with deterministic ordering).

Per-process input on multi-host: :func:`process_shard_bounds`,
:func:`shard_for_process`, :func:`tfds_split_for_process` and
:func:`grain_shard_for_process` all split N examples the same way: contiguous,
disjoint, complete, sizes differing by at most one, the first ``N % P``
processes one larger (10 over 4 -> [3, 3, 2, 2]). :func:`grain_shard_options`
(``ShardByJaxProcess``) is for training with a Grain ``DataLoader``, which
keeps only ``N // P`` records per process.
:func:`eval_batches_per_process` gives the batch count every process must run
so that none waits at a collective; :class:`loopkit.evaluation.Evaluator` pads
the short processes with fully masked batches.

Heavy libraries (tensorflow, tensorflow_datasets, grain) are imported only
when a function that needs them is called.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from loopkit._internal.checks import check_global_batch_size, process_of, process_rows
from loopkit._internal.extras import require
from loopkit.data.positions import check_step_position, step_position


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


def _num_examples(arrays: Any) -> int:
  sizes = {np.shape(x)[0] for x in jax.tree.leaves(arrays)}
  if len(sizes) != 1:
    raise ValueError(f"all arrays need the same leading (example) size, got {sorted(sizes)}")
  return sizes.pop()


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


class TfDataSource:
  """A ``tf.data.Dataset`` (e.g. from ``tfds.load``) as a resumable numpy source.

  Iterates with ``tfds.as_numpy``; the position is the number of batches
  consumed, ``{"tf_batches": n}``, and ``set_state`` re-opens the dataset at
  ``dataset.skip(n)`` (tf.data reads and drops the skipped elements in C++;
  no numpy conversion). Exact resumes need a dataset that replays the same
  sequence: fixed shuffle seeds and deterministic ordering.

  Args:
    dataset: a batched ``tf.data.Dataset`` whose elements are tensors or
      dicts/tuples of tensors with a leading batch axis.

  Example:
    >>> import tensorflow as tf  # doctest: +SKIP
    >>> src = TfDataSource(tf.data.Dataset.range(10).batch(2))  # doctest: +SKIP
  """

  def __init__(self, dataset: Any):
    self.dataset = dataset

  def __iter__(self) -> _TfIterator:
    return _TfIterator(self.dataset)


class _TfIterator:
  """Iterator over a tf.data.Dataset as numpy, with a batch-count state."""

  def __init__(self, dataset: Any):
    self._dataset = dataset
    self._open(0)

  def _open(self, n: int) -> None:
    tfds = require("tensorflow_datasets", "loopkit.TfDataSource")  # heavy: on use

    ds = self._dataset.skip(n) if n else self._dataset
    self._it = iter(tfds.as_numpy(ds))
    self._n = n

  def __iter__(self):
    return self

  def __next__(self) -> Any:
    batch = next(self._it)
    self._n += 1
    return batch

  def get_state(self) -> dict[str, int]:
    """``{"tf_batches": n}``: batches consumed since the start of the dataset."""
    return {"tf_batches": self._n}

  def set_state(self, state: dict[str, int]) -> None:
    """Re-opens the dataset after ``state["tf_batches"]`` batches.

    Raises:
      ValueError: a state saved by another pipeline (e.g. a GrainSource's
        ``{"grain_step": ...}``), naming it.
    """
    if not isinstance(state, dict) or "tf_batches" not in state:
      raise ValueError(f"the checkpoint's data position {state!r} did not come from a tf.data "
                       "pipeline (a TfDataSource saves {'tf_batches': n}): resume with the "
                       "pipeline that saved it, or start a new run in another directory")
    self._open(int(state["tf_batches"]))


def steps_per_epoch_of(source: Any) -> int:
  """The number of batches in one epoch of a sized source (``steps_per_epoch="auto"``).

  Asks, in order: a ``steps_per_epoch`` attribute (:class:`ArraySource`); a
  ``tf.data.Dataset``'s ``cardinality()`` (also inside a
  :class:`TfDataSource`); ``len(source)`` (a list of batches, a Grain
  ``MapDataset`` after ``.batch``). The source is taken to be one epoch.

  Args:
    source: the batches given to ``TrainLoop.run``.

  Returns:
    The epoch length in batches (>= 1).

  Raises:
    ValueError: the length is unknown, naming the source's type and why: an
      infinite tf.data cardinality (``.repeat()``), an unknown one (e.g. after
      ``.filter``; ``tf.data.experimental.assert_cardinality(n)`` declares it),
      an unsized iterator (Grain ``DataLoader`` / ``IterDataset``, generators),
      or an empty source.
  """
  what = f"{type(source).__module__}.{type(source).__qualname__}"
  n = getattr(source, "steps_per_epoch", None)
  dataset: Any = getattr(source, "dataset", source) if isinstance(source, TfDataSource) else source
  if n is None and callable(getattr(dataset, "cardinality", None)):
    n = int(dataset.cardinality())
    if n == -1:  # tf.data.INFINITE_CARDINALITY
      raise ValueError(f"steps_per_epoch='auto': the {what} repeats forever (tf.data "
                       "cardinality INFINITE): pass steps_per_epoch=N, or the dataset before "
                       ".repeat()")
    if n < 0:  # tf.data.UNKNOWN_CARDINALITY
      raise ValueError(f"steps_per_epoch='auto': tf.data does not know the length of this "
                       f"{what} (UNKNOWN cardinality, e.g. after .filter): pass "
                       "steps_per_epoch=N or declare it with "
                       "dataset.apply(tf.data.experimental.assert_cardinality(N))")
  if n is None:
    try:
      n = len(source)
    except TypeError:
      raise ValueError(
          f"steps_per_epoch='auto' needs a sized source, got a {what} (no len(), no tf.data "
          "cardinality, no steps_per_epoch): pass steps_per_epoch=N (e.g. "
          "num_examples // global_batch_size; for a Grain DataLoader, the length of its "
          "batched MapDataset)") from None
  if n < 1:
    raise ValueError(f"steps_per_epoch='auto': the {what} has {n} batches")
  return int(n)


def check_epoch_length(source: Any, steps_per_epoch: int | None) -> None:
  """Refuses a loop's ``steps_per_epoch`` other than the epoch its source declares.

  A source that knows its epoch says so with an int ``steps_per_epoch`` attribute
  (:class:`ArraySource`, :class:`~loopkit.data.GrainSource`,
  :class:`~loopkit.data.DeviceDataset`: ``N // B``); its epoch ``e`` is a
  permutation of its own. A loop told another length would number epochs, fire
  ``every_epochs`` hooks and count ``num_epochs`` at other steps than the source's
  epoch ends (``epoch=0`` at step 20 of a 15-step epoch). A stream (a list, tf.data,
  a Grain iterator) declares no epoch: its length is the batches it holds, which may
  be several epochs, so it is not checked.

  Args:
    source: the batches given to ``TrainLoop.run``.
    steps_per_epoch: the loop's steps per epoch, or None (no epochs: nothing to check).

  Raises:
    ValueError: both lengths known and different, naming both numbers (and the
      source's examples and batch size where it has them) and ``steps_per_epoch``.
  """
  n = getattr(source, "steps_per_epoch", None)
  if (steps_per_epoch is None or isinstance(n, bool) or not isinstance(n, (int, np.integer))
      or n == steps_per_epoch):
    return
  what = type(source).__name__
  examples = getattr(source, "num_examples", getattr(source, "num_records", None))
  batch = getattr(source, "global_batch_size", None)
  made = (f" ({examples} examples // global batch {batch})"
          if isinstance(examples, int) and isinstance(batch, int) else "")
  raise ValueError(
      f"TrainLoop(steps_per_epoch={steps_per_epoch}), but the {what} given to run has an epoch "
      f"of {n} steps{made}: the loop's epochs (LoopInfo.epoch, every_epochs hooks, num_epochs) "
      f"would not end where the source's do. Pass steps_per_epoch={n}, or "
      "steps_per_epoch='auto' to take the source's")


# -- opening a source at a saved position (used by the feeder) ---------------------------


def open_source(batches: Any, position: Any, step: int) -> tuple[Iterator, int]:
  """Opens a batch source at a saved position.

  Args:
    batches: an iterable of batches; an iterator with ``get_state``/``set_state``
      (Grain); or a step-indexed source with ``batch_at(step) -> batch`` (and
      optionally ``position_at(step)``, the position it saves,
      ``check_position(position, step)``, which refuses a position it did not save,
      and ``close()``, called when the run ends to free what reads ahead, such as
      worker processes; a later read must work again, as :class:`GrainSource`'s does).
    position: None (start as given), a batch count (int), or an iterator state.
    step: the global step training resumes at (used for ``batch_at``).

  Returns:
    (iterator positioned at the next unconsumed batch, start count).

  Stateless iterables are positioned by a *counted skip*: ``position`` batches
  are drawn and dropped, which is exact when the iterable restarts from its
  first batch (documented cost: reading the skipped batches once).
  """
  if hasattr(batches, "batch_at"):
    check = getattr(batches, "check_position", None)  # e.g. GrainSource: same pipeline?
    if position is not None and callable(check):
      check(position, step)
    return _StepIndexed(batches, step), step
  it = iter(batches)
  if position is None:
    return it, 0
  if isinstance(position, (int, np.integer)):
    for i in range(int(position)):
      try:
        next(it)
      except StopIteration:
        raise ValueError(f"cannot resume the data at position {position}: the source has "
                         f"only {i} batches") from None
    return it, int(position)
  set_state = getattr(it, "set_state", None)
  if set_state is None:
    raise ValueError(f"the saved data position is an iterator state ({type(position).__name__}) "
                     "but the source has no set_state")
  set_state(position)
  return it, 0


class _StepIndexed:
  """Iterator over ``source.batch_at(step)``; its state is the next step."""

  def __init__(self, source: Any, step: int):
    self._source = source
    self._step = step

  def __iter__(self):
    return self

  def __next__(self):
    try:
      batch = self._source.batch_at(self._step)
    except IndexError:  # a finite step-indexed source: past its last step
      raise StopIteration from None
    self._step += 1
    return batch

  def get_state(self) -> Any:
    """The next step, or the source's ``position_at(step)`` where it has one."""
    position_at = getattr(self._source, "position_at", None)
    return position_at(self._step) if callable(position_at) else self._step

  def skip_batches(self, n: int) -> None:
    """Steps over the next ``n`` batches without reading them (skipped data steps,
    :mod:`loopkit.core.skips`)."""
    self._step += n

  @property
  def takes_chunks(self) -> bool:
    """Whether :meth:`take` is available (the source has ``chunk_at(step, n)``)."""
    return callable(getattr(self._source, "chunk_at", None))

  def take(self, n: int) -> tuple[Any, int, bool]:
    """The next ``n`` batches stacked (``source.chunk_at``): ``(leaves [m, B, ...], m, fresh)``.

    ``m < n`` where the source ends first; the state advances by ``m``. ``fresh``: the
    leaves are new arrays that nothing else refers to or writes (an :class:`ArraySource`'s
    gathers; a source whose ``chunks_are_fresh`` is True, e.g. a GrainSource), so the
    feeder may place them as they are; a user's ``chunk_at`` may return its own buffers,
    which the feeder copies.
    """
    chunk = self._source.chunk_at(self._step, n)
    m = int(np.shape(jax.tree.leaves(chunk)[0])[0])
    self._step += m
    return chunk, m, (type(self._source).chunk_at is ArraySource.chunk_at
                      or getattr(self._source, "chunks_are_fresh", False) is True)

  def close_source(self) -> None:
    """Calls the source's ``close()`` where it has one (a GrainSource stops its worker
    processes; its next read starts them again). The feeder calls it once its producer has
    left the source, when the run ends."""
    close = getattr(self._source, "close", None)
    if callable(close):
      close()

  @property
  def takes_into(self) -> bool:
    """Whether :meth:`take_into` is available: the source is an :class:`ArraySource`
    whose ``chunk_at`` is its own (not overridden)."""
    return (isinstance(self._source, ArraySource)
            and type(self._source).chunk_at is ArraySource.chunk_at)

  def take_into(self, n: int, out: list[np.ndarray]) -> int:
    """:meth:`take` written into ``out`` (``ArraySource._chunk_into``); returns ``m``."""
    m = self._source._chunk_into(self._step, n, out)
    self._step += m
    return m

  def __repr__(self) -> str:
    return f"{self._source!r} (batch_at, next step {self._step})"
