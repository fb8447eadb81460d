"""Feeding device calls: stack batches into chunks ``[K, B, ...]`` and prefetch them.

A source yields batches: pytrees of numpy arrays with a leading batch axis
(the global batch on one process, the process-local part on multi-host). For
each planned call of ``n`` steps the feeder takes ``n`` batches, stacks them to
``[n, B, ...]``, pads to ``[K, B, ...]`` with zeros (padding slots are never
computed on, see :mod:`loopkit.program`) and places the chunk on the mesh with
``jax.make_array_from_process_local_data`` (batch axis sharded on the data
axis). A background thread does this ``prefetch`` chunks ahead, so the host
prepares and transfers the next chunk while the current call runs.

Each chunk records the source position *after* its last batch; the loop saves
the position of the last consumed chunk, never the prefetched one (case C25).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from loopkit.program import tree_mismatch

_DONE = object()


@dataclasses.dataclass
class Chunk:
  """One call's input.

  Attributes:
    batches: pytree of ``jax.Array`` ``[K, B, ...]`` on the mesh.
    num_steps: int32 scalar ``jax.Array`` (replicated): real batches in the chunk.
    length: the same as a Python int.
    position: source position after the chunk's last batch (batches consumed
      from the source since it was given, or the source's ``get_state()``).
    exhausted: the source ran out while forming this chunk (``length`` may then
      be less than planned, or 0).
    global_batch_size: B.
  """

  batches: Any
  num_steps: Any
  length: int
  position: Any
  exhausted: bool
  global_batch_size: int


def open_source(batches: Any, position: Any, step: int) -> tuple[Iterator, int]:
  """Opens a batch source at a saved position.

  Args:
    batches: an iterable of batches; an iterator with ``get_state``/``set_state``
      (Grain); or a step-indexed source with ``batch_at(step) -> batch``.
    position: None (start as given), a batch count (int), or an iterator state.
    step: the global step training resumes at (used for ``batch_at``).

  Returns:
    (iterator positioned at the next unconsumed batch, start count).

  Stateless iterables are positioned by a *counted skip*: ``position`` batches
  are drawn and dropped, which is exact when the iterable restarts from its
  first batch (documented cost: reading the skipped batches once).
  """
  if hasattr(batches, "batch_at"):
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

  def get_state(self) -> int:
    return self._step


class ChunkFeeder:
  """Forms, places and prefetches chunks for a known sequence of call lengths.

  Args:
    source: iterable of batches (pytrees of numpy arrays, leading axis B_local).
    plan: iterator of call lengths (from :func:`loopkit.planner.plan_calls`).
    iterations_per_loop: K, slots per chunk.
    batch_sharding: sharding of a chunk leaf ``[K, B, ...]``.
    replicated: sharding for the run-length scalar.
    data_parallel_size: number of shards of the batch axis; B must divide by it.
    prefetch: chunks prepared ahead by a background thread (0 = synchronous).
    start_position: position count of the source when given (for resumes).
    close_timeout_secs: how long ``close`` waits for the producer thread; a
      thread blocked inside the source is left behind (it is a daemon).

  Thread-safety: ``next``/``close`` from one consumer thread only.
  Raises (from ``next``): ValueError for a batch whose structure, shapes or
  dtypes differ from the first one (naming the leaf and step), or whose global
  batch does not divide by the data-parallel size; any exception raised by the
  source, re-raised in the consumer thread.
  """

  def __init__(self, source: Iterable, plan: Iterator[int], *, iterations_per_loop: int,
               batch_sharding: NamedSharding, replicated: NamedSharding,
               data_parallel_size: int, prefetch: int = 2, start_position: int = 0,
               first_step: int = 0, close_timeout_secs: float = 5.0):
    self._close_timeout_secs = close_timeout_secs
    self._it = iter(source)
    self._plan = plan
    self._k = iterations_per_loop
    self._batch_sharding = batch_sharding
    self._replicated = replicated
    self._dp = data_parallel_size
    self._count = start_position
    self._step = first_step
    self._spec = None
    self._nums: dict[int, jax.Array] = {}
    self._stop = threading.Event()
    self._queue: queue.Queue | None = None
    self._thread = None
    if prefetch > 0:
      self._queue = queue.Queue(maxsize=prefetch)
      self._thread = threading.Thread(target=self._produce, daemon=True,
                                      name="loopkit-prefetch")
      self._thread.start()

  def _position(self) -> Any:
    get_state = getattr(self._it, "get_state", None)
    return get_state() if callable(get_state) else self._count

  def _check(self, batch: Any, step: int) -> list:
    """Checks a batch against the first one; returns its leaves (flattened once)."""
    if self._spec is None:
      leaves = jax.tree.leaves(batch)
      if not leaves:
        raise ValueError("a batch must have at least one array leaf")
      b_local = np.shape(leaves[0])[0] if np.ndim(leaves[0]) else None
      for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if np.ndim(x) == 0 or np.shape(x)[0] != b_local:
          raise ValueError(
              f"batch leaf {jax.tree_util.keystr(path)} has shape {np.shape(x)}; every "
              f"leaf needs the same leading batch dimension ({b_local})")
      b_global = b_local * jax.process_count()
      if b_global % self._dp:
        raise ValueError(
            f"global batch size {b_global} is not divisible by the data-parallel "
            f"size {self._dp}")
      self._spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                                batch)
      spec_leaves, self._spec_def = jax.tree.flatten(self._spec)
      self._leaf_specs = [(s.shape, s.dtype) for s in spec_leaves]
      self.global_batch_size = b_global
      return jax.tree.leaves(batch)
    # Fast path (per batch, on the prefetch thread): one flatten and a shape and
    # dtype compare per leaf; tree_mismatch only to word the error.
    leaves, treedef = jax.tree.flatten(batch)
    if treedef == self._spec_def:
      for x, (shape, dtype) in zip(leaves, self._leaf_specs):
        if getattr(x, "shape", None) != shape or getattr(x, "dtype", None) != dtype:
          break
      else:
        return leaves
    problem = tree_mismatch(self._spec, jax.tree.map(np.asarray, batch),
                            what=f"batch for step {step + 1} differs from the first batch")
    if problem:
      raise ValueError(problem)
    return jax.tree.leaves(batch)

  def _form(self, n: int) -> Chunk:
    got: list[Any] = []
    exhausted = False
    for _ in range(n):
      if self._stop.is_set():  # closing: this chunk is dropped anyway
        break
      try:
        batch = next(self._it)
      except StopIteration:
        exhausted = True
        break
      got.append(self._check(batch, self._step + len(got)))
      self._count += 1
    self._step += len(got)
    position = self._position()
    if not got:
      return Chunk(None, None, 0, position, True, getattr(self, "global_batch_size", 0))

    def stack(xs, spec):
      # [n * B, ...] by concatenation, viewed as [n, B, ...]: half the cost of
      # np.stack for many small batches (every leaf has a leading batch axis).
      shape, dtype = spec
      if len(xs) == self._k:
        return np.concatenate(xs).reshape((self._k,) + shape)
      arr = np.zeros((self._k,) + shape, dtype)  # a short call: zero padding slots
      np.concatenate(xs, out=arr[:len(xs)].reshape((len(xs) * shape[0],) + shape[1:]))
      return arr

    arrays = [stack(xs, spec) for xs, spec in zip(zip(*got), self._leaf_specs)]
    if jax.process_count() == 1:  # one batched transfer (no cross-process check on 1 process)
      placed = jax.device_put(arrays, self._batch_sharding)
    else:
      placed = [jax.make_array_from_process_local_data(
          self._batch_sharding, a, (self._k, a.shape[1] * jax.process_count()) + a.shape[2:])
                for a in arrays]
    batches = jax.tree.unflatten(self._spec_def, placed)
    # Not jax.device_put: on several processes, device_put of a host value to a
    # global sharding runs a cross-process equality check (a collective); from
    # this thread it would interleave with the main thread's collectives (e.g.
    # the preemption all-gather) in a different order on each process.
    num = self._nums.get(len(got))
    if num is None:  # one placed scalar per distinct length (never donated, so reusable)
      n_scalar = np.int32(len(got))
      num = self._nums[len(got)] = jax.make_array_from_callback((), self._replicated,
                                                                lambda _: n_scalar)
    return Chunk(batches, num, len(got), position, exhausted, self.global_batch_size)

  def _produce(self) -> None:
    try:
      for n in self._plan:
        if self._stop.is_set():
          return
        chunk = self._form(n)
        if not self._put(chunk) or chunk.exhausted:
          return
      self._put(_DONE)
    except BaseException as e:  # surfaced in the consumer thread
      self._put(e)

  def _put(self, item: Any) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def next(self) -> Chunk | None:
    """The next chunk, or None when the plan is done."""
    if self._queue is None:
      n = next(self._plan, None)
      return None if n is None else self._form(n)
    while True:
      try:
        item = self._queue.get(timeout=1.0)
        break
      except queue.Empty:
        if not self._thread.is_alive() and self._queue.empty():
          raise RuntimeError("loopkit prefetch thread ended without a result") from None
    if item is _DONE:
      return None
    if isinstance(item, BaseException):
      raise item
    return item

  def close(self) -> None:
    """Stops the producer; never hangs.

    Drops the prefetched chunks (freeing their device buffers) and waits at
    most ``close_timeout_secs`` for the thread, which stops at its next check
    (between batches, or within 0.1 s when blocked on a full queue). A thread
    blocked inside the source's ``next`` is left behind as a daemon.
    """
    self._stop.set()
    if self._queue is not None:
      while True:
        try:
          self._queue.get_nowait()
        except queue.Empty:
          break
    if self._thread is not None:
      self._thread.join(timeout=self._close_timeout_secs)
