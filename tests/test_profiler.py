"""ProfilerHook: the planner lands start/stop exactly, trace files in the TensorBoard profile
layout, and the loop goes on (same parameters, one compile)."""

import glob
import os

import jax
import numpy as np
import pytest

import loopkit
from tests import toy


def test_trace_over_exact_step_range(tmp_path):
  prof = loopkit.observe.ProfilerHook(tmp_path, start_step=6, num_steps=4)
  seen = []  # (end_step, tracing?) after the profiler's on_trigger at every boundary
  watch = loopkit.CallbackHook(lambda info, s: seen.append((info.end_step, prof.active)),
                               needs_state=False)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[prof, watch])
  state = loop.run(toy.init_state(), toy.batches(20), num_steps=20)

  # Calls are cut at 6 and 10; the trace holds exactly the calls for steps 7..10.
  assert seen == [(4, False), (6, True), (10, False), (14, False), (18, False), (20, False)]
  files = glob.glob(os.path.join(tmp_path, "plugins", "profile", "*", "*.xplane.pb"))
  assert len(files) == 1 and os.path.getsize(files[0]) > 0
  assert prof.trace_dirs == [os.path.dirname(files[0])]

  # The loop resumed normally: all steps, one compile, same parameters as without the hook.
  assert loop.ledger.step == 20 and int(state["step"]) == 20
  assert loop.program.compile_count() == 1
  plain = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4)
  ref = plain.run(toy.init_state(), toy.batches(20), num_steps=20)
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_trace_stops_when_the_run_ends_inside_the_range(tmp_path):
  prof = loopkit.observe.ProfilerHook(tmp_path, start_step=0, num_steps=100)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[prof])
  loop.run(toy.init_state(), toy.batches(8), num_steps=8)
  assert not prof.active
  assert len(glob.glob(os.path.join(tmp_path, "plugins", "profile", "*", "*.xplane.pb"))) == 1
  # A second trace in the same process works (the profiler was released).
  jax.profiler.start_trace(str(tmp_path / "again"))
  jax.profiler.stop_trace()


def test_a_run_that_raises_inside_the_range_writes_its_trace(tmp_path):
  def boom(info, state):
    raise KeyboardInterrupt(f"stop at step {info.end_step}")

  prof = loopkit.observe.ProfilerHook(tmp_path, start_step=0, num_steps=100)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[
      prof, loopkit.CallbackHook(boom, at_steps=[8], at_end=False, needs_state=False)])
  with pytest.raises(KeyboardInterrupt, match="stop at step 8"):
    loop.run(toy.init_state(), toy.batches(20), num_steps=20)
  assert not prof.active
  files = glob.glob(os.path.join(tmp_path, "plugins", "profile", "*", "*.xplane.pb"))
  assert len(files) == 1 and os.path.getsize(files[0]) > 0
  assert prof.trace_dirs == [os.path.dirname(files[0])]


@pytest.mark.parametrize("kw", [dict(start_step=-1, num_steps=2), dict(start_step=0, num_steps=0)])
def test_bad_range(tmp_path, kw):
  with pytest.raises(ValueError, match="must be"):
    loopkit.observe.ProfilerHook(tmp_path, **kw)
