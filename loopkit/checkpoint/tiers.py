"""Two retention tiers: frequent temporary checkpoints beside sparse permanent ones.

The *temporary* tier is the hook's cadence (``every_steps``, ``every_secs``,
``every_epochs``, ``at_steps``, and every preemption or end-of-run save): of
it only the newest ``max_to_keep`` checkpoints are kept (default 1 once a
permanent tier is set: each new save replaces the last). The *permanent* tier
is every multiple of ``keep_every_steps`` and every step in ``keep_steps``:
the hook also saves there (the planner cuts device calls so those steps land
exactly) and never deletes them.

A checkpoint's tier follows from its step alone, as with Orbax's
``keep_period`` and Levanter's permanent checkpoints, so nothing extra is
stored and a resume picks the newest checkpoint of either tier. The retention decision is
Orbax's own preservation policies, composed: ``AnyPreservationPolicy`` of
``LatestN(max_to_keep)`` (counted over both tiers, as Orbax's ``max_to_keep``
with ``keep_period`` counts), ``EveryNSteps(keep_every_steps)``,
``CustomSteps(keep_steps)`` and, with ``keep_best``, ``BestN``. Orbax's
save-decision policies are not used: loopkit's planner must know each save's
step before the call that reaches it (:class:`PermanentMarks`).

Used by :class:`loopkit.checkpoint.CheckpointHook`; plain host objects, not
thread-safe, identical on every process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from loopkit._internal.extras import missing
from loopkit.core.triggers import Trigger, _whole_steps

try:
  from orbax.checkpoint import checkpoint_managers as ocp_managers
except ImportError as e:
  raise missing(e, "loopkit.checkpoint") from e

__all__ = ["PermanentMarks", "check_permanent", "preservation_policy", "with_permanent_marks"]


def check_permanent(keep_every_steps: Any, keep_steps: Any) -> tuple[int | None, tuple[int, ...]]:
  """The permanent tier's settings, checked: ``(keep_every_steps, sorted keep_steps)``.

  Raises:
    ValueError: ``keep_every_steps`` or a ``keep_steps`` entry that is not a
      whole number of steps > 0, or ``keep_steps`` that is not a sequence
      (naming the value).
  """
  every = None if keep_every_steps is None else _whole_steps("keep_every_steps",
                                                             keep_every_steps)
  if keep_steps is None:
    return every, ()
  if isinstance(keep_steps, (str, bytes)) or not isinstance(keep_steps, Iterable):
    raise ValueError(f"keep_steps must be a sequence of steps, got {keep_steps!r}")
  return every, tuple(sorted({_whole_steps("keep_steps entry", s) for s in keep_steps}))


@dataclasses.dataclass
class PermanentMarks(Trigger):
  """A :class:`~loopkit.core.triggers.Trigger` that also fires at every multiple of
  ``keep_every_steps`` (its other marks, ``keep_steps`` among its ``at_steps``, are the
  base trigger's), and tells the planner so.

  Attributes:
    keep_every_steps: the permanent tier's period in steps (int > 0), or None.
  """

  keep_every_steps: int | None = None

  def next_step(self, step: int, steps_per_epoch: int | None = None) -> int | None:
    base = super().next_step(step, steps_per_epoch)
    if self.keep_every_steps is None:
      return base
    mark = (step // self.keep_every_steps + 1) * self.keep_every_steps
    return mark if base is None else min(base, mark)

  def crossed(self, start: int, end: int, steps_per_epoch: int | None = None) -> bool:
    return (super().crossed(start, end, steps_per_epoch)
            or (self.keep_every_steps is not None
                and end // self.keep_every_steps > start // self.keep_every_steps))


def with_permanent_marks(trigger: Trigger, keep_every_steps: int | None,
                         keep_steps: Sequence[int]) -> Trigger:
  """``trigger`` with the permanent tier's steps added to its marks (itself if there are none)."""
  if keep_every_steps is None and not keep_steps:
    return trigger
  fields = {f.name: getattr(trigger, f.name) for f in dataclasses.fields(Trigger) if f.init}
  fields["at_steps"] = sorted(set(trigger.at_steps or ()) | set(keep_steps))
  return PermanentMarks(**fields, keep_every_steps=keep_every_steps)


def preservation_policy(*, max_to_keep: int | None, keep_every_steps: int | None,
                        keep_steps: Sequence[int], keep_best: int | None,
                        best_metric_fn: Callable[[Any], float], best_mode: str) -> Any:
  """Orbax's ``AnyPreservationPolicy``: a checkpoint stays if any tier keeps it.

  Args:
    max_to_keep: newest checkpoints kept (None: all).
    keep_every_steps, keep_steps: the permanent tier (see the module).
    keep_best: also keep the best N by ``best_metric_fn`` (None: no ranking).
    best_metric_fn: Orbax's ``get_metric_fn`` (the saved metrics to a float).
    best_mode: ``"min"`` or ``"max"``.
  """
  policies: list[Any] = [ocp_managers.LatestN(n=max_to_keep)]
  if keep_every_steps is not None:
    policies.append(ocp_managers.EveryNSteps(interval_steps=keep_every_steps))
  if keep_steps:
    policies.append(ocp_managers.CustomSteps(steps=list(keep_steps)))
  if keep_best:
    policies.append(ocp_managers.BestN(
        get_metric_fn=best_metric_fn, reverse=best_mode == "min", n=keep_best,
        keep_checkpoints_without_metrics=True))
  return ocp_managers.AnyPreservationPolicy(policies)
