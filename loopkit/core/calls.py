"""Forming and dispatching a device call: the room of a run a chunk passes first.

The feeder's next chunk (its wait timed as data wait; the first chunk's layout and
device-memory checks), then one dispatch of the compiled program over it: the ledger
advanced and a :class:`~loopkit.core.boundary.Boundary` recorded for the boundary
room (:mod:`loopkit.core.boundary`).

Functions of the :class:`~loopkit.core.run.Run` they act on (the only writer of run state), called
from its conductor (:meth:`loopkit.core.run.Run.calls`) in order. Not thread-safe.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import jax

from loopkit._internal.checks import warn_if_pmap_layout
from loopkit.core import boundary, start_end
from loopkit.core.boundary import Boundary
from loopkit.core.ledger import Bucket, epoch_of
from loopkit.data.assembly import check_chunk_memory, chunk_device_bytes
from loopkit.data.feeding import Chunk, ChunkFeeder

if TYPE_CHECKING:
  from loopkit.core.run import Run

log = logging.getLogger("loopkit")


def next_chunk(run: Run, feeder: ChunkFeeder) -> Chunk | None:
  """The feeder's next chunk (its wait timed as data wait), or None when the data ran out.

  The first chunk that was not interrupted settles an unknown ``examples_seen``
  and, without a ``global_batch_size`` (else the feeder checked the batch),
  warns about a pmap-looking layout.
  """
  watchdog = run.watchdog
  if watchdog is not None:
    watchdog.enter_phase("data", run.ledger.step)
  t0 = run.now()
  chunk = feeder.next()
  run.add_time(Bucket.DATA_WAIT, run.now() - t0)
  if watchdog is not None:
    watchdog.leave_phase()
  if chunk is None or (chunk.length == 0 and not chunk.interrupted):
    if chunk is not None:
      start_end.warn_exhausted(run, stacklevel=6)
    return None
  if not run.checked_layout and not chunk.interrupted:
    run.checked_layout = True
    if run.config.global_batch_size is None:
      warn_if_pmap_layout(chunk.batches, run.config.data_parallel_size)
    check_device_memory(run, chunk)
  if run.examples_unknown and not chunk.interrupted:
    run.examples_unknown = False
    run.ledger.examples_seen = run.ledger.step * chunk.global_batch_size
  return chunk


def check_device_memory(run: Run, chunk: Chunk) -> None:
  """Refuses, before the first step, chunks that do not fit beside the state in a device's
  memory (:func:`loopkit.data.assembly.check_chunk_memory`; devices that report no limit,
  CPUs, are not checked)."""
  device = run.config.mesh.local_devices[0]
  sharding = run.program.batch_sharding
  leaves = jax.tree.leaves(chunk.batches)
  spec = [((x.shape[1] // jax.process_count(),) + tuple(x.shape[2:]), x.dtype)
          for x in leaves]
  check_chunk_memory(
      iterations_per_loop=run.config.iterations_per_loop,
      chunk_bytes=chunk_device_bytes(spec, leaves[0].shape[0], sharding, jax.process_count()),
      prefetch=run.config.prefetch, state=run.state,
      device=device)


def dispatch(run: Run, state: Any, chunk: Chunk, time_due: dict[int, bool]) -> tuple[Any, Boundary]:
  """Dispatches one device call over ``chunk`` and records its :class:`Boundary`."""
  if run.phase == "start":  # the run's start ends at its first dispatch
    run.tick_total()
    run.phase = "calls"
  ledger, program = run.ledger, run.program
  start = ledger.step
  t0 = run.now()
  first_call = program.compile_count() == 0
  watchdog = run.watchdog
  if watchdog is not None:
    if first_call:
      watchdog.enter_phase("compile", start)
    else:
      watchdog.enter_phase("device_call", start, "dispatch")
  state, out = program(state, chunk.batches, chunk.num_steps, chunk.length)
  if watchdog is not None:
    watchdog.leave_phase()
  run.state, run.state_position = state, chunk.position  # its input was donated
  ledger.add_time(Bucket.COMPILE if first_call else Bucket.DISPATCH, run.now() - t0)
  ledger.advance(chunk.length, chunk.global_batch_size)
  ledger.skipped_steps += chunk.skipped
  end = ledger.step
  if first_call:
    run.check_replicas(state, f"after the first device call (steps {start + 1}..{end})")
  is_last = end >= run.target or chunk.exhausted
  epoch, in_epoch = epoch_of(end, run.steps_per_epoch)
  return state, Boundary(start_step=start, end_step=end, loop_index=ledger.loop_index - 1,
                         epoch=epoch, step_in_epoch=in_epoch,
                         examples_seen=ledger.examples_seen, is_last=is_last,
                         data_position=chunk.position, skipped_steps=ledger.skipped_steps,
                         out=out,
                         firing=boundary.firing(run, start, end, is_last, time_due))
