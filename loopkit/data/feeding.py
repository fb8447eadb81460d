"""Feeding device calls: stack batches into chunks ``[K, B, ...]`` and prefetch them.

A source yields batches: pytrees of numpy arrays with a leading batch axis (the global
batch on one process, the process-local part on multi-host). For each planned call of
``n`` steps the feeder takes ``n`` batches, stacks them to ``[n, B, ...]``, pads to
``[max(K, MIN_SLOTS), B, ...]`` with zeros (padding slots are never computed on; K = 1
chunks carry one zero slot so the program runs the K = 2 loop body without padding on
the device, see :mod:`loopkit.core.program`) and places the chunk on the mesh with
``jax.make_array_from_process_local_data`` (batch axis sharded on the data axis or axes);
on accelerators it instead places each batch as it comes and assembles the chunk on the
devices (``assembly="device"``, :mod:`loopkit.data.assembly`), so no host array of the
chunk's size is made. Or,
for a consumer that pins the chunk's sharding on one process of CPU devices, hands it
over as numpy for the jitted call to place (``call_places=True``,
:func:`loopkit.data.placement.call_places_numpy`). A background thread does this
``prefetch`` chunks ahead, so the host prepares and transfers the next chunk while the
current call runs. A step-indexed source with
``chunk_at(step, n)`` (:class:`loopkit.ArraySource`) gives the ``n`` batches already
stacked, in one call: no Python object per batch, one copy into the chunk.

Each chunk records the source position *after* its last batch; the loop saves
the position of the last consumed chunk, never the prefetched one.
A count position is derived from steps, ``start_position + steps formed + steps skipped``,
so it always equals the batches of the chunks formed so far and of the skip ranges passed.

Skipping (:mod:`loopkit.core.skips`). Given skip ranges in data steps, the feeder passes
over a range that starts at its next batch just before it forms a chunk: a step-indexed
source steps over it without reading, any other source's batches are drawn and dropped.
The chunk records how many (``Chunk.skipped``). The planner ends calls where ranges start,
so a chunk's batches are consecutive data steps.

Stopping. Given an ``interrupt`` event (the loop passes its preemption flag),
the feeder abandons the chunk it is forming once the event is set: it pulls no
batch after the one in flight (user code cannot be interrupted) and ``next``
returns an ``interrupted`` chunk within about 50 ms of the event, while the
batch is still being read. The abandoned batches are never dispatched and never
counted in a position, so a resume re-reads them. After ``close`` (or an
interrupt) the producer thread touches no JAX API again: a daemon thread inside
JAX's C++ code when the interpreter finalizes is killed by a forced unwind that
jaxlib's bindings catch and swallow, and glibc aborts the process ("FATAL:
exception not rethrown", exit code 134). A producer still inside the source's
``next`` after ``close``'s wait is joined again (bounded) at interpreter exit.

This module holds :class:`ChunkFeeder` (one class of about 410 lines: forming, placing,
prefetching and stopping are one state machine) and its :class:`Chunk`; the checks of each
batch against the first are its base :class:`loopkit.data.batch_checks.FirstBatchChecks`,
the registry of stranded producer threads is :mod:`loopkit.data._stranded`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from loopkit._internal.checks import MIN_SLOTS
from loopkit._internal.mesh import data_parallel_size as data_parallel_size_of, is_cpu_mesh
from loopkit.data._stranded import _STRANDED, _STRANDED_LOCK
from loopkit.data.assembly import DeviceAssembler, resolve_chunk_assembly
from loopkit.data.batch_checks import FirstBatchChecks
from loopkit.data.placement import (
    ALIGN_MIN_BYTES,
    Placer as _Placer,
    call_places_numpy,
    empty_host_buffer,
)

log = logging.getLogger("loopkit")

# Moved to loopkit._internal.checks / loopkit.data.sources; kept importable from here.
_DONE = object()
_POLL_SECS = 0.05  # how often a waiting ``next`` looks at the interrupt event
CLOSE_TIMEOUT_SECS = 5.0
"""Default seconds ``ChunkFeeder.close`` (and interpreter exit) wait for a producer
thread to leave the source's ``next``."""


def skip_count(ranges: tuple[tuple[int, int], ...], data_step: int) -> int:
  """Batches to pass over after ``data_step`` before the next batch trained on.

  Args:
    ranges: merged skip ranges (:func:`loopkit.core.skips.merge_ranges`).
    data_step: data steps consumed so far.

  Returns:
    ``last - data_step`` when data step ``data_step + 1`` lies in a range ``(first, last)``,
    else 0.

  Example:
    >>> skip_count(((31, 40),), 30), skip_count(((31, 40),), 29)
    (10, 0)
  """
  for first, last in ranges:
    if first <= data_step + 1 <= last:
      return last - data_step
  return 0


@dataclasses.dataclass
class Chunk:
  """One call's input.

  Attributes:
    batches: pytree of ``jax.Array`` ``[max(K, MIN_SLOTS), B, ...]`` on the mesh (slots
      after ``length`` are zeros); numpy arrays of that shape when the feeder hands
      chunks to the call unplaced (``call_places``).
    num_steps: int32 scalar ``jax.Array`` (replicated): real batches in the chunk.
    length: the same as a Python int.
    position: source position after the chunk's last batch (batches consumed
      from the source since it was given, or the source's ``get_state()``).
    exhausted: the source ran out while forming this chunk (``length`` may then
      be less than planned, or 0).
    global_batch_size: B.
    skipped: data steps passed over just before the chunk's first batch (skip ranges).
    interrupted: the chunk was abandoned because the feeder's ``interrupt``
      event was set; ``batches``, ``num_steps`` and ``position`` are None,
      ``length`` is 0, and it must not be dispatched.
  """

  batches: Any
  num_steps: Any
  length: int
  position: Any
  exhausted: bool
  global_batch_size: int
  interrupted: bool = False
  skipped: int = 0


class ChunkFeeder(FirstBatchChecks):
  """Forms, places and prefetches chunks for a known sequence of call lengths.

  Args:
    source: iterable of batches (pytrees of numpy arrays, leading axis B_local).
    plan: iterator of call lengths (from :func:`loopkit.core.planner.plan_calls`).
    iterations_per_loop: K; a chunk has ``max(K, MIN_SLOTS)`` slots (K = 1 chunks
      carry one zero slot: the program's loop body then never meets a size-1 slot axis,
      :mod:`loopkit.core.program`, and the program pads nothing on the device).
    batch_sharding: sharding of a chunk leaf ``[K, B, ...]``.
    replicated: sharding for the run-length scalar.
    data_parallel_size: slices of the batch axis, B must divide by it; None (default): the
      product of the sizes of the mesh axes that split the batch in ``batch_sharding``,
      which a given value must equal. The first batch is checked against ``batch_sharding``
      (:func:`loopkit._internal.mesh.check_batch_on_mesh`: divisibility, naming the axes, and
      on several processes that the mesh gives each process the rows it feeds).
    prefetch: chunks prepared ahead by a background thread (0 = synchronous).
    start_position: position count of the source when given (for resumes).
    first_step: the global step of the first batch.
    close_timeout_secs: seconds ``close`` (and interpreter exit, when ``close``
      did not wait) wait for the producer thread to leave the source (default
      :data:`CLOSE_TIMEOUT_SECS`); one still blocked inside the source's
      ``next`` is then left behind as a daemon, with a warning naming the source.
    interrupt: an event (e.g. :attr:`loopkit.core.preemption.PreemptionWatcher.event`)
      at which the chunk being formed is abandoned (see the module docstring);
      the event must stay set once set.
    global_batch_size: B as the loop was told it (None: the first batch's); every
      leaf of the first batch must then be ``[B / processes, ...]``
      (:func:`loopkit._internal.checks.check_batch_layout`). Without it, a first batch
      already placed with a leading device axis (``prefetch_to_device``) is refused
      (:func:`loopkit._internal.checks.check_device_axis_layout`).
    call_places: the consumer's jitted call pins ``batch_sharding`` in its
      ``in_shardings``: where :func:`loopkit.data.placement.call_places_numpy` says
      so (read here, on the constructing thread), chunks are handed over as numpy
      and the call transfers them.
    skips: skip ranges ``((first, last), ...)`` in data steps, merged
      (:func:`loopkit.core.skips.merge_ranges`); the plan must end calls where they start
      (:func:`loopkit.core.skips.cut_steps`).
    first_data_step: data steps the source has given before its first batch here
      (default ``first_step``).
    assembly: where a chunk is formed: ``"host"`` (stacked in a host buffer, placed in one
      transfer), ``"device"`` (each batch placed as it comes, the chunk assembled on the
      devices), or ``"auto"``: ``"device"`` on accelerators, ``"host"`` on CPU meshes
      (:mod:`loopkit.data.assembly`). Same chunk values either way.

  Thread-safety: ``next``/``close`` from one consumer thread only.
  Raises (from ``next``): ValueError for a batch whose structure, shapes or
  dtypes differ from the first one (naming the leaf and step), or whose global
  batch does not divide by the data-parallel size or is not ``global_batch_size``; any exception
  raised by the
  source, re-raised in the consumer thread.
  """

  def __init__(self, source: Iterable, plan: Iterator[int], *, iterations_per_loop: int,
               batch_sharding: NamedSharding, replicated: NamedSharding,
               data_parallel_size: int | None = None, prefetch: int = 2, start_position: int = 0,
               first_step: int = 0, close_timeout_secs: float | None = None,
               interrupt: threading.Event | None = None,
               global_batch_size: int | None = None, call_places: bool = False,
               skips: tuple[tuple[int, int], ...] = (), first_data_step: int | None = None,
               assembly: str = "host"):
    self._close_timeout_secs = (CLOSE_TIMEOUT_SECS if close_timeout_secs is None
                                else close_timeout_secs)
    self._interrupt = interrupt
    self._it = iter(source)
    name = repr(self._it)
    self._source_name = name if len(name) <= 200 else name[:197] + "..."
    self._plan = plan
    self._slots = max(iterations_per_loop, MIN_SLOTS)  # slots per chunk
    self._batch_sharding = batch_sharding
    self._replicated = replicated
    dp = data_parallel_size_of(batch_sharding.mesh, batch_sharding.spec[1])
    if data_parallel_size is not None and data_parallel_size != dp:
      raise ValueError(f"data_parallel_size={data_parallel_size}, but the batch sharding "
                       f"{batch_sharding.spec} splits the batch {dp} ways")
    self._expected_batch = global_batch_size
    self._start_position = start_position
    self._first_step = first_step
    self._step = first_step
    self._skips = tuple(skips)
    self._data_step = first_step if first_data_step is None else first_data_step
    self._skipped = 0  # data steps passed over by this feeder (count positions)
    self._spec = None
    self._spec_def: Any = None  # the first batch's structure (set by _check)
    self._nums: dict[int, jax.Array] = {}
    self._place = _Placer(batch_sharding)
    self.assembly = resolve_chunk_assembly(assembly, batch_sharding)
    self._assembler: DeviceAssembler | None = None  # "device" assembly, from the first batch
    self._hand_numpy = (self.assembly == "host" and call_places
                        and call_places_numpy(batch_sharding))
    self._align = is_cpu_mesh(batch_sharding.mesh)
    self._small: dict[tuple, bool] = {}  # (leaf shape, dtype) -> np.empty is enough
    self._list_defs: dict[int, Any] = {}  # n -> structure of n first batches (_check_chunk)
    # A step-indexed source with chunk_at (loopkit.ArraySource): a chunk in one call.
    self._takes_chunks = bool(getattr(self._it, "takes_chunks", False))
    # An ArraySource gathers straight into the chunk's own (aligned, padded) buffers.
    self._takes_into = self._takes_chunks and bool(getattr(self._it, "takes_into", False))
    get_state = getattr(self._it, "get_state", None)
    self._get_state = get_state if callable(get_state) else None
    self._stop = threading.Event()
    self._queue: queue.Queue | None = None
    self._thread = None
    if prefetch > 0:
      self._queue = queue.Queue(maxsize=prefetch)
      self._thread = threading.Thread(target=self._produce, daemon=True,
                                      name="loopkit-prefetch")
      self._thread.start()

  def _position(self) -> Any:
    get_state = self._get_state
    if get_state is not None:
      return get_state()
    # batches formed and skipped
    return self._start_position + (self._step - self._first_step) + self._skipped

  def _interrupted_chunk(self) -> Chunk:
    return Chunk(None, None, 0, None, False, getattr(self, "global_batch_size", 0),
                 interrupted=True)

  def _empty_leaf(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised chunk leaf ``[K, B, ...]``, a fresh buffer for every chunk
    (:func:`loopkit.data.placement.empty_host_buffer`; a plain ``np.empty`` for the
    leaves it would not align, decided once per leaf shape)."""
    small = self._small.get((shape, dtype))
    if small is None:
      small = self._small[(shape, dtype)] = not self._align or (
          math.prod(shape) * np.dtype(dtype).itemsize < ALIGN_MIN_BYTES)
    if small:
      return np.empty(shape, dtype)
    return empty_host_buffer(shape, dtype, aligned=True)

  def _form(self, n: int) -> Chunk | None:
    """Forms a chunk of ``n`` batches; None when halted (nothing placed or counted)."""
    pulled = self._pull(n)
    if pulled is None:
      return None
    cols, count, fresh, exhausted, skipped = pulled
    self._step += count
    self._skipped += skipped
    self._data_step += skipped + count
    position = self._position()
    if not count:
      return Chunk(None, None, 0, position, True, getattr(self, "global_batch_size", 0),
                   skipped=skipped)
    if self.assembly == "device":  # cols: the chunk's leaves, already on the devices
      return Chunk(jax.tree.unflatten(self._spec_def, cols), self._num_steps(count), count,
                   position, exhausted, self.global_batch_size, skipped=skipped)
    arrays = [self._stack(xs, spec, count, fresh) for xs, spec in zip(cols, self._leaf_specs)]
    return Chunk(self._place_chunk(arrays), self._num_steps(count), count, position, exhausted,
                 self.global_batch_size, skipped=skipped)

  def _pass_over(self, n: int) -> tuple[int, bool] | None:
    """Passes over the next ``n`` batches (a skip range); None when halted.

    Returns:
      ``(passed, exhausted)``: batches passed over, and whether the source ran out first.
    """
    it = self._it
    skip = getattr(it, "skip_batches", None)
    if callable(skip):  # a step-indexed source: nothing to read
      skip(n)
      return n, False
    stopped = self._stop.is_set
    interrupted = self._interrupt.is_set if self._interrupt is not None else bool
    for i in range(n):
      if stopped() or interrupted():
        return None
      try:
        next(it)
      except StopIteration:
        return i, True
    return n, False

  def _pull(self, n: int) -> tuple[list, int, bool, bool, int] | None:
    """Passes over a skip range that starts at the next batch, then takes up to ``n``
    batches from the source, checked; None when halted.

    Returns:
      ``(cols, count, fresh, exhausted, skipped)``: per leaf, the batches taken (a list,
      one stacked array ``[count, B, ...]`` from ``chunk_at``, or the chunk leaf
      ``[slots, B, ...]`` whose first ``count`` rows ``take_into`` wrote); how many;
      whether that stacked array is new (the source keeps no reference); whether
      the source ran out; the batches passed over first.
    """
    skipped = 0
    if self._skips:
      to_skip = skip_count(self._skips, self._data_step)
      if to_skip:
        passed = self._pass_over(to_skip)
        if passed is None:
          return None
        skipped, ran_out = passed
        if ran_out:
          return [], 0, False, True, skipped
    pulled = self._pull_batches(n)
    return None if pulled is None else (*pulled, skipped)

  def _pull_batches(self, n: int) -> tuple[list, int, bool, bool] | None:
    """:meth:`_pull` without the skipping."""
    if self.assembly == "device":
      return self._pull_onto_device(n)
    # Halted (closing or interrupted): the chunk being formed is dropped. Per batch only
    # the source and that check (its two lookups bound once; bool() is False: no
    # interrupt event); the batches are checked together once pulled (_check_chunk).
    stopped = self._stop.is_set
    interrupted = self._interrupt.is_set if self._interrupt is not None else bool
    it = self._it
    if self._takes_chunks:  # a source with chunk_at: the n batches stacked in one call
      if stopped() or interrupted():
        return None
      if self._takes_into and self._spec is not None:  # the first chunk sets the spec
        bufs = [self._empty_leaf((self._slots,) + shape, dtype)
                for shape, dtype in self._leaf_specs]
        count = it.take_into(n, bufs)  # type: ignore[attr-defined]
        if stopped() or interrupted():
          return None
        return (bufs if count else []), count, True, count < n
      stacked, count, fresh = it.take(n)  # type: ignore[attr-defined]
      if stopped() or interrupted():
        return None
      return (self._check_stacked(stacked, count, self._step) if count else [], count, fresh,
              count < n)
    got: list[Any] = []
    exhausted = False
    for _ in range(n):
      if stopped() or interrupted():
        return None
      try:
        got.append(next(it))
      except StopIteration:
        exhausted = True
        break
    if stopped() or interrupted():  # checked before any JAX call (see the module docstring)
      return None
    return self._check_chunk(got, self._step) if got else [], len(got), False, exhausted

  def _pull_onto_device(self, n: int) -> tuple[list, int, bool, bool] | None:
    """:meth:`_pull_batches` for ``"device"`` assembly: each batch checked, placed and
    written into the chunk on the devices as it comes; the chunk's leaves are returned."""
    stopped = self._stop.is_set
    interrupted = self._interrupt.is_set if self._interrupt is not None else bool
    it = self._it
    chunk: list | None = None
    count = 0
    exhausted = False
    for i in range(n):
      if stopped() or interrupted():
        return None
      try:
        batch = next(it)
      except StopIteration:
        exhausted = True
        break
      leaves = self._check(batch, self._step + i)
      if stopped() or interrupted():  # checked before any JAX call (see the module docstring)
        return None
      if self._assembler is None:
        self._assembler = DeviceAssembler(self._batch_sharding, self._leaf_specs, self._slots)
      placed = self._assembler.place([np.asarray(x) for x in leaves])
      chunk = self._assembler.write(self._assembler.empty() if chunk is None else chunk,
                                    placed, i)
      count += 1
    return (chunk or []), count, False, exhausted

  def _stack(self, xs: Any, spec: tuple[tuple[int, ...], np.dtype], count: int,
             fresh: bool) -> np.ndarray:
    """One chunk leaf ``[slots, B, ...]`` from ``count`` batches' leaves ``xs``, zero-padded."""
    # [n * B, ...] by concatenation into [K, B, ...]: half the cost of np.stack
    # for many small batches (every leaf has a leading batch axis); a stacked
    # leaf [n, B, ...] (chunk_at) is one copy.
    shape, dtype = spec
    if fresh and len(xs) == self._slots and xs.flags.c_contiguous:
      # A new array the source keeps no reference to (chunk_at's, or a chunk leaf that
      # take_into wrote count rows of): the chunk leaf itself.
      if count < self._slots:
        xs[count:] = 0
      return xs
    arr = self._empty_leaf((self._slots,) + shape, dtype)
    if isinstance(xs, np.ndarray):
      arr[:count] = xs
    elif count == 1:  # K = 1: one batch into the first of two slots
      arr[0] = xs[0]
    else:
      np.concatenate(xs, out=arr[:count].reshape((count * shape[0],) + shape[1:]))
    if count < self._slots:  # a short call: zero padding slots
      arr[count:] = 0
    return arr

  def _place_chunk(self, arrays: list[np.ndarray]) -> Any:
    """The chunk's leaves placed on the batch sharding, as the batch pytree."""
    if self._hand_numpy:  # the jitted call transfers them (call_places_numpy)
      return jax.tree.unflatten(self._spec_def, arrays)
    if jax.process_count() == 1:  # one batched transfer (no cross-process check on 1 process)
      placed = self._place(arrays)
    else:
      placed = [jax.make_array_from_process_local_data(
          self._batch_sharding, a, (self._slots, a.shape[1] * jax.process_count()) + a.shape[2:])
                for a in arrays]
    return jax.tree.unflatten(self._spec_def, placed)

  def _num_steps(self, count: int) -> Any:
    """The run length ``count`` as a placed int32 scalar, one per distinct length (never
    donated, so reusable)."""
    # Not jax.device_put: on several processes, device_put of a host value to a
    # global sharding runs a cross-process equality check (a collective); from
    # this thread it would interleave with the main thread's collectives (e.g.
    # the device all-gather of the agreement's fallback) in a different order on each process.
    num = self._nums.get(count)
    if num is None:
      n_scalar = np.int32(count)
      num = self._nums[count] = jax.make_array_from_callback((), self._replicated,
                                                             lambda _: n_scalar)
    return num

  def _produce(self) -> None:
    try:
      for n in self._plan:
        chunk = self._form(n)
        if chunk is None or not self._put(chunk) or chunk.exhausted:
          return  # halted: the consumer sees the interrupt event or has closed
      self._put(_DONE)
    except BaseException as e:  # surfaced in the consumer thread
      self._put(e)

  def _put(self, item: Any) -> bool:
    assert self._queue is not None  # the producer thread runs only with prefetch > 0
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def next(self) -> Chunk | None:
    """The next chunk, or None when the plan is done.

    Returns a chunk with ``interrupted=True`` when the ``interrupt`` event is
    set and no formed chunk is waiting: at once with ``prefetch`` > 0 (even while
    the producer is inside the source), after the batch in flight without.
    """
    if self._queue is None:
      n = next(self._plan, None)
      if n is None:
        return None
      chunk = self._form(n)
      return self._interrupted_chunk() if chunk is None else chunk
    poll = 1.0 if self._interrupt is None else _POLL_SECS
    while True:
      try:
        item = self._queue.get(timeout=poll)
        break
      except queue.Empty:
        if self._interrupt is not None and self._interrupt.is_set():
          return self._interrupted_chunk()
        if self._thread is not None and not self._thread.is_alive() and self._queue.empty():
          raise RuntimeError("loopkit prefetch thread ended without a result") from None
    if item is _DONE:
      return None
    if isinstance(item, BaseException):
      raise item
    return item

  def _close_source(self) -> None:
    """A step-indexed source's ``close()`` (its worker processes stop); errors are logged."""
    close_source = getattr(self._it, "close_source", None)
    if callable(close_source):
      try:
        close_source()
      except Exception:  # noqa: BLE001 (the run's own outcome, or exception, comes first)
        log.warning("closing the data source %s failed", self._source_name, exc_info=True)

  def close(self, wait_secs: float | None = None) -> None:
    """Stops the producer, then closes a step-indexed source; never hangs.

    Drops the prefetched chunks (freeing their device buffers) and waits for
    the thread, which stops at its next check: right after the source's
    ``next`` returns (without touching JAX again), or within 0.1 s when blocked
    on a full queue. A thread still inside the source after the wait is left
    behind as a daemon, with a warning naming the source (when the wait was not
    0), and waited for again at interpreter exit. Once the thread has left the
    source, a step-indexed source's ``close()`` runs (a
    :class:`~loopkit.data.GrainSource` stops its worker processes; a later run
    starts them again at its step); a plain iterator is left open, so a later
    run can continue it.

    Args:
      wait_secs: how long to wait for the thread, in seconds (default
        ``close_timeout_secs``; 0 to return at once, e.g. while an exception
        propagates).
    """
    self._stop.set()
    if self._queue is not None:
      while True:
        try:
          self._queue.get_nowait()
        except queue.Empty:
          break
    if self._thread is None:
      self._close_source()
      return
    wait = self._close_timeout_secs if wait_secs is None else wait_secs
    self._thread.join(timeout=wait)
    if not self._thread.is_alive():
      self._close_source()
    else:  # still inside the source: closing it now could block on the read in flight
      if wait > 0:
        log.warning("the data source %s is still inside next() %.1f s after the run "
                    "stopped; its prefetch thread ends when next() returns (interpreter exit "
                    "waits up to %.1f s for it)", self._source_name, wait,
                    self._close_timeout_secs)
      with _STRANDED_LOCK:
        _STRANDED[:] = [s for s in _STRANDED if s[0].is_alive()]
        _STRANDED.append((self._thread, self._source_name, self._close_timeout_secs))
