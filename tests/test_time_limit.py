"""run(max_time=): a wall-clock budget, agreed at boundaries, status "time limit" (issue 39)."""

import datetime
import logging

import jax
import pytest

import loopkit
from loopkit.core.time_limit import TimeLimit, as_time_limit
from tests import toy
from tests._kit_worker import CountingClock  # each read one second after the last

DATA = toy.batches(40)


def make(tmp_path, k=4):
  rows = loopkit.LoggingHook(every_steps=8)
  ckpt = loopkit.CheckpointHook(tmp_path, every_steps=100)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k, hooks=[rows, ckpt])
  return loop, rows, ckpt


def test_stops_at_the_first_boundary_past_the_budget_saves_and_resumes_bitwise(tmp_path):
  loop, rows, ckpt = make(tmp_path)
  clock = CountingClock()
  loop.run(toy.init_state(), DATA, num_steps=40, max_time=TimeLimit(3.5, clock=clock))
  # start = 0; boundaries read 1, 2, 3 (< 3.5: calls to 4, 8, 12), then 4: stop at step 12
  assert loop.status == "time limit" and loop.ledger.step == 12
  assert ckpt.saved_steps == [12]  # saved there, off its cadence
  assert [s for s, _ in rows.records] == [8]  # no row at the stop (it is resumed)
  loop, rows2, ckpt = make(tmp_path)
  out = loop.run(toy.init_state(), DATA, num_steps=40)
  assert ckpt.restored_step == 12 and loop.status == "completed"
  straight_rows = loopkit.LoggingHook(every_steps=8)
  straight = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4,
                               hooks=[straight_rows]).run(toy.init_state(), DATA, num_steps=40)
  toy.assert_bitwise(out, straight)
  assert rows.records + rows2.records == straight_rows.records


def test_a_spent_budget_stops_before_the_first_call_and_other_stops_win(tmp_path):
  loop, _, ckpt = make(tmp_path)
  loop.run(toy.init_state(), DATA, num_steps=40, max_time=TimeLimit(1, clock=CountingClock()))
  assert loop.status == "time limit" and loop.ledger.step == 0 and ckpt.saved_steps == [0]
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4)
  loop.preemption.request()
  loop.run(toy.init_state(), DATA, num_steps=8, max_time=TimeLimit(1, clock=CountingClock()))
  assert loop.status == "preempted"
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4)
  loop.run(toy.init_state(), DATA, num_steps=8, max_time="1h")  # the real clock: not reached
  assert loop.status == "completed"


def test_max_time_forms_and_errors():
  assert as_time_limit(90).seconds == 90.0
  assert as_time_limit("5m").seconds == 300.0
  assert as_time_limit(datetime.timedelta(hours=2)).seconds == 7200.0
  assert as_time_limit(None) is None
  for bad in ("soon", 0, -3.0, True):
    with pytest.raises(ValueError, match="max_time must be"):
      as_time_limit(bad)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4)
  state = toy.init_state()
  with pytest.raises(ValueError, match=r"got 'soon'"):
    loop.run(state, DATA, num_steps=8, max_time="soon")
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # refused before any work


def test_c82_the_stop_message_reports_the_reading_the_decision_used(tmp_path, caplog):
  """The docs' clock, each read a second later: start 0, boundaries 1, 2, 3 (< 3.5), then 4
  stops; the message says 4.0 (a second read would say 5.0)."""
  loop, _, _ = make(tmp_path)
  clock = CountingClock()
  with caplog.at_level(logging.INFO, logger="loopkit"):
    loop.run(toy.init_state(), DATA, num_steps=40, max_time=TimeLimit(3.5, clock=clock))
  assert loop.ledger.step == 12
  assert ("max_time of 3.5 s reached at step 12 (4.0 s since run started): stopping there to "
          "be resumed") in caplog.text, caplog.text


class StepClock(loopkit.Hook):
  """A clock a hook moves: the last step its ``after_each_call`` saw."""

  needs_state = False

  def __init__(self):
    super().__init__()
    self.step = 0

  def after_each_call(self, info):
    self.step = info.end_step

  def __call__(self):
    return float(self.step)


@pytest.mark.parametrize("k,stop", [(1, 22), (3, 24), (7, 28)])
def test_c82_a_clock_a_hook_moves_is_read_before_that_calls_hooks(k, stop):
  """As docs/operating.md says: the budget is read before the next dispatch, and the hooks of
  the call that just ended run after it (one call late), so a clock that ``after_each_call``
  moves is seen one call later: a budget of 21 steps stops at 22, 24, 28 for K = 1, 3, 7."""
  clock = StepClock()
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k, hooks=[clock])
  loop.run(toy.init_state(), DATA, num_steps=40, max_time=TimeLimit(21, clock=clock))
  assert (loop.status, loop.ledger.step) == ("time limit", stop)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_c82_with_a_hook_that_needs_the_state_the_clock_is_read_after_the_hooks(k):
  """The same clock on a hook with ``Hook``'s default ``needs_state=True``, which fires at every
  boundary: the boundary's hooks run before the read, so the run stops at 21 for every K (as
  docs/operating.md says)."""
  clock = StepClock()
  clock.needs_state = True
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k, hooks=[clock])
  loop.run(toy.init_state(), DATA, num_steps=40, max_time=TimeLimit(21, clock=clock))
  assert (loop.status, loop.ledger.step) == ("time limit", 21)
