"""CheckpointHook in one process: exact resume, cases C06, C07, C19, C21, C24, C25, errors.

Real Orbax on tmp_path. "Interrupting" a run here means ending it at a step
(its final step is saved) or preempting it, then building a *fresh* TrainLoop
and hook on the same directory, with a differently initialised state that the
restore must replace. Kills and other processes: tests/test_checkpoint_process.py.
"""

import dataclasses
import json
import logging
import os
import signal
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import toy

import loopkit
from loopkit.checkpoint import CheckpointError, CheckpointHook


def make_loop(k, hooks=(), step=None, **kw):
  return loopkit.TrainLoop(step or toy.make_global_step(), iterations_per_loop=k,
                           hooks=list(hooks), **kw)


assert_bitwise = toy.assert_bitwise


class Recorder(loopkit.Hook):
  """Records on_run_start's ledger view and every call's (end step, epoch, traces)."""

  needs_state = False

  def __init__(self):
    super().__init__()
    self.start = None
    self.calls = []
    self.infos = []

  def on_run_start(self, loop, state):
    led = loop.ledger
    self.start = (led.step, led.epoch, led.step_in_epoch, loop.data_position)

  def after_each_call(self, info):
    self.calls.append((info.end_step, info.epoch, {k: v.copy() for k, v in info.traces.items()}))
    self.infos.append((info.end_step, info.epoch, info.step_in_epoch))


def test_each_save_is_announced_before_it_starts(tmp_path, caplog):
  """C70: the first save of a process takes seconds (Orbax starting up): each save says what it
  saves, and where, before the save starts (no earlier save of that step is under way)."""
  hook = CheckpointHook(tmp_path / "c", every_steps=4)
  said: list[tuple[str, list[int]]] = []

  class Snapshot(logging.Handler):
    def emit(self, record):
      said.append((record.getMessage(), list(hook.saved_steps)))

  handler = Snapshot()
  logging.getLogger("loopkit").addHandler(handler)
  try:
    with caplog.at_level("INFO", logger="loopkit"):
      make_loop(2, [hook]).run(toy.init_state(), toy.batches(10), num_steps=10)
  finally:
    logging.getLogger("loopkit").removeHandler(handler)
  c = tmp_path / "c"
  assert [(m, s) for m, s in said if "checkpoint" in m] == [
      (f"checkpoints in {c}", []), (f"saving checkpoint 4 in {c}", []),
      (f"saving checkpoint 8 in {c}", [4]), (f"saving checkpoint 10 in {c}", [4, 8])]
  assert hook.saved_steps == [4, 8, 10]


def test_c84_a_finished_run_run_again_says_it_is_complete_and_what_it_did(tmp_path, caplog):
  """A run already at its target, run again: it restores, trains nothing, runs its at_end
  hooks once (an evaluation), writes no checkpoint, and says so; no line reads like a fault."""
  def hooks():
    return [CheckpointHook(tmp_path / "c", every_steps=4),
            loopkit.EvalHook(loopkit.Evaluator(
                lambda state, batch: {"w0": batch["x"] @ state["params"]["w"][:, 0]}),
                toy.batches(2), every_steps=8)]
  make_loop(4, hooks()).run(toy.init_state(), toy.batches(8), num_steps=8)
  again = hooks()
  with caplog.at_level("INFO", logger="loopkit"):
    loop = make_loop(4, again)
    loop.run(toy.init_state(), toy.batches(8), num_steps=8)
  c = tmp_path / "c"
  lines = [r.getMessage() for r in caplog.records if r.name == "loopkit"]
  assert [m for m in lines if not m.startswith("evaluation: ")] == [
      f"checkpoints in {c}",
      f"resumed from checkpoint 8 in {c}",
      "the run is already complete at step 8 (num_steps=8): nothing to train; its at_end hooks "
      "run once",
      f"checkpoint 8 in {c} is already saved (this run resumed from it): not written again",
      next(m for m in lines if m.startswith("step 8 eval: ")),
      "run complete at step 8: it was complete when it started, so nothing was trained; its "
      "at_end hooks ran once (CheckpointHook, EvalHook)"], lines
  assert loop.status == "completed" and again[0].saved_steps == []
  assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "loopkit")


def test_a_finished_run_run_again_writes_each_step_and_name_once(tmp_path):
  """The at_end evaluation of a finished run run again is in metrics.jsonl already: the
  file after the second run is the first run's, line for line (each (step, name) once), and
  a name new at that step is still written."""
  def run(extra=False):
    writer = loopkit.observe.create_default_writer(tmp_path / "logs")
    evals = {"w0": lambda state, batch: batch["x"] @ state["params"]["w"][:, 0]}
    if extra:
      evals["w1"] = lambda state, batch: batch["x"] @ state["params"]["w"][:, 1]
    hooks = [loopkit.LoggingHook(writer, every_steps=4),
             CheckpointHook(tmp_path / "c", every_steps=4),
             loopkit.EvalHook(loopkit.Evaluator(lambda s, b: {k: f(s, b) for k, f in
                                                              evals.items()}),
                              toy.batches(2), writer=writer, every_steps=8)]
    make_loop(4, hooks).run(toy.init_state(), toy.batches(8), num_steps=8)
    writer.close()
    return (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()

  first = run()
  assert [json.loads(x)["step"] for x in first if "eval/w0" in x] == [8]
  assert run() == first
  third = run(extra=True)
  assert third[:len(first)] == first
  (new,) = [json.loads(x) for x in third[len(first):]]
  assert new["step"] == 8 and set(new) == {"step", "eval/w1"}, new


# -- resume equivalence ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def ref12():
  """The uninterrupted 12-step run (the same for every K: invariant 1)."""
  return make_loop(4).run(toy.init_state(), toy.batches(12), num_steps=12)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_resume_is_bitwise_equal_to_uninterrupted(tmp_path, k, ref12):
  data, ref = toy.batches(12), ref12
  for stop in (2, 5, 8):
    d = tmp_path / f"stop{stop}"
    first = CheckpointHook(d)
    make_loop(k, [first]).run(toy.init_state(), data, num_steps=stop)
    assert first.saved_steps == [stop]  # the final step of a run is always saved
    hook = CheckpointHook(d)
    loop = make_loop(k, [hook])
    final = loop.run(toy.init_state(seed=7), data, num_steps=12)  # restore must win
    assert hook.restored_step == stop
    assert loop.ledger.step == 12 and toy.opt_count(final) == 12
    assert type(final["opt"][0]) is type(toy.init_state()["opt"][0])  # no namedtuple drift
    assert_bitwise(final, ref)


def test_resume_chain_and_change_of_k(tmp_path, ref12):
  """Stop at 3 (K=4), at 7 (K=3), finish at 12 (K=1): still bitwise equal."""
  data, ref = toy.batches(12), ref12
  for k, stop in ((4, 3), (3, 7), (1, 12)):
    hook = CheckpointHook(tmp_path, every_steps=5)
    init = toy.init_state(seed=0 if stop == 3 else 3)  # later runs must restore
    final = make_loop(k, [hook]).run(init, data, num_steps=stop)
  assert hook.restored_step == 7 and hook.saved_steps == [10, 12]
  assert hook.all_steps() == [3, 5, 7, 10, 12]
  assert_bitwise(final, ref)


def test_restore_adds_no_compilation(tmp_path):
  data = toy.batches(12)
  hook = CheckpointHook(tmp_path, every_steps=4)
  loop = make_loop(4, [hook])
  loop.run(toy.init_state(), data, num_steps=8)
  assert loop.program.compile_count() == 1
  state = loop.run(toy.init_state(seed=5), data, num_steps=12)  # same loop: restores 8
  assert hook.restored_step == 8
  assert loop.program.compile_count() == 1 and loop.program.trace_count == 1
  fresh_hook = CheckpointHook(tmp_path, every_steps=4)
  fresh = make_loop(2, [fresh_hook])
  fresh.run(toy.init_state(), data, num_steps=12)  # restores 12: no call
  assert fresh_hook.restored_step == 12 and fresh.program.compile_count() == 0
  assert int(state["step"]) == 12


def test_restore_keeps_live_shardings(tmp_path):
  data = toy.batches(8)
  mesh8 = jax.make_mesh((8,), ("data",))
  make_loop(4, [CheckpointHook(tmp_path)], mesh=mesh8).run(toy.init_state(), data, num_steps=4)
  mesh2 = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  hook = CheckpointHook(tmp_path)
  loop = make_loop(4, [hook], mesh=mesh2)
  state = loop.run(toy.init_state(), data, num_steps=8)
  assert hook.restored_step == 4
  for x, sh in zip(jax.tree.leaves(state), jax.tree.leaves(loop.program.state_shardings),
                   strict=True):
    assert x.sharding.is_equivalent_to(sh, x.ndim) and len(x.sharding.device_set) == 2


def test_async_write_does_not_race_with_the_next_donating_call(tmp_path):
  """Save every 2 steps while the next call donates the state: every file equals its step."""
  n = 1 << 16

  def step(s, b):
    return {"w": s["w"] * 1.0001 + b["x"].mean(), "step": s["step"] + 1}, {"m": s["w"][0]}

  def init():
    return {"w": jnp.arange(n, dtype=jnp.float32), "step": jnp.zeros((), jnp.int32)}

  data = [{"x": np.full((8,), i, np.float32)} for i in range(12)]
  seen = {}
  record = loopkit.CallbackHook(lambda i, s: seen.__setitem__(i.end_step, np.asarray(s["w"])),
                                every_steps=2)
  make_loop(2, [record], step=step).run(init(), data, num_steps=12)
  hook = CheckpointHook(tmp_path, every_steps=2)
  make_loop(2, [hook], step=step).run(init(), data, num_steps=12)
  assert hook.all_steps() == list(range(2, 13, 2))
  for s in hook.all_steps():
    assert np.array_equal(np.asarray(hook.restore(init(), s).state["w"]), seen[s]), s


# -- field cases ------------------------------------------------------------------------------


def test_c06_resume_accounting(tmp_path):
  """steps_per_epoch=5, K=5: 2 epochs, then asked for 3 -> exactly 5 more steps."""
  data = toy.batches(15)
  first = CheckpointHook(tmp_path, every_epochs=1)
  make_loop(5, [first], steps_per_epoch=5).run(toy.init_state(), data, num_epochs=2)
  assert first.saved_steps == [5, 10]
  hook, rec = CheckpointHook(tmp_path, every_epochs=1), Recorder()
  loop = make_loop(5, [hook, rec], steps_per_epoch=5)
  final = loop.run(toy.init_state(), data, num_epochs=3)
  assert hook.restored_step == 10
  # One epoch convention (loopkit.core.ledger.epoch_of, LoopInfo's): after step 10 the ledger is
  # at the end of epoch 1 (5 of 5 steps done); the next step starts epoch 2 from 0.
  assert rec.start[:3] == (10, 1, 5)
  assert [(s, e) for s, e, _ in rec.calls] == [(15, 2)]  # hook steps [15], epoch index 2
  assert [i for _, _, i in rec.infos] == [5]  # step-in-epoch restarted at 0: 5 steps into 2
  assert loop.ledger.step == 15 and int(final["step"]) == 15 and toy.opt_count(final) == 15
  assert loop.ledger.loop_index == 3  # 2 calls before the restore + 1 after
  assert hook.saved_steps == [15]


def _int_step(state, batch):
  """A step whose params depend on the data order; traces the element it used."""
  x = batch["x"][0]
  grads = {"w": state["params"]["w"] - x}
  updates, opt = TX_C07.update(grads, state["opt"], state["params"])
  return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
           "step": state["step"] + 1, "seen": state["seen"] + x},
          {"x": x})


TX_C07 = optax.adam(0.1)


def _int_state():
  params = {"w": jnp.zeros((), jnp.float32)}
  return {"params": params, "opt": TX_C07.init(params), "step": jnp.zeros((), jnp.int32),
          "seen": jnp.zeros((), jnp.float32)}


def test_c07_checkpoint_label_is_updates_applied(tmp_path):
  data = [{"x": np.array([i], np.float32)} for i in range(12)]  # batch 1: one device
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  ref = make_loop(4, step=_int_step, mesh=mesh).run(_int_state(), data, num_steps=12)
  first = CheckpointHook(tmp_path, every_steps=4)
  make_loop(4, [first], step=_int_step, mesh=mesh).run(_int_state(), data, num_steps=8)
  for s in first.all_steps():  # invariant at every save
    r = first.restore(_int_state(), s)
    assert s == int(r.state["step"]) == int(r.state["opt"][0].count) == r.ledger.step
    assert r.ledger.examples_seen == s and float(r.state["seen"]) == sum(range(s))
  assert first.all_steps() == [4, 8]
  hook, rec = CheckpointHook(tmp_path, every_steps=4), Recorder()
  final = make_loop(4, [hook, rec], step=_int_step, mesh=mesh).run(_int_state(), data,
                                                                   num_steps=12)
  assert hook.restored_step == 8
  assert rec.calls[0][2]["x"][0] == 8.0  # the first element used after the restore
  assert list(rec.calls[0][2]["x"]) == [8.0, 9.0, 10.0, 11.0]
  assert_bitwise(final, ref)


def _metric_step(state, batch):
  del batch
  s = state["step"] + 1
  return {"step": s, "w": state["w"] + 1.0}, {"loss": s.astype(jnp.float32)}


def test_c19_best_n_never_loses_the_latest(tmp_path):
  """Saves at 100..500, metric steadily worse, keep 3 best -> resume 500, best 100."""
  data = [{"x": np.zeros((8,), np.float32)}] * 500
  def state0():
    return {"step": jnp.zeros((), jnp.int32), "w": jnp.zeros((), jnp.float32)}

  hook = CheckpointHook(tmp_path, every_steps=100, keep_best=3, best_metric="loss",
                        best_mode="min")
  make_loop(50, [hook], step=_metric_step).run(state0(), data, num_steps=500)
  assert hook.saved_steps == [100, 200, 300, 400, 500]
  assert hook.latest_step() == 500
  assert hook.best_step() == 100
  assert hook.all_steps() == [100, 200, 300, 500]  # best 3 + the newest
  again = CheckpointHook(tmp_path, every_steps=100, keep_best=3, best_metric="loss")
  state = make_loop(50, [again], step=_metric_step).run(state0(), data, num_steps=500)
  assert again.restored_step == 500 and int(state["step"]) == 500 and float(state["w"]) == 500


def test_retention_max_to_keep_and_best_max(tmp_path):
  data = [{"x": np.zeros((8,), np.float32)}] * 12
  def state0():
    return {"step": jnp.zeros((), jnp.int32), "w": jnp.zeros((), jnp.float32)}

  hook = CheckpointHook(tmp_path / "a", every_steps=2, max_to_keep=2)
  make_loop(4, [hook], step=_metric_step).run(state0(), data, num_steps=12)
  assert hook.all_steps() == [10, 12]
  # "max": higher is better -> the best is the newest; keep 2 best + 1 newest = 2 dirs.
  best = CheckpointHook(tmp_path / "b", every_steps=2, keep_best=2, best_metric="loss",
                        best_mode="max")
  make_loop(4, [best], step=_metric_step).run(state0(), data, num_steps=12)
  assert best.all_steps() == [10, 12] and best.best_step() == 12


def _commit_file_mode(monkeypatch):
  """Makes CheckpointHook write in Orbax's commit-file mode (its default on GCS): step
  directories are written in place and commit_success.txt marks them complete."""
  options = CheckpointHook._options

  def patched(self):
    return dataclasses.replace(
        options(self), temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath)

  monkeypatch.setattr(CheckpointHook, "_options", patched)


@pytest.mark.parametrize("mode", ["atomic_rename", "commit_file"])
def test_c21_unfinished_save_is_invisible_and_removed(tmp_path, mode, monkeypatch, ref12):
  """A real failed save of step 12 (Orbax's leftover of either atomicity mode, kept as a kill
  right after the failure keeps it: the hook's own removal is switched off) is removed."""
  data, ref = toy.batches(12), ref12
  if mode == "commit_file":
    _commit_file_mode(monkeypatch)
  first = CheckpointHook(tmp_path, every_steps=4)
  make_loop(4, [first]).run(toy.init_state(), data, num_steps=8)
  assert first.all_steps() == [4, 8]
  with monkeypatch.context() as m:
    _fail_ledger_write_at(m, 12)
    m.setattr(loopkit.checkpoint.hook, "_remove_failed_save", lambda directory, step: None)
    with pytest.raises(CheckpointError, match="save of step 12"):
      make_loop(4, [CheckpointHook(tmp_path, every_steps=4)]).run(toy.init_state(), data,
                                                                   num_steps=12)
  left = sorted(n for n in os.listdir(tmp_path) if n.startswith("12"))
  if mode == "atomic_rename":
    assert len(left) == 1 and left[0].startswith("12.orbax-checkpoint-tmp")
  else:
    assert left == ["12"] and not os.path.exists(tmp_path / "12" / "commit_success.txt")
  hook = CheckpointHook(tmp_path, every_steps=4)
  with warnings.catch_warnings():
    # removed, not warned about
    warnings.simplefilter("error", loopkit.checkpoint.CheckpointWarning)
    final = make_loop(4, [hook]).run(toy.init_state(), data, num_steps=12)
  assert hook.restored_step == 8
  assert hook.saved_steps == [12]
  assert hook.all_steps() == [4, 8, 12]
  assert sorted(os.listdir(tmp_path)) == ["12", "4", "8", "TRAIN_COMPLETE"]
  assert os.path.exists(tmp_path / "12" / "commit_success.txt")
  assert_bitwise(final, ref)
  assert_bitwise(hook.restore(toy.init_state(), 12).state, ref)


class IntIterator:
  """Elements 0..n-1 in batches of 2; Grain-like state = index of the next element."""

  def __init__(self, n=100, batch=2):
    self.n, self.batch, self.next = n, batch, 0

  def __iter__(self):
    return self

  def __next__(self):
    if self.next + self.batch > self.n:
      raise StopIteration
    b = {"x": np.arange(self.next, self.next + self.batch, dtype=np.float32)}
    self.next += self.batch
    return b

  def get_state(self):
    return {"next": self.next}

  def set_state(self, s):
    self.next = int(s["next"])


def _pair_step(state, batch):
  return ({"step": state["step"] + 1, "sum": state["sum"] + batch["x"].sum()},
          {"a": batch["x"].min(), "b": batch["x"].max()})  # the pair [a, a + 1]


def _consumed(rec):
  out = []
  for _, _, tr in rec.calls:
    for a, b in zip(tr["a"], tr["b"], strict=True):
      out += [int(a), int(b)]
  return out


@pytest.mark.parametrize("source", ["iterator_state", "counted_list"])
def test_c25_saved_position_is_the_consumed_one_under_prefetch(tmp_path, source):
  """Ints 0..99, batch 2, K=3, prefetch 2: checkpoint at 9 stores position 18."""
  def state0():
    return {"step": jnp.zeros((), jnp.int32), "sum": jnp.zeros((), jnp.float32)}

  batches_list = [{"x": np.arange(i, i + 2, dtype=np.float32)} for i in range(0, 100, 2)]
  src_a = IntIterator() if source == "iterator_state" else batches_list
  hook_a, rec_a = CheckpointHook(tmp_path, every_steps=9), Recorder()
  stopper = loopkit.CallbackHook(lambda info, s: loop_a.request_stop("killed"),
                                 at_steps=[9], needs_state=False)
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])  # batch 2
  loop_a = make_loop(3, [hook_a, rec_a, stopper], step=_pair_step, prefetch=2, mesh=mesh)
  loop_a.run(state0(), src_a, num_steps=30)  # asked for 30, "killed" after the save at 9
  assert loop_a.status == "killed" and hook_a.saved_steps == [9]
  assert _consumed(rec_a) == list(range(18))  # elements seen 0..17
  saved = hook_a.restore(state0(), 9).data_position
  if source == "iterator_state":
    assert saved == {"next": 18}  # the consumed position ...
    assert src_a.next > 18  # ... although the prefetcher had read further
  else:
    assert saved == 9  # batches consumed (a counted skip on resume)
  src_b = IntIterator() if source == "iterator_state" else batches_list
  hook_b, rec_b = CheckpointHook(tmp_path, every_steps=9), Recorder()
  final = make_loop(3, [hook_b, rec_b], step=_pair_step, prefetch=2, mesh=mesh).run(
      state0(), src_b, num_steps=15)
  assert hook_b.restored_step == 9
  assert rec_b.start[3] == saved
  assert _consumed(rec_b)[:2] == [18, 19]  # first batch after the restore
  both = _consumed(rec_a) + _consumed(rec_b)
  assert both == list(range(30))  # no repeats, no gaps
  assert float(final["sum"]) == sum(range(30))


class SigtermAt:
  """A list source that sends SIGTERM to this process when batch ``at`` is read."""

  def __init__(self, batches, at):
    self.batches, self.at = batches, at

  def __iter__(self):
    for i, b in enumerate(self.batches):
      if i == self.at:
        os.kill(os.getpid(), signal.SIGTERM)
      yield b


def test_c24_preemption_saves_off_cadence_and_resumes(tmp_path):
  """K=4; SIGTERM while the call for steps 5-8 runs -> checkpoint at 8, status preempted."""
  data = toy.batches(16)
  ref = make_loop(4).run(toy.init_state(), data, num_steps=16)
  before = signal.getsignal(signal.SIGTERM)
  hook = CheckpointHook(tmp_path, every_steps=12)
  # prefetch=0: batch 8 (the first of steps 9-12) is read after steps 5-8 were dispatched.
  loop = make_loop(4, [hook], prefetch=0)
  state = loop.run(toy.init_state(), SigtermAt(data, 8), num_steps=16)
  assert loop.status == "preempted"
  assert loop.ledger.step == 8 and int(state["step"]) == 8
  assert hook.saved_steps == [8] and hook.all_steps() == [8]  # 8 is not on the cadence
  assert signal.getsignal(signal.SIGTERM) is before  # handlers restored
  again = CheckpointHook(tmp_path, every_steps=12)
  loop2 = make_loop(4, [again])
  final = loop2.run(toy.init_state(), data, num_steps=16)
  assert again.restored_step == 8 and loop2.status == "completed"
  assert again.saved_steps == [12, 16]
  assert_bitwise(final, ref)


def test_preemption_request_from_a_hook_lands_on_that_boundary(tmp_path):
  data = toy.batches(12)
  hook = CheckpointHook(tmp_path, every_steps=10)
  preempt = loopkit.CallbackHook(lambda info, s: loop.preemption.request(), at_steps=[6])
  loop = make_loop(3, [hook, preempt])
  loop.run(toy.init_state(), data, num_steps=12)
  assert loop.status == "preempted" and hook.saved_steps == [6]


def test_preemption_watcher_signals():
  w = loopkit.core.PreemptionWatcher()
  before = signal.getsignal(signal.SIGINT)
  w.install()
  try:
    assert not w.agreed()
    os.kill(os.getpid(), signal.SIGINT)
    assert w.requested and w.agreed() and w.signal_received == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C insists
      os.kill(os.getpid(), signal.SIGINT)
  finally:
    w.uninstall()
  assert signal.getsignal(signal.SIGINT) is before
  no_signals = loopkit.core.PreemptionWatcher(signals=())
  no_signals.install()
  no_signals.request()
  assert no_signals.agreed()


# -- errors -----------------------------------------------------------------------------------


def _tree_changed(kind):
  state = toy.init_state()
  if kind == "shape":
    state["params"]["w"] = jnp.zeros((5, 2))
  elif kind == "dtype":
    state["params"]["b"] = jnp.zeros((2,), jnp.bfloat16)
  elif kind == "extra_leaf":
    state["params"]["c"] = jnp.zeros((2,))
  else:
    state["opt"] = optax.sgd(0.1, momentum=0.9).init(state["params"])
  return state


@pytest.mark.parametrize("kind,leaf", [("shape", "params/w"), ("dtype", "params/b"),
                                       ("extra_leaf", "params/c"),
                                       ("optimizer", "opt/0")])
def test_mismatched_checkpoint_names_the_leaf_before_changing_anything(tmp_path, kind, leaf):
  data = toy.batches(8)
  make_loop(4, [CheckpointHook(tmp_path)]).run(toy.init_state(), data, num_steps=4)
  listing = sorted(os.listdir(tmp_path))
  loop = make_loop(4, [CheckpointHook(tmp_path)])
  with pytest.raises(ValueError, match="does not match the train state") as e:
    loop.run(_tree_changed(kind), data, num_steps=8)
  assert leaf in str(e.value)
  assert sorted(os.listdir(tmp_path)) == listing
  assert loop.program.compile_count() == 0


def _fail_ledger_write_at(monkeypatch, step):
  handler = loopkit.checkpoint.hook.ocp.JsonCheckpointHandler
  original = handler._save_fn

  async def failing(self, x, directory):
    if directory.name.startswith("ledger") and directory.parent.name.split(".")[0] == str(step):
      raise OSError(f"injected: disk full while writing step {step}")
    return await original(self, x, directory)

  monkeypatch.setattr(handler, "_save_fn", failing)


def test_failed_async_save_raises_at_next_boundary_and_later_saves_work(tmp_path, monkeypatch):
  data = toy.batches(16)
  ref = make_loop(4).run(toy.init_state(), data, num_steps=16)
  hook = CheckpointHook(tmp_path, every_steps=4)
  loop = make_loop(4, [hook])
  _fail_ledger_write_at(monkeypatch, 8)
  with pytest.raises(CheckpointError, match="save of step 8 .* failed.*disk full"):
    loop.run(toy.init_state(), data, num_steps=16)
  assert loop.ledger.step == 12  # surfaced at the next boundary, not at the end
  monkeypatch.undo()
  assert hook.all_steps() == [4]
  final = loop.run(toy.init_state(), data, num_steps=16)  # same hook, same loop
  assert hook.restored_step == 4 and hook.saved_steps[-3:] == [8, 12, 16]
  assert hook.all_steps() == [4, 8, 12, 16]
  assert not any(".orbax-checkpoint-tmp" in n for n in os.listdir(tmp_path))
  assert_bitwise(final, ref)


def test_failed_final_save_raises_at_run_end(tmp_path, monkeypatch):
  data = toy.batches(8)
  hook = CheckpointHook(tmp_path, every_steps=4)
  _fail_ledger_write_at(monkeypatch, 8)
  with pytest.raises(CheckpointError, match="save of step 8"):
    make_loop(4, [hook]).run(toy.init_state(), data, num_steps=8)
  monkeypatch.undo()
  assert hook.all_steps() == [4]


class Counter(loopkit.Hook):
  """A hook with state that must survive a resume."""

  needs_state = False

  def __init__(self):
    super().__init__()
    self.calls = 0

  def after_each_call(self, info):
    self.calls += 1

  def checkpoint_state(self):
    return {"calls": self.calls}

  def restore_checkpoint_state(self, d):
    self.calls = d["calls"]


def test_hook_state_and_ledger_round_trip(tmp_path):
  data = toy.batches(12)
  c1 = Counter()
  loop1 = make_loop(4, [CheckpointHook(tmp_path, every_steps=4), c1])
  loop1.run(toy.init_state(), data, num_steps=8)
  c2 = Counter()
  hook = CheckpointHook(tmp_path, every_steps=4)
  loop2 = make_loop(4, [hook, c2])
  loop2.run(toy.init_state(), data, num_steps=12)
  assert c1.calls == 2 and c2.calls == 3  # 2 restored + 1 new call
  r = hook.restore(toy.init_state(), 8)
  assert r.ledger.examples_seen == 8 * 16 and r.ledger.loop_index == 2
  assert r.hook_states == {"Counter": {"calls": 2}}  # keyed by the hook's stable name
  assert loop2.ledger.seconds["total"] > r.ledger.seconds["total"] > 0


def test_hook_state_follows_the_hook_name_not_its_position(tmp_path):
  """Saved with [ckpt, Counter]; resumed with an unrelated hook inserted before Counter."""
  data = toy.batches(12)
  make_loop(4, [CheckpointHook(tmp_path, every_steps=4), Counter()]).run(
      toy.init_state(), data, num_steps=8)
  c2 = Counter()
  make_loop(4, [CheckpointHook(tmp_path), loopkit.NanCheckHook(), c2]).run(
      toy.init_state(), data, num_steps=12)
  assert c2.calls == 3  # 2 restored + 1 new call


def test_old_checkpoints_keyed_by_position_still_restore(tmp_path):
  """A checkpoint written before hook names ({"1:Counter": ...}): the only Counter gets it,
  wherever it now is."""
  hook = CheckpointHook(tmp_path, async_save=False)
  at4 = make_loop(4).run(toy.init_state(), toy.batches(4), num_steps=4)
  assert hook.save(4, at4, ledger=loopkit.core.Ledger(step=4, examples_seen=64, loop_index=1),
                   data_position=4, hook_states={"1:Counter": {"calls": 7}})
  hook.close()
  c = Counter()
  loop = make_loop(4, [CheckpointHook(tmp_path), loopkit.NanCheckHook(), c])
  loop.run(toy.init_state(), toy.batches(8), num_steps=8)
  assert c.calls == 8 and loop.ledger.step == 8  # 7 restored + 1 new call


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="keep_best needs best_metric"):
    CheckpointHook(tmp_path, keep_best=2)
  with pytest.raises(ValueError, match="max_to_keep"):
    CheckpointHook(tmp_path, max_to_keep=0)
  with pytest.raises(ValueError, match="best_mode"):
    CheckpointHook(tmp_path, best_metric="loss", best_mode="lowest")
  with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
    CheckpointHook(tmp_path).restore(toy.init_state())
