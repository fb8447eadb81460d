"""Time-based K (iterations_per_loop="30s"): steps per call chosen from the measured step time
with an injected clock; one compile; events still land; results equal to a fixed K."""

import logging

import jax
import numpy as np
import pytest

import loopkit
from loopkit.core.planner import TimeBasedK, parse_duration, plan_calls
from tests import toy

FakeClock, Tick = toy.FakeClock, toy.Tick


def test_parse_duration():
  assert parse_duration("30s") == 30.0
  assert parse_duration("5m") == 300.0
  assert parse_duration("1h") == 3600.0
  for bad in ["30", "0s", "1.5s", "-3s", "10d", "s", ""]:
    with pytest.raises(ValueError, match="iterations_per_loop must be an int >= 1 or a "
                                         "duration"):
      parse_duration(bad)


def test_time_based_k_unit():
  clock = FakeClock()
  tk = TimeBasedK(0.5, max_iterations_per_loop=64, clock=clock)
  assert tk.current() == 1
  tk.record(1)  # first boundary: only starts the clock (it includes compilation)
  assert tk.current() == 1 and tk.secs_per_step is None
  clock.t = 0.125  # 1 step in 1/8 s
  tk.record(2)
  assert tk.secs_per_step == 0.125 and tk.current() == 4
  clock.t += 4 * 0.0078125  # 4 steps in 1/32 s: 1/128 s per step -> 64 (the cap)
  tk.record(6)
  assert tk.current() == 64
  clock.t += 64 * 1.0  # much slower: 1 s per step -> at least 1
  tk.record(70)
  assert tk.current() == 1
  tk.start()
  tk.record(71)  # a new run re-marks the clock without measuring across runs
  assert tk.current() == 1


def test_time_based_k_errors():
  with pytest.raises(ValueError, match="target_secs must be > 0"):
    TimeBasedK(0.0, max_iterations_per_loop=4)
  with pytest.raises(ValueError, match="max_iterations_per_loop must be an int >= 1"):
    TimeBasedK(1.0, max_iterations_per_loop=0)
  with pytest.raises(ValueError, match=r"initial must be in \[1, 4\]"):
    TimeBasedK(1.0, max_iterations_per_loop=4, initial=5)
  with pytest.raises(ValueError, match="only for a duration"):
    loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, max_iterations_per_loop=8)


def test_string_form_on_the_loop():
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop="30s")
  assert loop.time_based_k.target_secs == 30.0
  assert loop.iterations_per_loop == 100 == loop.program.iterations_per_loop  # default slot cap
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop="2m",
                           max_iterations_per_loop=16)
  assert loop.time_based_k.target_secs == 120.0 and loop.program.iterations_per_loop == 16


def test_plan_reads_the_current_choice():
  clock = FakeClock()
  tk = TimeBasedK(1.0, max_iterations_per_loop=8, initial=2, clock=clock)
  plan = plan_calls(0, iterations_per_loop=tk, num_steps=20,
                    triggers=[loopkit.Trigger(every_steps=9)])
  assert [next(plan), next(plan)] == [2, 2]
  tk.record(2)
  clock.t = 0.25
  tk.record(4)  # 1/8 s per step -> 8 steps per second-long call
  assert list(plan) == [5, 8, 1, 2]  # 4->9 (event), 9->17, 17->18 (event), 18->20


def run_adaptive(secs_per_step, n, *, target=0.125, cap=16, hooks=(), prefetch=0):
  clock = FakeClock()
  tick = Tick(clock, secs_per_step)
  tk = TimeBasedK(target, max_iterations_per_loop=cap, clock=clock)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=tk,
                           hooks=[tick, *hooks], prefetch=prefetch)
  state = loop.run(toy.init_state(), toy.batches(n), num_steps=n)
  return loop, state, tick.lengths


def test_loop_adapts_to_the_measured_step_time():
  """1/64 s per step and 1/8 s per call -> 8 steps per call; then 1/32 s per step -> 4.

  The first call's boundary only starts the clock; the second measures one step; with
  prefetch=0 each choice applies from the call planned right after it (calls are planned one
  ahead of the boundary that is one call late).
  """
  slow_from = 30
  loop, state, lengths = run_adaptive(lambda s: 1 / 64 if s <= slow_from else 1 / 32, 51)
  # Call 7 (steps 28..35) is the first with slow steps (3 x 1/64 + 5 x 1/32 = 13/64 s:
  # floor(0.125 / (13/512)) = 4); call 8 was planned before its boundary, call 9 after.
  assert lengths == [1, 1, 1, 8, 8, 8, 8, 8, 4, 4]
  assert sum(lengths) == 51 and loop.ledger.step == 51
  assert loop.time_based_k.current() == 4
  assert loop.program.compile_count() == 1  # many call lengths, one executable
  assert toy.opt_count(state) == 51


def test_results_equal_fixed_k_and_events_land():
  logger = loopkit.LoggingHook(every_steps=10)
  loop, state, lengths = run_adaptive(lambda s: 1 / 64, 35, hooks=[logger], prefetch=2)
  assert [s for s, _ in logger.records] == [10, 20, 30, 35]
  assert max(lengths) <= 16
  fixed = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=5)
  ref = fixed.run(toy.init_state(), toy.batches(35), num_steps=35)
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_real_clock_smoke():
  """With the real clock a 1-hour target hits the cap once a step time is measured."""
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop="1h",
                           max_iterations_per_loop=8, prefetch=0)
  loop.run(toy.init_state(), toy.batches(30), num_steps=30)
  assert loop.time_based_k.current() == 8
  assert loop.time_based_k.secs_per_step > 0
  assert loop.ledger.step == 30 and loop.program.compile_count() == 1


def old_rule(target, cap, secs, n0=1, calls=20):
  """The previous rule (K = target / (call secs / steps)) on the same calls, for comparison."""
  k, ks = n0, []
  for _ in range(calls):
    k = max(1, min(cap, int(target / (secs(k) / k) + 1e-9)))
    ks.append(k)
  return ks


def test_ramp_up_fits_the_per_call_overhead():
  """A call of n steps takes 20 ms + n x 1 ms; target 0.1 s -> (0.1 - 0.02) / 0.001 = 80 steps.

  Dividing one-step call times by their steps says 21 ms per step (K = 4); the fit on the
  one-step call and the 4-step call finds the 20 ms overhead: K = 80 at the second measured
  call; the previous rule crept up over 6 calls and stayed below (4, 16, 44, 68, 77, 79, 79).
  """
  clock = FakeClock()
  secs = lambda n: 0.02 + 0.001 * n  # noqa: E731
  tk = TimeBasedK(0.1, max_iterations_per_loop=1000, clock=clock)
  step = 1
  tk.record(step)  # the compiling call: starts the clock
  ks = []
  for _ in range(6):
    n = tk.current()
    clock.t += secs(n)
    step += n
    tk.record(step)
    ks.append(tk.current())
  assert ks == [4, 80, 80, 80, 80, 80]
  assert tk.overhead_secs == pytest.approx(0.02) and tk.secs_per_step == pytest.approx(0.001)
  assert not tk.capped and tk.wanted == 80
  assert old_rule(0.1, 1000, secs)[:8] == [4, 16, 44, 68, 77, 79, 79, 79]


def test_cap_is_reported_once(caplog):
  """Target 1 s, 20 ms + 1 ms per step: 980 steps wanted, the cap of 100 binds."""
  clock = FakeClock()
  secs = lambda n: 0.02 + 0.001 * n  # noqa: E731
  tk = TimeBasedK(1.0, max_iterations_per_loop=100, clock=clock)
  step = 1
  tk.record(step)
  with caplog.at_level(logging.WARNING, logger="loopkit"):
    for _ in range(4):
      n = tk.current()
      clock.t += secs(n)
      step += n
      tk.record(step)
  assert tk.current() == 100 and tk.capped and tk.wanted == 980
  assert caplog.messages == [
      "time-based iterations_per_loop: a 1 s call wants 980 steps (1 ms per step + 20 ms per "
      "call) but max_iterations_per_loop=100 caps it, so calls take about 0.12 s; raise "
      "max_iterations_per_loop to reach 1 s"]
