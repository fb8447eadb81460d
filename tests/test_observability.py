"""What a user sees (issue 18): metrics that survive a SIGKILL and a resume, once; throughput
rows from the injected clock; per-step rows under their own keys; the progress bar through a
pseudo-terminal."""

import json
import logging
import os
import re
import shutil
import subprocess
import textwrap
import time

import numpy as np
import pytest

# No 'tensorboard.compat.notf' marker (see tests/test_writers.py).
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import loopkit
from tests import bootstrap, toy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_tb(logdir):
  """{tag: [(step, value), ...]} as TensorBoard shows them (purged events hidden)."""
  acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
  acc.Reload()
  return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_jsonl(path):
  return [json.loads(line) for line in open(path)]


KILL_WORKER = textwrap.dedent("""
    import os, signal, sys
    import jax.numpy as jnp, numpy as np
    import loopkit

    workdir, kill_at = sys.argv[1], int(sys.argv[2])

    def step(state, batch):
      s = state["step"] + 1
      return ({"w": state["w"] + jnp.sum(batch["x"]), "step": s},
              {"s": s.astype(jnp.float32)})

    def kill(info, state):
      os.kill(os.getpid(), signal.SIGKILL)

    writer = loopkit.observe.create_default_writer(workdir, console=False)  # async TB + JSONL
    hooks = [loopkit.LoggingHook(writer, every_steps=5, per_step=True),
             loopkit.CheckpointHook(os.path.join(workdir, "ckpt"), every_steps=50,
                                    async_save=False)]
    if kill_at:
      hooks.append(loopkit.CallbackHook(kill, needs_state=False, at_steps=[kill_at],
                                        at_end=False))
    loop = loopkit.TrainLoop(step, iterations_per_loop=4, hooks=hooks)
    batches = [{"x": np.full((4, 1), i, np.float32)} for i in range(100)]
    loop.run({"w": jnp.zeros(()), "step": jnp.zeros((), jnp.int32)}, batches, num_steps=100)
    writer.close()
    print("done", loop.ledger.step)
""")


def test_metrics_survive_sigkill_and_a_resume_writes_each_step_once(tmp_path):
  """Rows every 5 steps (K=4), per-step rows, a checkpoint at 50, SIGKILL at 75, resume to 100.

  After the kill the files hold every row up to the checkpoint (flushed at its save); after the
  resume, every step 5, 10, ..., 100 once (averaged ``s`` = step - 2, the mean of its 5 steps)
  and every per-step value 1..100 once, in JSONL and in TensorBoard.
  """
  cmd = bootstrap.command("-c", KILL_WORKER, tmp_path, devices=1)
  first = subprocess.run(cmd + ["75"], capture_output=True, text=True, env=bootstrap.env(),
                         timeout=300)
  assert first.returncode == -9, first.stderr[-3000:]  # SIGKILL, no clean exit
  rows = read_jsonl(tmp_path / "metrics.jsonl")
  averaged = sorted(r["step"] for r in rows if "s" in r)
  per_step = sorted(r["step"] for r in rows if "per_step/s" in r)
  assert set(range(5, 51, 5)) <= set(averaged), averaged  # rows the checkpoint covers survived
  assert set(range(1, 51)) <= set(per_step), per_step
  tb = read_tb(tmp_path)
  assert {5 * i for i in range(1, 11)} <= {s for s, _ in tb["s"]}

  second = subprocess.run(cmd + ["0"], capture_output=True, text=True, env=bootstrap.env(),
                          timeout=300)
  assert second.returncode == 0, second.stderr[-3000:]
  assert second.stdout.split() == ["done", "100"]

  rows = read_jsonl(tmp_path / "metrics.jsonl")
  assert [(r["step"], r["s"]) for r in rows if "s" in r] == [
      (s, float(s - 2)) for s in range(5, 101, 5)]
  assert [(r["step"], r["per_step/s"]) for r in rows if "per_step/s" in r] == [
      (s, float(s)) for s in range(1, 101)]
  tb = read_tb(tmp_path)
  assert tb["s"] == [(s, float(s - 2)) for s in range(5, 101, 5)]
  assert tb["per_step/s"] == [(s, float(s)) for s in range(1, 101)]
  assert len([f for f in os.listdir(tmp_path) if "tfevents" in f]) == 2


def test_jsonl_writer_flushes_on_its_time_bound(tmp_path):
  clock = toy.FakeClock()
  path = tmp_path / "m.jsonl"
  w = loopkit.observe.JsonlWriter(path, flush_secs=10.0, clock=clock)
  w.write_scalars(1, {"a": 1.0})
  assert path.read_text() == ""  # buffered: the last flush is 0 s old
  clock.t = 9.9
  w.write_scalars(2, {"a": 2.0})
  assert path.read_text() == ""
  clock.t = 10.0
  w.write_scalars(3, {"a": 3.0})  # 10 s since the last flush: this write flushes
  assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
  clock.t = 15.0
  w.write_scalars(4, {"a": 4.0})
  assert len(read_jsonl(path)) == 3
  w.close()
  assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4]


def test_tensorboard_writer_flushes_on_its_time_bound(tmp_path):
  clock = toy.FakeClock()
  w = loopkit.observe.TensorBoardWriter(tmp_path, flush_secs=10.0, clock=clock)
  w.write_scalars(1, {"a": 1.0})
  assert "a" not in read_tb(tmp_path)
  clock.t = 10.0
  w.write_scalars(2, {"a": 2.0})
  assert read_tb(tmp_path)["a"] == [(1, 1.0), (2, 2.0)]
  w.close()


def test_jsonl_resume_drops_rows_at_and_after_the_first_new_step(tmp_path):
  path = tmp_path / "m.jsonl"
  path.write_text('{"hparams": {"lr": 0.1}}\n{"step": 5, "a": 1}\n{"step": 10, "a": 2}\n'
                  '{"step": 15, "a": 3}\n{"step": 2')  # a line cut short by a kill
  w = loopkit.observe.JsonlWriter(path)
  w.write_scalars(10, {"a": 20})
  w.close()
  assert path.read_text() == ('{"hparams": {"lr": 0.1}}\n{"step": 5, "a": 1}\n'
                              '{"step": 10, "a": 20}\n')
  assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_jsonl_resume_that_writes_hparams_first_still_drops_the_old_rows(tmp_path):
  path = tmp_path / "m.jsonl"
  path.write_text('{"step": 5, "a": 1}\n{"step": 10, "a": 2}\n')
  w = loopkit.observe.JsonlWriter(path)
  w.write_hparams({"lr": 0.1})
  w.write_scalars(10, {"a": 20})
  w.write_scalars(15, {"a": 30})
  w.close()
  assert read_jsonl(path) == [{"step": 5, "a": 1}, {"hparams": {"lr": 0.1}},
                              {"step": 10, "a": 20}, {"step": 15, "a": 30}]


def test_tensorboard_resume_that_writes_hparams_first_still_purges(tmp_path):
  w = loopkit.observe.TensorBoardWriter(tmp_path)
  w.write_scalars(5, {"a": 1.0})
  w.write_scalars(10, {"a": 2.0})
  w.close()
  w = loopkit.observe.TensorBoardWriter(tmp_path)  # a resumed run from step 5
  w.write_hparams({"lr": 0.1})
  w.write_scalars(10, {"a": 20.0})
  w.close()
  assert read_tb(tmp_path)["a"] == [(5, 1.0), (10, 20.0)]


def _rerun_case(workdir, num_steps):
  """A run to ``num_steps`` (rows every 5, eval every 10, checkpoints every 10) writing through
  create_default_writer into ``workdir``; returns the JSONL rows and TensorBoard's view."""
  writer = loopkit.observe.create_default_writer(workdir, console=False)
  ev = loopkit.EvalHook(loopkit.Evaluator(lambda s, b: {"w": (b["x"] @ s["params"]["w"])[:, 0]},
                                          global_batch_size=8),
                        [{"x": np.ones((8, 4), np.float32)}], writer=writer, every_steps=10)
  hooks = [loopkit.LoggingHook(writer, every_steps=5), ev,
           loopkit.CheckpointHook(os.path.join(workdir, "ckpt"), every_steps=10,
                                  async_save=False)]
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=5, hooks=hooks)
  loop.run(toy.init_state(), toy.batches(40, batch_size=8), num_steps=num_steps)
  writer.close()
  return read_jsonl(os.path.join(workdir, "metrics.jsonl")), read_tb(workdir)


def test_rerunning_a_finished_run_keeps_its_last_rows(tmp_path):
  """A run to 20, then the same command again (it restores step 20 and only evaluates): the
  rows at 20 stay (train row and eval row) and the re-run's evaluation at 20, which the file
  holds already, is not written again (each (step, name) once, the first kept, as in the
  trackers); nothing at steps < 20 moves. Before, the re-run's first write (its eval at 20)
  dropped every row at steps >= 20; then it wrote a second eval row at 20."""
  rows, tb = _rerun_case(str(tmp_path), 20)
  assert [r["step"] for r in rows if "loss" in r] == [5, 10, 15, 20]
  again, tb_again = _rerun_case(str(tmp_path), 20)
  assert again == rows
  assert [r["step"] for r in again if "eval/w" in r] == [10, 20]
  assert tb_again["loss"] == tb["loss"]


def test_a_resume_keeps_the_rows_of_its_checkpoint_step_and_rewrites_the_later_ones(tmp_path):
  """A run to 20 whose last checkpoint (20) is lost, as after a kill just before it: the resume
  from 10 keeps the rows at 5 and 10 (the eval at 10 included) and writes 15 and 20 once."""
  rows, tb = _rerun_case(str(tmp_path), 20)
  shutil.rmtree(tmp_path / "ckpt" / "20")
  again, tb_again = _rerun_case(str(tmp_path), 20)
  assert [(r["step"], r["loss"]) for r in again if "loss" in r] == [
      (r["step"], r["loss"]) for r in rows if "loss" in r]
  assert [r["step"] for r in again if "eval/w" in r] == [10, 20]
  assert tb_again["loss"] == tb["loss"]


@pytest.mark.parametrize("kind", ["jsonl", "tensorboard"])
def test_keep_rows_through_keeps_the_start_step_and_drops_what_follows(tmp_path, kind):
  """A file writer told the run starts at 10 keeps the old rows up to 10 whatever its first
  write's step (10 here: what a bare first-write rule would drop); one never told keeps only
  the rows before its first write."""
  def fresh():
    if kind == "jsonl":
      return loopkit.observe.JsonlWriter(tmp_path / "metrics.jsonl")
    return loopkit.observe.TensorBoardWriter(tmp_path)

  def steps():
    if kind == "jsonl":
      return [(r["step"], r["a"]) for r in read_jsonl(tmp_path / "metrics.jsonl") if "a" in r]
    return read_tb(tmp_path)["a"]

  w = fresh()
  for step in (5, 10, 15):
    w.write_scalars(step, {"a": float(step)})
  w.close()
  w = loopkit.observe.AsyncWriter(loopkit.observe.MultiWriter([fresh()]))  # passed through
  loopkit.observe.keep_rows_through(w, 10)
  w.write_scalars(10, {"b": 1.0})
  w.write_scalars(15, {"a": 150.0})
  w.close()
  assert steps() == [(5, 5.0), (10, 10.0), (15, 150.0)]
  w = fresh()  # not told: its first write at 15 drops the rows at >= 15
  w.write_scalars(15, {"a": 1500.0})
  w.close()
  assert steps() == [(5, 5.0), (10, 10.0), (15, 1500.0)]


@pytest.mark.parametrize("kind", ["jsonl", "tensorboard"])
def test_keep_rows_through_trims_rows_the_same_writer_wrote_in_an_earlier_run(tmp_path, kind):
  """One writer, two runs in one process (a rerun after an error that resumes from step 10):
  the rows it wrote at 15 and 20 go before its next row; before, they stayed beside the new."""
  if kind == "jsonl":
    w = loopkit.observe.JsonlWriter(tmp_path / "metrics.jsonl")
  else:
    w = loopkit.observe.TensorBoardWriter(tmp_path)
  loopkit.observe.keep_rows_through(w, 0)
  for step in (5, 10, 15, 20):
    w.write_scalars(step, {"a": float(step)})
  loopkit.observe.keep_rows_through(w, 10)  # the second run continues from 10
  w.write_scalars(15, {"a": 150.0})
  w.close()
  if kind == "jsonl":
    got = [(r["step"], r["a"]) for r in read_jsonl(tmp_path / "metrics.jsonl")]
  else:
    got = read_tb(tmp_path)["a"]
  assert got == [(5, 5.0), (10, 10.0), (15, 150.0)]


class Recorder(toy.FakeClock):
  def __init__(self):
    super().__init__()
    self.rows, self.flushes = [], 0

  def write_scalars(self, step, scalars):
    self.rows.append((step, dict(scalars)))

  def flush(self):
    self.flushes += 1


def test_logging_hook_flushes_its_writer_at_each_checkpoint_save(tmp_path):
  rec = Recorder()
  ckpt = loopkit.CheckpointHook(tmp_path / "ckpt", every_steps=4, async_save=False)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2,
                           hooks=[loopkit.LoggingHook(rec, every_steps=3), ckpt])
  loop.run(toy.init_state(), toy.batches(12), num_steps=12)
  assert ckpt.saved_steps == [4, 8, 12]
  assert rec.flushes == 3 + 1  # each save, and the end of the run


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_rows_written_before_run_raises_are_on_disk(tmp_path, error):
  """C57: create_default_writer (TensorBoard and JSONL on a background thread, console lines),
  a hook that raises at step 50: the rows at 10..40 of LoggingHook, EvalHook and GoodputHook
  are in metrics.jsonl and in the event file, read back, when the error reaches the caller."""
  import jax.numpy as jnp

  def train_step(state, batch):
    loss = jnp.mean(batch["x"])
    return {"w": state["w"] + loss, "step": state["step"] + 1}, {"loss": loss}

  def boom(info, state):
    raise error(f"stop at step {info.end_step}")

  batches = [{"x": np.full((8, 2), float(i), np.float32)} for i in range(100)]
  writer = loopkit.observe.create_default_writer(tmp_path)
  evaluator = loopkit.Evaluator(lambda state, batch: {"x": batch["x"][:, 0]})
  loop = loopkit.TrainLoop(train_step, iterations_per_loop=5, hooks=[
      loopkit.CallbackHook(boom, at_steps=[50], at_end=False, needs_state=False),
      loopkit.LoggingHook(writer, every_steps=10),
      loopkit.EvalHook(evaluator, batches[:2], writer=writer, every_steps=20, at_end=False),
      loopkit.observe.GoodputHook(writer, every_steps=20)])
  with pytest.raises(error, match="stop at step 50"):
    loop.run({"w": jnp.zeros(()), "step": jnp.zeros((), jnp.int32)}, batches, num_steps=100)
  rows = read_jsonl(tmp_path / "metrics.jsonl")
  assert [(r["step"], r["loss"]) for r in rows if "loss" in r] == [
      (10, 4.5), (20, 14.5), (30, 24.5), (40, 34.5)]
  assert [(r["step"], r["eval/x"]) for r in rows if "eval/x" in r] == [(20, 0.5), (40, 0.5)]
  assert [(r["step"], r["goodput/steps"]) for r in rows if "goodput/steps" in r] == [
      (20, 20), (40, 40)]
  tb = read_tb(tmp_path)
  assert tb["loss"] == [(10, 4.5), (20, 14.5), (30, 24.5), (40, 34.5)]
  assert tb["eval/x"] == [(20, 0.5), (40, 0.5)]
  assert tb["goodput/steps"] == [(20, 20.0), (40, 40.0)]
  writer.close()


def test_throughput_rows_follow_the_injected_clock():
  """0.5 s per step, K=2, rows every 4 steps, batch 16: 2 steps/s, 32 examples/s, 1 s per call.

  The first row's window starts after the run's first call (the compiling one).
  """
  clock, rec = toy.FakeClock(), Recorder()
  hook = loopkit.LoggingHook(rec, every_steps=4, clock=clock)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2,
                           hooks=[toy.Tick(clock, 0.5), hook])
  loop.run(toy.init_state(), toy.batches(12), num_steps=12)
  rows = dict(rec.rows)
  assert sorted(rows) == [4, 8, 12]
  for step in (4, 8, 12):
    got = {k: v for k, v in rows[step].items() if k.startswith("throughput/")}
    assert got.pop("throughput/steps_per_sec") == 2.0
    assert got.pop("throughput/examples_per_sec") == 32.0
    assert got.pop("throughput/secs_per_call") == 1.0
    # The fake clock's time is no hook's (the ledger's real clock sees microseconds).
    assert got.pop("throughput/hook_secs") < 0.05
    assert 0.95 < got.pop("throughput/loop_secs_per_call") <= 1.0
    assert 0.0 <= got.pop("throughput/goodput") <= 1.0
    # Every window's calls take about 1 s (the fake clock): each row about the median.
    assert abs(got.pop("throughput/call_secs_vs_median") - 1.0) < 0.05
    # FLOPs of the compiled step x 4 steps over the 2 calls' loop seconds (tests/test_mfu.py)
    assert got.pop("throughput/tflops_per_device") == loop.program.flops_per_step() * 4 / (
        rows[step]["throughput/loop_secs_per_call"] * 2) / 1e12
    assert got == {}  # no throughput/mfu on CPU
  assert all(not any(k.startswith("throughput/") for k in s) for _, s in hook.records)


class SleepAt(loopkit.Hook):
  """Sleeps ``secs`` (real time) when it fires; its time goes to the ``eval`` bucket."""

  needs_state = False
  time_bucket = "eval"

  def __init__(self, secs, **trigger):
    super().__init__(**trigger)
    self.secs = secs

  def on_trigger(self, info, state):
    time.sleep(self.secs)


def test_c67_the_loop_row_leaves_out_the_hooks_and_the_hooks_row_holds_them():
  """C67: a 0.3 s "evaluation" at step 8 only (after the row at 8, so in the window 8..12):
  secs_per_call jumps in that window, loop_secs_per_call (the call alone) does not, and
  hook_secs holds the 0.3 s; the three add up."""
  rec = Recorder()
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[
      loopkit.LoggingHook(rec, every_steps=4), SleepAt(0.3, at_steps=[8], at_end=False)])
  loop.run(toy.init_state(), toy.batches(16), num_steps=16)
  rows = dict(rec.rows)
  assert sorted(rows) == [4, 8, 12, 16]
  tp = {step: {k.removeprefix("throughput/"): v for k, v in row.items()
               if k.startswith("throughput/")} for step, row in rows.items()}
  for step in (4, 8, 16):  # no sleep in these windows
    assert tp[step]["hook_secs"] < 0.1, tp[step]
  assert 0.3 <= tp[12]["hook_secs"] < 0.3 + 0.1, tp[12]
  assert tp[12]["secs_per_call"] >= 0.15  # 2 calls in the window, one 0.3 s sleep
  for step in (8, 12, 16):  # the toy call alone: milliseconds, with or without the sleep
    assert tp[step]["loop_secs_per_call"] < 0.05, tp[step]
    calls = 2  # every_steps=4 at K=2
    assert tp[step]["secs_per_call"] * calls == pytest.approx(
        tp[step]["loop_secs_per_call"] * calls + tp[step]["hook_secs"], rel=1e-9, abs=1e-12)
  assert loop.ledger.seconds["eval"] >= 0.3


def test_throughput_skips_a_row_that_holds_only_the_first_call():
  clock, rec = toy.FakeClock(), Recorder()
  hook = loopkit.LoggingHook(rec, every_steps=2, clock=clock)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2,
                           hooks=[toy.Tick(clock, 0.25), hook])
  loop.run(toy.init_state(), toy.batches(6), num_steps=6)
  rows = dict(rec.rows)
  assert "throughput/steps_per_sec" not in rows[2]
  assert rows[4]["throughput/steps_per_sec"] == rows[6]["throughput/steps_per_sec"] == 4.0


def test_per_step_rows_have_their_own_keys():
  rec = Recorder()
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=3,
                           hooks=[loopkit.LoggingHook(rec, every_steps=3, per_step=True,
                                                      throughput=False)])
  loop.run(toy.init_state(), toy.batches(3), num_steps=3)
  assert [(s, sorted(r)) for s, r in rec.rows] == [
      (1, ["per_step/loss"]), (2, ["per_step/loss"]), (3, ["per_step/loss"]),
      (3, ["epoch", "examples_seen", "loss"])]
  assert rec.rows[3][1]["loss"] == pytest.approx(
      np.mean([r["per_step/loss"] for _, r in rec.rows[:3]]), rel=1e-6)



BAR_SCRIPT = textwrap.dedent("""
    import jax.numpy as jnp, numpy as np
    import loopkit

    def step(state, batch):
      loss = jnp.mean(batch["x"])
      return {"w": state["w"] + loss, "step": state["step"] + 1}, {"loss": loss}

    loop = loopkit.TrainLoop(step, iterations_per_loop=10,
                             hooks=[loopkit.ProgressHook(), loopkit.LoggingHook(every_steps=20)])
    batches = [{"x": np.full((16, 2), float(i), np.float32)} for i in range(40)]
    loop.run({"w": jnp.zeros(()), "step": jnp.zeros((), jnp.int32)}, batches, num_steps=40)
""")


def run_in_terminal(code, cols=80, timeout=120):
  """Runs ``code`` with stdout and stderr on one pseudo-terminal of ``cols`` columns.

  Returns the raw bytes written to the terminal, decoded.
  """
  import fcntl
  import pty
  import select
  import struct
  import termios
  import time
  master, slave = pty.openpty()
  fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
  env = bootstrap.env(COLUMNS=str(cols), TERM="xterm")
  proc = subprocess.Popen(bootstrap.command("-c", code, devices=1), stdin=slave, stdout=slave,
                          stderr=slave, env=env, close_fds=True)
  os.close(slave)
  out, deadline = b"", time.monotonic() + timeout
  while time.monotonic() < deadline:
    ready, _, _ = select.select([master], [], [], 1.0)
    if ready:
      try:
        chunk = os.read(master, 65536)
      except OSError:  # the child closed the terminal
        break
      if not chunk:
        break
      out += chunk
    elif proc.poll() is not None:
      break
  proc.wait(timeout=10)
  os.close(master)
  assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
  return out.decode()


def screen(raw):
  """What the terminal shows: each line with its carriage returns applied (text overwrites
  from column 0), trailing blanks removed. No cursor-movement escapes are expected."""
  assert "\x1b" not in raw, repr(raw)
  lines = []
  for line in raw.replace("\r\n", "\n").split("\n"):
    cells: list[str] = []
    for seg in line.split("\r"):
      cells[:len(seg)] = seg
    lines.append("".join(cells).rstrip())
  while lines and not lines[-1]:
    lines.pop()
  return lines


def test_progress_bar_in_a_terminal_keeps_log_lines_on_their_own_lines():
  """80 columns: 'compiling' once, each log line alone on its line, one final bar with the
  loss, one rate and a labelled ETA, no stale bar left above."""
  raw = run_in_terminal(BAR_SCRIPT)
  shown = screen(raw)
  assert shown[0] == ("step 0/40: waiting for the first batches, then compiling the first device "
                      "call"), shown
  assert shown[1] == "step 20: loss=9.5, epoch=0, examples_seen=320", shown
  assert shown[2] == "step 40: loss=29.5, epoch=0, examples_seen=640", shown
  assert re.fullmatch(r"step 40/40 \|\u2588{20}\| 100%, \d+(\.\d)? steps/s, ETA 0:00:00, "
                      r"loss=34\.5", shown[3]), shown
  assert len(shown) == 4, shown
  assert all(len(line) <= 80 for line in shown)


# Modules whose log calls still start with "loopkit: " (the default handler already prefixes
# warnings "loopkit WARNING:"); remove a module from here once its messages are fixed.
KNOWN_PREFIXED: set[str] = set()


def test_log_messages_do_not_repeat_the_loggers_name():
  import ast
  found = set()
  pkg = os.path.join(REPO, "loopkit")
  for name in sorted(os.listdir(pkg)):
    if not name.endswith(".py"):
      continue
    tree = ast.parse(open(os.path.join(pkg, name)).read())
    for node in ast.walk(tree):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr in ("debug", "info", "warning", "error", "exception")
          and node.args and isinstance(node.args[0], ast.Constant)
          and str(node.args[0].value).startswith("loopkit: ")):
        found.add(name)
  assert found == KNOWN_PREFIXED


# -- each row printed once, whatever the writer (LoggingHook, EvalHook, GoodputHook) ----------

def _toy_eval_step(state, batch):
  return {"err": (batch["x"] @ state["params"]["w"] - batch["y"])[:, 0] ** 2}  # [B]


class PrintingWriter:
  """A user's writer that prints its rows itself, and says so (``prints_to_console``)."""

  def __init__(self):
    self.lines = []

  def write_scalars(self, step, scalars):
    self.lines.append(f"step {step}: " + ", ".join(scalars))
    logging.getLogger("loopkit").info("user writer: step %d: %s", step, ", ".join(scalars))

  def prints_to_console(self):
    return True

  def flush(self):
    pass

  def close(self):
    pass


PRINTED_ROW = re.compile(r"^(?:user writer: )?step (\d+)(:| eval:)(?: (\S+))?")


def printed_once_kinds(messages):
  """{kind: sorted steps} of the rows among log messages: ``row`` (a LoggingHook row),
  ``eval`` (EvalHook's line, or a writer's row of ``eval/*`` names), ``goodput`` (a writer's
  row of ``goodput/*`` names, in one line or ConsoleWriter's table), and ``summary`` (the
  goodput table's or headline's step)."""
  out = {"row": [], "eval": [], "goodput": [], "summary": []}
  for message in messages:
    lines = message.splitlines()
    m = PRINTED_ROW.match(lines[0])
    if m is not None:
      first = m.group(3) or (lines[1].strip() if len(lines) > 1 else "")
      kind = "eval" if m.group(2) == " eval:" else next(
          (k for k in ("eval", "goodput") if first.startswith(k + "/")), "row")
      out[kind].append(int(m.group(1)))
    g = re.search(r"^goodput [0-9.]+% at step (\d+)", message, re.M)
    if g is not None:
      out["summary"].append(int(g.group(1)))
  return {k: sorted(v) for k, v in out.items()}


WRITERS = {
    "none": lambda d: None,
    "jsonl": lambda d: loopkit.observe.JsonlWriter(d / "metrics.jsonl"),
    "console": lambda d: loopkit.observe.ConsoleWriter(),
    "default": lambda d: loopkit.observe.create_default_writer(d),
    "default_no_console": lambda d: loopkit.observe.create_default_writer(d, console=False),
    "async_console_in_multi": lambda d: loopkit.observe.MultiWriter(
        [loopkit.observe.JsonlWriter(d / "metrics.jsonl"),
         loopkit.observe.AsyncWriter(loopkit.observe.ConsoleWriter())]),
    "console_below_the_level": lambda d: loopkit.observe.ConsoleWriter(level=logging.DEBUG),
    "user_printing": lambda d: PrintingWriter(),
}
# Whether the writer itself prints (then the hooks print nothing of their own).
PRINTS = {"none": False, "jsonl": False, "console": True, "default": True,
          "default_no_console": False, "async_console_in_multi": True,
          "console_below_the_level": False, "user_printing": True}


@pytest.mark.parametrize("kind", list(WRITERS))
def test_every_row_and_evaluation_is_printed_once_whatever_the_writer(tmp_path, caplog, kind):
  """NEW-A (tests/test_matrix.py): LoggingHook, EvalHook and GoodputHook all writing to one
  writer, 14 steps at K=3, rows every 4, evaluations every 7: each row (4, 8, 12, 14) and each
  evaluation (7, 14) is printed exactly once, by the writer when it prints (a ConsoleWriter,
  alone, in create_default_writer's MultiWriter or behind an AsyncWriter; a user's writer that
  says so), else by the hook; the goodput seconds once (the writer's row and the summary's
  headline, or the summary's table)."""
  writer = WRITERS[kind](tmp_path)
  assert loopkit.observe.prints_to_console(writer) is PRINTS[kind]
  ev = loopkit.EvalHook(loopkit.Evaluator(_toy_eval_step), toy.batches(2), writer=writer,
                        every_steps=7)
  hooks = [loopkit.LoggingHook(writer, every_steps=4), ev,
           loopkit.observe.GoodputHook(writer)]
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=3, hooks=hooks)
  with caplog.at_level(logging.INFO, logger="loopkit"):  # a DEBUG ConsoleWriter prints nothing
    loop.run(toy.init_state(), toy.batches(14), num_steps=14)
    if writer is not None:
      writer.close()
  shown = [r.getMessage() for r in caplog.records]
  got = printed_once_kinds(shown)
  want_goodput = [14] if PRINTS[kind] else []  # the writer's goodput/* row, printed
  assert got == {"row": [4, 8, 12, 14], "eval": [7, 14], "goodput": want_goodput,
                 "summary": [14]}, shown
  tables = [m for m in shown if m.startswith("goodput summary:\n")]
  assert len(tables) == (0 if PRINTS[kind] else 1), shown  # the seconds once
  assert [s for s, _ in ev.results] == [7, 14]
  if kind in ("console", "default", "async_console_in_multi"):
    assert shown[-1] == "goodput " + shown[-1].split("goodput ", 1)[1]  # the headline alone
    assert sum(m.startswith("step 7: eval/err=") for m in shown) == 1, shown
  if kind in ("jsonl", "default", "default_no_console", "async_console_in_multi"):
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], sorted(r)[0]) for r in rows] == [
        (4, "epoch"), (7, "eval/err"), (8, "epoch"), (12, "epoch"), (14, "epoch"),
        (14, "eval/err"), (14, "goodput/checkpoint_secs")]


# The same hooks in a user's script, with CLU's writer (its LoggingWriter logs through absl)
# or create_default_writer's, in a plain script or under absl.app.run (which turns absl's INFO
# lines on). CLU's writer modules are loaded without clu/metric_writers/__init__.py, which
# imports TensorFlow (absent from the newest-JAX environment), as tests/_matrix_worker.py does.
ONCE_SCRIPT = """\
import logging, os, sys, types
from absl import app
import jax.numpy as jnp
import loopkit
from tests import toy

def clu_writer(path):
  import clu
  pkg = types.ModuleType("clu.metric_writers")
  pkg.__path__ = [os.path.join(os.path.dirname(clu.__file__), "metric_writers")]
  sys.modules["clu.metric_writers"] = pkg
  from clu.metric_writers import async_writer, logging_writer
  return async_writer.AsyncMultiWriter([logging_writer.LoggingWriter(),
                                        loopkit.observe.JsonlWriter(path)])

def eval_step(state, batch):
  return {"err": (batch["x"] @ state["params"]["w"] - batch["y"])[:, 0] ** 2}

def main(argv=()):
  workdir = sys.argv[1]
  writer = (clu_writer(os.path.join(workdir, "metrics.jsonl")) if sys.argv[2] == "clu"
            else loopkit.observe.create_default_writer(workdir))
  print("prints_to_console before run:", loopkit.observe.prints_to_console(writer),
        file=sys.stderr, flush=True)
  hooks = [loopkit.LoggingHook(writer, every_steps=4, throughput=False),
           loopkit.EvalHook(loopkit.Evaluator(eval_step), toy.batches(2), writer=writer,
                            every_steps=7)]
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=3, hooks=hooks)
  loop.run(toy.init_state(), toy.batches(14), num_steps=14)
  writer.close()

if sys.argv[3] == "absl":
  app.run(main, argv=sys.argv[:1])
else:
  main()
"""
# loopkit's forms ("step N: ...", "step N eval: ...") and CLU's ("[N] name=value, ...").
LOOPKIT_LINE = re.compile(r"\bstep (\d+)(?::| eval:) (\S+?)=")
CLU_LINE = re.compile(r"\] \[(\d+)\] (\S+?)=")


@pytest.mark.parametrize("writer,setup,printer", [
    ("clu", "plain", "loopkit"),  # absl shows no INFO line before its flags are parsed
    ("clu", "absl", "clu"),
    ("default", "absl", "loopkit")])
def test_clu_and_default_writers_print_each_row_once_in_a_users_script(tmp_path, writer, setup,
                                                                       printer):
  """NEW-A with CLU's writer (a LoggingWriter in an AsyncMultiWriter, as CLU's
  create_default_writer makes): in a plain script absl hides INFO lines, so the hooks print the
  rows; under absl.app.run CLU's writer prints them, and the hooks do not again. Every row
  (4, 8, 12, 14) and evaluation (7, 14) once; metrics.jsonl holds each once."""
  pytest.importorskip("clu")
  pytest.importorskip("absl")
  (tmp_path / "script.py").write_text(ONCE_SCRIPT)
  out = subprocess.run(bootstrap.command(tmp_path / "script.py", str(tmp_path), writer, setup,
                                         devices=1),
                       capture_output=True, text=True, env=bootstrap.env(), cwd=REPO,
                       timeout=300)
  assert out.returncode == 0, out.stderr
  said = re.search(r"prints_to_console before run: (\w+)", out.stderr).group(1)
  assert said == str(printer == "clu" or writer == "default"), out.stderr
  pattern = CLU_LINE if printer == "clu" else LOOPKIT_LINE
  other = LOOPKIT_LINE if printer == "clu" else CLU_LINE
  shown = [(int(m.group(1)), m.group(2)) for m in map(pattern.search, out.stderr.splitlines())
           if m]
  rows = sorted(step for step, name in shown if not name.startswith("eval/")
                and name != "err")
  evals = sorted(step for step, name in shown if name.startswith("eval/") or name == "err")
  assert (rows, evals) == ([4, 8, 12, 14], [7, 14]), out.stderr
  assert not any(map(other.search, out.stderr.splitlines())), out.stderr
  disk = [(r["step"], "eval/err" in r) for r in read_jsonl(tmp_path / "metrics.jsonl")]
  assert disk == [(4, False), (7, True), (8, False), (12, False), (14, False), (14, True)]
