"""Boundary agreement: every host-local decision is taken once per boundary, together.

On a multi-host run every process runs the same loop, and every process must
take the same decision at the same loop boundary: fire a hook (a checkpoint save
or an evaluation runs collectives), stop, or go on. Some decisions read
something local to one process: a wall clock (``every_secs`` triggers), a
signal (preemption), a hook's own memory (``loop.request_stop`` from a hook
that ran on process 0 only). Two processes reading their own clocks 10 ms apart
fire on different steps, and the first collective that one of them enters
alone fails or hangs (case C30 in the project's cases: "Gloo AllGather
failed").

:func:`agree` turns a vector of local yes/no answers into the same vector on
every process: the logical OR over processes (one process asking is enough,
as in JAX's preemption sync and Orbax's). The loop calls it once per device
call, before it dispatches the next one, with every host-local decision of
the boundary in one vector (see :class:`loopkit.core.loop.TrainLoop`).

A requested stop also carries its reason (``loop.request_stop("diverged")``):
:func:`agree_with_reason` adds it to the same vector, and the run stops on every
process with the same status, the reason of the lowest-index process that gave
one (process 1 alone asking gives every process process 1's reason; processes 0
and 1 both asking, process 0's).

Cost: on one process no communication (the local vector is the answer). On
several processes one ``multihost_utils.process_allgather`` of a few int32s,
which blocks until every process reaches the boundary (measured on this
2-core CPU machine by case C30 in ``tests/test_multihost.py``; see docs/multihost.md). At the
one boundary where a stop was requested, a second ``process_allgather`` carries the
reason's bytes.

Multi-host-safe by construction: every process must call :func:`agree` at the
same boundaries with vectors of the same length. Thread-safety: call from the
loop's thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

__all__ = ["agree", "agree_with_reason"]


def agree(local: Sequence[bool]) -> list[bool]:
  """The OR over all processes of each local decision.

  Args:
    local: this process's answers, one per decision; the same length (and
      meaning) on every process.

  Returns:
    A list of bools of the same length, identical on every process: True where
    at least one process answered True.
  """
  if len(local) == 0:
    return []
  return agree_with_reason(local, None)[0]


def agree_with_reason(local: Sequence[bool], reason: str | None) -> tuple[list[bool], str | None]:
  """:func:`agree` of ``local``, plus one reason agreed across processes.

  Args:
    local: this process's answers, as for :func:`agree`.
    reason: this process's reason (e.g. of a requested stop), or None.

  Returns:
    ``(agreed, reason)``, identical on every process: ``agree(local)`` and
    the reason of the lowest-index process that gave one (None if none did).
    One ``process_allgather`` of ``len(local) + 2`` int32s; a second one, of
    the reasons' UTF-8 bytes, only when some process gave a reason.
  """
  if jax.process_count() == 1:
    return [bool(x) for x in local], reason
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  data = b"" if reason is None else reason.encode("utf-8")
  flags = np.asarray([bool(x) for x in local] + [reason is not None, len(data)], np.int32)
  gathered = np.asarray(multihost_utils.process_allgather(flags)).reshape(-1, flags.size)
  agreed = [bool(x) for x in gathered[:, :-2].any(axis=0)]
  gave = np.flatnonzero(gathered[:, -2])
  if gave.size == 0:
    return agreed, None
  width = max(int(gathered[:, -1].max()), 1)  # the same on every process
  mine = np.zeros(width, np.int32)
  mine[:len(data)] = np.frombuffer(data, np.uint8)
  texts = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, width)
  first = int(gave[0])
  return agreed, bytes(texts[first, :gathered[first, -1]].astype(np.uint8)).decode("utf-8")
