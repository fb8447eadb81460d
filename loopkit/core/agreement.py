"""Agreement: every host-local decision is taken once per boundary, by all processes together.

On a multi-host run every process runs the same loop, and every process must
take the same decision at the same loop boundary: fire a hook (a checkpoint save
or an evaluation runs collectives), stop, or go on. Some decisions read
something local to one process: a wall clock (``every_secs`` triggers), a
signal (preemption), a hook's own memory (``loop.request_stop`` from a hook
that ran on process 0 only). Two processes reading their own clocks 10 ms apart
fire on different steps, and the first collective that one of them enters
alone fails or hangs (over gloo: "Gloo AllGather failed").

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
several processes each process writes its answers (a short JSON string) to the
key-value store of the coordination service that ``jax.distributed`` runs and
reads the others' (:func:`loopkit._internal.compat.coordination_client`): host
traffic only, so it does not wait for the program in flight and the next call
is dispatched while the previous one runs (docs/concepts.md, *Agreement at each
boundary*, has the measured cost). Where JAX keeps no reachable client, one
``multihost_utils.process_allgather`` of a few int32s (plus one of the reasons'
bytes when some process gave a reason) does the same; being a device
collective, it returns only after the program in flight has finished.

A process that has not answered within :data:`TIMEOUT_SECS` (or has died) makes
every waiting process raise :class:`AgreementError` naming it, instead of
hanging.

Multi-host-safe by construction: every process must call :func:`agree` at the
same boundaries with vectors of the same length. Thread-safety: call from the
loop's thread only.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from loopkit._internal import compat

__all__ = ["AgreementError", "TIMEOUT_SECS", "agree", "agree_with_reason", "waiting_for"]

TIMEOUT_SECS = 1800.0
"""Seconds a process waits at an agreement for every other process's answer (a process
that runs a long host-only hook alone delays the others by as much)."""

_KEY = "loopkit/agreement"
_BLOCK = 64  # agreements per key directory: one delete per block, not one per agreement
_rounds = itertools.count()  # this process's agreements so far: the same on every process
# (client, agreement number, its key directory) while this process waits in one, else None.
_waiting: tuple[Any, int, str] | None = None


class AgreementError(RuntimeError):
  """A process did not give its answer to an agreement in time (or its coordination
  service is gone); the message names the process and the agreement's number."""


def agree(local: Sequence[bool]) -> list[bool]:
  """The OR over all processes of each local decision.

  Args:
    local: this process's answers, one per decision; the same length (and
      meaning) on every process.

  Returns:
    A list of bools of the same length, identical on every process: True where
    at least one process answered True.

  Raises:
    AgreementError: another process did not answer within :data:`TIMEOUT_SECS`.
  """
  if len(local) == 0:
    return []
  return agree_with_reason(local, None)[0]


def agree_with_reason(local: Sequence[bool], reason: str | None, *,
                      timeout_secs: float | None = None) -> tuple[list[bool], str | None]:
  """:func:`agree` of ``local``, plus one reason agreed across processes.

  Args:
    local: this process's answers, as for :func:`agree`.
    reason: this process's reason (e.g. of a requested stop), or None.
    timeout_secs: how long to wait for the other processes (default
      :data:`TIMEOUT_SECS`).

  Returns:
    ``(agreed, reason)``, identical on every process: ``agree(local)`` and
    the reason of the lowest-index process that gave one (None if none did).

  Raises:
    AgreementError: another process did not answer in time.
  """
  flags = [bool(x) for x in local]
  if jax.process_count() == 1:
    return flags, reason
  client = compat.coordination_client()
  timeout = TIMEOUT_SECS if timeout_secs is None else float(timeout_secs)
  answers = (_through_service(client, flags, reason, timeout) if client is not None
             else _through_devices(flags, reason))
  agreed = [any(col) for col in zip(*(f for f, _ in answers), strict=True)]
  given = [r for _, r in answers if r is not None]
  return agreed, (given[0] if given else None)


def _through_service(client: Any, flags: list[bool], reason: str | None,
                     timeout: float) -> list[tuple[list[bool], str | None]]:
  """Every process's ``(flags, reason)``, in process order, through the key-value store.

  Each agreement has its own number ``n`` (the same on every process, which calls them in
  the same order) and its keys ``loopkit/agreement/{n // 64}/{n}/{process}``: one set and
  one blocking get per other process. Once a process has read every answer of agreement
  ``n``, every other process has finished reading the earlier ones, so at each
  ``n = 64 j`` it deletes the directory of block ``j - 1`` (one recursive delete per 64
  agreements; at most 128 agreements' keys stay in the store).
  """
  n, me = next(_rounds), jax.process_index()
  block = f"{_KEY}/{n // _BLOCK}"
  client.key_value_set(f"{block}/{n}/{me}", json.dumps([flags, reason]))
  deadline = time.monotonic() + timeout
  answers: list[tuple[list[bool], str | None]] = []
  global _waiting
  _waiting = (client, n, f"{block}/{n}")  # for waiting_for (a watchdog's thread)
  try:
    for p in range(jax.process_count()):
      if p == me:
        answers.append((flags, reason))
        continue
      wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
      try:
        got, why = json.loads(client.blocking_key_value_get(f"{block}/{n}/{p}", wait_ms))
      except Exception as e:  # JAX's runtime error: DEADLINE_EXCEEDED, or the service is gone
        raise AgreementError(
            f"process {p} did not answer agreement {n} within {timeout:g} s (this is process "
            f"{me}): it is slower by that much, stuck, or gone ({type(e).__name__}: {e})"
        ) from e
      if len(got) != len(flags):
        raise AgreementError(f"process {p} answered agreement {n} with {len(got)} decisions, "
                             f"process {me} with {len(flags)}: the processes run different "
                             "loops")
      answers.append(([bool(x) for x in got], why))
  finally:
    _waiting = None
  if n > 0 and n % _BLOCK == 0:  # every process has read all of block n // 64 - 1
    client.key_value_delete(f"{_KEY}/{n // _BLOCK - 1}")
  return answers


def waiting_for(wait_ms: int = 50) -> tuple[int, list[int]] | None:
  """The agreement this process waits in, and the processes whose answer it lacks.

  For a watchdog (:class:`loopkit.observe.Watchdog`) on another thread: reads the
  coordination service's store (one blocking get of ``wait_ms`` per process, host only).

  Returns:
    ``(agreement number, [process index, ...])`` (the processes that have not arrived,
    ascending), or None when this process waits in no agreement through the store (one
    process, or the device-collective path, where who has arrived is not known).
  """
  waiting = _waiting
  if waiting is None:
    return None
  client, n, keys = waiting
  missing = []
  for p in range(jax.process_count()):
    try:
      client.blocking_key_value_get(f"{keys}/{p}", wait_ms)
    except Exception:  # pylint: disable=broad-except  # DEADLINE_EXCEEDED: not there
      missing.append(p)
  return n, missing


def _through_devices(flags: list[bool], reason: str | None) -> list[tuple[list[bool], str | None]]:
  """Every process's ``(flags, reason)`` through ``process_allgather`` (device collectives)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  data = b"" if reason is None else reason.encode("utf-8")
  packed = np.asarray(flags + [reason is not None, len(data)], np.int32)
  gathered = np.asarray(multihost_utils.process_allgather(packed)).reshape(-1, packed.size)
  reasons: list[str | None] = [None] * gathered.shape[0]
  if gathered[:, -2].any():
    width = max(int(gathered[:, -1].max()), 1)  # the same on every process
    mine = np.zeros(width, np.int32)
    mine[:len(data)] = np.frombuffer(data, np.uint8)
    texts = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, width)
    reasons = [bytes(texts[p, :gathered[p, -1]].astype(np.uint8)).decode("utf-8")
               if gathered[p, -2] else None for p in range(gathered.shape[0])]
  return [([bool(x) for x in gathered[p, :-2]], reasons[p]) for p in range(gathered.shape[0])]
