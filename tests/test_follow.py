"""Evaluation beside training: loopkit.tools.follower.CheckpointFollower and TRAIN_COMPLETE.

The follower's rows are compared with the rows EvalHook writes in the training run for the same
steps, bitwise (the JSON rows parse to equal floats). In-process tests drive training and the
follower in sequence (retention and a follower's restart made to happen at exact points);
``test_sidecar_process_beside_training_process`` runs both as real processes side by side.
"""

import json
import logging
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

import loopkit
from loopkit.checkpoint import CheckpointHook
from loopkit.tools.follower import CheckpointFollower, follow
from loopkit.tools import follower as follower_lib
from loopkit.observe.writers import JsonlWriter
from tests import _follow_worker as w
from tests import bootstrap

STEPS = [2, 4, 6, 8, 10]


def rows(path) -> dict[int, dict]:
  out = {}
  for line in Path(path).read_text().splitlines():
    row = json.loads(line)
    assert row["step"] not in out, f"step {row['step']} twice in {path}"
    out[row["step"]] = row
  return out


def train(directory, num_steps, *, hooks=(), eval_path=None, max_to_keep=None, k=3):
  """The worker's model and data in this process: checkpoints (and EvalHook rows) every 2."""
  ckpt = CheckpointHook(directory, every_steps=w.EVERY, max_to_keep=max_to_keep)
  all_hooks = [ckpt, *hooks]
  if eval_path is not None:
    all_hooks.append(loopkit.EvalHook(w.evaluator(), w.eval_batches(), every_steps=w.EVERY,
                                      writer=JsonlWriter(eval_path, flush_secs=0)))
  loop = loopkit.TrainLoop(w.train_step, iterations_per_loop=k, hooks=all_hooks)
  loop.run(w.init_state(), w._data(0, 12, 8), num_steps=num_steps)
  if eval_path is not None:
    all_hooks[-1].writer.close()
  return loop


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted run to step 10: its checkpoints (all kept) and EvalHook's rows."""
  d = tmp_path_factory.mktemp("reference")
  loop = train(d / "ckpt", 10, eval_path=d / "eval.jsonl")
  assert loop.status == "completed"
  return d / "ckpt", rows(d / "eval.jsonl")


def make_follower(directory, out: Path, **kwargs):
  return CheckpointFollower(directory, w.init_state(), w.evaluator(), w.eval_batches(),
                            writer=JsonlWriter(out / "metrics.jsonl", flush_secs=0),
                            progress_file=out / "progress.json", poll_secs=0.05, **kwargs)


def test_follower_rows_are_eval_hook_rows_bitwise_and_it_stops_at_the_marker(reference,
                                                                             tmp_path):
  ckpt, expected = reference
  assert sorted(expected) == STEPS
  assert json.loads((ckpt / "TRAIN_COMPLETE").read_text())["step"] == 10
  f = follow(ckpt, w.init_state(), w.evaluator(), w.eval_batches(),
             writer=JsonlWriter(tmp_path / "metrics.jsonl"), poll_secs=0.05)
  assert f.status == "complete" and f.skipped_steps == []
  assert [s for s, _ in f.results] == STEPS
  got = rows(tmp_path / "metrics.jsonl")
  assert got == expected  # every key, every float: the same bits
  assert set(got[10]) == {"step", "eval/mse", "eval/max_err", "eval/num_examples"}
  assert got[10]["eval/num_examples"] == 29


def test_follower_skips_a_checkpoint_deleted_under_it_and_reads_no_unfinished_save(
    reference, tmp_path, monkeypatch, caplog):
  ckpt = tmp_path / "ckpt"
  shutil.copytree(reference[0], ckpt)
  (ckpt / "12.orbax-checkpoint-tmp-99").mkdir()  # a save in progress (atomic-rename mode)
  (ckpt / "14").mkdir()  # one in commit-file mode: no commit_success.txt yet
  (ckpt / "14" / "state").mkdir()
  f = make_follower(ckpt, tmp_path / "follow")
  restore = f._reader.restore

  def deleted_first(like, step=None):  # retention removes step 4 after it was listed
    if step == 4:
      shutil.rmtree(ckpt / "4")
    return restore(like, step=step)

  monkeypatch.setattr(f._reader, "restore", deleted_first)
  with caplog.at_level(logging.WARNING, logger="loopkit"):
    f.run()
  assert f.status == "complete" and f.skipped_steps == [4]
  assert [s for s, _ in f.results] == [2, 6, 8, 10]
  assert "checkpoint 4 in" in caplog.text and "deleted before it was evaluated" in caplog.text
  got = rows(tmp_path / "follow" / "metrics.jsonl")
  assert got == {s: reference[1][s] for s in (2, 6, 8, 10)}
  assert json.loads((tmp_path / "follow" / "progress.json").read_text()) == {
      "directory": str(ckpt), "evaluated": [2, 6, 8, 10], "skipped": [4]}
  # The follower only reads: the unfinished saves are neither steps nor removed.
  assert (ckpt / "12.orbax-checkpoint-tmp-99").is_dir() and (ckpt / "14" / "state").is_dir()


def test_follower_lists_again_when_a_step_is_deleted_while_orbax_lists_it(reference, tmp_path,
                                                                          monkeypatch):
  """Retention deletes steps 4 and then 6 between Orbax listing the step directories and
  reading each step's metrics (CI, 2026-12-04: the sidecar process died of Orbax's
  ``ValueError: No step path found with name=4``): the listing is taken again, the follower
  evaluates the steps that stay, and a directory that keeps failing still raises."""
  import orbax.checkpoint as ocp
  ckpt = tmp_path / "ckpt"
  shutil.copytree(reference[0], ckpt)
  find = ocp.CheckpointManager._get_read_step_directory
  doomed = [4, 6]  # deleted, one per listing, when Orbax first reads their metrics

  def deleted_while_listed(self, step, directory):
    if doomed and step == doomed[0]:
      shutil.rmtree(ckpt / str(doomed.pop(0)))
    return find(self, step, directory)

  monkeypatch.setattr(ocp.CheckpointManager, "_get_read_step_directory", deleted_while_listed)
  f = make_follower(ckpt, tmp_path / "follow")
  f.run()
  assert doomed == [] and f.status == "complete" and f.skipped_steps == []
  assert [s for s, _ in f.results] == [2, 8, 10]
  assert rows(tmp_path / "follow" / "metrics.jsonl") == {s: reference[1][s] for s in (2, 8, 10)}
  hook = CheckpointHook(ckpt)
  assert hook.all_steps() == [2, 8, 10] and hook.latest_step() == 10

  def always_gone(self, step, directory):
    raise ValueError(f"No step path found with name={step}")

  monkeypatch.setattr(ocp.CheckpointManager, "_get_read_step_directory", always_gone)
  with pytest.raises(ValueError, match=r"No step path found with name=(2|8|10)$"):  # threads
    hook.all_steps()
  hook.close()


def test_follower_restarted_continues_and_the_marker_follows_the_runs(reference, tmp_path):
  """Run to 4 (completed), follow; preempted at 6, follow (time-out); resume to 10, a
  restarted follower evaluates 8 and 10 only: its file holds each step once, EvalHook's rows."""
  ckpt, out = tmp_path / "ckpt", tmp_path / "follow"
  marker = ckpt / "TRAIN_COMPLETE"
  assert train(ckpt, 4).status == "completed"
  assert json.loads(marker.read_text())["step"] == 4 and "status" in marker.read_text()
  a = make_follower(ckpt, out)
  a.run()
  assert a.status == "complete" and [s for s, _ in a.results] == [2, 4]

  seen = []

  def preempt(info, state):
    seen.append(marker.exists())
    loop.preemption.request()

  loop = loopkit.TrainLoop(w.train_step, iterations_per_loop=3,
                           hooks=[CheckpointHook(ckpt, every_steps=w.EVERY),
                                  loopkit.CallbackHook(preempt, at_steps=[6])])
  loop.run(w.init_state(), w._data(0, 12, 8), num_steps=10)
  assert loop.status == "preempted" and seen == [False]  # removed when the run started
  assert not marker.exists()  # a preemption is not the end of training
  b = make_follower(ckpt, out, timeout_secs=0.3)
  b.run()
  assert b.status == "timed_out" and [s for s, _ in b.results] == [6]

  assert train(ckpt, 10).status == "completed"
  assert json.loads(marker.read_text())["step"] == 10
  with open(out / "metrics.jsonl", "a") as f:  # a row written just before a kill, unrecorded
    f.write(json.dumps({"step": 8, "eval/mse": 0.0}) + "\n")
  c = make_follower(ckpt, out)
  assert c.done_through == 6
  c.run()
  assert c.status == "complete" and [s for s, _ in c.results] == [8, 10]
  assert rows(out / "metrics.jsonl") == reference[1]  # each step once, bitwise EvalHook's


def test_no_marker_after_a_run_that_raised(tmp_path):
  ckpt = tmp_path / "ckpt"
  assert train(ckpt, 2, k=2).status == "completed" and (ckpt / "TRAIN_COMPLETE").exists()

  def fail(info, state):
    raise RuntimeError("boom at 4")

  with pytest.raises(RuntimeError, match="boom at 4"):
    train(ckpt, 8, k=2, hooks=[loopkit.CallbackHook(fail, at_steps=[4])])
  assert not (ckpt / "TRAIN_COMPLETE").exists()
  assert CheckpointHook(ckpt).all_steps() == [2, 4]


def test_follower_refuses_wrong_inputs(reference, tmp_path, monkeypatch):
  ckpt = reference[0]
  with pytest.raises(ValueError, match="one-shot iterator"):
    CheckpointFollower(ckpt, w.init_state(), w.evaluator(), iter(w.eval_batches()))
  with pytest.raises(TypeError, match="got the function eval_step, not an evaluator"):
    CheckpointFollower(ckpt, w.init_state(), w.eval_step, w.eval_batches())
  progress = tmp_path / "progress.json"
  progress.write_text(json.dumps({"directory": "/elsewhere/ckpt", "evaluated": [2]}))
  with pytest.raises(ValueError, match=r"records checkpoints of /elsewhere/ckpt, not of "
                                       + str(ckpt)):
    CheckpointFollower(ckpt, w.init_state(), w.evaluator(), w.eval_batches(),
                       progress_file=progress)
  wrong = dict(w.init_state(), w=np.zeros((5, 3), np.float32))
  monkeypatch.setattr(follower_lib, "_DELETION_GRACE_S", 0.0)
  f = CheckpointFollower(ckpt, wrong, w.evaluator(), w.eval_batches(), poll_secs=0.05)
  with pytest.raises(ValueError, match=r"leaf w has shape \(6, 3\) in the checkpoint, "
                                       r"\(5, 3\) in the train state"):
    f.run()


def test_follow_command_writes_eval_hook_rows_and_exits_by_the_marker(reference, tmp_path,
                                                                      capsys):
  from loopkit.tools import follow as follow_cli
  out = tmp_path / "follow"
  argv = ["tests._follow_worker:target", "--directory", str(reference[0]), "--output_dir",
          str(out), "--poll_secs", "0.05"]
  assert follow_cli.main(argv) == 0
  assert capsys.readouterr().out == (f"complete: evaluated 5 checkpoint(s) {STEPS}; rows in "
                                     f"{out / 'metrics.jsonl'}\n")
  assert rows(out / "metrics.jsonl") == reference[1]
  assert json.loads((out / "follow_progress.json").read_text())["evaluated"] == STEPS
  unfinished = tmp_path / "unfinished"  # the same checkpoints, no TRAIN_COMPLETE: time-out
  shutil.copytree(reference[0], unfinished, ignore=shutil.ignore_patterns("TRAIN_COMPLETE"))
  argv[2], argv[4] = str(unfinished), str(tmp_path / "other")
  assert follow_cli.main([*argv, "--timeout_secs", "0.2"]) == 1
  assert capsys.readouterr().out.startswith(f"timed_out: evaluated 5 checkpoint(s) {STEPS}")


def test_follow_command_prints_its_rows_and_lines_as_a_training_run_does(reference, tmp_path):
  """``python -m loopkit.tools.follow`` run as a user runs it (a fresh process, no logging set
  up, no TrainLoop built): each evaluation's row is one console line (create_default_writer's
  ConsoleWriter), the follower's own lines print plainly, nothing comes out bare."""
  out = subprocess.run(bootstrap.command(
      "-c", SIDECAR, "tests._follow_worker:target", "--directory", reference[0],
      "--output_dir", tmp_path / "follow", "--poll_secs", "0.05", devices=2),
      env=bootstrap.env(), cwd=bootstrap.ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stderr.splitlines()
  shown = [line.split(":")[0] for line in lines if "eval/mse=" in line]
  assert shown == [f"step {s}" for s in STEPS], out.stderr[-3000:]
  assert sum(line.startswith("follower: evaluating the checkpoints in ") for line in lines) == 1
  assert sum(line.startswith("follower: training complete at step 10") for line in lines) == 1
  assert not [line for line in lines if line.startswith(("WARNING:", "INFO:"))], out.stderr


def test_follow_command_refuses_a_target_of_the_wrong_kind():
  from loopkit.tools import follow as follow_cli
  with pytest.raises(SystemExit, match=r"must return \(like, evaluator, batches\)"):
    follow_cli._target_kwargs("m:f", [1, 2, 3])
  with pytest.raises(SystemExit, match="unknown: writer"):
    follow_cli._target_kwargs("m:f", {"like": 1, "evaluator": 2, "batches": 3, "writer": 4})


SIDECAR = ("import runpy, sys; sys.exit(runpy.run_module('loopkit.tools.follow', "
           "run_name='__main__'))")


@pytest.mark.slow(
    held_by="tests/test_follow.py::"
            "test_follower_restarted_continues_and_the_marker_follows_the_runs",
    reason="two fresh processes (JAX + Orbax each) side by side and a lagging sidecar: 9-10 s "
           "alone, 14-19 s on 2 busy cores; the twin drives training, marker, retention and "
           "restarts in sequence in this process")
def test_sidecar_process_beside_training_process(tmp_path):
  """A training process (checkpoints and EvalHook every 2 steps, max_to_keep=2) and
  ``python -m loopkit.tools.follow`` started together, the sidecar slower than the training
  run (retention deletes checkpoints under it): the sidecar's rows are the training run's
  EvalHook rows of the same steps, bitwise, and it stops at TRAIN_COMPLETE (exit 0) having
  evaluated the last step."""
  env = bootstrap.env()
  sidecar_cmd = bootstrap.command(
      "-c", SIDECAR, "tests._follow_worker:lagging_target", "--directory",
      tmp_path / "checkpoints", "--output_dir", tmp_path / "follow", "--poll_secs", "0.1",
      "--timeout_secs", "120", devices=2)
  trainer = subprocess.Popen(bootstrap.command(Path(w.__file__), tmp_path, "0.15", devices=2),
                             env=env, cwd=bootstrap.ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  sidecar = subprocess.Popen(sidecar_cmd, env=env, cwd=bootstrap.ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  try:
    t_out, t_err = trainer.communicate(timeout=180)
    s_out, s_err = sidecar.communicate(timeout=180)
  finally:
    for p in (trainer, sidecar):
      if p.poll() is None:
        p.send_signal(signal.SIGKILL)
  assert trainer.returncode == 0 and "STATUS completed" in t_out, t_err[-3000:]
  assert sidecar.returncode == 0, s_err[-3000:]
  assert s_out.startswith("complete: evaluated"), s_out + s_err[-3000:]
  train_rows = rows(tmp_path / "train_eval.jsonl")
  assert sorted(train_rows) == list(range(2, 13, 2))
  got = rows(tmp_path / "follow" / "metrics.jsonl")
  assert 12 in got  # the last checkpoint, seen through the marker
  assert got == {s: train_rows[s] for s in got}  # bitwise EvalHook's rows
  progress = json.loads((tmp_path / "follow" / "follow_progress.json").read_text())
  assert progress["evaluated"] == sorted(got)
  assert not set(progress["skipped"]) & set(got)
  unseen = sorted(set(train_rows) - set(got) - set(progress["skipped"]))
  print(f"\nsidecar evaluated {sorted(got)}, skipped {progress['skipped']} (deleted between its "
        f"listing and its read), never saw {unseen} (deleted before it looked); training rows at "
        f"{sorted(train_rows)}")
