"""The call planner is pure: tested without devices (triggers: tests/test_triggers.py)."""

import itertools

import pytest

from loopkit.core.planner import next_call_length, plan_calls
from loopkit.core.triggers import Trigger


def calls(step=0, **kw):
  return list(plan_calls(step, **kw))


def test_tail_c01():
  assert calls(iterations_per_loop=4, num_steps=10) == [4, 4, 2]


def test_tail_with_epochs_c01():
  plan = calls(iterations_per_loop=1000, num_steps=10800, steps_per_epoch=1000)
  assert plan == [1000] * 10 + [800]


def test_save_cadence_lands_exactly_c02():
  trig = Trigger(every_steps=8)
  plan = calls(iterations_per_loop=4, num_steps=32, triggers=[trig])
  ends = list(itertools.accumulate(plan))
  assert [e for e in ends if e % 8 == 0] == [8, 16, 24, 32]
  plan = calls(iterations_per_loop=4, num_steps=24, triggers=[Trigger(every_steps=6)])
  assert plan == [4, 2] * 4


def test_k_larger_than_epoch_c04():
  assert calls(iterations_per_loop=20, num_steps=10, steps_per_epoch=5) == [5, 5]


def test_resume_plan_c06():
  assert calls(10, iterations_per_loop=5, num_steps=15, steps_per_epoch=5) == [5]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 100])
@pytest.mark.parametrize("every", [1, 3, 5, 6])
@pytest.mark.parametrize("spe", [None, 7, 10])
def test_plan_properties(k, every, spe):
  trig = Trigger(every_steps=every)
  at = Trigger(at_steps=[11, 13])
  plan = calls(iterations_per_loop=k, num_steps=45, steps_per_epoch=spe, triggers=[trig, at])
  assert sum(plan) == 45
  assert all(1 <= n <= k for n in plan)
  ends = set(itertools.accumulate(plan))
  starts = [0] + list(itertools.accumulate(plan))[:-1]
  assert {s for s in range(1, 46) if s % every == 0} <= ends
  assert {11, 13} <= ends
  if spe:
    # no call crosses an epoch end
    for s, n in zip(starts, plan):
      assert s // spe == (s + n - 1) // spe
  # the planner is greedy: each call is as long as the constraints allow
  for s, n in zip(starts, plan):
    limits = [k, 45 - s, every - s % every, *(m - s for m in (11, 13) if m > s)]
    if spe:
      limits.append(spe - s % spe)
    assert n == min(limits)


def test_bad_k():
  with pytest.raises(ValueError, match="iterations_per_loop must be >= 1, got 0"):
    next_call_length(0, iterations_per_loop=0, num_steps=5)


def test_done_returns_zero():
  assert next_call_length(10, iterations_per_loop=4, num_steps=10) == 0
  assert calls(12, iterations_per_loop=4, num_steps=10) == []
