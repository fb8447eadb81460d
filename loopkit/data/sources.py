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

This module holds :class:`TfDataSource` and how the loop opens any source (:func:`open_source`,
:func:`steps_per_epoch_of`, :func:`check_epoch_length`); :class:`ArraySource` and
:func:`batch_arrays` live in :mod:`loopkit.data.array_source`, the per-process shards in
:mod:`loopkit.data.shards`. All are importable from here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from loopkit._internal.extras import require
from loopkit.data.array_source import ArraySource, batch_arrays
from loopkit.data.shards import (
  eval_batches_per_process,
  grain_shard_for_process,
  grain_shard_options,
  process_shard_bounds,
  shard_for_process,
  tfds_split_for_process,
)

__all__ = ["ArraySource", "TfDataSource", "batch_arrays", "check_epoch_length",
           "eval_batches_per_process", "grain_shard_for_process", "grain_shard_options",
           "open_source", "process_shard_bounds", "shard_for_process", "steps_per_epoch_of",
           "tfds_split_for_process"]


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
