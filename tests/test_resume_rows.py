"""C62: the rows of a run cut and resumed are the rows of the uninterrupted run, however it was cut.

The subprocess tests run tests/_rows_worker.py (22 steps per epoch, K=7, rows every epoch and
every 9 steps, an evaluation every 9 steps, a checkpoint every 14 steps, 44 steps) cut by a real
SIGINT / SIGTERM (a preemption: the run saves and returns), a SIGKILL, or a hook that raises
(a new process resumes, or the same loop is run again in the same process), and compare the
JSONL files line by line with an uninterrupted run's. The in-process tests hold the parts:
which hooks fire at a preemption, and a rerun in the same process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest

import loopkit
from tests import bootstrap, toy

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rows_worker.py")
FILES = ("epoch.jsonl", "steps.jsonl", "eval.jsonl")


def _worker(workdir, *args):
  t0 = time.monotonic()
  proc = subprocess.run(bootstrap.command(WORKER, "--dir", workdir, *args, devices=1),
                        capture_output=True, text=True, timeout=120, env=bootstrap.env())
  return proc, time.monotonic() - t0


def _lines(workdir):
  out = {}
  for name in FILES:
    path = os.path.join(workdir, name)
    out[name] = open(path).read().splitlines() if os.path.exists(path) else []
  return out


def _steps(lines):
  import json
  return [json.loads(line)["step"] for line in lines]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  proc, secs = _worker(workdir)
  print(f"uninterrupted run: {secs:.1f} s")
  assert proc.returncode == 0 and "STATUS completed 44" in proc.stdout, proc.stderr[-3000:]
  rows = _lines(workdir)
  assert _steps(rows["epoch.jsonl"]) == [22, 44]
  assert _steps(rows["steps.jsonl"]) == [9, 18, 27, 36, 44]  # 44: the run's end
  assert _steps(rows["eval.jsonl"]) == [9, 18, 27, 36, 44]
  return rows


_HERE = "tests/test_resume_rows.py"
_CUT_TEST = f"{_HERE}::test_rows_after_a_cut_and_a_resume_equal_the_uninterrupted_runs"
# (how, at step, what the cut process prints or returns)
CUTS = [pytest.param("sigint", 7, "STATUS preempted 7", id="sigint"),  # the case: mid-epoch
        # after the checkpoint at 14, with windows open: the same preemption as sigint's
        pytest.param("sigterm", 16, "STATUS preempted 16", id="sigterm", marks=pytest.mark.slow(
            held_by=_CUT_TEST, reason="a preemption like [sigint]'s, later in the epoch: "
                                      "two more processes")),
        pytest.param("kill", 20, None, id="kill"),  # SIGKILL: resumes from 14
        pytest.param("raise", 20, None, id="raise"),  # a hook raises, the process dies
        # the same loop run again in the same process
        pytest.param("raise-rerun", 20, "RAISED 20", id="raise-rerun", marks=pytest.mark.slow(
            held_by=f"{_HERE}::test_a_rerun_in_the_same_process_writes_the_uninterrupted_rows",
            reason="the in-process rerun held in-process by its twin: one more process"))]


@pytest.mark.parametrize("how,at,printed", CUTS)
def test_rows_after_a_cut_and_a_resume_equal_the_uninterrupted_runs(tmp_path, uninterrupted,
                                                                     how, at, printed):
  workdir = str(tmp_path)
  cut, secs = _worker(workdir, "--cut", how, "--at", str(at))
  if how == "kill":
    assert cut.returncode == -signal.SIGKILL
  elif how == "raise":
    assert cut.returncode == 1 and f"hook failed at step {at}" in cut.stderr
  else:
    assert cut.returncode == 0 and printed in cut.stdout, cut.stderr[-3000:]
  if how in ("sigint", "sigterm"):  # a preemption writes no row at its step
    rows = _lines(workdir)
    assert at not in _steps(rows["epoch.jsonl"]) + _steps(rows["steps.jsonl"])
    assert at not in _steps(rows["eval.jsonl"])
  if how != "raise-rerun":  # a new process resumes
    resumed, secs2 = _worker(workdir)
    secs += secs2
    assert resumed.returncode == 0, resumed.stderr[-3000:]
  else:
    resumed = cut
  assert "STATUS completed 44" in resumed.stdout
  print(f"{how} at {at} + resume: {secs:.1f} s")
  rows = _lines(workdir)
  for name in FILES:  # the same steps, bitwise the same values
    assert rows[name] == uninterrupted[name], name


def test_at_a_preemption_only_the_hooks_that_act_there_fire(tmp_path):
  """A preemption at step 6 (K=4, rows every 5): the checkpoint and a user's at_end hook fire;
  the LoggingHook, the EvalHook and a user's hook with fires_at_preemption=False do not; the
  LoggingHook's open window (step 6) goes into the checkpoint and the resumed row at 10 covers
  6-10 with the uninterrupted run's values."""
  pytest.importorskip("orbax.checkpoint")
  data = toy.batches(12)
  seen = {"user": [], "quiet": []}
  evaluator = loopkit.Evaluator(lambda s, b: {"w": (b["x"] @ s["params"]["w"])[:, 0]},
                                global_batch_size=16)
  quiet = loopkit.CallbackHook(lambda info, s: seen["quiet"].append(info.end_step),
                               every_steps=5)
  quiet.fires_at_preemption = False

  def hooks():
    return [loopkit.LoggingHook(every_steps=5),
            loopkit.EvalHook(evaluator, data[:1], every_steps=5),
            loopkit.CallbackHook(lambda info, s: seen["user"].append(info.end_step),
                                 every_steps=5), quiet,
            loopkit.CheckpointHook(tmp_path, every_steps=100, async_save=False)]

  first = hooks()
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[
      *first, loopkit.CallbackHook(lambda info, s: loop.preemption.request(), at_steps=[6])])
  loop.run(toy.init_state(), data, num_steps=12)
  assert loop.status == "preempted" and first[4].saved_steps == [6]
  assert seen == {"user": [5, 6], "quiet": [5]}
  assert [s for s, _ in first[0].records] == [5] and [s for s, _ in first[1].results] == [5]
  assert first[4].restore(toy.init_state()).hook_states["LoggingHook"]["first_step"] == 6
  second = hooks()
  loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=second).run(
      toy.init_state(), data, num_steps=12)
  assert second[4].restored_step == 6
  assert [s for s, _ in second[0].records] == [10, 12] and second[0].first_steps == [6, 11]
  straight = loopkit.LoggingHook(every_steps=5)
  loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[straight]).run(
      toy.init_state(), data, num_steps=12)
  assert first[0].records + second[0].records == straight.records
  assert [s for s, _ in first[1].results + second[1].results] == [5, 10, 12]


@pytest.mark.parametrize("restore", [False, True], ids=["from_scratch", "from_checkpoint"])
def test_a_rerun_in_the_same_process_writes_the_uninterrupted_rows(tmp_path, restore):
  """K=2, rows every 5 into a JsonlWriter; a hook raises once at step 11; the same loop runs
  again, from the initial state (the window of step 11 it holds is not this run's) or from the
  checkpoint at 9 (the row at 10 goes, file and records: the resumed run writes it again, from
  the window of steps 6-9 saved at 9). Rows and records equal the uninterrupted run's."""
  if restore:
    pytest.importorskip("orbax.checkpoint")
  data = toy.batches(12)

  def run(path, fail_at=None):
    writer = loopkit.observe.JsonlWriter(path, flush_secs=0)
    logging = loopkit.LoggingHook(writer, every_steps=5, throughput=False)
    hooks = [logging]
    if restore:
      hooks.append(loopkit.CheckpointHook(f"{path}.ckpt", every_steps=3, async_save=False))
    armed = [fail_at is not None]

    def fail(info, state):
      if armed[0]:
        armed[0] = False
        raise RuntimeError("boom")

    hooks.append(loopkit.CallbackHook(fail, at_steps=[fail_at or 12], at_end=False))
    loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=hooks)
    if fail_at is not None:
      with pytest.raises(RuntimeError, match="boom"):
        loop.run(toy.init_state(), data, num_steps=12)
      assert [s for s, _ in logging.records] == [5, 10]
    loop.run(toy.init_state(), data, num_steps=12)
    writer.close()
    return logging, open(path).read().splitlines()

  straight, straight_rows = run(tmp_path / "straight.jsonl")
  again, rows = run(tmp_path / "rerun.jsonl", fail_at=11)
  assert [s for s, _ in again.records] == [5, 10, 12]
  assert again.records == straight.records and again.first_steps == straight.first_steps
  assert rows == straight_rows
  assert np.isfinite([r["loss"] for _, r in again.records]).all()
