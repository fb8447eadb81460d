"""Goodput: the summary's arithmetic, the loop's buckets (checkpoint, eval, hooks), lost work
after a restart, persistence in the checkpoint, and no device syncs added."""

import json
import logging
import time

import jax
import numpy as np
import pytest

import loopkit
from loopkit import goodput
from loopkit.hooks import Hook
from loopkit.ledger import Ledger
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

  def after_call(self, info, state):
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
  gp = loopkit.GoodputHook(writer, every_steps=4)
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
  parts = (s.compile_secs + s.data_wait_secs + s.checkpoint_secs + s.eval_secs + s.lost_secs
           + s.dispatch_secs + s.device_wait_secs + s.host_gap_secs)
  assert parts == pytest.approx(s.job_secs, rel=1e-9, abs=1e-9)
  assert 0.0 < s.goodput < 1.0
  # Written as metrics at the planner-landed steps 4, 8 and at the end (12).
  assert [step for step, _ in writer.rows] == [4, 8, 12]
  assert writer.rows[-1][1]["goodput/goodput"] == s.goodput
  assert any(m.startswith("goodput summary:\ngoodput ") for m in caplog.messages)


def test_lost_work_after_a_restart(tmp_path):
  """Attempt 1 reaches step 12; attempt 2 starts again at 8: 4 steps are redone."""
  loop1 = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4,
                            hooks=[loopkit.GoodputHook(workdir=tmp_path)])
  state8 = None

  def keep(info, state):
    nonlocal state8
    state8 = jax.device_get(state)

  loop1.hooks.insert(0, loopkit.CallbackHook(keep, at_steps=[8], at_end=False))
  loop1.run(toy.init_state(), toy.batches(12), num_steps=12)
  record = json.loads((tmp_path / "goodput.json").read_text())
  assert record["step"] == 12 and record["lost_steps"] == 0
  assert record["secs_per_step"] > 0

  gp = loopkit.GoodputHook(workdir=tmp_path)
  loop2 = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[gp])
  loop2.run(state8, toy.batches(16)[8:], num_steps=16)
  assert loop2.ledger.lost_steps == 4
  assert loop2.ledger.seconds["lost"] == 4 * record["secs_per_step"]
  assert gp.summary.lost_steps == 4 and gp.summary.lost_secs == 4 * record["secs_per_step"]
  record2 = json.loads((tmp_path / "goodput.json").read_text())
  assert (record2["step"], record2["lost_steps"]) == (16, 4)

  # A third attempt that restarts at 12 adds 4 more to the counters it carries.
  loop3 = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4,
                            hooks=[loopkit.GoodputHook(workdir=tmp_path)])
  state12 = dict(state8, step=np.int32(12))
  loop3.run(state12, toy.batches(16)[12:], num_steps=16)
  assert loop3.ledger.lost_steps == 8


def test_persisted_in_the_checkpoint_and_restored(tmp_path):
  """The ledger (time buckets, lost steps) is saved with the state and comes back on resume."""
  pytest.importorskip("orbax.checkpoint")

  class Crash(Hook):
    needs_state = False

    def observe(self, info):
      if info.end_step == 14:
        raise RuntimeError("simulated crash")

  ckpt_dir, work = tmp_path / "ckpt", tmp_path / "work"
  loop1 = loopkit.TrainLoop(
      toy.make_global_step(), iterations_per_loop=2,
      hooks=[loopkit.CheckpointHook(ckpt_dir, every_steps=4, async_save=False),
             loopkit.GoodputHook(workdir=work), Crash()])
  with pytest.raises(RuntimeError, match="simulated crash"):
    loop1.run(toy.init_state(), toy.batches(20), num_steps=20)
  assert json.loads((work / "goodput.json").read_text())["step"] == 14
  ckpt1 = loop1.hooks[0]
  ckpt1.close()

  ckpt = loopkit.CheckpointHook(ckpt_dir, every_steps=4, async_save=False)
  gp = loopkit.GoodputHook(workdir=work)
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
  writer = loopkit.AsyncWriter(Recorder())
  hooks = [loopkit.GoodputHook(writer, every_steps=4),
           loopkit.ProgressHook(log_every_secs=0.0, stream=open("/dev/null", "w")),
           loopkit.LoggingHook(writer, per_step=True)]
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=hooks)
  state = toy.init_state()
  with jax.transfer_guard("disallow"):
    loop.run(state, toy.batches(12), num_steps=12)
  writer.close()
  assert loop.ledger.step == 12
