"""The hang and straggler watchdog (loopkit.observe.Watchdog), and step-time deviation rows.

A stuck process is met the way a job meets it: the run is in a child process that gets
stuck (a device call whose host callback sleeps, a source that blocks, a second process
that stops answering) and the test reads its exit status, its stderr and its records.
The functions the children run are in tests/watchdog_workers.py.
"""

import collections
import json
import re
import threading
import time

import pytest

import loopkit
from loopkit.observe import watchdog as watchdog_lib
from loopkit.tools import testing
from tests import toy
from tests import watchdog_workers as workers


def run_stuck(target, workdir, num_processes=1):
  """Runs ``target(workdir)`` in processes; returns their results (all ended)."""
  t0 = time.monotonic()
  with testing.ProcessGroup(target, num_processes=num_processes,
                            devices_per_process=2 if num_processes > 1 else 1,
                            args=(str(workdir),)) as group:
    results = group.wait(timeout_s=60)
  print(f"{target.__name__}: ended after {time.monotonic() - t0:.1f} s")
  return results


def records(workdir):
  with open(workdir / "watchdog.jsonl") as f:
    return [json.loads(line) for line in f]


def assert_stack_dump(stderr, *frames):
  """Every thread's stack is in ``stderr``, with ``frames`` (function names) in them."""
  assert "loopkit watchdog: every thread's stack in process" in stderr
  assert "most recent call first" in stderr and "in _watch" in stderr
  for name in frames:
    assert re.search(rf"line \d+ in {name}\b", stderr), (name, stderr[-3000:])


def test_a_device_call_that_never_returns_exits_75_with_the_phase_and_stacks(tmp_path):
  (r,) = run_stuck(workers.stuck_device_call, tmp_path)
  assert r.returncode == watchdog_lib.EXIT_CODE == 75 and not r.killed
  assert "step 6's host callback sleeps" in r.stdout
  # K=2: the call of steps 5..6 started after step 4; on CPU its dispatch runs the callback
  line = ("loopkit watchdog: process 0 of 1 stuck in phase 'device_call' after step 4: "
          r"2\.\d s, past its deadline of 2 s \(explicit\); exiting with status 75")
  assert re.search(line, r.stderr), r.stderr[-3000:]
  assert_stack_dump(r.stderr, "nap", "stuck_device_call")  # the sleeping callback, the run
  (rec,) = records(tmp_path)
  assert (rec["phase"], rec["step"], rec["deadline_secs"], rec["process"]) == (
      "device_call", 4, 2.0, 0)
  assert 2.0 < rec["elapsed_secs"] < 4.0
  # The goodput ledger of the next attempt counts the stuck time as lost (once).
  with open(tmp_path / "goodput.json") as f:
    prev = json.load(f)
  assert prev["step"] == 2  # the last boundary whose hooks ran (one call late)
  hook = loopkit.observe.GoodputHook(workdir=tmp_path, log_summary=False)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[hook])
  loop.run(toy.init_state(), toy.batches(2), num_steps=2)
  expected = float(prev["lost_secs"]) + 2 * float(prev["secs_per_step"]) + rec["elapsed_secs"]
  assert loop.ledger.seconds["lost"] == expected
  assert loop.ledger.lost_steps == 2
  with open(tmp_path / "goodput.json") as f:
    prev = json.load(f)
  assert prev["hangs_counted"] == 1
  # Starting over once more redoes 2 steps again, but the hang is not counted twice.
  again = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[
      loopkit.observe.GoodputHook(workdir=tmp_path, log_summary=False)])
  again.run(toy.init_state(), toy.batches(2), num_steps=2)
  assert again.ledger.seconds["lost"] == float(prev["lost_secs"]) + 2 * float(
      prev["secs_per_step"])
  assert again.ledger.lost_steps == 4


def test_a_source_that_blocks_exits_in_the_data_phase(tmp_path):
  (r,) = run_stuck(workers.blocking_source, tmp_path)
  assert r.returncode == 75 and not r.killed
  assert "the source blocks before batch 7" in r.stdout
  assert re.search(r"stuck in phase 'data' after step 6: 2\.\d s, past its deadline of 2 s",
                   r.stderr), r.stderr[-3000:]
  assert_stack_dump(r.stderr, "__iter__", "next_chunk")  # the source's thread, the run's
  (rec,) = records(tmp_path)
  assert (rec["phase"], rec["step"]) == ("data", 6)


def test_a_second_process_that_stops_answering_is_named_by_the_first(tmp_path):
  """Process 1 sleeps in a hook after step 6 (alive: its heartbeats go on); process 0 waits
  for its answer at the next boundary agreement and its watchdog names process 1."""
  r0, r1 = run_stuck(workers.straggler, tmp_path, num_processes=2)
  print(r0.stderr[-2500:])
  assert r0.returncode == 75 and not r0.killed
  assert "process 1 stops answering after step 6" in r1.stdout
  # K=3: the hook of step 6 runs one call late, after the call of steps 7..9 was dispatched.
  line = ("loopkit watchdog: process 0 of 2 stuck in phase 'agreement' after step 9: "
          r"2\.\d s, past its deadline of 2 s \(explicit\); not arrived at agreement \d+: "
          "process 1; exiting with status 75")
  assert re.search(line, r0.stderr), r0.stderr[-3000:]
  assert_stack_dump(r0.stderr, "agree_with_reason")
  recs = records(tmp_path)
  assert [(r["process"], r["phase"], r["step"], r["not_arrived"]) for r in recs] == [
      (0, "agreement", 9, [1])]
  # Process 1 does not outlive its coordinator: it is ended too (the job restarts whole).
  assert r1.returncode != 0


# -- in process: deadlines, arguments, overhead ------------------------------------------------


class SlowHook(loopkit.Hook):
  """A hook in ``bucket`` whose firing at step 4 waits until ``released`` is set."""

  needs_state = False

  def __init__(self, bucket, released):
    super().__init__(at_steps=[4], at_end=False)
    self.time_bucket = bucket
    self.released = released

  def on_trigger(self, info, state):
    assert self.released.wait(20), "the watchdog did not fire"


@pytest.mark.parametrize("bucket", ["checkpoint", "eval"])
def test_a_stuck_checkpoint_or_evaluation_is_named(bucket, capfd, caplog):
  """A hook's phase is its time bucket: a save or an evaluation that hangs is named as such
  (an injected ``exit`` records the status and releases the hook, so the run ends here)."""
  released, exits = threading.Event(), []

  def fake_exit(code):
    exits.append(code)
    released.set()

  w = loopkit.observe.Watchdog({bucket: 0.3}, poll_secs=0.05, exit=fake_exit)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2,
                           hooks=[SlowHook(bucket, released), w])
  loop.run(toy.init_state(), toy.batches(6), num_steps=6)
  assert exits == [75]
  rec = w.expired
  assert (rec["phase"], rec["step"], rec["deadline_secs"]) == (bucket, 4, 0.3)
  line = (f"loopkit watchdog: process 0 of 1 stuck in phase '{bucket}' after step 4: "
          r"0\.\d s, past its deadline of 0\.3 s \(explicit\); exiting with status 75")
  assert re.fullmatch(line, rec["message"]), rec["message"]
  assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [rec["message"]]
  assert_stack_dump(capfd.readouterr().err, "on_trigger")


def test_deadline_rules():
  w = loopkit.observe.Watchdog({"eval": 30.0, "hooks": None}, multiple=10.0, floor_secs=0.5,
                               min_samples=3, first_secs=100.0)
  assert w.deadline("compile") == (3600.0, "explicit")
  assert w.deadline("eval") == (30.0, "explicit")
  assert w.deadline("hooks") == (None, "explicit")
  assert w.deadline("device_call")[0] == 100.0  # no samples yet: first_secs
  for secs in (0.1, 0.3, 0.2):
    w._samples.setdefault("device_call", collections.deque()).append(secs)
  secs, how = w.deadline("device_call")
  assert secs == pytest.approx(2.0) and "10 x median 0.2 s of 3 samples" in how
  assert w.deadline("device_call", "dispatch")[0] == 100.0  # its own samples: none yet
  w._samples["device_call"].extend([0.01] * 10)  # median 0.01: 10 x 0.01 < the floor
  assert w.deadline("device_call")[0] == 0.5


@pytest.mark.parametrize("kwargs, fragment", [
    ({"deadlines": {"data": 0}}, "deadlines['data'] must be a positive number of seconds, got 0"),
    ({"multiple": -1.0}, "multiple must be a positive number of seconds, got -1.0"),
    ({"poll_secs": "1"}, "poll_secs must be a positive number of seconds, got '1'"),
    ({"min_samples": 0}, "min_samples must be an int >= 1, got 0"),
])
def test_bad_arguments_are_named(kwargs, fragment):
  with pytest.raises(ValueError, match=re.escape(fragment)):
    loopkit.observe.Watchdog(**kwargs)


def test_a_run_in_time_is_untouched_and_every_phase_is_timed():
  """A run whose phases stay within their deadlines ends normally, bitwise as without a
  watchdog; the phases it reported; the thread is gone after the run."""
  w = loopkit.observe.Watchdog({"device_call": 60.0}, poll_secs=0.01)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[w])
  state = loop.run(toy.init_state(), toy.batches(12), num_steps=12)
  plain = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2).run(
      toy.init_state(), toy.batches(12), num_steps=12)
  toy.assert_bitwise(state, plain)
  assert loop.status == "completed" and w.expired is None and w._thread is None
  counts = {k: len(v) for k, v in w._samples.items()}
  # 6 calls: 1 compiles, 5 dispatched later; 6 waits for outputs; 7 chunk reads (the last
  # finds the end); hooks: on_run_start, 6 after_each_call rounds, on_run_end.
  assert counts == {"compile": 1, "dispatch": 5, "device_call": 6, "data": 6, "hooks": 8}


def test_overhead_per_call_is_small():
  """What a run pays per device call: five phases entered and left (compile aside), and the
  watchdog's own hook calls; measured alone (a run's timing on a shared machine is noise)."""
  w = loopkit.observe.Watchdog()
  info = None
  n = 20000
  t0 = time.perf_counter()
  for _ in range(n):
    for phase in ("data", "agreement", "device_call", "device_call", "hooks"):
      w.enter_phase(phase, 0)
      w.leave_phase()
    w.after_each_call(info)
    w.on_trigger(info, None)
  per_call = (time.perf_counter() - t0) / n
  print(f"watchdog bookkeeping: {per_call * 1e6:.2f} us per device call")
  assert per_call < 20e-6


@pytest.mark.slow(held_by="tests/test_watchdog.py::test_overhead_per_call_is_small",
                  reason="times two 400-call runs several times (5 s alone, noisy under load)")
def test_overhead_of_a_run():
  got = workers.overhead(calls=400)
  per_call = got["with"] - got["without"]
  print(f"seconds per call without a watchdog {got['without'] * 1e6:.0f} us, with "
        f"{got['with'] * 1e6:.0f} us: {per_call * 1e6:+.1f} us per call")
  assert per_call < 0.2 * got["without"]


def test_step_time_deviation_in_rows():
  """A call four times slower than the others: its row says 4x the median."""
  clock, rec = toy.FakeClock(), []

  class Recorder:
    def write_scalars(self, step, scalars):
      rec.append((step, scalars))

  # seconds per step (K=1); long against the hooks' real seconds taken out of the fake clock's
  # windows (CI at 2 lanes on 2 cores: 7 ms of them made 0.5 s steps read 0.986x the median)
  slow = lambda step: 200.0 if step == 7 else 50.0
  hook = loopkit.LoggingHook(Recorder(), clock=clock)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=1,
                           hooks=[toy.Tick(clock, slow), hook])
  loop.run(toy.init_state(), toy.batches(10), num_steps=10)
  dev = {step: row.get("throughput/call_secs_vs_median") for step, row in rec}
  assert dev[1] is None  # the first call compiles: no throughput in its row
  # (the hooks' real seconds, a few hundred us, are taken out of the fake clock's windows)
  assert dev[2] == pytest.approx(1.0, rel=1e-2)
  assert dev[7] == pytest.approx(4.0, rel=1e-2)
  for step in (3, 4, 5, 6, 8, 9, 10):
    assert dev[step] == pytest.approx(1.0, rel=1e-2), (step, dev)
