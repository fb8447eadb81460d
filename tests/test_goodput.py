"""Goodput: the summary's arithmetic, the loop's buckets (checkpoint, eval, hooks), lost work
after a restart, persistence in the checkpoint, and no device syncs added."""

import json
import logging
import time
import types

import jax
import numpy as np
import pytest

import loopkit
from loopkit.core.hooks import Hook
from loopkit.core.ledger import Ledger
from loopkit.observe import goodput
from tests import toy


class Recorder:
  def __init__(self):
    self.rows = []

  def write_scalars(self, step, scalars):
    self.rows.append((step, dict(scalars)))

  def flush(self):
    pass

  def close(self):
    pass


class Sleeper(Hook):
  """Sleeps ``secs`` at each firing; its time goes to ``time_bucket``."""

  needs_state = False

  def __init__(self, bucket, secs, **trigger):
    super().__init__(**trigger)
    self.time_bucket = bucket
    self.secs = secs
    self.fired = 0

  def on_trigger(self, info, state):
    self.fired += 1
    time.sleep(self.secs)


def test_summary_arithmetic():
  ledger = Ledger(step=50, lost_steps=7, seconds={
      "total": 100.0, "compile": 10.0, "data_wait": 5.0, "checkpoint": 3.0, "eval": 2.0,
      "dispatch": 20.0, "device_wait": 50.0, "hooks": 4.0, "lost": 20.0})
  s = goodput.summarize(ledger)
  assert s.job_secs == 120.0
  assert s.productive_secs == 80.0  # 120 - (10 + 5 + 3 + 2 + 20)
  assert s.host_gap_secs == 10.0  # 80 - (20 + 50)
  assert s.goodput == 80.0 / 120.0
  assert (s.steps, s.lost_steps) == (50, 7)
  scalars = s.as_scalars()
  assert scalars["goodput/goodput"] == 80.0 / 120.0
  assert scalars["goodput/lost_steps"] == 7
  table = s.table()
  assert table.splitlines()[0] == "goodput 66.7% at step 50 (7 steps redone after restarts)"
  assert "lost to restarts        20.000    16.7%" in table.splitlines()


def test_empty_ledger():
  s = goodput.summarize(Ledger())
  assert s.job_secs == 0.0 and np.isnan(s.goodput)


def test_loop_buckets_and_metrics(caplog):
  """Checkpoint-like and eval-like hooks' time lands in their buckets; buckets add up."""
  writer = Recorder()
  ckpt = Sleeper("checkpoint", 0.02, every_steps=4)
  ev = Sleeper("eval", 0.03, every_steps=6)
  gp = loopkit.observe.GoodputHook(writer, every_steps=4)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[ckpt, ev, gp])
  with caplog.at_level(logging.INFO, logger="loopkit"):
    loop.run(toy.init_state(), toy.batches(12), num_steps=12)
  sec = loop.ledger.seconds
  assert ckpt.fired == 3 and ev.fired == 2  # at 4, 8, 12 and 6, 12
  assert 0.06 <= sec["checkpoint"] < 0.06 + 0.5
  assert 0.06 <= sec["eval"] < 0.06 + 0.5
  assert {"total", "compile", "dispatch", "device_wait", "data_wait", "hooks"} <= set(sec)
  s = gp.summary
  assert s.steps == 12 and s.lost_steps == 0
  # The summary is taken in on_run_end; the loop's total then adds the feeder's shutdown.
  assert s.total_secs <= sec["total"] < s.total_secs + 0.5
  parts = (s.compile_secs + s.data_wait_secs + s.checkpoint_secs + s.eval_secs + s.setup_secs
           + s.lost_secs + s.dispatch_secs + s.device_wait_secs + s.host_gap_secs)
  assert parts == pytest.approx(s.job_secs, rel=1e-9, abs=1e-9)
  assert 0.0 < s.goodput < 1.0
  # Written as metrics at the planner-landed steps 4, 8 and at the end (12).
  assert [step for step, _ in writer.rows] == [4, 8, 12]
  assert writer.rows[-1][1]["goodput/goodput"] == s.goodput
  assert any(m.startswith("goodput summary:\ngoodput ") for m in caplog.messages)


def test_lost_work_after_a_restart(tmp_path):
  """Attempt 1 reaches step 12; attempt 2 starts again at 8: 4 steps are redone."""
  loop1 = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4,
                            hooks=[loopkit.observe.GoodputHook(workdir=tmp_path)])
  state8 = None

  def keep(info, state):
    nonlocal state8
    state8 = jax.device_get(state)

  loop1.hooks.insert(0, loopkit.CallbackHook(keep, at_steps=[8], at_end=False))
  loop1.run(toy.init_state(), toy.batches(12), num_steps=12)
  record = json.loads((tmp_path / "goodput.json").read_text())
  assert record["step"] == 12 and record["lost_steps"] == 0
  assert record["secs_per_step"] > 0

  gp = loopkit.observe.GoodputHook(workdir=tmp_path)
  loop2 = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[gp])
  loop2.run(state8, toy.batches(16)[8:], num_steps=16)
  assert loop2.ledger.lost_steps == 4
  assert loop2.ledger.seconds["lost"] == 4 * record["secs_per_step"]
  assert gp.summary.lost_steps == 4 and gp.summary.lost_secs == 4 * record["secs_per_step"]
  record2 = json.loads((tmp_path / "goodput.json").read_text())
  assert (record2["step"], record2["lost_steps"]) == (16, 4)

  # A third attempt that restarts at 12 adds 4 more to the counters it carries.
  loop3 = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4,
                            hooks=[loopkit.observe.GoodputHook(workdir=tmp_path)])
  state12 = dict(state8, step=np.int32(12))
  loop3.run(state12, toy.batches(16)[12:], num_steps=16)
  assert loop3.ledger.lost_steps == 8


def test_persisted_in_the_checkpoint_and_restored(tmp_path):
  """The ledger (time buckets, lost steps) is saved with the state and comes back on resume."""
  pytest.importorskip("orbax.checkpoint")

  class Crash(Hook):
    needs_state = False

    def after_each_call(self, info):
      if info.end_step == 14:
        raise RuntimeError("simulated crash")

  ckpt_dir, work = tmp_path / "ckpt", tmp_path / "work"
  loop1 = loopkit.TrainLoop(
      toy.make_global_step(), iterations_per_loop=2,
      hooks=[loopkit.CheckpointHook(ckpt_dir, every_steps=4, async_save=False),
             loopkit.observe.GoodputHook(workdir=work), Crash()])
  with pytest.raises(RuntimeError, match="simulated crash"):
    loop1.run(toy.init_state(), toy.batches(20), num_steps=20)
  assert json.loads((work / "goodput.json").read_text())["step"] == 14
  ckpt1 = loop1.hooks[0]
  ckpt1.close()

  ckpt = loopkit.CheckpointHook(ckpt_dir, every_steps=4, async_save=False)
  gp = loopkit.observe.GoodputHook(workdir=work)
  loop2 = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[ckpt, gp])
  loop2.run(toy.init_state(), toy.batches(20), num_steps=20)
  assert ckpt.restored_step == 12
  assert loop2.ledger.lost_steps == 2  # steps 13 and 14 were trained twice
  saved = loopkit.CheckpointHook(ckpt_dir).restore(toy.init_state())
  assert saved.step == 20
  assert saved.ledger.lost_steps == 2
  assert saved.ledger.seconds["checkpoint"] > 0
  assert saved.ledger.seconds["lost"] == loop2.ledger.seconds["lost"]
  assert saved.ledger.seconds["total"] > 0


def test_no_device_syncs_added():
  """Goodput, progress and writers only read host values: the loop runs under a transfer guard."""
  writer = loopkit.observe.AsyncWriter(Recorder())
  hooks = [loopkit.observe.GoodputHook(writer, every_steps=4),
           loopkit.ProgressHook(log_every_secs=0.0, stream=open("/dev/null", "w")),
           loopkit.LoggingHook(writer, per_step=True)]
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=hooks)
  state = toy.init_state()
  with jax.transfer_guard("disallow"):
    loop.run(state, toy.batches(12), num_steps=12)
  writer.close()
  assert loop.ledger.step == 12


# -- records at the right step; resumes keep the time after the last save; one row per step ----


class FakeTime:
  """Stands in for the ``time`` module in loopkit.core.loop: the loop's clock moves only when a
  hook advances it, so every bucket is an exact binary fraction."""

  def __init__(self):
    self.t = 0.0

  def perf_counter(self):
    return self.t


class Work(Hook):
  """Advances the fake clock by 1/16 s per step observed (lands in the ``hooks`` bucket)."""

  needs_state = False

  def __init__(self, clock):
    super().__init__()
    self.clock = clock

  def after_each_call(self, info):
    self.clock.t += info.num_steps / 16


class FakeEval(Hook):
  """An eval hook that takes 1/4 s of the fake clock per firing (``eval`` bucket)."""

  needs_state = False
  time_bucket = "eval"

  def __init__(self, clock, **trigger):
    super().__init__(**trigger)
    self.clock = clock
    self.fired_at = []

  def on_trigger(self, info, state):
    self.fired_at.append(info.end_step)
    self.clock.t += 0.25


def test_record_at_a_boundary_describes_the_steps_up_to_it(tmp_path):
  """K=11, goodput every 33 steps, no hook needs the state: the step-33 record says 33 steps
  (the loop has dispatched the call to 44 when it runs the 33 boundary's hooks)."""
  writer = Recorder()
  gp = loopkit.observe.GoodputHook(writer, workdir=tmp_path, every_steps=33)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=11, hooks=[gp])
  loop.run(toy.init_state(), toy.batches(66), num_steps=66)
  assert [(step, row["goodput/steps"]) for step, row in writer.rows] == [(33, 33), (66, 66)]
  assert json.loads((tmp_path / "goodput.json").read_text())["step"] == 66
  assert gp.summary.steps == 66


def test_a_stop_at_a_written_boundary_writes_no_second_row():
  """A stop requested at step 33 (state hook: the loop syncs there) after the goodput row at
  33: the end of the run writes no second row for 33."""
  writer = Recorder()
  gp = loopkit.observe.GoodputHook(writer, every_steps=33)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=11, hooks=[gp])
  loop.hooks.append(loopkit.CallbackHook(lambda info, state: loop.request_stop("stopped"),
                                         at_steps=[33], at_end=False))
  loop.run(toy.init_state(), toy.batches(66), num_steps=66)
  assert loop.status == "stopped" and loop.ledger.step == 33
  assert [(step, row["goodput/steps"]) for step, row in writer.rows] == [(33, 33)]
  assert gp.summary.steps == 33


def _resumable_run(tmp_path, clock, writer, num_steps):
  """Checkpoint every 33 steps, then an eval every 33 steps (after the save), goodput."""
  pytest.importorskip("orbax.checkpoint")
  ckpt = loopkit.CheckpointHook(tmp_path / "ckpt", every_steps=33, async_save=False)
  ev = FakeEval(clock, every_steps=33)
  gp = loopkit.observe.GoodputHook(writer, workdir=tmp_path / "work", every_steps=33,
                           log_summary=False)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=11,
                           hooks=[Work(clock), ckpt, ev, gp])
  loop.run(toy.init_state(), toy.batches(99), num_steps=num_steps)
  ckpt.close()
  return loop, ckpt, ev, gp


def test_resume_keeps_the_time_spent_after_the_last_checkpoint(tmp_path, monkeypatch):
  """The step-66 eval runs after the step-66 save; a resumed run still counts its 1/4 s."""
  clock = FakeTime()
  monkeypatch.setattr(loopkit.core.run, "time", clock)
  writer = Recorder()
  loop1, _, ev1, gp1 = _resumable_run(tmp_path, clock, writer, 66)
  assert ev1.fired_at == [33, 66]
  assert (gp1.summary.eval_secs, gp1.summary.total_secs) == (0.5, 4.625)  # 66/16 + 2/4
  assert loop1.ledger.seconds["hooks"] == 4.125

  # Resumed with nothing left to do: restores 66, keeps run 1's time after that save and
  # evaluates the end once (C42: an at_end hook fires in a run that makes no call).
  loop2, ckpt2, ev2, gp2 = _resumable_run(tmp_path, clock, writer, 66)
  assert ckpt2.restored_step == 66 and ev2.fired_at == [66]
  assert (gp2.summary.eval_secs, gp2.summary.total_secs) == (0.75, 4.875)
  assert loop2.ledger.seconds["hooks"] == 4.125

  # Resumed to 99: restores 66 again (run 2 saved nothing), evaluates at 99.
  loop3, ckpt3, ev3, gp3 = _resumable_run(tmp_path, clock, writer, 99)
  assert ckpt3.restored_step == 66 and ev3.fired_at == [99]
  assert gp3.summary.eval_secs == 1.0  # at 33, 66 (run 1), 66 (run 2's end), 99
  assert gp3.summary.total_secs == 7.1875  # 99/16 + 4/4
  assert loop3.ledger.seconds["hooks"] == 6.1875
  assert (gp3.summary.steps, gp3.summary.lost_steps, gp3.summary.lost_secs) == (99, 0, 0.0)
  saved = loopkit.CheckpointHook(tmp_path / "ckpt").restore(toy.init_state(), 99).ledger
  assert saved.seconds["eval"] == 0.75  # saved before the eval at 99; holds 33, 66 and 66 again
  record = json.loads((tmp_path / "work" / "goodput.json").read_text())
  assert (record["step"], record["saved_step"], record["row_step"]) == (99, 99, 99)
  assert record["unsaved_secs"]["eval"] == 0.25  # the eval at 99, after the save


def test_resume_writes_one_row_per_step(tmp_path, monkeypatch):
  """Runs to 66, again to 66 (restored, nothing to do), then to 99: one row at 33, 66, 99."""
  clock = FakeTime()
  monkeypatch.setattr(loopkit.core.run, "time", clock)
  writer = Recorder()
  for num_steps in (66, 66, 99):
    _resumable_run(tmp_path, clock, writer, num_steps)
  assert [(step, row["goodput/steps"]) for step, row in writer.rows] == [
      (33, 33), (66, 66), (99, 99)]
  # The 66 -> 66 run evaluates its end once (C42), so the row at 99 counts four evals.
  assert [row["goodput/eval_secs"] for _, row in writer.rows] == [0.25, 0.5, 1.0]
  assert json.loads((tmp_path / "work" / "goodput.json").read_text())["step"] == 99


@pytest.mark.parametrize("restored", [True, False])
def test_time_after_the_save_is_added_only_to_the_restored_ledger(tmp_path, restored):
  """The record's time after the step-12 save goes into a ledger restored from that
  checkpoint (with the record's lost-step count); a ledger not restored is left alone."""
  (tmp_path / "goodput.json").write_text(json.dumps(
      {"step": 12, "lost_steps": 2, "lost_secs": 0.5, "secs_per_step": 0.25, "row_step": 12,
       "saved_step": 12, "unsaved_secs": {"lost": 0.5, "eval": 0.125, "total": 0.625}}))
  ledger = Ledger(step=12, seconds={"total": 4.0, "eval": 1.0})
  gp = goodput.GoodputHook(Recorder(), workdir=tmp_path, log_summary=False)
  if restored:
    gp.restore_checkpoint_state({"step": 12, "seconds": dict(ledger.seconds)})
  ctx = types.SimpleNamespace(ledger=ledger)  # the loop's context, reduced to its ledger
  gp.on_run_start(ctx, None)
  change = gp.adjust_ledger(ctx)  # the hook returns the change; the loop applies it
  assert (change is not None) == restored
  if change is not None:
    assert change.lost_steps == 2 and dict(change.add_seconds) == {
        "lost": 0.5, "eval": 0.125, "total": 0.625}
    change.apply_to(ledger)
  gp.on_run_end(ctx, None)  # no device call: nothing left to train
  if restored:
    assert ledger.seconds == {"total": 4.625, "eval": 1.125, "lost": 0.5}
    assert ledger.lost_steps == 2
  else:
    assert ledger.seconds == {"total": 4.0, "eval": 1.0} and ledger.lost_steps == 0
  assert gp.writer.rows == []  # step 12 already has a row
  record = json.loads((tmp_path / "goodput.json").read_text())
  assert (record["step"], record["row_step"]) == (12, 12)
  assert record["saved_step"] == (12 if restored else None)


# -- C68: a finished run run again trains nothing and adds no productive time -----------------


class SlowStart(Hook):
  """A generic hook (``hooks`` bucket) whose ``on_run_start`` takes ``secs`` (a progress bar or
  a writer opening)."""

  needs_state = False

  def __init__(self, secs):
    super().__init__()
    self.secs = secs

  def on_run_start(self, ctx, state):
    time.sleep(self.secs)


def test_c68_a_rerun_that_trains_nothing_adds_no_productive_time(tmp_path):
  """Run 1 trains 8 steps (checkpoints at 4 and 8, an "evaluation" of 0.1 s at the end, a hook
  whose start takes 0.1 s, logging, goodput); run 2 is the same run in the same workdirs: it
  restores step 8 and only evaluates. Its productive time, device_wait, dispatch and host gap
  equal run 1's; its seconds are in checkpoint (the restore), eval (>= 0.1 s) and setup (the
  slow start's 0.1 s and the rest of the run's start and end)."""
  pytest.importorskip("orbax.checkpoint")

  def run():
    ckpt = loopkit.CheckpointHook(tmp_path / "ckpt", every_steps=4, async_save=False)
    gp = loopkit.observe.GoodputHook(workdir=tmp_path / "work", log_summary=False)
    ev = Sleeper("eval", 0.1, every_steps=8)
    loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[
        SlowStart(0.1), loopkit.LoggingHook(every_steps=4), ckpt, ev, gp])
    loop.run(toy.init_state(), toy.batches(8), num_steps=8)
    ckpt.close()
    return loop, ckpt, ev, gp.summary

  loop1, _, ev1, s1 = run()
  loop2, ckpt2, ev2, s2 = run()
  assert loop1.ledger.loop_index == 4 and ev1.fired == 1
  assert ckpt2.restored_step == 8 and loop2.ledger.loop_index == 4 and ev2.fired == 1
  assert (s1.steps, s2.steps) == (8, 8)
  same = lambda a, b: a == pytest.approx(b, rel=0, abs=1e-9)
  assert same(s2.productive_secs, s1.productive_secs), (s1, s2)
  assert same(s2.device_wait_secs, s1.device_wait_secs)
  assert same(s2.dispatch_secs, s1.dispatch_secs)
  assert same(s2.host_gap_secs, s1.host_gap_secs), (s1, s2)
  assert same(s2.compile_secs, s1.compile_secs) and same(s2.lost_secs, 0.0)
  eval_, restore, setup = (s2.eval_secs - s1.eval_secs, s2.checkpoint_secs - s1.checkpoint_secs,
                           s2.setup_secs - s1.setup_secs)
  assert 0.1 <= eval_ < 0.1 + 0.5
  assert 0.0 < restore  # the restore, a few ms to a few hundred
  assert 0.1 <= setup < 0.1 + 1.0  # the slow start, placing the state, opening the source ...
  assert same(s2.job_secs - s1.job_secs,
              eval_ + restore + setup + (s2.data_wait_secs - s1.data_wait_secs))
  assert s2.goodput < s1.goodput
