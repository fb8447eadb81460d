"""Cases C29, C31, C32, C34, C36, C37, C40, C42 (shared/cases/CASES.md) and the loop's
"completed only at the target" invariant: the edges where a run loses work or lies."""

import gc
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from tests import toy


def ema_state(seed=0):
  """The toy state plus an EMA of the parameters (a second tree of the same shapes)."""
  s = toy.init_state(seed)
  s["ema"] = jax.tree.map(jnp.copy, s["params"])
  return s


def make_ema_step(inner):
  def step(state, batch):
    params = {k: v for k, v in state.items() if k != "ema"}
    new, metrics = inner(params, batch)
    new["ema"] = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, state["ema"], new["params"])
    return new, metrics
  return step


class Returns(loopkit.Hook):
  """At ``at_steps`` (or in on_run_start) returns a state whose 'ema' is 'params' itself
  (``alias=True``: one array in two leaves) or a copy of it."""

  def __init__(self, *, alias, on_start=False, **trigger):
    super().__init__(at_end=False, **trigger)
    self.alias, self.on_start = alias, on_start

  def _replace(self, state):
    params = state["params"]
    ema = params if self.alias else jax.tree.map(jnp.copy, params)
    return {**state, "ema": ema}

  def on_run_start(self, loop, state):
    return self._replace(state) if self.on_start else None

  def on_trigger(self, info, state):
    return None if self.on_start else self._replace(state)


@pytest.mark.parametrize("on_start", [False, True], ids=["on_trigger", "on_run_start"])
@pytest.mark.parametrize("style", ["global", "per_device"])
def test_c29_one_array_in_two_leaves_from_any_path(on_start, style):
  """A hook returns a state with the same array in two leaves: the run continues and ends
  bitwise equal to a hook that copies (every path goes through one placement)."""
  def run(alias):
    step = make_ema_step(toy.make_global_step() if style == "global"
                         else toy.make_per_device_step())
    hook = Returns(alias=alias, on_start=on_start, at_steps=[4])
    loop = loopkit.TrainLoop(step, iterations_per_loop=3, hooks=[hook], step_style=style)
    return loop.run(ema_state(), toy.batches(10), num_steps=10)

  toy.assert_bitwise(run(alias=True), run(alias=False))


@pytest.mark.parametrize("spe,every,expected", [
    (4, 0.5, [2, 4, 6, 8, 10, 12]), (4, 1.5, [6, 12]), (6, 1 / 3, [2, 4, 6, 8, 10, 12])])
def test_c31_fractional_epochs_fire_on_whole_steps(spe, every, expected):
  fired = []
  hook = loopkit.CallbackHook(lambda info, s: fired.append(info.end_step), every_epochs=every,
                              at_end=False, needs_state=False)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=5, hooks=[hook],
                           steps_per_epoch=spe)
  loop.run(toy.init_state(), toy.batches(12), num_steps=12)
  assert fired == expected and loop.status == "completed" and loop.ledger.step == 12


def test_c31_a_period_of_part_of_a_step_fails_before_training():
  hook = loopkit.CallbackHook(lambda info, s: None, every_epochs=0.5)
  with pytest.raises(ValueError, match=r"CallbackHook: every_epochs=0\.5 with steps_per_epoch=3"):
    loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[hook],
                      steps_per_epoch=3)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[hook])
  with pytest.raises(ValueError, match="every_epochs needs the loop's steps_per_epoch"):
    loop.run(toy.init_state(), toy.batches(4), num_steps=4)
  assert loop.ledger.step == 0  # refused before any call


def test_c32_marks_combine_on_one_hook():
  fired = []
  hook = loopkit.CallbackHook(lambda info, s: fired.append(info.end_step), every_steps=10,
                              at_steps=[15], needs_state=False)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[hook])
  loop.run(toy.init_state(), toy.batches(30), num_steps=30)
  assert fired == [10, 15, 20, 30]


@pytest.mark.parametrize("k,spe,marks", [
    (k, spe, marks) for k, spe, marks in itertools.product(
        (1, 3), (None, 4, 5),
        ({"every_steps": 3}, {"at_steps": [2, 11, 11, 40]}, {"every_steps": 4, "at_steps": [5]},
         {"every_epochs": 0.5}, {"every_epochs": 2, "every_steps": 3}))
    if not (spe is None and "every_epochs" in marks) and not (spe == 5 and marks.get(
        "every_epochs") == 0.5)])
def test_completed_means_the_target_step_was_reached(k, spe, marks):
  """Whatever the marks, K and epoch length: 'completed' <=> ledger step == target, and
  every mark in range was landed on exactly."""
  fired = []
  hook = loopkit.CallbackHook(lambda info, s: fired.append(info.end_step), at_end=False,
                              needs_state=False, **marks)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k, hooks=[hook],
                           steps_per_epoch=spe)
  loop.run(toy.init_state(), toy.batches(13), num_steps=13)
  assert loop.status == "completed" and loop.ledger.step == 13
  t = hook.trigger
  assert fired == [s for s in range(1, 14) if t.crossed(s - 1, s, spe)]


def test_completed_is_never_reported_below_the_target(monkeypatch):
  """A plan that ends early (a planner bug) is an error, not a 'completed' run."""
  real = loopkit.core.run.plan_calls
  monkeypatch.setattr(loopkit.core.run, "plan_calls",
                      lambda *a, **kw: itertools.islice(real(*a, **kw), 2))
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4)
  with pytest.raises(RuntimeError, match="ended at step 8 without reaching its target step 12"):
    loop.run(toy.init_state(), toy.batches(12), num_steps=12)
  assert loop.status != "completed"


def drifting_step(drift_from):
  """Per-device step whose 'stats' (BatchNorm-like) are averaged over devices only for
  steps before ``drift_from``: from then on every device keeps its own."""
  inner = toy.make_per_device_step()

  def step(state, batch):
    params = {k: v for k, v in state.items() if k != "stats"}
    new, m = inner(params, batch)
    local = jnp.mean(batch["x"], axis=0)
    synced = jax.lax.pmean(local, "data")
    new["stats"] = 0.9 * state["stats"] + 0.1 * jnp.where(state["step"] + 1 < drift_from,
                                                          synced, local)
    return new, m
  return step


def test_c34_replicas_that_drift_later_are_refused_before_the_save(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  state = {**toy.init_state(), "stats": jnp.zeros((4,))}
  ckpt = loopkit.CheckpointHook(tmp_path, every_steps=8, async_save=False)
  loop = loopkit.TrainLoop(drifting_step(drift_from=5), iterations_per_loop=4,
                           step_style="per_device", hooks=[ckpt])
  with pytest.raises(ValueError, match=r"at step 8, before the state goes to CheckpointHook, "
                     r"the devices' copies of state leaves stats differ"):
    loop.run(state, toy.batches(16), num_steps=16)
  ckpt.close()
  assert ckpt.all_steps() == []  # nothing was saved from one device's copy
  assert loop.ledger.seconds["replica_check"] > 0


def test_c34_check_is_skipped_when_replicas_agree_and_timed(tmp_path):
  state = {**toy.init_state(), "stats": jnp.zeros((4,))}
  seen = []
  hook = loopkit.CallbackHook(lambda info, s: seen.append(info.end_step), every_steps=4)
  loop = loopkit.TrainLoop(drifting_step(drift_from=10**6), iterations_per_loop=4,
                           step_style="per_device", hooks=[hook])
  loop.run(state, toy.batches(12), num_steps=12)
  assert seen == [4, 8, 12] and loop.status == "completed"


@pytest.mark.parametrize("when", ["before_run", "on_run_start"])
def test_c36_a_preemption_requested_early_stops_at_the_first_boundary_and_saves(tmp_path, when):
  pytest.importorskip("orbax.checkpoint")
  ckpt = loopkit.CheckpointHook(tmp_path, every_steps=100, async_save=False)

  class Early(loopkit.Hook):
    requests = 1

    def on_run_start(self, loop, state):
      if self.requests:
        self.requests -= 1
        loop.preemption.request()

  hooks = [ckpt] + ([Early(at_end=False)] if when == "on_run_start" else [])
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=hooks)
  if when == "before_run":
    loop.preemption.request()
  state = loop.run(toy.init_state(), toy.batches(8), num_steps=8)
  assert loop.status == "preempted" and loop.ledger.step == 0 and int(state["step"]) == 0
  assert loop.ledger.loop_index == 0  # no device call was made
  assert ckpt.all_steps() == [0]
  # The next run starts unflagged and resumes from the saved step.
  state = loop.run(toy.init_state(), toy.batches(8), num_steps=8)
  assert loop.status == "completed" and ckpt.all_steps() == [0, 8]


def test_c37_host_values_in_loop_info_are_host_memory():
  kept = []
  counts = []

  class Keep(loopkit.Hook):
    needs_state = False

    def after_each_call(self, info):
      kept.append(info)
      counts.append(len(jax.live_arrays()))

  def step(state, batch):
    new, m = toy.make_global_step()(state, batch)
    return new, {**m, "sum": loopkit.metrics.Sum(jnp.sum(batch["x"])),
                 "max": loopkit.metrics.Max(jnp.max(batch["x"]))}

  loop = loopkit.TrainLoop(step, iterations_per_loop=1, hooks=[Keep()], prefetch=0)
  # Earlier tests' arrays in reference cycles: freed now, not by a collection during the run
  # (in the full 3.12 suite one such collection dropped the count from 408 to 260 mid-run).
  gc.collect()
  loop.run(toy.init_state(), toy.batches(50), num_steps=50)
  assert len(kept) == 50
  assert max(counts[5:-1]) - min(counts[5:-1]) <= 2, counts  # the last has no prefetch
  for info in kept:  # numpy's own memory, not views that keep device buffers alive
    for x in jax.tree.leaves((info.metric_values, info.traces)):
      assert isinstance(x, np.ndarray)
      while isinstance(x.base, np.ndarray):  # e.g. a trace sliced from the fetched [K]
        x = x.base
      assert x.base is None, type(x.base)


def test_c40_pmap_layout_batches_are_warned_about_at_the_first_chunk():
  rng = np.random.default_rng(0)
  pmap_batches = [{"image": rng.normal(size=(8, 8, 4, 4, 3)).astype(np.float32),
                   "label": rng.integers(0, 10, size=(8, 8)).astype(np.int32)}
                  for _ in range(3)]

  def step(state, batch):
    return {"step": state["step"] + 1}, {"x": jnp.mean(batch["image"])}

  for style in ("global", "per_device"):
    loop = loopkit.TrainLoop(step, iterations_per_loop=2, step_style=style)
    with pytest.warns(loopkit.data.BatchLayoutWarning,
                      match=r"\[8, 8, \.\.\.\].*looks like jax\.pmap"
                      r" input.*x\.reshape\(\(-1,\) \+ x\.shape\[2:\]\)") as record:
      loop.run({"step": jnp.zeros((), jnp.int32)}, pmap_batches, num_steps=3)
    assert sum(issubclass(w.category, loopkit.data.BatchLayoutWarning) for w in record) == 1
  # Global batches of 8 examples (the pmap batches reshaped) are not warned about.
  global_batches = [jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), b)
                    for b in pmap_batches]
  global_batches = [jax.tree.map(lambda x: x[:8], b) for b in global_batches]
  with warnings.catch_warnings():
    warnings.simplefilter("error", loopkit.data.BatchLayoutWarning)
    loopkit.TrainLoop(step, iterations_per_loop=2).run(
        {"step": jnp.zeros((), jnp.int32)}, global_batches, num_steps=3)


def _logging_run(tmp_path, num_steps, crash_at=None):
  pytest.importorskip("orbax.checkpoint")
  log = loopkit.LoggingHook(every_steps=10)
  hooks = [log, loopkit.CheckpointHook(tmp_path, at_steps=[12], async_save=False)]
  if crash_at is not None:
    def crash(info, state):
      raise KeyboardInterrupt("killed")
    hooks.append(loopkit.CallbackHook(crash, at_steps=[crash_at], at_end=False,
                                      needs_state=False))
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=hooks)
  try:
    loop.run(toy.init_state(), toy.batches(30), num_steps=num_steps)
  except KeyboardInterrupt:
    pass
  return log


def test_c42_running_average_across_a_resume_covers_the_same_steps(tmp_path):
  whole = _logging_run(tmp_path / "whole", 30)
  killed = _logging_run(tmp_path / "cut", 30, crash_at=16)
  assert [s for s, _ in killed.records] == [10]
  resumed = _logging_run(tmp_path / "cut", 30)
  assert [s for s, _ in whole.records] == [10, 20, 30] == [10] + [s for s, _ in resumed.records]
  assert whole.first_steps == [1, 11, 21] and resumed.first_steps == [11, 21]
  assert whole.records[1:] == resumed.records  # the row at 20 averages 11..20, bitwise


def test_c42_rerunning_a_finished_run_evaluates_its_end_once(tmp_path):
  pytest.importorskip("orbax.checkpoint")

  def run():
    evals = []
    ev = loopkit.CallbackHook(lambda info, s: evals.append((info.end_step, info.num_steps)),
                              every_steps=4)
    loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4,
                             hooks=[loopkit.CheckpointHook(tmp_path, async_save=False), ev])
    loop.run(toy.init_state(), toy.batches(8), num_steps=8)
    return loop, evals

  loop, evals = run()
  assert evals == [(4, 4), (8, 4)]
  loop, evals = run()
  assert evals == [(8, 0)] and loop.status == "completed" and loop.ledger.loop_index == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "uint32", "bool",
                                   "key"])
def test_replica_fingerprint_sees_one_changed_element_and_a_swap(dtype):
  """The per-device replica check compares fingerprints: equal bits agree; one changed
  element, or two elements swapped, do not."""
  from loopkit.core.program import leaf_fingerprint
  fp = jax.jit(leaf_fingerprint)
  if dtype == "key":
    x = jax.random.split(jax.random.key(0), 6)
    changed = x.at[3].set(jax.random.key(1))
  else:
    base = np.array([[0, 1, 1], [0, 1, 0]]) if dtype == "bool" else np.arange(6).reshape(2, 3)
    flipped = base.copy()
    flipped[1, 2] = 1 - base[1, 2]
    x, changed = jnp.asarray(base).astype(dtype), jnp.asarray(flipped).astype(dtype)
  swapped = x.reshape(-1)[jnp.array([1, 0, 2, 3, 4, 5])].reshape(x.shape)  # x[0] != x[1]
  assert np.array_equal(fp(x), fp(jnp.array(x, copy=True)))
  assert not np.array_equal(fp(x), fp(changed))
  assert not np.array_equal(fp(x), fp(swapped))


def test_c40_no_warning_for_a_single_leaf_or_a_global_batch_of_device_count_examples():
  from loopkit._internal.checks import warn_if_pmap_layout
  assert not warn_if_pmap_layout({"x": np.zeros((2, 8, 2))}, 8)  # 8 examples x 2 features
  assert not warn_if_pmap_layout({"x": np.zeros((2, 8, 3, 3)), "y": np.zeros((2, 8))}, 8)
  assert not warn_if_pmap_layout({"x": np.zeros((2, 16, 2, 2)), "y": np.zeros((2, 16, 2))}, 8)
  with pytest.warns(loopkit.data.BatchLayoutWarning):
    assert warn_if_pmap_layout({"x": np.zeros((2, 8, 2, 5)), "y": np.zeros((2, 8, 2))}, 8)


@pytest.mark.parametrize("returns,message", [
    (lambda s, loss: s, "it returned only a state \\(no metrics\\)"),
    (lambda s, loss: (s,), "it returned a tuple of 1: \\(a dict with keys \\['opt', 'params', "
                           "'step'\\]\\)"),
    (lambda s, loss: (s, loss), "its second element is an array of shape \\(\\) dtype float32 "
                                "\\(a bare scalar: wrap it, \\{'loss': loss\\}\\)"),
    (lambda s, loss: (s, "loss"), "its second element is a str"),
    (lambda s, loss: ({"loss": loss}, s), "the state and the metrics look swapped"),
    (lambda s, loss: (s, {"loss": loss}, 1), "it returned a tuple of 3"),
])
def test_wrong_train_step_returns_say_what_was_returned_and_expected(returns, message):
  inner = toy.make_global_step()

  def step(state, batch):
    new, m = inner(state, batch)
    return returns(new, m["loss"])

  loop = loopkit.TrainLoop(step, iterations_per_loop=2)
  with pytest.raises(TypeError, match=r"train_step must return \(new_state, metrics\) with "
                     r"metrics a dict of scalars.*; " + message):
    loop.run(toy.init_state(), toy.batches(2), num_steps=2)


def test_c42_a_logging_hook_after_the_checkpoint_hook_is_warned_about(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  ckpt, log = loopkit.CheckpointHook(tmp_path), loopkit.LoggingHook(every_steps=10)
  with pytest.warns(UserWarning, match="LoggingHook comes after CheckpointHook"):
    loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[ckpt, log])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[log, ckpt])


def test_a_checkpoint_save_flushes_the_other_hooks_writers(tmp_path):
  """What a checkpoint covers is on disk: every hook with flush() is flushed at each save."""
  pytest.importorskip("orbax.checkpoint")
  flushed = []

  class Writer:
    def write_scalars(self, step, scalars):
      pass

    def flush(self):
      flushed.append(loop.ledger.step)

  ev = loopkit.EvalHook(loopkit.Evaluator(lambda s, b: {"x": jnp.mean(b["x"])},
                                          global_batch_size=8),
                        [{"x": np.ones((8,), np.float32)}], writer=Writer(), every_steps=100,
                        at_end=False)
  hooks = [loopkit.LoggingHook(Writer(), every_steps=100, at_end=False), ev,
           loopkit.CheckpointHook(tmp_path, every_steps=4, async_save=False)]
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=hooks)
  loop.run(toy.init_state(), toy.batches(8), num_steps=8)
  # At each save (4, 8) both writers, once; the LoggingHook flushes again at its run end.
  assert flushed == [4, 4, 8, 8, 8]
