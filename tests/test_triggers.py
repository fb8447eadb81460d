"""Triggers are pure: crossing semantics, time marks on an injected clock, marks that are
not whole steps, fractional epochs (C31) and combined marks (C32); tested without devices."""

import re

import pytest

from loopkit.core.planner import plan_calls
from loopkit.core.triggers import Trigger


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
