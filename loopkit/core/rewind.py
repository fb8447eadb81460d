"""A rewind: a resume inside the process, asked for by a hook at a boundary.

A hook with ``rewind_request`` may ask, at a call's boundary, to go back to an
earlier checkpoint and skip data (:mod:`loopkit.core.skips`); agreed across
processes, the run applies the hook's restore (:func:`rewind`), drops the call
dispatched meanwhile and opens the source again at the restored position.

Functions of the :class:`~loopkit.core.run.Run` they act on (the only writer of run state), called
from its conductor (:meth:`loopkit.core.run.Run.calls`) in order. Not thread-safe.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any

from loopkit.core.agreement import agree_with_reason
from loopkit.core.context import Restore
from loopkit.core.hooks import (
  LoopInfo,
)
from loopkit.core.ledger import Bucket, Ledger
from loopkit.core.skips import (
  RewindRequest,
  rewound_ledger,
)

if TYPE_CHECKING:
  from loopkit.core.run import Run

log = logging.getLogger("loopkit")


def agreed_rewind(run: Run, info: LoopInfo) -> tuple[int, RewindRequest] | None:
  """Asks every hook that may rewind (``rewind_request(info)``); the first request, agreed.

  On several processes the request goes through one agreement
  (:func:`loopkit.core.agreement.agree_with_reason`, the request as its reason), so every
  process rewinds at the same boundary in the same way: the lowest-index process's
  request, if any process made one.

  Returns:
    ``(hook index, request)`` or None.
  """
  local: tuple[int, RewindRequest] | None = None
  for i in run.rewinders:
    request = run.call_hook(i, getattr(run.hooks[i], "rewind_request"), info)
    if request is None:
      continue
    if not isinstance(request, RewindRequest):
      raise TypeError(f"{run.names[i]}.rewind_request returned {request!r}, not a "
                      "loopkit.core.skips.RewindRequest or None")
    if local is None:
      local = (i, request)
  if run.single_process:
    return local
  text = None if local is None else json.dumps([local[0], dataclasses.asdict(local[1])])
  _, text = agree_with_reason([local is not None], text)
  if text is None:
    return None
  index, fields = json.loads(text)
  return int(index), RewindRequest(**fields)


def rewind(run: Run, i: int, request: RewindRequest) -> Any:
  """Applies an agreed rewind: hook ``i``'s restore, a new skip range, the accounting.

  A rewind is a resume inside the process. The hook's ``rewind(ctx, request, like)``
  returns a :class:`~loopkit.core.context.Restore` at a step below
  ``request.before_step``; it is applied as a restore at the start (state, ledger, data
  position, the other hooks' states), the ledger is the one
  :func:`loopkit.core.skips.rewound_ledger` makes of it (the skip range from the restored
  data step + 1 through ``request.skip_through`` joined to the ranges in force, the steps
  thrown away in ``lost_steps``, the wall time since the checkpoint in ``seconds["lost"]``
  and the restore's in ``seconds["checkpoint"]``), and every hook's ``adjust_ledger`` is
  called as at a run's start (:meth:`adjust_hooks`): writers, records and histories drop
  what they hold past the restored step. No hook fires at this boundary, and the call
  dispatched after it is dropped with the state it produces.

  Returns:
    The restored state (:attr:`rewound` is then True).

  Raises:
    TypeError: the hook returned no Restore.
    ValueError: a Restore at or after ``request.before_step``, or a ``skip_through``
      before the restored data step.
  """
  name = run.names[i]
  before = run.ledger.copy()
  t0 = run.now()
  restore = run.call_hook(i, getattr(run.hooks[i], "rewind"), run.contexts[i], request,
                           run.state)
  restore_secs = run.now() - t0
  if not isinstance(restore, Restore):
    raise TypeError(f"{name}.rewind returned {restore!r}, not a loopkit.core.Restore")
  if not isinstance(restore.ledger, Ledger) or restore.ledger.step >= request.before_step:
    got = restore.ledger.step if isinstance(restore.ledger, Ledger) else restore.ledger
    raise ValueError(f"{name}.rewind restored step {got}, not a step before "
                     f"{request.before_step} (the request's before_step)")
  state = run.apply_restore(restore, i)
  first = run.ledger.data_step + 1
  if request.skip_through < first:
    raise ValueError(f"{name} asked to skip through data step {request.skip_through}, "
                     f"before data step {first}, the first after the restored step "
                     f"{run.ledger.step}")
  ledger = rewound_ledger(run.ledger, before, skip_through=request.skip_through,
                          total_secs=before.seconds.get(Bucket.TOTAL, 0.0) + t0 - run.t_mark,
                          restore_secs=restore_secs)
  run.set_ledger(ledger)
  run.t_mark = t0  # the restore and what follows go to the total at the next tick
  log.warning("%s: %s; rewinding from step %d to step %d, skipping data steps %d..%d "
              "(skip_steps now %s); the %d steps trained past step %d are thrown away", name,
              request.reason, request.before_step, ledger.step, first, request.skip_through,
              list(ledger.skip_steps), before.step - ledger.step, ledger.step)
  run.state_position = run.data_position
  run.last = run.last_info = None
  run.status = None  # a data_exhausted warned on the thrown-away calls no longer holds
  run.adjust_hooks()  # as at a resume: the hooks continue from the restored step
  if run.config.time_based_k is not None:
    run.config.time_based_k.start()
  run.rewound = True
  return state
