"""The checkpoint directory at run start and after a failed save: a relative path, an
unwritable directory (C45), two runs into one directory (C46), a resume already past the
target (C47), and, on two processes, the lock's outcome and the failed save's removal
(issue #24 item 9).

Tests run as root here, and root writes into a ``chmod 555`` directory anyway; the
read-only cases therefore run in a subprocess started by ``setpriv`` without the
capabilities CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (so permissions bind root as they
bind any user), or plainly when not root; they are skipped only as root without setpriv.
A path under a regular file is unwritable for root too and runs in this process.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import toy
from test_checkpoint_hook import (
  Counter as Calls,  # counts device calls (after_each_call)
  _commit_file_mode,
  _fail_ledger_write_at,
)

import loopkit
from loopkit.checkpoint import CheckpointError, CheckpointHook
from loopkit.checkpoint.lock import LOCK_FILE, DirectoryLock, _start_time, stale_reason
from loopkit.tools import testing
from tests import bootstrap

ROOT = Path(__file__).parent.parent


def make_loop(k, hooks=(), **kw):
  return loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k, hooks=list(hooks),
                           **kw)


def _lock_record(**over):
  now = time.time()
  record = {"host": socket.gethostname(), "pid": os.getpid(), "since": now, "heartbeat": now,
            "start_time": _start_time(os.getpid()), "token": "t"}
  record.update(over)
  return record


# -- C45: the directory is checked before step 1 ------------------------------------------


def test_c45_relative_directory_is_resolved_at_construction(tmp_path, monkeypatch, caplog):
  monkeypatch.chdir(tmp_path)
  hook = CheckpointHook(os.path.join("runs", "a"), every_steps=2)
  assert str(hook.directory) == str(tmp_path / "runs" / "a")
  monkeypatch.chdir("/")  # a later chdir does not move it
  with caplog.at_level("INFO", logger="loopkit"):
    make_loop(2, [hook]).run(toy.init_state(), toy.batches(4), num_steps=4)
  assert hook.saved_steps == [2, 4] and sorted(os.listdir(tmp_path / "runs" / "a")) == [
      "2", "4", "TRAIN_COMPLETE"]
  assert f"checkpoints in {tmp_path / 'runs' / 'a'}" in caplog.text


def test_c45_a_path_under_a_regular_file_is_refused_before_any_step(tmp_path):
  (tmp_path / "file").write_text("")
  calls, hook = Calls(), CheckpointHook(tmp_path / "file" / "ckpt", every_steps=2)
  loop = make_loop(2, [calls, hook])
  t0 = time.monotonic()
  with pytest.raises(CheckpointError, match=r"checkpoint directory .*file/ckpt is not writable: "
                     r"NotADirectoryError: Not a directory"):
    loop.run(toy.init_state(), toy.batches(4), num_steps=4)
  assert time.monotonic() - t0 < 5 and calls.calls == 0 and loop.program.compile_count() == 0


READ_ONLY = r"""
import os, sys, time
sys.path.insert(0, "tests")
import toy, loopkit
from loopkit.checkpoint import CheckpointError, CheckpointHook
d = sys.argv[1]
def run(hooks, n):
  loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=1, hooks=hooks).run(
      toy.init_state(), toy.batches(n), num_steps=n)
assert not os.access(d, os.W_OK), "the directory is writable: the test would prove nothing"
t0 = time.monotonic()
try:
  run([CheckpointHook(d, every_steps=2)], 4)
except CheckpointError as e:
  print("AT START", round(time.monotonic() - t0, 3), e)
os.chmod(d, 0o755)
late = os.path.join(d, "late")
def lock_out(info, state):
  hook.wait_until_finished()  # step 2 committed
  os.chmod(late, 0o555)
os.mkdir(late)
hook = CheckpointHook(late, every_steps=2)
t0 = time.monotonic()
try:
  run([hook, loopkit.CallbackHook(lock_out, at_steps=[3], needs_state=False)], 8)
except CheckpointError as e:
  print("LATER", round(time.monotonic() - t0, 3), e)
os.chmod(late, 0o755)
print("LEFT", sorted(os.listdir(late)), hook.all_steps())
"""


def _without_dac_override() -> list[str]:
  """The command prefix under which file permissions bind this user (see the module doc)."""
  if os.geteuid() != 0:
    return []
  if shutil.which("setpriv") is None:
    pytest.skip("root without setpriv: a chmod 555 directory stays writable")
  caps = "-dac_override,-dac_read_search"
  return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]


def test_c45_read_only_directory_is_refused_in_seconds_and_a_later_failure_does_not_hang(
    tmp_path):
  """At start: refused, no step; made read-only during the run: the save of 4 fails at once
  (Orbax makes the step directory inside save), not after its 300 s signal time-outs."""
  d = tmp_path / "ro"
  d.mkdir()
  os.chmod(d, 0o555)
  cmd = [*_without_dac_override(), *bootstrap.command("-c", READ_ONLY, d, devices=8)]
  out = subprocess.run(cmd, capture_output=True, text=True, env=bootstrap.env(), cwd=ROOT,
                       timeout=240)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = {x.split(" ", 1)[0]: x.split(" ", 1)[1] for x in out.stdout.splitlines()}
  secs, message = lines["AT"].split(" ", 2)[1:]
  print(f"refused at start after {secs} s; later failure: {lines['LATER'][:40]}")
  assert float(secs) < 5
  assert message.startswith(f"checkpoint directory {d} is not writable: PermissionError: "
                            "Permission denied")
  secs, message = lines["LATER"].split(" ", 1)
  assert float(secs) < 60, secs  # 300+ s with Orbax's background directory creation
  assert message.startswith(f"saving step 4 to {d / 'late'} failed: PermissionError")
  assert lines["LEFT"] == "['.loopkit-lock.json', '2'] [2]"  # nothing partial; 2 the latest
  # (the lock stays in the read-only directory; stale once the process is gone)


@pytest.mark.parametrize("mode", ["atomic_rename", "commit_file"])
def test_c45_a_failed_save_removes_its_partial_directory(tmp_path, monkeypatch, mode):
  """Disk full while writing step 8 (both of Orbax's atomicity modes): the error reaches the
  user at the next boundary and the partial directory is gone right then."""
  if mode == "commit_file":
    _commit_file_mode(monkeypatch)
  hook = CheckpointHook(tmp_path, every_steps=4)
  loop = make_loop(4, [hook])
  _fail_ledger_write_at(monkeypatch, 8)
  with pytest.raises(CheckpointError, match="save of step 8 .* failed.*disk full"):
    loop.run(toy.init_state(), toy.batches(16), num_steps=16)
  assert sorted(os.listdir(tmp_path)) == ["4"]  # no 8.orbax-checkpoint-tmp, no partial 8
  monkeypatch.undo()
  assert hook.latest_step() == 4


# -- C46: two runs, one directory -----------------------------------------------------------

HOLDER = r"""
import sys, time
sys.path.insert(0, "tests")
import toy, loopkit
from loopkit.checkpoint import CheckpointHook
def hold(info, state):
  print("HOLDING", flush=True)
  time.sleep(600)
loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[
    CheckpointHook(sys.argv[1], every_steps=2),
    loopkit.CallbackHook(hold, at_steps=[2], needs_state=False)]).run(
        toy.init_state(), toy.batches(4), num_steps=4)
"""


def test_c46_a_live_run_blocks_a_second_one_and_a_killed_one_does_not(tmp_path, caplog):
  env = bootstrap.env()
  first = subprocess.Popen(bootstrap.command("-c", HOLDER, tmp_path, devices=8),
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                           cwd=ROOT)
  try:
    assert first.stdout.readline().strip() == "HOLDING"
    deadline = time.monotonic() + 60
    while not (tmp_path / "2" / "commit_success.txt").exists():
      assert time.monotonic() < deadline, os.listdir(tmp_path)
      time.sleep(0.1)
    (tmp_path / "6.orbax-checkpoint-tmp").mkdir()  # as if the first were writing step 6
    before = sorted(p.name for p in tmp_path.iterdir())
    assert CheckpointHook(tmp_path).all_steps() == [2]  # a reader removes nothing either
    calls, hook = Calls(), CheckpointHook(tmp_path, every_steps=2)
    loop = make_loop(2, [calls, hook])
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as e:
      loop.run(toy.init_state(), toy.batches(4), num_steps=4)
    took = time.monotonic() - t0
    message = str(e.value)
    assert message.startswith(f"checkpoint directory {tmp_path} is in use by another run: "
                              f"host {socket.gethostname()}, pid {first.pid}, since 20")
    assert f"holds {tmp_path / LOCK_FILE}" in message
    assert took < 5 and calls.calls == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing of the first's removed
  finally:
    first.send_signal(signal.SIGKILL)
    first.wait()
  assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == first.pid  # left behind
  again = CheckpointHook(tmp_path, every_steps=2)
  with caplog.at_level("WARNING", logger="loopkit"):
    make_loop(2, [again]).run(toy.init_state(), toy.batches(4), num_steps=4)
  assert again.restored_step == 2 and again.saved_steps == [4]
  assert f"pid {first.pid} is not alive on this host" in caplog.text
  assert sorted(os.listdir(tmp_path)) == ["2", "4", "TRAIN_COMPLETE"]  # unfinished 6 removed
  assert not (tmp_path / LOCK_FILE).exists()  # released at run end


@pytest.mark.parametrize("record, stale", [
    (dict(), "it is this process's own"),
    (dict(pid=os.getppid(), start_time=_start_time(os.getppid())), None),
    (dict(pid=os.getppid(), start_time="1"), f"pid {os.getppid()} is another process now"),
    (dict(pid=2 ** 22 + 7), f"pid {2 ** 22 + 7} is not alive"),
    (dict(host="other-host", heartbeat_age=0.0), None),
    (dict(host="other-host", heartbeat_age=400.0), "its heartbeat is 4"),
])
def test_c46_stale_locks(record, stale):
  record = dict(record)
  if "heartbeat_age" in record:  # the age, not the time: the suite may run long after collection
    record["heartbeat"] = time.time() - record.pop("heartbeat_age")
  reason = stale_reason(_lock_record(**record), stale_after_s=300)
  assert (reason is None) if stale is None else reason.startswith(stale), reason


def test_c46_another_host_blocks_until_its_heartbeat_is_stale(tmp_path):
  (tmp_path / LOCK_FILE).write_text(json.dumps(_lock_record(host="node-7", pid=12)))
  with pytest.raises(CheckpointError, match=r"in use by another run: host node-7, pid 12, since "
                     r"20\d\d-\d\d-\d\d \d\d:\d\d:\d\d UTC \(heartbeat \d+ s ago\)"):
    make_loop(2, [CheckpointHook(tmp_path)]).run(toy.init_state(), toy.batches(2), num_steps=2)
  old = time.time() - 301
  (tmp_path / LOCK_FILE).write_text(json.dumps(_lock_record(host="node-7", pid=12,
                                                            heartbeat=old)))
  hook = CheckpointHook(tmp_path)
  make_loop(2, [hook]).run(toy.init_state(), toy.batches(2), num_steps=2)
  assert hook.saved_steps == [2]


def test_c46_heartbeat_and_release(tmp_path):
  lock = DirectoryLock(loopkit.checkpoint.hook.epath.Path(tmp_path), heartbeat_s=0.05)
  assert lock.acquire() is None
  first = json.loads((tmp_path / LOCK_FILE).read_text())
  time.sleep(0.5)
  later = json.loads((tmp_path / LOCK_FILE).read_text())
  assert later["token"] == first["token"] and later["heartbeat"] > first["heartbeat"] + 0.2
  (tmp_path / LOCK_FILE).write_text(json.dumps(dict(later, token="someone else")))
  lock.release()  # not ours any more: left in place
  assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "someone else"
  assert sorted(os.listdir(tmp_path)) == [LOCK_FILE]  # no temporary files left


# -- C47: a resume already past the target --------------------------------------------------


def test_c47_resume_past_the_target_warns_with_both_numbers(tmp_path, caplog):
  make_loop(4, [CheckpointHook(tmp_path, every_steps=20)]).run(toy.init_state(),
                                                                  toy.batches(60), num_steps=60)
  hook, calls = CheckpointHook(tmp_path), Calls()
  loop = make_loop(4, [hook, calls])
  with caplog.at_level("WARNING", logger="loopkit"):
    state = loop.run(toy.init_state(), toy.batches(60), num_steps=30)
  assert "nothing to run: the state is at step 60 and num_steps is 30" in caplog.text
  assert hook.restored_step == 60 and int(state["step"]) == 60 and calls.calls == 0
  assert loop.status == "completed"


def test_c47_no_false_warning_when_the_checkpoint_is_behind(tmp_path, caplog):
  """A state passed at 8 with a checkpoint at 4 and num_steps=6: the checkpoint wins, 2 steps
  run, and nothing says 'nothing to run'."""
  loop = make_loop(2, [CheckpointHook(tmp_path, every_steps=4)])
  state8 = loop.run(toy.init_state(), toy.batches(8), num_steps=4)
  state8 = make_loop(2).run(state8, toy.batches(8), num_steps=8)
  hook = CheckpointHook(tmp_path)
  with caplog.at_level("WARNING", logger="loopkit"):
    make_loop(2, [hook]).run(state8, toy.batches(8), num_steps=6)
  assert hook.restored_step == 4 and hook.saved_steps == [6]
  assert "nothing to run" not in caplog.text


# -- two processes: one outcome for all, and item 9's removal order -----------------------


def test_two_processes_refuse_alike_and_process_0_removes_a_failed_save_last(tmp_path):
  """A live lock (this pytest process's): both processes' runs fail at start with the same
  message. A failed save's folder: process 1 gets to the removal 3 s late; process 0 removes
  it only after (it waits at Orbax's barrier)."""
  from tests import multihost_workers as workers
  locked, failed = tmp_path / "locked", tmp_path / "failed"
  locked.mkdir()
  (failed / "8.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
  (locked / LOCK_FILE).write_text(json.dumps(_lock_record()))  # os.getpid(): alive, not theirs
  p0, p1 = testing.run_processes(workers.checkpoint_directory_claims, num_processes=2,
                                 devices_per_process=4, args=(str(locked), str(failed)),
                                 timeout_s=300)
  print(f"refused after {p0['refused_s']:.2f} s / {p1['refused_s']:.2f} s; process 0 removed "
        f"{p0['removed_at'][0] - p1['arrived_at']:.3f} s after process 1 arrived")
  want = (f"process 0: checkpoint directory {locked} is in use by another run: host "
          f"{socket.gethostname()}, pid {os.getpid()}, since ")
  assert p0["error"] == p1["error"] and p0["error"].startswith(want), p0["error"]
  assert p0["refused_s"] < 30 and p1["refused_s"] < 30
  assert p1["removed_at"] == [] and len(p0["removed_at"]) == 1
  assert p0["removed_at"][0] >= p1["arrived_at"]
  assert p0["left"] == [] and os.listdir(failed) == []  # (process 1 does not wait for it)
