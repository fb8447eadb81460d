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
the boundary in one vector (see :class:`loopkit.loop.TrainLoop`).

Cost: on one process no communication (the local vector is the answer). On
several processes one ``multihost_utils.process_allgather`` of a few int32s,
which blocks until every process reaches the boundary (measured on this
2-core CPU machine in ``tests/test_boundary_agreement.py``; see docs/multihost.md).

Multi-host-safe by construction: every process must call :func:`agree` at the
same boundaries with vectors of the same length. Thread-safety: call from the
loop's thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

__all__ = ["agree"]


def agree(local: Sequence[bool]) -> list[bool]:
  """The OR over all processes of each local decision.

  Args:
    local: this process's answers, one per decision; the same length (and
      meaning) on every process.

  Returns:
    A list of bools of the same length, identical on every process: True where
    at least one process answered True.
  """
  if jax.process_count() == 1:
    return [bool(x) for x in local]
  flags = np.asarray([bool(x) for x in local], np.int32)
  if flags.size == 0:
    return []
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  gathered = np.asarray(multihost_utils.process_allgather(flags))  # [processes, n]
  return [bool(x) for x in np.asarray(gathered.reshape(-1, flags.size).any(axis=0))]
