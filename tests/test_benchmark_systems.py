"""benchmarks/: the hand-written K-scan anchor computes what loopkit computes, and the
per-round ratios that benchmarks/run.py reports."""

import jax
import numpy as np
import pytest

from benchmarks import run, systems, workloads
from tests import toy


@pytest.mark.parametrize("k", [1, 4])
def test_handwritten_k_scan_ends_bitwise_where_loopkit_ends(k):
  """Same MLP, same list of 12 numpy batches: the hand-written loop's final state is bitwise
  loopkit's at the same K (so their time ratio compares the same work), one program each."""
  w = workloads.get("mlp", 12)
  data = workloads.make_data(w)
  hand = systems.HandwrittenScan(w, data, k)
  lk = systems.Loopkit(w, data, k)
  hand.warm()
  lk.warm()
  toy.assert_bitwise(hand.final_state(),
                     jax.device_get(lk.loop.run(workloads.init_state(w), iter(lk.batches),
                                                num_steps=12)))
  assert hand.train_compiles() == lk.train_compiles() == 1
  assert (hand.calls_per_run, hand.name) == (12 // k, f"hand-written K-scan K={k}")
  assert hand.timed() > 0 and hand.train_compiles() == 1  # a timed run compiles nothing new


def test_round_ratios_are_taken_within_each_round():
  """Rates a / b per round (same S), their median, smallest and largest."""
  a = {"steps": 100, "round_times": [1.0, 2.0, 1.0, 4.0]}
  b = {"steps": 100, "round_times": [2.0, 2.0, 3.0, 2.0]}
  assert run.round_ratio(a, b) == (1.5, 0.5, 3.0, 4)
  assert run.round_ratio(a, None) is None and run.round_ratio({"steps": 1}, b) is None
  assert run._fmt_round_ratio(run.round_ratio(a, b)) == "1.50 [0.50-3.00]"
  rows = [dict(workload="mlp", devices=1, system=name, steps=100, round_times=t, times=t,
               train_compiles=1, timed_compiles=0, rss_growth_mb=None) for name, t in
          [("loopkit K=10", [1.0, 1.0]), ("hand-written K-scan K=10", [0.9, 0.95]),
           ("limit (one scan)", [0.9, 0.9]), ("per-step jit, numpy in", [2.0, 2.0])]]
  table = run.render_round_ratios(rows)
  assert "| mlp | 1 | 10 | 2 | 0.93 [0.90-0.95] | 0.97 [0.95-1.00] | 0.90 [0.90-0.90] | " \
         "2.00 [2.00-2.00] |" in table
  met = {name: ok for name, ok, _ in run.check_targets(rows)}
  assert met["MLP, 1 dev: loopkit K=10 >= 0.95 x the hand-written K-scan loop (median of "
             "rounds)"] is False


def test_the_main_thread_forming_rows_get_their_own_round_ratios():
  """prefetch=0 (chunks formed on the main thread between a dispatch and its wait) is compared
  with the same hand-written loop, and named as not the default."""
  rows = [dict(workload="mlp", devices=1, system=name, steps=100, round_times=t, times=t,
               train_compiles=1, timed_compiles=0, rss_growth_mb=None) for name, t in
          [("loopkit K=10", [1.0, 1.0]), ("loopkit K=10 prefetch=0", [0.9, 1.0]),
           ("hand-written K-scan K=10", [0.9, 0.95]), ("loopkit K=1 prefetch=0", [4.0, 4.0]),
           ("limit (one scan)", [0.9, 0.9]), ("per-step jit, numpy in", [2.0, 2.0])]]
  table = run.render_round_ratios(rows)
  assert "| mlp | 1 | 10 prefetch=0 | 2 | 0.97 [0.95-1.00] |" in table
  met = {name: ok for name, ok, _ in run.check_targets(rows)}
  assert met["MLP, 1 dev: loopkit K=10 prefetch=0 >= 0.95 x the hand-written K-scan loop "
             "(median of rounds; not the default)"] is True
  assert met["MLP, 1 dev: loopkit K=1 prefetch=0 >= 0.5 x the per-step jit loop, numpy in "
             "(median of rounds; not the default)"] is True
