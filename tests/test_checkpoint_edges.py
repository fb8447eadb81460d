"""CheckpointHook at the edges: an error while a save is in flight (C33), folders the hook did
not write (C35), a directory with someone else's checkpoints (C41)."""

import os
import subprocess
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import toy

import loopkit
from loopkit.checkpoint import CheckpointHook, CheckpointWarning
from tests import bootstrap

assert_bitwise = toy.assert_bitwise


def make_loop(k, hooks=(), step=None, **kw):
  return loopkit.TrainLoop(step or toy.make_global_step(), iterations_per_loop=k,
                           hooks=list(hooks), **kw)


def listing(d: Path) -> dict[str, bytes]:
  """Every file under ``d`` (relative path -> bytes)."""
  return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# -- C33: an error while an asynchronous save is in flight --------------------------------

N_BIG = 8 << 20  # float32 elements: a 32 MB state


def _big_step(s, b):
  return {"w": s["w"] * 1.0001 + b["x"].mean(), "step": s["step"] + 1}, {"m": s["w"][0]}


def _big_state():
  return {"w": jnp.arange(N_BIG, dtype=jnp.float32), "step": jnp.zeros((), jnp.int32)}


BIG_DATA = [{"x": np.full((8,), i, np.float32)} for i in range(12)]


class Boom(Exception):
  pass


class RaiseAfterSave(loopkit.Hook):
  """Raises at ``step``, right after the checkpoint hook (listed first) started its save."""

  needs_state = False

  def __init__(self, ckpt, step):
    super().__init__(at_steps=[step], at_end=False)
    self.ckpt = ckpt
    self.in_flight = None

  def on_trigger(self, info, state):
    self.in_flight = self.ckpt._in_flight  # the step being written now
    raise Boom(f"hook failed at step {info.end_step}")


def _c33_episode(d: Path, mesh) -> dict:
  ckpt = CheckpointHook(d, every_steps=4)
  boom = RaiseAfterSave(ckpt, 8)
  with pytest.raises(Boom, match="hook failed at step 8"):
    make_loop(2, [ckpt, boom], step=_big_step, mesh=mesh).run(_big_state(), BIG_DATA,
                                                              num_steps=12)
  names = sorted(os.listdir(d))  # when run raised: nothing is being written any more
  again = CheckpointHook(d, every_steps=4)
  loop = make_loop(2, [again], step=_big_step, mesh=mesh)
  final = loop.run(_big_state(), BIG_DATA, num_steps=12)
  return dict(in_flight=boom.in_flight, names_at_raise=names, manager_closed=ckpt._manager is None,
              restored=again.restored_step, saved=again.saved_steps, steps=again.all_steps(),
              final=final, names_after=sorted(os.listdir(d)))


def jax_mesh1():
  return jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])  # no 8 replicas of 32 MB


@pytest.fixture(scope="module")
def big_reference():
  return make_loop(2, step=_big_step, mesh=jax_mesh1()).run(_big_state(), BIG_DATA,
                                                            num_steps=12)


def _c33_repeats(tmp_path, big_reference, n):
  mesh = jax_mesh1()
  failures, restored = [], []
  for i in range(n):
    d = tmp_path / f"rep{i}"
    try:
      r = _c33_episode(d, mesh)
      assert r["in_flight"] == 8  # the error came while step 8 was being written
      assert r["manager_closed"]
      assert r["names_at_raise"] in (["4", "8"], ["4"]), r["names_at_raise"]  # committed or gone
      assert r["restored"] == (8 if "8" in r["names_at_raise"] else 4)
      assert r["steps"] == [4, 8, 12]
      assert r["saved"] == ([12] if r["restored"] == 8 else [8, 12])
      assert r["names_after"] == ["12", "4", "8", "TRAIN_COMPLETE"]
      assert_bitwise(r["final"], big_reference)
      restored.append(r["restored"])
    except AssertionError as e:  # count, then report all
      failures.append(f"repeat {i}: {e}")
  print(f"C33: {n} repeats, {len(failures)} failures, restored steps {restored}")
  assert not failures, failures
  return restored


def test_c33_error_while_a_save_is_in_flight(tmp_path, big_reference):
  """32 MB state, 3 repeats: run raises the hook's error only once the save of 8 committed."""
  restored = _c33_repeats(tmp_path, big_reference, 3)
  assert restored == [8, 8, 8]  # a healthy save is waited for, never abandoned


@pytest.mark.slow(held_by="tests/test_checkpoint_edges.py::test_c33_failed_in_flight_save_is_cleaned_up",
                  reason="20 repeats of the race")
def test_c33_error_while_a_save_is_in_flight_20_repeats(tmp_path, big_reference):
  restored = _c33_repeats(tmp_path, big_reference, 20)
  assert restored == [8] * 20


def test_c33_failed_in_flight_save_is_cleaned_up(tmp_path, monkeypatch):
  """The hook raises while the save of 8 is failing: the error of the hook propagates, the
  unfinished directory is gone, and a new hook resumes from 4."""
  from test_checkpoint_hook import _fail_ledger_write_at
  data = toy.batches(12)
  ckpt = CheckpointHook(tmp_path, every_steps=4)
  with monkeypatch.context() as m:
    _fail_ledger_write_at(m, 8)
    with pytest.raises(Boom):
      make_loop(2, [ckpt, RaiseAfterSave(ckpt, 8)]).run(toy.init_state(), data, num_steps=12)
  assert sorted(os.listdir(tmp_path)) == ["4"] and ckpt._manager is None
  again = CheckpointHook(tmp_path, every_steps=4)
  final = make_loop(2, [again]).run(toy.init_state(), data, num_steps=12)
  assert again.restored_step == 4 and again.saved_steps == [8, 12]
  assert_bitwise(final, make_loop(2).run(toy.init_state(), data, num_steps=12))


C33_FRESH = r"""
import sys, jax
sys.path.insert(0, "tests")
import test_checkpoint_edges as t, loopkit
hook = loopkit.CheckpointHook(sys.argv[1], every_steps=4)
mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
final = t.make_loop(2, [hook], step=t._big_step, mesh=mesh).run(t._big_state(), t.BIG_DATA,
                                                                 num_steps=12)
print("RESUMED", hook.restored_step, hook.saved_steps, float(final["w"][-1]))
"""


def test_c33_a_fresh_process_resumes_too(tmp_path, big_reference):
  mesh = jax_mesh1()
  ckpt = CheckpointHook(tmp_path, every_steps=4)
  with pytest.raises(Boom):
    make_loop(2, [ckpt, RaiseAfterSave(ckpt, 8)], step=_big_step, mesh=mesh).run(
        _big_state(), BIG_DATA, num_steps=12)
  out = subprocess.run(bootstrap.command("-c", C33_FRESH, tmp_path, devices=8),
                       capture_output=True, text=True, env=bootstrap.env(),
                       cwd=Path(__file__).parent.parent, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  line = [x for x in out.stdout.splitlines() if x.startswith("RESUMED")][0]
  assert line == f"RESUMED 8 [12] {float(big_reference['w'][-1])}"


def test_on_run_error_failure_is_logged_and_the_run_error_propagates(caplog):
  class BadCleanup(loopkit.Hook):
    needs_state = False

    def on_run_error(self, loop, error):
      raise RuntimeError("cleanup broke")

  seen = []

  class Seen(loopkit.Hook):
    needs_state = False

    def on_run_error(self, loop, error):
      seen.append(error)

  def fail(info, s):
    raise Boom("at 2")

  loop = make_loop(2, [BadCleanup(), Seen(), loopkit.CallbackHook(fail, at_steps=[2])])
  with pytest.raises(Boom, match="at 2"):
    loop.run(toy.init_state(), toy.batches(4), num_steps=4)
  assert len(seen) == 1 and isinstance(seen[0], Boom)  # later hooks still called
  assert "BadCleanup.on_run_error failed" in caplog.text


# -- C35: folders the hook did not write ----------------------------------------------------


def test_c35_user_folder_named_like_a_step_is_kept(tmp_path):
  """A user's folder "5" with files, max_to_keep=1: kept, not restored, not deleted."""
  user = tmp_path / "5"
  (user / "sub").mkdir(parents=True)
  (user / "notes.txt").write_text("mine")
  (user / "sub" / "data.bin").write_bytes(b"\x00\x01")
  (tmp_path / "7").mkdir()  # an empty folder, too
  before = listing(user)
  data = toy.batches(12)
  hook = CheckpointHook(tmp_path, every_steps=4, max_to_keep=1)
  with pytest.warns(CheckpointWarning, match=r"holds 5, 7: named like loopkit checkpoints"):
    final = make_loop(4, [hook]).run(toy.init_state(), data, num_steps=12)
  assert hook.restored_step is None and hook.saved_steps == [4, 8, 12]
  assert hook.all_steps() == [12]  # retention removed 4 and 8, not 5 or 7
  assert sorted(os.listdir(tmp_path)) == ["12", "5", "7", "TRAIN_COMPLETE"]
  assert listing(user) == before
  assert_bitwise(final, make_loop(4).run(toy.init_state(), data, num_steps=12))
  with warnings.catch_warnings():
    warnings.simplefilter("error", CheckpointWarning)  # once per hook
    assert hook.all_steps() == [12]
  again = CheckpointHook(tmp_path, every_steps=4, max_to_keep=1)
  with pytest.warns(CheckpointWarning, match="holds 5, 7"):
    assert again.latest_step() == 12
  assert listing(user) == before


def test_c35_old_style_complete_checkpoint_is_kept_and_its_step_not_overwritten(tmp_path):
  """A complete Orbax checkpoint as an older Orbax's atomic rename left it (no
  commit_success.txt) at step 12, next to loopkit's 4 and 8: kept byte for byte; resume from
  8; the save at 12 is skipped with a warning."""
  data = toy.batches(16)
  make_loop(4, [CheckpointHook(tmp_path, every_steps=4)]).run(toy.init_state(), data,
                                                              num_steps=8)
  old = tmp_path / "12"
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(old, {"params": toy.init_state()["params"]})
  checkpointer.wait_until_finished()
  for p in old.rglob("commit_success.txt"):
    p.unlink()
  before = listing(old)
  assert "_METADATA" in before and "_CHECKPOINT_METADATA" in before
  hook = CheckpointHook(tmp_path, every_steps=4)
  with pytest.warns(CheckpointWarning) as record:
    final = make_loop(4, [hook]).run(toy.init_state(), data, num_steps=16)
  messages = [str(w.message) for w in record]
  assert any("holds 12: named like loopkit checkpoints" in m for m in messages), messages
  assert any("not saving step 12" in m for m in messages), messages
  assert hook.restored_step == 8 and hook.saved_steps == [16]
  assert hook.all_steps() == [4, 8, 16]
  assert listing(old) == before
  assert_bitwise(final, make_loop(4).run(toy.init_state(), data, num_steps=16))


def test_c35_evidence_of_an_unfinished_save(tmp_path):
  """The rule, both sides: Orbax's tmp names and step folders holding only loopkit's items
  and Orbax's step metadata are removed; anything else is kept."""
  from etils import epath

  from loopkit.checkpoint.files import _tidy, _unfinished_write

  def make(name, files):
    p = tmp_path / name
    p.mkdir()
    for f, text in files.items():
      (p / f).parent.mkdir(parents=True, exist_ok=True)
      (p / f).write_text(text)
    return epath.Path(p)

  meta = '{"item_handlers": null, "init_timestamp_nsecs": 1, "commit_timestamp_nsecs": null}'
  cases = {
      "3.orbax-checkpoint-tmp-123": ({"state/x": ""}, True),  # atomic-rename mode
      "4": ({"_CHECKPOINT_METADATA": meta, "state/_sharding": "", "ledger/x": ""}, True),  # GCS
      "6": ({"state/ocdbt.process_0/d/x": "", "hooks/x": ""}, True),  # a retention delete cut
      "10": ({"_CHECKPOINT_METADATA": meta}, True),  # a commit-file save that just started
      "5": ({"notes.txt": "mine"}, False),  # a user's folder
      "7": ({"_CHECKPOINT_METADATA": meta, "state/x": "", "mine.txt": ""}, False),  # + user file
      "8": ({"_METADATA": "", "d/x": "", "manifest.ocdbt": ""}, False),  # another Orbax's
      "9": ({"commit_success.txt": "", "state/x": ""}, False),  # complete
      "11": ({}, False),  # empty: no evidence
      "checkpoint_5.orbax-checkpoint-tmp-1": ({"x": ""}, False),  # someone else's tmp
  }
  for name, (files, unfinished) in cases.items():
    assert _unfinished_write(make(name, files)) is unfinished, name
  messages = _tidy(epath.Path(tmp_path))
  assert len(messages) == 2 and "holds 11, 5, 7, 8:" in messages[0]
  assert "does not read: checkpoint_5.orbax-checkpoint-tmp-1 " in messages[1]
  assert sorted(os.listdir(tmp_path)) == ["11", "5", "7", "8", "9",
                                          "checkpoint_5.orbax-checkpoint-tmp-1"]


# -- C41: someone else's checkpoints ----------------------------------------------------------


def test_c41_flax_checkpoint_in_the_directory_warns_and_can_be_imported(tmp_path):
  from flax.training import checkpoints
  data = toy.batches(8)
  theirs = make_loop(4).run(toy.init_state(), data, num_steps=4)  # a state at step 4
  checkpoints.save_checkpoint(tmp_path, theirs, step=50)
  assert os.listdir(tmp_path) == ["checkpoint_50"]
  before = listing(tmp_path / "checkpoint_50")
  hook = CheckpointHook(tmp_path)
  with pytest.warns(CheckpointWarning, match=r"checkpoints loopkit does not read: "
                                            r"checkpoint_50 \(e.g. from flax.training"):
    make_loop(4, [hook]).run(toy.init_state(), data, num_steps=4)
  assert hook.restored_step is None and hook.saved_steps == [4]
  assert sorted(os.listdir(tmp_path)) == ["4", "TRAIN_COMPLETE", "checkpoint_50"]
  assert listing(tmp_path / "checkpoint_50") == before
  # The documented import: restore with flax yourself, pass the state to run.
  imported = checkpoints.restore_checkpoint(tmp_path, target=toy.init_state(), prefix="checkpoint_")
  assert int(imported["step"]) == 4
  fresh = CheckpointHook(tmp_path / "run2")
  with warnings.catch_warnings():
    warnings.simplefilter("error", CheckpointWarning)
    final = make_loop(4, [fresh]).run(imported, data[4:], num_steps=8)
  assert fresh.saved_steps == [8]
  assert_bitwise(final, make_loop(4).run(toy.init_state(), data, num_steps=8))


@pytest.mark.parametrize("names", [["ckpt-100.index", "ckpt-100.data-00000-of-00001"],
                                   ["step_ckpt_7"]])
def test_c41_other_checkpoint_names_warn(tmp_path, names):
  for n in names:
    (tmp_path / n).write_text("x")
  (tmp_path / "events.out.tfevents.1796110476.host").write_text("x")  # not a checkpoint
  (tmp_path / "config.json").write_text("{}")
  with pytest.warns(CheckpointWarning) as record:
    CheckpointHook(tmp_path).all_steps()
  assert len(record) == 1
  message = str(record[0].message)
  assert all(n in message for n in names) and "tfevents" not in message
  assert "config.json" not in message
