"""The call planner and triggers are pure: tested without devices."""

import itertools
import re

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


def test_crossing_semantics():
  t = Trigger(every_steps=5)
  assert t.crossed(3, 7) and not t.crossed(5, 9) and t.crossed(9, 10)
  assert t.should_fire(0, 4, is_last=True)  # at_end
  assert not Trigger(every_steps=5, at_end=False).should_fire(0, 4, is_last=True)
  e = Trigger(every_epochs=2)
  assert e.next_step(0, steps_per_epoch=3) == 6 and e.crossed(4, 6, steps_per_epoch=3)
  with pytest.raises(ValueError, match="steps_per_epoch"):
    e.next_step(0)


def test_every_secs_with_injected_clock():
  now = [0.0]
  t = Trigger(every_secs=10, clock=lambda: now[0])
  assert not t.time_due()  # starts the clock
  now[0] = 9.9
  assert not t.time_due()
  assert not t.should_fire(1, 2, time_due=t.time_due())
  now[0] = 10.0
  assert t.time_due()
  assert t.should_fire(2, 3, time_due=t.time_due())
  assert t.time_due()  # deciding changes nothing: only fired() restarts the period
  t.fired()
  now[0] = 15.0
  assert not t.time_due()
  assert t.next_step(4) is None  # time marks never cut calls
  t.start_clock()  # the loop restarts the period when a run starts
  now[0] = 24.9
  assert not t.time_due()


def test_bad_period():
  with pytest.raises(ValueError, match="every_steps must be a whole number of steps > 0, got 0"):
    Trigger(every_steps=0)


@pytest.mark.parametrize("kwargs,value", [
    ({"every_steps": 2.5}, "2.5"), ({"every_steps": True}, "True"), ({"at_steps": [3, 1.5]}, "1.5"),
    ({"at_steps": [0]}, "0"), ({"at_steps": 7}, "7"), ({"every_epochs": -1}, "-1"),
    ({"every_secs": 0}, "0")])
def test_marks_that_are_not_whole_steps_are_refused_naming_the_value(kwargs, value):
  with pytest.raises(ValueError, match=re.escape(value)):
    Trigger(**kwargs)


def test_c31_fractional_epochs():
  with pytest.raises(ValueError, match=r"every_epochs=0\.5 with steps_per_epoch=3 is 1\.5 steps"):
    Trigger(every_epochs=0.5).next_step(0, steps_per_epoch=3)
  t = Trigger(every_epochs=0.5, at_end=False)
  assert list(plan_calls(0, iterations_per_loop=100, num_steps=12, steps_per_epoch=4,
                         triggers=[t])) == [2] * 6
  assert Trigger(every_epochs=1.5).next_step(0, steps_per_epoch=4) == 6


def test_c32_marks_combine():
  t = Trigger(every_steps=10, at_steps=[15], at_end=False)
  assert list(plan_calls(0, iterations_per_loop=4, num_steps=30, triggers=[t])) == [
      4, 4, 2, 4, 1, 4, 1, 4, 4, 2]
  e = Trigger(every_epochs=1, at_steps=[3], every_steps=4)
  assert [e.next_step(s, steps_per_epoch=5) for s in (0, 3, 4, 5, 7)] == [3, 4, 5, 8, 8]
  assert e.crossed(2, 3, 5) and e.crossed(4, 5, 5) and not e.crossed(5, 7, 5)
