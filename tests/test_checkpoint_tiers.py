"""Two retention tiers (issue 38): temporary checkpoints of the cadence beside permanent ones.

CheckpointHook(every_steps=7, keep_every_steps=25): saves every 7 steps and at every multiple
of 25; keeps the newest checkpoint (max_to_keep defaults to 1) and every multiple of 25. A
kill between tiers (during the retention delete of a temporary step) is in
tests/test_checkpoint_process.py::test_kill_between_tiers_resumes_bitwise.
"""

import os

import pytest
import toy
from etils import epath

import loopkit
from loopkit.checkpoint import CheckpointHook, CheckpointWarning
from loopkit.checkpoint.files import _TRASH, _tidy
from loopkit.checkpoint.tiers import PermanentMarks

DATA = toy.batches(100)
EVERY_7 = [7, 14, 21, 28, 35, 42, 49, 56, 63, 70, 77, 84, 91, 98]


def make_loop(hooks=(), k=4):
  return loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k, hooks=list(hooks))


def test_100_steps_keep_every_25_and_the_newest(tmp_path):
  """Temporary every 7 (1 kept), permanent every 25: 18 saves, [25, 50, 75, 100] kept (98, the
  newest temporary, went when 100 was saved)."""
  hook = CheckpointHook(tmp_path, every_steps=7, keep_every_steps=25)
  make_loop([hook]).run(toy.init_state(), DATA, num_steps=100)
  assert hook.saved_steps == sorted(EVERY_7 + [25, 50, 75, 100])
  assert hook.all_steps() == [25, 50, 75, 100]
  # no trash left; the run completed (tools.follower's marker)
  assert sorted(os.listdir(tmp_path)) == ["100", "25", "50", "75", "TRAIN_COMPLETE"]


def test_keep_steps_and_max_to_keep_2(tmp_path):
  """Explicit permanent steps (10, 33: off the cadence, saved there too) and the newest 2."""
  hook = CheckpointHook(tmp_path, every_steps=7, keep_steps=[33, 10], max_to_keep=2)
  assert hook.keep_steps == (10, 33) and isinstance(hook.trigger, PermanentMarks)
  make_loop([hook], k=5).run(toy.init_state(), DATA, num_steps=40)
  assert hook.saved_steps == [7, 10, 14, 21, 28, 33, 35, 40]
  assert hook.all_steps() == [10, 33, 35, 40]


def test_every_secs_temporary_tier(tmp_path):
  """A time-based temporary tier (no time mark reached here) beside every 25 steps."""
  hook = CheckpointHook(tmp_path, every_secs=3600, keep_every_steps=25)
  make_loop([hook]).run(toy.init_state(), DATA, num_steps=60)
  assert hook.saved_steps == [25, 50, 60] and hook.all_steps() == [25, 50, 60]


def test_preemption_is_temporary_and_resume_picks_the_newest_of_either(tmp_path):
  """Preempted at 37: 37 is kept beside 25 (35 went) and the resume picks it (a temporary
  newer than the permanent 25); it is replaced at 42. Stopped at 50, the newest is the
  permanent 50 (49 went), which the next resume picks. The run ends bitwise equal to the
  uninterrupted one, with the same steps kept."""
  def hook():
    return CheckpointHook(tmp_path, every_steps=7, keep_every_steps=25)

  first = hook()
  loop = make_loop([first, loopkit.CallbackHook(lambda info, s: loop.preemption.request(),
                                                at_steps=[37])])
  loop.run(toy.init_state(), DATA, num_steps=100)
  assert loop.status == "preempted" and first.saved_steps == [7, 14, 21, 25, 28, 35, 37]
  assert first.all_steps() == [25, 37]
  second = hook()
  make_loop([second]).run(toy.init_state(), DATA, num_steps=50)
  assert second.restored_step == 37 and second.saved_steps == [42, 49, 50]
  assert second.all_steps() == [25, 50]
  third = hook()
  final = make_loop([third], k=3).run(toy.init_state(), DATA, num_steps=100)
  assert third.restored_step == 50 and third.saved_steps == [56, 63, 70, 75, 77, 84, 91, 98, 100]
  assert third.all_steps() == [25, 50, 75, 100]
  toy.assert_bitwise(final, make_loop().run(toy.init_state(), DATA, num_steps=100))


def test_bad_tier_arguments(tmp_path):
  with pytest.raises(ValueError, match=r"keep_every_steps must be a whole number of steps > 0, "
                                       r"got 0"):
    CheckpointHook(tmp_path, every_steps=7, keep_every_steps=0)
  with pytest.raises(ValueError, match=r"keep_steps entry must be a whole number of steps, "
                                       r"got 2\.5"):
    CheckpointHook(tmp_path, keep_steps=[5, 2.5])
  with pytest.raises(ValueError, match=r"keep_steps must be a sequence of steps, got '10'"):
    CheckpointHook(tmp_path, keep_steps="10")


def test_a_delete_cut_short_leaves_only_trash_which_is_removed(tmp_path):
  """What a kill during a delete leaves on a local disk: part of a step inside the trash
  (the step was renamed there first). Opening the directory removes the trash; a user's
  empty folder named like a step (C35) is still kept, with a warning."""
  partial = tmp_path / _TRASH / "4" / "state" / "ocdbt.process_0"
  partial.mkdir(parents=True)
  (partial / "manifest.ocdbt").write_bytes(b"")
  (tmp_path / "7").mkdir()
  messages = _tidy(epath.Path(tmp_path))
  assert len(messages) == 1 and "holds 7: named like loopkit checkpoints" in messages[0]
  assert sorted(os.listdir(tmp_path)) == ["7"]
  hook = CheckpointHook(tmp_path, every_steps=2, max_to_keep=1)
  with pytest.warns(CheckpointWarning, match="holds 7"):
    make_loop([hook], k=2).run(toy.init_state(), DATA, num_steps=4)
  assert hook.all_steps() == [4]
  assert sorted(os.listdir(tmp_path)) == ["4", "7", "TRAIN_COMPLETE"]
